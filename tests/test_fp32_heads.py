"""The critic's / reward model's score head and the likelihood term compute in float32 in a bf16 run (issue 29,
item 4).

DeepSpeed's bf16 engines cast every parameter to bf16 (only buffers can stay float32), so the head's weights
are bf16 there; the head's forward (``Fp32Linear``) computes ``hidden.float() @ W.float()ᵀ + b`` instead of a
bf16 linear whose output is rounded to bf16 (2^-9 relative) before ``.float()``.  Checked on the bf16 step-3
critic engine and a bf16 reward model with a likelihood term, against float32 arithmetic on the same bf16
hidden states and weights."""

from __future__ import annotations

import pytest
import torch

from marlhf import embedded
from marlhf.models.forward import token_values
from marlhf.models.heads import Fp32Linear
from marlhf.models.loading import load_reward_model, load_tokenizer

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def nano():
    return embedded.prepare(size="nano").model_dir


def batch(vocab: int, rows: int = 3, width: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(5, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding in one row
    return ids, mask


def test_the_bf16_critic_engine_computes_its_value_head_in_float32(nano, tmp_path):
    from ppo_harness import make_trainer, rlhf_args

    t = make_trainer(rlhf_args(nano, tmp_path / "run", dtype="bf16"))
    critic = t.rlhf.critic
    inner = critic.module
    assert type(inner.score) is Fp32Linear
    assert inner.score.weight.dtype == torch.bfloat16  # DeepSpeed cast the head with the rest: the forward is fp32
    ids, mask = batch(inner.config.vocab_size)
    base = getattr(inner, inner.base_model_prefix)
    with torch.no_grad():
        hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
        assert hidden.dtype == torch.bfloat16
        # values of about ±8, the scale where the issue measured ±0.02 of bf16 rounding
        scale = 8.0 / (hidden.float() @ inner.score.weight.float().T).abs().max()
        inner.score.weight.mul_(scale.to(torch.bfloat16))
        W = inner.score.weight.float()
        want = (hidden.float() @ W.T).squeeze(-1)  # float32 arithmetic on the same bf16 inputs
        old = torch.nn.functional.linear(hidden, inner.score.weight).squeeze(-1).float()  # the former bf16 head
        got = token_values(critic, ids, mask)
    assert got.dtype == torch.float32
    assert got.abs().max() > 4
    real = mask.bool()  # (hidden states at padding depend on the attention path; nothing reads them)
    err = (got - want)[real].abs().max().item()
    assert err <= 8 * 2 ** -20, err  # float32 rounding of |V| ≈ 8 (a few ulps)
    old_err = (old - want)[real].abs().max().item()
    assert old_err > 1000 * max(err, 2 ** -24) and old_err > 4e-3, (old_err, err)  # bf16: ~2^-9 · 8


def test_a_bf16_reward_models_likelihood_term_is_float32_on_the_bf16_hidden_states(nano):
    tok = load_tokenizer(str(nano), EOT)
    model = load_reward_model(str(nano), tok, likelihood_term=True).eval()
    with torch.no_grad():
        model.likelihood.scale.fill_(0.7)
    model = model.to(torch.bfloat16)
    assert type(model.likelihood.lm_head) is Fp32Linear and type(model.score) is Fp32Linear
    ids, mask = batch(model.config.vocab_size)
    start = torch.tensor([4, 6, 5])
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = token_values(model, ids, mask, start)
        # float32 reference on the same bf16 hidden states: head value + 0.7 · cumulative answer log-probs
        head = (hidden.float() @ model.score.weight.float().T).squeeze(-1)
        logp = torch.log_softmax(hidden.float() @ model.likelihood.lm_head.weight.float().T, dim=-1)
        picked = logp[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)  # column t: log p(token t + 1)
        column = torch.arange(1, ids.shape[1])[None]
        answer = (column >= start[:, None]) & mask[:, 1:].bool()
        want = head + model.likelihood.scale.float() * torch.nn.functional.pad((picked * answer).cumsum(1), (1, 0))
        old_logp = torch.log_softmax(model.likelihood.lm_head.__class__.__mro__[1].forward(
            model.likelihood.lm_head, hidden).float(), dim=-1)  # nn.Linear's bf16 forward: the former term
        old = old_logp[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    assert got.dtype == torch.float32
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=2e-6, atol=2e-5)
    assert (old - picked).abs().max() > 100 * 2e-6  # the bf16 projection's rounding, for scale
