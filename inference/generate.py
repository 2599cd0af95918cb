#!/usr/bin/env python
"""Sample answers of a policy to prompts from a file or a dataset split, into a resumable JSON-lines file.

    python inference/generate.py --model out/step3 --data_path synthetic --split eval --output ppo.jsonl
    python inference/generate.py --model out/step1 --prompts prompts.jsonl --num_samples 4 --temperature 0.8 \\
        --seed 7 --output sft.jsonl

``--model``: any Hugging Face folder, a step's output (step 3's ``actor/`` is used, or ``--model_part``), or
empty for the embedded default.  The end token and prompt format come from the folder's
``conversation_format.json``.  Prompts: ``--prompts FILE`` (json/jsonl/parquet rows with ``prompt`` and an
optional ``id``), or ``--data_path`` specs as in training with ``--split eval`` (the held-out prompts step 3
evaluates on) or ``--split train`` (step 3's share), selected by the same ``--data_split`` / ``--data_seed``
/ ``--eval_fraction``.

Each row: ``prompt_id``, ``sample`` (0 … N-1), ``prompt``, ``response``, ``ended`` (stopped at the end token),
``length`` (answer tokens, end token included), ``seed`` (the batch's) and ``policy`` (``--policy_name``) —
what ``rm_eval.py`` and ``judge.py`` read.  A stopped run started again with the same flags continues where it
stopped and ends with the same file as an uninterrupted run (``--overwrite`` starts over).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from marlhf.config import BaseArgs
from marlhf.errors import ConfigError, run_cli
from marlhf.eval.generate import LoadedPolicy, generate_file, prompts_from_dataset, prompts_from_file
from marlhf.utils.model_card import STEP3_MODELS


def add_sampling_args(p: argparse.ArgumentParser, temperature: float | None = 1.0) -> None:
    """The policy and sampling flags the generation tools share."""
    p.add_argument("--model", default="", help="HF folder, step output or hub name (empty: the embedded default)")
    p.add_argument("--model_part", default="actor", choices=STEP3_MODELS, help="Which model of a step-3 output")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--max_prompt_len", type=int, default=256, help="Longer prompts keep their most recent turns")
    if temperature is not None:
        p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top_k", type=int, default=0, help="0: off")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--end_of_conversation_token", default="", help="Default: the one recorded with the model")
    p.add_argument("--prompt_format", default="auto", choices=("auto", "raw", "chat_template"))
    p.add_argument("--debug", action="store_true", help="Show tracebacks for user errors")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", default=None, help="json/jsonl/parquet file with a 'prompt' per row")
    src.add_argument("--data_path", nargs="+", default=None, help="Dataset specs as in training")
    p.add_argument("--split", default="eval", choices=("eval", "train"), help="With --data_path: which prompts")
    p.add_argument("--data_split", default=BaseArgs.data_split)
    p.add_argument("--data_seed", type=int, default=BaseArgs.seed, help="The training run's --seed (data split)")
    p.add_argument("--eval_fraction", type=float, default=BaseArgs.eval_fraction)
    p.add_argument("--bad_rows", default="error", choices=("error", "skip"))
    p.add_argument("--max_prompts", type=int, default=0, help="Use the first N prompts (0: all)")


def load_prompts(args) -> list:
    if args.prompts:
        prompts = prompts_from_file(args.prompts)
    else:
        prompts = prompts_from_dataset(args.data_path, args.split, data_split=args.data_split, seed=args.data_seed,
                                       eval_fraction=args.eval_fraction, bad_rows=args.bad_rows)
    if args.max_prompts < 0:
        raise ConfigError(f"--max_prompts must be >= 0, got {args.max_prompts}")
    return prompts[:args.max_prompts] if args.max_prompts else prompts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_args(p)
    add_prompt_args(p)
    p.add_argument("--output", required=True, help="JSON lines (resumed when it exists)")
    p.add_argument("--num_samples", type=int, default=1, help="Answers per prompt")
    p.add_argument("--greedy", action="store_true", help="Greedy decoding instead of sampling")
    p.add_argument("--seed", type=int, default=0, help="Sampling seed (each batch samples under its own)")
    p.add_argument("--batch_size", type=int, default=8, help="Prompts per generate call")
    p.add_argument("--policy_name", default="", help="The rows' 'policy' field (default: the model folder's name)")
    p.add_argument("--overwrite", action="store_true", help="Start over instead of resuming")
    p.add_argument("--no_progress", action="store_true", help="No progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    prompts = load_prompts(args)
    policy = LoadedPolicy(args.model, args.model_part, args.end_of_conversation_token, args.prompt_format)
    name = args.policy_name or (Path(args.model).name if args.model else "embedded")
    cfg = policy.config(args.max_new_tokens, args.temperature, args.top_k, args.top_p, do_sample=not args.greedy)
    source = {"prompts": args.prompts} if args.prompts else {
        "data_path": args.data_path, "split": args.split, "data_split": args.data_split, "data_seed": args.data_seed,
        "eval_fraction": args.eval_fraction}
    generate_file(policy, prompts, args.output, cfg=cfg, num_samples=args.num_samples, batch_size=args.batch_size,
                  max_prompt_len=args.max_prompt_len, seed=args.seed, policy_name=name, overwrite=args.overwrite,
                  progress=not args.no_progress, settings={"source": source})
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
