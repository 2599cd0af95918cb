"""The cost-per-step benchmark (issue 11 §3): the phase timer hook changes nothing the step computes, and
``scripts/bench_step3.py --quick`` writes a JSON whose numbers the rendered table shows, phases that add up
to the step, no critic work for the critic-free variants and ratios that are the ratios of its own times.
No timing is asserted (times vary by machine): only the bookkeeping around them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lab.cost_report import PHASES, render_cost_section
from ppo_harness import make_trainer, prompts, rlhf_args

from marlhf.utils.timing import NO_TIMER, PhaseTimer

REPO = Path(__file__).resolve().parents[1]


def test_phase_timer_sums_spans_per_name_nested_and_on_error():
    timer = PhaseTimer()
    with timer("outer"):
        for _ in range(3):
            with timer("inner"):
                time.sleep(0.001)
    with pytest.raises(ValueError), timer("failing"):
        raise ValueError("boom")
    assert timer.calls == {"inner": 3, "outer": 1, "failing": 1}
    assert timer.seconds["inner"] >= 0.003 - 1e-4  # three sleeps of 1 ms, summed
    assert timer.seconds["outer"] >= timer.seconds["inner"]  # a name's time includes what nests in it
    timer.reset()
    assert timer.seconds == {} and timer.calls == {}
    assert NO_TIMER("x") is NO_TIMER("y")  # the default allocates nothing per phase


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_timed_step_computes_exactly_what_an_untimed_one_does(tmp_path, estimator):
    """Two fresh trainers from the same seed: one with the default NO_TIMER, one timed.  Experience and the
    weights after the update are bitwise equal; the timer saw each phase, and no critic without one."""
    from marlhf import embedded

    nano = embedded.prepare(size="nano").model_dir
    flags = {"max_answer_seq_len": 8, "per_device_generation_batch_size": 4, "per_device_training_batch_size": 4}
    if estimator == "grpo":
        flags.update(advantage_estimator="grpo", num_samples_per_prompt=2, per_device_generation_batch_size=2)
    out = {}
    for timed in (False, True):
        args = rlhf_args(nano, tmp_path / f"t{timed}", **flags)
        t = make_trainer(args)
        timer = PhaseTimer()
        if timed:
            t.timer = timer
        ids, mask = prompts(args, t.tokenizer, args.per_device_generation_batch_size)
        exp, _ = t.make_experience(ids, mask, step=0)
        t.ppo_update([exp])
        params = {f"{k}.{n}": p.detach().clone() for k, e in t.rlhf.trainable().items()
                  for n, p in e.module.named_parameters()}
        out[timed] = (exp, params, timer)
    (e0, w0, untimed), (e1, w1, timer) = out[False], out[True]
    for f in ("seq", "logprobs", "ref_logprobs", "values", "rewards", "seg", "advantages", "returns"):
        a, b = getattr(e0, f), getattr(e1, f)
        assert (a is None and b is None) or torch.equal(a, b), f
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert untimed.calls == {}  # the trainer's default is NO_TIMER
    critic = {"forward/critic", "train/critic"}
    expected = {"generation", "forward/actor", "forward/ref", "forward/reward", "macro", "train/actor"}
    assert set(timer.calls) == (expected | critic if estimator == "gae" else expected)
    # one batch, one micro-batch: each phase once, but "macro" twice (the rule's segments, then the advantages:
    # mc_macro's continuations run between the two and are timed as generation/mc)
    assert timer.calls == {name: 2 if name == "macro" else 1 for name in timer.calls}


# ------------------------------------------------------------------------------------------ --quick run
def _numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", cell)]


def _close(shown: float, value: float, cell: str) -> None:
    decimals = len(cell.split(".")[1]) if "." in cell else 0
    assert abs(shown - value) <= 0.5 * 10 ** -decimals + 1e-9, (cell, value)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("cost") / "cost.json"
    # the child picks its own free rendezvous port: the one this process's engines hold is taken
    env = {**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "scripts/bench_step3.py", "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), out


def test_quick_run_writes_every_variant_with_consistent_checks(quick):
    report, out = quick
    assert list(report["variants"]) == ["ppo", "n5", "grpo"]
    bools = {k: v for k, v in report["checks"].items() if isinstance(v, bool)}
    assert len(bools) == 4 and all(bools.values()), report["checks"]  # restores exact, same answers, deterministic
    assert out.with_suffix(".md").read_text() == render_cost_section(out)
    for r in report["variants"].values():
        assert r["answers"] == report["config"]["batch"] == r["prompts"] * r["samples_per_prompt"]
        assert r["train_flops"] > 0 and r["memory_mb"]["engines_used"] > 0
        assert len(r["repeats"]) == report["config"]["repeats"]


def test_phases_add_up_to_the_step_and_critic_free_runs_no_critic(quick):
    report, _ = quick
    for name, r in report["variants"].items():
        for rep in r["repeats"]:
            ph = rep["phases_s"]
            assert set(ph) == set(PHASES)
            assert sum(ph.values()) == pytest.approx(rep["step_s"], rel=1e-9)
            assert ph["other"] >= 0  # the timed phases nest inside the step
            assert sum(rep["timer_s"].values()) <= rep["step_s"]
        critic_work = {k for k in r["timer_s"] if "critic" in k}
        if r["critic"]:
            assert critic_work == {"forward/critic", "train/critic"}, name
            assert "critic" in r["memory_mb"]["engines_used_detail"]
        else:
            assert critic_work == set() and "critic" not in r["memory_mb"]["engines_used_detail"], name
    ppo, grpo = report["variants"]["ppo"], report["variants"]["grpo"]
    assert grpo["memory_mb"]["engines_used"] < ppo["memory_mb"]["engines_used"]  # no critic weights / Adam
    assert (grpo["prompts"], grpo["samples_per_prompt"]) == (1, 4)


def test_ratios_are_the_ratios_of_the_reported_times(quick):
    report, _ = quick
    base = report["variants"]["ppo"]["step_s"]
    for r in report["variants"].values():
        s, q = r["step_s"], r["ratio_to_ppo"]
        assert q["median"] == pytest.approx(s["median"] / base["median"], rel=1e-12)
        assert q["min"] == pytest.approx(s["min"] / base["min"], rel=1e-12)
        steps = [x["step_s"] for x in r["repeats"]]
        assert s["min"] == min(steps) and s["max"] == max(steps)
    assert report["variants"]["ppo"]["ratio_to_ppo"]["median"] == 1.0


def test_rendered_table_shows_the_json_numbers(quick):
    report, out = quick
    md = render_cost_section(out)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in md.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    assert list(rows) == list(report["variants"])
    for name, r in report["variants"].items():
        cells = rows[name]
        assert cells[0] == ("yes" if r["critic"] else "no")
        assert _numbers(cells[1]) == [r["answers"], r["prompts"], r["samples_per_prompt"]]
        expected = [[r["step_s"]["median"], r["step_s"]["min"]], *[[r["phases_s"][k]] for k in PHASES],
                    [r["generated_tokens_per_s"]], [r["train_tokens_per_s"]],
                    [r["train_gflops_per_s"], 100 * r["train_fraction_of_matmul_peak"]],
                    [r["memory_mb"]["engines_used"]], [r["memory_mb"]["step_increase"]],
                    [r["ratio_to_ppo"]["median"], r["ratio_to_ppo"]["min"]]]
        for cell, values in zip(cells[2:], expected, strict=True):
            parts = re.split(r" / | \(", cell)
            shown = [_numbers(p)[0] for p in parts]
            assert len(shown) == len(values), cell
            for s, v, p in zip(shown, values, parts):
                _close(s, v, p.strip("()%"))
    c = report["config"]
    assert c["machine"] in md and f"{c['threads']} thread(s)" in md and f"{c['batch']} answers per step" in md


def test_reading_names_a_variant_whose_macro_phase_costs_more_than_the_threshold(quick, tmp_path):
    """The reading's verdict comes from the numbers: give n5 a macro phase 5% of a PPO step longer than PPO's
    and it is named as an additional cost; as measured (--quick) the verdict is read off the same rule."""
    from lab.cost_report import MACRO_COST_THRESHOLD

    report, _ = quick
    V = report["variants"]
    extra = (V["n5"]["phases_s"]["macro"] - V["ppo"]["phases_s"]["macro"]) / V["ppo"]["step_s"]["median"]
    holds = "holds here for every MA-PPO variant measured"
    assert (holds in render_cost_section(quick[1])) == (extra <= MACRO_COST_THRESHOLD)
    V["n5"]["phases_s"]["macro"] = V["ppo"]["phases_s"]["macro"] + 0.05 * V["ppo"]["step_s"]["median"]
    path = tmp_path / "inflated.json"
    path.write_text(json.dumps(report))
    md = render_cost_section(path)
    assert holds not in md and "holds here for 0 of 1 variants and not for n5 (+5.0%)" in md
