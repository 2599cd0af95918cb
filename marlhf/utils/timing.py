"""Wall-clock time per named phase of a step-3 step, for the cost benchmark (``scripts/bench_step3.py``).

The rollout and the update take an optional ``timer`` and wrap each of their phases in ``with timer(name)``:
generation, the forward of each model, the reward, the macro part, the actor / critic / ptx updates.  The
default :data:`NO_TIMER` returns one shared ``nullcontext``, so an untimed step pays two attribute look-ups
per phase and computes exactly what it computes without the hook.  Only wall time is read around the
phase; nothing inside it changes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class PhaseTimer:
    """Seconds and call counts per phase name, summed over every ``with timer(name):`` since :meth:`reset`.

    Phases may nest (``train`` around ``train/actor``): each name sums its own spans, so a name's time
    includes that of the names nested in it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class _NoTimer:
    """The default: times nothing (one shared, reusable null context)."""

    _null = contextlib.nullcontext()

    def __call__(self, name: str) -> contextlib.nullcontext:
        return self._null


NO_TIMER = _NoTimer()
