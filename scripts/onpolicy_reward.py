"""Does a reward model trained on the policy's own answers make step 3 better?  (Issue 28, lever 1.)

Starting from a finished main job (``marlhf quickstart --output_dir RUN``: step1/, step2/, step3/):

1. ``marlhf generate --phase 2``: K answers of the SFT policy to each of step 2's prompts;
2. ``marlhf label --annotator gold --tau T``: pairs of them labelled by the simulated annotator, a share of the
   prompts held out (``test.jsonl``);
3. ``marlhf rm``: the step-2 reward model trained on, continued on those pairs;
4. ``marlhf score-pairs``: both reward models' accuracy on the held-out policy pairs, against the gold order, split
   by how far apart the gold scores are;
5. ``marlhf ppo``, with the quick start's step-3 settings, against each reward model at several seeds (same
   prompt split, ``--data_seed``), evaluated on ``--eval_prompts`` held-out prompts.

Each stage is skipped when its output exists, so a stopped run continues.  Writes ``OUT/report.json`` and a
Markdown table (``--report``, default ``docs/results/onpolicy_reward.md``).

    python scripts/onpolicy_reward.py --run runs/quickstart --out runs/onpolicy --seeds 1234 1 2
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from lab.summary import machine, mean_se

from marlhf.cli.quickstart import ONPOLICY_TAU, marlhf_cmd, onpolicy_reward_model, run_logged

METRICS = ("gold_score", "gold_invented", "gold_repeated", "eos_rate", "kl", "rm_score")


def pair_accuracy(pairs: Path, scores: Path) -> dict:
    """Accuracy against the gold order on the held-out pairs, by gold gap (ties: the annotator's coin)."""
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    scored = [json.loads(line) for line in scores.read_text().splitlines()]
    buckets: dict[str, list[bool]] = {"gap >= 0.1": [], "0 < gap < 0.1": [], "tie": []}
    for row, s in zip(rows, scored, strict=True):
        g_chosen, g_rejected = row["meta"]["annotator_scores"]
        says_chosen = s["chosen_score"] > s["rejected_score"]
        gap = abs(g_chosen - g_rejected)
        key = "tie" if gap == 0 else ("gap >= 0.1" if gap >= 0.1 else "0 < gap < 0.1")
        buckets[key].append(says_chosen == (g_chosen > g_rejected) if gap else says_chosen)
    separated = buckets["gap >= 0.1"] + buckets["0 < gap < 0.1"]
    out = {k: {"accuracy": sum(v) / len(v), "pairs": len(v)} for k, v in buckets.items() if v}
    out["gold separated"] = {"accuracy": sum(separated) / len(separated), "pairs": len(separated)}
    out["all pairs"] = {"accuracy": sum(buckets["tie"] + separated) / len(rows), "pairs": len(rows)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="A finished main job's output folder (step1/, step2/, step3/)")
    p.add_argument("--out", required=True, help="Folder of this experiment's outputs")
    p.add_argument("--samples", type=int, default=2, help="Answers per step-2 prompt (pairs: 0-1, 2-3, ...)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2], help="Step-3 seeds")
    p.add_argument("--eval_prompts", type=int, default=256)
    p.add_argument("--report", default="docs/results/onpolicy_reward.md")
    args = p.parse_args(argv)
    run_dir, out = Path(args.run).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    step3 = json.loads((run_dir / "step3" / "args.json").read_text())

    # 1-3. the SFT policy's answers to step 2's prompts, paired and labelled; the reward model trained on them
    # (what `marlhf quickstart` does between steps 2 and 3)
    seconds = onpolicy_reward_model(
        run_dir / "step1", run_dir / "step2", out, args.samples,
        generation={"max_new_tokens": step3["max_answer_seq_len"], "max_prompt_len": step3["max_prompt_seq_len"],
                    "temperature": step3["temperature"], "top_k": step3["top_k"]})
    counts = json.loads((out / "pairs" / "label.json").read_text())["counts"]
    rm = out / "reward_model"
    models = {"synthetic pairs (step 2)": run_dir / "step2", "+ policy pairs": rm}

    # 4. accuracy on held-out pairs of the policy's own answers
    accuracy = {}
    for i, (name, path) in enumerate(models.items()):
        scores = out / f"scores_{i}.jsonl"
        if not scores.exists():
            run_logged(marlhf_cmd("score-pairs", "--model_name_or_path", str(path), "--input",
                                  str(out / "pairs" / "test.jsonl"), "--output", str(scores)), out / f"rw_eval_{i}.log")
        accuracy[name] = pair_accuracy(out / "pairs" / "test.jsonl", scores)

    # 5. step 3 against each reward model, the quick start's settings, several seeds
    config = {k: v for k, v in step3.items() if k not in ("output_dir", "tensorboard_path", "local_rank",
                                                            "critic_model_name_or_path", "data_output_path")}
    (out / "step3_config.json").write_text(json.dumps(config, indent=1))
    runs: dict[str, list[dict]] = {name: [] for name in models}
    initial = []
    for seed in args.seeds:
        for i, (name, path) in enumerate(models.items()):
            dest = out / f"ppo_{i}_seed{seed}"
            if not (dest / "summary.json").exists():
                seconds[f"ppo {i} seed {seed}"] = run_logged(marlhf_cmd(
                    "ppo", "--config", str(out / "step3_config.json"), "--critic_model_name_or_path", str(path),
                    "--output_dir", str(dest), "--data_output_path", str(out / "data3"), "--seed", str(seed),
                    "--data_seed", str(step3["seed"]), "--max_eval_samples", str(args.eval_prompts),
                    "--disable_progress_bar"), out / f"ppo_{i}_seed{seed}.log")
            summary = json.loads((dest / "summary.json").read_text())
            runs[name].append({"seed": seed, **{k: summary["final_policy"][k] for k in (*METRICS, "gold_score_se")}})
            initial.append(summary["initial_policy"]["gold_score"])

    report = {"settings": vars(args), "pairs": counts, "accuracy": accuracy, "runs": runs,
              "sft_gold": initial[0], "seconds": seconds, "machine": machine()}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    write_markdown(report, Path(args.report))
    print(Path(args.report).read_text())
    return 0


def write_markdown(report: dict, path: Path) -> None:
    acc, runs = report["accuracy"], report["runs"]
    buckets = list(next(iter(acc.values())))
    lines = ["# A reward model trained on the policy's own answers (issue 28, lever 1)", "",
             "Generated by `scripts/onpolicy_reward.py` from a quick-start run "
             f"({report['pairs']['pairs']} labelled pairs of SFT answers to step 2's prompts, annotator: the "
             f"gold scorer with τ = {ONPOLICY_TAU}; "
             f"{report['pairs']['annotator_ties']} ties labelled by a coin), on {report['machine']}.", "",
             "## Accuracy on held-out pairs of the SFT policy's answers", "",
             "| reward model | " + " | ".join(buckets) + " |", "|---" * (len(buckets) + 1) + "|"]
    for name, row in acc.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[b]['accuracy']:.3f} ({row[b]['pairs']})" for b in buckets)
                     + " |")
    lines += ["", f"## Step 3 against each (held-out gold of the SFT policy: {report['sft_gold']:.3f})", "",
              "| reward model | seed | " + " | ".join(METRICS) + " |", "|---" * (len(METRICS) + 2) + "|"]
    for name, rows in runs.items():
        for r in rows:
            lines.append(f"| {name} | {r['seed']} | {r['gold_score']:.3f} ± {r['gold_score_se']:.3f} | "
                         + " | ".join(f"{r[k]:.3f}" for k in METRICS[1:]) + " |")
        m, se = mean_se([r["gold_score"] for r in rows])
        lines.append(f"| {name} | mean | {m:.3f} ± {se:.3f} (seeds) | | | | | |")
    lines += ["", "± on a seed: the standard error over held-out prompts; on the mean: over seeds."]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
