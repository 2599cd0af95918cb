"""The reproduction sweep: which step-3 variants run, where their results live, and what they add up to.

A *run* is one step-3 training of one variant (PPO, MA-PPO with a rule, a critic-free estimator) under one
reward setting (the embedded task's gold scorer as the reward, or the reward model) and one seed, all
from the same SFT model and reward model.  Its folder holds what step 3 writes anyway —
``initial_policy.json`` (held-out evaluation at step 0), ``metrics.jsonl`` (``eval/*`` rows every
``--eval_interval`` steps, ``train/*`` rows every step) and ``summary.json`` (the final evaluation) — so a
run is *done* when ``summary.json`` exists, and an unfinished one resumes from its checkpoints.

This module only reads those files and computes: curves with their seed spread, final scores with 95%
confidence intervals over seeds, and steps-to-parity (the first evaluated step at which a variant's
seed-mean reaches vanilla PPO's final seed-mean, as a fraction of PPO's steps — the paper's "1.7–2×
faster", §4.2) with a bootstrap interval over seeds, and the same in wall-clock time (the seconds the
variant's steps took to get there, as a fraction of PPO's whole run; only between runs on one kind of CPU).
``scripts/reproduce.py`` runs the sweep; ``scripts/lab/results_report.py`` writes the report.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

BASELINE = "ppo"

# the held-out quantities a curve/table shows, in order; the gold components follow where the task has them
CURVE_KEYS = ("gold_score", "rm_score", "kl", "response_len", "eos_rate")


@dataclass(frozen=True)
class Variant:
    """One step-3 configuration: a name for folders and tables, a label for humans, its flags (and the launch
    script's environment where a flag of the script's own must change)."""

    name: str
    label: str
    flags: tuple[str, ...]
    needs: tuple[str, ...] = ()  # RLHFArgs fields the flags need (a build without them cannot run it)
    critic: bool = True  # False: critic-free, step 3 refuses the critic's and GAE's flags (CRITIC_FLAGS)
    one_action: bool = False  # each answer is one macro action: GAE's λ weighs nothing (ONE_ACTION_FLAGS)
    env: tuple[tuple[str, str], ...] = ()  # the tiny step-3 script's environment overrides, (name, value) pairs

    def available(self, known_fields: set[str]) -> bool:
        return all(f in known_fields for f in self.needs)


def _fixed(n: str, *extra: str) -> tuple[str, ...]:
    return ("--termination_condition", "fixed", "--ngram", n, *extra)


# The group estimators answer K = 4 times each of 4 prompts per step: the same 16 answers a PPO step
# generates and trains on (the tiny scripts' batch), so a step costs about the same for every variant; the
# held-out evaluation keeps PPO's 16 prompts per batch, so every variant is evaluated on the same samples.
_GROUPS = ("--num_samples_per_prompt", "4", "--per_device_generation_batch_size", "4",
           "--per_device_eval_generation_batch_size", "16")
# GRPO's advantages are normalised within each prompt's group: step 3 refuses the tiny script's batch whitening on top
_GROUP_NORMALISED = (("WHITEN_ADVANTAGES", "0"),)

# paper §4.2–4.5 and App. C.3 / D.1: n ∈ {3,5,10,∞}, the four rules, σ for n = 5, the ratio, baselines
VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("ppo", "PPO (n = 1)", _fixed("1")),
    Variant("n3", "MA-PPO n = 3", _fixed("3")),
    Variant("n5", "MA-PPO n = 5", _fixed("5")),
    Variant("n10", "MA-PPO n = 10", _fixed("10")),
    Variant("ninf", "MA-PPO n = ∞", _fixed("inf"), one_action=True),
    Variant("randomized", "MA-PPO randomized", ("--termination_condition", "randomized")),
    Variant("ppl", "MA-PPO ppl", ("--termination_condition", "ppl")),
    Variant("parsing", "MA-PPO parsing", ("--termination_condition", "parsing")),
    Variant("word", "MA-PPO word", ("--termination_condition", "word")),
    # τ = 0.9: the SFT policy's answers of the embedded task are copied with confidence, and τ = 0.1 leaves 1.4
    # actions per answer (n = ∞ again); 0.9 gives 7.6, between n = 5's 9.6 and n = 10's 5.1
    # (scripts/lowprob_threshold.py, docs/embedded_task.md)
    Variant("lowprob", "MA-PPO lowprob (τ = 0.9)", ("--termination_condition", "lowprob", "--lowprob_threshold", "0.9"),
            needs=("lowprob_threshold",)),
    Variant("n5_sigma_unit", "MA-PPO n = 5, σ unit", _fixed("5", "--value_function", "unit")),
    Variant("n5_sigma_position", "MA-PPO n = 5, σ position", _fixed("5", "--value_function", "position")),
    Variant("n5_ratio_macro", "MA-PPO n = 5, macro ratio", _fixed("5", "--policy_ratio", "macro")),
    # critic-free: the whole answer is one action (no --termination_condition/--ngram: step 3 refuses them
    # there unless --policy_ratio macro, see marlhf/rlhf/advantages SequenceEstimator.check)
    Variant("rloo", "RLOO (K = 4)", ("--advantage_estimator", "rloo", *_GROUPS),
            needs=("advantage_estimator", "num_samples_per_prompt"), critic=False),
    Variant("grpo", "GRPO (K = 4)", ("--advantage_estimator", "grpo", *_GROUPS),
            needs=("advantage_estimator", "num_samples_per_prompt"), critic=False, env=_GROUP_NORMALISED),
    Variant("grpo_dr", "Dr. GRPO (K = 4, no std)", ("--advantage_estimator", "grpo", "--grpo_normalization", "none",
                                                    *_GROUPS),
            needs=("advantage_estimator", "num_samples_per_prompt", "grpo_normalization"), critic=False,
            env=_GROUP_NORMALISED),
    Variant("reinforce", "REINFORCE", ("--advantage_estimator", "reinforce"), needs=("advantage_estimator",),
            critic=False),
    # Monte-Carlo macro values (VinePPO): no critic, K = 4 continuations from every boundary of n = 5 actions
    Variant("mc_macro", "MC macro values (n = 5, K = 4)", ("--advantage_estimator", "mc_macro", "--mc_rollouts", "4"),
            needs=("advantage_estimator", "mc_rollouts"), critic=False),
    # the same estimator at a quarter of the continuations (~5 boundaries x 2 instead of ~10 x 4 per answer): each
    # continuation is generated and scored whole, so a step's extra cost scales with their number
    Variant("mc_macro_n10_k2", "MC macro values (n = 10, K = 2)",
            ("--advantage_estimator", "mc_macro", "--mc_rollouts", "2", "--ngram", "10"),
            needs=("advantage_estimator", "mc_rollouts"), critic=False),
]}

# reward setting -> (step-3 flags, the held-out score it optimises)
REWARDS: dict[str, tuple[tuple[str, ...], str]] = {
    "gold": (("--reward_source", "gold"), "gold_score"),
    "rm": ((), "rm_score"),
}


@dataclass(frozen=True)
class RunSpec:
    reward: str
    variant: str
    seed: int
    root: Path

    @property
    def out(self) -> Path:
        return self.root / self.reward / self.variant / f"seed{self.seed}"

    @property
    def done(self) -> bool:
        return (self.out / "summary.json").exists()


def plan(root: Path, rewards: list[str], variants: list[str], seeds: list[int]) -> list[RunSpec]:
    unknown = [v for v in variants if v not in VARIANTS] + [r for r in rewards if r not in REWARDS]
    if unknown:
        raise ValueError(f"unknown variant/reward {unknown}; variants: {sorted(VARIANTS)}; rewards: {sorted(REWARDS)}")
    return [RunSpec(r, v, s, root) for r in rewards for v in variants for s in seeds]


# --------------------------------------------------------------------------------------------- reading runs
def read_run(out: Path) -> dict:
    """One finished run as ``{"steps": S, "curve": {step: {key: value}}, "final": {...}, "train_kl": {step: v},
    "elapsed": {step: seconds}, "cpu": name}``.

    The curve holds step 0 (``initial_policy.json``), every ``eval/*`` row of ``metrics.jsonl`` and the
    final evaluation at step S (``summary.json``, which wins over an ``eval/*`` row at the same step).
    ``elapsed``: the seconds steps 1..s took together (their ``train/step_seconds``, evaluation excluded),
    with ``elapsed[0] = 0``; empty when any step did not record its time (runs of older builds).  ``cpu``: the
    CPU its summary names (None: not recorded, runs of older builds)."""
    summary = json.loads((out / "summary.json").read_text())
    steps = int(summary["steps"])
    curve: dict[int, dict] = {0: dict(summary["initial_policy"])}
    train_kl: dict[int, float] = {}
    step_seconds: dict[int, float] = {}
    metrics = out / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        if not line.strip():
            continue
        row = json.loads(line)
        ev = {k[len("eval/"):]: v for k, v in row.items() if k.startswith("eval/")}
        if ev:
            curve.setdefault(int(row["step"]), {}).update(ev)
        if "train/kl" in row:
            train_kl[int(row["step"])] = row["train/kl"]
        if "train/step_seconds" in row:
            step_seconds[int(row["step"])] = row["train/step_seconds"]
    curve[steps] = dict(summary["final_policy"])
    elapsed: dict[int, float] = {}
    if all(s in step_seconds for s in range(1, steps + 1)):
        total = 0.0
        elapsed[0] = total
        for s in range(1, steps + 1):
            total += step_seconds[s]
            elapsed[s] = total
    return {"steps": steps, "curve": curve, "final": curve[steps], "train_kl": train_kl, "elapsed": elapsed,
            "cpu": (summary.get("machine") or {}).get("cpu")}


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of the two-sided Student-t confidence interval over seeds (half-width nan for
    one seed: no spread to estimate)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    from scipy.stats import t

    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)


@dataclass
class VariantResult:
    """A variant under one reward setting, over its seeds."""

    variant: str
    seeds: list[int]
    steps: int
    curves: dict[str, dict[int, list[float]]]  # key -> step -> one value per seed (steps every seed has)
    finals: dict[str, list[float]]  # key -> one final value per seed
    elapsed: dict[int, list[float]] | None = None  # step -> seconds of steps 1..step, one per seed (None: unrecorded)
    cpus: tuple[str | None, ...] = ()  # the CPU each seed's run names, seed order (None: not recorded)

    def mean_curve(self, key: str) -> dict[int, float]:
        return {s: sum(v) / len(v) for s, v in sorted(self.curves.get(key, {}).items())}

    def final(self, key: str) -> tuple[float, float]:
        return t_interval(self.finals[key])


def collect(specs: list[RunSpec]) -> dict[str, dict[str, VariantResult]]:
    """reward -> variant -> result, over the finished runs among ``specs`` (unfinished ones are left out;
    :func:`missing` names them)."""
    grouped: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    for spec in specs:
        if spec.done:
            grouped.setdefault((spec.reward, spec.variant), []).append((spec.seed, read_run(spec.out)))
    out: dict[str, dict[str, VariantResult]] = {}
    for (reward, variant), runs in grouped.items():
        out.setdefault(reward, {})[variant] = combine(variant, runs)
    return out


def combine(variant: str, runs: list[tuple[int, dict]]) -> VariantResult:
    """One variant's finished runs, ``(seed, read_run(...))`` each, as curves and finals over seeds (the keys
    and steps every run has)."""
    runs = sorted(runs, key=lambda sr: sr[0])
    keys = [k for k in runs[0][1]["final"] if all(k in r["final"] for _, r in runs)
            and isinstance(runs[0][1]["final"][k], (int, float))]
    common = set.intersection(*(set(r["curve"]) for _, r in runs))
    curves = {k: {s: [r["curve"][s][k] for _, r in runs] for s in sorted(common)
                  if all(k in r["curve"][s] for _, r in runs)} for k in keys}
    # KL to the reference: the held-out one where logged, else the training batches' (every step)
    if "kl" not in keys:
        kl_common = set.intersection(*(set(r["train_kl"]) for _, r in runs))
        curves["train_kl"] = {s: [r["train_kl"][s] for _, r in runs] for s in sorted(kl_common)}
    elapsed = None
    if all(r["elapsed"] for _, r in runs):
        timed = set.intersection(*(set(r["elapsed"]) for _, r in runs))
        elapsed = {s: [r["elapsed"][s] for _, r in runs] for s in sorted(timed)}
    return VariantResult(variant, [s for s, _ in runs], max(r["steps"] for _, r in runs), curves,
                         {k: [r["final"][k] for _, r in runs] for k in keys}, elapsed,
                         tuple(r.get("cpu") for _, r in runs))


def missing(specs: list[RunSpec]) -> list[RunSpec]:
    return [s for s in specs if not s.done]


def improved(result: VariantResult, key: str) -> bool:
    """Whether the seed-mean of ``key`` ended above where it started (step 0)."""
    curve = result.mean_curve(key)
    return bool(curve) and min(curve) == 0 and sum(result.finals[key]) / len(result.finals[key]) > curve[0]


def _parity_step(curve: dict[int, list[float]], finals: list[float], rows: list[int],
                 base_rows: list[int]) -> int | None:
    """First step of ``curve`` (step -> one value per seed) whose mean over the seeds ``rows`` reaches the mean
    of ``finals`` over the seeds ``base_rows``; None: never."""
    target = sum(finals[i] for i in base_rows) / len(base_rows)
    for step in sorted(curve):
        if sum(curve[step][i] for i in rows) / len(rows) >= target:
            return step
    return None


def steps_to_parity(result: VariantResult, baseline: VariantResult, key: str) -> float | None:
    """First evaluated step at which ``result``'s seed-mean of ``key`` reaches ``baseline``'s final
    seed-mean, divided by the baseline's number of steps (< 1: faster than PPO).  None: never reached.
    Meaningful only when the baseline improved on its start (:func:`improved`); the report says so."""
    step = _parity_step(result.curves[key], baseline.finals[key], list(range(len(result.seeds))),
                        list(range(len(baseline.seeds))))
    return None if step is None else step / baseline.steps


def timing_mismatch(result: VariantResult, baseline: VariantResult) -> str | None:
    """Why the two variants' seconds do not compare, or None when they do: every run must name the same CPU, or
    none may name one (records of older builds, which cannot be told apart)."""
    cpus = {*result.cpus, *baseline.cpus}
    if len(cpus) < 2:
        return None
    named = sorted(c if c is not None else "not recorded" for c in cpus)
    return f"the runs ran on different CPUs ({'; '.join(named)})"


def time_to_parity(result: VariantResult, baseline: VariantResult, key: str) -> float | None:
    """Wall-clock steps-to-parity: the seconds ``result``'s steps took up to its parity step (mean over its
    seeds), divided by the seconds ``baseline``'s whole run took (mean over its seeds): the paper's claim is
    about training time, and a variant whose step costs more can win in steps and lose here.  None: never
    reached; nan: a run did not record its step times, or the runs ran on different CPUs (:func:`timing_mismatch`)."""
    if result.elapsed is None or baseline.elapsed is None or timing_mismatch(result, baseline):
        return float("nan")
    step = _parity_step(result.curves[key], baseline.finals[key], list(range(len(result.seeds))),
                        list(range(len(baseline.seeds))))
    if step is None:
        return None
    spent = result.elapsed[step]
    whole = baseline.elapsed[max(baseline.elapsed)]
    return (sum(spent) / len(spent)) / (sum(whole) / len(whole))


def parity_draws(result: VariantResult, baseline: VariantResult, key: str, draws: int = 4000,
                 seed: int = 0) -> list[float]:
    """Bootstrap over seeds: ``draws`` times, the variant's and the baseline's seeds each resampled with
    replacement and steps-to-parity computed from the resampled means (``inf``: never reached)."""
    rng = random.Random(seed)
    n, m = len(result.seeds), len(baseline.seeds)
    out = []
    for _ in range(draws):
        rows = [rng.randrange(n) for _ in range(n)]
        base_rows = [rng.randrange(m) for _ in range(m)]
        step = _parity_step(result.curves[key], baseline.finals[key], rows, base_rows)
        out.append(math.inf if step is None else step / baseline.steps)
    return out


def parity_interval(result: VariantResult, baseline: VariantResult, key: str, level: float = 0.95,
                    draws: int = 4000, seed: int = 0) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval over seeds of :func:`steps_to_parity` (an end of None: in that share of
    resamples the variant never reached the baseline)."""
    values = sorted(parity_draws(result, baseline, key, draws, seed))
    lo = values[int(math.floor((1 - level) / 2 * draws))]
    hi = values[min(draws - 1, int(math.ceil((1 + level) / 2 * draws)) - 1)]
    return tuple(None if v == math.inf else v for v in (lo, hi))


# ----------------------------------------------------------------------------------------- tuning on validation
def parse_grid(text: str) -> list[dict[str, str]]:
    """``"actor_learning_rate=3e-5,1e-4 kl_ctl=0.02,0.1"`` -> every combination, as step-3 flag -> value dicts
    in the written order (an empty text: one point with no flags, i.e. no tuning)."""
    axes = []
    for item in text.split():
        name, sep, values = item.partition("=")
        choices = [v for v in values.split(",") if v]
        if not sep or not name or not choices:
            raise ValueError(f"--tune_grid item {item!r}: write FLAG=V1,V2,... (e.g. actor_learning_rate=1e-5,3e-5)")
        axes.append((name.lstrip("-"), choices))
    points = [{}]
    for name, choices in axes:
        points = [{**p, name: v} for p in points for v in choices]
    return points


def point_label(point: dict[str, str]) -> str:
    """A folder name for a grid point, e.g. ``actor_learning_rate=1e-05,kl_ctl=0.1`` ('default' when empty)."""
    return ",".join(f"{k}={v}" for k, v in point.items()) or "default"


def point_flags(point: dict[str, str]) -> list[str]:
    return [x for k, v in point.items() for x in (f"--{k}", v)]


# what a critic-free variant's step 3 refuses (no critic, no GAE between a response's steps): dropped from its grid
CRITIC_FLAGS = frozenset({"lam", "lam_critic", "adaptive_lam_alpha", "gamma", "critic_learning_rate",
                          "critic_weight_decay", "cliprange_value"})


# what cannot matter when each answer is one action: GAE over one step is A = R - V(s0) whatever λ (the sweep's
# n = ∞ runs at λ 0.95 and 1.0 agreed to the last digit at all 8 points of its reward-model grid)
ONE_ACTION_FLAGS = ("lam", "lam_critic")


def variant_points(grid: list[dict[str, str]], variant: str) -> list[dict[str, str]]:
    """The grid a variant is tuned on: every point, without the critic's and GAE's flags for a critic-free one
    (the points that then coincide are one), and with λ held at the grid's first value for a one-action one (the
    folders keep their labels, so runs made on the whole grid are found)."""
    if VARIANTS[variant].one_action:
        first = grid[0] if grid else {}
        return [pt for pt in grid if all(pt.get(k) == first.get(k) for k in ONE_ACTION_FLAGS)]
    if VARIANTS[variant].critic:
        return grid
    points = [{k: v for k, v in pt.items() if k not in CRITIC_FLAGS} for pt in grid]
    return list({point_label(pt): pt for pt in points}.values())


def choose(scores: dict[str, list[float]]) -> str:
    """The grid point (label -> its runs' final validation scores, one per tuning seed) with the highest mean;
    the first written wins a tie, so a rerun chooses the same."""
    if not scores:
        raise ValueError("no finished tuning run to choose from")
    return max(scores, key=lambda label: (sum(scores[label]) / len(scores[label]), -list(scores).index(label)))
