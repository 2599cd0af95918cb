"""Run the whole pipeline — step 1 (SFT) → step 2 (reward model) → step 3 (MA-PPO) — with one command.

Like DeepSpeed-Chat's ``e2e_rlhf.py``: each step runs as its launch script
(``training/step*/training_scripts/<family>/run_<size>.sh``) would run it -- the same flags, from the recipes in
``marlhf/recipes.py`` -- through the installed entry points (``python -m marlhf sft`` on one rank, the
``deepspeed`` runner beside this Python on more), one after the other, each step's output feeding the next; no
checkout is needed.  The default runs the embedded tiny model on the synthetic task on this machine's CPU:

    marlhf quickstart
    marlhf quickstart --size gemma-2b --task tldr --output_dir /data/runs/gemma2b

On the embedded task the reward model learns from preference pairs of the SFT policy's own answers
(``--onpolicy_samples`` answers to each of step 2's prompts, in disjoint pairs, labelled by the task's gold scorer
as a simulated annotator: ``marlhf generate`` → ``marlhf label`` → ``marlhf rm``), the distribution step 3 explores:
step 2 runs without an epoch (the SFT model with a new score head, evaluated on the synthetic pairs) and that
round trains it (``step2_onpolicy``).  Trained on the task's synthetic pairs, the reward model does not hold
where step 3 goes (docs/results/onpolicy_reward.md); ``--no-onpolicy_only`` trains step 2 on them first, as the
main job once did (docs/results/main_job_two_rounds.md).  ``--onpolicy_rounds 2`` adds a second round, as in
iterated RLHF (Llama 2, Anthropic's online RLHF): a step 3 against that reward model (the probe), two of its
answers to each prompt paired with two of the SFT policy's, labelled, and the reward model trained further on
them.  Step 3 proper starts from the SFT policy against the last round's reward model, which is also evaluated
on step 2's held-out synthetic pairs (``step2_onpolicy*/synthetic_eval``).

``--generation_backend vllm`` (with its ``--vllm_*`` flags) samples step 3's rollouts and the rounds' answers
with a vLLM engine instead of the policy's own ``generate`` (``pip install 'marlhf[vllm]'``; docs/gpu.md).

It ends with a summary: the SFT policy vs the final policy on held-out prompts (reward-model score, and
the gold score where the task has one), plus the step-1 perplexity and the step-2 accuracies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from marlhf import recipes
from marlhf.config import RewardArgs, RLHFArgs, SFTArgs
from marlhf.config import parse_args as parse_step_args
from marlhf.errors import ConfigError
from marlhf.preflight import check_data, check_model
from marlhf.sections import GenerationEngineSection
from marlhf.utils.flags import add_flags


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=recipes.sizes(), help="Model family/size of the launch scripts.")
    p.add_argument("--step", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3], help="Steps to run.")
    p.add_argument("--output_dir", default="runs/quickstart", help="Root; steps write step1/, step2/, step3/.")
    p.add_argument("--task", default=None, help="TASK of the launch scripts (tldr, hh, webgpt, apps).")
    p.add_argument("--actor_model", default=None, help="Step-3 actor (default: <output_dir>/step1).")
    p.add_argument("--reward_model", default=None, help="Step-3 critic/reward (default: <output_dir>/step2).")
    p.add_argument("--zero_stage", default=None, help="ZeRO stage passed to every step's script.")
    p.add_argument("--termination_condition", default=None, help="Step-3 macro-action rule (default: script's).")
    p.add_argument("--ngram", default=None, help="Step-3 n of the fixed rule (1 = vanilla PPO).")
    p.add_argument("--onpolicy_samples", type=int, default=4,
                   help="Embedded task: SFT answers per step-2 prompt whose gold-labelled pairs (--onpolicy_pairing, "
                        "ties dropped) train the reward model further at the end of step 2 (0: off; ignored for "
                        "--task).")
    p.add_argument("--onpolicy_max_prompts", type=int, default=0,
                   help="Of step 2's prompts, the first N answered for those pairs (0: all).")
    p.add_argument("--onpolicy_pairing", default="disjoint", choices=("disjoint", "all"),
                   help="Pairs of a prompt's answers: disjoint (0-1, 2-3, ...: each answer in one pair) or all "
                        "K(K-1)/2 (3x the pairs and ~1.6x the reward model's time for K = 4; no better in step 3 "
                        "at the one seed run both ways, docs/results/rm_levers.md).")
    p.add_argument("--onpolicy_ties", default="drop", choices=("drop", "keep"),
                   help="Pairs the annotator scores equal: drop, or keep with a coin-flip label.")
    p.add_argument("--onpolicy_epochs", type=int, default=2,
                   help="Epochs of the reward model over each round's pairs (2: above 0.80 pair accuracy on held-out "
                        "pairs of the SFT policy's answers at every seed measured, docs/results/rm_levers.md).")
    p.add_argument("--onpolicy_only", action=argparse.BooleanOptionalAction, default=True,
                   help="The reward model learns from the policy's pairs only: step 2 runs with --num_train_epochs "
                        "0 (the SFT model with an untrained score head, evaluated on the synthetic pairs) and the "
                        "rounds train it from there; --no-onpolicy_only trains step 2 on the synthetic pairs first.")
    p.add_argument("--onpolicy_rounds", type=int, default=1,
                   help="Rounds of pairs on the policy's answers (embedded task): 1 = the SFT policy's only; each "
                        "further round runs a step 3 against the last reward model (step2_onpolicy_roundR/probe) "
                        f"and trains the reward model further on {ROUND_SAMPLES} of its answers per prompt paired "
                        f"with {ROUND_SAMPLES} of the SFT policy's.")
    add_flags(p, GenerationEngineSection)  # step 3's rollouts and the rounds' answers: HF generate or vLLM
    p.add_argument("--extra_args", action="append", default=[],
                   help="An extra flag for every step, repeatable, e.g. --extra_args=--max_steps=5 ('=' forms); the "
                        "rounds' reward model gets them too, under its own data, output, epoch and learning-rate "
                        "flags.")
    return p.parse_args(argv)


def onpolicy_dir(root: Path, round_: int) -> Path:
    """Round 1's folder is ``step2_onpolicy``, round R's ``step2_onpolicy_roundR``."""
    return root / ("step2_onpolicy" if round_ == 1 else f"step2_onpolicy_round{round_}")


def uses_onpolicy(args) -> bool:
    """Whether step 3's reward model is the one trained on the policy's answers: on the embedded task only (its
    gold scorer is the annotator), unless turned off or an explicit reward model replaces step 2's.  The stage
    ends step 2 (so ``--step 1 2`` leaves the reward model step 3 uses); ``--step 3`` alone reuses its output,
    or runs it when there is none."""
    return (args.onpolicy_samples > 0 and args.task is None and args.size.startswith("tiny")
            and args.reward_model is None)


def step3_reward_model(args, root: Path) -> Path:
    """Step 3's reward model (and critic): --reward_model, else the last round's on the policy's answers, else
    step 2's."""
    if args.reward_model:
        return Path(args.reward_model)
    if not uses_onpolicy(args):
        return root / "step2"
    return onpolicy_dir(root, args.onpolicy_rounds) / "reward_model"


def synthetic_eval_dir(root: Path, rounds: int) -> Path:
    """Where the last round's reward model is evaluated on step 2's held-out synthetic pairs."""
    return onpolicy_dir(root, rounds) / "synthetic_eval"


def step_env(step: int, args, root: Path, reward_model: Path | None = None, extra_args: tuple[str, ...] = ()) -> dict:
    """The launch script's environment for one step: the user's, with the quick start's task, models and
    EXTRA_ARGS (step 3 against ``reward_model``, default :func:`step3_reward_model`)."""
    env = dict(os.environ)
    if args.task:
        env["TASK"] = args.task
    if step == 3:
        extra_args = (*GenerationEngineSection.build(args).argv(), *extra_args)
        env["ACTOR_MODEL_PATH"] = args.actor_model or str(root / "step1")
        env["CRITIC_MODEL_PATH"] = str(reward_model or step3_reward_model(args, root))
        if args.termination_condition:
            env["TERMINATION"] = args.termination_condition
        if args.ngram:
            env["NGRAM"] = args.ngram
    elif step == 2:
        env.setdefault("MODEL_PATH", str(root / "step1"))
    if args.extra_args or extra_args:
        env["EXTRA_ARGS"] = " ".join([env.get("EXTRA_ARGS", ""), *args.extra_args, *extra_args]).strip()
    return env


def plan_step(step: int, args, root: Path, out: Path | None = None, reward_model: Path | None = None,
              extra_args: tuple[str, ...] = ()) -> recipes.StepLaunch:
    """One step as its launch script would start it into ``out`` (default ``root/stepK``); a setting the script
    refuses stops here, before anything starts."""
    out = out or root / f"step{step}"
    if not recipes.has_step(args.size, step):
        raise SystemExit(f"--size {args.size} has no step {step} (CodeGemma: no reward model, paper B.2)")
    try:
        return recipes.step_launch(args.size, step, out, args.zero_stage,
                                   env=step_env(step, args, root, reward_model, extra_args))
    except ConfigError as err:
        raise SystemExit(f"step {step}: {err}") from None


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def check_devices(plan: recipes.StepLaunch, size: str) -> None:
    """A step that asks for more GPUs than this machine has stops here, saying so.  DeepSpeed starts CPU ranks
    over gloo where there is no GPU: the tiny sizes are made for that; a GPU size does it only when NUM_GPUS says
    how many ranks (the user asked)."""
    if plan.hostfile:  # the ranks run on the hostfile's nodes, not here
        return
    gpus = visible_gpus()
    if gpus == 0 and plan.device == "GPU" and not plan.num_gpus_given:
        raise SystemExit(f"--size {size} runs on {plan.num_gpus} GPUs per node (NUM_GPUS, default 8) and this "
                         f"machine has none: run --size tiny here, or set NUM_GPUS=N to start N DeepSpeed CPU ranks "
                         f"over gloo anyway (slow; Table 5's global batches are kept by gradient accumulation)")
    if 0 < gpus < plan.num_gpus:
        raise SystemExit(f"step {plan.step} asks for NUM_GPUS={plan.num_gpus} GPUs and this machine has {gpus}: set "
                         f"NUM_GPUS={gpus} (Table 5's global batches are kept by gradient accumulation)")


def flag_values(flags: list[str], flag: str) -> list[str]:
    """The values of the last ``flag`` in ``flags`` (argparse keeps the last), up to the next flag."""
    if flag not in flags:
        return []
    at = len(flags) - 1 - flags[::-1].index(flag)
    values = []
    for value in flags[at + 1:]:
        if value.startswith("--"):
            break
        values.append(value)
    return values


def preflight(args, root: Path) -> list[recipes.StepLaunch]:
    """Every step planned, and what each needs from this machine and the hub checked, before the first starts:
    a refused setting, too few GPUs, or a model or dataset that cannot be had stops the run here, once
    (not in every rank of a step that has started).  Models this run writes (under ``root``) are not checked."""
    plans = [plan_step(step, args, root) for step in sorted(args.step)]
    for plan in plans:
        check_devices(plan, args.size)
        try:
            # the step's own parser, as its ranks will read the flags (a generation engine that is not installed,
            # a bad option): before step 1 trains, not when step 3 starts
            parse_step_args({1: SFTArgs, 2: RewardArgs, 3: RLHFArgs}[plan.step], plan.flags)
            for flag in ("--model_name_or_path", "--actor_model_name_or_path", "--critic_model_name_or_path"):
                for model in flag_values(plan.flags, flag):
                    if not Path(model).resolve().is_relative_to(root):
                        check_model(model, flag)
            check_data(flag_values(plan.flags, "--data_path"))
        except ConfigError as err:
            raise SystemExit(f"step {plan.step}: {err}") from None
    return plans


def launch(cmd: list[str], log: Path) -> int:
    """Run ``cmd`` with its output on the terminal and appended to ``log`` (the launch scripts' ``tee``); its
    exit status."""
    with open(log, "a") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for line in iter(proc.stdout.readline, b""):
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            f.write(line.decode(errors="replace"))
            f.flush()
    return proc.returncode


def run_step(step: int, args, root: Path, out: Path | None = None, reward_model: Path | None = None,
             extra_args: tuple[str, ...] = ()) -> float:
    """Run one step into ``out`` (default ``root/stepK``) through the installed entry point, logged to its
    ``training.log`` as the launch script logs it; step 3 against ``reward_model`` (default
    :func:`step3_reward_model`); ``extra_args``: flags after --extra_args'.  Seconds taken."""
    plan = plan_step(step, args, root, out, reward_model, extra_args)
    cmd = plan.command()
    print(f"\n=== step {step}: {' '.join(cmd)}", flush=True)
    plan.log_file.parent.mkdir(parents=True, exist_ok=True)
    plan.log_file.write_text(f"launch: {' '.join(cmd[:len(cmd) - len(plan.flags)])}\n")  # as the scripts log it
    t0 = time.time()
    code = launch(cmd, plan.log_file)
    if code != 0:
        raise SystemExit(f"step {step} failed with exit code {code}; see {plan.log_file}")
    return time.time() - t0


# the simulated annotator and the reward model's further training (docs/results/onpolicy_reward.md)
ONPOLICY_TAU = 0.05  # Bradley-Terry temperature of the gold annotator's labels
ONPOLICY_RM_LEARNING_RATE = 1e-4
ONPOLICY_HELD_OUT = 0.15  # share of the prompts whose pairs measure the reward model
ROUND_SAMPLES = 2  # a later round: this many answers of the probe and of the SFT policy per prompt, all pairs
PROBE_EVAL_SAMPLES = 16  # the probe's own held-out evaluation: its answers are what the round needs


def marlhf_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "marlhf", *args]


def run_logged(cmd: list[str], log: Path) -> float:
    """Run a command with its output in ``log``; seconds taken.  Stops naming the log's tail on failure."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n--- {log} ---\n{log.read_text()[-3000:]}")
    return time.time() - t0


def step2_config(step2: dict, path: Path, drop: tuple[str, ...] = ()) -> Path:
    """Write step 2's settings (its ``args.json``) as a ``marlhf rm --config`` file at ``path``, without what
    belongs to that run (its output, model, rank) and the keys in ``drop``; returns ``path``."""
    own = ("output_dir", "tensorboard_path", "local_rank", "model_name_or_path")
    path.write_text(json.dumps({k: v for k, v in step2.items() if k not in own + drop}, indent=1))
    return path


def onpolicy_reward_model(sft: Path, rm: Path, out: Path, samples: int, generation: dict | None = None,
                          max_prompts: int = 0, rm_args: list[str] | tuple = (), pairing: str = "all",
                          ties: str = "drop", epochs: int = 1, compare_with: Path | None = None,
                          step2: Path | None = None, seed: int = 8, engine_args: list[str] | tuple = ()) -> dict:
    """Train the reward model ``rm`` further on gold-labelled pairs of the policy ``sft``'s answers.

    ``samples`` answers to each of step 2's prompts (the data settings are step 2's, from the args.json of
    ``step2``, default ``rm``; ``generation``: sampling flags of ``marlhf generate``, default step 3's defaults;
    ``seed``: its sampling seed), paired and labelled by the gold scorer (``out/pairs``: train.jsonl and the
    held-out test.jsonl); with ``compare_with`` (an earlier policy's answers to the same prompts) the first
    ``samples`` of those join each prompt's answers before pairing.  The reward model continues on the train
    pairs with step 2's settings (``out/reward_model``) and ``rm_args``, the round's own flags (its pairs, split,
    output, epochs, learning rate) winning over both.  ``max_prompts``: the first that many of step 2's prompts
    (0: all); ``engine_args``: the generation engine's flags (``--generation_backend vllm``, ...).  Each stage
    is skipped when its output exists.  Returns the seconds each stage took."""
    step2 = json.loads(((step2 or rm) / "args.json").read_text())
    defaults = {f.name: f.default for f in dataclasses.fields(RLHFArgs)}
    gen = {"max_prompt_len": defaults["max_prompt_seq_len"],
           "temperature": defaults["temperature"], "top_k": defaults["top_k"], **(generation or {})}
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    if not (out / "pairs" / "label.json").exists():
        seconds["generate"] = run_logged(marlhf_cmd(
            "generate", "--model", str(sft), "--data_path", *step2["data_path"], "--split", "train", "--phase", "2",
            "--data_split", step2["data_split"], "--data_seed", str(step2["seed"] if step2["data_seed"] < 0
                                                                   else step2["data_seed"]),
            "--eval_fraction", str(step2["eval_fraction"]), "--num_samples", str(samples), "--seed", str(seed),
            "--batch_size", "32", *[x for k, v in gen.items() for x in (f"--{k}", str(v))],
            *(["--max_prompts", str(max_prompts)] if max_prompts else []), *engine_args,
            "--output", str(out / "answers.jsonl"), "--overwrite", "--no_progress"), out / "generate.log")
        seconds["label"] = run_logged(marlhf_cmd(
            "label", "--generations", str(out / "answers.jsonl"), *([str(compare_with), "--max_samples", str(samples)]
                                                                     if compare_with else []),
            "--annotator", "gold", "--tau", str(ONPOLICY_TAU), "--pairing", pairing, "--ties", ties,
            "--seed", "1", "--eval_fraction", str(ONPOLICY_HELD_OUT), "--output", str(out / "pairs")),
            out / "label.log")
    if not (out / "reward_model" / "model.safetensors").exists():
        config = step2_config(step2, out / "rm_config.json",
                              drop=("data_path", "data_split", "data_output_path", "eval_fraction"))
        # the user's flags first: the round's own (its pairs, split, output, epochs, learning rate) come last and
        # win, so a flag meant for the steps (--extra_args=--data_split=...) cannot subsample the round's pairs
        seconds["reward_model"] = run_logged(marlhf_cmd(
            "rm", "--config", str(config), *rm_args, "--model_name_or_path", str(rm),
            "--data_path", str(out / "pairs"), "--data_split", "0,1,0", "--data_output_path", str(out / "data"),
            "--output_dir", str(out / "reward_model"), "--num_train_epochs", str(epochs),
            "--learning_rate", str(ONPOLICY_RM_LEARNING_RATE), "--disable_progress_bar"),
            out / "reward_model.log")
    return seconds


def synthetic_accuracy(rm: Path, step2: Path, out: Path) -> float | None:
    """Evaluate the reward model ``rm`` on step 2's held-out synthetic pairs (``marlhf rm`` with step 2's settings
    and no epoch: it evaluates before training, ``out/metrics.jsonl``); seconds taken, None when already done."""
    if (out / "metrics.jsonl").exists():
        return None
    out.mkdir(parents=True, exist_ok=True)
    config = step2_config(json.loads((step2 / "args.json").read_text()), out / "rm_config.json")
    return run_logged(marlhf_cmd("rm", "--config", str(config), "--model_name_or_path", str(rm),
                                 "--output_dir", str(out), "--num_train_epochs", "0", "--disable_progress_bar"),
                      out.parent / "synthetic_eval.log")


def metric_values(folder: Path, key: str) -> list:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    values = [json.loads(line).get(key) for line in path.read_text().splitlines() if line.strip()]
    return [v for v in values if v is not None]


def last_metric(folder: Path, key: str):
    values = metric_values(folder, key)
    return values[-1] if values else None


def first_metric(folder: Path, key: str):
    values = metric_values(folder, key)
    return values[0] if values else None


def summarize(root: Path, seconds: dict, rounds: int = 1) -> dict:
    summary = {"seconds": {(f"step{k}" if isinstance(k, int) else k): round(v, 1) for k, v in seconds.items()},
               "step1_final_perplexity": last_metric(root / "step1", "eval/perplexity"),
               "step2_final_accuracy": last_metric(root / "step2", "eval/accuracy")}
    for r in range(1, rounds + 1):
        # held-out pairs of the policies' own answers, labelled by the annotator: round 1 the SFT policy's,
        # a later round the probe's against the SFT policy's
        folder = onpolicy_dir(root, r)
        if (folder / "reward_model").exists():
            summary[f"{folder.name}_accuracy_before"] = first_metric(folder / "reward_model", "eval/accuracy")
            summary[f"{folder.name}_accuracy"] = last_metric(folder / "reward_model", "eval/accuracy")
    synthetic = synthetic_eval_dir(root, rounds)  # the reward model step 3 uses, on step 2's synthetic pairs
    if (synthetic / "metrics.jsonl").exists():
        summary["final_reward_model_synthetic_accuracy"] = last_metric(synthetic, "eval/accuracy")
    s3 = root / "step3" / "summary.json"
    if s3.exists():
        summary.update(json.loads(s3.read_text()))
    return summary


def print_summary(summary: dict) -> None:
    print("\n=== summary")
    for key, seconds in summary["seconds"].items():
        parts = summary.get("stage_seconds", {}).get(key)
        print(f"{key}: {seconds:.0f} s" + (" (" + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()) + ")"
                                           if parts else ""))
    if summary.get("step1_final_perplexity") is not None:
        print(f"step 1 held-out perplexity: {summary['step1_final_perplexity']:.2f}")
    if summary.get("step2_final_accuracy") is not None:
        print(f"step 2 held-out pair accuracy: {summary['step2_final_accuracy']:.3f}"
              + (f" (step 3's reward model, after the rounds: {summary['final_reward_model_synthetic_accuracy']:.3f})"
                 if summary.get("final_reward_model_synthetic_accuracy") is not None else ""))
    if summary.get("step2_onpolicy_accuracy") is not None:
        print(f"step 2 accuracy on held-out pairs of the SFT policy's answers (the annotator's labels): "
              f"{summary['step2_onpolicy_accuracy_before']:.3f} -> {summary['step2_onpolicy_accuracy']:.3f}")
    for key in sorted(k for k in summary if k.startswith("step2_onpolicy_round") and k.endswith("_accuracy")
                      and summary[k] is not None):
        r = key[len("step2_onpolicy_round"):-len("_accuracy")]
        print(f"round {r}: accuracy on held-out pairs of the probe's and the SFT policy's answers: "
              f"{summary[key[:-len('_accuracy')] + '_accuracy_before']:.3f} -> {summary[key]:.3f}")
    before, after = summary.get("initial_policy"), summary.get("final_policy")
    if before and after:
        print(f"{'held-out prompts':<22}{'SFT policy':>12}{'final policy':>14}")
        # each score's standard error over the answers follows it (what a difference is worth), and the gold
        # score's components (gold_coverage, ...) its total: why a policy scores what it does
        totals = ["rm_score", "rm_score_se", "gold_score", "gold_score_se"]
        keys = totals + [k for k in before if k.startswith("gold_") and k not in totals]
        for key in keys + ["response_len", "eos_rate"]:
            if key in before and key in after:
                print(f"{key:<22}{before[key]:>12.3f}{after[key]:>14.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    root = Path(args.output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if args.onpolicy_rounds < 1:
        raise SystemExit(f"--onpolicy_rounds must be >= 1 (--onpolicy_samples 0 turns the rounds off), "
                         f"got {args.onpolicy_rounds}")
    preflight(args, root)
    seconds = {}
    stages = {}  # a round's parts (probe, generate, label, reward_model): where its time went
    sft = Path(args.actor_model or root / "step1")
    rm_args = [a for arg in args.extra_args for a in arg.split("=", 1)]
    engine_args = GenerationEngineSection.build(args).argv()

    def onpolicy_rounds():
        """The rounds on the policy's answers not done yet (a finished one is reused: each stage is skipped
        when its output exists)."""
        for r in range(1, args.onpolicy_rounds + 1):
            out = onpolicy_dir(root, r)
            if (out / "reward_model" / "model.safetensors").exists():
                continue
            t0 = time.time()
            shutil.rmtree(synthetic_eval_dir(root, r), ignore_errors=True)  # of an earlier reward model
            if r == 1:
                print(f"\n=== step 2, on the policy's answers: {args.onpolicy_samples} per prompt, pairs labelled by "
                      f"the gold scorer, the reward model trained further ({out})", flush=True)
                parts = onpolicy_reward_model(sft, root / "step2", out, args.onpolicy_samples,
                                              max_prompts=args.onpolicy_max_prompts, pairing=args.onpolicy_pairing,
                                              ties=args.onpolicy_ties, epochs=args.onpolicy_epochs, rm_args=rm_args,
                                              engine_args=engine_args)
            else:
                previous = onpolicy_dir(root, r - 1) / "reward_model"
                print(f"\n=== step 2, round {r}: a step 3 against {previous} (the probe), then {ROUND_SAMPLES} of its "
                      f"answers per prompt paired with {ROUND_SAMPLES} of the SFT policy's, labelled by the gold "
                      f"scorer, the reward model trained further ({out})", flush=True)
                parts = {}
                if not (out / "probe" / "actor" / "model.safetensors").exists():
                    parts["probe"] = run_step(3, args, root, out=out / "probe", reward_model=previous,
                                              extra_args=(f"--max_eval_samples={PROBE_EVAL_SAMPLES}",))
                parts.update(onpolicy_reward_model(
                    out / "probe" / "actor", previous, out, ROUND_SAMPLES, max_prompts=args.onpolicy_max_prompts,
                    pairing="all", ties=args.onpolicy_ties, epochs=args.onpolicy_epochs, rm_args=rm_args,
                    step2=root / "step2", compare_with=onpolicy_dir(root, 1) / "answers.jsonl", seed=7 + r,
                    engine_args=engine_args))
            seconds[out.name] = time.time() - t0
            stages[out.name] = {k: round(v, 1) for k, v in parts.items()}
        last = onpolicy_dir(root, args.onpolicy_rounds)  # the reward model step 3 uses, on step 2's held-out pairs
        took = synthetic_accuracy(last / "reward_model", root / "step2", synthetic_eval_dir(root, args.onpolicy_rounds))
        if took is not None:
            seconds[last.name] = seconds.get(last.name, 0.0) + took
            stages.setdefault(last.name, {})["synthetic_eval"] = round(took, 1)

    for step in sorted(args.step):
        if step == 2:  # the rounds' pairs and reward models came from the step 2 being replaced
            for old in [root / "step2_onpolicy", *root.glob("step2_onpolicy_round*")]:
                shutil.rmtree(old, ignore_errors=True)
        if step == 3 and uses_onpolicy(args):  # --step 3 alone after a step 2 without (all of) them
            onpolicy_rounds()
        only_policy_pairs = step == 2 and args.onpolicy_only and uses_onpolicy(args)
        seconds[step] = run_step(step, args, root, extra_args=("--num_train_epochs=0",) if only_policy_pairs else ())
        if step == 2 and uses_onpolicy(args):
            onpolicy_rounds()
    summary = summarize(root, seconds, args.onpolicy_rounds if uses_onpolicy(args) else 1)
    summary["stage_seconds"] = stages
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    models = [root / f"step{k}" for k in (1, 2) if k in seconds] + [
        onpolicy_dir(root, r) / "reward_model" for r in range(1, args.onpolicy_rounds + 1)
        if onpolicy_dir(root, r).name in seconds] + ([root / "step3/actor"] if 3 in seconds else [])
    print(f"\nwritten: {root / 'summary.json'}; models: {', '.join(map(str, models))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
