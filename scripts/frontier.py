"""The over-optimisation frontier: held-out gold and reward-model score against √KL to the SFT policy.

Gao et al. (2022, "Scaling laws for reward model overoptimization", Fig. 1) plot a policy's true (gold) score
against √KL(π ‖ π_SFT) while it optimises a learned proxy: the proxy's score keeps rising, the gold score rises,
peaks and falls.  Comparing RLHF methods at a given KL budget — not at a given step — is the fair comparison.

From a finished main job (``marlhf quickstart --output_dir RUN``: step1/ the SFT policy, step2_onpolicy/ or
step2/ the reward model, step3/ the settings), this runs step 3 longer than the main job for each method
(PPO, n = 1; MA-PPO, n = 5 by default) at several seeds, evaluating every ``--eval_interval`` steps on the same
held-out prompts (gold score, reward-model score, KL of the answers to the SFT policy), and writes a
Markdown report with a PNG (``--report``, default ``docs/results/frontier.md``).  Each run is skipped when its
summary exists, so a stopped sweep continues; ``--report_only`` redraws from the runs on disk.

    python scripts/frontier.py --run runs/quickstart --out runs/frontier
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from lab.summary import machine, mean_se

from marlhf.cli.quickstart import marlhf_cmd, run_logged

METHODS = {"PPO (n = 1)": "1", "MA-PPO (n = 5)": "5"}  # name -> --ngram of the fixed rule
POINT_KEYS = ("gold_score", "rm_score", "kl", "gold_invented", "gold_repeated", "eos_rate")


def run_points(run: Path) -> list[dict]:
    """One run's evaluations along training, in step order: the initial policy (step 0), every ``eval/*``
    record of ``metrics.jsonl`` and the final policy (``summary.json``).  Each point has ``step`` and the
    keys of :data:`POINT_KEYS` it was evaluated on."""
    summary = json.loads((run / "summary.json").read_text())
    points = [{"step": 0, **{k: summary["initial_policy"][k] for k in POINT_KEYS if k in summary["initial_policy"]}}]
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        evals = {k[len("eval/"):]: v for k, v in record.items() if k.startswith("eval/")}
        if evals:
            points.append({"step": record["step"], **{k: evals[k] for k in POINT_KEYS if k in evals}})
    points.append({"step": summary["steps"], **{k: summary["final_policy"][k] for k in POINT_KEYS
                                                if k in summary["final_policy"]}})
    return points


def sqrt_kl(kl: float) -> float:
    """√KL, the x axis; a Monte-Carlo KL estimate a hair below 0 (the SFT policy itself) counts as 0."""
    return math.sqrt(max(kl, 0.0))


def aggregate(runs: list[list[dict]]) -> list[dict]:
    """Seeds of one method, point by point (the same evaluation steps in every run): per step the mean over
    seeds of √KL, gold and RM score, with their standard errors over seeds."""
    steps = [p["step"] for p in runs[0]]
    for points in runs[1:]:
        if [p["step"] for p in points] != steps:
            raise ValueError(f"runs evaluated at different steps: {steps} vs {[p['step'] for p in points]}")
    rows = []
    for i, step in enumerate(steps):
        row = {"step": step, "seeds": len(runs)}
        for key, values in (("sqrt_kl", [sqrt_kl(r[i]["kl"]) for r in runs]),
                            ("gold_score", [r[i]["gold_score"] for r in runs]),
                            ("rm_score", [r[i]["rm_score"] for r in runs]),
                            ("gold_invented", [r[i]["gold_invented"] for r in runs]),
                            ("gold_repeated", [r[i]["gold_repeated"] for r in runs])):
            row[key], row[key + "_se"] = mean_se(values)
        rows.append(row)
    return rows


def peak(rows: list[dict]) -> dict:
    """The point of highest mean gold score (the first of equals)."""
    return max(rows, key=lambda r: (r["gold_score"], -r["step"]))


def gold_at_kl(rows: list[dict], budget: float) -> float | None:
    """Mean gold score where the mean √KL first reaches ``budget``, linearly interpolated between the two
    evaluations around it; None when the method never gets that far."""
    for a, b in zip(rows, rows[1:], strict=False):
        if a["sqrt_kl"] <= budget <= b["sqrt_kl"] and b["sqrt_kl"] > a["sqrt_kl"]:
            t = (budget - a["sqrt_kl"]) / (b["sqrt_kl"] - a["sqrt_kl"])
            return a["gold_score"] + t * (b["gold_score"] - a["gold_score"])
    return rows[0]["gold_score"] if budget == rows[0]["sqrt_kl"] else None


def plot(curves: dict[str, list[dict]], path: Path, per_seed: dict[str, list[list[dict]]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, (name, rows) in enumerate(curves.items()):
        x = [r["sqrt_kl"] for r in rows]
        color = f"C{i}"
        for ax, key in zip(axes, ("gold_score", "rm_score"), strict=True):
            ax.errorbar(x, [r[key] for r in rows], yerr=[r[key + "_se"] if r["seeds"] > 1 else 0 for r in rows],
                        marker="o", markersize=3, capsize=2, label=f"{name}, mean of seeds", color=color)
            for points in (per_seed or {}).get(name, []):  # each seed: the mean hides seeds that diverge
                ax.plot([sqrt_kl(p["kl"]) for p in points], [p[key] for p in points], color=color, alpha=0.35,
                        linewidth=0.8, marker=".", markersize=2)
    for ax, title in zip(axes, ("held-out gold score", "reward-model score (the proxy)"), strict=True):
        ax.set_xlabel("√KL(π ‖ π_SFT) per answer (nats^½)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(curves: dict[str, list[dict]], settings: dict, path: Path,
                 per_seed: dict[str, list[list[dict]]] | None = None) -> str:
    png = path.with_suffix(".png")
    plot(curves, png, per_seed)
    budgets = sorted({round(b, 1) for b in (0.5, 1.0, 1.5, 2.0)})
    lines = [f"# The over-optimisation frontier at KL coefficient {settings['kl_ctl']}: gold and RM score "
             "against √KL", "",
             f"Generated by `scripts/frontier.py` on {settings['machine']}: step 3 against the learned reward model "
             f"({settings['reward_model']}) for {settings['steps']} steps at KL coefficient {settings['kl_ctl']}, "
             f"evaluated every {settings['eval_interval']} steps on {settings['eval_prompts']} held-out prompts, seeds "
             f"{', '.join(map(str, settings['seeds']))}; the other settings are the main job's step 3.", "",
             f"![frontier]({png.name})", "",
             "| method | peak gold (mean ± se over seeds) | at step | at √KL | final gold | final √KL "
             "| final RM score | "
             + " | ".join(f"gold at √KL {b}" for b in budgets) + " |",
             "|---" * (7 + len(budgets)) + "|"]
    for name, rows in curves.items():
        top, last = peak(rows), rows[-1]
        at = [gold_at_kl(rows, b) for b in budgets]
        lines.append(f"| {name} | {top['gold_score']:.3f} ± {top['gold_score_se']:.3f} | {top['step']} | "
                     f"{top['sqrt_kl']:.2f} | {last['gold_score']:.3f} ± {last['gold_score_se']:.3f} | "
                     f"{last['sqrt_kl']:.2f} | {last['rm_score']:.2f} | "
                     + " | ".join("—" if g is None else f"{g:.3f}" for g in at) + " |")
    if per_seed:
        lines += ["", "Each seed's final policy (thin lines in the plot; EOS: the share of answers that end):", "",
                  "| method | seed | gold | √KL | RM score | EOS |", "|---" * 6 + "|"]
        for name, runs in per_seed.items():
            for seed, points in zip(settings["seeds"], runs, strict=False):
                last = points[-1]
                lines.append(f"| {name} | {seed} | {last['gold_score']:.3f} | {sqrt_kl(last['kl']):.2f} | "
                             f"{last['rm_score']:.2f} | {last.get('eos_rate', float('nan')):.2f} |")
    lines += ["", "Every evaluation, mean over seeds (± standard error over seeds):", ""]
    for name, rows in curves.items():
        lines += [f"### {name}", "", "| step | √KL | gold | RM score | invented facts | repeated |", "|---" * 6 + "|"]
        lines += [f"| {r['step']} | {r['sqrt_kl']:.2f} ± {r['sqrt_kl_se']:.2f} | {r['gold_score']:.3f} ± "
                  f"{r['gold_score_se']:.3f} | {r['rm_score']:.2f} ± {r['rm_score_se']:.2f} | "
                  f"{r['gold_invented']:.3f} | {r['gold_repeated']:.3f} |" for r in rows]
        lines.append("")
    lines += ["KL: the mean over the held-out answers of Σ_t log π(a_t|s_t) − log π_SFT(a_t|s_t) (a Monte-Carlo "
              "estimate of the sequence KL).  Gold at a √KL budget: interpolated between the two evaluations "
              "around it (— : the method never got that far).", "",
              "Command: `" + settings["command"] + "`", ""]
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="A finished main job's output folder (step1/, step2*/, step3/)")
    p.add_argument("--out", required=True, help="Folder of the runs (one per method and seed)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--steps", type=int, default=150, help="PPO steps per run")
    p.add_argument("--eval_interval", type=int, default=15)
    p.add_argument("--eval_prompts", type=int, default=256)
    p.add_argument("--kl_ctl", type=float, default=0.1,
                   help="KL coefficient (lower than the main job's, so that training travels along the frontier)")
    p.add_argument("--report", default="docs/results/frontier.md")
    p.add_argument("--report_only", action="store_true", help="Redraw the report from the runs on disk")
    args = p.parse_args(argv)
    run_dir, out = Path(args.run).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    step3 = json.loads((run_dir / "step3" / "args.json").read_text())
    reward_model = run_dir / "step2_onpolicy" / "reward_model"
    if not reward_model.exists():
        reward_model = run_dir / "step2"
    config = {k: v for k, v in step3.items() if k not in ("output_dir", "tensorboard_path", "local_rank",
                                                            "critic_model_name_or_path", "data_output_path")}
    config.update(max_steps=args.steps, eval_interval=args.eval_interval, kl_ctl=args.kl_ctl,
                  num_train_epochs=args.steps,  # enough epochs of prompts: --max_steps ends the run
                  max_eval_samples=args.eval_prompts, data_seed=step3["seed"], print_answers=False)
    (out / "step3_config.json").write_text(json.dumps(config, indent=1))
    curves, per_seed = {}, {}
    for name in args.methods:
        runs = []
        for seed in args.seeds:
            dest = out / f"ngram{METHODS[name]}_seed{seed}"
            if not (dest / "summary.json").exists():
                if args.report_only:
                    continue
                print(f"{name}, seed {seed} -> {dest}", flush=True)
                run_logged(marlhf_cmd("ppo", "--config", str(out / "step3_config.json"), "--critic_model_name_or_path",
                                      str(reward_model), "--ngram", METHODS[name], "--termination_condition", "fixed",
                                      "--seed", str(seed), "--output_dir", str(dest), "--data_output_path",
                                      str(out / "data"), "--disable_progress_bar"), out / f"{dest.name}.log")
            runs.append(run_points(dest))
        if runs:
            curves[name], per_seed[name] = aggregate(runs), runs
    settings = {**vars(args), "reward_model": str(reward_model.relative_to(run_dir)), "machine": machine(),
                "command": "python scripts/frontier.py --run RUN --out OUT --steps {steps} --eval_interval "
                           "{eval_interval} --kl_ctl {kl_ctl} --seeds {s}".format(**vars(args),
                                                                                   s=" ".join(map(str, args.seeds)))}
    print(write_report(curves, settings, Path(args.report), per_seed))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
