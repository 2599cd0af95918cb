"""Reward distributions of several policies: score their generations with a reward model (and, on the
embedded task, its gold scorer), print per-policy statistics and mean shifts against a baseline policy,
write a JSON report and a PNG of the distributions (the paper's Figs. 3 and 10).

    marlhf score-policies --reward_model out/step2 --generations sft.jsonl ppo.jsonl ma_ppo.jsonl \\
        --baseline sft --output_json report.json --output_png scores.png

Generations: JSON lines with ``prompt``, ``response`` and ``policy`` per row (one file per policy, or one
file with several).  The gold scorer is used when the data is the embedded synthetic task: ``--data_path``,
else the data the reward model was trained on (its run's ``args.json``); ``--gold off`` skips it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from marlhf.errors import ConfigError, run_cli
from marlhf.eval.score_report import (
    build_report,
    format_report,
    plot_distributions,
    read_generations,
    score_policies,
    write_report,
)
from marlhf.models.placement import add_placement_args
from marlhf.rewards.gold import gold_scorer
from marlhf.rewards.reward_model import Scorer
from marlhf.sections import DataSection, RobustnessSection, SupervisedSection
from marlhf.utils.flags import add_flags

log = logging.getLogger("marlhf")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reward_model", required=True, help="Step-2 output folder (or step 3's critic)")
    p.add_argument("--generations", nargs="+", required=True, help="JSON lines: prompt, response, policy")
    p.add_argument("--baseline", default=None, help="Policy whose mean the others' shifts are measured from")
    p.add_argument("--gold", default="auto", choices=("auto", "on", "off"),
                   help="The embedded task's gold scorer: auto = when the data is synthetic")
    p.add_argument("--data_path", nargs="+", default=None,
                   help="Dataset specs the generations come from (default: the reward model's training data)")
    p.add_argument("--output_json", default=None)
    p.add_argument("--output_png", default=None)
    p.add_argument("--bins", type=int, default=30)
    add_flags(p, DataSection, only=("end_of_conversation_token", "prompt_format"),
              help={"end_of_conversation_token": "Default: the one recorded with the model."})
    add_flags(p, SupervisedSection, only=("max_seq_len",))
    p.add_argument("--batch_size", type=int, default=16)
    add_flags(p, RobustnessSection, only=("debug",))
    add_placement_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if args.bins < 1:
        raise ConfigError(f"--bins must be at least 1, got {args.bins}")
    generations = read_generations(args.generations)
    if args.baseline is not None and args.baseline not in generations:
        raise ConfigError(f"--baseline {args.baseline!r} is not one of the policies: {', '.join(generations)}")

    rm = Scorer(args.reward_model, args.end_of_conversation_token, args.max_seq_len, args.prompt_format,
                device=args.device, dtype=args.dtype)
    scorers = {"reward_model": lambda p, r: rm(p, r, args.batch_size)}
    gold = gold_scorer(args.gold, args.data_path, args.reward_model)
    if gold is not None:
        scorers["gold"] = gold
    scores = score_policies(generations, scorers)
    report = build_report(scores, args.baseline)
    report["reward_model"] = args.reward_model
    report["generations"] = list(args.generations)
    print(format_report(report))
    if args.output_json:
        write_report(report, args.output_json)
        log.info("wrote %s", args.output_json)
    if args.output_png:
        plot_distributions(scores, args.output_png, args.bins)
        log.info("wrote %s", args.output_png)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
