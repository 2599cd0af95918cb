"""DPO / IPO (paper App. C.3): losses and response log-probs vs loop references, the pair data, and a short
end-to-end run of training/step2_dpo_finetuning/main.py on the embedded tiny model (one rank, DeepSpeed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_DATA, load_main

from marlhf.config import DPOArgs, parse_args
from marlhf.data.pipeline import ResumableSampler
from marlhf.dpo import DPOCollator, preference_loss, sequence_logprobs
from marlhf.errors import ConfigError
from marlhf.utils.tracking import read_metrics

STEP2_DPO = REPO / "training/step2_dpo_finetuning/main.py"
SEEDS = [0, 1, 2]


# ---------------------------------------------------------------- losses
def log_ratios(seed: int, B: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [-20 * torch.rand(B, generator=g, dtype=torch.float64) for _ in range(4)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 0.01, 1.0])
def test_dpo_sigmoid_loss_matches_loop(seed, beta):
    pc, pr, rc, rr = log_ratios(seed)
    loss, stats = preference_loss("sigmoid", pc, pr, rc, rr, beta)
    per_pair, correct = [], 0
    for i in range(len(pc)):
        h = (pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item())
        per_pair.append(math.log1p(math.exp(-beta * h)))  # -log σ(βh)
        correct += h > 0
    assert loss.item() == pytest.approx(sum(per_pair) / len(per_pair), rel=1e-12)
    assert stats["accuracy"].item() == pytest.approx(correct / len(pc))
    assert stats["chosen_reward"].item() == pytest.approx(beta * (pc - rc).mean().item())
    assert stats["rejected_reward"].item() == pytest.approx(beta * (pr - rr).mean().item())
    assert stats["margin"].item() == pytest.approx(stats["chosen_reward"].item() - stats["rejected_reward"].item())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 0.01])
def test_ipo_loss_matches_loop(seed, beta):
    pc, pr, rc, rr = log_ratios(seed)
    loss, _ = preference_loss("ipo", pc, pr, rc, rr, beta)
    per_pair = [((pc[i] - rc[i]) - (pr[i] - rr[i]) - 1 / (2 * beta)).item() ** 2 for i in range(len(pc))]
    assert loss.item() == pytest.approx(sum(per_pair) / len(per_pair), rel=1e-12)


def test_losses_at_the_reference_and_their_gradients():
    """Policy = reference (h = 0): DPO is log 2 with gradient -β/2 per pair on log π(y⁺); IPO is 1/(4β²)
    with gradient 2(0 - 1/(2β)) = -1/β; the reference gets no gradient."""
    beta = 0.1
    for kind, value, grad in (("sigmoid", math.log(2), -beta / 2), ("ipo", 1 / (4 * beta ** 2), -1 / beta)):
        pc, pr = torch.full((4,), -3.0, requires_grad=True), torch.full((4,), -5.0, requires_grad=True)
        rc, rr = torch.full((4,), -3.0, requires_grad=True), torch.full((4,), -5.0, requires_grad=True)
        loss, stats = preference_loss(kind, pc, pr, rc, rr, beta)
        loss.backward()
        assert loss.item() == pytest.approx(value)
        torch.testing.assert_close(pc.grad, torch.full((4,), grad / 4))  # mean over 4 pairs
        torch.testing.assert_close(pr.grad, torch.full((4,), -grad / 4))
        assert rc.grad is None and rr.grad is None
        assert stats["accuracy"].item() == 0.0 and stats["margin"].item() == 0.0
    with pytest.raises(ValueError, match="dpo_loss='hinge'"):
        preference_loss("hinge", pc, pr, rc, rr, beta)
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss("sigmoid", pc, pr, rc, rr, 0.0)


# ---------------------------------------------------------------- pairs and log-probs
PAIRS = [  # prompt tokens 1-4 (lengths differ), responses of several lengths, pad id 0
    {"chosen_ids": [1, 2, 3, 7, 8, 9], "chosen_start": 3, "rejected_ids": [1, 2, 3, 5], "rejected_start": 3},
    {"chosen_ids": [4, 4, 6], "chosen_start": 2, "rejected_ids": [4, 4, 9, 9, 9, 9, 9], "rejected_start": 2},
]


def test_collator_masks_prompt_and_padding():
    batch = DPOCollator(0)(PAIRS)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 8, 9, 0], [4, 4, 6, 0, 0, 0, 0],
                                           [1, 2, 3, 5, 0, 0, 0], [4, 4, 9, 9, 9, 9, 9]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 7, 8, 9, -100], [-100, -100, 6, -100, -100, -100, -100],
                                        [-100, -100, -100, 5, -100, -100, -100], [-100, -100, 9, 9, 9, 9, 9]]


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_logprobs_match_loop_and_ignore_prompt_and_padding(seed):
    batch = DPOCollator(0)(PAIRS)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 7, 12, generator=g, dtype=torch.float64)
    got = sequence_logprobs(logits[:, :-1], batch["labels"][:, 1:])
    rows = [(p["chosen_ids"], p["chosen_start"]) for p in PAIRS] + [(p["rejected_ids"], p["rejected_start"])
                                                                      for p in PAIRS]
    for b, (ids, start) in enumerate(rows):
        want = 0.0
        for t in range(start, len(ids)):  # response token t is predicted by position t - 1
            row = logits[b, t - 1].tolist()
            want += row[ids[t]] - math.log(sum(math.exp(x) for x in row))
        assert got[b].item() == pytest.approx(want, rel=1e-12)
    # logits at positions that predict prompt tokens, or that follow the last real token, do not matter
    noisy = logits.clone()
    for b, (ids, start) in enumerate(rows):
        noisy[b, :start - 1] = 1e3 * torch.randn(start - 1, 12, generator=g, dtype=torch.float64)
        noisy[b, len(ids):] = float("nan")
    torch.testing.assert_close(sequence_logprobs(noisy[:, :-1], batch["labels"][:, 1:]), got)


def test_phase2_pairs_record_where_each_response_starts(embedded, tmp_path):
    from marlhf.cli._run import data_section
    from marlhf.data.pipeline import build_phase_data
    from marlhf.embedded import default_model
    from marlhf.models.loading import load_tokenizer_and_format

    args, _ = parse_args(DPOArgs, ["--data_path", "synthetic:num_records=60", "--data_output_path", str(tmp_path),
                                   "--max_seq_len", "256", "--output_dir", str(tmp_path / "out")])
    tok, fmt = load_tokenizer_and_format(default_model(""), "", "auto")
    data = build_phase_data(data_section(args, fmt), tok, phase=2)
    for item in data.train[:10]:
        c, r, cs, rs = item["chosen_ids"], item["rejected_ids"], item["chosen_start"], item["rejected_start"]
        assert 0 < cs < len(c) and 0 < rs < len(r)
        assert c[:cs] == r[:rs]  # the same prompt tokens
        text = tok.decode(c[:cs])
        assert text.rstrip().endswith("TL;DR:") or "Assistant" in text, text[-40:]


# ---------------------------------------------------------------- flags
def test_dpo_flags():
    args, _ = parse_args(DPOArgs, ["--beta", "0.01", "--dpo_loss", "ipo"])
    assert (args.beta, args.dpo_loss, args.ref_model_name_or_path, args.learning_rate) == (0.01, "ipo", "", None)
    with pytest.raises(ConfigError, match="--beta must be > 0"):
        parse_args(DPOArgs, ["--beta", "0"])


def test_dpo_default_learning_rates():
    from marlhf.config import RewardArgs, SFTArgs
    from marlhf.utils.ds_engine import default_learning_rate

    assert [parse_args(c, [])[0].engine().stage for c in (SFTArgs, RewardArgs, DPOArgs)] == ["sft", "reward", "dpo"]
    assert default_learning_rate("dpo", 5_000_000) == 1e-4  # the embedded tiny model
    assert default_learning_rate("dpo", 2_500_000_000) == 2e-7  # App. C.3, Gemma-2B


# ---------------------------------------------------------------- end to end
COMMON = ["--data_path", TINY_DATA, "--max_seq_len", "256", "--per_device_train_batch_size", "8",
          "--per_device_eval_batch_size", "16", "--max_eval_samples", "64", "--disable_progress_bar", "--seed", "1",
          "--learning_rate", "1e-3"]


@pytest.fixture(scope="module")
def dpo_run(embedded, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    load_main(STEP2_DPO)([*COMMON, "--output_dir", str(out / "model"), "--data_output_path", str(out / "data"),
                          "--max_steps", "3", "--beta", "0.1"])
    return out


def test_dpo_run_raises_the_margin_on_its_training_pairs(dpo_run, embedded):
    from transformers import AutoModelForCausalLM

    model_dir = dpo_run / "model"
    train = [m for m in read_metrics(model_dir) if "train/loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3]
    # step 1 is scored before any update: the policy is its reference (the model it started from)
    assert train[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert train[0]["train/margin"] == pytest.approx(0.0, abs=1e-6)
    evals = [m for m in read_metrics(model_dir) if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 3] and evals[0]["eval/margin"] == pytest.approx(0.0, abs=1e-6)
    # the 24 pairs the 3 steps trained on, re-scored with the exported policy in plain transformers against the
    # reference: chosen answers gained log-probability relative to rejected ones (measured: margin 0 -> ~0.05)
    data = torch.load(next((dpo_run / "data").glob("reward_*.pt")), weights_only=False)["train"]
    sampler = ResumableSampler(len(data), 1)
    seen = [data[i] for i in list(sampler)[:24]]
    batch = DPOCollator(0)(seen)
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reference = AutoModelForCausalLM.from_pretrained(embedded.model_dir).eval()
    with torch.no_grad():
        # every column projected here (plain transformers), only the answer's in training
        full = {m: m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
                for m in (policy, reference)}
        pc, pr = sequence_logprobs(full[policy], batch["labels"][:, 1:]).chunk(2)
        rc, rr = sequence_logprobs(full[reference], batch["labels"][:, 1:]).chunk(2)
    _, stats = preference_loss("sigmoid", pc, pr, rc, rr, 0.1)
    assert stats["margin"].item() > 0.01 and stats["accuracy"].item() > 0.6, stats


def test_dpo_output_is_a_plain_hf_model_with_its_conversation_format(dpo_run, embedded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = dpo_run / "model"
    fmt = json.loads((model_dir / "conversation_format.json").read_text())
    assert fmt == {"end_of_conversation_token": "<|endoftext|>", "prompt_format": "raw"}
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.convert_tokens_to_ids("<|endoftext|>") in model.generation_config.eos_token_id
    base = AutoModelForCausalLM.from_pretrained(embedded.model_dir).state_dict()
    moved = [n for n, p in model.state_dict().items() if not torch.equal(p, base[n])]
    assert len(moved) > 10


def test_ipo_run_starts_at_its_reference_value(embedded, tmp_path):
    load_main(STEP2_DPO)([*COMMON, "--output_dir", str(tmp_path / "model"), "--data_output_path",
                          str(tmp_path / "data"), "--max_steps", "2", "--beta", "0.5", "--dpo_loss", "ipo",
                          "--max_eval_samples", "16"])
    train = [m for m in read_metrics(Path(tmp_path / "model")) if "train/loss" in m]
    assert train[0]["train/loss"] == pytest.approx(1.0, abs=1e-5)  # (0 - 1/(2·0.5))² at the reference
    assert train[1]["train/margin"] > 0  # one update moved the log-ratio margin toward IPO's target 1/(2β)
