"""Step 3 on two ranks at the scale path's settings, end to end through the launcher: the trained SFT policy's
answers end at different lengths on each rank (so each rank has its own number of macro boundaries), with
gradient accumulation, bf16, the EMA, a checkpoint every step, the critic checked against Monte-Carlo values
(``--critic_mc_check``: a generate and a score per chunk of boundaries, collective under ZeRO-3) and export.

* ZeRO-3 actor and critic (the 7B script's placement): before, the first generation aborted (gloo: "Received
  data size doesn't match expected size") and the Monte-Carlo chunks differed in number between ranks;
* ZeRO-2 actor beside a ZeRO-3 EMA / reference offloaded to the CPU (``--offload_reference_model``): the EMA's
  export copied empty partitions;
* both: a run stopped after step 1 and resumed ends with the uninterrupted run's weights, bit for bit."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import STEP3, deepspeed_cmd, run_launcher
from safetensors.torch import load_file

from marlhf.utils.tracking import read_metrics

pytestmark = pytest.mark.slow


def _argv(sft, out, *extra):
    return ["--actor_model_name_or_path", str(sft), "--reward_source", "gold",
            "--data_path", "synthetic:num_records=400", "--data_output_path", str(out / "data"),
            "--output_dir", str(out), "--max_prompt_seq_len", "160", "--max_answer_seq_len", "64",
            "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--dtype", "bf16", "--ngram", "16", "--critic_mc_check", "1",
            "--enable_ema", "--max_steps", "2", "--save_steps", "1", "--keep_checkpoints", "5",
            "--max_eval_samples", "4", "--disable_progress_bar", "--seed", "5", *extra]


@pytest.mark.parametrize("placement", [
    ("--actor_zero_stage", "3", "--critic_zero_stage", "3"),
    ("--actor_zero_stage", "2", "--critic_zero_stage", "2", "--offload_reference_model"),
], ids=["zero3", "zero2-offloaded-ema"])
def test_two_ranks_train_checkpoint_resume_and_export(placement, quickstart_sft, tmp_path):
    port = 29631 if "3" in placement[1] else 29632
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    run_launcher([*deepspeed_cmd(2, port), str(STEP3), *_argv(quickstart_sft, full, *placement)], timeout=900)
    rows = [m for m in read_metrics(full) if "train/actor_loss" in m]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["train/eos_rate"] <= 1 and r["train/response_len"] < 64  # answers ended, at their own lengths
        assert r["train/mc_continuations"] > 0 and -1 <= r["train/critic_mc_corr"] <= 1
    # resume from step 1's checkpoint: the same final weights as the uninterrupted run
    shutil.copytree(full / "checkpoints/step00000001", stopped / "checkpoints/step00000001")
    (stopped / "checkpoints/latest").write_text("step00000001")
    shutil.copy(full / "initial_policy.json", stopped / "initial_policy.json")
    run_launcher([*deepspeed_cmd(2, port), str(STEP3), *_argv(quickstart_sft, stopped, *placement), "--resume"],
                 timeout=900)
    assert [m["step"] for m in read_metrics(stopped) if "train/actor_loss" in m] == [2]
    for part in ("actor", "critic", "actor_ema"):
        a = load_file(full / part / "model.safetensors")
        b = load_file(stopped / part / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    # the EMA export holds weights (not empty partitions), between the SFT model's and the actor's
    ema, actor = load_file(full / "actor_ema/model.safetensors"), load_file(full / "actor/model.safetensors")
    sft = load_file(quickstart_sft / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert ema[name].shape == sft[name].shape and not torch.equal(ema[name], sft[name])
    assert (ema[name].float() - sft[name].float()).norm() < (actor[name].float() - sft[name].float()).norm()
