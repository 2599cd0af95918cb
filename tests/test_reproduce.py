"""The reproduction benchmark: reading runs, seed statistics, steps-to-parity, the report — against hand-made
runs and hand computations — and ``scripts/reproduce.py --quick`` end to end, its report checked against the
run logs it was built from."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lab import sweep
from lab.results_report import claims, equal_kl_claims, frontier_table, summary_table, write_report

REPO = Path(__file__).resolve().parents[1]
T975_DF2 = 4.302652729911275  # Student-t 97.5% quantile, 2 degrees of freedom (tables)
T975_DF1 = 12.706204736174696  # and 1 degree of freedom


def fake_run(out: Path, steps: int, curve: dict[int, float], rm: float, seed_kl: float,
             step_seconds: float | None = None, held_out_kl: dict[int, float] | None = None,
             cpu: str | None = None) -> None:
    """A finished step-3 run folder as step 3 writes it: gold_score curve at the given steps (and each step's
    wall time, ``step_seconds`` x the step's number, when given; the held-out KL at the same steps, when given;
    the machine the summary names, when ``cpu`` is given)."""
    out.mkdir(parents=True)
    kl = (lambda s: {"kl": held_out_kl[s]}) if held_out_kl else (lambda s: {})
    final = {"gold_score": curve[steps], "rm_score": rm, "response_len": 40.0, "eos_rate": 1.0, **kl(steps)}
    (out / "summary.json").write_text(json.dumps({"steps": steps, "initial_policy": {
        "gold_score": curve[0], "rm_score": 0.0, "response_len": 45.0, "eos_rate": 1.0, **kl(0)},
        "final_policy": final, **({} if cpu is None else {"machine": {"cpu": cpu, "cores": 2, "gpu": "none"}})}))
    rows = [{"step": s, "train/kl": seed_kl * s, "train/reward": 0.1,
             **({} if step_seconds is None else {"train/step_seconds": step_seconds * s})}
            for s in range(1, steps + 1)]
    rows += [{"step": s, "eval/gold_score": v, "eval/rm_score": 0.5, **{f"eval/{k}": x for k, x in kl(s).items()}}
             for s, v in curve.items() if 0 < s < steps]
    (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


@pytest.fixture
def runs(tmp_path):
    # PPO reaches 0.5 at step 8 (mean over seeds); n5 gets there at step 4 -> parity 4/8 = 0.5
    ppo = {1: {0: 0.1, 4: 0.2, 8: 0.50}, 2: {0: 0.1, 4: 0.3, 8: 0.40}, 3: {0: 0.1, 4: 0.25, 8: 0.60}}
    n5 = {1: {0: 0.1, 4: 0.55, 8: 0.7}, 2: {0: 0.1, 4: 0.45, 8: 0.6}, 3: {0: 0.1, 4: 0.5, 8: 0.8}}
    for variant, curves in (("ppo", ppo), ("n5", n5)):
        for seed, curve in curves.items():
            fake_run(tmp_path / "gold" / variant / f"seed{seed}", 8, curve, rm=seed / 10, seed_kl=0.01 * seed)
    return tmp_path, ppo, n5


def test_read_run_curve_holds_initial_eval_rows_and_final(runs):
    root, ppo, _ = runs
    run = sweep.read_run(root / "gold" / "ppo" / "seed1")
    assert run["steps"] == 8
    assert {s: v["gold_score"] for s, v in run["curve"].items()} == ppo[1]
    assert run["train_kl"][8] == pytest.approx(0.08)


def test_seed_statistics_and_parity_against_hand_computation(runs):
    root, ppo, n5 = runs
    res = sweep.collect(sweep.plan(root, ["gold"], ["ppo", "n5"], [1, 2, 3]))["gold"]
    finals = [n5[s][8] for s in (1, 2, 3)]
    mean = sum(finals) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in finals) / 2)
    m, half = res["n5"].final("gold_score")
    assert m == pytest.approx(mean) and half == pytest.approx(T975_DF2 * sd / math.sqrt(3))
    # PPO's final mean 0.5; n5's seed-mean curve: step 0 0.1, step 4 0.5 -> reached at 4 of PPO's 8 steps
    assert sweep.steps_to_parity(res["n5"], res["ppo"], "gold_score") == pytest.approx(0.5)
    assert sweep.steps_to_parity(res["ppo"], res["ppo"], "gold_score") == pytest.approx(1.0)
    # the training KL curve (no held-out KL logged) is kept for every step
    assert res["ppo"].curves["train_kl"][8] == pytest.approx([0.08, 0.16, 0.24])


def test_parity_never_reached_is_none(runs):
    root, _, _ = runs
    res = sweep.collect(sweep.plan(root, ["gold"], ["ppo", "n5"], [1, 2, 3]))["gold"]
    assert sweep.steps_to_parity(res["ppo"], res["n5"], "gold_score") is None  # PPO never reaches n5's 0.7


def exact_parity_distribution(variant: dict, base: dict, steps: int) -> dict[float, float]:
    """Steps-to-parity over every equally likely bootstrap resample of the seeds (each seed list drawn with
    replacement, all n^n orderings of the variant's times all m^m of the baseline's): value -> probability, by a
    plain loop over the curves as written (inf: never reached)."""
    seeds, base_seeds = sorted(variant), sorted(base)
    dist: dict[float, float] = {}
    for rows in itertools.product(seeds, repeat=len(seeds)):
        for base_rows in itertools.product(base_seeds, repeat=len(base_seeds)):
            target = sum(base[s][steps] for s in base_rows) / len(base_rows)
            value = math.inf
            for step in sorted(variant[seeds[0]]):
                if sum(variant[s][step] for s in rows) / len(rows) >= target:
                    value = step / steps
                    break
            dist[value] = dist.get(value, 0.0) + 1.0 / (len(seeds) ** len(seeds) * len(base_seeds) ** len(base_seeds))
    return dist


def test_parity_bootstrap_against_exact_enumeration(runs):
    """The bootstrap's draws follow the exact resampling distribution (every resample enumerated): each value's
    share within 4.5 binomial standard errors, and the 95% interval's ends are that distribution's quantiles."""
    root, ppo, n5 = runs
    res = sweep.collect(sweep.plan(root, ["gold"], ["ppo", "n5"], [1, 2, 3]))["gold"]
    for variant, base, a, b in ((res["n5"], res["ppo"], n5, ppo), (res["ppo"], res["n5"], ppo, n5)):
        exact = exact_parity_distribution(a, b, 8)
        draws = 20000
        sample = sweep.parity_draws(variant, base, "gold_score", draws=draws, seed=3)
        assert set(sample) <= set(exact)
        for value, prob in exact.items():
            share = sample.count(value) / draws
            assert abs(share - prob) <= 4.5 * math.sqrt(prob * (1 - prob) / draws) + 1e-12, (value, share, prob)
        lo, hi = sweep.parity_interval(variant, base, "gold_score", draws=draws, seed=3)
        for end, q in ((lo, 0.025), (hi, 0.975)):  # P(X < end) <= q <= P(X <= end), up to the draws' noise
            end = math.inf if end is None else end
            assert sum(p for v, p in exact.items() if v < end) <= q + 0.01
            assert sum(p for v, p in exact.items() if v <= end) >= q - 0.01
    # n5 reaches PPO's mean at step 4 unless the resample is far off; PPO reaching n5's 0.7 is rare
    assert sweep.parity_interval(res["n5"], res["ppo"], "gold_score")[0] == pytest.approx(0.5)
    assert sweep.parity_interval(res["ppo"], res["n5"], "gold_score")[1] is None


def test_time_to_parity_counts_each_variants_own_step_seconds(tmp_path):
    """n5 reaches PPO's final mean at step 4 (half of PPO's steps), but its steps take 2.5 times
    PPO's: in time it needs 25 s against PPO's 36 s for the whole run.  Runs without step times: nan."""
    ppo = {1: {0: 0.1, 4: 0.2, 8: 0.50}, 2: {0: 0.1, 4: 0.3, 8: 0.40}}
    n5 = {1: {0: 0.1, 4: 0.55, 8: 0.7}, 2: {0: 0.1, 4: 0.45, 8: 0.6}}
    for variant, curves, secs in (("ppo", ppo, 1.0), ("n5", n5, 2.5)):
        for seed, curve in curves.items():
            fake_run(tmp_path / "gold" / variant / f"seed{seed}", 8, curve, rm=0.0, seed_kl=0.01,
                     step_seconds=secs)
    res = sweep.collect(sweep.plan(tmp_path, ["gold"], ["ppo", "n5"], [1, 2]))["gold"]
    # fake_run's step s records step_seconds x s: n5's steps 1..4 take 2.5 x (1+2+3+4) = 25 s; PPO's 1..8 36 s
    assert res["n5"].elapsed[4] == pytest.approx([25.0, 25.0]) and res["ppo"].elapsed[8] == pytest.approx([36.0] * 2)
    assert sweep.steps_to_parity(res["n5"], res["ppo"], "gold_score") == pytest.approx(0.5)
    assert sweep.time_to_parity(res["n5"], res["ppo"], "gold_score") == pytest.approx(25 / 36)
    assert sweep.time_to_parity(res["ppo"], res["n5"], "gold_score") is None
    table = {r["variant"]: r for r in summary_table(res, "gold")}
    assert table["n5"]["time_parity_gold_score"] == pytest.approx(25 / 36)
    (tmp_path / "gold" / "n5" / "seed2" / "metrics.jsonl").write_text(json.dumps({"step": 4, "eval/gold_score": 0.45}))
    res = sweep.collect(sweep.plan(tmp_path, ["gold"], ["ppo", "n5"], [1, 2]))["gold"]
    assert res["n5"].elapsed is None and math.isnan(sweep.time_to_parity(res["n5"], res["ppo"], "gold_score"))


def test_wall_clock_parity_only_between_runs_on_one_kind_of_cpu(tmp_path):
    """Seconds from two CPUs do not compare: n5 on a machine twice as fast would look twice as quick.  Runs that
    all name one CPU (or, records of older builds, none) are compared; any other mix gives nan, and the report
    says why instead of a number."""
    ppo = {1: {0: 0.1, 4: 0.2, 8: 0.50}, 2: {0: 0.1, 4: 0.3, 8: 0.40}}
    n5 = {1: {0: 0.1, 4: 0.55, 8: 0.7}, 2: {0: 0.1, 4: 0.45, 8: 0.6}}

    def results(cpus: dict[str, list[str | None]], root: Path) -> dict:
        for variant, curves in (("ppo", ppo), ("n5", n5)):
            for (seed, curve), cpu in zip(curves.items(), cpus[variant]):
                fake_run(root / "gold" / variant / f"seed{seed}", 8, curve, rm=0.0, seed_kl=0.01, step_seconds=1.0,
                         cpu=cpu)
        return sweep.collect(sweep.plan(root, ["gold"], ["ppo", "n5"], [1, 2]))["gold"]

    xeon, epyc = "Intel(R) Xeon(R) Processor", "AMD EPYC 7B13"
    same = results({"ppo": [xeon, xeon], "n5": [xeon, xeon]}, tmp_path / "same")
    assert same["n5"].cpus == (xeon, xeon) and sweep.timing_mismatch(same["n5"], same["ppo"]) is None
    assert sweep.time_to_parity(same["n5"], same["ppo"], "gold_score") == pytest.approx(10 / 36)
    for name, cpus in (("mixed", {"ppo": [epyc, epyc], "n5": [xeon, xeon]}),
                       ("within", {"ppo": [xeon, xeon], "n5": [xeon, epyc]}),
                       ("unrecorded", {"ppo": [None, None], "n5": [xeon, xeon]})):
        res = results(cpus, tmp_path / name)
        why = sweep.timing_mismatch(res["n5"], res["ppo"])
        named = sorted(c or "not recorded" for c in {*cpus["ppo"], *cpus["n5"]})
        assert why == f"the runs ran on different CPUs ({'; '.join(named)})", name
        assert math.isnan(sweep.time_to_parity(res["n5"], res["ppo"], "gold_score")), name
        assert sweep.steps_to_parity(res["n5"], res["ppo"], "gold_score") == pytest.approx(0.5)  # steps still do
        row = {r["variant"]: r for r in summary_table(res, "gold")}["n5"]
        assert row["time_parity_note_gold_score"] == why
        text = "\n".join(claims({"gold": summary_table(res, "gold")}))
        assert f"wall-clock time not compared: {why}" in text and "in wall-clock time at" not in text


def test_claims_cover_every_macro_action_variant_and_no_critic_free_baseline(tmp_path):
    """The speed / final-score claims are the paper's, MA-PPO's against PPO: one line per variant with a critic
    (lowprob, named unlike the n-gram and rule variants, was once left out), none for RLOO / GRPO / MC values."""
    curve = {0: 0.1, 4: 0.3, 8: 0.5}
    names = ["ppo", "n5", "lowprob", "ppl", "n5_sigma_unit", "grpo", "rloo", "mc_macro"]
    for name in names:
        fake_run(tmp_path / "gold" / name / "seed1", 8, curve, rm=0.0, seed_kl=0.01)
    res = sweep.collect(sweep.plan(tmp_path, ["gold"], names, [1]))
    text = "\n".join(claims({"gold": summary_table(res["gold"], "gold")}))
    for name in names[1:]:
        line = f"**gold reward, {sweep.VARIANTS[name].label}**"
        assert (line in text) == sweep.VARIANTS[name].critic, name


def test_unfinished_runs_are_missing_not_averaged(runs):
    root, _, _ = runs
    (root / "gold" / "n5" / "seed3" / "summary.json").unlink()
    specs = sweep.plan(root, ["gold"], ["ppo", "n5"], [1, 2, 3])
    assert [(s.variant, s.seed) for s in sweep.missing(specs)] == [("n5", 3)]
    assert sweep.collect(specs)["gold"]["n5"].seeds == [1, 2]


def test_report_table_equals_the_runs(runs, tmp_path):
    root, ppo, n5 = runs
    specs = sweep.plan(root, ["gold"], ["ppo", "n5"], [1, 2, 3])
    results = sweep.collect(specs)
    report = write_report(tmp_path / "docs" / "results.md", results,
                          settings={"seeds": [1, 2, 3], "steps": 8, "eval_interval": 4, "eval_samples": 8,
                                    "rewards": ["gold"]}, commands=["cmd"], missing=[], unavailable={},
                          invocation="test")
    text = report.read_text()
    assert (tmp_path / "docs" / "results" / "curves_gold.png").stat().st_size > 1000
    table = {r["variant"]: r for r in summary_table(results["gold"], "gold")}
    assert table["n5"]["gold_score"]["per_seed"] == [n5[s][8] for s in (1, 2, 3)]
    row = next(line for line in text.splitlines() if line.startswith("| MA-PPO n = 5 |"))
    gold_cell = row.split("|")[4].strip()
    assert gold_cell == f"{table['n5']['gold_score']['mean']:.3f} ± {table['n5']['gold_score']['ci95']:.3f}"
    parity, time_parity = row.split("|")[-3].strip(), row.split("|")[-2].strip()
    lo, hi = sweep.parity_interval(results["gold"]["n5"], results["gold"]["ppo"], "gold_score")
    assert parity == f"0.50 [{lo:.2f}, {'never' if hi is None else f'{hi:.2f}'}]" and time_parity == "–"
    assert "reached PPO's final gold_score at 0.50 of PPO's steps — faster as claimed" in text
    saved = json.loads((tmp_path / "docs" / "results" / "results.json").read_text())
    assert saved["tables"]["gold"][1]["gold_score"]["per_seed"] == [n5[s][8] for s in (1, 2, 3)]


def test_reward_at_equal_kl_interpolates_each_seed_at_the_budget_every_seed_reached(tmp_path):
    """The frontier section: the budget is the largest √KL every seed of every variant reached (here n5 seed 1's
    final √1.96 = 1.4); each seed's gold there is read off its own curve by linear interpolation in √KL,
    by hand below, and the report's cell is their mean ± the Student-t half-width."""
    gold = {"ppo": {1: {0: 0.1, 4: 0.3, 8: 0.5}, 2: {0: 0.1, 4: 0.2, 8: 0.6}},
            "n5": {1: {0: 0.1, 4: 0.5, 8: 0.7}, 2: {0: 0.1, 4: 0.6, 8: 0.65}}}
    kl = {"ppo": {1: {0: 0.0, 4: 1.0, 8: 4.0}, 2: {0: 0.0, 4: 0.25, 8: 2.25}},
          "n5": {1: {0: 0.0, 4: 0.64, 8: 1.96}, 2: {0: 0.0, 4: 1.44, 8: 3.24}}}
    for variant in gold:
        for seed in (1, 2):
            fake_run(tmp_path / "runs" / "gold" / variant / f"seed{seed}", 8, gold[variant][seed], rm=0.0,
                     seed_kl=0.01, held_out_kl=kl[variant][seed])
    results = sweep.collect(sweep.plan(tmp_path / "runs", ["gold"], ["ppo", "n5"], [1, 2]))
    report = write_report(tmp_path / "docs" / "results.md", results,
                          settings={"seeds": [1, 2], "steps": 8, "eval_interval": 4, "eval_samples": 8,
                                    "rewards": ["gold"]}, commands=["cmd"], missing=[], unavailable={},
                          invocation="test")
    # √KL segments around 1.4: ppo 1: 1 -> 2 (0.3 -> 0.5), ppo 2: 0.5 -> 1.5 (0.2 -> 0.6),
    # n5 1: its final point, n5 2: 1.2 -> 1.8 (0.6 -> 0.65)
    hand = {"ppo": [0.3 + 0.4 * 0.2, 0.2 + 0.9 * 0.4], "n5": [0.7, 0.6 + (0.2 / 0.6) * 0.05]}
    saved = json.loads((tmp_path / "docs" / "results" / "results.json").read_text())["frontier"]["gold"]
    assert saved["ppo"]["budget"] == pytest.approx(1.4)
    text = report.read_text()
    assert "| variant | best gold, √KL ≤ 1.40 | gold on first reaching √KL 1.40 |" in text
    assert (tmp_path / "docs" / "results" / "frontier_gold.png").stat().st_size > 1000
    for variant, label in (("ppo", "PPO (n = 1)"), ("n5", "MA-PPO n = 5")):
        # every curve here rises with √KL, so the best within the budget is where it first reaches it
        at, first = saved[variant]["gold_at_budget"], saved[variant]["gold_first_at_budget"]
        assert at["per_seed"] == pytest.approx(hand[variant]) == first["per_seed"]
        mean = sum(hand[variant]) / 2
        half = T975_DF1 * abs(hand[variant][0] - hand[variant][1]) / 2  # sd / √2 = |a - b| / 2 for two seeds
        assert (at["mean"], at["ci95"]) == (pytest.approx(mean), pytest.approx(half))
        # the mean curve: √KL and gold averaged over seeds at each evaluation; the final row closes the table
        last = saved[variant]["rows"][-1]
        assert last["sqrt_kl"] == pytest.approx(sum(math.sqrt(kl[variant][s][8]) for s in (1, 2)) / 2)
        row = next(line for line in text.splitlines() if line.startswith(f"| {label} | {mean:.3f}"))
        assert row.split("|")[2].strip() == row.split("|")[3].strip() == f"{mean:.3f} ± {half:.3f}"
        assert row.split("|")[-2].strip() == f"{last['sqrt_kl']:.2f}"
    # n5 0.658 ± 0.537 against PPO 0.470 ± 1.143 (two seeds): the intervals overlap, no claim either way
    n5, ppo = (saved[v]["gold_at_budget"] for v in ("n5", "ppo"))
    assert (f"- **gold reward, MA-PPO n = 5 at equal KL** (best gold within √KL 1.40): {n5['mean']:.3f} ± "
            f"{n5['ci95']:.3f} vs "
            f"PPO {ppo['mean']:.3f} ± {ppo['ci95']:.3f} — within the intervals.") in text
    # a seed that never left the SFT policy: no common divergence, so no cell and no claim
    kl_curve = results["gold"]["ppo"].curves["kl"]
    results["gold"]["ppo"].curves["kl"] = {s: [0.0, v[1]] for s, v in kl_curve.items()}
    table = frontier_table(results["gold"])
    assert table["ppo"]["budget"] == 0 and table["n5"]["gold_at_budget"] is None
    assert equal_kl_claims({"gold": table}) == []


def test_parity_is_undefined_when_ppo_did_not_improve(tmp_path):
    """A PPO that ends below its start would make every variant 'reach parity' at step 0: the report must say
    the speed claim was not tested instead of calling it reproduced."""
    for variant, final in (("ppo", 0.05), ("n5", 0.2)):
        for seed in (1, 2):
            fake_run(tmp_path / "gold" / variant / f"seed{seed}", 8, {0: 0.1, 4: 0.08, 8: final + seed / 100},
                     rm=0.0, seed_kl=0.01)
    results = sweep.collect(sweep.plan(tmp_path, ["gold"], ["ppo", "n5"], [1, 2]))
    table = {r["variant"]: r for r in summary_table(results["gold"], "gold")}
    assert table["n5"]["parity_gold_score"] == "n/a" and table["n5"]["start_gold_score"] == pytest.approx(0.1)
    text = write_report(tmp_path / "r.md", results, settings={"seeds": [1, 2], "steps": 8, "eval_interval": 4,
                                                             "eval_samples": 8, "rewards": ["gold"]},
                        commands=[], missing=[], unavailable={}, invocation="test").read_text()
    assert "PPO did not improve the held-out gold_score" in text and "faster as claimed" not in text


def test_tune_grid_is_every_combination_and_choose_takes_the_best_mean():
    grid = sweep.parse_grid("actor_learning_rate=1e-5,3e-5 --kl_ctl=0.02,0.1")
    assert grid == [{"actor_learning_rate": "1e-5", "kl_ctl": "0.02"}, {"actor_learning_rate": "1e-5", "kl_ctl": "0.1"},
                    {"actor_learning_rate": "3e-5", "kl_ctl": "0.02"}, {"actor_learning_rate": "3e-5", "kl_ctl": "0.1"}]
    assert sweep.parse_grid("") == [{}] and sweep.point_label(grid[1]) == "actor_learning_rate=1e-5,kl_ctl=0.1"
    assert sweep.point_flags(grid[1]) == ["--actor_learning_rate", "1e-5", "--kl_ctl", "0.1"]
    with pytest.raises(ValueError, match="FLAG=V1,V2"):
        sweep.parse_grid("actor_learning_rate")
    assert sweep.choose({"a": [0.5, 0.7], "b": [0.65, 0.6], "c": [0.1]}) == "b"  # means 0.60, 0.625, 0.1
    assert sweep.choose({"a": [0.5], "b": [0.5]}) == "a"  # a tie: the first written


def test_the_full_sweeps_defaults_have_the_power_issue_30_asks_for():
    from reproduce import parse_args

    args = parse_args([])
    assert len(args.seeds) >= 5 and args.steps >= 100 and args.eval_samples >= 512  # 256 test prompts when halved
    assert {"ppo", "n5", "n10", "parsing", "ppl", "lowprob", "grpo", "rloo"} <= set(args.variants)
    # Monte-Carlo macro values run once, in their cheaper setting (what step 3 receives: the launch test below)
    mc = [v for v in args.variants if "mc_macro" in sweep.VARIANTS[v].flags]
    assert mc == ["mc_macro_n10_k2"]
    for grid in args.grids.values():
        assert {k for pt in grid for k in pt} == {"actor_learning_rate", "kl_ctl", "lam"} and len(grid) == 8
    assert not set(args.tune_seeds) & set(args.seeds) and not parse_args(["--quick"]).tuned


def test_the_gold_rewards_grid_is_the_reward_models_with_beta_scaled_to_the_gold_scores_spread(tmp_path):
    """The same points but for β, which is the reward model's × 0.05 (the ratio of the two scores' standard errors
    on the SFT policy's held-out answers); a --tune_grid given alone is every reward's; tuning one reward of a
    sweep and not the other is refused."""
    from reproduce import parse_args

    grids = parse_args([]).grids
    assert len(grids["gold"]) == len(grids["rm"]) == 8
    for gold, rm in zip(grids["gold"], grids["rm"]):
        assert {k: v for k, v in gold.items() if k != "kl_ctl"} == {k: v for k, v in rm.items() if k != "kl_ctl"}
        assert float(gold["kl_ctl"]) == pytest.approx(0.05 * float(rm["kl_ctl"]))
    same = parse_args(["--tune_grid", "kl_ctl=0.1,0.2"]).grids
    assert same["gold"] == same["rm"] == [{"kl_ctl": "0.1"}, {"kl_ctl": "0.2"}]
    assert parse_args(["--tune_grid", "kl_ctl=0.1", "--tune_grid_gold", "kl_ctl=0.01"]).grids["gold"] == [
        {"kl_ctl": "0.01"}]
    assert not parse_args(["--tune_grid", ""]).tuned
    proc = subprocess.run([sys.executable, "scripts/reproduce.py", "--dry_run", "--tune_grid_gold", ""], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "tune every reward" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "scripts/reproduce.py", "--dry_run", "--tune_grid_gold", "kl=1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--tune_grid_gold: step 3 has no flag --kl" in proc.stderr, proc.stderr
    from reproduce import tuning_plan  # each reward's runs at its own grid's points, a shared point once for both

    tune = tuning_plan(tmp_path, {"gold": sweep.parse_grid("kl_ctl=0.01,0.1"), "rm": sweep.parse_grid("kl_ctl=0.1,1")},
                       ["ppo"], [101])
    assert {label: [(s.reward, s.out) for s in specs] for (_, label), (_, specs) in tune.items()} == {
        f"kl_ctl={kl}": [(r, tmp_path / "tune" / f"kl_ctl={kl}" / r / "ppo" / "seed101") for r in rewards]
        for kl, rewards in (("0.01", ["gold"]), ("0.1", ["gold", "rm"]), ("1", ["rm"]))}


def test_the_full_sweep_starts_from_the_main_jobs_reward_model(tmp_path):
    """Its base is the main job's steps 1-2, step 2 ending with the reward model trained on the SFT policy's
    answers (one round), and that model is every run's reward; ``--quick`` skips the round and uses step 2's;
    given models are used as they are, the SFT model also answering for the round."""
    from reproduce import base_models, parse_args

    sft, rm, cmds = base_models(parse_args(["--dry_run"]), tmp_path)
    assert (sft, rm) == (str(tmp_path / "base/step1"), str(tmp_path / "base/step2_onpolicy/reward_model"))
    assert "--step 1 2" in cmds[0] and "--onpolicy_samples" not in cmds[0]
    # the records were made with one round on all pairs of each prompt's answers, step 2 trained on the
    # synthetic pairs first
    assert "--onpolicy_rounds 1 --no-onpolicy_only --onpolicy_pairing all" in cmds[0]
    sft, rm, cmds = base_models(parse_args(["--dry_run", "--quick"]), tmp_path)
    assert rm == str(tmp_path / "base/step2") and "--onpolicy_samples 0" in cmds[0]
    sft, rm, cmds = base_models(parse_args(["--dry_run", "--sft", "/m/sft"]), tmp_path)
    assert sft == "/m/sft" and "--step 2 --actor_model /m/sft" in cmds[0]
    given = parse_args(["--dry_run", "--sft", "/m/sft", "--rm", "/m/rm"])
    assert base_models(given, tmp_path) == ("/m/sft", "/m/rm", [])


def test_critic_free_variants_are_tuned_without_the_critics_flags():
    grid = sweep.parse_grid("actor_learning_rate=1e-5,3e-5 lam=0.95,1.0")
    assert sweep.variant_points(grid, "ppo") == grid
    assert sweep.variant_points(grid, "grpo") == [{"actor_learning_rate": "1e-5"}, {"actor_learning_rate": "3e-5"}]
    assert sweep.variant_points(grid, "mc_macro") == sweep.variant_points(grid, "rloo")
    # every variant's grid is a valid step-3 configuration (step 3 refuses --lam without a critic)
    from marlhf.config import RLHFArgs, parse_args

    for name, variant in sweep.VARIANTS.items():
        for point in sweep.variant_points(grid, name):
            parse_args(RLHFArgs, [*variant.flags, *sweep.point_flags(point)])


def test_one_action_variants_hold_lambda_at_the_grids_first_value():
    """n = ∞ makes each answer one macro action, where GAE is A = R - V(s0) whatever λ: its grid keeps the first λ
    (the folder labels unchanged, so runs made on the whole grid are found), the others keep every point."""
    import torch

    from marlhf.rlhf.ppo_math import compute_advantages

    grid = sweep.parse_grid("actor_learning_rate=3e-5,1e-4 kl_ctl=0.05,0.5 lam=0.95,1.0")
    points = sweep.variant_points(grid, "ninf")
    assert [sweep.point_label(p) for p in points] == [
        "actor_learning_rate=3e-5,kl_ctl=0.05,lam=0.95", "actor_learning_rate=3e-5,kl_ctl=0.5,lam=0.95",
        "actor_learning_rate=1e-4,kl_ctl=0.05,lam=0.95", "actor_learning_rate=1e-4,kl_ctl=0.5,lam=0.95"]
    assert sweep.variant_points(grid, "n10") == grid and len(sweep.variant_points(grid, "ppl")) == 8
    assert sweep.variant_points(sweep.parse_grid("kl_ctl=0.05,0.5"), "ninf") == sweep.parse_grid("kl_ctl=0.05,0.5")
    # why: one segment per answer (n = ∞) gives the same advantages and returns at every λ; n = 5 does not
    g = torch.Generator().manual_seed(0)
    values, rewards = torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)
    mask = torch.ones(3, 12, dtype=torch.bool)
    mask[1, 9:] = False
    whole = torch.where(mask, 0, -1)
    fives = torch.where(mask, torch.arange(12) // 5, -1)
    at = {lam: compute_advantages(values, rewards, mask, whole, lam=lam)[:2] for lam in (0.0, 0.95, 1.0)}
    for lam in (0.0, 0.95):
        assert torch.equal(at[lam][0], at[1.0][0]) and torch.equal(at[lam][1], at[1.0][1])
    assert not torch.allclose(compute_advantages(values, rewards, mask, fives, lam=0.95)[0],
                              compute_advantages(values, rewards, mask, fives, lam=1.0)[0])


def test_tuning_reports_each_methods_own_best_point_on_the_test_half(tmp_path):
    """Finished tuning runs (validation gold: PPO best at lr 1e-5, MA-PPO at 3e-5): a dry run plans the reported
    runs at each method's own choice, fresh seeds, the test half of the held-out prompts; the report shows the
    grid with the choices.  Overlapping seeds and unknown flags are refused."""
    out = tmp_path / "repro"
    best = {"ppo": "1e-5", "n5": "3e-5"}
    for lr in ("1e-5", "3e-5"):
        for variant in ("ppo", "n5"):
            gold = 0.6 if best[variant] == lr else 0.5
            fake_run(out / "tune" / f"actor_learning_rate={lr}" / "gold" / variant / "seed101", 4,
                     {0: 0.4, 4: gold}, rm=0.0, seed_kl=0.01)
    cmd = [sys.executable, "scripts/reproduce.py", "--out", str(out), "--sft", "S", "--rm", "R", "--variants", "ppo",
           "n5", "--rewards", "gold", "--seeds", "1", "2", "--dpo_steps", "0", "--dry_run",
           "--tune_grid", "actor_learning_rate=1e-5,3e-5"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tuning: 4 runs, 4 done, 0 to run" in proc.stdout and "runs: 4 runs, 0 done, 4 to run" in proc.stdout
    planned = [line for line in proc.stdout.splitlines() if line.startswith("$ ") and "/gold/" in line]
    assert len(planned) == 4
    for line in planned:
        variant = "ppo" if "/gold/ppo/" in line else "n5"
        assert f"--actor_learning_rate {best[variant]} --eval_prompts test --seed " in line, line
        assert f"/test/actor_learning_rate={best[variant]}/gold/{variant}/seed" in line, line
        assert "--eval_interval 10 " in line and "--save_steps 10 " in line, line
    from reproduce import choose_points, tuning_plan

    tune = tuning_plan(out, {"gold": sweep.parse_grid("actor_learning_rate=1e-5,3e-5")}, ["ppo", "n5"], [101])
    tuning = choose_points(tune, ["gold"], ["ppo", "n5"])
    assert tuning["gold"]["n5"]["chosen"]["point"] == {"actor_learning_rate": "3e-5"}
    assert tuning["gold"]["ppo"]["scores"] == {"actor_learning_rate=1e-5": [0.6], "actor_learning_rate=3e-5": [0.5]}
    text = write_report(tmp_path / "r.md", {}, settings={"seeds": [1, 2], "steps": 4, "eval_interval": 4,
                                                         "eval_samples": 8, "rewards": ["gold"],
                                                         "tune_grids": {"gold": "actor_learning_rate=1e-5,3e-5"},
                                                         "tune_seeds": [101]},
                        commands=[], missing=[], unavailable={}, invocation="test", tuning=tuning).read_text()
    assert "| PPO (n = 1) | **0.600** | 0.500 |" in text and "| MA-PPO n = 5 | 0.500 | **0.600** |" in text
    assert "every 4 steps on the 4-prompt test half of 8 held-out prompts (the other half chose" in text
    assert "its reward's grid (gold: `--tune_grid_gold actor_learning_rate=1e-5,3e-5`) with seeds [101]" in text
    tuning["gold"]["ppo"]["scores"]["actor_learning_rate=1e-5"] = [0.7, 0.5]  # two tuning seeds: each one shown
    text = write_report(tmp_path / "r.md", {}, settings={"seeds": [1, 2], "steps": 4, "eval_interval": 4,
                                                         "eval_samples": 8, "rewards": ["gold"],
                                                         "tune_grids": {"gold": "actor_learning_rate=1e-5,3e-5"},
                                                         "tune_seeds": [101, 102]},
                        commands=[], missing=[], unavailable={}, invocation="test", tuning=tuning).read_text()
    assert "| PPO (n = 1) | **0.600 (0.700 / 0.500)** | 0.500 |" in text
    for bad, message in ((["--tune_seeds", "1"], "overlap"),
                         (["--tune_grid", "no_such_flag=1,2"], "no flag --no_such")):
        proc = subprocess.run([*cmd[:-2], *bad, *([] if "--tune_grid" in bad else cmd[-2:])], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_tuning_runs_evaluate_before_and_after_only_and_the_commands_keep_each_runs_own_interval(tmp_path):
    """A tuning run still to do evaluates at its start and end only (--tune_eval_interval 0, the default) and keeps
    a checkpoint every --eval_interval steps; a finished run's command line says the interval it ran with (its
    args.json: 10 for the records made before the flag), so the report's commands stay true of every record."""
    from reproduce import parse_args, run_specs

    args = parse_args(["--report_only"])
    assert (args.tune_eval_interval, args.eval_interval) == (0, 10)
    specs = [sweep.RunSpec("gold", "ppo", seed, tmp_path / "tune" / "kl_ctl=0.1" / "gold" / "ppo" / f"seed{seed}")
             for seed in (101, 102, 103)]
    for spec, recorded in zip(specs[:2], (10, None)):
        fake_run(spec.out, 4, {0: 0.4, 4: 0.5}, rm=0.0, seed_kl=0.01)
        if recorded is not None:
            (spec.out / "args.json").write_text(json.dumps({"eval_interval": recorded, "seed": spec.seed}))
    commands: list[str] = []
    run_specs(specs, args, "S", "R", {}, commands, lambda: None, "tuning", args.tune_eval_interval)
    assert len(commands) == 2, commands
    assert commands[0].startswith("for SEED in 101; do") and "--eval_interval 10 " in commands[0]
    assert commands[1].startswith("for SEED in 102 103; do") and "--eval_interval 0 " in commands[1]
    assert all("--save_steps 10 " in c and "--seed $SEED " in c for c in commands), commands


def test_reported_runs_belong_to_their_point_so_a_changed_choice_runs_the_new_points_seeds(tmp_path):
    """Reported runs finished at PPO's choice on one tuning seed (lr 1e-5: 0.6 against 0.55) count as done while
    that point is chosen; a second tuning seed on which 1e-5 collapses (0.1) moves the choice to 3e-5 (mean 0.55
    against 0.35), whose seeds are planned afresh: the old point's runs are neither reported as the new point's
    nor deleted."""
    out = tmp_path / "repro"

    def tuned(lr, seed, gold):
        fake_run(out / "tune" / f"actor_learning_rate={lr}" / "gold" / "ppo" / f"seed{seed}", 4, {0: 0.4, 4: gold},
                 rm=0.0, seed_kl=0.01)

    tuned("1e-5", 101, 0.6), tuned("3e-5", 101, 0.55)
    for seed in (1, 2):
        fake_run(out / "test" / "actor_learning_rate=1e-5" / "gold" / "ppo" / f"seed{seed}", 4, {0: 0.4, 4: 0.6},
                 rm=0.0, seed_kl=0.01)
    cmd = [sys.executable, "scripts/reproduce.py", "--out", str(out), "--sft", "S", "--rm", "R", "--variants", "ppo",
           "--rewards", "gold", "--seeds", "1", "2", "--dpo_steps", "0", "--dry_run",
           "--tune_grid", "actor_learning_rate=1e-5,3e-5", "--tune_seeds", "101"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tuning: 2 runs, 2 done, 0 to run" in proc.stdout and "runs: 2 runs, 2 done, 0 to run" in proc.stdout
    tuned("1e-5", 102, 0.1), tuned("3e-5", 102, 0.55)
    proc = subprocess.run([*cmd, "102"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tuning: 4 runs, 4 done, 0 to run" in proc.stdout and "runs: 2 runs, 0 done, 2 to run" in proc.stdout
    planned = [line for line in proc.stdout.splitlines() if line.startswith("$ ") and "/gold/ppo/" in line]
    assert len(planned) == 2 and all("/test/actor_learning_rate=3e-5/gold/ppo/seed" in line
                                     and "--actor_learning_rate 3e-5 --eval_prompts test" in line for line in planned)
    assert all((out / "test" / "actor_learning_rate=1e-5" / "gold" / "ppo" / f"seed{s}" / "summary.json").exists()
               for s in (1, 2))


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown variant"):
        sweep.plan(tmp_path, ["gold"], ["n7"], [1])


def test_records_keep_finished_runs_only_and_refuse_other_starting_weights(runs, tmp_path):
    """--records: archive copies the report's files of finished runs (not an unfinished one, not checkpoints);
    restore puts them back in a fresh --out where they count as done and read back equal; base.json refuses
    to continue from other SFT/RM weights, naming them."""
    from lab import records

    root, _, _ = runs
    specs = sweep.plan(root, ["gold"], ["ppo", "n5"], [1, 2, 3, 4])  # seed 4: never started
    unfinished = root / "gold" / "ppo" / "seed3"
    (unfinished / "summary.json").rename(unfinished / "was_summary.json")
    (root / "gold" / "n5" / "seed1" / "checkpoint").mkdir()
    (root / "gold" / "n5" / "seed1" / "checkpoint" / "model.pt").write_bytes(b"x" * 1000)
    kept = tmp_path / "records"
    assert records.archive(root, kept, [s.out for s in specs]) == 5 * 2  # summary + metrics of 5 finished runs
    assert records.archive(root, kept, [s.out for s in specs]) == 0  # unchanged files are not rewritten
    assert not (kept / "gold" / "ppo" / "seed3").exists()
    assert not (kept / "gold" / "n5" / "seed1" / "checkpoint").exists()

    fresh = tmp_path / "fresh"
    fresh_specs = sweep.plan(fresh, ["gold"], ["ppo", "n5"], [1, 2, 3, 4])
    (fresh / "gold" / "n5" / "seed2").mkdir(parents=True)  # a partial run there: the record replaces it
    (fresh / "gold" / "n5" / "seed2" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert records.restore(kept, fresh, [s.out for s in fresh_specs]) == 10
    assert [s.done for s in fresh_specs] == [s.done for s in specs]
    for a, b in zip(specs, fresh_specs):
        if a.done:
            assert sweep.read_run(a.out) == sweep.read_run(b.out)

    def model(folder: Path, weights: bytes) -> Path:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(weights)
        (folder / "config.json").write_text("{}")
        return folder

    sft, rm = model(tmp_path / "sft", b"sft weights"), model(tmp_path / "rm", b"rm weights")
    first = records.check_base(kept, sft, rm)
    assert json.loads((kept / "base.json").read_text()) == first
    assert records.check_base(kept, sft, rm) == first
    (rm / "config.json").write_text('{"x": 1}')  # not weights: no change
    assert records.check_base(kept, sft, rm) == first
    (rm / "model.safetensors").write_bytes(b"rm weights, trained elsewhere")
    with pytest.raises(records.RecordsMismatch, match=r"base.json.*other rm weights"):
        records.check_base(kept, sft, rm)

    # the starting models travel with the records (not their logs); a fresh --out gets them back once
    base = root / "base"
    for name, folder in (("step1", sft), ("step2", rm)):
        (base / name).mkdir(parents=True)
        for f in folder.iterdir():
            (base / name / f.name).write_bytes(f.read_bytes())
        (base / name / "training.log").write_text("long log")
    (base / "summary.json").write_text('{"seconds": {}}')
    assert records.keep_base(root, kept) == 5 and records.keep_base(root, kept) == 0
    assert not (kept / "base" / "step1" / "training.log").exists()
    assert records.restore_base(kept, fresh) and not records.restore_base(kept, fresh)
    for name in ("step1", "step2"):
        assert records.weights_digest(fresh / "base" / name) == records.weights_digest(base / name)
    assert (fresh / "base" / "summary.json").exists()
    # with the main job's reward model (step 2's trained further on the policy's answers) that one travels
    # instead of step 2's, without the round's data
    onpolicy = base / "step2_onpolicy"
    model(onpolicy / "reward_model", b"on-policy rm weights")
    (onpolicy / "pairs.jsonl").write_text("not kept")
    kept2, fresh2 = tmp_path / "kept2", tmp_path / "fresh2"
    assert records.keep_base(root, kept2) == 5
    assert sorted(p.relative_to(kept2).as_posix() for p in kept2.rglob("*") if p.is_file()) == [
        "base/step1/config.json", "base/step1/model.safetensors", "base/step2_onpolicy/reward_model/config.json",
        "base/step2_onpolicy/reward_model/model.safetensors", "base/summary.json"]
    assert records.restore_base(kept2, fresh2)
    assert records.weights_digest(fresh2 / "base/step2_onpolicy/reward_model") == records.weights_digest(
        onpolicy / "reward_model") and not (fresh2 / "base/step2").exists()


def table_rows(text: str) -> dict[str, list[str]]:
    """Each row label's first table row (the main table; the equal-KL table below it repeats the labels)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("| ") and "---" not in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.setdefault(cells[0], cells[1:])
    return rows


@pytest.mark.slow
def test_quick_sweep_end_to_end(tmp_path):
    """``--quick``: steps 1–2 briefly, PPO and MA-PPO n = 5 for 2 seeds x 3 steps with the gold reward, held-out
    evaluation every step, DPO for 3 steps; the report's numbers are the runs' own, and a rerun trains nothing."""
    out, report = tmp_path / "repro", tmp_path / "docs" / "results.md"
    kept = tmp_path / "records"
    cmd = [sys.executable, "scripts/reproduce.py", "--quick", "--out", str(out), "--report", str(report),
           "--parallel", "2", "--records", str(kept)]
    # its own ports and data cache: the launch scripts' defaults (29500, /tmp/data_files) may be taken
    env = {**os.environ, "MASTER_PORT": "29683", "DATA_OUTPUT_PATH": str(tmp_path / "data")}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = table_rows(report.read_text())
    for variant in ("ppo", "n5"):
        finals, evals = [], []
        for seed in (1, 2):
            run = out / "gold" / variant / f"seed{seed}"
            summary = json.loads((run / "summary.json").read_text())
            assert summary["steps"] == 3
            finals.append(summary["final_policy"]["gold_score"])
            metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            evals.append([m["step"] for m in metrics if "eval/gold_score" in m])
            # each step's wall time (time parity) holds its generation and its update
            timed = [m for m in metrics if "train/step_seconds" in m]
            assert [m["step"] for m in timed] == [1, 2, 3]
            assert all(m["train/step_seconds"] >= m["train/gen_seconds"] + m["train/train_seconds"] for m in timed)
        assert evals == [[1, 2], [1, 2]]  # --eval_interval 1, the final evaluation is summary.json's
        mean = sum(finals) / 2
        label = sweep.VARIANTS[variant].label
        assert re.match(rf"{mean:.3f} ± ", rows[label][2]), (rows[label], finals)
    # DPO, its own budget: the SFT evaluated by marlhf eval-policy with a step-3 run's settings is that
    # run's step 0, number for number; the report's DPO row is the mean of its runs' final evaluations
    sft_eval = json.loads((out / "dpo" / "sft_eval" / "eval.json").read_text())
    step0 = json.loads((out / "gold" / "ppo" / "seed1" / "initial_policy.json").read_text())
    assert {k: sft_eval[k] for k in step0} == step0
    dpo = [json.loads((out / "dpo" / f"seed{s}" / "summary.json").read_text())["final_policy"] for s in (1, 2)]
    assert all(d["kl"] != 0 for d in dpo) and sft_eval["kl"] == 0.0  # DPO moved off its reference
    dpo_row = rows["DPO (3 steps)"]
    for col, key in enumerate(("gold_score", "rm_score", "kl")):
        assert re.match(rf"{(dpo[0][key] + dpo[1][key]) / 2:.3f} ± ", dpo_row[col]), (dpo_row, dpo)
    assert rows["SFT (start)"][0] == f"{step0['gold_score']:.3f}"
    # reward at equal KL from the same runs; what the full sweep has and this one does not, said
    text = report.read_text()
    assert "### Reward at equal KL" in text and (report.parent / "results" / "frontier_gold.png").exists()
    assert "- variant n10: not in this sweep" in text and "- the rm reward: not in this sweep" in text
    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert "4 runs, 4 done, 0 to run" in rerun.stdout
    assert "\n$ " not in rerun.stdout  # nothing trained or evaluated again, DPO included
    # the records alone (a few small files per run, digests of the starting weights) give the same report
    assert json.loads((kept / "base.json").read_text()).keys() == {"sft", "rm"}
    weights = sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*.safetensors"))
    assert weights == ["base/step1/model.safetensors", "base/step2/model.safetensors"]  # no run's models
    assert not list(kept.rglob("*.pt")) and not list(kept.rglob("checkpoints"))
    # another machine: a fresh --out continues from the records, trains and evaluates nothing
    moved = subprocess.run([*cmd[:cmd.index("--out") + 1], str(tmp_path / "elsewhere"), *cmd[cmd.index("--out") + 2:]],
                           cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert moved.returncode == 0, moved.stdout[-3000:] + moved.stderr[-3000:]
    assert "restored the recorded SFT and reward model" in moved.stdout and "4 runs, 4 done, 0 to run" in moved.stdout
    assert "\n$ " not in moved.stdout
    again = tmp_path / "from_records.md"
    proc = subprocess.run([sys.executable, "scripts/reproduce.py", "--quick", "--report_only", "--out", str(kept),
                           "--report", str(again)], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert table_rows(again.read_text()) == rows


def test_data_seed_fixes_the_split_while_seed_varies():
    from marlhf.config import RLHFArgs, parse_args
    from marlhf.data.pipeline import phase_records
    from marlhf.data.records import BadRowPolicy

    def split(*flags):
        args, _ = parse_args(RLHFArgs, ["--data_path", "synthetic:num_records=200", *flags])
        train, held = phase_records(args.data_path, args.data_split, 3, args.split_seed, args.eval_fraction,
                                    BadRowPolicy())
        return [r.source for r in train], [r.source for r in held]

    assert split("--seed", "7", "--data_seed", "1234") == split("--seed", "1234")
    assert split("--seed", "7") != split("--seed", "1234")  # without it, --seed reshuffles the phases


def test_held_out_kl_against_a_per_sample_loop(tmp_path):
    """evaluate_policy's KL = Σ_t log π(a_t|s_t) − log π_ref(a_t|s_t) over each held-out answer, averaged:
    0 with the reference itself, and the loop value over the same seeded samples with a perturbed actor."""
    import torch
    from ppo_harness import evaluate, make_trainer, phase3_data, rlhf_args

    from marlhf import embedded
    from marlhf.data.pipeline import PromptCollator
    from marlhf.sampler import sample

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path, max_eval_samples=6, per_device_generation_batch_size=4,
                     per_device_training_batch_size=4)
    t = make_trainer(args)
    items = phase3_data(args, t.tokenizer).eval[:6]
    actor, ref = t.rlhf.actor, t.rlhf.ref
    assert evaluate(t, items, args, {}, ref=ref)["kl"] == 0.0
    with torch.no_grad():
        actor.module.lm_head.weight.add_(0.05 * torch.randn_like(actor.module.lm_head.weight))
    got = evaluate(t, items, args, {}, ref=ref, seed=5)["kl"]

    cfg = t.gen_cfg  # the flags' sampling settings, stopping at the run's end token
    total = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        for i in range(0, len(items), 4):
            batch = PromptCollator(t.tokenizer.pad_token_id)(items[i:i + 4])
            s = sample(actor, batch["prompt_ids"], batch["prompt_mask"], cfg)
            for row in range(s.seq.shape[0]):
                ids = s.seq[row][s.attention_mask[row].bool()]  # unpadded prompt + answer
                n_prompt = int(s.prompt_mask[row].sum())
                kl = 0.0
                for model_sign in ((actor.module, 1.0), (ref.module, -1.0)):
                    model, sign = model_sign
                    with torch.no_grad():
                        logp = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
                    for pos in range(n_prompt, len(ids)):  # each answer token given everything before it
                        kl += sign * logp[pos - 1, ids[pos]].item()
                total.append(kl)
    assert got == pytest.approx(sum(total) / len(total), rel=1e-4, abs=1e-5)
    assert abs(got) > 1e-3


def test_held_out_evaluation_reports_each_scores_standard_error(tmp_path):
    """``<name>_score_se`` = sample standard deviation of the answers' scores / √n, for a plain source and for
    one that explains itself (its ``total``), computed here from the scores the sources handed out."""
    import statistics

    from ppo_harness import evaluate, make_trainer, phase3_data, rlhf_args

    from marlhf import embedded

    class Plain:  # a score per answer that varies: its length in characters, modulo 7
        seen: list[float] = []

        def score(self, prompts, responses, meta, ended=None):
            out = [float(len(r) % 7) - 2.5 for r in responses]
            self.seen += out
            return out

    class Explained:
        components = ("twice",)
        seen: list[float] = []

        def details(self, prompts, responses, ended, meta):
            rows = [{"total": 0.1 * len(r.split()), "twice": 0.2 * len(r.split())} for r in responses]
            self.seen += [r["total"] for r in rows]
            return rows

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path, max_eval_samples=10, per_device_generation_batch_size=4,
                     per_device_training_batch_size=4)
    t = make_trainer(args)
    items = phase3_data(args, t.tokenizer).eval[:10]
    plain, explained = Plain(), Explained()
    got = evaluate(t, items, args, {"p": plain, "x": explained})
    for name, src in (("p", plain), ("x", explained)):
        assert len(src.seen) == 10 and statistics.stdev(src.seen) > 0
        assert got[f"{name}_score"] == pytest.approx(statistics.fmean(src.seen), abs=1e-6)
        assert got[f"{name}_score_se"] == pytest.approx(statistics.stdev(src.seen) / 10 ** 0.5, rel=1e-6)
    assert got["x_twice"] == pytest.approx(2 * got["x_score"], rel=1e-9)


def test_held_out_evaluation_batch_is_independent_of_the_training_batch(tmp_path):
    """Held-out answers are one seeded stream batched by --per_device_eval_generation_batch_size (default: the
    training generation batch): a group estimator generating 2 prompts per batch evaluates exactly like PPO
    generating 4 when both evaluate 4 per batch — the sweep compares every variant on the same samples."""
    import dataclasses

    import torch
    from ppo_harness import evaluate, make_trainer, phase3_data, rlhf_args

    from marlhf import embedded

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path, max_eval_samples=8, per_device_generation_batch_size=4,
                     per_device_training_batch_size=4)
    t = make_trainer(args)
    items = phase3_data(args, t.tokenizer).eval[:8]
    with torch.no_grad():  # an actor away from its reference: the KL tells one sample stream from another
        head = t.rlhf.actor.module.lm_head.weight
        head.add_(0.05 * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))

    def ev(**over):
        return evaluate(t, items, dataclasses.replace(args, **over), {}, ref=t.rlhf.ref, seed=3)

    ppo = ev()
    assert ev(per_device_generation_batch_size=2, per_device_eval_generation_batch_size=4) == ppo
    assert ppo["kl"] != 0.0
    assert ev(per_device_generation_batch_size=2)["kl"] != ppo["kl"]  # evaluated 2 per batch: other samples


@pytest.mark.parametrize("reward", list(sweep.REWARDS))
@pytest.mark.parametrize("variant", list(sweep.VARIANTS))
def test_every_variant_is_a_valid_step3_configuration(variant, reward, tmp_path):
    """The command line the sweep's launch (``step3_command``: the tiny step-3 script with the variant's flags and
    environment) hands to step 3 — recorded by a fake ``deepspeed`` — parses and validates as step 3 would: the
    tiny script's own flags included (its advantage whitening, which GRPO refuses, made the sweep's GRPO runs fail
    at start before the variant turned it off)."""
    import reproduce
    from test_launch_scripts import launch_ok

    from marlhf.config import RLHFArgs, parse_args

    spec = sweep.RunSpec(reward, variant, 1, tmp_path / "runs")
    cmd, env = reproduce.step3_command(spec, reproduce.parse_args(["--quick"]), str(tmp_path / "sft"),
                                       str(tmp_path / "rm"))
    launch = launch_ok(reproduce.REPO / cmd[1], tmp_path, *cmd[2:], **env)
    args, _ = parse_args(RLHFArgs, launch.flags)  # raises ConfigError on a refused combination
    flags = sweep.VARIANTS[variant].flags
    given = dict(zip(flags[::2], flags[1::2]))
    assert args.advantage_estimator == given.get("--advantage_estimator", "gae")
    # the variant's own n and K win over the tiny script's defaults (NGRAM=5, --mc_rollouts 4)
    assert args.ngram == given.get("--ngram", "5")
    assert args.mc_rollouts == int(given.get("--mc_rollouts", "4"))
    assert args.whiten_advantages == (dict(sweep.VARIANTS[variant].env).get("WHITEN_ADVANTAGES", "1") == "1")
    assert args.seed == 1 and args.output_dir == str(spec.out)
    assert (args.reward_source == "gold") == (reward == "gold")
    if "--num_samples_per_prompt" in given:  # the same 16 answers per step as PPO's 16 prompts
        assert args.num_samples_per_prompt * args.per_device_generation_batch_size == 16
        assert args.per_device_eval_generation_batch_size == 16
