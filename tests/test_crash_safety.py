"""Crash safety, proven: a training process SIGKILLed while it writes a checkpoint, or between two
checkpoints, resumes with ``--resume`` from the last complete one and ends with the weights of an
uninterrupted run; a checkpoint written with other topology flags is refused with a clear message.

The kill lands at a known point: ``tests/pause_harness.py`` runs the step with a listener on one of the points
it announces (``marlhf.utils.events``) that stops it there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, STEP1, TINY_DATA, load_main
from safetensors.torch import load_file

from marlhf.errors import UserError
from marlhf.utils.tracking import read_metrics


def argv(out, data, *extra) -> list[str]:
    return ["--data_path", TINY_DATA, "--max_seq_len", "256", "--per_device_train_batch_size", "4",
            "--max_eval_samples", "8", "--max_steps", "4", "--save_steps", "2", "--disable_progress_bar",
            "--seed", "1", "--output_dir", str(out), "--data_output_path", str(data), *extra]


@pytest.fixture(scope="module")
def reference(embedded, tmp_path_factory):
    work = tmp_path_factory.mktemp("crash")
    load_main(STEP1)(argv(work / "full", work / "data"))
    return work


def clean_env() -> dict:
    """This process's environment minus the process-group variables an in-process run left behind (their
    MASTER_PORT is still bound by this process)."""
    drop = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def kill_at(work, name: str, pause: str) -> None:
    """Start step 1 as its own process, wait until it sits at ``pause``, and SIGKILL it there."""
    marker = work / f"{name}.paused"
    env = {**clean_env(), "PYTHONPATH": str(REPO)}
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests/pause_harness.py"), pause, str(marker), str(STEP1),
                                 *argv(work / name, work / "data")], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, (work / f"{name}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never reached the pause point"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


@pytest.mark.parametrize("pause", ["save:4", "step:3"], ids=["mid_checkpoint_write", "between_checkpoints"])
def test_killed_run_resumes_to_the_uninterrupted_weights(reference, pause):
    work = reference
    name = pause.replace(":", "_")
    kill_at(work, name, pause)
    ckpts = work / name / "checkpoints"
    assert (ckpts / "latest").read_text() == "step00000002"  # the last COMPLETE checkpoint
    if pause == "save:4":
        # killed mid-write: the engine's files of step 4 are on disk, the checkpoint is not complete
        assert list((ckpts / "step00000004").rglob("*.pt")) and not (ckpts / "step00000004/trainer_state.json").exists()
    load_main(STEP1)([*argv(work / name, work / "data"), "--resume"])
    full = load_file(work / "full" / "model.safetensors")
    resumed = load_file(work / name / "model.safetensors")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    steps = [m["step"] for m in read_metrics(work / name) if "train/loss" in m]
    assert steps[-2:] == [3, 4]


def test_resume_refuses_other_topology_flags(reference, tmp_path):
    main = load_main(STEP1)
    out = tmp_path / "run"
    shutil.copytree(reference / "full" / "checkpoints", out / "checkpoints")
    with pytest.raises(UserError, match=r"written with sft LoRA rank 0 \(now 4\)"):
        main([*argv(out, reference / "data"), "--resume", "--lora_dim", "4"])
    with pytest.raises(UserError, match=r"written with sft ZeRO stage 0 \(now 2\)"):
        main([*argv(out, reference / "data"), "--resume", "--zero_stage", "2"])
    state_file = out / "checkpoints/step00000004/trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["topology"] == {"world_size": 1, "sft": {"zero_stage": 0, "lora_dim": 0}}
    state["topology"]["world_size"] = 2
    state_file.write_text(json.dumps(state))
    with pytest.raises(UserError, match=r"world size 2 \(now 1\).*Resume with the flags of the run"):
        main([*argv(out, reference / "data"), "--resume"])
