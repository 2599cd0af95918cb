"""A block of code on its own torch RNG stream, leaving the caller's streams as they were.

``torch.manual_seed`` reseeds the CPU generator and every visible device's generator (``torch.cuda.manual_seed_all``).
``torch.random.fork_rng(devices=[])`` saves and restores the CPU's only, so a seeded evaluation inside it used
to reset the training run's CUDA sampling stream to the evaluation seed at every evaluation (the issue-29
finding).  :func:`isolated_rng` forks the CPU and every device of the current accelerator, the same set that
``manual_seed`` reaches.  Saving a device's state does not create a CUDA context on it (the generator's state
is host-side seed and offset), so forking all of a node's devices costs microseconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def rng_devices() -> tuple[str | None, list[int]]:
    """(device type, indices) of the accelerator devices ``torch.manual_seed`` reseeds: every visible device of
    the current accelerator (CUDA / ROCm / XPU ...); (None, []) on a CPU-only machine."""
    acc = torch.accelerator.current_accelerator()
    if acc is None:
        return None, []
    module = torch.get_device_module(acc.type)
    return acc.type, list(range(module.device_count()))


@contextlib.contextmanager
def isolated_rng(seed: int | None = None) -> Iterator[None]:
    """Run the block with the CPU's and every accelerator device's RNG state restored afterwards; with ``seed``,
    the block starts from ``torch.manual_seed(seed)``."""
    device_type, devices = rng_devices()
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        if seed is not None:
            torch.manual_seed(seed)
        yield
