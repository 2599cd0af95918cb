"""Preference pairs on a policy's own answers, labelled by a simulated annotator (marlhf/data/onpolicy.py).

    marlhf generate --model out/sft --data_path synthetic --split train --num_samples 2 --output answers.jsonl
    marlhf label --generations answers.jsonl --annotator gold --tau 0.1 --output out/pairs
    marlhf rm --model_name_or_path out/sft --data_path out/pairs --data_split 0,1,0 --output_dir out/rm

``--annotator``: ``gold`` (the embedded task's gold scorer) or ``reward_model:PATH`` (a step-2 reward model
folder, e.g. a larger one).  Each pair of a prompt's answers (0-1, 2-3, ...; all of them with ``--pairing all``;
those the annotator scores equal dropped with ``--ties drop``) is labelled a ≻ b with probability
σ((g_a − g_b)/τ).  Writes ``train.jsonl`` and ``test.jsonl`` (``--eval_fraction`` of the prompts held out: the
reward model's accuracy on the policy's own answers, ``marlhf score-pairs --input OUT/test.jsonl``) and
``label.json``.  Run again with the same inputs, it finds ``label.json`` and does nothing.

Several ``--generations`` files (answers of different policies to the same prompts) are pooled per prompt, the
first ``--max_samples`` answers of each: an iterated round pairs a new policy's answers with an earlier one's,

    marlhf label --generations step3_answers.jsonl sft_answers.jsonl --max_samples 2 --pairing all ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

from marlhf.data.onpolicy import label_pairs, pool_generations, read_generations, split_by_prompt, write_pairs
from marlhf.errors import ConfigError, run_cli
from marlhf.sections import ScheduleSection
from marlhf.utils.flags import add_flags

log = logging.getLogger("marlhf")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generations", required=True, nargs="+",
                   help="marlhf generate's JSON lines, >= 2 answers per prompt (several files: pooled per prompt)")
    p.add_argument("--max_samples", type=int, default=0,
                   help="The first N answers to a prompt taken from each --generations file (0: all)")
    p.add_argument("--annotator", default="gold", help="gold | reward_model:PATH")
    p.add_argument("--tau", type=float, default=0.0,
                   help="Bradley-Terry temperature of the annotator: P(a > b) = sigmoid((g_a - g_b) / tau); "
                        "0 = the higher score always wins")
    p.add_argument("--pairing", default="disjoint", choices=("disjoint", "all"),
                   help="Pairs of a prompt's K answers: disjoint (0-1, 2-3, ...) or all K(K-1)/2")
    p.add_argument("--ties", default="keep", choices=("keep", "drop"),
                   help="Pairs the annotator scores equal: keep (labelled by a coin) or drop")
    add_flags(p, ScheduleSection, only=("seed",),
              help={"seed": "Seed of the labels' draws and of the held-out prompts"})
    p.add_argument("--eval_fraction", type=float, default=0.1, help="Share of prompts held out in test.jsonl")
    p.add_argument("--output", required=True, help="Folder for train.jsonl, test.jsonl and label.json")
    p.add_argument("--debug", action="store_true", help="Show tracebacks for user errors")
    return p.parse_args(argv)


def annotator(spec: str):
    """The scorer behind ``--annotator``: (prompts, responses, ended) -> scores."""
    kind, _, arg = spec.partition(":")
    if kind == "gold" and not arg:
        from marlhf.rewards.gold import GoldScorer

        gold = GoldScorer()
        return lambda prompts, responses, ended: gold(list(prompts), list(responses), list(ended))
    if kind == "reward_model" and arg:
        from marlhf.rewards.reward_model import Scorer

        rm = Scorer(arg)
        return lambda prompts, responses, ended: rm(list(prompts), list(responses))
    raise ConfigError(f"--annotator must be gold or reward_model:PATH, got {spec!r}")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    sources = [Path(g) for g in args.generations]
    for source in sources:
        if not source.is_file():
            raise ConfigError(f"--generations {source}: no such file")
    out = Path(args.output)
    # everything that changes the pairs: the same inputs find the folder done
    settings = {"generations": [str(s) for s in sources], "generations_sha256": [file_digest(s) for s in sources],
                "max_samples": args.max_samples, "annotator": args.annotator, "tau": args.tau,
                "pairing": args.pairing, "ties": args.ties, "seed": args.seed, "eval_fraction": args.eval_fraction}
    record = out / "label.json"
    if record.exists():
        before = json.loads(record.read_text())
        if before.get("settings") == settings:
            log.info("%s: labelled already with these inputs (%s)", out, before["counts"])
            print(out)
            return 0
    groups = pool_generations([read_generations(s) for s in sources], args.max_samples)
    if max(len(g) for g in groups.values()) < 2:
        raise ConfigError(f"{', '.join(map(str, sources))}: one answer per prompt; sample two or more "
                          f"(marlhf generate --num_samples 2)")
    pairs, counts = label_pairs(groups, annotator(args.annotator), args.tau, args.seed, args.pairing,
                                args.ties)
    train, test = split_by_prompt(pairs, args.eval_fraction, args.seed)
    counts.update(train_pairs=len(train), test_pairs=len(test))
    write_pairs(out, train, test, {"settings": settings, "counts": counts})
    log.info("%s: %s", out, counts)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
