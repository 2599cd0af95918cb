"""The issue-28 result scripts' arithmetic, against hand computations: scripts/frontier.py (points of a run,
seeds aggregated point by point, the gold peak, gold at a √KL budget, the report) and scripts/main_job_seeds.py
(a seed's row, the table and the means over seeds)."""

import importlib.util
import json
import math

import pytest
from conftest import REPO


def load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


frontier = load("frontier")
from lab.frontier import best_gold_within  # noqa: E402  (scripts/ is on the path once frontier.py is loaded)

seeds_script = load("main_job_seeds")


def policy(gold, rm, kl, **extra):
    return {"gold_score": gold, "rm_score": rm, "kl": kl, "gold_invented": 0.5, "gold_repeated": 0.0, "eos_rate": 1.0,
            "gold_score_se": 0.02, "num_prompts": 256.0, "gold_coverage": 0.8, **extra}


def write_run(folder, evals, final):
    """A step-3 output: initial policy, eval/* records every few steps among train/* ones, final policy."""
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": 1, "train/reward": 0.1})]
    for step, (gold, rm, kl) in evals.items():
        lines.append(json.dumps({"step": step, "train/reward": 0.2}))
        lines.append(json.dumps({"step": step, **{f"eval/{k}": v for k, v in policy(gold, rm, kl).items()}}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "summary.json").write_text(json.dumps({"steps": final[0], "initial_policy": policy(0.5, -8.0, 0.0),
                                                     "final_policy": policy(*final[1:])}))


def test_frontier_points_aggregate_peak_and_budget(tmp_path):
    write_run(tmp_path / "a", {10: (0.60, -7.0, 1.0), 20: (0.62, -6.0, 4.0)}, (30, 0.55, -5.0, 9.0))
    write_run(tmp_path / "b", {10: (0.64, -7.5, 1.0), 20: (0.58, -6.5, 4.0)}, (30, 0.57, -5.5, 9.0))
    a, b = frontier.run_points(tmp_path / "a"), frontier.run_points(tmp_path / "b")
    assert [p["step"] for p in a] == [0, 10, 20, 30]  # the train/* records are not points
    assert [p["gold_score"] for p in a] == [0.5, 0.60, 0.62, 0.55]
    rows = frontier.aggregate([a, b])
    assert [r["sqrt_kl"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert rows[1]["gold_score"] == pytest.approx(0.62) and rows[2]["gold_score"] == pytest.approx(0.60)
    # standard error over the two seeds: |x1 - x2| / 2
    assert rows[1]["gold_score_se"] == pytest.approx(0.02) and rows[3]["rm_score_se"] == pytest.approx(0.25)
    top = frontier.peak(rows)
    assert (top["step"], top["gold_score"]) == (10, pytest.approx(0.62))
    # gold at √KL 1.5: halfway between the evaluations at √KL 1 (0.62) and 2 (0.60)
    assert frontier.gold_at_kl(rows, 1.5) == pytest.approx(0.61)
    assert frontier.gold_at_kl(rows, 0.5) == pytest.approx(0.56)
    assert frontier.gold_at_kl(rows, 3.5) is None  # never got that far
    assert best_gold_within(rows, 1.5) == pytest.approx(0.62)  # the evaluation at √KL 1 beats 0.61
    assert frontier.sqrt_kl(-0.01) == 0.0
    text = frontier.write_report({"PPO (n = 1)": rows}, {"machine": "test CPU", "reward_model": "step2", "steps": 30,
                                                         "kl_ctl": 0.1, "eval_interval": 10, "eval_prompts": 256,
                                                         "seeds": [1, 2], "command": "python scripts/frontier.py"},
                                 tmp_path / "frontier.md", per_seed={"PPO (n = 1)": [a, b]})
    assert "| PPO (n = 1) | 0.620 ± 0.020 | 10 | 1.00 | 0.560 ± 0.010 | 3.00 | -5.25 |" in text
    assert "| PPO (n = 1) | 1 | 0.550 | 3.00 | -5.00 | 1.00 |" in text  # each seed's final policy
    assert (tmp_path / "frontier.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="different steps"):
        frontier.aggregate([a, a[:-1]])


def test_best_gold_within_a_budget_credits_the_climb_after_an_early_kl_jump():
    """The sweep's curves: √KL jumps past the budget in the first evaluation (gold dips), then settles below it
    while gold climbs.  Gold on first reaching √KL 1.3 reads the dip; the best within the budget is the climb's
    top — by hand over the evaluations inside (0.64, 0.70, 0.74, 0.75) and the two crossings."""
    rows = [{"sqrt_kl": x, "gold_score": g} for x, g in
            ((0.0, 0.64), (1.35, 0.59), (1.2, 0.70), (1.25, 0.74), (1.28, 0.75), (1.6, 0.80))]
    assert frontier.gold_at_kl(rows, 1.3) == pytest.approx(0.64 - 0.05 * 1.3 / 1.35)
    assert best_gold_within(rows, 1.3) == pytest.approx(0.75 + (0.02 / 0.32) * 0.05)  # 1.28 -> 1.6
    # at 1.22 only 0.64 and 0.70 lie inside; crossings 0.5948 (first segment), 0.6853 (1.35 -> 1.2) and
    # 0.716 (1.2 -> 1.25: 0.70 + 0.4 x 0.04) — the last is the best
    assert best_gold_within(rows, 1.22) == pytest.approx(0.716)
    assert best_gold_within(rows[1:], 1.0) is None  # never within
    assert best_gold_within(rows, 0.0) == pytest.approx(0.64)


def write_seed(folder, sft_gold, rl_gold, oracle_gold=None, generate=90.0):
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({
        "seconds": {"step1": 160.0, "step2": 60.0, "step2_onpolicy": 200.0, "step3": 100.0},
        "stage_seconds": {"step2_onpolicy": {"generate": generate, "label": 2.0, "reward_model": 100.0}},
        "step2_final_accuracy": 0.88, "step2_onpolicy_accuracy_before": 0.66, "step2_onpolicy_accuracy": 0.75,
        "initial_policy": policy(sft_gold, -8.0, 0.0), "final_policy": policy(rl_gold, -7.0, 1.5)}))
    if oracle_gold is not None:
        (folder / "step3_oracle").mkdir()
        (folder / "step3_oracle/summary.json").write_text(json.dumps({"final_policy": policy(oracle_gold, -7.5, 2.0)}))
        (folder / "step3_oracle/args.json").write_text(json.dumps({"kl_ctl": 0.05}))


def test_main_job_table_and_means(tmp_path):
    write_seed(tmp_path / "seed1", 0.50, 0.58, 0.66)
    write_seed(tmp_path / "seed2", 0.54, 0.60, 0.64, generate=102.0)
    rows = {s: seeds_script.seed_row(tmp_path / f"seed{s}") for s in (1, 2)}
    assert rows[1]["total_seconds"] == 520.0 and rows[1]["prompts"] == 256
    agg = seeds_script.aggregate(rows)
    assert agg["gain over SFT"][0] == pytest.approx(0.07) and agg["gain over SFT"][1] == pytest.approx(0.01)
    assert agg["SFT gold spread (max - min)"][0] == pytest.approx(0.04)
    assert agg["oracle gain over SFT"][0] == pytest.approx(0.13)
    assert agg["main job minutes"][0] == pytest.approx(520 / 60)
    text = seeds_script.write_markdown({"seeds": rows, "aggregate": agg, "machine": "test CPU"}, tmp_path / "t.md")
    # the gain in its standard error: 0.08 / √(0.02² + 0.02²) = 2.8
    assert "| 1 | 0.500 ± 0.020 | 0.580 ± 0.020 | +0.080 (+2.8) | 0.660 ± 0.020 | 0.500 → 0.500 |" in text
    assert "| gain over SFT | 0.070 ± 0.010 |" in text
    assert "| seeds gaining more than their se | 2.000 ± 0.000 |" in text
    assert "| minutes, step2_onpolicy | 3.333 ± 0.000 |" in text
    # a round's parts, each over the seeds: generation (90 and 102 s) = 1.6 ± 0.1 min
    assert "| minutes, step2_onpolicy / generate | 1.600 ± 0.100 |" in text
    assert "| minutes, step2_onpolicy / reward_model | 1.667 ± 0.000 |" in text
    assert "0.660 → 0.750 | — |" in text  # no second round in these runs
    summary = json.loads((tmp_path / "seed2/summary.json").read_text())
    summary.update(step2_onpolicy_round2_accuracy_before=0.7, step2_onpolicy_round2_accuracy=0.8)
    (tmp_path / "seed2/summary.json").write_text(json.dumps(summary))
    rows[2] = seeds_script.seed_row(tmp_path / "seed2")
    text = seeds_script.write_markdown({"seeds": rows, "aggregate": agg, "machine": "test CPU"}, tmp_path / "t.md")
    assert "0.660 → 0.750 | 0.700 → 0.800 |" in text
    assert "| 0.880 | 0.660 → 0.750 |" in text  # step 2's synthetic accuracy; the final model's not reported
    for seed in (1, 2):  # runs that evaluate step 3's reward model on the synthetic pairs too
        summary = json.loads((tmp_path / f"seed{seed}/summary.json").read_text())
        summary["final_reward_model_synthetic_accuracy"] = 0.80 + seed / 100
        (tmp_path / f"seed{seed}/summary.json").write_text(json.dumps(summary))
        rows[seed] = seeds_script.seed_row(tmp_path / f"seed{seed}")
    agg = seeds_script.aggregate(rows)
    assert agg["RM accuracy on synthetic pairs, final"][0] == pytest.approx(0.815)
    text = seeds_script.write_markdown({"seeds": rows, "aggregate": agg, "machine": "test CPU"}, tmp_path / "t.md")
    assert "| 0.880 → 0.810 | 0.660 → 0.750 |" in text
    assert "Seed 1:" not in text  # no run reused another's stages
    summary = json.loads((tmp_path / "seed1/summary.json").read_text())
    summary["composed_from"] = "steps 1-2 are another run's"
    (tmp_path / "seed1/summary.json").write_text(json.dumps(summary))
    rows[1] = seeds_script.seed_row(tmp_path / "seed1")
    text = seeds_script.write_markdown({"seeds": rows, "aggregate": agg, "machine": "test CPU"}, tmp_path / "t.md")
    assert "Seed 1: steps 1-2 are another run's." in text and "Seed 2:" not in text
    assert "`marlhf quickstart` with `--seed S`" in text
    # a lever of the main job measured at the same seeds names its flags in the first line
    text = seeds_script.write_markdown({"seeds": rows, "aggregate": agg, "machine": "test CPU",
                                        "quickstart_args": "--onpolicy_max_prompts 800"}, tmp_path / "t.md")
    assert "`marlhf quickstart --onpolicy_max_prompts 800` with `--seed S`" in text
    # the numbers behind the table beside it, from the same report (a stale JSON once sat next to a newer table)
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["aggregate"]["gain over SFT"] == pytest.approx(list(agg["gain over SFT"]))
    assert saved["seeds"]["1"]["total_seconds"] == 520.0
    assert math.isnan(seeds_script.mean_se([1.0])[1])
    assert rows[1]["oracle_kl_ctl"] == 0.05
    # the oracle's beta: the main job's times the gold score's spread over the reward model's (ratio of the SEs)
    summary = json.loads((tmp_path / "seed1/summary.json").read_text())
    summary["initial_policy"].update(gold_score_se=0.02, rm_score_se=0.25)
    (tmp_path / "seed1/summary.json").write_text(json.dumps(summary))
    assert seeds_script.oracle_kl_ctl(tmp_path / "seed1", 0.5) == pytest.approx(0.04)
