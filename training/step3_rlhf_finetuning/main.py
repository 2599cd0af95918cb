#!/usr/bin/env python
"""Step 3: RLHF with MA-PPO — DeepSpeed-Chat's entry point, run by the launch scripts beside it.

The code is `marlhf.cli.ppo`: the same as `marlhf ppo FLAGS` or `deepspeed --module marlhf.cli.ppo FLAGS`.
"""

import sys

from marlhf.cli.ppo import main
from marlhf.errors import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(main))
