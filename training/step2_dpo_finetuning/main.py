#!/usr/bin/env python
"""Step 2 alternative: DPO / IPO — DeepSpeed-Chat's entry point, run by the launch scripts beside it.

The code is `marlhf.cli.dpo`: the same as `marlhf dpo FLAGS` or `deepspeed --module marlhf.cli.dpo FLAGS`.
"""

import sys

from marlhf.cli.dpo import main
from marlhf.errors import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(main))
