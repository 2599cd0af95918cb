#!/usr/bin/env python
"""Step 1: supervised fine-tuning — DeepSpeed-Chat's entry point, run by the launch scripts beside it.

The code is `marlhf.cli.sft`: the same as `marlhf sft FLAGS` or `deepspeed --module marlhf.cli.sft FLAGS`.
"""

import sys

from marlhf.cli.sft import main
from marlhf.errors import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(main))
