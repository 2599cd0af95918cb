"""Process-group helpers: one place that knows about ranks, so the rest of the code stays rank-agnostic."""

from __future__ import annotations

import logging
import os
import random
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("marlhf")


def init_distributed() -> None:
    """Start the process group once (gloo on CPU, nccl on CUDA — DeepSpeed picks the accelerator's backend).

    A plain ``python main.py`` (no launcher) becomes a world of one, so the same code path runs everywhere.
    """
    import deepspeed

    if dist.is_available() and dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
    from marlhf.errors import UserError

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


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    from deepspeed.accelerator import get_accelerator

    get_accelerator().manual_seed_all(seed)


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
