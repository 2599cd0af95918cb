"""Run the whole pipeline — step 1 (SFT) → step 2 (reward model) → step 3 (MA-PPO) — with one command.

Like DeepSpeed-Chat's ``e2e_rlhf.py``: each step is its own launch script
(``training/step*/training_scripts/<family>/run_<size>.sh``), run one after the other, each step's output
feeding the next.  The default runs the embedded tiny model on the synthetic task on this machine's CPU:

    marlhf quickstart
    marlhf quickstart --size gemma-2b --task tldr --output_dir /data/runs/gemma2b

It ends with a summary: the SFT policy vs the final policy on held-out prompts (reward-model score, and
the gold score where the task has one), plus the step-1 perplexity and step-2 accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: marlhf/cli/quickstart.py
STEP_DIRS = {1: "step1_supervised_finetuning", 2: "step2_reward_model_finetuning", 3: "step3_rlhf_finetuning"}
SIZES = {  # --size -> (family folder, script name)
    "tiny": ("tiny", "run_tiny.sh"),
    "tiny-2ranks": ("tiny", "run_tiny_2ranks.sh"),
    "gemma-2b": ("gemma", "run_2b.sh"),
    "gemma-7b": ("gemma", "run_7b.sh"),
    "gemma2-27b": ("gemma2", "run_27b.sh"),
    "codegemma-2b": ("codegemma", "run_2b.sh"),
    "codegemma-7b": ("codegemma", "run_7b.sh"),
    "llama3.2-3b": ("llama3.2", "run_3b.sh"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=sorted(SIZES), help="Model family/size of the launch scripts.")
    p.add_argument("--step", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3], help="Steps to run.")
    p.add_argument("--output_dir", default="runs/quickstart", help="Root; steps write step1/, step2/, step3/.")
    p.add_argument("--task", default=None, help="TASK of the launch scripts (tldr, hh, webgpt, apps).")
    p.add_argument("--actor_model", default=None, help="Step-3 actor (default: <output_dir>/step1).")
    p.add_argument("--reward_model", default=None, help="Step-3 critic/reward (default: <output_dir>/step2).")
    p.add_argument("--zero_stage", default=None, help="ZeRO stage passed to every step's script.")
    p.add_argument("--termination_condition", default=None, help="Step-3 macro-action rule (default: script's).")
    p.add_argument("--ngram", default=None, help="Step-3 n of the fixed rule (1 = vanilla PPO).")
    p.add_argument("--extra_args", action="append", default=[],
                   help="An extra flag for every step, repeatable, e.g. --extra_args=--max_steps=5 ('=' forms).")
    return p.parse_args(argv)


def script_for(step: int, size: str) -> Path:
    if not (REPO / "training" / "launch_common.sh").exists():
        raise SystemExit("marlhf quickstart runs the launch scripts of a checkout (training/step*/training_scripts), "
                         f"which this install ({REPO}) lacks: clone the repository and `pip install -e .` in it. "
                         "The steps themselves need no checkout: marlhf sft | rm | ppo.")
    family, name = SIZES[size]
    path = REPO / "training" / STEP_DIRS[step] / "training_scripts" / family / name
    if not path.exists():
        raise SystemExit(f"step {step} has no launch script for size {size!r} ({path})")
    return path


def run_step(step: int, args, root: Path) -> float:
    out = root / f"step{step}"
    env = dict(os.environ)
    if args.task:
        env["TASK"] = args.task
    if step == 3:
        env["ACTOR_MODEL_PATH"] = args.actor_model or str(root / "step1")
        env["CRITIC_MODEL_PATH"] = args.reward_model or str(root / "step2")
        if args.termination_condition:
            env["TERMINATION"] = args.termination_condition
        if args.ngram:
            env["NGRAM"] = args.ngram
    elif step == 2:
        env.setdefault("MODEL_PATH", str(root / "step1"))
    if args.extra_args:
        env["EXTRA_ARGS"] = " ".join([env.get("EXTRA_ARGS", ""), *args.extra_args]).strip()
    cmd = ["bash", str(script_for(step, args.size)), str(out)] + ([args.zero_stage] if args.zero_stage else [])
    print(f"\n=== step {step}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"step {step} failed with exit code {proc.returncode}; see {out}/training.log")
    return time.time() - t0


def last_metric(folder: Path, key: str):
    path = folder / "metrics.jsonl"
    if not path.exists():
        return None
    values = [json.loads(line).get(key) for line in path.read_text().splitlines() if line.strip()]
    values = [v for v in values if v is not None]
    return values[-1] if values else None


def summarize(root: Path, seconds: dict[int, float]) -> dict:
    summary = {"seconds": {f"step{k}": round(v, 1) for k, v in seconds.items()},
               "step1_final_perplexity": last_metric(root / "step1", "eval/perplexity"),
               "step2_final_accuracy": last_metric(root / "step2", "eval/accuracy")}
    s3 = root / "step3" / "summary.json"
    if s3.exists():
        summary.update(json.loads(s3.read_text()))
    return summary


def print_summary(summary: dict) -> None:
    print("\n=== summary")
    for key, seconds in summary["seconds"].items():
        print(f"{key}: {seconds:.0f} s")
    if summary.get("step1_final_perplexity") is not None:
        print(f"step 1 held-out perplexity: {summary['step1_final_perplexity']:.2f}")
    if summary.get("step2_final_accuracy") is not None:
        print(f"step 2 held-out pair accuracy: {summary['step2_final_accuracy']:.3f}")
    before, after = summary.get("initial_policy"), summary.get("final_policy")
    if before and after:
        print(f"{'held-out prompts':<22}{'SFT policy':>12}{'final policy':>14}")
        # each score's standard error over the answers follows it (what a difference is worth), and the gold
        # score's components (gold_coverage, ...) its total: why a policy scores what it does
        totals = ["rm_score", "rm_score_se", "gold_score", "gold_score_se"]
        keys = totals + [k for k in before if k.startswith("gold_") and k not in totals]
        for key in keys + ["response_len", "eos_rate"]:
            if key in before and key in after:
                print(f"{key:<22}{before[key]:>12.3f}{after[key]:>14.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    root = Path(args.output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    seconds = {}
    for step in sorted(args.step):
        seconds[step] = run_step(step, args, root)
    summary = summarize(root, seconds)
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    models = [root / f"step{k}" for k in (1, 2) if k in seconds] + ([root / "step3/actor"] if 3 in seconds else [])
    print(f"\nwritten: {root / 'summary.json'}; models: {', '.join(map(str, models))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
