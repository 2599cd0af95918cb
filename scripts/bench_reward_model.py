#!/usr/bin/env python
"""Held-out pair accuracy and time of step 2 (reward model) of the tiny launch script, over seeds and settings.

Step 2 of the quick start is ``training/step2_reward_model_finetuning/training_scripts/tiny/run_tiny.sh``;
this runs that exact script from one step-1 model (so the SFT cost is paid once) for every setting x seed,
with the setting's flags appended through EXTRA_ARGS (argparse keeps the last value of a repeated flag),
and reports per run the held-out pair accuracy, the mean chosen / rejected score and the wall time, then
per setting the mean, min and spread of the accuracy over the seeds.

The held-out labels carry the task's label noise too (a flipped pair counts against a perfect model), so
the report also gives the *label ceiling*: the share of the first --max_eval held-out pairs whose chosen
answer really has the higher gold score (~0.90 at label noise 0.1).  ``--breakdown`` also scores those pairs
with each run's model and reports how often it orders a pair as the gold scorer does, overall and by what
sets the pair apart (``synthetic.pair_difference``: a dropped fact is "coverage", an invented one replacing a
fact "coverage+invented", sentences out of order "order", ...) and by the flaws the generator drew for the
pair (``synthetic.extra_flaws``: "drop", "swap_tags", "invent:pet", ...): which flaws the reward model cannot
see.  Reference rankers join that table: ``--likelihood_of MODEL`` ranks by each answer's summed
log-probability under MODEL (e.g. the SFT model the reward models start from), ``--implicit_reward_of
POLICY`` by DPO's implicit reward log π_POLICY − log π_SFT (the --sft model as DPO's reference; β > 0 does not
change the order), e.g. a model of ``training/step2_dpo_finetuning``.

    python scripts/bench_reward_model.py --sft runs/quickstart/step1 --seeds 1 2 3 \\
        --setting base: --setting "e4:--num_train_epochs=4" --out bench_results/reward_model.json

A setting is NAME:FLAGS (FLAGS space-separated main.py flags in the --flag=value form, or the launch
script's environment overrides as VAR=value, e.g. ``plain:LIKELIHOOD_TERM=0`` for the score head alone;
empty = the launch script's defaults); ``--from_scratch`` starts the RM from the embedded tiny model
instead of --sft.  Run it under the heavy lock on a shared machine: each run is 2-4 min on 2 CPU cores.
Writes the JSON report to --out and a markdown table next to it (same name, .md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

SCRIPT = REPO / "training" / "step2_reward_model_finetuning" / "training_scripts" / "tiny" / "run_tiny.sh"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft", required=True, help="Step-1 model folder the reward model starts from.")
    p.add_argument("--from_scratch", action="store_true", help="Start from the embedded tiny model instead.")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="--seed of each run.")
    p.add_argument("--setting", action="append", default=[],
                   help="NAME:FLAGS, repeatable (default one setting 'default' = the launch script's values).")
    p.add_argument("--data_path", default="", help="DATA_PATH of the launch script (default its synthetic).")
    p.add_argument("--work_dir", default="runs/bench_reward_model", help="Where the runs' models go.")
    p.add_argument("--keep_models", action="store_true", help="Keep each run's model (default: deleted).")
    p.add_argument("--max_eval", type=int, default=256, help="Held-out pairs the label ceiling is computed on "
                   "(the launch script's MAX_EVAL_SAMPLES).")
    p.add_argument("--breakdown", action="store_true", help="Agreement with the gold scorer by what sets each "
                   "held-out pair apart (synthetic data only).")
    p.add_argument("--likelihood_of", default="", help="With --breakdown: also rank the held-out pairs by each "
                   "answer's summed log-probability under this causal LM (e.g. the --sft model), a reference "
                   "for what the reward models learn.")
    p.add_argument("--implicit_reward_of", default="", help="With --breakdown: also rank the held-out pairs by "
                   "the DPO implicit reward of this policy against the --sft model (log-probability difference).")
    p.add_argument("--out", default="bench_results/reward_model.json")
    return p.parse_args(argv)


def parse_setting(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"--setting must be NAME:FLAGS (got {text!r})")
    flags = flags.split()
    bad = [f for f in flags if not (f.startswith("--") and "=" in f) and not _ENV.fullmatch(f)]
    if bad:
        raise SystemExit(f"--setting {name}: flags must be --flag=value or VAR=value, got {bad}")
    return name, flags


_ENV = re.compile(r"[A-Z][A-Z0-9_]*=\S*")  # a launch-script environment override


def label_ceiling(max_eval: int) -> float:
    """Share of the first ``max_eval`` held-out synthetic pairs whose label agrees with the gold scorer."""
    from marlhf.data.adapters import load_records
    from marlhf.embedded.task import gold_score

    records = load_records("synthetic", split="test")[:max_eval]
    agree = sum(gold_score(r.prompt, r.chosen) > gold_score(r.prompt, r.rejected) for r in records)
    return agree / len(records)


def flaw_group(meta: dict) -> str:
    """The flaws that set a pair apart (``synthetic.extra_flaws``: drawn for its copy, nearly always the worse
    side): dropped facts named "drop" whatever the slot, invented ones by kind ("invent:pet", "invent:age": a
    narrator tag a few years off, "invent:name": a sentence naming the pet wrongly), "swap_tags" (narrator and
    other tags exchanged)."""
    from marlhf.embedded.task import extra_flaws

    return "+".join(sorted("drop" if f.startswith("drop:") else f for f in extra_flaws(meta)))


def _by_group(keys: list[str], agree: list[bool]) -> dict:
    groups: dict[str, list[bool]] = {}
    for key, ok in zip(keys, agree):
        groups.setdefault(key, []).append(ok)
    return {k: {"pairs": len(v), "gold_agreement": sum(v) / len(v)}
            for k, v in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))}


def gold_breakdown(scorer, records: list) -> dict:
    """How often ``scorer(prompts, responses)`` orders a held-out pair as the gold scorer does, overall, per
    :func:`synthetic.pair_difference` of the pair and per :func:`flaw_group` (largest groups first), next to
    its label accuracy."""
    from marlhf.embedded.task import gold_score, pair_difference

    prompts = [r.prompt for r in records]
    chosen, rejected = scorer(prompts, [r.chosen for r in records]), scorer(prompts, [r.rejected for r in records])
    agree = [(c > j) == (gold_score(r.prompt, r.chosen) > gold_score(r.prompt, r.rejected))
             for r, c, j in zip(records, chosen, rejected)]
    out = {"pairs": len(records), "label_accuracy": sum(c > j for c, j in zip(chosen, rejected)) / len(records),
           "gold_agreement": sum(agree) / len(agree),
           "by_difference": _by_group([pair_difference(r.prompt, r.chosen, r.rejected) for r in records], agree)}
    if all("flaws" in r.meta for r in records):
        out["by_flaw"] = _by_group([flaw_group(r.meta) for r in records], agree)
    return out


def implicit_reward(policy, reference):
    """DPO's implicit reward (over β) as a ranker: ``policy(p, r) - reference(p, r)`` per answer."""
    return lambda prompts, responses: [a - b for a, b in zip(policy(prompts, responses),
                                                             reference(prompts, responses))]


def reference_rankers(args, held_out: list) -> list[dict]:
    """--likelihood_of / --implicit_reward_of: each ranker's :func:`gold_breakdown` on the held-out pairs."""
    from marlhf.rewards.reward_model import LikelihoodScorer

    rankers = []
    if args.likelihood_of:
        rankers.append((f"likelihood of `{args.likelihood_of}`", LikelihoodScorer(args.likelihood_of)))
    if args.implicit_reward_of:
        rankers.append((f"implicit reward of `{args.implicit_reward_of}`",
                        implicit_reward(LikelihoodScorer(args.implicit_reward_of), LikelihoodScorer(args.sft))))
    out = []
    for name, scorer in rankers:
        b = gold_breakdown(scorer, held_out)
        out.append({"name": name, "breakdown": b})
        print(f"{name}: label accuracy {b['label_accuracy']:.3f}, agrees with the gold scorer on "
              f"{b['gold_agreement']:.3f}", flush=True)
    return out


def final_eval(folder: Path) -> dict:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/accuracy" in r]
    if not evals:
        raise SystemExit(f"{folder}/metrics.jsonl has no eval/accuracy row")
    last = evals[-1]
    return {"accuracy": last["eval/accuracy"], "chosen_score": last.get("eval/chosen_score"),
            "rejected_score": last.get("eval/rejected_score"), "steps": last["step"],
            "accuracy_curve": [(r["step"], r["eval/accuracy"]) for r in evals]}


def run_one(sft: str, data_path: str, flags: list[str], seed: int, out: Path) -> dict:
    overrides = dict(f.split("=", 1) for f in flags if _ENV.fullmatch(f))
    main_flags = [f for f in flags if not _ENV.fullmatch(f)]
    env = dict(os.environ, MODEL_PATH=sft, EXTRA_ARGS=" ".join([f"--seed={seed}", *main_flags]), **overrides)
    if data_path:
        env["DATA_PATH"] = data_path
    env.setdefault("PYTHONPATH", str(REPO))
    t0 = time.time()
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"step 2 failed (exit {proc.returncode}); see {out}/training.log")
    return {"seed": seed, "seconds": round(seconds, 1), **final_eval(out)}


def summarize(runs: list[dict]) -> dict:
    acc = [r["accuracy"] for r in runs]
    return {"accuracy_mean": statistics.mean(acc), "accuracy_min": min(acc), "accuracy_max": max(acc),
            "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "seconds_mean": statistics.mean(r["seconds"] for r in runs)}


def markdown(report: dict) -> str:
    lines = [f"Step 2 (tiny launch script) from `{report['sft']}` on `{report['data_path']}`; "
             f"held-out pairs: {report['max_eval']}, "
             f"label ceiling {report['label_ceiling']:.3f}; seeds {report['seeds']}.", "",
             "| setting | flags | accuracy per seed | mean | min | s / run |", "|---|---|---|---:|---:|---:|"]
    for s in report["settings"]:
        per_seed = ", ".join(f"{r['accuracy']:.3f}" for r in s["runs"])
        lines.append(f"| {s['name']} | `{' '.join(s['flags']) or '(script defaults)'}` | {per_seed} | "
                     f"{s['summary']['accuracy_mean']:.3f} | {s['summary']['accuracy_min']:.3f} | "
                     f"{s['summary']['seconds_mean']:.0f} |")
    broken = [(s["name"], r["seed"], r["breakdown"]) for s in report["settings"] for r in s["runs"]
              if "breakdown" in r]
    broken += [(f"{ref['name']} (reference)", "", ref["breakdown"]) for ref in report.get("references", [])]
    titles = {"by_difference": "what sets the pair apart in the gold scorer's components",
              "by_flaw": "the flaws that set the pair apart (`synthetic.extra_flaws`)"}
    for grouping, title in titles.items() if broken else ():
        first = broken[0][2]
        if grouping not in first:
            continue
        kinds = [k for k, v in first[grouping].items() if v["pairs"] >= 0.01 * first["pairs"]]
        lines += ["", f"Agreement with the gold scorer's order of each held-out pair, by {title} (groups under "
                  "1% of the pairs are in the JSON only):", "",
                  "| setting | seed | all | " + " | ".join(kinds) + " |", "|---|---|---:|" + "---:|" * len(kinds)]
        for name, seed, b in broken:
            cells = [f"{b[grouping][k]['gold_agreement']:.3f}" if k in b[grouping] else "" for k in kinds]
            lines.append(f"| {name} | {seed} | {b['gold_agreement']:.3f} | " + " | ".join(cells) + " |")
        lines.append(f"| pairs | | {first['pairs']} | "
                     + " | ".join(str(first[grouping][k]["pairs"]) for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = [parse_setting(s) for s in args.setting] or [("default", [])]
    sft = "" if args.from_scratch else str(Path(args.sft).resolve())
    if sft and not (Path(sft) / "config.json").exists():
        raise SystemExit(f"--sft {args.sft}: no config.json there (a step-1 output folder is expected)")
    work = Path(args.work_dir).resolve()
    report = {"sft": sft or "embedded tiny model", "data_path": args.data_path or "synthetic",
              "seeds": args.seeds, "max_eval": args.max_eval,
              "label_ceiling": label_ceiling(args.max_eval), "machine": platform.platform(),
              "cpus": os.cpu_count(), "settings": []}
    print(f"label ceiling on the first {args.max_eval} held-out pairs: {report['label_ceiling']:.3f}", flush=True)
    held_out = []  # the pairs --breakdown scores every run's model on, loaded once
    if args.breakdown:
        from marlhf.data.adapters import load_records

        held_out = load_records(args.data_path or "synthetic", split="test")[:args.max_eval]
        report["references"] = reference_rankers(args, held_out)
    elif args.likelihood_of or args.implicit_reward_of:
        raise SystemExit("--likelihood_of and --implicit_reward_of need --breakdown")
    for name, flags in settings:
        runs = []
        for seed in args.seeds:
            out = work / f"{name}-seed{seed}"
            run = run_one(sft, args.data_path, flags, seed, out)
            runs.append(run)
            print(f"{name} seed {seed}: accuracy {run['accuracy']:.3f} (curve {run['accuracy_curve']}), "
                  f"chosen {run['chosen_score']:.2f} / rejected {run['rejected_score']:.2f}, "
                  f"{run['seconds']:.0f} s", flush=True)
            if args.breakdown:
                from marlhf.rewards.reward_model import Scorer

                run["breakdown"] = b = gold_breakdown(Scorer(str(out)), held_out)
                print(f"{name} seed {seed}: agrees with the gold scorer on {b['gold_agreement']:.3f} of the pairs; "
                      "by flaw: " + ", ".join(f"{k} {v['gold_agreement']:.3f} ({v['pairs']})"
                                              for k, v in b.get("by_flaw", b["by_difference"]).items()), flush=True)
            if not args.keep_models:
                for f in ("model.safetensors",):
                    (out / f).unlink(missing_ok=True)
        summary = summarize(runs)
        report["settings"].append({"name": name, "flags": flags, "runs": runs, "summary": summary})
        print(f"== {name}: accuracy mean {summary['accuracy_mean']:.3f} min {summary['accuracy_min']:.3f} "
              f"(std {summary['accuracy_std']:.3f}), {summary['seconds_mean']:.0f} s per run", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(f"\n{markdown(report)}\nwritten: {out}, {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
