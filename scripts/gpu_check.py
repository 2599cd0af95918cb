"""The GPU confirmation run: the three steps on one CUDA device, in the precisions and ZeRO stages users run.

docs/gpu.md lists what was fixed for GPU nodes from reading DeepSpeed's source and testing on CPU; this
script is the run that confirms it on a GPU.  Each check is one `marlhf` process on the embedded task,
small enough that the whole run takes a few minutes on one GPU:

    sft_bf16_z2     step 1 from the embedded model, bf16, ZeRO-2
    rm_bf16_z2      step 2 from the embedded model, bf16, ZeRO-2
    ppo_bf16_z2     step 3 from --actor / --reward, bf16, ZeRO-2 (held-out gold and RM score before/after)
    ppo_bf16_z3     step 3, bf16, actor and critic ZeRO-3 (generation gathers the partitioned actor)
    ppo_fp16_z2     step 3, fp16 with DeepSpeed's loss scaling (overflow steps counted apart)
    ppo_offload_ref step 3, bf16, reference and reward models as ZeRO-3 engines with parameters on the CPU
    hybrid_refused  step 3 with --enable_hybrid_engine on a Llama actor: must stop before loading, naming why
    generate_auto   `marlhf generate --device auto --dtype auto` (must pick cuda and bf16)

and, on --ranks GPUs (default 2; 1 skips them), what one process cannot show:

    rm_bf16_z3_accum2   step 2 at ZeRO-3 with gradient accumulation 2 (the forward through the engine)
    ppo_bf16_z3_ranks   step 3, actor and critic ZeRO-3, accumulation 2, EMA, a checkpoint, the critic against
                        Monte-Carlo values: answers of different lengths per rank, parameters gathered once
    ppo_synced_ranks    the same with --zero3_generation synced (layers fetched per token, ranks in step)

    python scripts/gpu_check.py --actor STEP1_DIR --reward STEP2_DIR --out /tmp/gpu_check \\
        --report docs/results/gpu_check.md

Without --actor / --reward, step 3 starts from this run's own (short) steps 1 and 2.  A check that fails does
not stop the others; the report gives each one's result, numbers and the tail of a failing log.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file from anywhere: marlhf from this checkout
from marlhf.utils.tracking import read_metrics  # noqa: E402

TASK = ["--data_path", "synthetic", "--task", "synthetic", "--data_split", "2,4,4", "--num_padding_at_beginning", "0"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="Folder for the runs, their logs and report.json.")
    p.add_argument("--actor", default="", help="Step-1 model for step 3 (default: this run's sft_bf16_z2).")
    p.add_argument("--reward", default="", help="Step-2 model for step 3 (default: this run's rm_bf16_z2).")
    p.add_argument("--steps", type=int, default=30, help="PPO steps of ppo_bf16_z2 (the others run fewer).")
    p.add_argument("--eval_prompts", type=int, default=128, help="Held-out prompts scored before and after.")
    p.add_argument("--timeout", type=float, default=150, help="Seconds each check may run.")
    p.add_argument("--only", nargs="+", help="Run these checks only (names above).")
    p.add_argument("--report", help="Also write the markdown report here.")
    p.add_argument("--allow_cpu", action="store_true", help="Run without a CUDA device (to try the script).")
    p.add_argument("--ranks", type=int, default=2,
                   help="GPUs of the multi-rank checks (deepspeed --num_gpus); 1 skips them.")
    return p.parse_args(argv)


def step3_flags(actor: str, reward: str, out: Path, steps: int, eval_prompts: int, dtype: str, stage: int,
                extra: list[str] = ()) -> list[str]:
    """The tiny step-3 run of training/step3_rlhf_finetuning/training_scripts/tiny (MA-PPO, n = 5) at DTYPE and
    ZeRO STAGE for both trained models."""
    return ["ppo", *TASK, "--actor_model_name_or_path", actor, "--critic_model_name_or_path", reward,
            "--per_device_generation_batch_size", "16", "--per_device_training_batch_size", "16",
            "--max_prompt_seq_len", "192", "--max_answer_seq_len", "64", "--max_steps", str(steps),
            "--actor_learning_rate", "1e-4", "--critic_learning_rate", "1e-4", "--num_warmup_steps", "3",
            "--kl_ctl", "0.5", "--clip_reward_value", "100", "--whiten_advantages",
            "--termination_condition", "fixed", "--ngram", "5", "--eval_interval", "0",
            "--max_eval_samples", str(eval_prompts), "--eval_prompts", "validation", "--seed", "1234",
            "--dtype", dtype, "--actor_zero_stage", str(stage), "--critic_zero_stage", str(stage),
            "--deepspeed", "--output_dir", str(out), *extra]


def supervised_flags(step: str, out: Path, steps: int) -> list[str]:
    """Step 1 or 2 from the embedded model, bf16, ZeRO-2, STEPS optimizer steps."""
    lr = "1e-3" if step == "sft" else "5e-4"
    return [step, *TASK, "--max_seq_len", "256", "--per_device_train_batch_size", "16",
            "--per_device_eval_batch_size", "16", "--learning_rate", lr, "--num_train_epochs", "12",
            "--max_steps", str(steps), "--max_eval_samples", "128", "--lr_scheduler_type", "cosine",
            "--warmup_ratio", "0.1", "--zero_stage", "2", "--dtype", "bf16", "--deepspeed",
            "--output_dir", str(out)]


def plan(args) -> list[dict]:
    """The checks, in order: name, marlhf arguments, what success means."""
    out = Path(args.out)
    actor = args.actor or str(out / "sft_bf16_z2")
    reward = args.reward or str(out / "rm_bf16_z2")
    short = max(1, min(args.steps, 10))
    checks = [
        dict(name="sft_bf16_z2", argv=supervised_flags("sft", out / "sft_bf16_z2", 100), expect="ok"),
        dict(name="rm_bf16_z2", argv=supervised_flags("rm", out / "rm_bf16_z2", 60), expect="ok"),
        dict(name="ppo_bf16_z2", argv=step3_flags(actor, reward, out / "ppo_bf16_z2", args.steps,
                                                  args.eval_prompts, "bf16", 2), expect="ok"),
        dict(name="ppo_bf16_z3", argv=step3_flags(actor, reward, out / "ppo_bf16_z3", short, 32, "bf16", 3),
             expect="ok"),
        dict(name="ppo_fp16_z2", argv=step3_flags(actor, reward, out / "ppo_fp16_z2", short, 32, "fp16", 2),
             expect="ok"),
        dict(name="ppo_offload_ref", argv=step3_flags(actor, reward, out / "ppo_offload_ref", 5, 32, "bf16", 2,
                                                      ["--offload_reference_model"]), expect="ok"),
        dict(name="hybrid_refused", argv=step3_flags(actor, reward, out / "hybrid_refused", 2, 32, "bf16", 2,
                                                     ["--enable_hybrid_engine"]),
             expect="refused", needle="--enable_hybrid_engine cannot run the actor"),
        dict(name="generate_auto", argv=["generate", "--model", actor, *TASK[:2], "--split", "eval",
                                         "--max_prompts", "64", "--device", "auto", "--dtype", "auto",
                                         "--output", str(out / "generate_auto" / "answers.jsonl")],
             expect="ok"),
    ]
    if args.ranks > 1:  # per rank: generation batch 8, micro-batches of 4, two per optimizer step
        ranks = ["--per_device_generation_batch_size", "8", "--per_device_training_batch_size", "4",
                 "--gradient_accumulation_steps", "2"]
        z3 = [*ranks, "--enable_ema", "--save_steps", "2", "--critic_mc_check", "1"]
        rm = supervised_flags("rm", out / "rm_bf16_z3_accum2", 20)
        rm[rm.index("--zero_stage") + 1] = "3"
        rm[rm.index("--per_device_train_batch_size") + 1] = "8"
        checks += [
            dict(name="rm_bf16_z3_accum2", argv=[*rm, "--gradient_accumulation_steps", "2"], expect="ok",
                 ranks=args.ranks),
            dict(name="ppo_bf16_z3_ranks", argv=step3_flags(actor, reward, out / "ppo_bf16_z3_ranks", 4, 32, "bf16", 3,
                                                            z3), expect="ok", ranks=args.ranks),
            dict(name="ppo_synced_ranks", argv=step3_flags(actor, reward, out / "ppo_synced_ranks", 2, 32, "bf16", 3,
                                                           [*z3, "--zero3_generation", "synced"]),
                 expect="ok", ranks=args.ranks),
        ]
    if args.only:
        unknown = set(args.only) - {c["name"] for c in checks}
        if unknown:
            raise SystemExit(f"gpu_check: no check named {sorted(unknown)}; the checks: {[c['name'] for c in checks]}")
        checks = [c for c in checks if c["name"] in args.only]
    return checks


def command(check: dict) -> list[str]:
    """A check's command line: ``python -m marlhf STEP ...`` on one GPU, the ``deepspeed`` launcher beside this
    interpreter for a multi-rank check (``--module marlhf.cli.STEP``)."""
    step, *argv = check["argv"]
    ranks = check.get("ranks", 1)
    if ranks == 1:
        return [sys.executable, "-m", "marlhf", step, *argv]
    launcher = Path(sys.executable).parent / "deepspeed"
    return [str(launcher), "--num_gpus", str(ranks), "--module", f"marlhf.cli.{step}", *argv]


def numbers(name: str, run_dir: Path) -> dict:
    """The figures a check's output folder holds: last losses for steps 1-2; for step 3 the held-out scores
    before and after, the first step's importance ratio (1 up to the precision's rounding: one PPO epoch on
    the answers just sampled), skipped / overflow steps and the median seconds per step and of generation."""
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    train = [r for r in rows if any(k.startswith("train/") for k in r)]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    got: dict = {}
    if name.startswith(("sft", "rm")) and train:
        got["steps"] = train[-1]["step"]
        got["first_loss"] = train[0]["train/loss"]
        got["last_loss"] = train[-1]["train/loss"]
        if evals:
            got.update({k.split("/", 1)[1]: v for k, v in evals[-1].items() if k.startswith("eval/")})
    if name.startswith(("ppo", "hybrid")) and train:
        got["steps"] = train[-1]["step"]
        got["ratio_mean_step1"] = train[0].get("train/ratio_mean")
        got["approx_kl_step1"] = train[0].get("train/approx_kl")
        got["overflow_steps"] = sum(r.get("train/overflow_steps", 0) for r in train)
        got["skipped_steps_total"] = train[-1].get("train/skipped_steps_total")
        got["step_seconds_median"] = statistics.median(r["train/step_seconds"] for r in train)
        got["gen_seconds_median"] = statistics.median(r["train/gen_seconds"] for r in train)
        got["last_kl"] = train[-1].get("train/kl")
        got["last_critic_loss"] = train[-1].get("train/critic_loss")
        if "train/mc_continuations" in train[-1]:  # --critic_mc_check
            got["mc_continuations"] = train[-1]["train/mc_continuations"]
            got["critic_mc_corr"] = train[-1].get("train/critic_mc_corr")
        got["checkpoint"] = (run_dir / "checkpoints" / "latest").exists()
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        for when in ("initial_policy", "final_policy"):
            if when in s:
                for k in ("gold_score", "gold_score_se", "rm_score", "eos_rate", "kl"):
                    if k in s[when]:
                        got[f"{when.split('_')[0]}_{k}"] = s[when][k]
    answers = run_dir / "answers.jsonl"
    if answers.exists():
        got["answers"] = sum(1 for line in answers.read_text().splitlines() if line.strip())
    return got


def judge(check: dict, rc: int | None, log: str, got: dict) -> tuple[bool, str]:
    """Whether a check did what it should, and why not."""
    if rc is None:
        return False, "timed out"
    if check["expect"] == "refused":
        if rc == 0:
            return False, "ran, but should have been refused"
        if check["needle"] not in log:
            return False, f"stopped (rc {rc}) without the expected message {check['needle']!r}"
        return True, "refused as expected"
    if rc != 0:
        return False, f"exit status {rc}"
    name = check["name"]
    if name.startswith(("sft", "rm")):
        if not got.get("steps"):
            return False, "no training steps recorded"
        if not got["last_loss"] < got["first_loss"]:
            return False, f"loss did not fall ({got['first_loss']:.4f} -> {got['last_loss']:.4f})"
    if name.startswith("ppo"):
        if not got.get("steps"):
            return False, "no PPO steps recorded"
        if got.get("skipped_steps_total"):
            return False, f"{got['skipped_steps_total']:.0f} non-finite steps skipped"
        if "final_gold_score" not in got:
            return False, "no final evaluation"
        if name.endswith("_ranks") and not (got.get("checkpoint") and got.get("mc_continuations")):
            return False, "no checkpoint or no Monte-Carlo check of the critic recorded"
    if name == "generate_auto":
        if not got.get("answers"):
            return False, "no answers written"
        if "cuda" not in log or "bfloat16" not in log:
            return False, "did not report generating on cuda in bfloat16"
    return True, "ok"


def environment() -> dict:
    import torch
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    for name in ("transformers", "deepspeed"):
        try:
            env[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - reported, not raised: the checks say the rest
            env[name] = f"not importable: {e}"
    if env["cuda"]:
        env["device"] = torch.cuda.get_device_name(0)
        env["bf16"] = torch.cuda.is_bf16_supported()
        env["cuda_runtime"] = torch.version.cuda
    return env


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def report(env: dict, results: list[dict]) -> str:
    lines = ["# GPU confirmation run", "",
             "`scripts/gpu_check.py` (the embedded task: tiny Llama actor and reward model, 16 prompts per PPO step, "
             "answers <= 64 tokens). " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".", "",
             "| check | result | seconds | numbers |", "|---|---|---|---|"]
    for r in results:
        nums = "; ".join(f"{k} {fmt(v)}" for k, v in r["numbers"].items())
        lines.append(f"| {r['name']} | {'✔' if r['ok'] else '✘'} {r['why']} | {r['seconds']:.0f} | {nums} |")
    for r in results:
        if not r["ok"]:
            lines += ["", f"## {r['name']}: {r['why']}", "", "```", r["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    env = environment()
    if not env["cuda"] and not args.allow_cpu:
        raise SystemExit("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); this script "
                         "confirms the GPU paths and runs on a GPU node (--allow_cpu to try it on a CPU)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("environment:", json.dumps(env), flush=True)
    results = []
    for check in plan(args):
        cmd = command(check)
        log_path = out / f"{check['name']}.log"
        t0 = time.time()
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=args.timeout,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
            except subprocess.TimeoutExpired:
                rc = None
        seconds = time.time() - t0
        text = log_path.read_text(errors="replace")
        run_dir = out / check["name"]
        got = numbers(check["name"], run_dir)
        ok, why = judge(check, rc, text, got)
        result = dict(name=check["name"], ok=ok, why=why, rc=rc, seconds=seconds, numbers=got,
                      command=" ".join(cmd), log_tail="\n".join(text.splitlines()[-25:]))
        results.append(result)
        print(f"{check['name']}: {'ok' if ok else 'FAILED'} ({why}) in {seconds:.0f} s; "
              + ", ".join(f"{k} {fmt(v)}" for k, v in got.items()), flush=True)
        (out / "report.json").write_text(json.dumps(dict(environment=env, results=results), indent=1))
    text = report(env, results)
    (out / "report.md").write_text(text)
    if args.report:
        Path(args.report).write_text(text)
    failed = [r["name"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
