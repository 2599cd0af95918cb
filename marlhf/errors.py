"""User errors (bad data, paths, flags) versus bugs, and the one place entry points turn them into exits.

A :class:`UserError` is something the user can fix from the message alone: the entry point prints that
message as one line (rank 0 only, not once per rank) and exits with status 1, without a traceback.
Anything else is a bug and keeps its traceback.  ``--debug`` shows tracebacks for user errors too.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

EXIT_USER_ERROR = 1


class UserError(Exception):
    """A mistake in the user's input whose message says what to fix (file, row, field, flag)."""


class ConfigError(UserError, ValueError):
    """A bad flag value or combination, a missing path, or data too small for the requested run."""


class PlatformError(UserError, RuntimeError):
    """A requested feature this machine cannot run (e.g. GPU-only DeepSpeed kernels on a CPU)."""


class RewardError(UserError, RuntimeError):
    """The user's reward (``--reward_source python`` / ``remote``) failed or answered wrongly during a run:
    the function raised, the server could not be reached, or the rewards were the wrong count or not finite
    numbers.  The message names the function or URL and what was wrong."""


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient (``marlhf.utils.optim_step``'s
    guard); the run stops."""


def _is_rank0() -> bool:
    # RANK is set by every launcher before the process group exists; errors can come before init
    return int(os.environ.get("RANK", "0")) == 0


def run_cli(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> int:
    """Run an entry point's ``main(argv)``; a :class:`UserError` (or a run stopped by the non-finite guard)
    becomes one line on stderr from rank 0 and exit status 1.  Returns main's int result (or 0)."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        result = main(argv)
    except (UserError, NonFiniteError) as err:
        if debug:
            raise
        logging.shutdown()  # flush the log file before the message, so it is the last line
        if _is_rank0():
            print(f"error: {err}", file=sys.stderr, flush=True)
        elif isinstance(err, RewardError):  # met by this rank alone (its rows, its request): rank 0 cannot say it
            print(f"error: [rank {os.environ.get('RANK')}] {err}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except Exception as err:
        if not debug and _port_in_use(err):  # a DistNetworkError too, but nobody else stopped: say what to do
            logging.shutdown()
            if _is_rank0():
                port = os.environ.get("MASTER_PORT", "29500")
                print(f"error: the rendezvous port {port} is already in use (another run on this machine?); "
                      "pick a free one with MASTER_PORT=N (launch scripts) or deepspeed --master_port N",
                      file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        # another rank stopped (its user error is reported by rank 0, or its traceback by itself): this rank's
        # collective then fails with a connection error that says nothing new; exit quietly instead of adding
        # one traceback per rank
        if debug or not _peer_lost(err):
            raise
        logging.shutdown()
        if _is_rank0():
            print("error: another rank stopped; see its messages above (--debug for every rank's traceback)",
                  file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return result if isinstance(result, int) else 0


def _port_in_use(err: Exception) -> bool:
    text = str(err).lower()
    return "address already in use" in text or "eaddrinuse" in text


def _peer_lost(err: Exception) -> bool:
    """A collective failed because a peer process is gone (gloo / NCCL / the TCP store say so)."""
    import torch.distributed as tdist

    text = str(err)
    markers = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe")
    return isinstance(err, getattr(tdist, "DistNetworkError", ())) or any(m in text for m in markers)
