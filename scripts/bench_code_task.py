#!/usr/bin/env python
"""Does step 3 with program-test rewards raise the held-out program-test reward on the tiny code task?

The paper's code task (§4.4, App. B.5, Table 3) in miniature: the embedded tiny model is fine-tuned on the
generated ``synthetic_code`` problems (step 1), then trained by step 3 with ``--reward_source program_tests``
(the sandboxed unit tests of each problem give the compiler-signal reward of B.5; no reward model).  Both runs
are the tiny code launch scripts (``training/step{1,3}_*/training_scripts/tiny/run_tiny_code.sh``), so the
numbers are those of the documented configuration.  Per seed (``--seed`` of both steps; the data split and the
held-out problems stay fixed with ``--data_seed``) it reports, for the SFT policy and the final policy:

- step 3's own held-out evaluation (``summary.json``: the same held-out problems and sampling seed before and
  after): mean reward, pass rate (every test passed), share of tests passed and the verdict mix;
- pass@1 and pass@k (Chen et al.'s unbiased estimator) from ``--passk_samples`` answers per problem on
  ``--passk_problems`` held-out problems, sampled at step 3's temperature and run in the sandbox;
- the training reward (mean of the first and last ``--curve_window`` steps).

Each stage skips what is already done, so the stages can run as separate short commands (the machine is
shared):

    python scripts/bench_code_task.py --stage sft --seeds 1      # ~1.5 min per seed
    python scripts/bench_code_task.py --stage rl --seeds 1       # ~2.5 min per seed
    python scripts/bench_code_task.py --stage passk --seeds 1    # ~1 min per seed
    python scripts/bench_code_task.py --stage report --seeds 1 2 # writes --out (JSON) and the .md next to it
    python scripts/bench_code_task.py --seeds 1 2                # everything not yet done, then the report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

SFT_SCRIPT = REPO / "training/step1_supervised_finetuning/training_scripts/tiny/run_tiny_code.sh"
RL_SCRIPT = REPO / "training/step3_rlhf_finetuning/training_scripts/tiny/run_tiny_code.sh"
DATA_SEED = 1234  # the split (SFT / PPO shares) and held-out problems of every seed
STAGES = ("sft", "rl", "passk", "report")
VERDICT_KEYS = ("pass", "wrong_answer", "runtime_error", "timeout", "compile_error")
ANSWER_FORMS = ("reference", "off_by_one", "other")
EXAMPLES = 6  # answers per policy kept in passk.json (the first answer to each of the first problems)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--stage", default="all", choices=("all",) + STAGES)
    p.add_argument("--work", default="runs/code_task", help="Where the runs go (seed<S>/step1, seed<S>/step3)")
    p.add_argument("--out", default="docs/results/code_task.json", help="Report (JSON; markdown next to it)")
    p.add_argument("--passk_problems", type=int, default=64, help="Held-out problems for pass@k")
    p.add_argument("--passk_samples", type=int, default=8, help="Answers per problem for pass@k (n)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 4])
    p.add_argument("--reward_workers", type=int, default=2)
    p.add_argument("--curve_window", type=int, default=10, help="Steps averaged at each end of the reward curve")
    p.add_argument("--master_port", type=int, default=29561)
    return p.parse_args(argv)


def run_script(script: Path, out: Path, seed: int, work: Path, port: int, env_extra: dict) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), DATA_OUTPUT_PATH=str(work / "data"), MASTER_PORT=str(port),
               EXTRA_ARGS=f"--seed {seed} --data_seed {DATA_SEED} --disable_progress_bar", **env_extra)
    cmd = ["bash", str(script), str(out)]
    print(f"=== {' '.join(cmd)}  ({env['EXTRA_ARGS']})", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"{script.name} failed with exit code {proc.returncode}; see {out}/training.log")
    (out / "bench_seconds.json").write_text(json.dumps({"seconds": round(time.time() - t0, 1)}))


def stage_sft(seed: int, args, work: Path) -> None:
    out = work / f"seed{seed}" / "step1"
    if (out / "model.safetensors").exists():
        print(f"seed {seed}: SFT done ({out})")
        return
    run_script(SFT_SCRIPT, out, seed, work, args.master_port, {})


def stage_rl(seed: int, args, work: Path) -> None:
    sft, out = work / f"seed{seed}" / "step1", work / f"seed{seed}" / "step3"
    if (out / "summary.json").exists():
        print(f"seed {seed}: step 3 done ({out})")
        return
    if not (sft / "model.safetensors").exists():
        raise SystemExit(f"seed {seed}: no SFT model at {sft}; run --stage sft first")
    run_script(RL_SCRIPT, out, seed, work, args.master_port,
               {"ACTOR_MODEL_PATH": str(sft), "REWARD_WORKERS": str(args.reward_workers)})


def held_out_problems(step3: Path, limit: int) -> list:
    """The held-out records step 3 evaluated on (same data flags), first ``limit`` of them."""
    from marlhf.data.pipeline import phase_records
    from marlhf.data.records import BadRowPolicy

    cfg = json.loads((step3 / "args.json").read_text())
    _, evaluation = phase_records(cfg["data_path"], cfg["data_split"], 3, cfg["data_seed"] if cfg["data_seed"] >= 0
                                  else cfg["seed"], cfg["eval_fraction"], BadRowPolicy(cfg["bad_rows"]))
    return evaluation[:limit], cfg


def pass_counts(model: Path, records: list, cfg: dict, n: int, workers: int, seed: int) -> dict:
    """Sample ``n`` answers per problem from ``model`` (step 3's sampling settings), run them in the sandbox;
    the (n, correct) count per problem and the verdict mix."""
    import torch

    from marlhf.eval.generate_tool import LoadedPolicy, batch_seed
    from marlhf.rewards.program_tests import run_responses
    from marlhf.sections import SamplingSection

    policy = LoadedPolicy(str(model))
    responses = []
    with torch.no_grad():
        for b, start in enumerate(range(0, len(records), 16)):
            sampling = SamplingSection(max_new_tokens=cfg["max_answer_seq_len"], temperature=cfg["temperature"],
                                       top_k=cfg["top_k"], top_p=cfg["top_p"])
            gen = policy.config(sampling, seed=batch_seed(seed, b))
            chunk = [r.prompt for r in records[start:start + 16]]
            responses += policy.sample(chunk, gen, n, cfg["max_prompt_seq_len"])[0]
    results = run_responses(responses, [r.meta for r in records for _ in range(n)], workers=workers)
    correct = [sum(results[i * n + j].verdict == "pass" for j in range(n)) for i in range(len(records))]
    verdicts = {v: sum(r.verdict == v for r in results) / len(results) for v in VERDICT_KEYS}
    forms = answer_forms(responses, records, n, cfg["data_path"][0])
    examples = [{"problem": records[i].source, "answer": responses[i * n], "verdict": results[i * n].verdict}
                for i in range(min(EXAMPLES, len(records)))]
    return {"n": n, "correct": correct, "verdicts": verdicts, "forms": forms, "examples": examples,
            "mean_reward": statistics.fmean(r.reward for r in results)}


def answer_forms(responses: list, records: list, n: int, spec: str) -> dict:
    """Share of the answers (``n`` per problem, grouped by problem) whose program is the problem's reference
    program, the demonstrations' bug (the same program with the result off by one: what ``flaw_rate`` puts in
    the SFT data) or something else: what a reward gain is made of.  ``spec`` is the synthetic_code dataset."""
    from marlhf.code.apps import extract_code
    from marlhf.data.adapters.loader import parse_synthetic_options
    from marlhf.embedded import code_task

    name, _, options = spec.partition(":")
    if name != "synthetic_code":
        raise SystemExit(f"the answer forms need the synthetic_code task, not {spec!r}")
    cfg = code_task.SyntheticCodeConfig(**parse_synthetic_options(options, code_task.SyntheticCodeConfig))

    def norm(program: str) -> str:
        return " ".join(program.split())

    counts = dict.fromkeys(ANSWER_FORMS, 0)
    for i, record in enumerate(records):
        index = int(record.source.rpartition(":")[2])
        reference, buggy = (norm(code_task.problem(cfg.seed, index, dataclasses.replace(cfg, flaw_rate=rate))
                                 .chosen) for rate in (0.0, 1.0))
        for answer in responses[i * n:(i + 1) * n]:
            got = norm(extract_code(answer))
            counts["reference" if got == reference else "off_by_one" if got == buggy else "other"] += 1
    return {k: v / (n * len(records)) for k, v in counts.items()}


def stage_passk(seed: int, args, work: Path) -> None:
    step1, step3 = work / f"seed{seed}" / "step1", work / f"seed{seed}" / "step3"
    path = work / f"seed{seed}" / "passk.json"
    if path.exists():
        print(f"seed {seed}: pass@k done ({path})")
        return
    if not (step3 / "summary.json").exists():
        raise SystemExit(f"seed {seed}: no step-3 run at {step3}; run --stage rl first")
    records, cfg = held_out_problems(step3, args.passk_problems)
    t0 = time.time()
    result = {"problems": len(records), "sampling_seed": seed,
              "sft": pass_counts(step1, records, cfg, args.passk_samples, args.reward_workers, seed),
              "final": pass_counts(step3 / "actor", records, cfg, args.passk_samples, args.reward_workers, seed)}
    result["seconds"] = round(time.time() - t0, 1)
    path.write_text(json.dumps(result, indent=1))
    print(f"seed {seed}: pass@k counts written to {path} ({result['seconds']} s)")


# ---------------------------------------------------------------------------------------------- report
def policy_row(evaluation: dict) -> dict:
    row = {"reward": evaluation["program_score"], "pass_rate": evaluation["program_pass"],
           "tests_passed": evaluation["program_tests_passed"], "num_prompts": evaluation["num_prompts"]}
    row["verdicts"] = {v: evaluation[f"program_{v}"] for v in VERDICT_KEYS}
    return row


def seed_report(seed: int, args, work: Path) -> dict:
    from marlhf.eval.pass_at_k import pass_at_k

    step3 = work / f"seed{seed}" / "step3"
    summary = json.loads((step3 / "summary.json").read_text())
    cfg = json.loads((step3 / "args.json").read_text())
    rows = [json.loads(line) for line in (step3 / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["train/reward"] for r in rows if "train/reward" in r]
    w = min(args.curve_window, len(rewards))
    report = {
        "seed": seed,
        "steps": len(rewards),
        "config": {k: cfg[k] for k in ("advantage_estimator", "num_samples_per_prompt", "actor_learning_rate",
                                       "kl_ctl", "ppo_epochs", "temperature", "top_k", "max_answer_seq_len",
                                       "per_device_generation_batch_size", "data_path", "data_split", "data_seed")},
        "held_out": {"sft": policy_row(summary["initial_policy"]), "final": policy_row(summary["final_policy"])},
        "train_reward": {f"first_{w}": statistics.fmean(rewards[:w]), f"last_{w}": statistics.fmean(rewards[-w:])},
        "kl_final": summary["final_policy"].get("kl"),
    }
    passk = work / f"seed{seed}" / "passk.json"
    if passk.exists():
        counts = json.loads(passk.read_text())
        report["pass_at_k"] = {"problems": counts["problems"], "n": counts["sft"]["n"]}
        for policy in ("sft", "final"):
            c, n = counts[policy]["correct"], counts[policy]["n"]
            report["pass_at_k"][policy] = {f"pass@{k}": statistics.fmean(pass_at_k(n, ci, k) for ci in c)
                                           for k in args.k if k <= n}
            report["pass_at_k"][policy]["mean_reward"] = counts[policy]["mean_reward"]
            report["pass_at_k"][policy]["verdicts"] = counts[policy]["verdicts"]
            report["pass_at_k"][policy]["forms"] = counts[policy]["forms"]
            report["pass_at_k"][policy]["examples"] = counts[policy]["examples"]
    return report


def verdict(seeds: list[dict]) -> str:
    up = [s["held_out"]["final"]["reward"] > s["held_out"]["sft"]["reward"] for s in seeds]
    passes = [s["held_out"]["final"]["pass_rate"] > s["held_out"]["sft"]["pass_rate"] for s in seeds]
    return (f"held-out reward raised in {sum(up)} of {len(up)} seeds, pass rate raised in {sum(passes)} of "
            f"{len(passes)}")


def markdown(report: dict) -> str:
    lines = ["# Step 3 with program-test rewards on the tiny code task", "",
             "Generated by `python scripts/bench_code_task.py` (" + report["machine"] + "). The embedded tiny "
             "model (3.9M parameters) fine-tuned on `synthetic_code` (step 1), then step 3 with "
             "`--reward_source program_tests` (B.5 rewards: 1.0 all tests pass, -0.3 + 1.3 * passed/total if it "
             "runs, -0.6 runtime error, -1.0 syntax error), both by the tiny code launch scripts. Held-out: "
             "problems of step 3's held-out slice (never trained on), answers sampled at the training "
             "temperature under the same seed before and after.", "",
             f"**{report['verdict']}.**", "",
             "| seed | steps | policy | reward | pass rate | tests passed | wrong answer | runtime err | "
             "syntax err | pass@1 | pass@k |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["seeds"]:
        for policy, label in (("sft", "SFT"), ("final", "step 3")):
            h = s["held_out"][policy]
            pk = s.get("pass_at_k", {}).get(policy, {})
            ks = [k for k in pk if k.startswith("pass@") and k != "pass@1"]
            lines.append(f"| {s['seed']} | {s['steps']} | {label} | {h['reward']:+.3f} | {h['pass_rate']:.3f} | "
                         f"{h['tests_passed']:.3f} | {h['verdicts']['wrong_answer']:.3f} | "
                         f"{h['verdicts']['runtime_error']:.3f} | {h['verdicts']['compile_error']:.3f} | "
                         f"{pk.get('pass@1', float('nan')):.3f} | "
                         + ", ".join(f"{k} {pk[k]:.3f}" for k in ks) + " |")
    first = report["seeds"][0]
    lines += ["", f"Held-out columns: {first['held_out']['sft']['num_prompts']:.0f} problems, one answer each "
              "(step 3's `summary.json`). pass@k: " + (
                  f"{first['pass_at_k']['problems']} held-out problems x n = {first['pass_at_k']['n']} answers, "
                  "unbiased estimator (Chen et al. 2021)." if "pass_at_k" in first else "not run."),
              *answer_lines(report["seeds"]),
              "", "Training reward (batch mean, first vs last steps): " + "; ".join(
                  f"seed {s['seed']}: " + " -> ".join(f"{v:+.3f}" for v in s["train_reward"].values())
                  for s in report["seeds"]) + ".",
              "", "Step-3 configuration: " + ", ".join(f"`{k}` {v}" for k, v in first["config"].items()) + "."]
    return "\n".join(lines) + "\n"


def answer_lines(seeds: list[dict]) -> list[str]:
    """The pass@k answers by form (reference program / the demonstrations' off-by-one bug / other) and the
    first answers of the first seed, before and after."""
    if not all("forms" in s.get("pass_at_k", {}).get("sft", {}) for s in seeds):
        return []

    def forms(f: dict) -> str:
        return ", ".join(f"{k} {f[k]:.3f}" for k in ANSWER_FORMS)

    lines = ["", "What the pass@k answers are (share of all answers whose program is the problem's reference "
             "program, the SFT data's bug — the same program with the result off by one — or anything else):", ""]
    lines += [f"- seed {s['seed']}: SFT {forms(s['pass_at_k']['sft']['forms'])}; step 3 "
              f"{forms(s['pass_at_k']['final']['forms'])}" for s in seeds]
    first = seeds[0]
    lines += ["", f"First answers of seed {first['seed']} (newlines as `;`):", "",
              "| problem | SFT answer | verdict | step-3 answer | verdict |", "|---|---|---|---|---|"]
    for before, after in zip(first["pass_at_k"]["sft"]["examples"], first["pass_at_k"]["final"]["examples"]):
        def code(ex):
            return "`" + "; ".join(ex["answer"].strip().splitlines()).replace("|", "\\|") + "`"
        lines.append(f"| {before['problem']} | {code(before)} | {before['verdict']} | {code(after)} | "
                     f"{after['verdict']} |")
    return lines


def stage_report(args, work: Path) -> dict:
    seeds = [seed_report(s, args, work) for s in args.seeds]
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}",
              "verdict": verdict(seeds), "seeds": seeds}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"written: {out} and {out.with_suffix('.md')}")
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    stages = STAGES if args.stage == "all" else (args.stage,)
    for seed in args.seeds:
        for stage, fn in (("sft", stage_sft), ("rl", stage_rl), ("passk", stage_passk)):
            if stage in stages:
                fn(seed, args, work)
    if "report" in stages:
        stage_report(args, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
