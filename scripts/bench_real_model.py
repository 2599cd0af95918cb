#!/usr/bin/env python
"""Steps 1-3 on a real pretrained model (SmolLM2-135M-Instruct): seconds per step, peak memory per step, and
SFT throughput as a fraction of this machine's measured matmul peak.

Each step runs in its own process (so its peak resident memory is its own) for a few optimizer steps with
micro-batch --batch and --seq_len tokens (steps 1-2: --max_seq_len; step 3: half prompt, half answer);
s/step is the median gap between consecutive steps in metrics.jsonl (model loading, evaluation and export
excluded).  The matmul peak is the best of repeated fp32 (n x n) @ (n x n) products in this process with
torch's thread count.  SFT model FLOPs per token ~ 6 x parameters (forward + backward; attention scores,
~ 12 x layers x seq_len x hidden, are left out and are a few % at 256 tokens), counted over real (non-pad)
tokens of the batches.

    python scripts/convert_smollm2.py        # once
    python scripts/bench_real_model.py [--batch 4] [--seq_len 256] [--steps 4] [--only 1 2 3] \\
        [--data Anthropic/hh-rlhf:PATH] [--out bench_results/real_model.json]

The data default is the HH-RLHF slice of ../shared when present, else the test fixture (tiny).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAINS = {1: "training/step1_supervised_finetuning/main.py", 2: "training/step2_reward_model_finetuning/main.py",
         3: "training/step3_rlhf_finetuning/main.py"}
SHARED_HH = next((p for p in (REPO.parent / "shared", REPO.parent.parent / "shared")  # checkout or worktree
                  if (p / "data/hh-rlhf").is_dir()), REPO) / "data/hh-rlhf/harmless-base-test-part.jsonl.gz"
FIXTURE_HH = REPO / "tests/fixtures/real_model/hh_small.jsonl"


def child(step: int, argv: list[str]) -> None:
    """Run one step's main in this process, then print its peak resident memory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"main{step}", REPO / MAINS[step])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(argv)
    print("BENCH_PEAK_RSS_MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def run_step(step: int, argv: list[str], out: Path) -> dict:
    t0 = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", str(step), "--", *argv], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"step {step} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    peak = float(proc.stdout.split("BENCH_PEAK_RSS_MB")[-1].split()[0])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    key = "train/actor_loss" if step == 3 else "train/loss"
    times = [r["time"] for r in rows if key in r]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"s_per_step": statistics.median(gaps) if gaps else None, "steps": len(times),
            "peak_rss_gb": peak / 1024, "wall_s": time.time() - t0}


def sft_tokens_per_step(data_dir: Path, batch: int, steps: int, seed: int) -> float:
    """Mean real tokens per optimizer step over the batches of steps 2..steps (the timed gaps), drawn in the
    training sampler's order."""
    import torch

    from marlhf.data.pipeline import ResumableSampler

    [cache] = sorted(data_dir.glob("sft_*.pt"))
    items = torch.load(cache, weights_only=False)["train"]
    order = list(ResumableSampler(len(items), seed))[batch:batch * steps]
    return sum(len(items[i]["input_ids"]) for i in order) / (steps - 1)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child(int(sys.argv[2]), sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per stage (step 3: half, at least 2)")
    ap.add_argument("--only", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--data", default="", help="dataset spec (default: the shared HH slice, else the fixture)")
    ap.add_argument("--work", default="", help="where runs go (default: a temporary folder, kept)")
    ap.add_argument("--out", default="bench_results/real_model.json")
    cli = ap.parse_args()

    import torch
    from lab.perf import matmul_peak_gflops

    from marlhf.models.pretrained import prepare_smollm2

    model = str(prepare_smollm2())
    data = cli.data or f"Anthropic/hh-rlhf:{SHARED_HH if SHARED_HH.exists() else FIXTURE_HH}"
    work = Path(cli.work or tempfile.mkdtemp(prefix="bench_real_"))
    common = ["--data_path", data, "--bad_rows", "skip", "--data_split", "1,1,1", "--seed", "1",
              "--data_output_path", str(work / "data"), "--disable_progress_bar", "--max_eval_samples", "4"]
    sup = [*common, "--max_seq_len", str(cli.seq_len), "--per_device_train_batch_size", str(cli.batch),
           "--per_device_eval_batch_size", str(cli.batch), "--max_steps", str(cli.steps)]
    argv = {
        1: [*sup, "--model_name_or_path", model, "--output_dir", str(work / "step1")],
        2: [*sup, "--model_name_or_path", str(work / "step1"), "--output_dir", str(work / "step2")],
        3: [*common, "--actor_model_name_or_path", str(work / "step1"), "--critic_model_name_or_path",
            str(work / "step2"), "--max_prompt_seq_len", str(cli.seq_len // 2), "--max_answer_seq_len",
            str(cli.seq_len // 2), "--per_device_generation_batch_size", str(cli.batch),
            "--per_device_training_batch_size", str(cli.batch), "--max_steps", str(max(2, cli.steps // 2)),
            "--output_dir", str(work / "step3")],
    }
    peak_before = matmul_peak_gflops()
    report = {"model": "SmolLM2-135M-Instruct", "data": data, "batch": cli.batch, "seq_len": cli.seq_len,
              "threads": torch.get_num_threads(), "steps": {}}
    for step in cli.only:
        report["steps"][f"step{step}"] = run_step(step, argv[step], work / f"step{step}")
        print(f"step {step}: {report['steps'][f'step{step}']}", flush=True)
    peak = max(peak_before, matmul_peak_gflops())
    report["matmul_peak_gflops"] = peak
    if 1 in cli.only and report["steps"]["step1"]["s_per_step"]:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
                           .parameters())
        tokens = sft_tokens_per_step(work / "data", cli.batch, report["steps"]["step1"]["steps"], 1)
        tps = tokens / report["steps"]["step1"]["s_per_step"]
        report["sft"] = {"params": n_params, "real_tokens_per_step": tokens, "tokens_per_s": tps,
                         "model_gflops": 6 * n_params * tps / 1e9,
                         "fraction_of_matmul_peak": 6 * n_params * tps / 1e9 / peak}
    out = Path(cli.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(f"runs kept in {work}")


if __name__ == "__main__":
    main()
