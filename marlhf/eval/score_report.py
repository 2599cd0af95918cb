"""Score distributions of several policies' generations under a reward model (and the embedded task's gold
scorer): per-policy statistics, each policy's mean shift against a baseline, and histograms — the paper's
reward-distribution figures (Figs. 3 and 10) for any set of policies.

A generations file is JSON lines (or json / parquet) with ``prompt``, ``response`` and ``policy`` per row;
several files may be given, and one file may hold several policies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from marlhf.data.adapters.files import iter_file_rows
from marlhf.data.records import DataError, require_text
from marlhf.errors import ConfigError

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def read_generations(paths: Sequence[str | Path]) -> dict[str, list[tuple[str, str]]]:
    """``{policy: [(prompt, response), ...]}`` in file order; a bad row is a DataError naming file, row, field."""
    out: dict[str, list[tuple[str, str]]] = {}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"generations file {str(path)!r} does not exist")
        for file, n, row in iter_file_rows(path):
            if isinstance(row, DataError):
                raise row
            prompt = require_text(row, "prompt", file, n)
            response = row.get("response")
            if not isinstance(response, str):  # an empty answer is a legitimate (badly scored) generation
                raise DataError(file, n, "response", "missing" if response is None
                                else f"expected text, got {type(response).__name__}")
            policy = require_text(row, "policy", file, n)
            out.setdefault(policy, []).append((prompt, response))
    if not out:
        raise ConfigError(f"no generations in {', '.join(map(str, paths))}")
    return out


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default ``linear`` method)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(scores: Sequence[float]) -> dict[str, float]:
    """n, mean, population std (ddof 0: the spread of these very generations) and quantiles."""
    n = len(scores)
    mean = sum(scores) / n
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / n)
    ordered = sorted(scores)
    return {"n": n, "mean": mean, "std": std, **{f"q{round(q * 100):02d}": quantile(ordered, q) for q in QUANTILES}}


def score_policies(generations: dict[str, list[tuple[str, str]]],
                   scorers: dict[str, Callable[[list[str], list[str]], list[float]]]) -> dict[str, dict[str, list]]:
    """``{scorer: {policy: scores}}``."""
    return {name: {policy: list(fn([p for p, _ in pairs], [r for _, r in pairs]))
                   for policy, pairs in generations.items()}
            for name, fn in scorers.items()}


def build_report(scores: dict[str, dict[str, list[float]]], baseline: str | None) -> dict:
    """Statistics per scorer and policy, plus ``shift`` = policy mean - baseline mean (and in baseline stds)."""
    report: dict = {"baseline": baseline, "scorers": {}}
    for name, by_policy in scores.items():
        if baseline is not None and baseline not in by_policy:
            raise ConfigError(f"--baseline {baseline!r} is not one of the policies: {', '.join(sorted(by_policy))}")
        stats = {policy: summarize(values) for policy, values in by_policy.items()}
        if baseline is not None:
            base = stats[baseline]
            for s in stats.values():
                s["shift"] = s["mean"] - base["mean"]
                s["shift_in_baseline_std"] = s["shift"] / base["std"] if base["std"] > 0 else None
        report["scorers"][name] = stats
    return report


def format_report(report: dict) -> str:
    lines = []
    for name, stats in report["scorers"].items():
        lines.append(f"[{name}]")
        cols = ["n", "mean", "std", *(f"q{round(q * 100):02d}" for q in QUANTILES)]
        if report["baseline"] is not None:
            cols.append("shift")
        lines.append(f"{'policy':<20}" + "".join(f"{c:>10}" for c in cols))
        for policy, s in stats.items():
            cells = [f"{s[c]:>10d}" if c == "n" else f"{s[c]:>+10.4f}" if c == "shift" else f"{s[c]:>10.4f}"
                     for c in cols]
            lines.append(f"{policy:<20}" + "".join(cells))
    return "\n".join(lines)


def plot_distributions(scores: dict[str, dict[str, list[float]]], path: str | Path, bins: int = 30) -> None:
    """One panel per scorer with an overlaid, density-normalised histogram per policy (shared bin edges,
    so the shapes compare) and a dashed line at each policy's mean."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on training nodes
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scores), figsize=(5.5 * len(scores), 4), squeeze=False)
    for ax, (name, by_policy) in zip(axes[0], scores.items()):
        values = [v for vs in by_policy.values() for v in vs]
        lo, hi = min(values), max(values)
        edges = [lo + (hi - lo) * i / bins for i in range(bins + 1)] if hi > lo else bins
        for i, (policy, vs) in enumerate(by_policy.items()):
            color = f"C{i % 10}"
            ax.hist(vs, bins=edges, density=True, alpha=0.45, color=color, label=policy)
            ax.axvline(sum(vs) / len(vs), color=color, linestyle="--", linewidth=1)
        ax.set_xlabel(f"{name} score")
        ax.set_ylabel("density")
        ax.set_title(f"{name} score distribution")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
