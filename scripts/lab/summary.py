"""Small pieces the result scripts share: a mean with its standard error, the machine a number came from, and a
figure written to its file."""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / √n; nan for one value)."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def machine() -> str:
    """The CPU's model name and core count (the runs' speed depends on it; their scores do not)."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores"


def save_figure(fig, path: Path, title: str | None = None) -> Path:
    """``fig`` (matplotlib) titled, laid out and written to ``path`` (its folder made), then closed."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
