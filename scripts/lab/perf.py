"""What the benchmark scripts measure about the machine and the process: the matmul peak, resident memory.

* :func:`matmul_peak_gflops` — the best fp32 (n × n) @ (n × n) product rate with torch's current thread
  count: the yardstick a model's FLOP/s is divided by (``scripts/bench_real_model.py``,
  ``scripts/bench_step3.py``).
* :class:`PeakRSS` — the process's peak resident memory over a span of code, on Linux: freed heap is handed
  back to the OS (glibc ``malloc_trim``) and the kernel's high-water mark is reset (``/proc/self/clear_refs``
  ``5``) at the start, and ``VmHWM`` read at the end, so spans measured one after another in one process
  each get their own peak instead of the maximum since the process started.
* :func:`tensor_megabytes` — the bytes of a set of tensors (weights, gradients, optimizer state).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from pathlib import Path

import torch

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def matmul_peak_gflops(n: int = 1024, repeats: int = 20) -> float:
    """GFLOP/s of the fastest of ``repeats`` fp32 (n × n) @ (n × n) products (2·n³ FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def _status_mb(field: str) -> float:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{_STATUS} has no {field} line")


class PeakRSS:
    """Peak resident memory of this process between :meth:`start` and :meth:`stop` (MB), Linux only.

    ``start`` collects garbage, trims the heap and resets the high-water mark, and returns the resident
    memory then (what the span starts from); ``stop`` returns the high-water mark since.  The peak can
    include heap the allocator kept from before ``start`` if trimming could not return it."""

    def __init__(self) -> None:
        self.available = _STATUS.exists() and _CLEAR_REFS.exists()
        self.why_not = "" if self.available else f"{_STATUS} / {_CLEAR_REFS} missing (not Linux)"
        libc_name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(libc_name) if libc_name else None
        self._trim = getattr(libc, "malloc_trim", None)

    def start(self) -> float:
        if not self.available:
            raise RuntimeError(f"peak memory cannot be measured here: {self.why_not}")
        gc.collect()
        if self._trim is not None:
            self._trim(0)
        _CLEAR_REFS.write_text("5")  # reset VmHWM to the current VmRSS (Linux ≥ 4.0)
        return _status_mb("VmRSS")

    def stop(self) -> float:
        return _status_mb("VmHWM")


def tensor_megabytes(tensors) -> float:
    """MB held by ``tensors`` (an iterable; non-tensors are skipped, shared storages counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total / 2 ** 20
