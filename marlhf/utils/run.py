"""Start of every entry point: process group, seeds, logging, and a record of the exact configuration.

``args.json`` in the output folder holds the flags as given, and under ``"run_context"`` what the run resolved
from them at start (the task, the model an empty path stands for, the end token, the prompt format, the response
kind, the learning rates in force): the flags themselves are never rewritten."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from marlhf.utils import dist
from marlhf.utils.checkpoint import require_shared_output
from marlhf.utils.tracking import setup_logging

log = logging.getLogger("marlhf")

RUN_CONTEXT = "run_context"  # the key of the resolved values in args.json


def setup_run(output_dir: str, *, seed: int, dtype: str, flags: dict, save_steps: int = 0,
              resume: bool = False) -> None:
    """Process group, seeds and logging; ``flags`` (the parsed flags as given) recorded in ``args.json``."""
    dist.init_distributed()
    dist.set_seed(seed)
    setup_logging(output_dir)
    # collective: refuses checkpoints the nodes could not read back (before any model is loaded)
    require_shared_output(output_dir, save_steps, resume)
    if dist.is_main():
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "args.json").write_text(json.dumps(flags, indent=1))
        log.info("command: %s", " ".join(sys.argv))
    log.info("world size %d, device %s, dtype %s", dist.world_size(), dist.device(), dtype)


def record_run_context(output_dir: str, **values) -> None:
    """Add ``values`` (resolved at run time) to ``args.json``'s ``"run_context"`` (rank 0 writes)."""
    if not dist.is_main():
        return
    path = Path(output_dir) / "args.json"
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    recorded[RUN_CONTEXT] = {**recorded.get(RUN_CONTEXT, {}), **values}
    path.write_text(json.dumps(recorded, indent=1))
    log.info("run context: %s", ", ".join(f"{k}={v!r}" for k, v in values.items()))


def recorded_value(recorded: dict, key: str, default=None):
    """A value of a run's ``args.json``: what the run resolved (its run context) before the flag as given."""
    context = recorded.get(RUN_CONTEXT) or {}
    if context.get(key) not in (None, ""):
        return context[key]
    return recorded.get(key, default)
