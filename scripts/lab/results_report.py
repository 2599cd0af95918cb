"""``docs/results.md`` from the sweep's recorded runs: tables, curves, the commands, versions, machine, seeds,
and a plain statement of which of the paper's claims held at this scale.

Every number in the report comes from :mod:`lab.sweep` reading the runs' own files, and the same
numbers are written next to it as ``results.json`` (the test compares both with the run logs)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
from pathlib import Path

from lab.cost_report import render_cost_section
from lab.frontier import best_gold_within, common_budget, frontier_rows, gold_at_kl, peak
from lab.frontier import plot as plot_frontier
from lab.summary import save_figure
from lab.sweep import (
    BASELINE,
    REWARDS,
    VARIANTS,
    VariantResult,
    improved,
    parity_interval,
    steps_to_parity,
    t_interval,
    time_to_parity,
    timing_mismatch,
)
from marlhf.utils.machine import machine_info

TABLE_KEYS = ("gold_score", "rm_score", "kl", "train_kl", "response_len", "eos_rate")
PLOT_KEYS = (("gold_score", "held-out gold score"), ("rm_score", "held-out RM score"),
             ("kl", "held-out KL"), ("train_kl", "KL to reference (training batches)"),
             ("response_len", "answer length (tokens)"))
FASTER = 1 / 1.7  # the paper's "1.7–2x faster": parity at <= 59% of PPO's steps


def machine() -> dict:
    import deepspeed
    import torch
    import transformers

    return {**machine_info(), "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__, "os": platform.platform()}


def _final(r: VariantResult, key: str) -> tuple[float, float] | None:
    if key == "train_kl":  # the training-batch KL of the last step
        curve = r.curves.get("train_kl")
        return (sum(v := curve[max(curve)]) / len(v), float("nan")) if curve else None
    return r.final(key) if key in r.finals else None


def summary_table(results: dict[str, VariantResult], reward: str) -> list[dict]:
    """One row per variant: the final value (mean over seeds, 95% CI half-width) of every table key and the
    steps-to-parity on the optimised score (and on gold for the reward-model setting)."""
    base = results.get(BASELINE)
    optimised = REWARDS[reward][1]
    rows = []
    for name in [v for v in VARIANTS if v in results]:
        r = results[name]
        row = {"variant": name, "label": VARIANTS[name].label, "seeds": r.seeds, "steps": r.steps}
        for key in TABLE_KEYS:
            value = _final(r, key)
            if value is not None:
                row[key] = {"mean": value[0], "ci95": value[1], "per_seed": r.finals.get(key)}
        for key in dict.fromkeys((optimised, "gold_score")):
            if base is not None and key in r.finals and key in base.finals:
                # parity with a PPO that ended below its start would reward not learning: left undefined
                if improved(base, key):
                    row[f"parity_{key}"] = steps_to_parity(r, base, key)
                    row[f"parity_ci_{key}"] = parity_interval(r, base, key)
                    row[f"time_parity_{key}"] = time_to_parity(r, base, key)
                    if why := timing_mismatch(r, base):
                        row[f"time_parity_note_{key}"] = why
                else:
                    row[f"parity_{key}"] = "n/a"
            start = r.mean_curve(key).get(0)
            if start is not None:
                row[f"start_{key}"] = start
        rows.append(row)
    return rows


def _fmt(cell: dict | None) -> str:
    if cell is None:
        return "–"
    if math.isnan(cell["ci95"]):
        return f"{cell['mean']:.3f}"
    return f"{cell['mean']:.3f} ± {cell['ci95']:.3f}"


def _parity(v) -> str:
    return "never" if v is None else v if isinstance(v, str) else f"{v:.2f}"


def _parity_cell(row: dict, key: str) -> str:
    """Steps-to-parity with its bootstrap interval over seeds, e.g. ``0.50 [0.25, never]``."""
    cell = _parity(row.get(f"parity_{key}"))
    ci = row.get(f"parity_ci_{key}")
    return cell if ci is None else f"{cell} [{_parity(ci[0])}, {_parity(ci[1])}]"


def _time_cell(row: dict, key: str) -> str:
    if f"time_parity_{key}" not in row:  # PPO did not improve: parity undefined
        return "–"
    v = row[f"time_parity_{key}"]
    return "–" if isinstance(v, float) and math.isnan(v) else _parity(v)  # nan: not recorded / other CPUs


def plot_curves(results: dict[str, VariantResult], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(k, label) for k, label in PLOT_KEYS if any(k in r.curves and r.curves[k] for r in results.values())]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, (key, label) in zip(axes[0], keys):
        for name in [v for v in VARIANTS if v in results]:
            curve = results[name].curves.get(key)
            if not curve:
                continue
            steps = sorted(curve)
            mean = [sum(curve[s]) / len(curve[s]) for s in steps]
            line, = ax.plot(steps, mean, marker="o", ms=3, label=VARIANTS[name].label,
                            lw=2.2 if name == BASELINE else 1.3)
            if len(next(iter(curve.values()))) > 1:  # seed spread: min–max band
                ax.fill_between(steps, [min(curve[s]) for s in steps], [max(curve[s]) for s in steps],
                                color=line.get_color(), alpha=0.15)
        ax.set_xlabel("PPO step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, path, title)


def _seed_curves(r: VariantResult, i: int) -> dict[str, dict[int, list[float]]]:
    """Seed ``i``'s curves alone, in :class:`VariantResult`'s shape (one value per step)."""
    return {k: {s: [v[i]] for s, v in curve.items()} for k, curve in r.curves.items()}


def frontier_table(results: dict[str, VariantResult]) -> dict:
    """Reward at equal KL, for the variants with a held-out KL curve: each one's mean curve (:func:`frontier_rows`),
    its seeds' curves, and at the common budget — the largest √KL that every seed of every variant reached — each
    seed's best gold within it (:func:`best_gold_within`, ``gold_at_budget``: the comparison) and its gold on first
    reaching it (:func:`gold_at_kl`, ``gold_first_at_budget``), as means over seeds with Student-t intervals."""
    with_kl = {n: r for n in VARIANTS if (r := results.get(n)) is not None and r.curves.get("kl")
               and r.curves.get("gold_score")}
    if not with_kl:
        return {}
    seeds = {n: [frontier_rows(_seed_curves(r, i)) for i in range(len(r.seeds))] for n, r in with_kl.items()}
    budget = common_budget({f"{n}/{i}": rows for n, runs in seeds.items() for i, rows in enumerate(runs)})
    out = {}
    for n, r in with_kl.items():
        rows = frontier_rows(r.curves)
        def over_seeds(at: list[float | None]) -> dict | None:  # None in ``at``: a curve that starts past it
            mean, ci = t_interval([g for g in at if g is not None] or [math.nan])
            # budget 0: some seed never left the SFT policy, there is no common divergence to compare at
            return {"mean": mean, "ci95": ci, "per_seed": at} if budget > 0 else None

        out[n] = {"label": VARIANTS[n].label, "rows": rows, "seeds": seeds[n], "budget": budget,
                  "gold_at_budget": over_seeds([best_gold_within(rows_i, budget) for rows_i in seeds[n]]),
                  "gold_first_at_budget": over_seeds([gold_at_kl(rows_i, budget) for rows_i in seeds[n]])}
    return out


def frontier_section(table: dict, png: Path, rel: Path, reward: str) -> list[str]:
    """The equal-KL comparison under one reward setting: the plot and a table (empty without held-out KL)."""
    if not table:
        return []
    plot_frontier({v["label"]: v["rows"] for v in table.values()}, png,
                  {v["label"]: v["seeds"] for v in table.values()},
                  title=f"{reward} reward: score against √KL to the SFT policy")
    budget = next(iter(table.values()))["budget"]
    lines = ["### Reward at equal KL", "",
             f"![frontier]({png.relative_to(rel).as_posix()})", "",
             (f"The budget, √KL {budget:.2f}, is the largest √KL that every seed of every variant reached. Best "
              "gold within it: each seed's highest gold score while its √KL stays within the budget (evaluations "
              "joined by straight lines) — the policy that stopping at that divergence keeps, picked on these "
              "prompts for every variant alike — mean over seeds ± the 95% Student-t half-width: the comparison "
              "at the same divergence from the SFT policy. On first reaching: each seed's gold where its curve "
              "first gets to the budget, which reads a dip when KL jumps in the first steps." if budget > 0 else
              "Some seed stayed within √KL 0.05 of the SFT policy: no common divergence to compare the variants "
              "at (–).") + " Peak: the evaluation with the highest mean gold.", "",
             f"| variant | best gold, √KL ≤ {budget:.2f} | gold on first reaching √KL {budget:.2f} | peak gold "
             "| at step | at √KL | final gold | final √KL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for v in table.values():
        rows, at = v["rows"], v["gold_at_budget"]
        top, last = peak(rows), rows[-1]
        lines.append(f"| {v['label']} | {_fmt(at)} | {_fmt(v['gold_first_at_budget'])} | {top['gold_score']:.3f} "
                     f"| {top['step']} | "
                     f"{top['sqrt_kl']:.2f} | {last['gold_score']:.3f} | {last['sqrt_kl']:.2f} |")
    return lines + [""]


def ci_order(a: dict, b: dict) -> int:
    """+1 / -1 when ``a``'s 95% interval lies wholly above / below ``b``'s, else 0 (one seed: no interval)."""
    def half(c: dict) -> float:
        return 0.0 if math.isnan(c["ci95"]) else c["ci95"]

    if a["mean"] - half(a) > b["mean"] + half(b):
        return 1
    return -1 if a["mean"] + half(a) < b["mean"] - half(b) else 0


def claims(tables: dict[str, list[dict]]) -> list[str]:
    """The paper's claims, each stated as reproduced / not reproduced / not measured from the tables."""
    out = []
    for reward, rows in tables.items():
        by = {r["variant"]: r for r in rows}
        key = REWARDS[reward][1]
        base = by.get(BASELINE)
        # the MA-PPO variants: every one with a critic but PPO itself (the critic-free baselines have their own lines)
        ma = [r for r in rows
              if r["variant"] != BASELINE and r["variant"] in VARIANTS and VARIANTS[r["variant"]].critic]
        if base is None or not ma:
            out.append(f"- **{reward} reward**: not measured (needs PPO and at least one MA-PPO variant).")
            continue
        if base.get(f"parity_{key}") == "n/a":
            start = base.get(f"start_{key}")
            out.append(f"- **{reward} reward**: PPO did not improve the held-out {key} within the budget "
                       f"({start:.3f} at step 0 → {_fmt(base.get(key))}), so steps-to-parity is undefined: the "
                       "speed claim was not tested. Final scores:")
        for r in ma:
            p = r.get(f"parity_{key}")
            if p == "n/a":
                b, m = base.get(key), r.get(key)
                out.append(f"  - {r['label']}: {_fmt(m)} (from {r.get(f'start_{key}', float('nan')):.3f} at step 0) "
                           f"vs PPO {_fmt(b)}.")
                continue
            speed = ("not reached within the budget" if p is None else
                     f"reached PPO's final {key} at {p:.2f} of PPO's steps")
            verdict = ("faster as claimed (≥ 1.7×)" if p is not None and p <= FASTER else
                       "faster, but less than the claimed 1.7×" if p is not None and p < 1 else "not faster")
            ci = r.get(f"parity_ci_{key}")
            if ci is not None:
                verdict += f", bootstrap 95% interval over seeds [{_parity(ci[0])}, {_parity(ci[1])}]"
                if p is not None and p <= FASTER:
                    verdict += (" within the claim" if ci[1] is not None and ci[1] <= FASTER else
                                " — the claim is not established at these seeds")
            t = r.get(f"time_parity_{key}")
            if r.get(f"time_parity_note_{key}"):
                verdict += f"; wall-clock time not compared: {r[f'time_parity_note_{key}']}"
            elif t is not None and not (isinstance(t, float) and math.isnan(t)):
                verdict += f"; in wall-clock time at {t:.2f} of PPO's run"
            elif t is None and p is not None:
                verdict += "; in wall-clock time never"
            b, m = base.get(key), r.get(key)
            if b and m:
                if ci_order(m, b) > 0:
                    end = "ends higher (CIs apart)"
                else:
                    end = "ends higher, within the CIs" if m["mean"] > b["mean"] else "does not end higher"
            else:
                end = "final not measured"
            out.append(f"- **{reward} reward, {r['label']}**: {speed} — {verdict}; {end} "
                       f"({_fmt(m)} vs PPO {_fmt(b)}).")
    return out


def write_report(path: Path, results: dict[str, dict[str, VariantResult]], *, settings: dict, commands: list[str],
                 missing: list[str], unavailable: dict, invocation: str, real: dict | None = None,
                 dpo: dict | None = None, tuning: dict | None = None, not_run: list[str] = ()) -> Path:
    """``missing``: the unfinished runs (named by reward/variant and seeds); ``not_run``: the variants and
    reward settings of the full sweep this invocation left out."""
    path = Path(path)
    fig_dir = path.parent / "results"
    tables = {reward: summary_table(res, reward) for reward, res in results.items()}
    frontiers = {reward: frontier_table(res) for reward, res in results.items()}
    dpo_rows = dpo_table(dpo) if dpo and "result" in dpo else None
    (path.parent).mkdir(parents=True, exist_ok=True)
    (fig_dir).mkdir(parents=True, exist_ok=True)
    (fig_dir / "results.json").write_text(json.dumps({"settings": settings, "tables": tables, "real": real,
                                                      "dpo": dpo_rows or dpo, "tuning": tuning,
                                                      "frontier": frontiers}, indent=1))
    m = machine()
    lines = ["# Reproduction results", "",
             f"Generated by `{invocation}` on {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC from the "
             "recorded runs; every number below is read from the runs' own `summary.json` / `metrics.jsonl` "
             "(also in [results/results.json](results/results.json)).", "",
             "## Setup", "",
             f"- Report generated on: {m['cpu']}, {m['cores']} cores, GPU: {m['gpu']}; {m['os']} (the runs may have "
             "run elsewhere: each run's `summary.json` names its CPU — runs of older builds do not — and wall-clock "
             "parity is computed only between runs on one kind of CPU)",
             f"- Versions: Python {m['python']}, torch {m['torch']}, DeepSpeed {m['deepspeed']}, "
             f"transformers {m['transformers']}",
             f"- Seeds: {settings['seeds']} (data split fixed by `--data_seed 1234`); "
             f"{settings['steps']} PPO steps per run; held-out evaluation every {settings['eval_interval']} steps on "
             + (f"the {settings['eval_samples'] // 2}-prompt test half of "
                f"{settings['eval_samples']} held-out prompts (the other half chose the settings)."
                if any((settings.get("tune_grids") or {}).values()) else f"{settings['eval_samples']} prompts."),
             "- Values are means over seeds ± the half-width of the 95% Student-t interval. Steps-to-parity: "
             "the first evaluated step at which the variant's seed-mean reaches PPO's final seed-mean, as a "
             "fraction of PPO's steps (< 1: faster than PPO; 0: already at step 0), with its 95% percentile "
             "bootstrap interval over seeds in brackets (the variant's and PPO's seeds resampled; 'never': in that "
             "share of resamples it did not get there). Time parity: the seconds the variant's steps took to get "
             "there (evaluation excluded) as a fraction of PPO's whole run ('–': step times not recorded, or the "
             "runs ran on different CPUs). KL: Σ_t log π − log π_ref per held-out answer (the last training batch's "
             "where no held-out KL was logged).", ""]
    if tuning is not None:
        lines += tuning_section(tuning, settings)
    for reward, rows in tables.items():
        key = REWARDS[reward][1]
        title = {"gold": "Gold scorer as the reward", "rm": "Reward model as the reward"}[reward]
        fig = plot_curves(results[reward], fig_dir / f"curves_{reward}.png", title)
        lines += [f"## {title}", "", f"![curves]({fig.relative_to(path.parent).as_posix()})", "",
                  f"| variant | seeds | {key} at step 0 | gold | RM | KL | length | EOS | parity (" + key + ")"
                  + " | time parity" + (" | parity (gold)" if key != "gold_score" else "") + " |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if key != "gold_score" else "")]
        for r in rows:
            start = r.get(f"start_{key}")
            cells = [r["label"], str(len(r["seeds"])), "–" if start is None else f"{start:.3f}",
                     _fmt(r.get("gold_score")), _fmt(r.get("rm_score")),
                     _fmt(r.get("kl") or r.get("train_kl")), _fmt(r.get("response_len")), _fmt(r.get("eos_rate")),
                     _parity_cell(r, key), _time_cell(r, key)]
            if key != "gold_score":
                cells.append(_parity_cell(r, "gold_score"))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += frontier_section(frontiers[reward], fig_dir / f"frontier_{reward}.png", path.parent, reward)
    if dpo is not None:
        lines += dpo_section(dpo, dpo_rows)
    cost = fig_dir / "cost_per_step.json"  # scripts/bench_step3.py's, when it was run for this report
    if cost.exists():
        lines += [render_cost_section(cost).rstrip("\n"), "",
                  "(`python scripts/bench_step3.py` regenerates this section's JSON; the report reads it.)", ""]
    if real is not None:
        lines += real_section(real)
    lines += ["## The paper's claims at this scale", ""] + (claims(tables) or ["- No finished runs."])
    lines += equal_kl_claims(frontiers)
    lines += baseline_claims(tables, dpo_rows) + [""]
    if missing or unavailable or not_run:
        lines += ["## Not in this report", ""]
        lines += [f"- {v}: not run — this build's step 3 has no {', '.join(n)} flag" for v, n in unavailable.items()]
        lines += [f"- {run}: not finished (rerun the command to continue it)" for run in missing]
        lines += [f"- {what}: not in this sweep (`--variants` / `--rewards` add it)" for what in not_run]
        lines.append("")
    lines += other_measurements(fig_dir)
    lines += ["## Commands", "", "```bash", *commands, "```", ""]
    path.write_text("\n".join(lines))
    return path


def tuning_section(tuning: dict, settings: dict) -> list[str]:
    """Each method's grid and what it chose: the mean final gold score on the validation prompts at every grid
    point over the tuning seeds (and each seed's, when more than one), the chosen one in bold."""
    grids = settings.get("tune_grids") or {}  # reward -> the text of its grid
    flags = "; ".join(f"{reward}: `{'--tune_grid_gold' if reward == 'gold' else '--tune_grid'} {grid}`"
                      for reward, grid in grids.items())
    lines = ["## Settings chosen on the validation prompts", "",
             f"Every method ran at every point of its reward's grid ({flags}) "
             + f"with seeds {settings.get('tune_seeds')}, evaluated on the validation half of the held-out prompts; "
             "the point with its best mean final gold score is the one reported below (fresh seeds, the test half). "
             "Evaluation draws from its own random stream, so how often a tuning run was evaluated along the way "
             "(the commands below say) does not change its training.",
             ""]
    for reward, by in tuning.items():
        labels = list(dict.fromkeys(label for v in by.values() for label in v["scores"]))
        if not labels:
            continue
        lines += [f"{reward} reward:", "", "| variant | " + " | ".join(labels) + " |",
                  "|---|" + "---:|" * len(labels)]
        for variant, v in by.items():
            chosen = v["chosen"]["label"] if v["chosen"] else None
            cells = []
            for label in labels:
                vals = v["scores"].get(label)
                cell = "–" if not vals else f"{sum(vals) / len(vals):.3f}" + (  # each seed's too: a collapse shows
                    f" ({' / '.join(f'{x:.3f}' for x in vals)})" if len(vals) > 1 else "")
                cells.append(f"**{cell}**" if label == chosen else cell)
            lines.append(f"| {VARIANTS[variant].label} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def other_measurements(folder: Path) -> list[str]:
    """A list of the other result pages beside the report (``docs/results/*.md``, each generated by its own
    script or written from its own runs), by their titles."""
    pages = sorted(folder.glob("*.md"))
    if not pages:
        return []
    lines = ["## Other measurements", ""]
    for page in pages:
        first = page.read_text().splitlines()[:1]
        title = first[0].lstrip("# ").strip() if first else page.stem
        lines.append(f"- [{title}]({folder.name}/{page.name})")
    return lines + [""]


def real_section(real: dict) -> list[str]:
    """The real-model track: reward-model accuracy, RM score before/after per variant, sample answers."""
    lines = ["## Real-model track", ""]
    if "skipped" in real:
        return lines + [f"Not run: {real['skipped']}.", ""]
    st = real["steps"]
    acc = real["rm_accuracy"]
    lines += [f"`{Path(real['model']).name}` on `{Path(real['data']).name}`: SFT {st['sft']} steps, reward model "
              f"{st['rm']} steps (held-out pair accuracy {acc:.3f}), then {st['ppo']} steps of each variant "
              "(one seed; a small fixed budget: a plumbing-and-direction check, not a result)"
              + (f"; recorded {real['recorded']}" if real.get("recorded") else "") + ".", "",
              "| variant | RM score before | RM score after | length before | length after | EOS after |",
              "|---|---:|---:|---:|---:|---:|"]
    for v, r in real["variants"].items():
        b, a = r["before"], r["after"]
        lines.append(f"| {VARIANTS[v].label} | {b['rm_score']:.3f} | {a['rm_score']:.3f} | {b['response_len']:.1f} | "
                     f"{a['response_len']:.1f} | {a['eos_rate']:.2f} |")
    lines.append("")
    for v, r in real["variants"].items():
        lines += [f"Sample answers of the final {VARIANTS[v].label} policy (greedy):", ""]
        for smp in r["samples"]:
            prompt = " ".join(smp["prompt"].split())[-200:]
            lines += [f"- prompt …{prompt}", f"  - answer: {' '.join(smp['response'].split())[:300]}"]
        lines.append("")
    return lines


DPO_KEYS = ("gold_score", "rm_score", "kl", "response_len", "eos_rate", "gold_coverage", "gold_invented",
            "gold_repeated")


def dpo_table(dpo: dict) -> list[dict]:
    """Two rows, the SFT policy (DPO's start and reference) and DPO's final policy: mean ± CI over seeds of
    each key, and DPO's held-out implicit-reward pair accuracy (its own eval)."""
    r: VariantResult = dpo["result"]
    start = {"variant": "sft", "label": "SFT (start)", "seeds": r.seeds, "steps": 0}
    final = {"variant": "dpo", "label": f"DPO ({dpo['steps']} steps)", "seeds": r.seeds, "steps": r.steps}
    for key in DPO_KEYS:
        if key in r.finals:
            first = r.curves[key][0]
            start[key] = {"mean": sum(first) / len(first), "ci95": float("nan"), "per_seed": first}
            final[key] = {"mean": r.final(key)[0], "ci95": r.final(key)[1], "per_seed": r.finals[key]}
    acc = [a for a in dpo["implicit_accuracy"].values() if a is not None]
    if acc:
        final["implicit_accuracy"] = {"mean": sum(acc) / len(acc), "ci95": t_interval(acc)[1], "per_seed": acc}
    return [start, final]


def dpo_section(dpo: dict, rows: list[dict] | None) -> list[str]:
    lines = ["## DPO (its own budget)", ""]
    if rows is None:
        return lines + [f"Not in this report: {dpo['skipped']}.", ""]
    lines += [f"DPO (App. C.3; sigmoid loss, β 0.1, the tiny DPO launch script) from the same SFT model, "
              f"{dpo['steps']} optimizer steps on the reward model's preference pairs, seeds "
              f"{rows[1]['seeds']}. The SFT and each DPO policy are evaluated by `marlhf eval-policy` "
              "with a step-3 run's own settings, so the SFT row equals the step-3 runs' step 0 and every "
              "column compares with the tables above.", "",
              "| policy | gold | RM | KL | length | EOS | coverage | invented | repeated | implicit-reward accuracy |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append("| " + " | ".join([r["label"], *(_fmt(r.get(k)) for k in DPO_KEYS),
                                         _fmt(r.get("implicit_accuracy"))]) + " |")
    return lines + [""]


def equal_kl_claims(frontiers: dict[str, dict]) -> list[str]:
    """Each macro-action variant against PPO at the same divergence from the SFT policy (the frontier's common
    budget), per reward setting: higher or lower only when the 95% intervals over seeds are apart."""
    out = []
    for reward, table in frontiers.items():
        base = table.get(BASELINE)
        if base is None or base["gold_at_budget"] is None:
            continue
        b = base["gold_at_budget"]
        for name, v in table.items():
            if name == BASELINE:
                continue
            m = v["gold_at_budget"]
            order = ci_order(m, b)
            verdict = ("higher, intervals apart" if order > 0 else "lower, intervals apart" if order < 0 else
                       "within the intervals")
            out.append(f"- **{reward} reward, {v['label']} at equal KL** (best gold within √KL {v['budget']:.2f}): "
                       f"{_fmt(m)} vs "
                       f"PPO {_fmt(b)} — {verdict}.")
    return out


def baseline_claims(tables: dict[str, list[dict]], dpo_rows: list[dict] | None) -> list[str]:
    """App. C.3 / Table 7: MA-PPO against RLOO and DPO, on the held-out gold score (the yardstick every
    setting shares): stated as ends higher (CIs apart) / within the CIs / lower."""
    def versus(a: dict, b: dict) -> str:
        order = ci_order(a, b)
        if order:
            return "higher, CIs apart" if order > 0 else "lower, CIs apart"
        return "higher, within the CIs" if a["mean"] > b["mean"] else "lower, within the CIs"

    out = []
    for reward, rows in tables.items():
        by = {r["variant"]: r for r in rows}
        ma = by.get("n5")
        if ma is None or "gold_score" not in ma:
            continue
        for name in ("rloo", "grpo", "reinforce"):
            if name in by and "gold_score" in by[name]:
                out.append(f"- **{reward} reward, MA-PPO n = 5 vs {by[name]['label']}** (gold): "
                           f"{versus(ma['gold_score'], by[name]['gold_score'])} "
                           f"({_fmt(ma['gold_score'])} vs {_fmt(by[name]['gold_score'])}).")
        if dpo_rows and "gold_score" in dpo_rows[1]:
            d = dpo_rows[1]["gold_score"]
            out.append(f"- **MA-PPO n = 5 ({reward} reward) vs DPO** (gold): {versus(ma['gold_score'], d)} "
                       f"({_fmt(ma['gold_score'])} vs {_fmt(d)}; budgets differ: DPO trains on the preference "
                       "pairs, MA-PPO on its own samples).")
    return out
