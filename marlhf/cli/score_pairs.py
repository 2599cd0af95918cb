"""Score prompt/response pairs with a step-2 reward model.

    marlhf score-pairs --model_name_or_path out/rm --prompt "POST: ...\\nTL;DR:" \\
        --response " a summary" --response " another summary"
    marlhf score-pairs --model_name_or_path out/rm --input pairs.jsonl --output scores.jsonl
    marlhf score-pairs --model_name_or_path out/rm --data_path Anthropic/hh-rlhf:/data/hh-rlhf

An input file (json, jsonl or parquet) has rows with `prompt` and either `response`, or `chosen` and
`rejected` (then the pair accuracy is reported too).  ``--data_path`` takes the dataset specs of training
(hub names, NAME:LOCAL_PATH, files, synthetic) and scores the evaluation pairs step 2 evaluates on (the
test split, or the same held-out slice under the same --data_split / --seed / --eval_fraction).
Prompts are formatted and responses end with the end-of-conversation token exactly as in training: both
are read from the model folder (conversation_format.json); the flags only override them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from marlhf.data.adapters.files import iter_file_rows
from marlhf.data.pipeline import phase_records
from marlhf.data.records import BadRowPolicy, DataError, require_text
from marlhf.errors import run_cli
from marlhf.models.placement import add_placement_args
from marlhf.rewards.reward_model import Scorer
from marlhf.sections import DataSection, RobustnessSection, ScheduleSection, SupervisedSection
from marlhf.utils.flags import add_flags


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--prompt", default=None)
    p.add_argument("--response", action="append", default=[])
    p.add_argument("--input", default=None, help="JSON lines with prompt + response, or prompt + chosen + rejected")
    p.add_argument("--data_path", nargs="+", default=None,
                   help="Dataset specs as in training; their evaluation pairs are scored")
    add_flags(p, DataSection, only=("data_split", "eval_fraction", "bad_rows"))
    add_flags(p, ScheduleSection, only=("seed",), help={"seed": "The training run's split seed (its --data_seed, "
                                                                "else its --seed)."})
    p.add_argument("--max_eval_samples", type=int, default=0, help="Score at most this many pairs (0 = all)")
    p.add_argument("--output", default=None, help="Write one JSON line of scores per input row here")
    add_flags(p, DataSection, only=("end_of_conversation_token", "prompt_format"),
              help={"end_of_conversation_token": "Default: the one recorded with the model (else the tokenizer's own).",
                    "prompt_format": "Default (auto): the one recorded with the model."})
    add_flags(p, SupervisedSection, only=("max_seq_len",))
    p.add_argument("--batch_size", type=int, default=16)
    add_flags(p, RobustnessSection, only=("debug",))
    add_placement_args(p)
    return p.parse_args(argv)


def dataset_rows(args) -> list[dict]:
    """The evaluation pairs of ``--data_path`` as step 2 evaluates them, as prompt/chosen/rejected rows."""
    policy = BadRowPolicy(args.bad_rows)
    _, records = phase_records(args.data_path, args.data_split, 2, args.seed, args.eval_fraction, policy)
    rows = [{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected} if r.rejected is not None
            else {"prompt": r.prompt, "response": r.chosen} for r in records]
    if policy.num_skipped:
        print(policy.summary(), file=sys.stderr)
    return rows[:args.max_eval_samples] if args.max_eval_samples else rows


def read_rows(path: str) -> list[dict]:
    """Rows of a json/jsonl/parquet file, each checked for prompt + response or prompt + chosen + rejected."""
    rows = []
    for file, n, row in iter_file_rows(Path(path)):
        if isinstance(row, DataError):
            raise row
        require_text(row, "prompt", file, n)
        for field in ("response",) if "response" in row else ("chosen", "rejected"):
            require_text(row, field, file, n)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    scorer = Scorer(args.model_name_or_path, args.end_of_conversation_token, args.max_seq_len, args.prompt_format,
                    device=args.device, dtype=args.dtype)
    if args.input or args.data_path:
        rows = read_rows(args.input) if args.input else dataset_rows(args)
        results = []
        singles = [r for r in rows if "response" in r]
        pairs = [r for r in rows if "response" not in r]
        s = scorer([r["prompt"] for r in singles], [r["response"] for r in singles], args.batch_size)
        results += [{"prompt": r["prompt"], "response": r["response"], "score": v} for r, v in zip(singles, s)]
        if pairs:
            c = scorer([r["prompt"] for r in pairs], [r["chosen"] for r in pairs], args.batch_size)
            j = scorer([r["prompt"] for r in pairs], [r["rejected"] for r in pairs], args.batch_size)
            results += [{"prompt": r["prompt"], "chosen_score": a, "rejected_score": b}
                        for r, a, b in zip(pairs, c, j)]
            acc = sum(a > b for a, b in zip(c, j)) / len(pairs)
            print(f"pairs: {len(pairs)}  accuracy {acc:.4f}  mean chosen {sum(c) / len(c):.4f}  "
                  f"mean rejected {sum(j) / len(j):.4f}")
        if singles:
            print(f"responses: {len(singles)}  mean score {sum(s) / len(s):.4f}")
        if args.output:
            with open(args.output, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in results)
        return 0
    if args.prompt is None or not args.response:
        print("give --prompt and one or more --response, --input FILE or --data_path SPEC", file=sys.stderr)
        return 2
    for response, score in zip(args.response, scorer([args.prompt] * len(args.response), args.response)):
        print(f"{score:+.4f}\t{response!r}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
