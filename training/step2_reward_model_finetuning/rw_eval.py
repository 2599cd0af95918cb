#!/usr/bin/env python
"""Score prompt/response pairs with a step-2 reward model — DeepSpeed-Chat's rw_eval.py.

The code is `marlhf.cli.score_pairs`: the same as `marlhf score-pairs FLAGS`.
"""

import sys

from marlhf.cli.score_pairs import main
from marlhf.errors import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(main))
