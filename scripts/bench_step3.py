"""Cost of one step-3 step for PPO, every MA-PPO variant and every baseline on the same batch (issue 11 §3).

The paper (§3.2, §4) claims macro actions add no measurable cost to a PPO step: the segmentation is a few
scatter/gathers over (B, T) tensors and the forwards/backwards are the same whatever the segmentation.  This
times a whole step of each variant of the reproduction sweep (``scripts/lab/sweep.py`` VARIANTS, their own
flags parsed into ``RLHFArgs``) on the embedded model (actor = reference = critic init = reward model
architecture; fp32; ZeRO 0; the tiny launch script's sampling and micro-batch), split into phases:

  generation  ``marlhf.sampler.sample`` (answers to the prompts, K per prompt for RLOO / GRPO)
  forwards    experience forwards: actor and reference log-probs, critic values (GAE only), reward model
  macro       termination rule → segment ids → advantages (macro GAE, or the critic-free estimator)
  training    the PPO epoch: actor (+ critic) forward, backward and optimizer step per micro-batch
  other       the rest of the step (per-token KL rewards, statistics, micro-batch plans)

The phases are read from the trainer's own calls (``MAPPOTrainer.timer``, a ``marlhf.utils.timing``
PhaseTimer wrapped around the seams), so what is timed is what training runs.  Every timed step starts from
one snapshot of the trained engines (weights, Adam state, LR schedule, step counters; taken after a warm-up
step) and the same seed, so every variant generates from the same policy: the GAE variants answer the same
--batch prompts identically (checked), the group estimators answer the first --batch / K of them K times
(the same number of answers).  Critic-free variants get no critic (nothing of it runs).  Variants are
timed round-robin (order alternating per repeat) so load from other processes hits them alike; median and
min over --repeats.

Also reported per variant: generated tokens / s of generation; training tokens / s (real prompt + answer
tokens per PPO epoch / training seconds); training FLOPs (counted once per variant by torch's
FlopCounterMode over an untimed identical update: matmuls and attention, forward + backward) / training
seconds, as a fraction of this machine's fp32 matmul peak measured in the same run (before and after, the
higher kept); memory: the tensors of the engines the variant uses (weights, gradients, Adam state) and the
process's peak resident memory during the step above what it held before (``lab.perf.PeakRSS``).

    python scripts/bench_step3.py [--quick] [--size tiny] [--batch 16] [--answer_len 64] [--repeats 3] \\
        [--threads 2] [--variants all|ppo n5 grpo ...] [--max_seconds 0] [--out docs/results/cost_per_step.json]

Writes the JSON to --out and the markdown (``lab.cost_report.render_cost_section``) next to it (.md).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lab.cost_report import PHASES, render_cost_section  # noqa: E402
from lab.perf import PeakRSS, matmul_peak_gflops, tensor_megabytes  # noqa: E402
from lab.sweep import BASELINE, VARIANTS  # noqa: E402

from marlhf import embedded  # noqa: E402
from marlhf.cli._run import data_section, mappo_sections, step3_context, step3_trainer  # noqa: E402  # noqa: E402
from marlhf.config import RLHFArgs, parse_args  # noqa: E402
from marlhf.data.pipeline import PromptCollator, build_phase_data  # noqa: E402
from marlhf.models.loading import load_tokenizer_and_format, stop_token_ids  # noqa: E402
from marlhf.rlhf.advantages import estimator_class  # noqa: E402
from marlhf.rlhf.trainer import MAPPOTrainer  # noqa: E402
from marlhf.tasks import resolve_task  # noqa: E402
from marlhf.utils import dist  # noqa: E402
from marlhf.utils.machine import cpu_name  # noqa: E402
from marlhf.utils.timing import NO_TIMER, PhaseTimer  # noqa: E402

QUICK_VARIANTS = ["ppo", "n5", "grpo"]
DEFAULT_OUT = "docs/results/cost_per_step.json"
# the timer's phase names → the reported phases (the rest of the step is "other")
PHASE_OF = {"generation": "generation", "generation/mc": "generation", "forward/actor": "forwards",
            "forward/ref": "forwards", "forward/critic": "forwards", "forward/reward": "forwards", "macro": "macro",
            "train/actor": "training", "train/critic": "training", "train/ptx": "training"}


# ------------------------------------------------------------------------------------------ engine state
def snapshot(engine) -> dict:
    """Everything a DeepSpeed ZeRO-0 training step reads and writes: module weights, optimizer state (Adam
    moments and step counts), the LR schedule and the engine's step counters.  Deep copies."""
    return {"module": copy.deepcopy(engine.module.state_dict()),
            "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
            "scheduler": copy.deepcopy(engine.lr_scheduler.state_dict()),
            "counters": {k: getattr(engine, k) for k in ("global_steps", "global_samples", "micro_steps")}}


def restore(engine, snap: dict) -> None:
    """Put ``engine`` back into the snapshot's state (weights copied in place, so the optimizer keeps
    pointing at the same parameter tensors; optimizer.load_state_dict replaces the state wholesale)."""
    engine.module.load_state_dict(snap["module"])
    engine.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
    engine.lr_scheduler.load_state_dict(snap["scheduler"])
    for k, v in snap["counters"].items():
        setattr(engine, k, v)
    engine.module.zero_grad(set_to_none=True)


def fingerprint(*tensors_or_engines) -> str:
    """Bitwise hash of tensors / engines' weights: equal hashes after equal work prove a restore exact."""
    h = hashlib.sha256()
    for x in tensors_or_engines:
        items = sorted(x.module.state_dict().items()) if hasattr(x, "module") else [("t", x)]
        for name, t in items:
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _tensors(obj):
    """Every tensor inside nested dicts / lists / tuples (an optimizer state_dict)."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def engine_megabytes(engine, trained: bool) -> float:
    """Weights (+ gradients and optimizer state when trained) of one engine, MB."""
    params = list(engine.module.parameters())
    tensors = params + ([p.grad for p in params] + list(_tensors(engine.optimizer.state_dict())) if trained else [])
    return tensor_megabytes(tensors)


# ------------------------------------------------------------------------------------------ setup
def base_argv(cli, model_dir: str, tmp: str) -> list[str]:
    """The tiny launch script's step-3 settings (run_tiny.sh: 16 prompts, one micro-batch, answers <= 64,
    temperature 0.8, top-k 50, KL 0.5), the reward from the reward model (the paper's setting)."""
    return ["--actor_model_name_or_path", model_dir, "--critic_model_name_or_path", model_dir,
            "--data_path", "synthetic", "--data_output_path", tmp, "--output_dir", tmp,
            "--per_device_generation_batch_size", str(cli.batch),
            "--per_device_training_batch_size", str(cli.train_batch or cli.batch),
            "--max_prompt_seq_len", "192", "--max_answer_seq_len", str(cli.answer_len), "--seed", str(cli.seed),
            "--temperature", "0.8", "--top_k", "50", "--kl_ctl", "0.5", "--dtype", "fp32",
            "--actor_zero_stage", "0", "--critic_zero_stage", "0", "--disable_progress_bar"]


def variant_args(name: str, argv: list[str], batch: int) -> RLHFArgs:
    """The variant's sweep flags over the common ones; the group estimators answer batch / K prompts K times
    (the sweep's 4 x 4 at batch 16), so every variant trains on ``batch`` answers."""
    args, _ = parse_args(RLHFArgs, [*argv, *VARIANTS[name].flags])
    K = args.num_samples_per_prompt
    if batch % K:
        raise SystemExit(f"--batch {batch} is not a multiple of variant {name}'s K = {K} samples per prompt")
    return dataclasses.replace(args, per_device_generation_batch_size=batch // K)


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} logical CPUs"


# ------------------------------------------------------------------------------------------ one step
def run_step(trainer: MAPPOTrainer, batch: dict, seed: int, count_flops: bool = False):
    """One step as the training loop runs it (experience, then the PPO epoch) from the global seed ``seed``:
    (experience, wall seconds, training FLOPs or None)."""
    dist.set_seed(seed)
    t0 = time.perf_counter()
    exp, _ = trainer.make_experience(batch["prompt_ids"], batch["prompt_mask"], step=0)
    if count_flops:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            trainer.ppo_update([exp])
        return exp, time.perf_counter() - t0, counter.get_total_flops()
    trainer.ppo_update([exp])
    return exp, time.perf_counter() - t0, None


def phases(timer: PhaseTimer, step_s: float) -> dict[str, float]:
    """The timer's spans summed into the reported phases, ``other`` = step − the rest (so they sum to the
    step exactly)."""
    unknown = set(timer.seconds) - set(PHASE_OF)
    if unknown:
        raise RuntimeError(f"timer phases {sorted(unknown)} have no reported phase: add them to PHASE_OF")
    out = dict.fromkeys(PHASES, 0.0)
    for name, s in timer.seconds.items():
        out[PHASE_OF[name]] += s
    out["other"] = step_s - sum(out[p] for p in PHASES if p != "other")
    return out


def summarize(ts: list[float]) -> dict:
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "n": len(ts)}


# ------------------------------------------------------------------------------------------ main
def parse_cli(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke run: variants {' '.join(QUICK_VARIANTS)}, the nano model, batch 4, answers <= 16, "
                         "2 repeats (well under a minute)")
    ap.add_argument("--size", default=None, help="embedded model size (default tiny; --quick: nano)")
    ap.add_argument("--batch", type=int, default=None, help="answers per step (default 16; --quick: 4)")
    ap.add_argument("--answer_len", type=int, default=None, help="max generated tokens (default 64; --quick: 16)")
    ap.add_argument("--train_batch", type=int, default=0, help="PPO micro-batch (0: --batch, one micro-batch)")
    ap.add_argument("--repeats", type=int, default=None, help="timed round-robin repeats (default 3; --quick: 2)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0: torch default)")
    ap.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                    help=f"sweep variants to time, or 'all' (default all; --quick: {' '.join(QUICK_VARIANTS)}); "
                         f"{BASELINE} is always timed (the ratios' baseline)")
    ap.add_argument("--max_seconds", type=float, default=0,
                    help="start no further round of repeats once the run would pass this many seconds (0: no limit;"
                         " every round times every variant, so the round-robin stays whole)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--extra_flags", default="", help="step-3 flags added to every variant's, e.g. '--kl_penalty loss'")
    ap.add_argument("--all_forwards", action="store_true",
                    help="run the π_old and π_ref forwards even where nothing reads them (the two-pass rollout, "
                         "to time what marlhf.rlhf.sections.needed_forwards saves)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    cli = ap.parse_args(argv)
    q = cli.quick
    cli.size = cli.size or ("nano" if q else "tiny")
    cli.batch = cli.batch or (4 if q else 16)
    cli.answer_len = cli.answer_len or (16 if q else 64)
    cli.repeats = cli.repeats or (2 if q else 3)
    names = cli.variants or (QUICK_VARIANTS if q else ["all"])
    if names == ["all"]:
        names = list(VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    cli.variants = [BASELINE] + [v for v in VARIANTS if v in names and v != BASELINE]
    return cli


def main(argv=None) -> None:
    cli = parse_cli(argv)
    if cli.threads:
        torch.set_num_threads(cli.threads)
    for name in ("DeepSpeed", "deepspeed", "marlhf"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the critic's "score.weight newly initialised" load report is expected
    t_start = time.perf_counter()
    peak_before = matmul_peak_gflops(512 if cli.quick else 1024, 5 if cli.quick else 20)

    # 1. one RLHF engine (with a critic) and each variant's trainer over it; critic-free ones see no critic
    model_dir = str(embedded.prepare(size=cli.size).model_dir)
    with tempfile.TemporaryDirectory(prefix="bench_step3_") as tmp:  # only the tokenized-data cache
        argv = base_argv(cli, model_dir, tmp) + cli.extra_flags.split()
        args = {v: variant_args(v, argv, cli.batch) for v in cli.variants}
        dist.init_distributed()
        dist.set_seed(cli.seed)
        base = args[BASELINE]
        tok, fmt = load_tokenizer_and_format(model_dir, base.end_of_conversation_token, base.prompt_format,
                                             padding_side="left")
        prompts = build_phase_data(data_section(base, fmt), tok, phase=3).train[:cli.batch]
    task = resolve_task(base.task, base.data_path)
    context = step3_context(base, model_dir, task)
    rlhf = step3_trainer(base, model_dir, tok, fmt, context, task, total_steps=100)[0].rlhf
    trainers, batches = {}, {}
    for v in cli.variants:
        critic = estimator_class(args[v].advantage_estimator).needs_critic
        view = rlhf if critic else dataclasses.replace(rlhf, critic=None)
        sections = mappo_sections(args[v], response_kind=context["response_kind"],
                                  stop_ids=stop_token_ids(tok, fmt.end_of_conversation_token),
                                  pad_id=tok.pad_token_id)
        if cli.all_forwards:
            sections = dataclasses.replace(sections, rollout=dataclasses.replace(
                sections.rollout, rule_inputs=frozenset({"logprobs", "ref_logprobs"})))  # both forwards run
        trainers[v] = MAPPOTrainer(view, tok, sections)
        n = args[v].per_device_generation_batch_size
        batches[v] = PromptCollator(tok.pad_token_id)(prompts[:n])  # collated alone: no extra left padding
    trained = {"actor": rlhf.actor, "critic": rlhf.critic}

    # 2. warm-up: one PPO step creates the Adam moments (as mid-training); every later step starts from here
    run_step(trainers[BASELINE], batches[BASELINE], cli.seed)
    snaps = {k: snapshot(e) for k, e in trained.items()}
    start_fp = fingerprint(*trained.values())
    megabytes = {k: engine_megabytes(e, trained=k in trained) for k, e in
                 (("actor", rlhf.actor), ("ref", rlhf.ref), ("critic", rlhf.critic), ("reward", rlhf.reward))}

    # 3. per variant, untimed: its first step (spaCy / parser loads, allocator warm-up) with FLOPs counted
    flops, seq_fp, after_fp, counted_fp, tokens = {}, {}, {}, {}, {}
    for v in cli.variants:
        for k, e in trained.items():
            restore(e, snaps[k])
        exp, _, flops[v] = run_step(trainers[v], batches[v], cli.seed, count_flops=True)
        seq_fp[v] = {fingerprint(exp.seq)}
        counted_fp[v] = fingerprint(*trained.values())
        after_fp[v] = set()
        tokens[v] = {"answers": int(exp.seq.shape[0]),
                     "generated": int(exp.attention_mask[:, exp.prompt_width:].sum()),
                     "train": int(exp.attention_mask.sum()) * args[v].ppo_epochs,
                     "prompt_width": exp.prompt_width, "answer_width": int(exp.seq.shape[1] - exp.prompt_width)}

    # 4. timed steps, round-robin
    meter, timer = PeakRSS(), PhaseTimer()
    raw: dict[str, list[dict]] = {v: [] for v in cli.variants}
    restored_ok = True
    t_rounds = time.perf_counter()
    for rep in range(cli.repeats):
        elapsed = time.perf_counter() - t_start
        if cli.max_seconds and rep and elapsed + (time.perf_counter() - t_rounds) / rep > cli.max_seconds:
            print(f"stopping after {rep} of {cli.repeats} repeats: --max_seconds {cli.max_seconds} would be exceeded")
            break
        for v in cli.variants if rep % 2 == 0 else cli.variants[::-1]:  # alternate the order: no position bias
            for k, e in trained.items():
                restore(e, snaps[k])
            restored_ok &= fingerprint(*trained.values()) == start_fp
            rss_before = meter.start() if meter.available else None
            trainers[v].timer = timer
            timer.reset()
            try:
                exp, step_s, _ = run_step(trainers[v], batches[v], cli.seed)
            finally:
                trainers[v].timer = NO_TIMER
            rss_peak = meter.stop() if meter.available else None
            raw[v].append({"step_s": step_s, "phases_s": phases(timer, step_s),
                           "timer_s": dict(timer.seconds), "timer_calls": dict(timer.calls),
                           "rss_before_mb": rss_before, "rss_peak_mb": rss_peak})
            seq_fp[v].add(fingerprint(exp.seq))
            after_fp[v].add(fingerprint(*trained.values()))
    peak = max(peak_before, matmul_peak_gflops(512 if cli.quick else 1024, 5 if cli.quick else 20))

    # 5. report
    base_steps = [r["step_s"] for r in raw[BASELINE]]
    results = {}
    for v in cli.variants:
        rows = raw[v]
        steps = [r["step_s"] for r in rows]
        med = {p: statistics.median(r["phases_s"][p] for r in rows) for p in PHASES}
        train_s, gen_s = med["training"], med["generation"]
        critic = trainers[v].rlhf.critic is not None
        used = ["actor", "ref", "reward"] + (["critic"] if critic else [])
        res = {"label": VARIANTS[v].label, "flags": list(VARIANTS[v].flags), "critic": critic,
               "prompts": args[v].per_device_generation_batch_size,
               "samples_per_prompt": args[v].num_samples_per_prompt,
               **tokens[v], "step_s": summarize(steps), "phases_s": med,
               "timer_s": {k: statistics.median(r["timer_s"].get(k, 0.0) for r in rows)
                           for k in sorted({k for r in rows for k in r["timer_s"]})},
               "timer_calls": rows[0]["timer_calls"],
               "generated_tokens_per_s": tokens[v]["generated"] / gen_s,
               "train_tokens_per_s": tokens[v]["train"] / train_s,
               "train_flops": flops[v], "train_gflops_per_s": flops[v] / train_s / 1e9,
               "train_fraction_of_matmul_peak": flops[v] / train_s / 1e9 / peak,
               "memory_mb": {"engines_used": sum(megabytes[k] for k in used),
                             "engines_used_detail": {k: megabytes[k] for k in used}},
               "ratio_to_ppo": {"median": statistics.median(steps) / statistics.median(base_steps),
                                "min": min(steps) / min(base_steps),
                                "paired_median": statistics.median(s / b for s, b in zip(steps, base_steps))},
               "repeats": rows}
        if meter.available:
            res["memory_mb"].update(
                rss_before=statistics.median(r["rss_before_mb"] for r in rows),
                rss_peak=statistics.median(r["rss_peak_mb"] for r in rows),
                step_increase=statistics.median(r["rss_peak_mb"] - r["rss_before_mb"] for r in rows))
        results[v] = res
    gae = [v for v in cli.variants if results[v]["critic"]]
    cfg = {"machine": machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "python": platform.python_version(), "model": f"embedded {cli.size} (actor = reference = critic init = "
           "reward model architecture)", "model_dir": model_dir,
           "params": sum(p.numel() for p in rlhf.actor.module.parameters()), "dtype": "fp32", "zero_stage": 0,
           "batch": cli.batch, "train_micro_batch": args[BASELINE].per_device_training_batch_size,
           "answer_len": cli.answer_len, "ppo_epochs": args[BASELINE].ppo_epochs,
           "repeats": len(raw[BASELINE]), "repeats_requested": cli.repeats,
           "seed": cli.seed, "quick": cli.quick, "reward": "reward model (frozen engine)",
           "matmul_peak_gflops": {"before": peak_before, "used": peak, "n": 512 if cli.quick else 1024},
           "memory_meter": "PeakRSS (VmHWM after a malloc_trim + clear_refs reset)" if meter.available
           else f"unavailable: {meter.why_not}",
           "wall_s": time.perf_counter() - t_start}
    checks = {"restore_verified": restored_ok,
              "same_answers_across_repeats": all(len(s) == 1 for s in seq_fp.values()),
              "gae_variants_same_answers": len({next(iter(seq_fp[v])) for v in gae}) == 1,
              "updates_bitwise_deterministic": all(len(s) == 1 for s in after_fp.values()),
              # informational: FlopCounterMode may route ops through other kernels (last-bit differences)
              "counted_update_bitwise_equal": {v: after_fp[v] == {counted_fp[v]} for v in cli.variants}}
    report = {"config": cfg, "checks": checks, "baseline": BASELINE, "phases": list(PHASES), "variants": results}
    out = Path(cli.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    md = render_cost_section(out)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')} ({cfg['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
