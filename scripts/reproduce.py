#!/usr/bin/env python
"""The reproduction benchmark: PPO vs MA-PPO variants vs critic-free baselines, multi-seed, on the embedded task.

Does MA-PPO reach vanilla PPO's held-out score in fewer steps, and end higher (paper §4.2–4.5, Figs 2/5/6,
Table 7)?  Every variant trains from the same SFT model on the same prompts for the same number of steps,
under two reward settings — the gold scorer as the reward (credit assignment without reward-model error)
and the reward model (the paper's setting, where over-optimisation shows as RM up, gold down) — with
held-out gold score, RM score, KL and length recorded every ``--eval_interval`` steps.

    python scripts/reproduce.py                      # the full sweep (resumable: rerun to continue)
    python scripts/reproduce.py --quick              # minutes: 2 variants x 2 seeds x a few steps
    python scripts/reproduce.py --report_only        # regenerate docs/results.md from the recorded runs

1. steps 1–2 once (the quick start's launch scripts; or ``--sft`` / ``--rm`` to reuse models),
2. one step-3 run per (reward, variant, seed) through the tiny step-3 launch script, skipped when its
   ``summary.json`` exists and resumed from its checkpoints when it was interrupted,
3. the report (``--report``, default docs/results.md) from the recorded runs only.
The data split is fixed (``--data_seed``) across all runs; ``--seed`` varies the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from marlhf.config import RLHFArgs  # noqa: E402
from marlhf.eval import sweep  # noqa: E402
from marlhf.eval.results_report import write_report  # noqa: E402

FULL = dict(variants=list(sweep.VARIANTS), rewards=["gold", "rm"], seeds=[1, 2, 3], steps=40, eval_interval=5,
            eval_samples=64)
QUICK = dict(variants=["ppo", "n5"], rewards=["gold"], seeds=[1, 2], steps=3, eval_interval=1, eval_samples=8)
QUICK_BASE_STEPS = 30  # optimizer steps of steps 1 and 2 in --quick (the full sweep uses the quick start's)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/repro", help="Root of the sweep's runs.")
    p.add_argument("--quick", action="store_true", help="A few minutes: " + json.dumps(QUICK))
    p.add_argument("--variants", nargs="+", help=f"Default: all of {list(sweep.VARIANTS)}.")
    p.add_argument("--rewards", nargs="+", choices=list(sweep.REWARDS), help="Default: gold rm.")
    p.add_argument("--seeds", type=int, nargs="+", help="Default: 1 2 3.")
    p.add_argument("--steps", type=int, help="Step-3 PPO steps per run (default 40).")
    p.add_argument("--eval_interval", type=int, help="Held-out evaluation every k steps (default 5).")
    p.add_argument("--eval_samples", type=int, help="Held-out prompts per evaluation (default 64).")
    p.add_argument("--sft", help="SFT model to start from (default: run step 1 under --out/base).")
    p.add_argument("--rm", help="Reward model (default: run step 2 under --out/base).")
    p.add_argument("--report", default=str(REPO / "docs" / "results.md"), help="Markdown report to write.")
    p.add_argument("--report_only", action="store_true", help="Write the report from finished runs; train nothing.")
    p.add_argument("--dry_run", action="store_true", help="Print the commands, run nothing.")
    p.add_argument("--lock", help="Take this file lock (flock) around each run, so other heavy jobs on a shared "
                   "machine interleave between runs instead of skewing their timings.")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def run(cmd: list[str], env: dict, log_path: Path, dry: bool, lock: str | None = None) -> None:
    print("$ " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd), flush=True)
    if dry:
        return
    with open(lock, "a") if lock else contextlib.nullcontext() as held:
        if held is not None:
            fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        proc = subprocess.run(cmd, env={**os.environ, **env}, cwd=REPO)
    if proc.returncode != 0:  # the runs before it are kept: rerun to continue
        raise SystemExit(f"failed with exit code {proc.returncode}: see {log_path}")


def base_models(args, root: Path) -> tuple[str, str, list[str]]:
    """SFT and reward model paths, training them once (steps 1–2 of the quick start) unless given."""
    base = root / "base"
    commands = []
    if not (args.sft and args.rm):
        extra = [f"--extra_args=--max_steps={QUICK_BASE_STEPS}"] if args.quick else []
        steps = [s for s, given in ((1, args.sft), (2, args.rm)) if not given]
        cmd = [sys.executable, "scripts/e2e_rlhf.py", "--output_dir", str(base), "--step", *map(str, steps), *extra]
        env = {"MODEL_PATH": args.sft} if args.sft else {}
        commands.append(shlex.join(["python", *cmd[1:]]))
        if not (base / "summary.json").exists() and not args.report_only:
            run(cmd, env, base / "step1" / "training.log", args.dry_run, args.lock)
    return args.sft or str(base / "step1"), args.rm or str(base / "step2"), commands


def step3_command(spec: sweep.RunSpec, args, sft: str, rm: str) -> tuple[list[str], dict]:
    variant = sweep.VARIANTS[spec.variant]
    reward_flags, _ = sweep.REWARDS[spec.reward]
    extra = [*variant.flags, *reward_flags, "--seed", str(spec.seed), "--data_seed", "1234",
             "--max_steps", str(args.steps), "--eval_interval", str(args.eval_interval),
             "--max_eval_samples", str(args.eval_samples), "--save_steps", str(args.eval_interval), "--resume"]
    if spec.reward == "gold":  # the critic learns gold returns from a new head on the SFT model (a reward
        # model's head starts on the wrong scale and steers the first updates); the RM still scores held-out
        extra += ["--critic_model_name_or_path", sft, "--reward_model_name_or_path", rm]
    env = {"ACTOR_MODEL_PATH": sft, "CRITIC_MODEL_PATH": rm, "EXTRA_ARGS": " ".join(extra)}
    cmd = ["bash", "training/step3_rlhf_finetuning/training_scripts/tiny/run_tiny.sh", str(spec.out)]
    return cmd, env


def main(argv=None) -> int:
    args = parse_args(argv)
    root = Path(args.out).resolve()
    known = {f.name for f in fields(RLHFArgs)}
    unavailable = {v: sweep.VARIANTS[v].needs for v in args.variants if not sweep.VARIANTS[v].available(known)}
    variants = [v for v in args.variants if v not in unavailable]
    for v, needs in unavailable.items():  # said, not silently dropped; the report lists them too
        print(f"variant {v!r} cannot run in this build: step 3 has no {', '.join(needs)} flag", file=sys.stderr)
    sft, rm, commands = base_models(args, root)
    specs = sweep.plan(root, args.rewards, variants, args.seeds)
    todo = sweep.missing(specs)
    print(f"{len(specs)} runs, {len(specs) - len(todo)} done, {len(todo)} to run", flush=True)
    for i, spec in enumerate(specs):
        cmd, env = step3_command(spec, args, sft, rm)
        if i == 0 or (spec.reward, spec.variant) != (specs[i - 1].reward, specs[i - 1].variant):
            # one line per variant for the report, the seed as a shell variable
            line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)
            line = line.replace(f"--seed {spec.seed} ", "--seed $SEED ").replace(f"/seed{spec.seed}", "/seed$SEED")
            commands.append(f"for SEED in {' '.join(map(str, args.seeds))}; do {line}; done")
        if spec.done or args.report_only:
            continue
        t0 = time.time()
        run(cmd, env, spec.out / "training.log", args.dry_run, args.lock)
        print(f"[{specs.index(spec) + 1}/{len(specs)}] {spec.reward}/{spec.variant}/seed{spec.seed}: "
              f"{time.time() - t0:.0f} s", flush=True)
    if args.dry_run:
        return 0
    results = sweep.collect(specs)
    settings = {k: getattr(args, k) for k in ("steps", "eval_interval", "eval_samples", "seeds", "rewards")}
    invocation = shlex.join(["python", "scripts/reproduce.py", *(sys.argv[1:] if argv is None else argv)])
    path = write_report(Path(args.report), results, settings=settings, commands=commands,
                        missing=[f"{s.reward}/{s.variant}/seed{s.seed}" for s in sweep.missing(specs)],
                        unavailable=unavailable, invocation=invocation)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
