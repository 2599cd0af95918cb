"""Time one MA-PPO step's macro-action work and PPO update on real models, n = 1 (vanilla PPO) vs macro rules.

The paper (§3.2, §4) claims macro actions add no measurable cost to a PPO step: the macro computation is a
few scatter/gathers over (B, T) tensors and the update runs the same forwards/backwards whatever the
segmentation.  This measures it on the embedded tiny model (actor = critic init = tiny; fp32; ZeRO 0):

  1. build the RLHF engine once and collect ONE experience batch (generation + 4 forwards, seeded), so
     every variant sees the same prompts, answers, log-probs, values and rewards;
  2. time, on that same experience,
     (a) the macro part of experience processing (``rollout.macro_advantages``: segmenter + GAE) for every rule
         (--variants: fixed n=1, n=5, randomized, ppl, word, parsing; cheap, --macro_repeats times), and
     (b) the full update = macro part + ``MAPPOTrainer.ppo_update`` (actor + critic forward/backward/step)
         for --update_variants (default all; ~1 s each on 2 idle cores, so on a loaded machine pass e.g.
         "n=1 (vanilla PPO)" "n=5"), with the engines' weights, Adam state, LR schedule and step counters
         restored from one snapshot before every timed update (restore not timed), so every variant updates
         identical weights (checked: weight hashes before each update, and after it across repeats).

Variants are timed round-robin (each repeat times every variant once) so load bursts from other processes
hit all of them alike.  Min is the least noisy estimate on a shared machine.

    python scripts/bench_step3.py [--batch 16] [--answer_len 64] [--repeats 7] [--threads 2] \\
        [--update_variants all|"n=1 (vanilla PPO)" "n=5" ...] [--out bench_results/step3.json]

Writes the JSON report to --out and a markdown table next to it (same name, .md).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from marlhf import embedded  # noqa: E402
from marlhf.config import RLHFArgs, parse_args  # noqa: E402
from marlhf.data.pipeline import PromptCollator, build_phase_data  # noqa: E402
from marlhf.models.loading import run_tokenizer  # noqa: E402
from marlhf.rlhf.macro import macro_lengths  # noqa: E402
from marlhf.rlhf.rlhf_engine import build_rlhf_engine  # noqa: E402
from marlhf.rlhf.rollout import Experience, macro_advantages  # noqa: E402
from marlhf.rlhf.trainer import MAPPOTrainer  # noqa: E402
from marlhf.utils import dist  # noqa: E402

# name -> RLHFArgs overrides; the first one is the baseline of the ratios
VARIANTS: dict[str, dict] = {
    "n=1 (vanilla PPO)": {"termination_condition": "fixed", "ngram": "1"},
    "n=5": {"termination_condition": "fixed", "ngram": "5"},
    "n=5, macro ratio": {"termination_condition": "fixed", "ngram": "5", "policy_ratio": "macro"},
    "randomized": {"termination_condition": "randomized"},
    "ppl": {"termination_condition": "ppl"},
    "word": {"termination_condition": "word"},
    "parsing (text)": {"termination_condition": "parsing"},
}
BASELINE, MAIN = "n=1 (vanilla PPO)", "n=5"


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


def fingerprint(engine) -> str:
    """Bitwise hash of all weights: equal hashes after equal work prove the restore is exact."""
    h = hashlib.sha256()
    for name, t in sorted(engine.module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------ measurement
def macro_part(trainer: MAPPOTrainer, exp: Experience) -> tuple[Experience, int]:
    """Step 3 of make_experience alone: termination rule → segment ids → macro advantages/returns (and the
    number of samples whose parse fell back to fixed n)."""
    answer = exp.seq[:, exp.prompt_width:]
    seg, adv, ret, _, fallbacks = macro_advantages(trainer.segmenter, answer, exp.mask, exp.ref_logprobs,
                                                   exp.values, exp.rewards, trainer.rollout, step=0)
    return dataclasses.replace(exp, seg=seg, advantages=adv, returns=ret), fallbacks


def summarize(ts: list[float]) -> dict:
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "n": len(ts)}


def build(cli) -> tuple:
    """Args, tokenizer, RLHF engine and the prompt batch (the first --batch prompts of the step-3 split)."""
    model_dir = str(embedded.prepare(size="tiny").model_dir)
    with tempfile.TemporaryDirectory(prefix="bench_step3_") as tmp:  # only the tokenized-data cache
        args, _ = parse_args(RLHFArgs, [
            "--actor_model_name_or_path", model_dir, "--critic_model_name_or_path", model_dir,
            "--data_path", "synthetic", "--data_output_path", tmp, "--output_dir", tmp,
            "--per_device_generation_batch_size", str(cli.batch),
            "--per_device_training_batch_size", str(cli.train_batch or cli.batch),
            "--max_answer_seq_len", str(cli.answer_len), "--seed", str(cli.seed), "--dtype", "fp32",
            "--actor_zero_stage", "0", "--critic_zero_stage", "0", "--disable_progress_bar"])
        dist.init_distributed()
        dist.set_seed(args.seed)
        tok, _ = run_tokenizer(args, model_dir, padding_side="left")
        prompts = build_phase_data(args, tok, phase=3).train[:cli.batch]
    batch = PromptCollator(tok.pad_token_id)(prompts)
    rlhf = build_rlhf_engine(args, tok, total_steps=100)
    return args, tok, rlhf, batch, model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16, help="prompts in the one experience batch")
    ap.add_argument("--answer_len", type=int, default=64, help="max generated tokens")
    ap.add_argument("--train_batch", type=int, default=0,
                    help="PPO micro-batch (0: --batch, i.e. one micro-batch)")
    ap.add_argument("--repeats", type=int, default=7, help="timed round-robin repeats of the full update")
    ap.add_argument("--macro_repeats", type=int, default=20,
                    help="timed round-robin repeats of the macro part alone")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0: torch default)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), metavar="NAME",
                    help=f"rules whose macro part is timed: {' | '.join(VARIANTS)}")
    ap.add_argument("--update_variants", nargs="+", default=["all"], metavar="NAME",
                    help="rules whose full update is timed too, or 'all'")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="bench_results/step3.json")
    cli = ap.parse_args()
    if cli.update_variants == ["all"]:
        cli.update_variants = list(VARIANTS)
    for v in (*cli.variants, *cli.update_variants):
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {list(VARIANTS)}")
    if cli.threads:
        torch.set_num_threads(cli.threads)
    for name in ("DeepSpeed", "deepspeed", "marlhf"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the critic's "score.weight newly initialised" load report is expected
    updates = [BASELINE] + [v for v in cli.update_variants if v != BASELINE]
    variants = [v for v in VARIANTS if v in {*cli.variants, *updates}]

    # 1. engines and the one experience batch
    t0 = time.perf_counter()
    args, tok, rlhf, batch, model_dir = build(cli)
    setup_ms = (time.perf_counter() - t0) * 1e3
    trainers = {v: MAPPOTrainer(dataclasses.replace(args, **VARIANTS[v]), rlhf, tok) for v in variants}
    t0 = time.perf_counter()
    exp, exp_stats = trainers[BASELINE].make_experience(batch["prompt_ids"], batch["prompt_mask"], step=0)
    experience_ms = (time.perf_counter() - t0) * 1e3

    # warm-up: the macro part of every rule and one update of each timed variant (the first update also
    # creates the Adam moments, as mid-training); then snapshot — every timed update starts from this state
    exps, fallbacks, reasons = {}, {}, {}
    for v in variants:
        exps[v], fallbacks[v] = macro_part(trainers[v], exp)
        parser = trainers[v].segmenter.parser
        reasons[v] = dict(parser.fallback_reasons) if parser is not None else {}
    for v in updates:
        trainers[v].ppo_update([exps[v]])
    snaps = {"actor": snapshot(rlhf.actor), "critic": snapshot(rlhf.critic)}
    start_fp = {k: fingerprint(getattr(rlhf, k)) for k in snaps}

    # 2a. macro part alone, every rule
    macro_ms: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(cli.macro_repeats):
        for v in variants:
            t0 = time.perf_counter()
            macro_part(trainers[v], exp)
            macro_ms[v].append((time.perf_counter() - t0) * 1e3)
    # 2b. full update (macro part + ppo_update) from the snapshot, round-robin
    full_macro_ms: dict[str, list[float]] = {v: [] for v in updates}
    update_ms: dict[str, list[float]] = {v: [] for v in updates}
    after_fp: dict[str, set[str]] = {v: set() for v in updates}
    restored_ok = True
    t_bench = time.perf_counter()
    for rep in range(cli.repeats):
        for v in updates if rep % 2 == 0 else updates[::-1]:  # alternate the order: no position bias
            for k, snap in snaps.items():
                restore(getattr(rlhf, k), snap)
            restored_ok &= all(fingerprint(getattr(rlhf, k)) == start_fp[k] for k in snaps)
            t0 = time.perf_counter()
            e, _ = macro_part(trainers[v], exp)
            t1 = time.perf_counter()
            trainers[v].ppo_update([e])
            t2 = time.perf_counter()
            full_macro_ms[v].append((t1 - t0) * 1e3)
            update_ms[v].append((t2 - t1) * 1e3)
            after_fp[v].add(fingerprint(rlhf.actor) + fingerprint(rlhf.critic))
    bench_ms = (time.perf_counter() - t_bench) * 1e3
    deterministic = all(len(s) == 1 for s in after_fp.values())
    # n=1 and n=5 must really train differently (rules whose segmentation equals n=5's, e.g. an all-fallback
    # parse, give n=5's weights: that is expected)
    distinct = MAIN not in updates or after_fp[BASELINE] != after_fp[MAIN]

    # 3. report
    results: dict[str, dict] = {}
    for v in variants:
        lens = macro_lengths(exps[v].seg)
        n_macros = int(lens.gt(0).sum())
        results[v] = {"num_macros": n_macros, "mean_macro_len": float(lens.sum()) / max(n_macros, 1),
                      "parse_fallbacks": fallbacks[v], "parse_fallback_reasons": reasons[v],
                      "macro": summarize(macro_ms[v])}
    for v in updates:
        full = [m + u for m, u in zip(full_macro_ms[v], update_ms[v])]
        results[v].update(ppo_update=summarize(update_ms[v]), full=summarize(full))
    base = results[BASELINE]["full"]
    for v in updates:
        r = results[v]["full"]
        paired = [(m + u) / (m1 + u1) for m, u, m1, u1 in zip(full_macro_ms[v], update_ms[v],
                                                             full_macro_ms[BASELINE], update_ms[BASELINE])]
        results[v]["full_over_n1"] = {"median": r["median_ms"] / base["median_ms"],
                                      "min": r["min_ms"] / base["min_ms"],
                                      "paired_median": statistics.median(paired)}
    n_tokens = int(exp.mask.sum())
    cfg = {"model": "embedded tiny (actor = critic init)", "model_dir": model_dir, "dtype": "fp32",
           "zero_stage": 0, "batch": cli.batch, "train_micro_batch": args.per_device_training_batch_size,
           "answer_len": cli.answer_len, "prompt_width": exp.prompt_width,
           "mean_response_len": float(exp.mask.sum(1).float().mean()), "response_tokens": n_tokens,
           "repeats": cli.repeats, "macro_repeats": cli.macro_repeats, "seed": cli.seed,
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "machine": platform.processor() or platform.machine(),
           "restore": "deep copies of module/optimizer/LR-scheduler state_dicts + engine step counters, "
                      "taken after a warm-up update and restored before every timed update",
           "restore_verified": restored_ok, "updates_bitwise_deterministic": deterministic,
           "n1_and_n5_weights_differ": distinct}
    one_off = {"setup_engines_and_data": setup_ms, "make_experience": experience_ms,
               "of_which_generation": exp_stats["gen_seconds"] * 1e3, "full_update_loop": bench_ms}
    report = {"config": cfg, "one_off_ms": one_off, "results": results,
              "ratio_n5_over_n1_full": results[MAIN].get("full_over_n1") if MAIN in results else None}
    table = render_table(results, variants, updates)
    note = render_note(cfg, one_off, results, cli)
    print(table)
    out = Path(cli.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    title = "# MA-PPO step benchmark (macro part + PPO update)"
    out.with_suffix(".md").write_text(f"{title}\n\n{note}\n\n{table}\n")
    print(f"\n{note}\nwrote {out} and {out.with_suffix('.md')}")


def render_table(results: dict, variants: list[str], updates: list[str]) -> str:
    w = max(len(v) for v in variants) + 2
    lines = [f"| {'rule':<{w}} | macros | macro part ms (med / min) | ppo_update ms (med / min) "
             f"| full ms (med / min) | full / n=1 (med / min) |",
             f"|{'-' * (w + 2)}|-------:|--------------------------:|--------------------------:"
             f"|--------------------:|-----------------------:|"]
    for v in variants:
        r = results[v]
        m = r["macro"]
        row = f"| {v:<{w}} | {r['num_macros']:6d} | {m['median_ms']:13.2f} / {m['min_ms']:7.2f} |"
        if v in updates:
            u, f, q = r["ppo_update"], r["full"], r["full_over_n1"]
            row += (f" {u['median_ms']:13.1f} / {u['min_ms']:9.1f} "
                    f"| {f['median_ms']:8.1f} / {f['min_ms']:8.1f} | {q['median']:10.3f} / {q['min']:9.3f} |")
        else:
            row += f" {'-':>25} | {'-':>19} | {'-':>22} |"
        lines.append(row)
    if MAIN in updates:
        q = results[MAIN]["full_over_n1"]
        lines += ["", f"Full update (macro part + ppo_update) n=5 / n=1: {q['median']:.3f} (ratio of "
                      f"medians), {q['min']:.3f} (ratio of mins), {q['paired_median']:.3f} (median of "
                      f"per-repeat ratios)."]
    return "\n".join(lines)


def render_note(cfg: dict, one_off: dict, results: dict, cli) -> str:
    parse_note = ""
    if "parsing (text)" in results:
        r = results["parsing (text)"]
        parse_note = (f" Parsing rule (spaCy backend via 'auto'): {r['parse_fallbacks']} of {cli.batch} "
                      f"samples fell back to fixed n (reasons {r['parse_fallback_reasons']}).")
    return (f"Embedded tiny model (actor = critic init), fp32, ZeRO 0, one experience batch of B={cli.batch} "
            f"prompts (prompt width {cfg['prompt_width']}), answers <= {cli.answer_len} tokens (mean "
            f"{cfg['mean_response_len']:.1f}, {cfg['response_tokens']} tokens), PPO micro-batch "
            f"{cfg['train_micro_batch']}, one PPO epoch; torch {cfg['torch']}, {cfg['threads']} thread(s). "
            f"'macro part' = segmenter + compute_advantages (median / min of {cli.macro_repeats} round-robin "
            f"repeats); 'full' = macro part + ppo_update (actor and critic forward/backward/step), median / "
            f"min of {cli.repeats} round-robin repeats after one warm-up. Engine state (weights, Adam state, "
            f"LR schedule, step counters) restored from one snapshot before every timed update: restore "
            f"verified = {cfg['restore_verified']}, post-update weights bitwise identical across repeats = "
            f"{cfg['updates_bitwise_deterministic']}, different between n=1 and n=5 = "
            f"{cfg['n1_and_n5_weights_differ']}. One-off: make_experience "
            f"{one_off['make_experience']:.0f} ms (generation {one_off['of_which_generation']:.0f} ms)."
            f"{parse_note}")


if __name__ == "__main__":
    main()
