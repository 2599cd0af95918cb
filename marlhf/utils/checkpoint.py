"""Crash-safe DeepSpeed checkpoints (resume) and Hugging Face exports (the deliverable).

Layout under ``<output_dir>/checkpoints``::

    step00000040/<engine name>/...   DeepSpeed's files (model, optimizer, scheduler) per engine
    step00000040/trainer_state.json  step, epoch, data position, anything the trainer adds
    step00000040/rng_rank<r>.pt      every RNG of rank r
    latest                           the tag of the newest COMPLETE checkpoint

``latest`` is replaced atomically only after every rank finished writing, so a crash while saving leaves
the previous checkpoint as the one ``--resume`` loads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from marlhf.errors import ConfigError, UserError
from marlhf.utils import dist, events
from marlhf.utils.zero3 import materialized

log = logging.getLogger("marlhf")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def topology(engines: dict) -> dict:
    """The flags a checkpoint cannot be resumed across: world size, and each engine's ZeRO stage and LoRA rank
    (DeepSpeed's optimizer partitions and the parameter names depend on them)."""
    out: dict = {"world_size": dist.world_size()}
    for name, engine in engines.items():
        module = getattr(engine, "module", engine)
        lora = module.peft_config["default"].r if hasattr(module, "peft_config") else 0
        out[name] = {"zero_stage": int(engine.zero_optimization_stage()), "lora_dim": int(lora)}
    return out


def save_checkpoint(root: str | Path, engines: dict, step: int, state: dict, keep: int = 2) -> Path:
    """Save every engine of the run plus trainer state and RNGs as tag ``step{step}``; all ranks call this."""
    root = Path(root)
    tag = f"step{step:08d}"
    folder = root / tag
    if dist.is_main() and folder.exists():  # a half-written attempt of the same step
        shutil.rmtree(folder)
    dist.barrier()
    for name, engine in engines.items():
        if _is_frozen(engine):
            _save_frozen(engine, folder / name)
        else:
            engine.save_checkpoint(str(folder), tag=name, save_latest=False)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(dist.rng_state(), folder / f"rng_rank{dist.rank()}.pt")
    events.reached("save", step)  # the engines' files are written, the checkpoint is not complete yet
    dist.barrier()
    if dist.is_main():
        full = {"step": step, **state, "topology": topology(engines)}
        _atomic_write_text(folder / "trainer_state.json", json.dumps(full, indent=1))
        _atomic_write_text(root / "latest", tag)
        tags = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step"))
        for old in tags[:-keep] if keep > 0 else []:
            if old != tag:
                shutil.rmtree(root / old, ignore_errors=True)
        log.info("saved checkpoint %s", folder)
    dist.barrier()
    return folder


# A frozen engine's weights (the EMA: no optimizer, updated by the trainer), one file per rank: the rank's
# ZeRO-3 partitions, or the whole parameters (identical on every rank) below stage 3
FROZEN_FILE = "weights_rank{rank}.pt"


def _is_frozen(engine) -> bool:
    """An engine with no trainable parameter.  DeepSpeed sets up no checkpointing for one at ZeRO-3 (its
    ``save_checkpoint`` failed: 'NoneType' object has no attribute 'makedirs'), and it has no optimizer state to
    save at any stage: its weights are saved by :func:`_save_frozen` instead."""
    module = getattr(engine, "module", engine)
    return not any(p.requires_grad for p in module.parameters())


def _save_frozen(engine, folder: Path) -> None:
    """Each rank's ZeRO-3 partitions (what it holds for sure), or the whole parameters below ZeRO-3."""
    module = getattr(engine, "module", engine)
    state = {n: (p.ds_tensor if hasattr(p, "ds_id") else p.data).detach().cpu().clone()
             for n, p in module.named_parameters()}
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / FROZEN_FILE.format(rank=dist.rank()))


@torch.no_grad()
def _load_frozen(engine, folder: Path) -> None:
    saved = torch.load(folder / FROZEN_FILE.format(rank=dist.rank()), weights_only=True)
    module = getattr(engine, "module", engine)
    for name, p in module.named_parameters():
        if not hasattr(p, "ds_id"):
            p.data.copy_(saved[name])
            continue
        p.ds_tensor.copy_(saved[name])
        if materialized(p):  # a persistent ZeRO-3 parameter already fetched: its whole copy from the partitions
            parts = torch.distributed.get_world_size(p.ds_process_group)
            whole = torch.empty(p.ds_tensor.numel() * parts, dtype=p.dtype, device=p.ds_tensor.device)
            torch.distributed.all_gather_into_tensor(whole, p.ds_tensor.to(whole.device), group=p.ds_process_group)
            p.data.copy_(whole[:p.ds_numel].view_as(p.data))


def latest_checkpoint(root: str | Path) -> Path | None:
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    folder = Path(root) / pointer.read_text().strip()
    if not (folder / "trainer_state.json").exists():
        raise UserError(f"{pointer} names {folder}, which is incomplete; delete the pointer to start over")
    return folder


def _latest_state(root: str | Path) -> tuple[str, dict] | None:
    folder = latest_checkpoint(root)
    return None if folder is None else (str(folder), json.loads((folder / "trainer_state.json").read_text()))


def load_checkpoint(root: str | Path, engines: dict) -> dict | None:
    """Restore engines (weights, optimizer, scheduler) and RNGs from the latest checkpoint; its state or None.

    Whether there is one, which, and its trainer state are read on rank 0 and sent to the others
    (:func:`~marlhf.utils.dist.decide_on_main`): every rank then loads the same tag, or none does."""
    found = dist.decide_on_main(lambda: _latest_state(root))
    if found is None:
        return None
    folder, state = Path(found[0]), found[1]
    check_topology(folder, state.get("topology"), topology(engines))
    for name, engine in engines.items():
        if _is_frozen(engine) and (folder / name / FROZEN_FILE.format(rank=dist.rank())).exists():
            _load_frozen(engine, folder / name)
            continue
        path, _ = engine.load_checkpoint(str(folder), tag=name, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"could not load engine '{name}' from {folder}")
    rng = folder / f"rng_rank{dist.rank()}.pt"
    if rng.exists():
        dist.set_rng_state(torch.load(rng, weights_only=False))
    log.info("resumed from %s (step %d)", folder, state["step"])
    return state


def resumed_record(path: str | Path, resume: bool) -> dict | None:
    """The JSON record at ``path`` when resuming and rank 0 has it, else None — on every rank alike (the
    caller then recomputes it, collectively, e.g. step 3's initial evaluation)."""
    path = Path(path)
    return dist.decide_on_main(lambda: json.loads(path.read_text()) if resume and path.exists() else None)


def require_shared_output(output_dir: str | Path, save_steps: int = 0, resume: bool = False) -> bool:
    """Check (collectively, once per run) that every rank sees the same ``output_dir``; refuse checkpoints
    when they do not.  Returns whether it is shared.

    A DeepSpeed checkpoint is written by every rank into its own view of the folder: each rank's optimizer
    (and, under ZeRO-3, parameter) partition, plus the module states from rank 0 that every rank reads back.
    Without a shared filesystem the pieces end up on different nodes and no node can resume (or export) from
    them, and ``latest`` / ``trainer_state.json`` exist on node 0 only.  Without checkpoints a run needs no
    shared folder: logs, metrics and the exported model are written by rank 0, on node 0."""
    if dist.shares_folder(output_dir):
        return True
    flags = [f for f, on in (("--save_steps", save_steps > 0), ("--resume", resume)) if on]
    if flags:
        raise ConfigError(
            f"{' and '.join(flags)}: the ranks do not see the same --output_dir {output_dir} (a file rank 0 wrote "
            f"there is missing on another node). DeepSpeed checkpoints are written by every rank into its own "
            f"node's folder and read back from all of them, so checkpoints need an --output_dir on a filesystem "
            f"all nodes share (NFS, Lustre, ...); or run without {' and '.join(flags)}.")
    if dist.is_main():
        log.warning("--output_dir %s is not shared by all nodes: logs, metrics and the exported model are written "
                    "by rank 0 on this node only", output_dir)
    return False


def check_topology(folder: Path, saved: dict | None, current: dict) -> None:
    """Refuse to resume across a different world size / ZeRO stage / LoRA rank, naming each difference."""
    if saved is None:  # written before topologies were recorded
        return
    diffs = []
    if saved.get("world_size") != current["world_size"]:
        diffs.append(f"world size {saved.get('world_size')} (now {current['world_size']})")
    for name, now in current.items():
        if name == "world_size":
            continue
        then = saved.get(name)
        if then is None:
            diffs.append(f"no '{name}' engine (now one)")
            continue
        for key, flag in (("zero_stage", "ZeRO stage"), ("lora_dim", "LoRA rank")):
            if then.get(key) != now[key]:
                diffs.append(f"{name} {flag} {then.get(key)} (now {now[key]})")
    if diffs:
        raise UserError(f"--resume: {folder} was written with {'; '.join(diffs)}. Resume with the flags of the "
                        f"run that wrote it (ranks, --zero_stage, --lora_dim, ...) or use a new --output_dir.")
