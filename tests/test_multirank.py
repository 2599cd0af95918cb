"""Steps 1 and 2 under the real ``deepspeed`` launcher: CPU ranks over gloo (docs/design.md "Runs without a GPU").

Covered: ZeRO-2, ZeRO-3 (export gathers full tensors), a two-node launch simulated on this machine
(hostfile + one ``--no_ssh`` launcher per node) that also runs ZeRO-2 + CPU offload (DeepSpeedCPUAdam) — one
launch for both keeps the file's time down — and the reward model under ZeRO-3.  Every step-1 run uses the
same seed, data and global batch (2 ranks x 4), so they must agree with each other, and every exported
model must reproduce the evaluation the run logged at its last step.

Master ports 29641-29645 are reserved for this file (29621 is test_step3's).  On a fresh machine the
offload run first compiles DeepSpeed's cpu_adam op (~1 min, cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, STEP1, STEP2, TINY_DATA, deepspeed_cmd, run_launcher
from safetensors.torch import load_file

from marlhf.utils.tracking import read_metrics

pytestmark = pytest.mark.slow

STEPS = 4
COMMON = ["--data_path", TINY_DATA, "--max_seq_len", "256", "--per_device_train_batch_size", "4",
          "--per_device_eval_batch_size", "8", "--max_eval_samples", "16", "--max_steps", str(STEPS),
          "--eval_interval", str(STEPS), "--disable_progress_bar", "--seed", "1"]


@pytest.fixture(scope="module")
def work(embedded, tmp_path_factory) -> Path:
    """One folder per module: the tokenized-data cache is built by the first run and reused by the rest."""
    return tmp_path_factory.mktemp("multirank")


def run_argv(work: Path, name: str, *extra: str) -> list[str]:
    return [*COMMON, "--output_dir", str(work / name), "--data_output_path", str(work / "data"), *extra]


def train_losses(out: Path) -> list[float]:
    rows = [m for m in read_metrics(out) if "train/loss" in m]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    return [m["train/loss"] for m in rows]


def final_eval(out: Path) -> dict:
    rows = [m for m in read_metrics(out) if m["step"] == STEPS and any(k.startswith("eval/") for k in m)]
    assert len(rows) == 1, read_metrics(out)
    return rows[0]


@functools.cache
def eval_items(work: Path, args_cls, phase: int) -> list[dict]:
    """The held-out examples the run evaluated on, read through the pipeline (its cache is warm by now)."""
    from marlhf.cli._run import data_section
    from marlhf.config import parse_args
    from marlhf.data.pipeline import build_phase_data
    from marlhf.embedded import default_model
    from marlhf.models.loading import load_tokenizer_and_format

    args, _ = parse_args(args_cls, run_argv(work, "unused"))
    tok, fmt = load_tokenizer_and_format(default_model(args.model_name_or_path), args.end_of_conversation_token,
                                         args.prompt_format)
    items = build_phase_data(data_section(args, fmt), tok, phase).eval
    assert len(items) == 16
    return items


def reference_perplexity(model, items: list[dict]) -> float:
    """Slow reference: one unpadded sequence at a time, NLL of every response token given its prefix."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for item in items:
            ids = torch.tensor(item["input_ids"])
            start = item["response_start"]  # token t is predicted by the logits at t - 1
            logp = F.log_softmax(model(input_ids=ids[None]).logits[0, start - 1:-1].double(), dim=-1)
            nll -= logp.gather(1, ids[start:, None]).sum().item()
            count += len(ids) - start
    return math.exp(nll / count)


@functools.cache
def initial_weights(embedded) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded.model_dir).state_dict()


def check_sft_run(out: Path, work: Path, embedded) -> None:
    """What every step-1 run must show: it learned, and its export is the full, trained model."""
    from transformers import AutoModelForCausalLM

    from marlhf.config import SFTArgs

    losses = train_losses(out)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses  # measured: 7.61 -> 6.46
    first_eval = next(m for m in read_metrics(out) if m["step"] == 0 and "eval/perplexity" in m)
    last_eval = final_eval(out)
    assert last_eval["eval/perplexity"] < first_eval["eval/perplexity"] / 2  # measured: 2016 -> 668

    saved = load_file(out / "model.safetensors")  # the file itself: full tensors, not ZeRO partitions
    init = initial_weights(embedded)
    assert saved.keys() == init.keys()
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in init.items()}
    moved = [k for k in init if not torch.equal(saved[k], init[k])]
    assert len(moved) == len(init)  # 4 AdamW steps move every tensor

    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(p, saved[k]) for k, p in model.state_dict().items())
    # the exported weights are the trained ones: they reproduce the perplexity the ranks logged at step 4
    ppl = reference_perplexity(model, eval_items(work, SFTArgs, 1))
    assert ppl == pytest.approx(last_eval["eval/perplexity"], rel=1e-4)


# ------------------------------------------------------------------------------------------------ step 1
@pytest.fixture(scope="module")
def zero2(work):
    run_launcher([*deepspeed_cmd(2, 29641), str(STEP1), *run_argv(work, "zero2", "--zero_stage", "2")],
                 timeout=300)
    return work / "zero2"


@pytest.fixture(scope="module")
def zero3(work):
    run_launcher([*deepspeed_cmd(2, 29642), str(STEP1), *run_argv(work, "zero3", "--zero_stage", "3",
                                                                  "--save_steps", str(STEPS))], timeout=300)
    return work / "zero3"


def test_two_ranks_zero2(zero2, work, embedded):
    check_sft_run(zero2, work, embedded)
    assert "world 2" in (zero2 / "train.log").read_text()


def test_two_ranks_zero3_exports_gathered_weights(zero3, work, embedded):
    check_sft_run(zero3, work, embedded)


def test_two_ranks_zero3_checkpoint_exports_the_trained_model(zero3, tmp_path):
    """marlhf export --from_checkpoint merges the two ranks' ZeRO-3 partitions into the trained model."""
    from transformers import AutoModelForCausalLM

    from marlhf.models.card import export_step_output

    engine = zero3 / "checkpoints" / f"step{STEPS:08d}" / "sft"
    assert sorted(p.name for p in engine.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    dest = export_step_output(zero3, tmp_path / "from_ckpt", from_checkpoint=True)
    ids = torch.tensor([[5, 17, 33, 9, 101, 7]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(zero3)(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(dest)(input_ids=ids).logits
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------ two nodes, one machine
def run_nodes(cmds: list[list[str]], logs: list[Path], timeout: int) -> list[str]:
    """Start one launcher per node at once; wait for all; kill the rest if one fails or time runs out."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as fh:  # files, not pipes: a full pipe would block a rank mid-collective
            procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                          start_new_session=True))
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now  # the other node now waits on a dead peer: give it a moment, then stop it
            if now > deadline or (failed_at is not None and now > failed_at + 20):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
    outputs = [log.read_text() for log in logs]
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), "\n\n".join(f"node {i} exit {c}:\n{o[-3000:]}"
                                                   for i, (c, o) in enumerate(zip(codes, outputs)))
    return outputs


@pytest.fixture(scope="module")
def two_nodes(work):
    """ZeRO-2 with --offload: DeepSpeed itself refuses ZeRO-Offload with any optimizer but DeepSpeedCPUAdam/
    Lion (zero_force_ds_cpu_optimizer defaults to true), so a finished run shows make_optimizer chose it."""
    hostfile = work / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    launcher = shutil.which("deepspeed")
    assert launcher, "the deepspeed launcher is not on PATH"
    # node-b gets its own --output_dir, so whatever lands in node-a's was written by global rank 0.  The
    # data cache stays shared: rank 0 builds it and the other ranks read it (a shared filesystem is assumed)
    cmds = [[launcher, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
             "127.0.0.1", "--master_port", "29643", str(STEP1),
             *run_argv(work, f"node{node}", "--zero_stage", "2", "--offload")] for node in (0, 1)]
    outputs = run_nodes(cmds, [work / "node0.log", work / "node1.log"], timeout=400)
    return work / "node0", work / "node1", outputs


def test_two_nodes_one_rank_each_with_cpu_offload(two_nodes, work, embedded):
    node0, node1, outputs = two_nodes
    for node, out in enumerate(outputs):
        assert f"node_rank={node}" in out and "dist_world_size=2" in out  # DeepSpeed launcher's log
    check_sft_run(node0, work, embedded)
    assert '"offload": true' in (node0 / "args.json").read_text()
    assert not (node1 / "model.safetensors").exists() and not (node1 / "metrics.jsonl").exists()


def test_zero3_and_two_nodes_offload_train_the_same_model_as_zero2(zero2, zero3, two_nodes, embedded):
    """Same seed, data order and global batch: neither partitioning, offload nor node layout may change the
    result (and the two launchers formed one world of two ranks, not two worlds of one)."""
    ref_losses = train_losses(zero2)
    ref = load_file(zero2 / "model.safetensors")
    init = initial_weights(embedded)
    update = torch.cat([(ref[k] - init[k]).flatten() for k in init]).norm()
    for run in (zero3, two_nodes[0]):
        # measured: identical losses; weight difference norm <= 1.5e-5 (reduction order) vs update 3.3
        assert train_losses(run) == pytest.approx(ref_losses, rel=1e-4)
        other = load_file(run / "model.safetensors")
        diff = torch.cat([(other[k] - ref[k]).flatten() for k in init]).norm()
        assert diff < 0.01 * update, (run.name, diff.item(), update.item())


# ------------------------------------------------------------------------------------------------ step 2
def test_reward_model_two_ranks_zero3(work, embedded):
    from transformers import AutoModelForSequenceClassification

    from marlhf.config import RewardArgs

    out = work / "rm_zero3"
    run_launcher([*deepspeed_cmd(2, 29644), str(STEP2), *run_argv(work, "rm_zero3", "--zero_stage", "3")],
                 timeout=300)
    losses = train_losses(out)
    assert all(math.isfinite(x) for x in losses)

    saved = load_file(out / "model.safetensors")
    init = AutoModelForSequenceClassification.from_pretrained(embedded.model_dir, num_labels=1).state_dict()
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in init.items()}
    assert saved["score.weight"].shape == (1, init["model.embed_tokens.weight"].shape[1])
    moved = [k for k in init if k != "score.weight" and not torch.equal(saved[k], init[k])]
    assert len(moved) == len(init) - 1  # every backbone tensor trained (the head starts random anyway)

    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1
    # plain transformers' scores on the held-out pairs reproduce what the two ranks logged at step 4
    logged = final_eval(out)
    chosen, rejected = [], []
    with torch.no_grad():
        for item in eval_items(work, RewardArgs, 2):
            chosen.append(model(input_ids=torch.tensor([item["chosen_ids"]])).logits.item())
            rejected.append(model(input_ids=torch.tensor([item["rejected_ids"]])).logits.item())
    chosen, rejected = torch.tensor(chosen), torch.tensor(rejected)
    assert chosen.mean().item() == pytest.approx(logged["eval/chosen_score"], abs=1e-4)
    assert rejected.mean().item() == pytest.approx(logged["eval/rejected_score"], abs=1e-4)
    assert (chosen > rejected).float().mean().item() == pytest.approx(logged["eval/accuracy"], abs=1e-6)


def test_reward_model_with_likelihood_term_two_ranks_zero3(work, embedded):
    """--likelihood_term under ZeRO-3 on two ranks: the term's head and α are partitioned, trained and gathered
    into the export, and the folder loaded back with its term reproduces the scores the ranks logged."""
    from marlhf.config import RewardArgs
    from marlhf.models.forward import sequence_scores
    from marlhf.models.loading import load_reward_model, load_tokenizer

    out = work / "rm_ll_zero3"
    run_launcher([*deepspeed_cmd(2, 29645), str(STEP2), *run_argv(work, "rm_ll_zero3", "--zero_stage", "3",
                                                                  "--likelihood_term", "--learning_rate", "1e-4")],
                 timeout=300)
    saved = load_file(out / "model.safetensors")
    start = load_file(Path(embedded.model_dir) / "model.safetensors")["lm_head.weight"]
    head = saved["likelihood.lm_head.weight"]
    assert head.shape[1] == start.shape[1] and head.shape[0] >= start.shape[0]
    assert not torch.equal(head[:start.shape[0]], start)  # trained from the LM head it started as
    assert saved["likelihood.scale"].item() != 1.0
    model = load_reward_model(str(out), load_tokenizer(str(out))).eval()
    logged = final_eval(out)
    chosen, rejected = [], []
    with torch.no_grad():
        for item in eval_items(work, RewardArgs, 2):
            for ids, first, scores in ((item["chosen_ids"], item["chosen_start"], chosen),
                                       (item["rejected_ids"], item["rejected_start"], rejected)):
                ids = torch.tensor([ids])
                scores.append(sequence_scores(model, ids, torch.ones_like(ids), torch.tensor([first])).item())
    chosen, rejected = torch.tensor(chosen), torch.tensor(rejected)
    assert chosen.mean().item() == pytest.approx(logged["eval/chosen_score"], abs=1e-4)
    assert rejected.mean().item() == pytest.approx(logged["eval/rejected_score"], abs=1e-4)
    assert (chosen > rejected).float().mean().item() == pytest.approx(logged["eval/accuracy"], abs=1e-6)
