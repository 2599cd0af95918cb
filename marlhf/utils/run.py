"""Start of every entry point: process group, seeds, logging, and a record of the exact configuration."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

from marlhf.utils import dist
from marlhf.utils.checkpoint import require_shared_output
from marlhf.utils.tracking import setup_logging

log = logging.getLogger("marlhf")


def setup_run(args) -> None:
    dist.init_distributed()
    dist.set_seed(args.seed)
    setup_logging(args.output_dir)
    # collective: refuses checkpoints the nodes could not read back (before any model is loaded)
    require_shared_output(args.output_dir, getattr(args, "save_steps", 0), getattr(args, "resume", False))
    if dist.is_main():
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
        log.info("command: %s", " ".join(sys.argv))
    log.info("world size %d, device %s, dtype %s", dist.world_size(), dist.device(), args.dtype)
