"""What machine a run ran on, as recorded with its results: wall-clock numbers from two kinds of CPU do not
compare (the embedded model's step is about twice as long on one 2-core machine of this project's as on
another), so a run's ``summary.json`` names its CPU and whoever compares timings can check they match."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """``{"cpu", "cores", "gpu"}``: the CPU model, its logical CPUs and the first CUDA device ("none")."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "gpu": gpu}
