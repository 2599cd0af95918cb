#!/usr/bin/env python
"""Score prompt/response pairs with a step-2 reward model.

    python rw_eval.py --model_name_or_path out/rm --prompt "POST: ...\\nTL;DR:" \\
        --response " a summary" --response " another summary"
    python rw_eval.py --model_name_or_path out/rm --input pairs.jsonl --output scores.jsonl

An input file (json, jsonl or parquet) has rows with `prompt` and either `response`, or `chosen` and
`rejected` (then the pair accuracy is reported too). Responses get the end-of-conversation token
appended, as in training.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from marlhf.data.adapters.files import iter_file_rows
from marlhf.data.records import DataError, require_text
from marlhf.errors import run_cli
from marlhf.models.loading import load_tokenizer, load_value_model, sequence_scores


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--prompt", default=None)
    p.add_argument("--response", action="append", default=[])
    p.add_argument("--input", default=None, help="JSON lines with prompt + response, or prompt + chosen + rejected")
    p.add_argument("--output", default=None, help="Write one JSON line of scores per input row here")
    p.add_argument("--end_of_conversation_token", default="<|endoftext|>")
    p.add_argument("--max_seq_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--debug", action="store_true", help="Show tracebacks for user errors (bad file, missing model)")
    return p.parse_args(argv)


class Scorer:
    def __init__(self, path: str, eot: str, max_seq_len: int):
        self.tok = load_tokenizer(path, eot)
        self.model = load_value_model(path, self.tok).eval()
        self.eot, self.max_len = eot, max_seq_len

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str], batch_size: int = 16) -> list[float]:
        out = []
        for i in range(0, len(prompts), batch_size):
            texts = [p + r + self.eot for p, r in zip(prompts[i:i + batch_size], responses[i:i + batch_size])]
            enc = self.tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_len)
            out += sequence_scores(self.model, enc["input_ids"], enc["attention_mask"]).tolist()
        return out


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
    scorer = Scorer(args.model_name_or_path, args.end_of_conversation_token, args.max_seq_len)
    if args.input:
        rows = read_rows(args.input)
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
        print("give --prompt and one or more --response, or --input FILE", file=sys.stderr)
        return 2
    for response, score in zip(args.response, scorer([args.prompt] * len(args.response), args.response)):
        print(f"{score:+.4f}\t{response!r}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
