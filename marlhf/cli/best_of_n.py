"""Best-of-N: the reward model picks the best of N sampled answers per prompt; its score (and, on the embedded
task, the gold score of the picked answer) over N and temperature, as a table and a PNG (paper Fig. 8, D.4).

    marlhf best-of-n --model out/step3 --reward_model out/step2 --data_path synthetic \\
        --n 4 8 16 32 --temperatures 0.2 0.4 0.6 0.8 1.0 1.2 --max_prompts 32 \\
        --output_csv bon.csv --output_json bon.json --output_png bon.png

For each temperature, max(--n) answers per prompt are sampled once (the generation seam, ``num_samples``) and
scored once; best-of-n for each smaller n uses the first n of them (nested prefixes), so the whole table
costs one sampling pass per temperature.  ``rm_mean`` / ``gold_mean`` are the mean scores of those n samples
(what picking at random gets).  ``--samples_out`` keeps every sample with its scores.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from marlhf.errors import ConfigError, run_cli
from marlhf.eval.best_of_n import best_of_n, plot, table_rows, to_csv, to_markdown
from marlhf.eval.generate_tool import LoadedPolicy, PromptSource, add_prompt_args, add_sampling_args, batch_seed
from marlhf.rewards.gold import gold_scorer
from marlhf.rewards.reward_model import Scorer
from marlhf.sections import GenerationEngineSection, SamplingSection, ScheduleSection, SupervisedSection
from marlhf.utils.flags import add_flags

log = logging.getLogger("marlhf")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_args(p, temperature=False)
    add_prompt_args(p)
    p.add_argument("--reward_model", required=True, help="Step-2 output folder (the picker)")
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 8, 16, 32], help="Sizes N of the best-of-N pick")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.2, 0.4, 0.6, 0.8, 1.0, 1.2])
    p.add_argument("--gold", default="auto", choices=("auto", "on", "off"),
                   help="The embedded task's gold score of the pick: auto = when the data is synthetic")
    add_flags(p, ScheduleSection, only=("seed",), help={"seed": "Sampling seed (each temperature and batch its own)"})
    p.add_argument("--batch_size", type=int, default=4, help="Prompts per generate call (x max N answers)")
    p.add_argument("--rm_batch_size", type=int, default=64)
    add_flags(p, SupervisedSection, only=("max_seq_len",),
              help={"max_seq_len": "The reward model's input limit (prompt + answer tokens)."})
    p.add_argument("--output_csv", default=None)
    p.add_argument("--output_json", default=None)
    p.add_argument("--output_png", default=None)
    p.add_argument("--samples_out", default=None, help="JSON lines: every sample with its scores")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if min(args.n) < 1 or min(args.temperatures) <= 0:
        raise ConfigError(f"--n must be >= 1 and --temperatures > 0, got {args.n} and {args.temperatures}")
    ns, n_max = sorted(set(args.n)), max(args.n)
    prompts = PromptSource.build(args).load()
    policy = LoadedPolicy(args.model, args.model_part, args.end_of_conversation_token, args.prompt_format,
                          device=args.device, dtype=args.dtype, engine=GenerationEngineSection.build(args))
    rm = Scorer(args.reward_model, max_seq_len=args.max_seq_len, device=args.device, dtype=args.dtype)
    gold = gold_scorer(args.gold, args.data_path, args.reward_model)
    sample_rows: list[dict] = []
    results = {}
    for t_index, temperature in enumerate(args.temperatures):
        rm_rows, gold_rows = [], []
        for b in range(0, len(prompts), args.batch_size):
            chunk = prompts[b:b + args.batch_size]
            # each (temperature, batch) has its own seed: the samples do not depend on what ran before
            seed = batch_seed(args.seed, t_index * 1_000 + b // args.batch_size)
            sampling = SamplingSection.build(args, temperature=temperature)
            cfg = policy.config(sampling, seed=seed)
            responses, ended, lengths = policy.sample([p.text for p in chunk], cfg, n_max, sampling.max_prompt_len)
            texts = [p.text for p in chunk for _ in range(n_max)]
            r = rm(texts, responses, args.rm_batch_size)
            g = gold(texts, responses, ended) if gold is not None else None
            rm_rows += [r[i:i + n_max] for i in range(0, len(r), n_max)]
            if g is not None:
                gold_rows += [g[i:i + n_max] for i in range(0, len(g), n_max)]
            for i, resp in enumerate(responses if args.samples_out else []):
                row = {"temperature": temperature, "prompt_id": chunk[i // n_max].id, "sample": i % n_max,
                       "response": resp, "ended": ended[i], "length": lengths[i], "rm": r[i]}
                if g is not None:
                    row["gold"] = g[i]
                sample_rows.append(row)
        results[temperature] = best_of_n(torch.tensor(rm_rows, dtype=torch.float64), ns,
                                         torch.tensor(gold_rows, dtype=torch.float64) if gold is not None else None)
        best = results[temperature][-1]
        log.info("T = %g: best-of-%d reward-model score %.4f%s", temperature, n_max, best["rm_best"],
                 f", gold {best['gold_best']:.4f}" if gold is not None else "")
    rows = table_rows(results)
    if args.samples_out:
        Path(args.samples_out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in sample_rows),
                                          encoding="utf-8")
    print(to_markdown(rows))
    if args.output_csv:
        Path(args.output_csv).write_text(to_csv(rows))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"model": policy.path, "reward_model": args.reward_model,
                                                      "num_prompts": len(prompts), "rows": rows}, indent=1) + "\n")
    if args.output_png:
        plot(rows, args.output_png)
        log.info("wrote %s", args.output_png)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
