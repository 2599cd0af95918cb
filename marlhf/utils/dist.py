"""Process-group helpers: one place that knows about ranks, so the rest of the code stays rank-agnostic."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from marlhf.errors import UserError

log = logging.getLogger("marlhf")
T = TypeVar("T")


def init_distributed() -> None:
    """Start the process group once (gloo on CPU, nccl on CUDA — DeepSpeed picks the accelerator's backend).

    A plain ``python main.py`` (no launcher) becomes a world of one, so the same code path runs everywhere.
    """
    import deepspeed

    os.environ.setdefault("RANK", "0")  # also when a library started the group (an in-process vLLM engine)
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if dist.is_available() and dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    set_local_device()  # before the process group: its first collective must already run on this rank's device
    deepspeed.init_distributed()


def set_local_device() -> None:
    """Make ``cuda:<LOCAL_RANK>`` (the accelerator's equivalent) this process's current device.

    NCCL runs a collective whose device it cannot read off a tensor (``barrier``, ``broadcast_object_list``)
    on the current device.  DeepSpeed sets it only when the first engine is built; any collective before that
    (the data cache's, the shared-folder check's, a checkpoint decision's) would run on device 0 in every rank
    of a node — a hang or NCCL's "duplicate GPU" error.  The CPU accelerator has no device to pick."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu":
        acc.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_world_size() -> int:
    """Ranks on this node (the launcher's LOCAL_WORLD_SIZE; the whole world when it is not set)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def is_main() -> bool:
    return rank() == 0


def is_local_main() -> bool:
    """First rank of this node: the one that writes node-local files (e.g. the tokenized-data cache)."""
    return int(os.environ.get("LOCAL_RANK", 0)) == 0


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextmanager
def work_for_all():
    """Work some ranks do for the others (e.g. the first rank of a node builds the data cache), ended by a
    barrier that also carries the outcome.  A user error inside stops every rank together: the rank that hit
    it re-raises it (rank 0 prints it), the others raise a short :class:`UserError` — instead of dying at
    the barrier with a connection error and a traceback when the failing rank exits first."""

    failed = None
    try:
        yield
    except UserError as err:
        failed = err
    if world_size() > 1:
        flag = torch.tensor([float(failed is not None)], device=device())
        dist.all_reduce(flag)
        if failed is None and flag.item():
            raise UserError("stopped because another rank reported an error (rank 0 prints it)")
    if failed is not None:
        raise failed


def decide_on_main(fn: Callable[[], T]) -> T:
    """``fn()`` run on global rank 0 and its (picklable) result handed to every rank.

    For decisions that read files — is there a checkpoint to resume, which one, was the initial evaluation
    already written: when the ranks read them themselves, ranks that do not see the same folder (nodes without
    a shared filesystem, or one whose cache lags) take different branches, and a rank that skips a collective
    the others enter hangs them all.  An error in ``fn`` stops every rank: rank 0 raises it, the others a short
    :class:`UserError` (a user error) or RuntimeError (anything else)."""

    if world_size() == 1:
        return fn()
    box: list = [None]
    failure = None
    if is_main():
        try:
            box[0] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - re-raised below, after the others learnt of it
            failure = err
            box[0] = ("user error" if isinstance(err, UserError) else "error", None)
    dist.broadcast_object_list(box, src=0, device=device())
    kind, value = box[0]
    if failure is not None:
        raise failure
    if kind == "user error":
        raise UserError("stopped because rank 0 reported an error (rank 0 prints it)")
    if kind == "error":
        raise RuntimeError("stopped because rank 0 failed (see its traceback)")
    return value


def shares_folder(folder: str | Path) -> bool:
    """Whether every rank sees the same ``folder`` (collective): rank 0 writes a file with a fresh random name
    into it, every rank looks for it.  False when any rank does not find it — a node whose folder of that path
    is its own disk.  (A fresh name every time: no rank can hold a cached answer for it.)"""
    if world_size() == 1:
        return True
    import secrets

    token = [None]
    if is_main():
        token[0] = f".marlhf-shared-{secrets.token_hex(8)}"
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / token[0]).write_text(token[0])
        except OSError:  # rank 0 cannot write there: it reads back nothing, so "not shared" (and the run fails
            pass  # at its first write with the reason), instead of leaving the others waiting below
    dist.broadcast_object_list(token, src=0, device=device())  # sent after the file is written and closed
    path = Path(folder) / token[0]
    try:
        seen = path.read_text() == token[0]
    except OSError:
        seen = False
    flag = torch.tensor([float(seen)], device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if is_main():
        path.unlink(missing_ok=True)
    return bool(flag.item())


def device() -> torch.device:
    """This rank's accelerator device (``cpu`` here, ``cuda:<local_rank>`` on a GPU node)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    name = acc.device_name()
    if name == "cpu":
        return torch.device("cpu")
    return torch.device(acc.device_name(int(os.environ.get("LOCAL_RANK", 0))))


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= world_size()
    return x


def max_over_ranks(n: int) -> int:
    """The largest of every rank's ``n``: how many times to enter a loop whose every pass is collective (ZeRO-3
    forwards, generation), so that a rank with less work still joins the others' passes."""
    if world_size() == 1:
        return n
    x = torch.tensor([n], dtype=torch.long, device=device())
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return int(x.item())


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    from deepspeed.accelerator import get_accelerator

    get_accelerator().manual_seed_all(seed)


def seed_rank_streams(seed: int) -> None:
    """Give every rank its own random stream from here on (call it once the models are built).

    :func:`set_seed` seeds all ranks alike, so that whatever is drawn while the models are built (a new value
    head, LoRA's A matrices, added embedding rows) is the same everywhere; the data order has its own seeded
    generators.  What is drawn afterwards — sampling without a seed, dropout masks — must differ between ranks,
    or every rank draws the same answers to a shared prompt and the same masks.  Rank 0 keeps the stream it has
    (a one-rank run is unchanged, so recorded runs still reproduce); rank r > 0 restarts from ``seed + r``.  A
    resumed run then restores each rank's saved state over this (:func:`set_rng_state`)."""
    if rank() > 0:
        set_seed(seed + rank())


def rng_state() -> dict:
    """Every RNG this process draws from, so a resumed run continues the same random stream."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if acc.device_name() != "cpu":
        state["accelerator"] = acc.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])
