#!/usr/bin/env python
"""Step 2: reward model — DeepSpeed-Chat's entry point, run by the launch scripts beside it.

The code is `marlhf.cli.rm`: the same as `marlhf rm FLAGS` or `deepspeed --module marlhf.cli.rm FLAGS`.
"""

import sys

from marlhf.cli.rm import main
from marlhf.errors import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(main))
