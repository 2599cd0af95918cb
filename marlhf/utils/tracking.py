"""Metrics on rank 0: console, TensorBoard and a ``metrics.jsonl`` file (what tests and plots read)."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

from marlhf.utils import dist

log = logging.getLogger("marlhf")


def setup_logging(output_dir: str | None = None, level: int = logging.INFO) -> None:
    """Console logging on every rank (tagged with the rank when there are several) + a log file on rank 0."""
    tag = f"[rank{dist.rank()}] " if dist.world_size() > 1 else ""
    fmt = logging.Formatter(f"%(asctime)s {tag}%(levelname)s %(message)s", "%H:%M:%S")
    root = logging.getLogger("marlhf")
    root.setLevel(level)
    for old in root.handlers:  # a handler replaced is closed, not left holding its file
        old.close()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(fmt)
    handler.setLevel(level if dist.is_main() else logging.WARNING)
    root.addHandler(handler)
    if output_dir and dist.is_main():
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(Path(output_dir) / "train.log")
        fh.setFormatter(fmt)
        root.addHandler(fh)
    root.propagate = False


def close_run_log() -> None:
    """Detach and close the run's ``train.log`` (console logging stays): whatever runs next in the same process
    — another run, a library call — must not write into, or fail on, a finished run's log."""
    root = logging.getLogger("marlhf")
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


class Tracker:
    """Writes scalar metrics from rank 0; every other rank's calls are no-ops."""

    def __init__(self, output_dir: str, tensorboard_path: str = "", enable_tensorboard: bool = False,
                 print_every_step: bool = False):
        self.active = dist.is_main()
        self.print_every_step = print_every_step
        self.writer = None
        self.file = None
        if not self.active:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(output_dir) / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_path or str(Path(output_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict, prefix: str = "", echo: bool | None = None) -> None:
        if not self.active:
            return
        clean = {f"{prefix}{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        for k, v in clean.items():
            if self.writer is not None and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self.file.flush()
        if echo if echo is not None else self.print_every_step:
            log.info("step %d | %s", step, " | ".join(f"{k} {v:.4g}" for k, v in clean.items()))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.file is not None:
            self.file.close()


def read_metrics(output_dir: str) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
