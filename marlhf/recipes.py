"""The launch scripts' recipes as data: what ``training/step*/training_scripts/<family>/run_<size>.sh`` hands to
steps 1-3, so that ``marlhf quickstart`` runs the same steps from an installed wheel, through the installed entry
points (``python -m marlhf sft`` for one rank, ``deepspeed --module marlhf.cli.sft`` for more), without a checkout.

    launch = step_launch("tiny", 1, "runs/q/step1", env=os.environ)
    launch.flags          # exactly the flags the script passes to main.py (tests/test_launch_scripts.py)
    launch.command()      # the command line, its launcher found beside this interpreter

A recipe is a size script's variables (Table 5 of MA-RLHF, App. B.2, and the tiny scripts' values); the flags are
built from them as ``training/launch_common.sh`` builds them (``supervised_flags``, ``ppo_flags``), reading the same
environment overrides (``NUM_GPUS``, ``PER_DEVICE_BATCH``, ``DATA_PATH``, ``KL_CTL``, ``EXTRA_ARGS``, ...).  The
scripts stay the users' launchers and the reference: tests/test_launch_scripts.py runs every script the quick start
offers beside :func:`step_launch` and requires the same flags, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path

from marlhf.errors import ConfigError
from marlhf.tasks import load_task

STEP_MODULES = {1: "sft", 2: "rm", 3: "ppo"}  # the entry point of each step (marlhf.cli.<module>)
TEXT_TASKS = ("tldr", "hh", "webgpt")

# launch_common.sh's optional knobs, with the value most scripts use (a script's recipe overrides them)
COMMON = {"EOS_TOKEN": "", "GRADIENT_CHECKPOINTING": 0, "OFFLOAD": 0, "DTYPE": "bf16", "WARMUP_RATIO": "0.1",
          "WEIGHT_DECAY": "0.0", "MAX_EVAL_SAMPLES": "", "MAX_STEPS": "", "TEMPERATURE": "0.8", "TOP_K": "50",
          "LR_SCHEDULE": "cosine", "PRINT_INTERVAL": "50", "LIKELIHOOD_TERM": 0, "LIKELIHOOD_NORM": "sum",
          "LIKELIHOOD_SCALE": "1", "ADV_ESTIMATOR": "", "WHITEN_ADVANTAGES": 0, "CLIP_REWARD": "",
          "SAMPLES_PER_PROMPT": 1, "DEVICE": "GPU", "NUM_GPUS": "8"}


@dataclasses.dataclass(frozen=True)
class Env:
    """A recipe's value read from the environment first: ``${NAME:-default}`` (``keep_empty``: ``${NAME-default}``,
    where a variable set but empty stays empty)."""

    name: str
    default: object
    keep_empty: bool = False

    def read(self, env: Mapping[str, str]):
        value = env.get(self.name)
        if value is None or (value == "" and not self.keep_empty):
            return self.default
        return value


def by_task(**values):
    """A Table 5 row that differs by task (the scripts' ``by_task tldr=... hh=... webgpt=...``)."""
    return ("by_task", values)


def _hub(model: str, eos: str, steps: dict) -> dict:
    return {"kind": "text", "model": model, "eos": eos, "steps": steps}


GEMMA_EOS, LLAMA_EOS = "<eos>", "<|end_of_text|>"
TINY_STEPS = {
    1: {"ZERO": "0", "WEIGHT_DECAY": Env("WEIGHT_DECAY", "1.0"), "GLOBAL_BATCH": 16, "EPOCHS": "12", "LR": "1e-3",
        "MAX_EVAL_SAMPLES": "128", "PER_DEVICE": Env("PER_DEVICE_BATCH", 8)},
    2: {"ZERO": "0", "LIKELIHOOD_TERM": Env("LIKELIHOOD_TERM", "1"), "LIKELIHOOD_NORM": Env("LIKELIHOOD_NORM", "mean"),
        "LIKELIHOOD_SCALE": Env("LIKELIHOOD_SCALE", "45"), "GLOBAL_BATCH": 16, "MAX_EVAL_SAMPLES": "256",
        "PER_DEVICE": Env("PER_DEVICE_BATCH", 8)},  # LR / EPOCHS follow the likelihood term: _tiny_reward_model
    3: {"ZERO": "0", "WHITEN_ADVANTAGES": Env("WHITEN_ADVANTAGES", "1"), "PPO_BATCH": 16, "EPOCHS": "1",
        "MAX_STEPS": "60", "ACTOR_LR": "1e-4", "CRITIC_LR": "1e-4", "KL_CTL": Env("KL_CTL", "0.5"),
        "WARMUP_STEPS": "3", "MAX_EVAL_SAMPLES": "256", "PRINT_INTERVAL": "10", "CLIP_REWARD": "100",
        "TRAIN_PER_DEVICE": Env("PER_DEVICE_TRAIN_BATCH", 16)},
}

# --size -> the scripts' family/size: their recipes (the values each run_<size>.sh sets before run_step)
RECIPES = {
    "tiny": {"kind": "tiny", "model": "", "eos": "", "ranks": 1, "steps": TINY_STEPS, "outputs": "tiny"},
    # run_tiny_2ranks.sh: run_tiny.sh on two ranks under ZeRO-2, 8 experiences per rank per PPO micro-batch
    "tiny-2ranks": {"kind": "tiny", "model": "", "eos": "", "ranks": 2, "outputs": "tiny_2ranks",
                    "steps": {1: {**TINY_STEPS[1], "ZERO": "2"}, 2: {**TINY_STEPS[2], "ZERO": "2"},
                              3: {**TINY_STEPS[3], "ZERO": "2", "TRAIN_PER_DEVICE": Env("PER_DEVICE_TRAIN_BATCH", 8)}}},
    "gemma-2b": _hub("google/gemma-2b", GEMMA_EOS, {
        1: {"ZERO": "2", "GLOBAL_BATCH": by_task(tldr=512, hh=512, webgpt=64),
            "LR": by_task(tldr="5e-5", hh="5e-5", webgpt="1e-4"), "EPOCHS": "3",
            "PER_DEVICE": Env("PER_DEVICE_BATCH", 8)},
        2: {"ZERO": "2", "GLOBAL_BATCH": by_task(tldr=64, hh=64, webgpt=32), "EPOCHS": "1",
            "LR": by_task(tldr="1e-5", hh="1e-5", webgpt="2e-5"), "PER_DEVICE": Env("PER_DEVICE_BATCH", 4)},
        3: {"ZERO": "2", "CRITIC_ZERO": "3", "PPO_BATCH": 256, "EPOCHS": by_task(tldr="1", hh="1", webgpt="4"),
            "ACTOR_LR": "1.5e-5", "CRITIC_LR": "1.5e-5", "KL_CTL": Env("KL_CTL", "0.05"), "WARMUP_STEPS": "200",
            "TRAIN_PER_DEVICE": Env("PER_DEVICE_TRAIN_BATCH", 8)}}),
    "gemma-7b": _hub("google/gemma-7b", GEMMA_EOS, {
        1: {"ZERO": "3", "GLOBAL_BATCH": 128, "EPOCHS": by_task(tldr="1", hh="1", webgpt="5"), "LR": "2e-5",
            "PER_DEVICE": Env("PER_DEVICE_BATCH", 4), "GRADIENT_CHECKPOINTING": 1},
        2: {"ZERO": "3", "GLOBAL_BATCH": by_task(tldr=128, hh=64, webgpt=32), "EPOCHS": "1", "LR": "1e-6",
            "PER_DEVICE": Env("PER_DEVICE_BATCH", 4), "GRADIENT_CHECKPOINTING": 1},
        3: {"ZERO": "3", "CRITIC_ZERO": "3", "PPO_BATCH": 256, "EPOCHS": by_task(tldr="1", hh="1", webgpt="4"),
            "ACTOR_LR": "1e-6", "CRITIC_LR": "1e-6",
            "KL_CTL": Env("KL_CTL", by_task(tldr="0.05", hh="0.05", webgpt="0.1")),
            "WARMUP_STEPS": "200", "TRAIN_PER_DEVICE": Env("PER_DEVICE_TRAIN_BATCH", 4), "GRADIENT_CHECKPOINTING": 1}}),
    "gemma2-27b": _hub("google/gemma-2-27b", GEMMA_EOS, {
        1: {"ZERO": "3", "GLOBAL_BATCH": 128, "EPOCHS": "3", "LR": "5e-6", "PER_DEVICE": Env("PER_DEVICE_BATCH", 2),
            "GRADIENT_CHECKPOINTING": 1, "OFFLOAD": 1},
        2: {"ZERO": "3", "GLOBAL_BATCH": 128, "EPOCHS": "1", "LR": "8e-6", "PER_DEVICE": Env("PER_DEVICE_BATCH", 2),
            "GRADIENT_CHECKPOINTING": 1, "OFFLOAD": 1},
        3: {"ZERO": "3", "CRITIC_ZERO": "3", "PPO_BATCH": 256, "EPOCHS": "1", "ACTOR_LR": "7e-7", "CRITIC_LR": "1e-6",
            "KL_CTL": Env("KL_CTL", "0.1"), "WARMUP_STEPS": "0", "TRAIN_PER_DEVICE": Env("PER_DEVICE_TRAIN_BATCH", 2),
            "GRADIENT_CHECKPOINTING": 1, "OFFLOAD": 1}}),
    "llama3.2-3b": _hub("meta-llama/Llama-3.2-3B", LLAMA_EOS, {
        1: {"ZERO": "2", "GLOBAL_BATCH": by_task(tldr=512, hh=512, webgpt=64),
            "LR": by_task(tldr="5e-5", hh="5e-5", webgpt="1e-4"), "EPOCHS": "3",
            "PER_DEVICE": Env("PER_DEVICE_BATCH", 8)},
        2: {"ZERO": "2", "GLOBAL_BATCH": by_task(tldr=64, hh=64, webgpt=32), "EPOCHS": "1",
            "LR": by_task(tldr="1e-5", hh="1e-5", webgpt="2e-5"), "PER_DEVICE": Env("PER_DEVICE_BATCH", 4)},
        3: {"ZERO": "2", "CRITIC_ZERO": "3", "PPO_BATCH": 256, "EPOCHS": by_task(tldr="1", hh="1", webgpt="4"),
            "ACTOR_LR": "5e-6", "CRITIC_LR": "1e-5", "KL_CTL": Env("KL_CTL", "0.1"), "WARMUP_STEPS": "200",
            "TRAIN_PER_DEVICE": Env("PER_DEVICE_TRAIN_BATCH", 8)}}),
}
# CodeGemma on APPS (B.2, B.5): no step 2; step 3 rewards programs by their tests, its critic starts from the actor
_CODE_STEP3 = {"CRITIC_ZERO": "3", "NGRAM": Env("NGRAM", "10"), "PPO_BATCH": 16, "EPOCHS": "1", "ACTOR_LR": "5e-7",
               "CRITIC_LR": "5e-5", "KL_CTL": Env("KL_CTL", "0.05"), "WARMUP_STEPS": "20", "TEMPERATURE": "1.0",
               "TOP_K": "5", "PRINT_INTERVAL": "20", "TRAIN_PER_DEVICE": Env("PER_DEVICE_TRAIN_BATCH", 2)}
RECIPES["codegemma-2b"] = {"kind": "code", "model": "google/codegemma-2b", "eos": GEMMA_EOS, "steps": {
    1: {"ZERO": "2", "GLOBAL_BATCH": 16, "EPOCHS": "1", "LR": "5e-6", "WARMUP_RATIO": "0.0",
        "PER_DEVICE": Env("PER_DEVICE_BATCH", 2)},
    3: {"ZERO": "2", **_CODE_STEP3}}}
RECIPES["codegemma-7b"] = {"kind": "code", "model": "google/codegemma-7b-it", "eos": GEMMA_EOS, "steps": {
    1: {"ZERO": "3", "GLOBAL_BATCH": 32, "EPOCHS": "1", "LR": "2e-6", "WARMUP_RATIO": "0.0",
        "PER_DEVICE": Env("PER_DEVICE_BATCH", 2), "GRADIENT_CHECKPOINTING": 1},
    3: {"ZERO": "3", **_CODE_STEP3, "GRADIENT_CHECKPOINTING": 1}}}


@dataclasses.dataclass(frozen=True)
class StepLaunch:
    """One step as its launch script would start it: the entry point, its flags (EXTRA_ARGS last, so they win),
    the ranks per node (``num_gpus``), the world size, and the launcher's own settings."""

    step: int
    module: str  # marlhf.cli.<module>
    flags: list[str]
    num_gpus: int
    world: int
    device: str  # what one rank is: "GPU", or "rank" (the tiny scripts' CPU ranks over gloo)
    num_gpus_given: bool  # NUM_GPUS came from the environment (the user asked for that many ranks)
    master_port: str
    hostfile: str
    num_nodes: int
    launcher_args: list[str]
    launcher: str  # auto | deepspeed (LAUNCHER)
    log_file: Path

    @property
    def direct(self) -> bool:
        """LAUNCHER=auto on one local process: the entry point itself, without the runner's two extra processes."""
        return self.launcher == "auto" and self.world == 1 and not self.hostfile and not self.launcher_args

    def command(self, python: str = sys.executable) -> list[str]:
        """The command line: ``python -u -m marlhf MODULE ...`` for one local rank, else the ``deepspeed`` runner
        installed beside ``python`` (not whichever is first on PATH) with ``--module marlhf.cli.MODULE``."""
        if self.direct:
            return [python, "-u", "-m", "marlhf", self.module, *self.flags]
        launch = [str(deepspeed_launcher(python)), "--num_gpus", str(self.num_gpus), "--master_port", self.master_port]
        if self.hostfile:
            launch += ["--hostfile", self.hostfile, "--num_nodes", str(self.num_nodes)]
        return [*launch, *self.launcher_args, "--module", f"marlhf.cli.{self.module}", *self.flags]


def deepspeed_launcher(python: str = sys.executable) -> Path:
    """The ``deepspeed`` runner of the environment ``python`` belongs to (a venv's bin/ need not be on PATH)."""
    return Path(python).parent / "deepspeed"


def sizes() -> list[str]:
    return sorted(RECIPES)


def has_step(size: str, step: int) -> bool:
    return step in RECIPES[size]["steps"]


def _value(raw, env: Mapping[str, str], task: str):
    if isinstance(raw, Env):
        raw = raw.read(env)
    if isinstance(raw, tuple) and raw and raw[0] == "by_task":
        if task not in raw[1]:
            raise ConfigError(f"no value for TASK={task} among: {' '.join(f'{k}={v}' for k, v in raw[1].items())}")
        raw = raw[1][task]
    return raw


def _int(name: str, value) -> int:
    text = str(value)
    if not text.lstrip("-").isdigit():
        raise ConfigError(f"{name} must be an integer (got '{text}')")
    return int(text)


def _task(kind: str, env: Mapping[str, str], size: str) -> dict:
    """The task's launch values (``text_task`` / ``code_task`` / ``tiny_task`` of launch_common.sh)."""
    if kind == "text":
        name = env.get("TASK") or "tldr"
        if name not in TEXT_TASKS:
            raise ConfigError(f"TASK must be tldr, hh or webgpt for --size {size} (got '{name}')")
    elif kind == "code":
        name = env.get("TASK") or "apps"
        if name != "apps":
            raise ConfigError(f"TASK must be apps for CodeGemma (got '{name}')")
    else:
        name = env.get("TASK") or "synthetic"
        if name != "synthetic":
            raise ConfigError(f"tiny scripts run the synthetic task, not TASK={name}; set DATA_PATH instead")
    task = load_task(name)
    return {"TASK": name, "TASK_NAME": task.name, "DATASET": task.launch["data_path"],
            "DATA_SPLIT": task.launch["data_split"], "PROMPT_LEN": int(task.launch["max_prompt_seq_len"]),
            "ANSWER_LEN": int(task.launch["max_answer_seq_len"])}


def step_launch(size: str, step: int, output: str | Path, zero_stage: str | None = None,
                env: Mapping[str, str] | None = None) -> StepLaunch:
    """Step ``step`` of size ``size`` as ``bash run_<size>.sh OUTPUT [ZERO_STAGE]`` would launch it under the
    environment ``env`` (default: none): the same flags, ranks and launcher settings; a setting the script refuses
    raises :class:`ConfigError` with the script's message."""
    env = dict(env or {})
    recipe = RECIPES[size]
    if step not in recipe["steps"]:
        raise ConfigError(f"--size {size} has no step {step}")
    spec = recipe["steps"][step]
    v = dict(COMMON)
    v.update(_task(recipe["kind"], env, size))
    task = v["TASK"]
    if recipe["kind"] != "text":
        v.update(DTYPE="fp32" if recipe["kind"] == "tiny" else v["DTYPE"],
                 DEVICE="rank" if recipe["kind"] == "tiny" else "GPU")
    v["EOS_TOKEN"] = recipe["eos"]
    if "ranks" in recipe:
        v["NUM_GPUS"] = str(recipe["ranks"])
    for name, raw in spec.items():
        v[name] = _value(raw, env, task)
    if step == 2 and recipe["kind"] == "tiny":  # run_tiny.sh: with the likelihood term a gentler rate, one epoch
        v["LR"], v["EPOCHS"] = ("1e-4", "1") if _int("LIKELIHOOD_TERM", v["LIKELIHOOD_TERM"]) else ("5e-4", "2")
    zero = zero_stage or v["ZERO"]
    # the models: an empty path means the embedded tiny model (tiny scripts); a hub size defaults to the steps'
    # default outputs
    prefix = f"./output/{recipe.get('outputs', size)}" + ("" if recipe["kind"] == "tiny" else
                                                          f"/{'apps' if recipe['kind'] == 'code' else task}")
    if step == 1:
        model = env.get("MODEL_PATH") or recipe["model"]
    elif step == 2:
        model = Env("MODEL_PATH", f"{prefix}/step1", keep_empty=recipe["kind"] == "tiny").read(env)
    else:
        actor = Env("ACTOR_MODEL_PATH", f"{prefix}/step1", keep_empty=recipe["kind"] == "tiny").read(env)
        critic = Env("CRITIC_MODEL_PATH", actor if recipe["kind"] == "code" else f"{prefix}/step2",
                     keep_empty=recipe["kind"] == "tiny").read(env)
    # resolve_world
    num_gpus_given = bool(env.get("NUM_GPUS"))
    num_gpus = _int("NUM_GPUS", env.get("NUM_GPUS") or v["NUM_GPUS"])
    hostfile = env.get("HOSTFILE", "")
    if hostfile and not Path(hostfile).is_file():
        raise ConfigError(f"HOSTFILE '{hostfile}' not found")
    if env.get("NUM_NODES"):
        nodes = _int("NUM_NODES", env["NUM_NODES"])
    elif hostfile:
        nodes = sum(1 for line in Path(hostfile).read_text().splitlines()
                    if line.strip() and not line.strip().startswith("#"))
    else:
        nodes = 1
    world = num_gpus * nodes
    device = v["DEVICE"]
    data_path = (env.get("DATA_PATH") or v["DATASET"]).split()
    flags = []

    def data_flags():
        flags.extend(["--data_path", *data_path, "--task", v["TASK_NAME"], "--data_split", v["DATA_SPLIT"],
                      "--data_output_path", env.get("DATA_OUTPUT_PATH") or "/tmp/data_files"])
        if v["EOS_TOKEN"]:
            flags.extend(["--bad_rows", env.get("BAD_ROWS") or "skip", "--end_of_conversation_token", v["EOS_TOKEN"]])
        flags.extend(["--num_padding_at_beginning", "0"])

    if step in (1, 2):
        batch, micro = _int("GLOBAL_BATCH", v["GLOBAL_BATCH"]), _int("PER_DEVICE_BATCH", v["PER_DEVICE"])
        if not (world > 0 and micro > 0 and batch % (micro * world) == 0):
            raise ConfigError(f"global batch {batch} is not a multiple of PER_DEVICE_BATCH {micro} x {world} {device}s")
        accum = batch // (micro * world)
        if model:
            flags.extend(["--model_name_or_path", model])
        data_flags()
        flags.extend(["--max_seq_len", str(v["PROMPT_LEN"] + v["ANSWER_LEN"])])
        if v["MAX_EVAL_SAMPLES"]:
            flags.extend(["--max_eval_samples", v["MAX_EVAL_SAMPLES"]])
        flags.extend(["--per_device_train_batch_size", str(micro), "--per_device_eval_batch_size", str(micro),
                      "--gradient_accumulation_steps", str(accum), "--learning_rate", v["LR"],
                      "--weight_decay", v["WEIGHT_DECAY"], "--num_train_epochs", v["EPOCHS"],
                      "--lr_scheduler_type", v["LR_SCHEDULE"], "--warmup_ratio", v["WARMUP_RATIO"],
                      "--zero_stage", zero, "--group_by_length"])
        if int(v["OFFLOAD"]):
            flags.append("--offload")
        if int(v["GRADIENT_CHECKPOINTING"]):
            flags.append("--gradient_checkpointing")
        flags.extend(["--dtype", v["DTYPE"], "--deepspeed", "--output_dir", str(output)])
        if step == 2 and _int("LIKELIHOOD_TERM", v["LIKELIHOOD_TERM"]):
            flags.extend(["--likelihood_term", "--likelihood_norm", v["LIKELIHOOD_NORM"],
                          "--likelihood_scale", v["LIKELIHOOD_SCALE"]])
    else:
        _ppo_flags(flags, v, env, world, device, actor, critic, data_flags, output, zero,
                   zero_stage or v.get("CRITIC_ZERO") or zero, recipe["kind"])
    flags.extend((env.get("EXTRA_ARGS") or "").split())
    launcher = env.get("LAUNCHER") or "auto"
    if launcher not in ("auto", "deepspeed"):
        raise ConfigError(f"LAUNCHER must be auto or deepspeed (got '{launcher}')")
    return StepLaunch(step=step, module=STEP_MODULES[step], flags=flags, num_gpus=num_gpus, world=world,
                      device=device, num_gpus_given=num_gpus_given, master_port=env.get("MASTER_PORT") or "29500",
                      hostfile=hostfile, num_nodes=nodes, launcher_args=(env.get("LAUNCHER_ARGS") or "").split(),
                      launcher=launcher, log_file=Path(env.get("LOG_FILE") or Path(output) / "training.log"))


def _ppo_flags(flags: list[str], v: dict, env: Mapping[str, str], world: int, device: str, actor: str, critic: str,
               data_flags, output, actor_zero: str, critic_zero: str, kind: str) -> None:
    """Step 3's flags (``ppo_batches`` and ``ppo_flags`` of launch_common.sh), appended to ``flags``."""
    k = _int("SAMPLES_PER_PROMPT", v["SAMPLES_PER_PROMPT"])
    batch, chunks = _int("PPO_BATCH", v["PPO_BATCH"]), _int("GENERATION_BATCHES", env.get("GENERATION_BATCHES") or 1)
    micro = _int("PER_DEVICE_TRAIN_BATCH", v["TRAIN_PER_DEVICE"])
    if not (world > 0 and chunks > 0 and batch % (world * chunks * k) == 0):
        raise ConfigError(f"PPO batch {batch} is not a multiple of {world} {device}s x GENERATION_BATCHES {chunks} "
                          f"x {k} answers per prompt")
    per_device = batch // (world * chunks * k)
    if micro <= 0 or per_device * k % micro:
        raise ConfigError(f"{per_device * k} answers per {device}: not a multiple of PER_DEVICE_TRAIN_BATCH {micro}")
    accum = per_device * k * chunks // micro
    task_args = []
    if kind == "code":  # code_reward: the program tests (B.5), or a code reward model
        source = env.get("REWARD_SOURCE") or "program_tests"
        if source == "program_tests":
            workers = env.get("REWARD_WORKERS") or "1"
            if not (workers.isdigit() and int(workers) > 0):
                raise ConfigError(f"REWARD_WORKERS must be a positive integer (got '{workers}')")
            task_args = ["--response_kind", "code", "--reward_source", "program_tests", "--reward_workers", workers]
        elif source == "reward_model":
            path = env.get("REWARD_MODEL_PATH") or ""
            if not path:
                raise ConfigError("REWARD_SOURCE=reward_model needs REWARD_MODEL_PATH")
            task_args = ["--response_kind", "code", "--reward_source", "reward_model",
                         "--reward_model_name_or_path", path]
        else:
            raise ConfigError(f"REWARD_SOURCE must be program_tests or reward_model (got '{source}')")
    if actor:
        flags.extend(["--actor_model_name_or_path", actor])
    if critic:
        flags.extend(["--critic_model_name_or_path", critic])
    data_flags()
    flags.extend(["--max_prompt_seq_len", str(v["PROMPT_LEN"]), "--max_answer_seq_len", str(v["ANSWER_LEN"])])
    if v["MAX_EVAL_SAMPLES"]:
        flags.extend(["--max_eval_samples", v["MAX_EVAL_SAMPLES"]])
    flags.extend(["--per_device_generation_batch_size", str(per_device), "--generation_batches", str(chunks),
                  "--per_device_training_batch_size", str(micro), "--gradient_accumulation_steps", str(accum),
                  "--ppo_epochs", "1", "--num_train_epochs", v["EPOCHS"]])
    if v["MAX_STEPS"]:
        flags.extend(["--max_steps", v["MAX_STEPS"]])
    flags.extend(["--actor_learning_rate", v["ACTOR_LR"], "--critic_learning_rate", v["CRITIC_LR"],
                  "--actor_weight_decay", "0.0", "--critic_weight_decay", "0.0",
                  "--lr_scheduler_type", v["LR_SCHEDULE"], "--num_warmup_steps", v["WARMUP_STEPS"],
                  "--kl_ctl", str(v["KL_CTL"]), "--cliprange", "0.2", "--cliprange_value", "0.2", "--gamma", "1.0",
                  "--lam", "0.95", "--temperature", v["TEMPERATURE"], "--top_k", v["TOP_K"], "--top_p", "1.0",
                  "--termination_condition", env.get("TERMINATION") or "fixed",
                  "--ngram", str(v.get("NGRAM") or env.get("NGRAM") or "5"), "--value_function", "equal",
                  *task_args])
    if v["ADV_ESTIMATOR"]:
        flags.extend(["--advantage_estimator", v["ADV_ESTIMATOR"]])
    if _int("WHITEN_ADVANTAGES", v["WHITEN_ADVANTAGES"]):
        flags.append("--whiten_advantages")
    if v["CLIP_REWARD"]:
        flags.extend(["--clip_reward_value", v["CLIP_REWARD"]])
    if k > 1:
        flags.extend(["--num_samples_per_prompt", str(k)])
    flags.extend(["--actor_zero_stage", actor_zero, "--critic_zero_stage", critic_zero])
    if int(v["OFFLOAD"]):  # a model that needs parameter offload: ZeRO-3 layers fetched per token
        flags.extend(["--offload", "--offload_reference_model", "--zero3_generation", "synced"])
    if int(v["GRADIENT_CHECKPOINTING"]):
        flags.extend(["--actor_gradient_checkpointing", "--critic_gradient_checkpointing"])
    flags.extend(["--actor_dropout", "0.0", "--critic_dropout", "0.0", "--dtype", v["DTYPE"], "--print_answers",
                  "--print_answers_interval", v["PRINT_INTERVAL"], "--deepspeed", "--output_dir", str(output)])
