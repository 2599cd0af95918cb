"""Run an entry point with a pause installed at one of its announced points (marlhf/utils/events.py): on rank
0, on reaching WHERE:STEP the process writes MARKER and sleeps, so that a crash-safety test can SIGKILL it
exactly there.

    python tests/pause_harness.py WHERE:STEP MARKER SCRIPT.py|-m MODULE [ARGS...]
"""

import runpy
import sys
import time
from pathlib import Path

from marlhf.utils import dist, events


def main() -> None:
    point, marker, *target = sys.argv[1:]

    def pause(where: str, step: int) -> None:
        if f"{where}:{step}" == point and dist.is_main():
            Path(marker).write_text(point)
            time.sleep(600)

    events.add_listener(pause)
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main()
