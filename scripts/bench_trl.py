#!/usr/bin/env python
"""Step-3 cost against TRL's GRPOTrainer, side by side on one machine (issue 30 §3).

Both sides train the same model (SmolLM2-135M-Instruct, fp32, dropout off) on the same prompts (single-turn
HH-RLHF prompts of at most --prompt_len tokens, as raw text), K answers of at most --answer_len tokens per
optimizer step, sampled at temperature 1 from the full distribution, one PPO epoch and one optimizer step per
batch.  The reward is a cheap Python function (:func:`word_count_reward`), the same on both sides, so what is
timed is the engines' work.  Configurations (``--configs``):

  ours_grpo     ``marlhf ppo --advantage_estimator grpo``: K answers to one prompt, β = 0 (no reference forward)
  ours_grpo_kl  the same at β = 0.05 with the KL in the reward (per token, DeepSpeed-Chat's): a reference forward,
                and a policy forward before the update (the KL rewards need log π_old before it)
  ours_grpo_kl_loss  β = 0.05 with the KL as a loss term (``--kl_penalty loss``, as TRL): the reference forward only
  ours_ma_ppo   MA-PPO over 5-grams with its critic (started from the same model): K prompts × 1 answer, β = 0.05
  trl_grpo      TRL's ``GRPOTrainer``, ``num_generations`` = K, β = 0 (no reference model)
  trl_grpo_kl   the same at β = 0.05 (the reference model's forward)

Each configuration runs in a process of its own for --steps optimizer steps, the first --warmup of them not
timed; the configurations run round-robin for --rounds rounds (the order reversed every other round), so other
load hits them alike.  A step's seconds are wall-clock, generation included: ours ``train/step_seconds`` of the
run's ``metrics.jsonl``, TRL's a callback around each optimizer step (its generation happens inside the step).
Reported: the median over every timed step of every round, the spread of the per-round medians, the mean answer
length (the two sides sample different answers, so seconds per 1,000 generated tokens too), and each
configuration's ratio of medians to TRL's GRPO at the same β.

    pip install -r requirements-bench.txt   # TRL: not a dependency of the project, only of this benchmark
    python scripts/convert_smollm2.py       # once
    python scripts/bench_trl.py [--rounds 4] [--steps 5] [--warmup 2] [--out docs/results/cost_vs_trl.json] \
        [--report_only]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HH = Path(os.environ.get("MARLHF_SHARED", REPO.parent / "shared")) / "data/hh-rlhf/harmless-base-test-part.jsonl.gz"
CONFIGS = ("ours_grpo", "ours_grpo_kl", "ours_grpo_kl_loss", "ours_ma_ppo", "trl_grpo", "trl_grpo_kl")
BETA = {"ours_grpo": 0.0, "ours_grpo_kl": 0.05, "ours_grpo_kl_loss": 0.05, "ours_ma_ppo": 0.05, "trl_grpo": 0.0,
        "trl_grpo_kl": 0.05}
ASSISTANT = "\n\nAssistant:"


def word_count_reward(prompts=None, responses=None, meta=None, completions=None, **_) -> list[float]:
    """Minus the distance of the answer's word count from 30, over 30: cheap and the same on both sides (ours
    passes ``responses``, TRL ``completions``)."""
    answers = responses if responses is not None else completions
    return [-abs(len(a.split()) - 30) / 30 for a in answers]


def write_prompts(tokenizer, path: Path, count: int, max_tokens: int) -> int:
    """The first ``count`` single-turn prompts of the HH slice with at most ``max_tokens`` tokens, as a jsonl
    of prompt / chosen / rejected (step 3 reads the prompt only)."""
    if not HH.exists():
        raise SystemExit(f"{HH}: the HH-RLHF slice is not there (set MARLHF_SHARED to the folder holding data/)")
    rows = []
    with gzip.open(HH, "rt") as f:
        for line in f:
            chosen = json.loads(line)["chosen"]
            cut = chosen.rfind(ASSISTANT)
            prompt = chosen[:cut + len(ASSISTANT)]
            if prompt.count("Human:") != 1 or len(tokenizer(prompt)["input_ids"]) > max_tokens:
                continue
            rows.append({"prompt": prompt, "chosen": chosen[cut + len(ASSISTANT):], "rejected": " No."})
            if len(rows) == count:
                break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def run_logged(config: str, cmd: list[str], out: Path, threads: int) -> None:
    """One configuration's run in a process of its own with ``threads`` threads, its output in ``out``.log."""
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode:
        raise SystemExit(f"{config} failed ({proc.returncode}): see {log}")


# ------------------------------------------------------------------------------------------------ ours
def run_ours(config: str, args, model: str, data: Path, out: Path) -> list[dict]:
    K = args.answers
    common = ["--actor_model_name_or_path", model, "--data_path", str(data), "--data_split", "0,0,1",
              "--prompt_format", "raw", "--max_prompt_seq_len", str(args.prompt_len),
              "--max_answer_seq_len", str(args.answer_len), "--max_steps", str(args.steps),
              "--max_eval_samples", "4", "--ppo_epochs", "1", "--gradient_accumulation_steps", "1",
              "--per_device_training_batch_size", str(K), "--actor_learning_rate", "1e-6",
              "--critic_learning_rate", "1e-6", "--lr_scheduler_type", "constant", "--num_warmup_steps", "0",
              "--temperature", "1.0", "--top_k", "0", "--top_p", "1.0", "--actor_dropout", "0.0",
              "--critic_dropout", "0.0", "--dtype", "fp32", "--actor_zero_stage", "0", "--critic_zero_stage", "0",
              "--reward_source", "python", "--reward_function", f"{Path(__file__).resolve()}:word_count_reward",
              "--kl_ctl", str(BETA[config]), "--seed", str(args.seed), "--deepspeed", "--output_dir", str(out)]
    if config == "ours_ma_ppo":
        own = ["--per_device_generation_batch_size", str(K), "--termination_condition", "fixed", "--ngram", "5",
               "--critic_model_name_or_path", model]
    else:
        own = ["--per_device_generation_batch_size", "1", "--advantage_estimator", "grpo",
               "--num_samples_per_prompt", str(K)]
        if config == "ours_grpo_kl_loss":
            own += ["--kl_penalty", "loss"]
    out.mkdir(parents=True, exist_ok=True)
    run_logged(config, [sys.executable, "-m", "marlhf", "ppo", *common, *own], out, args.threads)
    steps = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "train/step_seconds" in record:
            steps.append({"seconds": record["train/step_seconds"], "gen_seconds": record["train/gen_seconds"],
                          "tokens": record["train/response_len"] * K})
    return steps


# ------------------------------------------------------------------------------------------------- TRL
def trl_worker(spec: dict) -> None:
    """Runs in a process of its own: TRL's GRPOTrainer for ``steps`` optimizer steps; writes each step's
    seconds and generated tokens to ``spec['out']``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    prompts = [json.loads(line)["prompt"] for line in Path(spec["data"]).read_text().splitlines()]
    K = spec["answers"]
    config = GRPOConfig(
        output_dir=spec["work"], use_cpu=True, bf16=False, fp16=False, seed=spec["seed"], report_to=[],
        per_device_train_batch_size=K, num_generations=K, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=spec["answer_len"], temperature=1.0, top_k=0, top_p=1.0, beta=spec["beta"],
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, max_steps=spec["steps"],
        logging_steps=1, save_strategy="no", disable_dropout=True, dataloader_num_workers=0)
    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append({"seconds": time.perf_counter() - self.t0})

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs and steps and "tokens" not in steps[-1]:
                steps[-1]["tokens"] = logs["completions/mean_length"] * K

    trainer = GRPOTrainer(model=model, reward_funcs=word_count_reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          callbacks=[StepTimer()])
    trainer.train()
    Path(spec["out"]).write_text(json.dumps(steps))


def run_trl(config: str, args, model: str, data: Path, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    spec = {"model": model, "data": str(data), "answers": args.answers, "answer_len": args.answer_len,
            "beta": BETA[config], "steps": args.steps, "seed": args.seed, "threads": args.threads,
            "work": str(out), "out": str(out / "steps.json")}
    run_logged(config, [sys.executable, __file__, "--trl_worker", json.dumps(spec)], out, args.threads)
    return json.loads((out / "steps.json").read_text())


# ---------------------------------------------------------------------------------------------- report
def summarise(rounds: dict[str, list[list[dict]]], warmup: int) -> dict:
    """Per configuration: the median step over the timed steps of every round, the per-round medians, the
    mean generated tokens per step and seconds per 1,000 of them; ratios to TRL's GRPO at the same β."""
    rows = {}
    for config, per_round in rounds.items():
        timed = [s for steps in per_round for s in steps[warmup:]]
        seconds = [s["seconds"] for s in timed]
        tokens = [s["tokens"] for s in timed if "tokens" in s]
        rows[config] = {"median_seconds": statistics.median(seconds), "steps_timed": len(seconds),
                        "round_medians": [statistics.median([s["seconds"] for s in steps[warmup:]])
                                          for steps in per_round],
                        "tokens_per_step": statistics.mean(tokens) if tokens else None}
        if tokens:
            rows[config]["seconds_per_1k_tokens"] = 1000 * sum(seconds) / sum(tokens)
    for config, row in rows.items():
        trl = "trl_grpo_kl" if BETA[config] else "trl_grpo"
        if trl in rows:
            row["ratio_to_trl"] = row["median_seconds"] / rows[trl]["median_seconds"]
            row["ratio_to_trl_against"] = trl
            if row.get("seconds_per_1k_tokens") and rows[trl].get("seconds_per_1k_tokens"):
                row["per_token_ratio_to_trl"] = row["seconds_per_1k_tokens"] / rows[trl]["seconds_per_1k_tokens"]
    return rows


def render(report: dict) -> str:
    a = report["settings"]
    lines = ["## Cost per step against TRL's GRPOTrainer", "",
             f"Generated by `scripts/bench_trl.py` on {report['machine']}; torch {report['torch']}, TRL "
             f"{report['trl']}, {a['threads']} thread(s).  SmolLM2-135M-Instruct, fp32; {a['answers']} answers "
             f"of at most {a['answer_len']} tokens per optimizer step (GRPO: one prompt × {a['answers']}; "
             f"MA-PPO: {a['answers']} prompts × 1) to single-turn HH-RLHF prompts of at most {a['prompt_len']} "
             f"tokens, temperature 1, one epoch, a Python reward on both sides; {a['rounds']} round-robin rounds "
             f"of {a['steps']} steps, the first {a['warmup']} of each not timed.", "",
             "| configuration | β | step s (median) | per-round medians | answer tokens / step | s / 1k tokens "
             "| step / TRL (same β) | per token / TRL |", "|---" * 8 + "|"]
    for config, r in report["rows"].items():
        ratio = f"{r['ratio_to_trl']:.2f}" if "ratio_to_trl" in r else "—"
        per_token = f"{r['per_token_ratio_to_trl']:.2f}" if "per_token_ratio_to_trl" in r else "—"
        tokens = f"{r['tokens_per_step']:.0f}" if r["tokens_per_step"] else "—"
        s1k = f"{r['seconds_per_1k_tokens']:.2f}" if r.get("seconds_per_1k_tokens") else "—"
        lines.append(f"| {config} | {BETA[config]} | {r['median_seconds']:.2f} | "
                     f"{' / '.join(f'{m:.2f}' for m in r['round_medians'])} | {tokens} | {s1k} | {ratio} | "
                     f"{per_token} |")
    lines += ["", "With one PPO epoch ours takes the old log-probabilities from the update's own forward (as TRL does "
              "with `num_iterations = 1`) unless something reads them before the update: the KL in the reward "
              "(`ours_grpo_kl`, `ours_ma_ppo`) does, so those run the policy's forward too; at β = 0 ours skips the "
              "reference forward. A ratio whose per-round medians overlap TRL's is within noise.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run not timed")
    ap.add_argument("--answers", type=int, default=8, help="answers per step (K of GRPO)")
    ap.add_argument("--answer_len", type=int, default=64)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--model", default="", help="model folder (default: SmolLM2-135M-Instruct, converted)")
    ap.add_argument("--work", default="bench_results/trl", help="where the runs go")
    ap.add_argument("--out", default="bench_results/cost_vs_trl.json", help="JSON report (Markdown beside it)")
    ap.add_argument("--report_only", action="store_true", help="rewrite the Markdown from the --out JSON")
    ap.add_argument("--trl_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(json.loads(args.trl_worker))
    if args.report_only:
        out = Path(args.out)
        out.with_suffix(".md").write_text(render(json.loads(out.read_text())))
        return print(out.with_suffix(".md").read_text())
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    if any(c.startswith("trl") for c in args.configs):
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("TRL is not installed: pip install -r requirements-bench.txt (only this benchmark "
                             "needs it), or pass --configs without the trl_* ones") from None
    import torch
    from lab.summary import machine
    from transformers import AutoTokenizer

    from marlhf.models.pretrained import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "prompts.jsonl"
    count = write_prompts(AutoTokenizer.from_pretrained(model), data, 64, args.prompt_len)
    print(f"{count} prompts of at most {args.prompt_len} tokens -> {data}", flush=True)
    rounds: dict[str, list[list[dict]]] = {c: [] for c in args.configs}
    for r in range(args.rounds):
        order = args.configs if r % 2 == 0 else list(reversed(args.configs))
        for config in order:
            run = run_trl if config.startswith("trl") else run_ours
            steps = run(config, args, model, data, work / f"round{r}" / config)
            rounds[config].append(steps)
            timed = [s["seconds"] for s in steps[args.warmup:]]
            print(f"round {r} {config}: {' '.join(f'{t:.2f}' for t in timed)} s", flush=True)
    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    report = {"machine": machine(), "torch": torch.__version__, "trl": trl_version, "settings": vars(args),
              "rows": summarise(rounds, args.warmup), "steps": rounds}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    markdown = render(report)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
