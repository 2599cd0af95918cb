"""Time the macro-action computations of MA-PPO alone (no model): segment ids per rule, aggregation, GAE,
broadcast, losses, on B × T random-length responses, and compare with the token-level (n = 1) pipeline.

    python scripts/bench_macro.py [--batch 64] [--length 512] [--repeats 20] [--out bench_results/macro.json]

Writes the JSON report to --out and a markdown table next to it (same name, .md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lab.rules import segments_for_rule  # noqa: E402

from marlhf.rlhf.macro import (  # noqa: E402
    fixed_starts,
    macro_lengths,
    macro_rewards,
    macro_values,
    ppl_starts,
    segments_from_starts,
    split_last_token,
    to_tokens,
)
from marlhf.rlhf.ppo_math import compute_advantages, gae, policy_loss, value_loss  # noqa: E402


def time_cases(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, dict]:
    """Round-robin over the cases (each repeat times every case once), so a burst of load from other
    processes on a shared machine hits all cases alike; min is the least noisy estimate."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {
        name: {"min_ms": min(ts), "median_ms": statistics.median(ts), "max_ms": max(ts)}
        for name, ts in times.items()
    }


def loop_token_gae(values: torch.Tensor, rewards: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """DeepSpeed-Chat's Python reverse loop over time steps, for reference only."""
    last = torch.zeros(values.shape[0], dtype=values.dtype)
    out = []
    T = values.shape[1]
    for t in reversed(range(T)):
        nv = values[:, t + 1] if t < T - 1 else 0.0
        last = rewards[:, t] + gamma * nv - values[:, t] + gamma * lam * last
        out.append(last)
    return torch.stack(out[::-1], dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--ngram", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default; 1 is steadiest)")
    ap.add_argument("--out", default="bench_results/macro.json")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    B, T = args.batch, args.length
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)  # (B,)
    mask = torch.arange(T)[None, :] < lens[:, None]  # (B, T)
    values = torch.randn(B, T, generator=g)  # (B, T)
    rewards = torch.randn(B, T, generator=g) * 0.01  # (B, T)
    ref_lp = -torch.rand(B, T, generator=g) * 4  # (B, T)
    logprobs = ref_lp + 0.05 * torch.randn(B, T, generator=g)  # (B, T)
    ids = torch.randint(0, 8000, (B, T), generator=g)  # (B, T)
    table = torch.rand(8000, generator=g) < 0.3  # (V,)
    kw = {"ngram": args.ngram, "ref_logprobs": ref_lp, "input_ids": ids, "word_start_table": table}

    seg_n = segments_for_rule("fixed", mask, ngram=args.ngram)
    V, mm = macro_values(values, seg_n, mask, "equal")
    R, _ = macro_rewards(rewards, seg_n, mask, "sum")
    A, Q = gae(V, R, mm, 1.0, 0.95)
    adv_n, ret_n, _ = compute_advantages(values, rewards, mask, seg_n)

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    cases: dict[str, Callable[[], object]] = {
        f"seg fixed n={args.ngram}": lambda: segments_for_rule("fixed", mask, **kw),
        "seg randomized": lambda: segments_for_rule("randomized", mask, generator=gen(1)),
        "seg ppl (exact, adaptive window)": lambda: segments_for_rule("ppl", mask, **kw),
        "seg ppl (exact, full window W=T)": lambda: segments_from_starts(ppl_starts(mask, ref_lp, window=T), mask),
        "seg ppl (max_len=64)": lambda: segments_for_rule("ppl", mask, ppl_max_len=64, **kw),
        "seg word": lambda: segments_for_rule("word", mask, **kw),
        "seg fixed + split_last": lambda: segments_from_starts(
            split_last_token(fixed_starts(mask, args.ngram), mask), mask
        ),
        "aggregate values (equal)": lambda: macro_values(values, seg_n, mask, "equal"),
        "aggregate values (position)": lambda: macro_values(values, seg_n, mask, "position"),
        "aggregate rewards (sum)": lambda: macro_rewards(rewards, seg_n, mask, "sum"),
        f"GAE macro (M={mm.shape[1]})": lambda: gae(V, R, mm, 1.0, 0.95),
        "broadcast A,Q to tokens": lambda: (to_tokens(A, seg_n), to_tokens(Q, seg_n)),
        "policy loss (token ratio)": lambda: policy_loss(logprobs, ref_lp, adv_n, mask, 0.2, seg_n, "token"),
        "policy loss (macro ratio)": lambda: policy_loss(logprobs, ref_lp, adv_n, mask, 0.2, seg_n, "macro"),
        "value loss": lambda: value_loss(values, values.detach(), ret_n, mask, 0.2),
        f"pipeline MA n={args.ngram} (seg + advantages)": lambda: compute_advantages(
            values, rewards, mask, segments_for_rule("fixed", mask, ngram=args.ngram)
        ),
        "pipeline MA ppl (seg + advantages)": lambda: compute_advantages(
            values, rewards, mask, segments_for_rule("ppl", mask, **kw)
        ),
        "pipeline MA randomized (seg + advantages)": lambda: compute_advantages(
            values, rewards, mask, segments_for_rule("randomized", mask, generator=gen(1))
        ),
        "pipeline token n=1 (seg + advantages)": lambda: compute_advantages(
            values, rewards, mask, segments_for_rule("fixed", mask, ngram=1)
        ),
        f"GAE token (M={T}, matmul)": lambda: gae(values, rewards, mask, 1.0, 0.95),
        "GAE token (Python loop over T, ref)": lambda: loop_token_gae(
            torch.where(mask, values, 0.0), torch.where(mask, rewards, 0.0), 1.0, 0.95
        ),
    }
    results = time_cases(cases, args.repeats)
    seg_ppl = segments_for_rule("ppl", mask, **kw)
    token = results["pipeline token n=1 (seg + advantages)"]["min_ms"]
    ratios = {name: r["min_ms"] / token for name, r in results.items() if name.startswith("pipeline MA")}
    report = {
        "config": {"batch": B, "length": T, "ngram": args.ngram, "repeats": args.repeats, "seed": args.seed,
                   "mean_response_len": float(lens.float().mean()), "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                   "num_macros_n": int(mm.sum()), "num_macros_token": int(mask.sum()),
                   "num_macros_ppl": int(macro_lengths(seg_ppl).gt(0).sum()),
                   "max_macro_len_ppl": int(macro_lengths(seg_ppl).max())},
        "results_ms": results,
        "ratio_vs_token_pipeline": ratios,
    }

    width = max(len(n) for n in results) + 2
    lines = [f"| {f'computation (B={B}, T={T})':<{width}} | min ms | median ms |",
             f"|{'-' * (width + 2)}|-------:|----------:|"]
    lines += [f"| {n:<{width}} | {r['min_ms']:6.2f} | {r['median_ms']:9.2f} |" for n, r in results.items()]
    lines += ["", "| ratio to token-level (n=1) pipeline (min times) | × |", "|---|---:|"]
    lines += [f"| {n} | {x:.2f} |" for n, x in ratios.items()]
    table = "\n".join(lines)
    print(table)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    cfg = report["config"]
    note = (f"B={B}, T={T} (mean response {cfg['mean_response_len']:.0f} tokens), torch {cfg['torch']}, "
            f"{cfg['threads']} thread(s); min and median of {args.repeats} round-robin repeats.")
    out.with_suffix(".md").write_text(f"# Macro-action computation benchmark\n\n{note}\n\n{table}\n")
    print(f"\nwrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
