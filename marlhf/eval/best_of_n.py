"""Best-of-N sampling: reward-model score (and gold score) of the answer the reward model picks among N samples,
over N and the sampling temperature — the paper's Fig. 8 and App. D.4.

Efficiency: for each temperature, N_max answers per prompt are sampled once and scored once; best-of-n for
every smaller n is read off the first n of those samples (nested prefixes).  The curves over n therefore come
from the same samples, so the picked reward-model score can only rise with n, and the table costs one
sampling pass per temperature instead of one per (n, temperature).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence

import torch


def best_of_n(rm: torch.Tensor, ns: Sequence[int], gold: torch.Tensor | None = None) -> list[dict[str, float]]:
    """Per n: mean over prompts of the reward-model score of the best of the first n samples (``rm_best``), the
    mean score of those n samples (``rm_mean``: what a random pick gets), and with ``gold`` the gold score of
    the picked answer (``gold_best``) and the gold mean of the n samples (``gold_mean``).

    ``rm``, ``gold``: (P, N_max) scores of N_max samples per prompt in sampling order.  Ties pick the first."""
    if rm.dim() != 2 or (gold is not None and gold.shape != rm.shape):
        raise ValueError(f"scores must be (prompts, samples) of one shape, got {tuple(rm.shape)}"
                         + ("" if gold is None else f" and {tuple(gold.shape)}"))
    out = []
    for n in ns:
        if not 1 <= n <= rm.shape[1]:
            raise ValueError(f"n = {n} outside 1 … {rm.shape[1]} sampled answers")
        head = rm[:, :n].double()
        pick = head.argmax(dim=1, keepdim=True)  # (P, 1): first maximum
        row = {"n": n, "rm_best": head.gather(1, pick).mean().item(), "rm_mean": head.mean().item()}
        if gold is not None:
            g = gold[:, :n].double()
            row |= {"gold_best": g.gather(1, pick).mean().item(), "gold_mean": g.mean().item()}
        out.append(row)
    return out


def table_rows(results: dict[float, list[dict[str, float]]]) -> list[dict[str, float]]:
    """Flat rows (temperature first) of ``{temperature: best_of_n(...)}``."""
    return [{"temperature": t, **row} for t, rows in results.items() for row in rows]


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_markdown(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:g}" if c in ("temperature", "n") else f"{r[c]:.4f}" for c in cols)
                     + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    """One panel per score (reward model, gold): the picked answer's score over N (log scale), one line per
    temperature, and a heatmap of the same numbers (temperature × N) under each."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    scores = [k for k in ("rm_best", "gold_best") if k in rows[0]]
    temps = sorted({r["temperature"] for r in rows})
    ns = sorted({r["n"] for r in rows})
    value = {(r["temperature"], r["n"], k): r[k] for r in rows for k in scores}
    fig, axes = plt.subplots(2, len(scores), figsize=(5.5 * len(scores), 8), squeeze=False)
    for j, key in enumerate(scores):
        ax = axes[0][j]
        for i, t in enumerate(temps):
            ax.plot(ns, [value[t, n, key] for n in ns], marker="o", color=f"C{i % 10}", label=f"T = {t:g}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("N (samples per prompt)")
        ax.set_ylabel(f"{key} (score of the reward model's pick)")
        ax.set_title(f"best-of-N: {'reward model' if key == 'rm_best' else 'gold'} score")
        ax.legend()
        grid = [[value[t, n, key] for n in ns] for t in temps]
        hm = axes[1][j]
        im = hm.imshow(grid, aspect="auto", cmap="viridis", origin="lower")
        hm.set_xticks(range(len(ns)), [str(n) for n in ns])
        hm.set_yticks(range(len(temps)), [f"{t:g}" for t in temps])
        hm.set_xlabel("N")
        hm.set_ylabel("temperature")
        for a, line in enumerate(grid):
            for b, v in enumerate(line):
                hm.text(b, a, f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=hm)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
