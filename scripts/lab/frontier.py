"""Reward at equal KL: held-out gold (and reward-model) score against √KL to the SFT policy, over seeds.

Gao et al. (2022, Fig. 1) plot a policy's gold score against √KL(π ‖ π_SFT) while it optimises a proxy; two
RLHF methods compared at the same KL budget, not the same step, is the fair comparison.  Shared by
``scripts/frontier.py`` (its own long runs) and the reproduction report (the sweep's runs)."""

from __future__ import annotations

import math
from pathlib import Path

from lab.summary import mean_se, save_figure

ROW_KEYS = ("gold_score", "rm_score", "gold_invented", "gold_repeated")  # aggregated next to √KL when present


def sqrt_kl(kl: float) -> float:
    """√KL, the x axis; a Monte-Carlo KL estimate a hair below 0 (the SFT policy itself) counts as 0."""
    return math.sqrt(max(kl, 0.0))


def frontier_rows(curves: dict[str, dict[int, list[float]]]) -> list[dict]:
    """Seeds of one method, evaluation by evaluation: ``curves`` maps a key (``kl``, ``gold_score``, maybe
    ``rm_score`` ...) to step -> one value per seed.  Per step (those with a KL), the mean over seeds of √KL and
    of each key of :data:`ROW_KEYS` present at that step, with its standard error over seeds (``KEY_se``)."""
    rows = []
    for step, kls in sorted(curves["kl"].items()):
        row = {"step": step, "seeds": len(kls)}
        row["sqrt_kl"], row["sqrt_kl_se"] = mean_se([sqrt_kl(k) for k in kls])
        for key in ROW_KEYS:
            values = curves.get(key, {}).get(step)
            if values is not None:
                row[key], row[key + "_se"] = mean_se(values)
        rows.append(row)
    return rows


def peak(rows: list[dict]) -> dict:
    """The point of highest mean gold score (the first of equals)."""
    return max(rows, key=lambda r: (r["gold_score"], -r["step"]))


def gold_at_kl(rows: list[dict], budget: float) -> float | None:
    """Mean gold score where the mean √KL first reaches ``budget``, linearly interpolated between the two
    evaluations around it; None when the method never gets that far."""
    for a, b in zip(rows, rows[1:], strict=False):
        if a["sqrt_kl"] <= budget <= b["sqrt_kl"] and b["sqrt_kl"] > a["sqrt_kl"]:
            t = (budget - a["sqrt_kl"]) / (b["sqrt_kl"] - a["sqrt_kl"])
            return a["gold_score"] + t * (b["gold_score"] - a["gold_score"])
    return rows[0]["gold_score"] if budget == rows[0]["sqrt_kl"] else None


def best_gold_within(rows: list[dict], budget: float) -> float | None:
    """The highest gold score on the curve (evaluations joined by straight lines in √KL) where √KL ≤ ``budget``:
    every evaluation inside the budget and every point where a segment crosses it, interpolated — what stopping
    at the best evaluation within that divergence keeps.  None when the curve never is within the budget.

    Unlike :func:`gold_at_kl` it does not read a transient: a KL that jumps past the budget in the first steps
    (gold dipping) and then settles below it while gold climbs is credited with the climb."""
    found = [r["gold_score"] for r in rows if r["sqrt_kl"] <= budget]
    for a, b in zip(rows, rows[1:], strict=False):
        if min(a["sqrt_kl"], b["sqrt_kl"]) < budget < max(a["sqrt_kl"], b["sqrt_kl"]):
            t = (budget - a["sqrt_kl"]) / (b["sqrt_kl"] - a["sqrt_kl"])
            found.append(a["gold_score"] + t * (b["gold_score"] - a["gold_score"]))
    return max(found) if found else None


def common_budget(curves: dict[str, list[dict]]) -> float:
    """The largest √KL every curve of ``curves`` (name -> :func:`frontier_rows`) reached, rounded down to 0.05:
    the budget at which all of them can be compared."""
    reach = min(max(r["sqrt_kl"] for r in rows) for rows in curves.values())
    return math.floor(reach * 20 + 1e-9) / 20  # 1e-9: a reach of 1.4 computed as 1.3999... stays 1.4


def plot(curves: dict[str, list[dict]], path: Path, per_seed: dict[str, list[list[dict]]] | None = None,
         title: str | None = None) -> Path:
    """Gold (and, where measured, reward-model) score against √KL: each method's mean over seeds with standard
    error bars; ``per_seed`` (method -> one :func:`frontier_rows` list per seed) as thin lines, since a mean
    hides seeds that diverge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("gold_score", "rm_score") if all(k in r for rows in curves.values() for r in rows)]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for i, (name, rows) in enumerate(curves.items()):
        x = [r["sqrt_kl"] for r in rows]
        color = f"C{i}"
        for ax, key in zip(axes[0], keys, strict=True):
            ax.errorbar(x, [r[key] for r in rows], yerr=[r[key + "_se"] if r["seeds"] > 1 else 0 for r in rows],
                        marker="o", markersize=3, capsize=2, label=f"{name}, mean of seeds", color=color)
            for points in (per_seed or {}).get(name, []):
                ax.plot([p["sqrt_kl"] for p in points], [p[key] for p in points], color=color, alpha=0.35,
                        linewidth=0.8, marker=".", markersize=2)
    titles = {"gold_score": "held-out gold score", "rm_score": "reward-model score (the proxy)"}
    for ax, key in zip(axes[0], keys, strict=True):
        ax.set_xlabel("√KL(π ‖ π_SFT) per answer (nats^½)")
        ax.set_title(titles[key])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, title)
