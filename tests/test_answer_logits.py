"""Only the columns that predict an answer token are projected onto the vocabulary (steps 1, 3 and DPO).

The SFT loss, the DPO sequence log-probs and step 3's log π(a_t | s_t) ask the model for the logits of those
columns alone (``next_token_logits``).  Checked against a loop over the full logits of plain transformers, on
right-padded SFT batches and left-padded rollouts, for the architectures of the embedded sizes and Gemma-2,
whose logits are soft-capped after the projection; and a hook on the output projection shows how many columns
it saw."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from marlhf.data.pipeline import SFTCollator
from marlhf.dpo import labelled_logprobs
from marlhf.models.forward import first_labelled_column, position_ids_from_mask
from marlhf.rlhf.rollout import policy_logprobs
from marlhf.supervised import answer_nll, sft_count, sft_loss

V = 37
ARCHS = {
    "llama": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, tie_word_embeddings=False),
    "gemma": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16),
    "gemma2": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, final_logit_softcapping=2.0),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2),
}
# (prompt, answer) lengths: the earliest answer starts at column 2, the latest at 7
ROWS = [(2, 5), (7, 3), (4, 1), (5, 4)]


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               **ARCHS[arch])
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if arch == "gemma2":
        assert model.config.final_logit_softcapping == 2.0  # the cap bites: logits end up within ±2
        return model  # float32: in float64, transformers' Gemma-2 makes whole left-padded rows NaN
    return model.double()


def _tol(model) -> float:
    return 1e-12 if model.dtype == torch.float64 else 2e-5


def _assert_close(got: torch.Tensor, want: list, model) -> None:
    tol = _tol(model)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=tol, atol=tol)


def _sft_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(3, V, (p + a,), generator=g).tolist(), "response_start": p}
            for p, a in ROWS]
    return SFTCollator(0)(rows), rows


def _projected_columns(model) -> list[int]:
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    return seen


def _logp(row: list[float], token: int) -> float:
    return row[token] - math.log(sum(math.exp(x) for x in row))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_sft_nll_and_dpo_logprobs_match_a_loop_over_full_logits(arch):
    model = _model(arch)
    batch, rows = _sft_batch(1)
    with torch.no_grad():
        full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if arch == "gemma2":
            assert full.abs().max() < 2.0
        per_row = []
        for b, row in enumerate(rows):  # answer token t is predicted by column t - 1
            ids, start = row["input_ids"], row["response_start"]
            per_row.append(sum(_logp(full[b, t - 1].tolist(), ids[t]) for t in range(start, len(ids))))
        columns = _projected_columns(model)
        nll, count = answer_nll(model, batch)
        count = count.item()  # a device tensor: the training loop reads nothing per micro-batch
        assert count == sft_count(batch) == sum(a for _, a in ROWS)
        assert nll.item() == pytest.approx(-sum(per_row), rel=_tol(model))
        loss, metrics = sft_loss(model, batch)
        assert loss.item() == pytest.approx(-sum(per_row) / count, rel=_tol(model)) == metrics["loss"].item()
        start = first_labelled_column(batch["labels"])
        assert start == 1  # the earliest answer token is at column 2
        got = labelled_logprobs(model, batch)
    T = batch["input_ids"].shape[1]
    assert columns == [T - 1 - start] * 3  # not the T columns of the full forward
    _assert_close(got, per_row, model)


def test_sft_loss_backpropagates_only_through_answer_predictions():
    """The loss is unchanged and its gradient too when the prompt's predictions are never computed."""
    model = _model("llama").train()
    batch, _ = _sft_batch(2)
    loss, _ = sft_loss(model, batch)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = torch.nn.functional.cross_entropy(full[:, :-1].transpose(1, 2), batch["labels"][:, 1:])  # mean, -100 out
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)


def test_a_batch_without_answer_tokens_gives_a_zero_loss_not_nan():
    model = _model("llama")
    batch, _ = _sft_batch(3)
    batch["labels"][:] = -100
    assert first_labelled_column(batch["labels"]) == batch["labels"].shape[1] - 1
    loss, _ = sft_loss(model, batch)
    assert loss.item() == 0.0 and answer_nll(model, batch)[1] == 0


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_rollout_logprobs_match_a_loop_over_full_logits(arch):
    """Step 3: left-padded prompts of width P, answers from column P (padding after an early EOS included)."""
    model = _model(arch)
    g = torch.Generator().manual_seed(4)
    P, A = 6, 5
    seq = torch.randint(3, V, (3, P + A), generator=g)
    mask = torch.ones_like(seq)
    mask[0, :2] = 0  # left padding
    mask[1, :4] = 0
    mask[2, P + 3:] = 0  # an answer that ended early
    seq[mask == 0] = 0
    with torch.no_grad():
        full = model(input_ids=seq, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        columns = _projected_columns(model)
        got = policy_logprobs(model, seq, mask, P)
    assert got.shape == (3, A) and columns == [A]
    want = [[_logp(full[b, P + t - 1].tolist(), seq[b, P + t].item()) for t in range(A)] for b in range(3)]
    _assert_close(got, want, model)
