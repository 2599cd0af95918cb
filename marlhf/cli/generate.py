"""Sample answers of a policy to prompts from a file or a dataset split, into a resumable JSON-lines file.

    marlhf generate --model out/step3 --data_path synthetic --split eval --output ppo.jsonl
    marlhf generate --model out/step1 --prompts prompts.jsonl --num_samples 4 --temperature 0.8 \\
        --seed 7 --output sft.jsonl

``--model``: any Hugging Face folder, a step's output (step 3's ``actor/`` is used, or ``--model_part``), or
empty for the embedded default.  The end token and prompt format come from the folder's
``conversation_format.json``.  Prompts: ``--prompts FILE`` (json/jsonl/parquet rows with ``prompt`` and an
optional ``id``), or ``--data_path`` specs as in training with ``--split eval`` (the held-out prompts step 3
evaluates on) or ``--split train`` (step 3's share; with ``--phase 2`` step 2's, the prompts whose answers
``marlhf label`` pairs), selected by the same ``--data_split`` / ``--data_seed`` / ``--eval_fraction``.

Each row: ``prompt_id``, ``sample`` (0 … N-1), ``prompt``, ``response``, ``ended`` (stopped at the end token),
``length`` (answer tokens, end token included), ``seed`` (the batch's) and ``policy`` (``--policy_name``) —
what ``marlhf score-policies``, ``judge`` and ``label`` read.  A stopped run started again with the same flags continues
where it stopped and ends with the same file as an uninterrupted run (``--overwrite`` starts over).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from marlhf.errors import run_cli
from marlhf.eval.generate_tool import LoadedPolicy, PromptSource, add_prompt_args, add_sampling_args, generate_file
from marlhf.sections import GenerationEngineSection, SamplingSection, ScheduleSection
from marlhf.utils.flags import add_flags


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_args(p)
    add_prompt_args(p)
    p.add_argument("--output", required=True, help="JSON lines (resumed when it exists)")
    p.add_argument("--num_samples", type=int, default=1, help="Answers per prompt")
    p.add_argument("--greedy", action="store_true", help="Greedy decoding instead of sampling")
    add_flags(p, ScheduleSection, only=("seed",), help={"seed": "Sampling seed (each batch samples under its own)"})
    p.add_argument("--batch_size", type=int, default=8, help="Prompts per generate call")
    p.add_argument("--policy_name", default="", help="The rows' 'policy' field (default: the model folder's name)")
    p.add_argument("--overwrite", action="store_true", help="Start over instead of resuming")
    p.add_argument("--no_progress", action="store_true", help="No progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    prompts = PromptSource.build(args).load()
    sampling = SamplingSection.build(args)
    policy = LoadedPolicy(args.model, args.model_part, args.end_of_conversation_token, args.prompt_format,
                          device=args.device, dtype=args.dtype, engine=GenerationEngineSection.build(args))
    name = args.policy_name or (Path(args.model).name if args.model else "embedded")
    cfg = policy.config(sampling, do_sample=not args.greedy)
    source = {"prompts": args.prompts} if args.prompts else {
        "data_path": args.data_path, "split": args.split, "phase": args.phase, "data_split": args.data_split,
        "data_seed": args.data_seed, "eval_fraction": args.eval_fraction}
    generate_file(policy, prompts, args.output, cfg=cfg, num_samples=args.num_samples, batch_size=args.batch_size,
                  max_prompt_len=sampling.max_prompt_len, seed=args.seed, policy_name=name, overwrite=args.overwrite,
                  progress=not args.no_progress, settings={"source": source})
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
