"""The project's cache folder and folders built atomically (the embedded task, converted models, parsers).

Every cached folder is built in a temporary sibling and renamed into place, so a crash never leaves a folder
that looks complete and concurrent callers (e.g. several DeepSpeed ranks) agree on one result.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)


def default_home() -> Path:
    """``$MARLHF_HOME`` if set, else ``~/.cache/marlhf``."""
    return Path(os.environ.get("MARLHF_HOME") or Path.home() / ".cache" / "marlhf")


def check_complete(folder: Path, names: list[str]) -> None:
    """A folder only appears complete (atomic rename); a missing file means it was edited by hand."""
    missing = [n for n in names if not (folder / n).exists()]
    if missing:
        raise FileNotFoundError(
            f"{folder} lacks {', '.join(missing)}; rebuild it with --force (or delete it)"
        )


def build_atomically(target: Path, build, replace: bool, required: tuple[str, ...] = ()) -> None:
    """Run ``build(tmp)`` in a fresh sibling folder, then rename it to ``target``.

    If another process completed ``target`` meanwhile, its result is kept and ours discarded.  With
    ``replace`` an existing ``target`` is swapped out (renamed away first, then deleted).  ``required``: files
    the build must have written; a build without them fails here and ``target`` is left as it was.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    logger.info("building %s", target)
    try:
        build(tmp)
        missing = [name for name in required if not (tmp / name).exists()]
        if missing:
            raise RuntimeError(f"building {target} wrote no {', '.join(missing)}; nothing was kept")
        if replace and target.exists():
            trash = target.parent / f".old-{target.name}-{uuid.uuid4().hex[:8]}"
            target.rename(trash)
            shutil.rmtree(trash)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():
                raise
            logger.info("%s was completed by another process; keeping that one", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def save_pretrained_here(obj, folder: Path, **kwargs) -> None:
    """``obj.save_pretrained(folder, **kwargs)`` on this process whatever its rank.  Once a process group is up,
    transformers 5 writes a model's weights on global rank 0 only; a cache folder is built by whichever rank (or
    node) gets there first, and a folder holding a tokenizer without its model must never be renamed into
    place."""
    if not hasattr(obj, "should_save_on_this_rank"):
        obj.save_pretrained(folder, **kwargs)
        return
    obj.should_save_on_this_rank = lambda is_main_process: is_main_process  # this instance only
    try:
        obj.save_pretrained(folder, **kwargs)
    finally:
        del obj.should_save_on_this_rank
