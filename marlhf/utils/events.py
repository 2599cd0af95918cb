"""Named points a run passes (``save`` of a checkpoint, a training ``step``, a ``generate`` batch written), and
callbacks a caller installs on them.  Production code only announces; nothing listens unless installed —
the crash-safety tests install a listener that stops the process at one point so that they can SIGKILL it
there (``tests/pause_harness.py``)."""

from __future__ import annotations

from collections.abc import Callable

Listener = Callable[[str, int], None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> Listener:
    """Call ``listener(where, step)`` at every point announced from now on, in this process."""
    _listeners.append(listener)
    return listener


def remove_listener(listener: Listener) -> None:
    _listeners.remove(listener)


def reached(where: str, step: int) -> None:
    """Announce that this process has reached point ``where`` at ``step`` (a no-op without listeners)."""
    for listener in list(_listeners):
        listener(where, step)
