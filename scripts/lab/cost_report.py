"""The "cost per step" section of the results report, from ``scripts/bench_step3.py``'s JSON (issue 11 §3).

:func:`render_cost_section` turns the benchmark's JSON into markdown: the setup (machine, threads, batch),
one table row per variant (seconds per step split into phases, tokens/s of generation and training, training
FLOP/s against the matmul peak measured in the same run, memory, the ratio to PPO's step) and a paragraph
reading the ratios — the paper's "no additional cost" claim (§4) — with the run's own noise as yardstick.
Every number comes from the JSON; nothing here measures.
"""

from __future__ import annotations

import json
from pathlib import Path

# the phases a step is split into, in order (they sum to the step: "other" is the rest)
PHASES = ("generation", "forwards", "macro", "training", "other")
# a macro phase adding more than this fraction of a PPO step counts as an additional cost in the reading
MACRO_COST_THRESHOLD = 0.01


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _row(name: str, r: dict) -> str:
    s, p, m, q = r["step_s"], r["phases_s"], r["memory_mb"], r["ratio_to_ppo"]
    answers = f"{r['answers']} ({r['prompts']}×{r['samples_per_prompt']})"
    inc = f"{m['step_increase']:.0f}" if "step_increase" in m else "n/a"
    cells = [name, "yes" if r["critic"] else "no", answers, f"{s['median']:.3f} / {s['min']:.3f}",
             *(f"{p[k]:.3f}" for k in PHASES), f"{r['generated_tokens_per_s']:.0f}", f"{r['train_tokens_per_s']:.0f}",
             f"{r['train_gflops_per_s']:.2f} ({_pct(r['train_fraction_of_matmul_peak'])})",
             f"{m['engines_used']:.0f}", inc, f"{q['median']:.3f} / {q['min']:.3f}"]
    return "| " + " | ".join(cells) + " |"


def render_table(report: dict) -> str:
    head = ["variant", "critic", "answers (prompts×K)", "step s (med / min)", *(f"{k} s" for k in PHASES),
            "gen tok/s", "train tok/s", "train GFLOP/s (of peak)", "engines MB", "step +MB", "step / PPO (med / min)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    lines += [_row(name, r) for name, r in report["variants"].items()]
    return "\n".join(lines)


def _span(values, fmt: str) -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def _reading(report: dict) -> str:
    """One paragraph on what the ratios say, from the numbers, with the run's own repeat spread as the noise
    yardstick.  The work MA-PPO adds to PPO is the macro phase (the rule's segmentation and macro GAE): the
    forwards and backwards are the same shapes, hence the same FLOPs (counted), whatever the segmentation."""
    V, base = report["variants"], report["baseline"]
    ppo = V[base]
    step = ppo["step_s"]["median"]
    # the run's noise: each variant's (max − min) / median over its repeats; the typical (median) one
    spreads = sorted((r["step_s"]["max"] - r["step_s"]["min"]) / r["step_s"]["median"] for r in V.values())
    spread = spreads[len(spreads) // 2]
    share = {k: ppo["phases_s"][k] / step for k in PHASES}
    text = [f"A PPO step takes {step:.2f} s here (median of {ppo['step_s']['n']}): generation "
            f"{_pct(share['generation'])}, experience forwards {_pct(share['forwards'])}, macro part "
            f"{_pct(share['macro'])}, training {_pct(share['training'])}. A variant's step varied by "
            f"{_pct(spread)} across its repeats (max − min over median; median over variants, largest "
            f"{_pct(spreads[-1])}): step ratios that close to 1 are noise."]
    ma = {v: r for v, r in V.items() if v != base and r["critic"]}
    if ma:
        ratios = {v: r["ratio_to_ppo"]["median"] for v, r in ma.items()}
        lo, hi = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
        span = f"{ratios[lo]:.3f}× ({lo}) to {ratios[hi]:.3f}× ({hi})" if lo != hi else f"{ratios[lo]:.3f}× ({lo})"
        same = [v for v, r in ma.items() if r["train_flops"] == ppo["train_flops"]]
        text.append(f"The MA-PPO variants' steps take {span} PPO's (ratio of medians); {len(same)} of {len(ma)} "
                    f"train with exactly PPO's FLOPs (same shapes), so their differences outside the macro phase "
                    f"are not extra work.")
        # the macro phase is timed on its own (its spread is small), so its extra time is read directly
        extra = {v: (r["phases_s"]["macro"] - ppo["phases_s"]["macro"]) / step for v, r in ma.items()}
        costly = {v: x for v, x in extra.items() if x > MACRO_COST_THRESHOLD}
        top = max(extra, key=extra.get)
        text.append(f"What MA-PPO adds, the macro phase, takes at most {_pct(extra[top])} of a PPO step more than "
                    f"PPO's own ({top}).")
        if costly:
            listed = ", ".join(f"{v} (+{_pct(x)})" for v, x in sorted(costly.items(), key=lambda kv: -kv[1]))
            text.append(f"The paper's \"no additional cost\" (§4) holds here for {len(ma) - len(costly)} of "
                        f"{len(ma)} variants and not for {listed}, whose macro phase adds more than "
                        f"{_pct(MACRO_COST_THRESHOLD)} of a PPO step.")
        else:
            text.append(f"The paper's \"no additional cost\" (§4) holds here for every MA-PPO variant measured: no "
                        f"macro phase adds more than {_pct(MACRO_COST_THRESHOLD)} of a PPO step.")
    cf = {v: r for v, r in V.items() if not r["critic"]}
    if cf:
        ratios = [r["ratio_to_ppo"]["median"] for r in cf.values()]
        train = [r["phases_s"]["training"] / ppo["phases_s"]["training"] for r in cf.values()]
        text.append(f"The critic-free baselines ({', '.join(cf)}) run no critic forward or update and take "
                    f"{_span(ratios, '.3f')}× PPO's step; their training phase is {_span(train, '.2f')}× PPO's.")
    frac = [r["train_fraction_of_matmul_peak"] for r in V.values()]
    text.append(f"Training runs at {_span([100 * f for f in frac], '.1f')}% of the fp32 matmul peak measured in the "
                f"same run ({report['config']['matmul_peak_gflops']['used']:.0f} GFLOP/s); the rest goes to small "
                f"matmuls, non-matmul operations and per-call overheads of a "
                f"{report['config']['params'] / 1e6:.2f} M-parameter model: these are costs at this scale, not at "
                f"the paper's.")
    return " ".join(text)


def render_cost_section(json_path: Path) -> str:
    """Markdown for the benchmark JSON at ``json_path``: setup, table, reading (ends with a newline)."""
    report = json.loads(Path(json_path).read_text())
    c, checks = report["config"], report["checks"]
    r0 = report["variants"][report["baseline"]]
    setup = (f"Machine: {c['machine']}; torch {c['torch']} with {c['threads']} thread(s); fp32 matmul peak "
             f"{c['matmul_peak_gflops']['used']:.1f} GFLOP/s (best {c['matmul_peak_gflops']['n']}² product, "
             f"measured before and after in the same run). Model: {c['model']}, {c['params'] / 1e6:.2f} M "
             f"parameters, {c['dtype']}, ZeRO {c['zero_stage']}; reward: {c['reward']}. Batch: {c['batch']} answers "
             f"per step (PPO / MA-PPO: {r0['prompts']} prompts; group estimators: {c['batch']} / K prompts × K), "
             f"answers ≤ {c['answer_len']} tokens, one PPO micro-batch of {c['train_micro_batch']}, "
             f"{c['ppo_epochs']} PPO epoch(s). {c['repeats']} round-robin repeats per variant, every step from the "
             f"same engine snapshot and seed{'; --quick smoke run' if c['quick'] else ''}.")
    cols = ("Phases are medians over repeats and sum to the step (\"other\": per-token KL rewards, statistics, "
            "micro-batch plans). gen tok/s: generated tokens / generation s; train tok/s: real prompt + answer "
            "tokens per PPO epoch / training s; train GFLOP/s: FLOPs counted by torch's FlopCounterMode over one "
            "identical update (forward + backward matmuls and attention) / training s. engines MB: tensors of the "
            "engines the variant uses (weights; + gradients and Adam state of the trained ones; critic-free: no "
            "critic); step +MB: the process's peak resident memory during the step above its resident memory "
            f"before it ({c['memory_meter']}). Checks: "
            + ", ".join(f"{k} = {v}" for k, v in checks.items() if isinstance(v, bool)) + ".")
    return (f"## Cost per step\n\n{setup}\n\n{render_table(report)}\n\n{cols}\n\n{_reading(report)}\n")
