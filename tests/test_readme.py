"""The README's "Run it on your own model" commands, run command for command as written, on the real model the
suite already uses: SmolLM2-135M-Instruct (a local folder in place of the hub name) and a local HH-RLHF file in
place of the hub dataset (``Anthropic/hh-rlhf:FILE``, the documented local-copy form), with one GPU, a free
master port, and short runs through documented flags appended to each command (one step, short sequences,
small batches, a few held-out prompts).  Any other change to the README's commands breaks this test, so the
README cannot drift from what the code does.  Every other step command the README shows is parsed by its
step's own flag parser, and every ``marlhf X`` it shows names a subcommand."""

import json
import math
import os
import random
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from marlhf.cli import COMMANDS
from marlhf.utils.tracking import read_metrics

pytestmark = pytest.mark.slow

README = (REPO / "README.md").read_text()
MARKER = "<!-- tests/test_readme.py runs"
HH = REPO / "tests/fixtures/real_model/hh_small.jsonl"
DATA = ["--data_split", "1,1,1", "--eval_fraction", "0.25", "--seed", "1", "--disable_progress_bar"]
SHORT = {  # appended to the README's commands: documented flags that make each run one short step
    "sft": [*DATA, "--max_seq_len", "128", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
            "--max_steps", "1"],
    "ppo": [*DATA, "--max_prompt_seq_len", "64", "--max_answer_seq_len", "16", "--per_device_generation_batch_size",
            "1", "--per_device_training_batch_size", "1", "--max_eval_samples", "2", "--max_steps", "1"],
}
SHORT["rm"] = SHORT["sft"]


def readme_blocks() -> list[str]:
    """The ```bash blocks right after the README's test markers, in order."""
    blocks = re.findall(re.escape(MARKER) + r"[^\n]*-->\n```bash\n(.*?)\n```", README, re.S)
    assert len(blocks) == 2, "the README's own-model section lost a tested block"
    return blocks


def commands(block: str) -> list[str]:
    """The block's lines with continuations joined (comments and assignments kept as they are)."""
    return block.replace("\\\n", " ").splitlines()


def shorten(line: str, port: int, data_cache: Path) -> str:
    """A ``deepspeed --module marlhf.cli.X`` line with a free master port and the short-run flags appended."""
    words = shlex.split(line, comments=True)
    if not words or words[0] != "deepspeed":
        return line
    module = words[words.index("--module") + 1].removeprefix("marlhf.cli.")
    extra = [*SHORT[module], "--data_output_path", str(data_cache)]
    return line.replace("deepspeed ", f"deepspeed --master_port {port} ", 1).split("#")[0] + " " + shlex.join(extra)


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range (32768+): the script binds it minutes later, and a
    port the kernel handed out (bind to 0) can meanwhile go to any process's outgoing connection — another test's
    gloo ranks took one in CI. The other tests' fixed ports are 29xxx: this draws from 20000-28999."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 29000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-28999")


@pytest.fixture(scope="module")
def smollm2():
    from marlhf.models.pretrained import PretrainedUnavailableError, prepare_smollm2

    try:
        return prepare_smollm2()
    except PretrainedUnavailableError as err:
        pytest.skip(f"the README's own-model commands run on SmolLM2: {err}")


@pytest.fixture(scope="module")
def own_model_run(smollm2, tmp_path_factory):
    """Both tested blocks as one bash script (the second uses the first's variables and models)."""
    root = tmp_path_factory.mktemp("readme")
    values = {"MODEL": str(smollm2), "DATA": f"Anthropic/hh-rlhf:{HH}", "OUT": str(root / "out"), "GPUS": "1"}
    lines, assigned = [], set()
    for line in commands("\n".join(readme_blocks())):
        if m := re.match(r"^([A-Z]+)=\S+", line):
            assigned.add(m.group(1))
            line = f"{m.group(1)}={shlex.quote(values[m.group(1)])}"
        lines.append(shorten(line, free_port(), root / "data"))
    assert assigned == set(values)
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    (root / "readme.sh").write_text(script)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(["bash", str(root / "readme.sh")], cwd=root, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return root / "out", smollm2


def args_of(folder: Path) -> dict:
    return json.loads((folder / "args.json").read_text())


def test_three_steps_train_smollm2_as_the_readme_says(own_model_run):
    out, smollm2 = own_model_run
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sft = args_of(out / "sft")
    assert (sft["model_name_or_path"], sft["dtype"], sft["zero_stage"]) == (str(smollm2), "bf16", 2)
    loss = [m["train/loss"] for m in read_metrics(out / "sft") if "train/loss" in m]
    assert len(loss) == 1 and math.isfinite(loss[0]) and 0 < loss[0] < 20
    # the SFT step moved the weights (exported in Hugging Face format)
    base = AutoModelForCausalLM.from_pretrained(smollm2).state_dict()
    tuned = load_file(out / "sft/model.safetensors")
    name = next(k for k in tuned if k.endswith("layers.0.mlp.down_proj.weight"))
    assert not tuned[name].float().equal(base[name].float())

    rm = args_of(out / "rm")
    assert rm["model_name_or_path"] == str(out / "sft")
    acc = [m["eval/accuracy"] for m in read_metrics(out / "rm") if "eval/accuracy" in m]
    assert acc and all(0.0 <= a <= 1.0 for a in acc)

    ppo = args_of(out / "ppo")
    assert (ppo["termination_condition"], ppo["ngram"], ppo["actor_zero_stage"], ppo["critic_zero_stage"]) == (
        "fixed", "5", 2, 2)
    summary = json.loads((out / "ppo/summary.json").read_text())
    assert summary["steps"] == 1
    for policy in ("initial_policy", "final_policy"):
        assert math.isfinite(summary[policy]["rm_score"]) and 0 <= summary[policy]["eos_rate"] <= 1
    assert (out / "ppo/actor/model.safetensors").exists() and (out / "ppo/critic/model.safetensors").exists()


def test_grpo_is_critic_free(own_model_run):
    out, _ = own_model_run
    args = args_of(out / "grpo")
    assert (args["advantage_estimator"], args["num_samples_per_prompt"], args["kl_penalty"]) == ("grpo", 8, "loss")
    assert (out / "grpo/actor/model.safetensors").exists() and not (out / "grpo/critic").exists()
    rows = [m for m in read_metrics(out / "grpo") if "train/actor_loss" in m]
    assert len(rows) == 1 and math.isfinite(rows[0]["train/actor_loss"])


def test_own_reward_function_is_the_reward(own_model_run):
    out, _ = own_model_run
    args = args_of(out / "ppo-own-reward")
    assert (args["reward_source"], args["reward_function"]) == ("python", "my_reward.py:reward")
    rows = [m for m in read_metrics(out / "ppo-own-reward") if "train/reward" in m]
    # the README's function: -|words - 50| / 50; answers of at most 16 tokens have at most 16 words
    assert len(rows) == 1 and -1.0 <= rows[0]["train/reward"] <= -34 / 50
    summary = json.loads((out / "ppo-own-reward/summary.json").read_text())
    assert -1.0 <= summary["final_policy"]["reward_score"] <= -34 / 50
    # no reward model: the critic started from the SFT model
    assert args["critic_model_name_or_path"] == "" and (out / "ppo-own-reward/critic/model.safetensors").exists()


def test_every_step_command_in_the_readme_parses(tmp_path):
    """Each ``deepspeed ... --module marlhf.cli.X`` and ``marlhf X`` command of the README, with its variables
    filled in, is accepted by that step's parser (flags, values, combinations)."""
    from marlhf.config import DPOArgs, RewardArgs, RLHFArgs, SFTArgs, parse_args

    classes = {"sft": SFTArgs, "rm": RewardArgs, "dpo": DPOArgs, "ppo": RLHFArgs}
    fill = {"$MODEL": "m", "$DATA": "synthetic", "$OUT": str(tmp_path), "$GPUS": "8"}
    (tmp_path / "my_reward.py").write_text("def reward(prompts, responses, meta):\n    return [0.0] * len(responses)\n")
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    parsed = 0
    cwd = os.getcwd()
    os.chdir(tmp_path)  # --reward_function my_reward.py:reward is relative to where the command runs
    try:
        for line in commands("\n".join(blocks)):
            for key, value in fill.items():
                line = line.replace(key, value)
            words = shlex.split(line, comments=True)
            if words[:1] == ["marlhf"]:
                assert words[1] in COMMANDS, line
            if words[:1] == ["deepspeed"] and "--module" in words:
                module = words[words.index("--module") + 1].removeprefix("marlhf.cli.")
                argv = words[words.index("--module") + 2:]
                parse_args(classes[module], argv)
                parsed += 1
    finally:
        os.chdir(cwd)
    assert parsed >= 5
