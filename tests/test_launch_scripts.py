"""The bash launch scripts (``training/step*/training_scripts``, ``training/multi_node``) kept honest.

Nothing trains here: each script runs with a fake ``deepspeed`` first on PATH that records its arguments.
The flags a script hands to ``main.py`` are then parsed by that stage's real parser (``marlhf.config``),
so a misspelt or removed flag fails here, and the values are checked against the paper's Table 5
(MA-RLHF, Appendix B.2) and C.4 (Llama-3.2-3B), copied below from the paper, not from the scripts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from conftest import PATH_FLAGS, QUICKSTART_SFT_ENV, QUICKSTART_SFT_SPLIT

from marlhf.config import BaseArgs, DPOArgs, RewardArgs, RLHFArgs, SFTArgs, build_parser

REPO = Path(__file__).resolve().parents[1]
TRAINING = REPO / "training"
STEP_DIRS = {1: "step1_supervised_finetuning", 2: "step2_reward_model_finetuning", 3: "step3_rlhf_finetuning",
             "dpo": "step2_dpo_finetuning"}  # DPO: step 2's alternative (App. C.3)
STAGE_ARGS: dict[int | str, type[BaseArgs]] = {1: SFTArgs, 2: RewardArgs, 3: RLHFArgs, "dpo": DPOArgs}
MULTI_NODE = TRAINING / "multi_node" / "run_gemma_7b_2nodes.sh"
HOSTFILE_EXAMPLE = TRAINING / "multi_node" / "hostfile.example"
COMMON = TRAINING / "launch_common.sh"  # sourced by every script: the shared launch machinery
GPUS_PER_NODE = 8  # the scripts' assumption for the GPU sizes (Table 5's batches are global)

STEP_SCRIPTS = sorted(TRAINING.glob("step*/training_scripts/*/*.sh"))
SCRIPTS = [*STEP_SCRIPTS, MULTI_NODE]
DATASETS = {"tldr": "openai/summarize_from_feedback", "hh": "Dahoas/full-hh-rlhf",
            "webgpt": "openai/webgpt_comparisons", "apps": "codeparrot/apps"}
TEXT_TASKS = ("tldr", "hh", "webgpt")

# The fake launcher: arguments NUL-separated into $FAKE_DS_ARGS, one line of output, chosen exit status.
FAKE_DEEPSPEED = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$FAKE_DS_ARGS"
echo "fake deepspeed: $# arguments"
exit "${FAKE_DS_EXIT:-0}"
"""

# The fake `python` of LAUNCHER=auto's direct launch: its arguments and the variables main.py would see.
# the fake python stands in for main.py only: the launch scripts' task lookup runs the real one
FAKE_PYTHON = """#!/usr/bin/env bash
if [[ "$1" == -m && "$2" == marlhf.tasks ]]; then exec """ + shlex.quote(sys.executable) + """ "$@"; fi
# the hub check before the launch: its own test (test_unavailable_model_stops_before_the_launch) runs the real one
if [[ "$1" == -m && "$2" == marlhf.preflight ]]; then
    if [[ -n "${REAL_PREFLIGHT:-}" ]]; then exec """ + shlex.quote(sys.executable) + """ "$@"; fi
    exit 0
fi
printf '%s\\0' "$@" > "$FAKE_PY_ARGS"
printf 'PYTHONPATH=%s\\nMASTER_PORT=%s\\n' "${PYTHONPATH:-}" "${MASTER_PORT:-unset}" > "$FAKE_PY_ARGS.env"
echo "fake python: $# arguments"
exit "${FAKE_PY_EXIT:-0}"
"""


# A machine of FAKE_GPUS GPUs for the scripts' GPU count (check_gpus): by default enough for every NUM_GPUS here.
FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
for ((i = 0; i < ${FAKE_GPUS:-64}; i++)); do echo "GPU $i: Fake GPU (UUID: GPU-$i)"; done
"""


def fake_bin(tmp_path: Path) -> Path:
    """tmp_path/fakebin with the fake launcher, python and nvidia-smi in it.  The python is there for the runner:
    the scripts start the ``deepspeed`` beside the python they run."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in {"deepspeed": FAKE_DEEPSPEED, "python": FAKE_PYTHON, "nvidia-smi": FAKE_NVIDIA_SMI}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def script(step: int, rel: str) -> Path:
    return TRAINING / STEP_DIRS[step] / "training_scripts" / rel


@dataclasses.dataclass
class Launch:
    """One run of a launch script under the fake launcher."""

    returncode: int
    stdout: str
    stderr: str
    argv: list[str] | None  # what `deepspeed` received; None when it was never called

    @property
    def main_index(self) -> int:
        return next(i for i, a in enumerate(self.argv) if a.endswith("/main.py"))

    @property
    def launcher(self) -> list[str]:
        return self.argv[: self.main_index]

    @property
    def main(self) -> Path:
        return Path(self.argv[self.main_index])

    @property
    def flags(self) -> list[str]:
        return self.argv[self.main_index + 1:]

    def launcher_value(self, flag: str) -> str:
        return self.launcher[self.launcher.index(flag) + 1]


def run(path: Path, tmp_path: Path, *args: str, **env: str) -> Launch:
    """Run ``bash path args`` in tmp_path with a clean environment plus ``env`` and the fake launcher.

    LAUNCHER=deepspeed unless ``env`` says otherwise, so that one-rank scripts are recorded as the runner's
    command line too (the direct one-rank launch of LAUNCHER=auto: test_one_local_rank_starts_main_directly)."""
    bin_dir = fake_bin(tmp_path)
    record = tmp_path / "deepspeed_args"
    record.unlink(missing_ok=True)
    full_env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path),
                "FAKE_DS_ARGS": str(record), "LAUNCHER": "deepspeed", **env}
    proc = subprocess.run(["bash", str(path), *args], cwd=tmp_path, env=full_env, capture_output=True,
                          text=True, timeout=60)
    argv = record.read_bytes().decode().split("\0")[:-1] if record.exists() else None
    return Launch(proc.returncode, proc.stdout, proc.stderr, argv)


def launch_ok(path: Path, tmp_path: Path, *args: str, **env: str) -> Launch:
    out = run(path, tmp_path, *args, **env)
    assert out.returncode == 0 and out.argv is not None, f"{path} failed ({out.returncode}):\n{out.stderr}"
    return out


@cache
def parser_for(step: int):
    return build_parser(STAGE_ARGS[step])


def parse(step: int, flags: list[str], where: str):
    """The stage config ``main.py`` would build from ``flags``: unknown flags and bad values fail by name."""
    parser = parser_for(step)
    _, unknown = parser.parse_known_args(flags)
    if unknown:
        pytest.fail(f"{where}: flags unknown to {STAGE_ARGS[step].__name__}: {unknown}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(flags)
    except SystemExit:
        pytest.fail(f"{where}: {STAGE_ARGS[step].__name__} rejects the flags: {err.getvalue().strip()}")
    cfg = STAGE_ARGS[step](**{f.name: getattr(ns, f.name) for f in dataclasses.fields(STAGE_ARGS[step])})
    cfg.validate()
    return cfg


def step_of(path: Path) -> int:
    if path == MULTI_NODE:
        return 1
    return next(k for k, d in STEP_DIRS.items() if d in path.parts)


def default_env(path: Path) -> dict[str, str]:
    """What a script needs before it launches anything (everything else has a default)."""
    if path == MULTI_NODE:
        return {"HOSTFILE": str(HOSTFILE_EXAMPLE)}
    return {}


def launch_and_parse(path: Path, tmp_path: Path, *args: str, **env: str):
    out = launch_ok(path, tmp_path, *args, **{**default_env(path), **env})
    step = step_of(path)
    assert out.main == TRAINING / STEP_DIRS[step] / "main.py"
    return out, parse(step, out.flags, f"{path.relative_to(REPO)} {env}")


def sft_batch(cfg, gpus: int = GPUS_PER_NODE) -> int:
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * gpus


# ------------------------------------------------------------------------------------------- every script
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(TRAINING)))
def test_script_is_strict_executable_bash(path):
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert os.access(path, os.X_OK), f"{path} is not executable"


def test_shellcheck_clean():
    assert shutil.which("shellcheck"), "shellcheck is missing: pip install -r requirements-dev.txt"
    proc = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(TRAINING)))
def test_script_flags_parse_and_log(path, tmp_path):
    out_dir = tmp_path / "run"
    out, cfg = launch_and_parse(path, tmp_path, str(out_dir), EXTRA_ARGS="--seed 77 --max_steps 7")
    # DeepSpeed-Chat's launch shape: deepspeed [--num_gpus N --master_port P ...] main.py --deepspeed ...
    assert out.launcher[:2] == ["--num_gpus", out.launcher_value("--num_gpus")]
    assert out.launcher_value("--master_port") == "29500"
    assert "--deepspeed" in out.flags
    assert cfg.output_dir == str(out_dir)
    # EXTRA_ARGS is appended verbatim, last, so its flags win
    assert out.flags[-4:] == ["--seed", "77", "--max_steps", "7"]
    assert (cfg.seed, cfg.max_steps) == (77, 7)
    # the launcher's output reaches the terminal and $OUTPUT/training.log
    log = out_dir / "training.log"
    assert log.read_text() == out.stdout and "fake deepspeed" in out.stdout


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(TRAINING)))
def test_launcher_failure_is_the_script_exit_status(path, tmp_path):
    out = run(path, tmp_path, str(tmp_path / "run"), FAKE_DS_EXIT="7", **default_env(path))
    assert out.returncode == 7  # pipefail: tee does not hide the launcher's failure
    assert "fake deepspeed" in (tmp_path / "run" / "training.log").read_text()


@pytest.mark.parametrize("path", STEP_SCRIPTS, ids=lambda p: str(p.relative_to(TRAINING)))
def test_machine_overrides(path, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode-a slots=8\n\nnode-b slots=8\n")
    out, cfg = launch_and_parse(path, tmp_path, "out", DATA_PATH="my/data:/data/x other.jsonl",
                                DATA_OUTPUT_PATH="/cache/tok", MASTER_PORT="29777", HOSTFILE=str(hostfile),
                                LAUNCHER_ARGS="--no_ssh_check", LOG_FILE=str(tmp_path / "logs" / "x.log"),
                                NUM_GPUS="2", PER_DEVICE_BATCH="1", PER_DEVICE_TRAIN_BATCH="1")
    assert cfg.data_path == ["my/data:/data/x", "other.jsonl"]
    assert cfg.data_output_path == "/cache/tok"
    assert out.launcher_value("--master_port") == "29777"
    assert out.launcher_value("--hostfile") == str(hostfile)
    assert out.launcher_value("--num_nodes") == "2"  # hosts counted from the hostfile
    assert out.launcher_value("--num_gpus") == "2"
    assert "--no_ssh_check" in out.launcher
    assert "fake deepspeed" in (tmp_path / "logs" / "x.log").read_text()


def test_common_file_is_clean_sourced_bash():
    assert subprocess.run(["bash", "-n", str(COMMON)], capture_output=True).returncode == 0
    proc = subprocess.run(["shellcheck", str(COMMON)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    for path in STEP_SCRIPTS:  # each script either sources it or delegates to its run_tiny.sh sibling
        text = path.read_text()
        assert "/../../../launch_common.sh" in text or "/run_tiny.sh" in text, path


@pytest.mark.parametrize("step", [1, 2, 3, "dpo"])
def test_script_knobs_are_not_environment_overrides(step, tmp_path):
    """What a size script sets (DTYPE, OFFLOAD, LR, ...) cannot be changed by a stray exported variable."""
    knobs = ["DTYPE", "OFFLOAD", "GRADIENT_CHECKPOINTING", "EOS_TOKEN", "WARMUP_RATIO", "MAX_EVAL_SAMPLES",
             "MAX_STEPS", "DATA_SPLIT", "DATASET", "PROMPT_LEN", "ANSWER_LEN", "OUTPUT", "EPOCHS",
             "GLOBAL_BATCH", "LR", "PER_DEVICE", "ZERO_STAGE", "PPO_BATCH", "ACTOR_LR", "CRITIC_LR",
             "WARMUP_STEPS", "TRAIN_PER_DEVICE", "TEMPERATURE", "TOP_K", "PRINT_INTERVAL", "GRAD_ACCUM",
             "GEN_PER_DEVICE", "WORLD", "FLAGS", "DEVICE", "ACTOR_ZERO_STAGE", "CRITIC_ZERO_STAGE", "BETA",
             "ADV_ESTIMATOR", "SAMPLES_PER_PROMPT", "WHITEN_ADVANTAGES", "CLIP_REWARD"]
    for rel in ("gemma/run_7b.sh", "tiny/run_tiny.sh"):
        _, clean = launch_and_parse(script(step, rel), tmp_path)
        _, noisy = launch_and_parse(script(step, rel), tmp_path, **dict.fromkeys(knobs, "1"))
        assert noisy == clean, rel


def test_scripts_run_from_any_cwd_by_relative_path(tmp_path):
    # the common file is found next to the script, not the caller: a relative path from elsewhere works
    for path in (script(1, "tiny/run_tiny_2ranks.sh"), script(3, "gemma/run_2b.sh"), MULTI_NODE):
        rel = Path(os.path.relpath(path, tmp_path))
        out = run(rel, tmp_path, str(tmp_path / "out"), **default_env(path))
        assert out.returncode == 0 and out.main == TRAINING / STEP_DIRS[step_of(path)] / "main.py", out.stderr


def test_every_family_and_size_exists():
    names = {str(p.relative_to(TRAINING)) for p in SCRIPTS}
    common = ["tiny/run_tiny.sh", "tiny/run_tiny_2ranks.sh", "gemma/run_2b.sh", "gemma/run_7b.sh",
              "gemma2/run_27b.sh", "llama3.2/run_3b.sh"]
    code = ["codegemma/run_2b.sh", "codegemma/run_7b.sh"]
    for step, rels in ((1, common + code), (2, common), (3, common + code), ("dpo", common)):
        for rel in rels:
            assert f"{STEP_DIRS[step]}/training_scripts/{rel}" in names
    # the code task has no reward model (B.2): no step-2 CodeGemma script
    assert not script(2, "codegemma").exists() and not script("dpo", "codegemma").exists()


# -------------------------------------------------------------------------------------- Table 5: step 1
# (script, task) -> global batch, epochs, lr, warmup ratio
GEMMA_2B_SFT = {"tldr": (512, 3, 5e-5, 0.1), "hh": (512, 3, 5e-5, 0.1), "webgpt": (64, 3, 1e-4, 0.1)}
SFT_TABLE = {
    **{("gemma/run_2b.sh", t): GEMMA_2B_SFT[t] for t in TEXT_TASKS},
    **{("gemma/run_7b.sh", t): (128, 5 if t == "webgpt" else 1, 2e-5, 0.1) for t in TEXT_TASKS},
    **{("gemma2/run_27b.sh", t): (128, 3, 5e-6, 0.1) for t in TEXT_TASKS},
    ("codegemma/run_2b.sh", "apps"): (16, 1, 5e-6, 0.0),
    ("codegemma/run_7b.sh", "apps"): (32, 1, 2e-6, 0.0),
    # C.4: Llama-3.2-3B follows Gemma 2B wherever it names no value of its own
    **{("llama3.2/run_3b.sh", t): GEMMA_2B_SFT[t] for t in TEXT_TASKS},
}
MODELS = {"gemma/run_2b.sh": "google/gemma-2b", "gemma/run_7b.sh": "google/gemma-7b",
          "gemma2/run_27b.sh": "google/gemma-2-27b", "codegemma/run_2b.sh": "google/codegemma-2b",
          "codegemma/run_7b.sh": "google/codegemma-7b-it", "llama3.2/run_3b.sh": "meta-llama/Llama-3.2-3B"}
RUN_NAMES = {"gemma/run_2b.sh": "gemma-2b", "gemma/run_7b.sh": "gemma-7b", "gemma2/run_27b.sh": "gemma2-27b",
             "codegemma/run_2b.sh": "codegemma-2b", "codegemma/run_7b.sh": "codegemma-7b",
             "llama3.2/run_3b.sh": "llama3.2-3b"}  # default OUTPUT: ./output/<name>/<task>/step<k>
SIZE_B = {"gemma/run_2b.sh": 2, "gemma/run_7b.sh": 7, "gemma2/run_27b.sh": 27, "codegemma/run_2b.sh": 2,
          "codegemma/run_7b.sh": 7, "llama3.2/run_3b.sh": 3}


def check_memory_settings(rel: str, zero: int, offload: bool, checkpointing: bool) -> None:
    """ZeRO-2 below 7B, ZeRO-3 from 7B, CPU offload at 27B, gradient checkpointing from 7B."""
    size = SIZE_B[rel]
    assert zero == (2 if size < 7 else 3)
    assert offload == (size >= 27)
    assert checkpointing == (size >= 7)


@pytest.mark.parametrize(("rel", "task"), sorted(SFT_TABLE))
def test_sft_table5(rel, task, tmp_path):
    batch, epochs, lr, warmup = SFT_TABLE[rel, task]
    _, cfg = launch_and_parse(script(1, rel), tmp_path, TASK=task)
    assert sft_batch(cfg) == batch
    assert (cfg.num_train_epochs, cfg.learning_rate, cfg.warmup_ratio) == (epochs, lr, warmup)
    assert cfg.lr_scheduler_type == "cosine" and cfg.dtype == "bf16"
    assert cfg.model_name_or_path == MODELS[rel]
    assert cfg.data_path == [DATASETS[task]]
    # B.2: SFT 20%, RM 40%, PPO 40%; APPS has no RM share and gives PPO 80%
    assert cfg.data_split == ("2,0,8" if task == "apps" else "2,4,4")
    assert cfg.max_seq_len == (600 if task == "apps" else 512) + 512
    check_memory_settings(rel, cfg.zero_stage, cfg.offload, cfg.gradient_checkpointing)
    assert cfg.output_dir == f"./output/{RUN_NAMES[rel]}/{task}/step1"


def test_sft_global_batch_survives_other_gpu_counts(tmp_path):
    rel = "gemma/run_2b.sh"
    for gpus in (1, 2, 4, 16):
        out, cfg = launch_and_parse(script(1, rel), tmp_path, NUM_GPUS=str(gpus))
        assert out.launcher_value("--num_gpus") == str(gpus)
        assert sft_batch(cfg, gpus) == 512
    _, cfg = launch_and_parse(script(1, rel), tmp_path, PER_DEVICE_BATCH="2")
    assert (cfg.per_device_train_batch_size, sft_batch(cfg)) == (2, 512)
    bad = run(script(1, rel), tmp_path, NUM_GPUS="3")
    assert bad.returncode == 2 and bad.argv is None
    assert "not a multiple" in bad.stderr


def test_sft_model_path_override(tmp_path):
    _, cfg = launch_and_parse(script(1, "gemma/run_7b.sh"), tmp_path, MODEL_PATH="/models/g7")
    assert cfg.model_name_or_path == "/models/g7"


@pytest.mark.parametrize("step", [1, 2, 3, "dpo"])
def test_unknown_task_stops_before_launching(step, tmp_path):
    cases = (("gemma/run_2b.sh", "apps"), ("gemma/run_7b.sh", "summarize"), ("tiny/run_tiny.sh", "tldr"))
    for rel, task in cases:
        out = run(script(step, rel), tmp_path, TASK=task)
        assert out.returncode == 2 and out.argv is None, (rel, task)
        assert "TASK" in out.stderr
    if step in (1, 3):
        out = run(script(step, "codegemma/run_2b.sh"), tmp_path, TASK="tldr")
        assert out.returncode == 2 and "apps" in out.stderr


# -------------------------------------------------------------------------------------- Table 5: step 2
RM_TABLE = {
    **{("gemma/run_2b.sh", t): (32, 1, 2e-5) if t == "webgpt" else (64, 1, 1e-5) for t in TEXT_TASKS},
    ("gemma/run_7b.sh", "tldr"): (128, 1, 1e-6),
    ("gemma/run_7b.sh", "hh"): (64, 1, 1e-6),
    ("gemma/run_7b.sh", "webgpt"): (32, 1, 1e-6),
    **{("gemma2/run_27b.sh", t): (128, 1, 8e-6) for t in TEXT_TASKS},
    **{("llama3.2/run_3b.sh", t): (32, 1, 2e-5) if t == "webgpt" else (64, 1, 1e-5) for t in TEXT_TASKS},
}


@pytest.mark.parametrize(("rel", "task"), sorted(RM_TABLE))
def test_reward_model_table5(rel, task, tmp_path):
    batch, epochs, lr = RM_TABLE[rel, task]
    _, cfg = launch_and_parse(script(2, rel), tmp_path, TASK=task)
    assert sft_batch(cfg) == batch
    assert (cfg.num_train_epochs, cfg.learning_rate, cfg.warmup_ratio) == (epochs, lr, 0.1)
    assert cfg.lr_scheduler_type == "cosine" and cfg.dtype == "bf16"
    assert cfg.data_path == [DATASETS[task]] and cfg.data_split == "2,4,4"
    check_memory_settings(rel, cfg.zero_stage, cfg.offload, cfg.gradient_checkpointing)
    assert not cfg.likelihood_term  # the paper's reward model: the score head alone
    # B.2: the reward model starts from the SFT model -- by default step 1's default output of this script
    step1, _ = launch_and_parse(script(1, rel), tmp_path, TASK=task)
    assert cfg.model_name_or_path == parse(1, step1.flags, rel).output_dir


# -------------------------------------------------------------------------------------- Table 5: step 3
# (script, task) -> PPO batch, actor lr, critic lr, epochs, KL, warmup steps
PPO_EPOCHS = {"tldr": 1, "hh": 1, "webgpt": 4}  # Gemma 2B and 7B (and Llama-3.2 3B after Gemma 2B)
PPO_TABLE = {
    **{("gemma/run_2b.sh", t): (256, 1.5e-5, 1.5e-5, PPO_EPOCHS[t], 0.05, 200) for t in TEXT_TASKS},
    **{("gemma/run_7b.sh", t): (256, 1e-6, 1e-6, PPO_EPOCHS[t], 0.1 if t == "webgpt" else 0.05, 200)
       for t in TEXT_TASKS},
    **{("gemma2/run_27b.sh", t): (256, 7e-7, 1e-6, 1, 0.1, 0) for t in TEXT_TASKS},
    ("codegemma/run_2b.sh", "apps"): (16, 5e-7, 5e-5, 1, 0.05, 20),
    ("codegemma/run_7b.sh", "apps"): (16, 5e-7, 5e-5, 1, 0.05, 20),
    # C.4: actor lr 5e-6, critic lr 1e-5, KL 0.1; the rest as Gemma 2B
    **{("llama3.2/run_3b.sh", t): (256, 5e-6, 1e-5, PPO_EPOCHS[t], 0.1, 200) for t in TEXT_TASKS},
}


def ppo_batches(cfg, gpus: int = GPUS_PER_NODE) -> tuple[int, int]:
    """(prompts per PPO step, experiences per optimizer step) over all GPUs."""
    rollout = cfg.per_device_generation_batch_size * cfg.generation_batches * gpus
    return rollout, cfg.per_device_training_batch_size * cfg.gradient_accumulation_steps * gpus


@pytest.mark.parametrize(("rel", "task"), sorted(PPO_TABLE))
def test_ppo_table5(rel, task, tmp_path):
    batch, actor_lr, critic_lr, epochs, kl, warmup = PPO_TABLE[rel, task]
    _, cfg = launch_and_parse(script(3, rel), tmp_path, TASK=task)
    code = task == "apps"
    assert ppo_batches(cfg) == (batch, batch)  # one actor/critic optimizer step per PPO batch
    assert (cfg.actor_learning_rate, cfg.critic_learning_rate) == (actor_lr, critic_lr)
    assert (cfg.num_train_epochs, cfg.kl_ctl, cfg.num_warmup_steps) == (epochs, kl, warmup)
    assert not cfg.whiten_advantages and cfg.clip_reward_value == 5  # DeepSpeed-Chat's
    assert (cfg.ppo_epochs, cfg.generation_batches) == (1, 1)
    assert (cfg.cliprange, cfg.lam, cfg.gamma) == (0.2, 0.95, 1.0)
    assert (cfg.temperature, cfg.top_k, cfg.top_p) == ((1.0, 5, 1.0) if code else (0.8, 50, 1.0))
    assert (cfg.max_prompt_seq_len, cfg.max_answer_seq_len) == (600 if code else 512, 512)
    assert cfg.lr_scheduler_type == "cosine" and cfg.dtype == "bf16"
    assert cfg.data_path == [DATASETS[task]]
    assert cfg.data_split == ("2,0,8" if code else "2,4,4")
    # MA-PPO by default: fixed 5-grams (code: 10-grams, the released APPS "Fixed10" checkpoints)
    assert (cfg.termination_condition, cfg.ngram_n) == ("fixed", 10 if code else 5)
    size = SIZE_B[rel]
    assert cfg.actor_zero_stage == (2 if size < 7 else 3) and cfg.critic_zero_stage == 3
    assert cfg.offload == cfg.offload_reference_model == (size >= 27)
    assert cfg.actor_gradient_checkpointing == cfg.critic_gradient_checkpointing == (size >= 7)
    # the models of the earlier steps, by default their scripts' default outputs (code: SFT as critic too)
    sft = parse(1, launch_ok(script(1, rel), tmp_path, TASK=task).flags, rel).output_dir
    assert cfg.actor_model_name_or_path == sft
    if code:
        assert cfg.critic_model_name_or_path == sft and cfg.response_kind == "code"
        # the compiler-signal reward of B.5: no reward model
        assert (cfg.reward_source, cfg.reward_model_name_or_path, cfg.reward_workers) == ("program_tests", "", 1)
    else:
        rm = parse(2, launch_ok(script(2, rel), tmp_path, TASK=task).flags, rel).output_dir
        assert cfg.critic_model_name_or_path == rm and cfg.reward_source == "reward_model"


def test_ppo_overrides(tmp_path):
    rel = "gemma/run_7b.sh"
    # B.2: MA-PPO on TL;DR at 7B needed KL 0.01; Table 5's 0.05 stays the default
    _, cfg = launch_and_parse(script(3, rel), tmp_path, KL_CTL="0.01", TERMINATION="parsing", NGRAM="1",
                              ACTOR_MODEL_PATH="/m/sft", CRITIC_MODEL_PATH="/m/rm")
    assert (cfg.kl_ctl, cfg.termination_condition, cfg.ngram_n) == (0.01, "parsing", 1)
    assert (cfg.actor_model_name_or_path, cfg.critic_model_name_or_path) == ("/m/sft", "/m/rm")
    _, cfg = launch_and_parse(script(3, rel), tmp_path, NGRAM="inf")
    assert cfg.ngram_n is None  # one macro action per response
    # positional ZeRO stages: both given, one given (both use it), defaults
    _, cfg = launch_and_parse(script(3, "gemma/run_2b.sh"), tmp_path, "out", "1", "2")
    assert (cfg.actor_zero_stage, cfg.critic_zero_stage) == (1, 2)
    _, cfg = launch_and_parse(script(3, "gemma/run_2b.sh"), tmp_path, "out", "0")
    assert (cfg.actor_zero_stage, cfg.critic_zero_stage) == (0, 0)
    # other GPU counts and generation chunks keep the PPO batch of 256
    for env in ({"NUM_GPUS": "4"}, {"NUM_GPUS": "16", "PER_DEVICE_TRAIN_BATCH": "2"},
                {"GENERATION_BATCHES": "4", "PER_DEVICE_TRAIN_BATCH": "8"}):
        _, cfg = launch_and_parse(script(3, rel), tmp_path, **env)
        assert ppo_batches(cfg, int(env.get("NUM_GPUS", GPUS_PER_NODE))) == (256, 256), env
    bad = run(script(3, rel), tmp_path, PER_DEVICE_TRAIN_BATCH="5")
    assert bad.returncode == 2 and bad.argv is None and "PER_DEVICE_TRAIN_BATCH" in bad.stderr


def test_codegemma_ppo_runs_with_program_tests(tmp_path):
    for rel in ("codegemma/run_2b.sh", "codegemma/run_7b.sh"):
        _, cfg = launch_and_parse(script(3, rel), tmp_path, REWARD_WORKERS="4")
        assert (cfg.reward_source, cfg.reward_workers, cfg.response_kind) == ("program_tests", 4, "code")
        assert cfg.reward_model_name_or_path == ""
        for bad in ("0", "two"):
            out = run(script(3, rel), tmp_path, REWARD_WORKERS=bad)
            assert out.returncode == 2 and out.argv is None and "REWARD_WORKERS" in out.stderr
        out = run(script(3, rel), tmp_path, REWARD_SOURCE="reward_model")
        assert out.returncode == 2 and "REWARD_MODEL_PATH" in out.stderr
        _, cfg = launch_and_parse(script(3, rel), tmp_path, REWARD_SOURCE="reward_model",
                                  REWARD_MODEL_PATH="/models/code-rm")
        assert (cfg.reward_source, cfg.reward_model_name_or_path) == ("reward_model", "/models/code-rm")
        out = run(script(3, rel), tmp_path, REWARD_SOURCE="judge")
        assert out.returncode == 2 and "REWARD_SOURCE must be" in out.stderr


# --------------------------------------------------------------------------------------- App. C.3: DPO
DPO_SIZES = ["gemma/run_2b.sh", "gemma/run_7b.sh", "gemma2/run_27b.sh", "llama3.2/run_3b.sh"]
DPO_BETA = {"tldr": 0.1, "hh": 0.01}  # C.3: β 0.1 on TL;DR, 0.01 on HH-RLHF; learning rate 2e-7


@pytest.mark.parametrize("rel", DPO_SIZES)
@pytest.mark.parametrize("task", sorted(DPO_BETA))
def test_dpo_appendix_c3(rel, task, tmp_path):
    _, cfg = launch_and_parse(script("dpo", rel), tmp_path, TASK=task)
    assert (cfg.beta, cfg.learning_rate, cfg.dpo_loss, cfg.num_train_epochs) == (DPO_BETA[task], 2e-7, "sigmoid", 1)
    assert cfg.lr_scheduler_type == "cosine" and cfg.dtype == "bf16" and cfg.warmup_ratio == 0.1
    # C.3: the reward model's data and split, its batch of pairs, the SFT model as policy init and reference
    rm_out, rm = launch_and_parse(script(2, rel), tmp_path, TASK=task)
    assert (cfg.data_path, cfg.data_split, cfg.max_seq_len) == (rm.data_path, rm.data_split, rm.max_seq_len)
    assert sft_batch(cfg) == sft_batch(rm)
    step1 = parse(1, launch_ok(script(1, rel), tmp_path, TASK=task).flags, rel).output_dir
    assert cfg.model_name_or_path == rm.model_name_or_path == step1 and cfg.ref_model_name_or_path == ""
    assert cfg.output_dir == f"./output/{RUN_NAMES[rel]}/{task}/step2_dpo"
    check_memory_settings(rel, cfg.zero_stage, cfg.offload, cfg.gradient_checkpointing)
    # IPO on request
    _, ipo = launch_and_parse(script("dpo", rel), tmp_path, TASK=task, DPO_LOSS="ipo")
    assert ipo.dpo_loss == "ipo"


def test_dpo_has_no_webgpt_beta(tmp_path):
    out = run(script("dpo", "gemma/run_2b.sh"), tmp_path, TASK="webgpt")
    assert out.returncode == 2 and out.argv is None and "no value for TASK=webgpt" in out.stderr


@pytest.mark.parametrize(("name", "ranks"), [("run_tiny.sh", 1), ("run_tiny_2ranks.sh", 2)])
def test_tiny_dpo_scripts(name, ranks, tmp_path):
    root = "tiny" if ranks == 1 else "tiny_2ranks"
    out, cfg = launch_and_parse(script("dpo", f"tiny/{name}"), tmp_path)
    _, rm = launch_and_parse(script(2, f"tiny/{name}"), tmp_path)
    assert out.launcher_value("--num_gpus") == str(ranks)
    assert (cfg.data_path, cfg.data_split, cfg.max_seq_len) == (rm.data_path, rm.data_split, rm.max_seq_len)
    assert sft_batch(cfg, ranks) == sft_batch(rm, ranks) == 16
    assert (cfg.model_name_or_path, cfg.output_dir) == (f"./output/{root}/step1", f"./output/{root}/step2_dpo")
    assert (cfg.beta, cfg.learning_rate, cfg.zero_stage) == (0.1, 1e-4, 0 if ranks == 1 else 2)
    embedded, cfg = launch_and_parse(script("dpo", f"tiny/{name}"), tmp_path, MODEL_PATH="")
    assert "--model_name_or_path" not in embedded.flags and cfg.model_name_or_path == ""


# ------------------------------------------------------------------------------------------ tiny scripts
@pytest.mark.parametrize(("name", "ranks"), [("run_tiny.sh", 1), ("run_tiny_2ranks.sh", 2)])
def test_tiny_scripts(name, ranks, tmp_path):
    root = "tiny" if ranks == 1 else "tiny_2ranks"
    configs = {}
    for step in (1, 2, 3):
        out, cfg = launch_and_parse(script(step, f"tiny/{name}"), tmp_path)
        assert out.launcher_value("--num_gpus") == str(ranks)
        assert cfg.data_path == ["synthetic"] and cfg.dtype == "fp32" and cfg.data_split == "4,3,3"
        assert cfg.output_dir == f"./output/{root}/step{step}"
        configs[step] = (out, cfg)
    (sft_out, sft), (_, rm), (_, ppo) = configs[1], configs[2], configs[3]
    # the embedded tiny model: no model path at all in step 1
    assert "--model_name_or_path" not in sft_out.flags and sft.model_name_or_path == ""
    assert sft.max_seq_len == rm.max_seq_len == 256
    assert sft_batch(sft, ranks) == sft_batch(rm, ranks) == 16
    # step 2 starts from step 1's output (B.2); MODEL_PATH= (empty) means the embedded model instead
    assert rm.model_name_or_path == f"./output/{root}/step1"
    rm_embedded, cfg = launch_and_parse(script(2, f"tiny/{name}"), tmp_path, MODEL_PATH="")
    assert "--model_name_or_path" not in rm_embedded.flags and cfg.model_name_or_path == ""
    # the tiny reward model adds the likelihood term (at a gentler learning rate); LIKELIHOOD_TERM=0 drops it
    assert (rm.likelihood_term, rm.learning_rate) == (True, 1e-4)
    _, plain = launch_and_parse(script(2, f"tiny/{name}"), tmp_path, LIKELIHOOD_TERM="0")
    assert (plain.likelihood_term, plain.learning_rate) == (False, 5e-4)
    # the term averages log p over the answer, starting at α = 45 (about the answers' length, so on the sum's
    # scale); LIKELIHOOD_NORM=sum LIKELIHOOD_SCALE=1 is the plain sum
    assert (rm.likelihood_norm, rm.likelihood_scale) == ("mean", 45.0)
    _, total = launch_and_parse(script(2, f"tiny/{name}"), tmp_path, LIKELIHOOD_NORM="sum", LIKELIHOOD_SCALE="1")
    assert (total.likelihood_term, total.likelihood_norm, total.likelihood_scale) == (True, "sum", 1.0)
    # step 1 decays the weights (1.0, AdamW's decoupled decay); WEIGHT_DECAY overrides it; step 2 does not decay
    assert (sft.weight_decay, rm.weight_decay) == (1.0, 0.0)
    _, plain_sft = launch_and_parse(script(1, f"tiny/{name}"), tmp_path, WEIGHT_DECAY="0.0")
    assert plain_sft.weight_decay == 0.0
    # step 3: the step-1/2 outputs, short prompts and answers, 16 prompts per PPO step
    assert (ppo.actor_model_name_or_path, ppo.critic_model_name_or_path) == \
        (f"./output/{root}/step1", f"./output/{root}/step2")
    assert (ppo.max_prompt_seq_len, ppo.max_answer_seq_len) == (192, 64)
    assert ppo_batches(ppo, ranks) == (16, 16)
    assert (ppo.termination_condition, ppo.ngram_n, ppo.max_steps > 0) == ("fixed", 5, True)
    assert ppo.whiten_advantages and ppo.clip_reward_value == 100  # the tiny reward model's scores are ~ -8
    zero = 0 if ranks == 1 else 2
    assert (sft.zero_stage, rm.zero_stage, ppo.actor_zero_stage, ppo.critic_zero_stage) == (zero,) * 4


def test_quickstart_sft_is_what_the_current_tiny_step1_script_trains(quickstart_sft, embedded, tmp_path):
    """tests/test_gold_rl.py and test_zero3_step3.py start from the ``quickstart_sft`` fixture's model (trained once
    per machine, then taken from its cache): it must be what the current tiny step-1 script trains, as the
    recorded sweeps of docs/results.md ran it — the quick start's step 1 at seed 1234, before the script's weight
    decay (1.0 since the main job adopted it) and the task's 4,3,3 split: WEIGHT_DECAY=0.0 on the 2,4,4 split
    (scripts/reproduce.py's SWEEP_SPLIT)."""
    from transformers import AutoTokenizer

    assert {"WEIGHT_DECAY": "0.0", "EXTRA_ARGS": f"--data_split {QUICKSTART_SFT_SPLIT}"} == QUICKSTART_SFT_ENV
    trained = json.loads((quickstart_sft / "args.json").read_text())
    _, sft = launch_and_parse(script(1, "tiny/run_tiny.sh"), tmp_path, **QUICKSTART_SFT_ENV)
    keys = ("data_path", "data_split", "eval_fraction", "model_name_or_path", "num_train_epochs", "max_steps",
            "learning_rate", "lr_scheduler_type", "warmup_ratio", "num_warmup_steps", "weight_decay",
            "per_device_train_batch_size", "gradient_accumulation_steps", "max_seq_len", "seed", "dtype",
            "loss_aggregation", "dropout", "lora_dim")
    assert {k: trained[k] for k in keys} == {k: getattr(sft, k) for k in keys}
    assert (sft.data_split, sft.weight_decay, sft.seed, sft.model_name_or_path) == (QUICKSTART_SFT_SPLIT, 0.0, 1234, "")
    # every other flag the script gives main.py, too: the model was trained by this script, not a hand-made command
    fields = {f.name for f in dataclasses.fields(SFTArgs)} - set(PATH_FLAGS)
    assert {k: trained[k] for k in fields} == {k: getattr(sft, k) for k in fields}
    # and on the current embedded task: its tokenizer is trained on the task's text, so a new task version shows
    assert AutoTokenizer.from_pretrained(quickstart_sft).get_vocab() == \
        AutoTokenizer.from_pretrained(embedded.tokenizer_dir).get_vocab()


def test_tiny_code_scripts(tmp_path):
    sft_out, sft = launch_and_parse(script(1, "tiny/run_tiny_code.sh"), tmp_path)
    _, ppo = launch_and_parse(script(3, "tiny/run_tiny_code.sh"), tmp_path)
    assert sft.data_path == ppo.data_path == \
        ["synthetic_code:num_records=2000,operations=2,max_constant=3,flaw_rate=0.5"]
    assert sft.data_split == ppo.data_split == "2,0,8"  # B.2: disjoint SFT / PPO shares, no step 2
    assert "--model_name_or_path" not in sft_out.flags and sft.dtype == ppo.dtype == "fp32"
    assert sft.max_seq_len == 176 and sft_batch(sft, 1) == 16
    assert (ppo.actor_model_name_or_path, ppo.critic_model_name_or_path) == ("./output/tiny_code/step1", "")
    assert (ppo.reward_source, ppo.response_kind) == ("program_tests", "code")
    assert (sft.learning_rate, sft.num_train_epochs, sft.lr_scheduler_type) == (2e-3, 6, "cosine")
    # GRPO: 4 prompts x K = 4 answers = 16 experiences, one optimizer step per batch
    assert (ppo.advantage_estimator, ppo.num_samples_per_prompt) == ("grpo", 4)
    assert (ppo.per_device_generation_batch_size, ppo.per_device_training_batch_size,
            ppo.gradient_accumulation_steps) == (4, 16, 1)
    # the configuration measured to learn (docs/results/code_task.md): the full distribution at temperature 1,
    # a constant lr 1e-4, no KL penalty
    assert (ppo.temperature, ppo.top_k, ppo.kl_ctl) == (1.0, 0, 0.0)
    assert (ppo.actor_learning_rate, ppo.lr_scheduler_type, ppo.max_steps) == (1e-4, "constant", 30)
    _, two = launch_and_parse(script(3, "tiny/run_tiny_code.sh"), tmp_path, NUM_GPUS="2",
                              PER_DEVICE_TRAIN_BATCH="4")  # 2 prompts x 4 answers on each of 2 ranks
    assert (two.per_device_generation_batch_size, two.gradient_accumulation_steps) == (2, 2)
    _, gae = launch_and_parse(script(3, "tiny/run_tiny_code.sh"), tmp_path, ESTIMATOR="gae")
    assert (gae.advantage_estimator, gae.num_samples_per_prompt) == ("gae", 1)
    assert (gae.per_device_generation_batch_size, gae.gradient_accumulation_steps) == (16, 1)
    bad = run(script(3, "tiny/run_tiny_code.sh"), tmp_path, ESTIMATOR="ppo")
    assert bad.returncode == 2 and bad.argv is None and "ESTIMATOR must be" in bad.stderr
    bad = run(script(3, "tiny/run_tiny_code.sh"), tmp_path, PER_DEVICE_TRAIN_BATCH="12")
    assert bad.returncode == 2 and "16 answers per rank: not a multiple of PER_DEVICE_TRAIN_BATCH 12" in bad.stderr
    # the other scripts' flags are unchanged: one answer per prompt, main.py's estimator
    _, text = launch_and_parse(script(3, "tiny/run_tiny.sh"), tmp_path)
    assert (text.advantage_estimator, text.num_samples_per_prompt) == ("gae", 1)


def test_tiny_model_path_override(tmp_path):
    _, cfg = launch_and_parse(script(1, "tiny/run_tiny.sh"), tmp_path, MODEL_PATH="/models/gpt2")
    assert cfg.model_name_or_path == "/models/gpt2"
    no_paths = {"ACTOR_MODEL_PATH": "", "CRITIC_MODEL_PATH": ""}
    out, cfg = launch_and_parse(script(3, "tiny/run_tiny.sh"), tmp_path, **no_paths)
    assert "--actor_model_name_or_path" not in out.flags and cfg.actor_model_name_or_path == ""


# ------------------------------------------------------------------------------------- LAUNCHER=auto
def run_auto(path: Path, tmp_path: Path, **env: str) -> tuple[Launch, list[str] | None, str]:
    """``run`` with LAUNCHER=auto (the default: LAUNCHER unset) and a fake python: (the launch, python's
    arguments or None, the variables it saw)."""
    record = tmp_path / "python_args"
    for f in (record, Path(f"{record}.env")):
        f.unlink(missing_ok=True)
    out = run(path, tmp_path, **{"LAUNCHER": "", "FAKE_PY_ARGS": str(record), **env})
    argv = record.read_bytes().decode().split("\0")[:-1] if record.exists() else None
    seen = Path(f"{record}.env").read_text() if record.exists() else ""
    return out, argv, seen


@pytest.mark.parametrize("step", [1, 2, 3, "dpo"])
def test_one_local_rank_starts_main_directly(step, tmp_path):
    """One local rank: `python -u main.py FLAGS EXTRA_ARGS`, main.py's flags exactly those the runner gets."""
    path = script(step, "tiny/run_tiny.sh")
    ds = launch_ok(path, tmp_path, EXTRA_ARGS="--seed 7")
    log = tmp_path / "auto.log"
    out, argv, seen = run_auto(path, tmp_path, EXTRA_ARGS="--seed 7", LOG_FILE=str(log))
    assert out.returncode == 0 and out.argv is None, out.stderr  # the runner was not called
    assert argv == ["-u", str(ds.main), *ds.flags] and ds.flags[-2:] == ["--seed", "7"]
    assert log.read_text() == out.stdout == f"launch: python -u {ds.main}\nfake python: {len(argv)} arguments\n"
    assert seen.splitlines() == [f"PYTHONPATH={tmp_path}", "MASTER_PORT=unset"]  # main.py picks a free port
    _, _, seen = run_auto(path, tmp_path, MASTER_PORT="29777", PYTHONPATH="/x")
    assert seen.splitlines() == [f"PYTHONPATH={tmp_path}:/x", "MASTER_PORT=29777"]
    failed, _, _ = run_auto(path, tmp_path, FAKE_PY_EXIT="3")
    assert failed.returncode == 3  # main.py's exit status is the script's, as the launcher's is


def test_auto_uses_the_runner_for_more_than_one_local_rank(tmp_path):
    two, argv, _ = run_auto(script(1, "tiny/run_tiny_2ranks.sh"), tmp_path)
    assert argv is None and two.launcher_value("--num_gpus") == "2"
    extra, argv, _ = run_auto(script(1, "tiny/run_tiny.sh"), tmp_path, LAUNCHER_ARGS="--bind_cores_to_rank")
    assert argv is None and "--bind_cores_to_rank" in extra.launcher
    multi, argv, _ = run_auto(MULTI_NODE, tmp_path, **default_env(MULTI_NODE), NUM_GPUS="1")
    assert argv is None and multi.launcher_value("--num_nodes") == "2"
    bad = run(script(1, "tiny/run_tiny.sh"), tmp_path, LAUNCHER="torchrun")
    assert bad.returncode == 2 and bad.argv is None and "LAUNCHER must be auto or deepspeed" in bad.stderr


# -------------------------------------------------------------------------------------------- multi-node
def test_multi_node_over_hostfile(tmp_path):
    out, cfg = launch_and_parse(MULTI_NODE, tmp_path, "out")
    assert out.launcher_value("--hostfile") == str(HOSTFILE_EXAMPLE)
    assert out.launcher_value("--num_nodes") == "2" and out.launcher_value("--num_gpus") == "8"
    assert "--no_ssh" not in out.launcher
    # the step-1 Gemma 7B configuration, its global batch of 128 now over 2 x 8 GPUs
    assert sft_batch(cfg, 16) == 128
    assert (cfg.model_name_or_path, cfg.learning_rate, cfg.zero_stage) == ("google/gemma-7b", 2e-5, 3)
    assert (tmp_path / "out" / "training.log").exists()


def test_multi_node_simulation_mode(tmp_path):
    env = {"NO_SSH": "1", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}
    out, _ = launch_and_parse(MULTI_NODE, tmp_path, "out", **env)
    launcher = out.launcher
    assert launcher[launcher.index("--no_ssh") + 1:launcher.index("--no_ssh") + 5] == \
        ["--node_rank", "1", "--master_addr", "127.0.0.1"]
    assert out.launcher_value("--master_port") == "29611"
    assert out.launcher_value("--hostfile") == str(HOSTFILE_EXAMPLE)
    # each node keeps its own log even on a shared file system
    assert (tmp_path / "out" / "training.node1.log").exists()
    assert not (tmp_path / "out" / "training.log").exists()
    # the mode needs both the node rank and node 0's address; a hostfile of one host is not multi-node
    for missing in ("NODE_RANK", "MASTER_ADDR"):
        bad = run(MULTI_NODE, tmp_path, **{**default_env(MULTI_NODE), **env, missing: ""})
        assert bad.returncode == 2 and bad.argv is None and missing in bad.stderr
    one_host = tmp_path / "one"
    one_host.write_text("solo slots=8\n")
    bad = run(MULTI_NODE, tmp_path, HOSTFILE=str(one_host))
    assert bad.returncode == 2 and "at least 2" in bad.stderr
    bad = run(MULTI_NODE, tmp_path, HOSTFILE=str(tmp_path / "missing"))
    assert bad.returncode == 2 and "hostfile" in bad.stderr


def test_hostfile_example_lists_two_nodes_of_eight():
    hosts = [line.split() for line in HOSTFILE_EXAMPLE.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert len(hosts) == 2 and all(h[1] == "slots=8" for h in hosts)


# ------------------------------------------------------------------------- the quick start's recipes (no bash)
# marlhf quickstart runs each step from marlhf/recipes.py through the installed entry points (a wheel has no
# training/ folder); every size it offers must hand its steps exactly the flags, ranks and launcher settings of the
# launch script of that size, which stays the users' launcher and the reference
SIZE_SCRIPTS = {"tiny": "tiny/run_tiny.sh", "tiny-2ranks": "tiny/run_tiny_2ranks.sh", "gemma-2b": "gemma/run_2b.sh",
                "gemma-7b": "gemma/run_7b.sh", "gemma2-27b": "gemma2/run_27b.sh",
                "codegemma-2b": "codegemma/run_2b.sh", "codegemma-7b": "codegemma/run_7b.sh",
                "llama3.2-3b": "llama3.2/run_3b.sh"}
QUICKSTART_ENVS = [  # the quick start's own variables and the users' common overrides
    {},
    {"TASK": "hh", "NUM_GPUS": "4", "EXTRA_ARGS": "--max_steps 3 --seed 7", "DATA_OUTPUT_PATH": "/d"},
    {"TASK": "webgpt", "MODEL_PATH": "/m", "ACTOR_MODEL_PATH": "/a", "CRITIC_MODEL_PATH": "/c", "TERMINATION": "ppl",
     "NGRAM": "3", "KL_CTL": "0.2", "PER_DEVICE_BATCH": "2", "PER_DEVICE_TRAIN_BATCH": "4", "MASTER_PORT": "29999"},
    {"MODEL_PATH": "", "ACTOR_MODEL_PATH": "", "CRITIC_MODEL_PATH": "", "DATA_PATH": "synthetic:seed=7 synthetic",
     "LIKELIHOOD_TERM": "0", "WEIGHT_DECAY": "0.5", "WHITEN_ADVANTAGES": "0", "GENERATION_BATCHES": "2"},
]


@pytest.mark.parametrize("size", sorted(SIZE_SCRIPTS))
def test_quickstart_recipes_launch_what_the_scripts_launch(size, tmp_path):
    from marlhf import recipes

    assert sorted(SIZE_SCRIPTS) == recipes.sizes()
    checked = 0
    for step in (1, 2, 3):
        path = script(step, SIZE_SCRIPTS[size])
        assert path.exists() == recipes.has_step(size, step), (size, step)
        if not path.exists():
            continue
        for env in QUICKSTART_ENVS:
            if "TASK" in env and not size.startswith(("gemma", "llama")):
                env = {k: v for k, v in env.items() if k != "TASK"}  # the tiny and code scripts have one task
            for zero in ([], ["1"]):
                out = run(path, tmp_path, str(tmp_path / "out"), *zero, **env)
                try:
                    launch = recipes.step_launch(size, step, tmp_path / "out", *zero, env=env)
                except Exception as err:  # noqa: BLE001 - the script must have refused it as well
                    assert out.returncode == 2 and out.argv is None, (size, step, env, err)
                    continue
                assert out.returncode == 0, (size, step, env, out.stderr)
                where = f"{size} step {step} {env} {zero}"
                assert launch.flags == out.flags, where
                assert (str(launch.num_gpus), launch.master_port) == \
                    (out.launcher_value("--num_gpus"), out.launcher_value("--master_port")), where
                assert launch.log_file == tmp_path / "out" / "training.log"
                checked += 1
    assert checked >= 8


def test_quickstart_recipe_command_uses_the_installed_entry_points(tmp_path):
    from marlhf import recipes

    one = recipes.step_launch("tiny", 1, tmp_path)
    assert one.command("/env/bin/python")[:6] == ["/env/bin/python", "-u", "-m", "marlhf", "sft", "--data_path"]
    two = recipes.step_launch("tiny-2ranks", 3, tmp_path)
    # the runner of the interpreter's own environment, whatever PATH holds
    assert two.command("/env/bin/python")[:7] == ["/env/bin/deepspeed", "--num_gpus", "2", "--master_port", "29500",
                                                  "--module", "marlhf.cli.ppo"]


# ----------------------------------------------------------------------------- GPUs and the runner (issue 57.7)
def test_gpu_script_without_gpus_needs_num_gpus_given(tmp_path):
    """A GPU size on a machine without GPUs stopped only when each of its 8 ranks failed; now the script says so
    before launching, naming the variable that asks for CPU ranks instead."""
    sft = script(1, "gemma/run_2b.sh")
    bad = run(sft, tmp_path, FAKE_GPUS="0")
    assert bad.returncode == 2 and bad.argv is None
    assert "this machine has no GPU" in bad.stderr and "set NUM_GPUS=N to start N DeepSpeed CPU ranks" in bad.stderr
    asked = launch_ok(sft, tmp_path, FAKE_GPUS="0", NUM_GPUS="2")  # CPU ranks, asked for by name
    assert asked.launcher_value("--num_gpus") == "2"
    tiny = launch_ok(script(1, "tiny/run_tiny_2ranks.sh"), tmp_path, FAKE_GPUS="0")  # CPU ranks by design
    assert tiny.launcher_value("--num_gpus") == "2"


def test_more_gpus_than_the_machine_has_stop_with_the_count(tmp_path):
    bad = run(script(3, "gemma/run_2b.sh"), tmp_path, FAKE_GPUS="2")
    assert bad.returncode == 2 and bad.argv is None
    assert "NUM_GPUS=8 GPUs asked for and this machine has 2 GPUs: set NUM_GPUS=2" in bad.stderr
    visible = run(script(1, "gemma/run_2b.sh"), tmp_path, CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert visible.returncode == 2 and "this machine has 4 GPUs" in visible.stderr
    launch_ok(script(1, "gemma/run_2b.sh"), tmp_path, FAKE_GPUS="2", NUM_GPUS="2")
    launch_ok(MULTI_NODE, tmp_path, "out", FAKE_GPUS="0", **default_env(MULTI_NODE))  # the nodes are elsewhere


def test_runner_is_the_one_beside_python(tmp_path):
    """The `deepspeed` of the python's own environment, not whichever comes first on PATH (nor none: an environment
    used by its python alone once stopped at `deepspeed: command not found`)."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "deepspeed").write_text("#!/usr/bin/env bash\necho 'the wrong deepspeed' >&2\nexit 99\n")
    (other / "deepspeed").chmod(0o755)
    bin_dir = fake_bin(tmp_path)
    env = {"PATH": f"{other}{os.pathsep}{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = launch_ok(script(1, "tiny/run_tiny_2ranks.sh"), tmp_path, **env)
    assert out.argv[:2] == ["--num_gpus", "2"] and "the wrong deepspeed" not in out.stderr
    assert (tmp_path / "output/tiny_2ranks/step1/training.log").read_text().startswith(
        f"launch: {bin_dir / 'deepspeed'} --num_gpus 2")


def test_unavailable_model_stops_before_the_launch(tmp_path):
    """A model the hub cannot give (here: no network, a name that does not exist) or a missing folder stops the
    script before `deepspeed` starts any rank, with one message naming it and the local-copy way."""
    missing = "marlhf-tests/no-such-model-issue-57"
    env = {"REAL_PREFLIGHT": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    out = run(script(1, "gemma/run_2b.sh"), tmp_path, MODEL_PATH=missing, **env)
    assert out.returncode == 2 and out.argv is None
    assert out.stderr.count("cannot be had") == 1 and f"model '{missing}' (--model_name_or_path)" in out.stderr
    assert "MODEL_PATH=DIR" in out.stderr and "HF_HUB_OFFLINE=1" in out.stderr
    gone = run(script(3, "tiny/run_tiny.sh"), tmp_path, **env)  # step 1's output not there yet
    assert gone.returncode == 2 and gone.argv is None
    assert "model folder './output/tiny/step1' (--actor_model_name_or_path) does not exist" in gone.stderr
    local = tmp_path / "models/sft"
    local.mkdir(parents=True)
    launch_ok(script(2, "tiny/run_tiny.sh"), tmp_path, MODEL_PATH=str(local), **env)  # local: no hub asked
