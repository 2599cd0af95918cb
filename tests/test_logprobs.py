"""Chosen-token log-probs in chunks (issue 29, items 11 and 15): marlhf/models/logprobs.py.

* values and gradients equal the plain ``log_softmax(logits / T).gather`` to float32 rounding (float32 and bf16
  logits; float64 logits to float64 rounding), over several chunks with a remainder;
* the head path (the likelihood term) equals the plain projection + log_softmax, values and gradients of both
  the hidden states and the head's weight;
* what autograd keeps for backward, counted with ``saved_tensors_hooks``: the plain computation keeps a float32
  copy of bf16 logits, 4·N·V bytes; the chunked one keeps the logits themselves (no copy) and N float32
  normalisers; the head path keeps only the hidden states;
* ``--logprob_temperature``: ``sampling`` makes π_old the distribution the answers were drawn from (HF
  generate's temperature-scaled scores); the first PPO epoch's ratio is exactly 1 with it."""

from __future__ import annotations

import pytest
import torch

from marlhf.models.logprobs import head_token_logprobs, token_logprobs

N, V = 2 * 7, 1000


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return torch.log_softmax(x, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def inputs(dtype, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    logits = (6 * torch.randn(2, 7, vocab, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (2, 7), generator=g)
    weights = torch.randn(2, 7, generator=g, dtype=torch.float64)  # an upstream gradient
    return logits, targets, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [3 * V, 10 ** 9])  # 5 chunks (3, 3, 3, 3, 2 rows); one chunk
def test_values_and_gradients_equal_log_softmax_gather(dtype, temperature, chunk_elements):
    logits, targets, w = inputs(dtype)
    got = token_logprobs(logits, targets, temperature, chunk_elements=chunk_elements)
    (g_got,) = torch.autograd.grad((got * w.to(got.dtype)).sum(), logits)
    want = reference(logits, targets, temperature)
    (g_want,) = torch.autograd.grad((want * w.to(want.dtype)).sum(), logits)
    assert got.dtype == want.dtype and g_got.dtype == dtype
    # float64 truth on the same (rounded) logits
    exact = reference(logits.detach().double(), targets, temperature)
    leaf = logits.detach().double().requires_grad_()
    (g_exact,) = torch.autograd.grad((reference(leaf, targets, temperature) * w).sum(), leaf)
    eps = torch.finfo(got.dtype).eps
    # |log p| is at most ~60 here: a few ulps of that, the plain float32 computation's own error
    assert (got.double() - exact).abs().max() <= 64 * 8 * eps
    assert (got.double() - want.double()).abs().max() <= 64 * 8 * eps
    g_eps = torch.finfo(dtype).eps  # the gradient is returned in the logits' dtype, as the plain one's
    bound = 16 * g_eps * (1 + g_exact.abs().max())  # the plain computation is off by up to ~8 ulps too
    assert (g_got.double() - g_exact).abs().max() <= bound
    assert (g_got.double() - g_want.double()).abs().max() <= bound


def test_rejects_misaligned_targets_and_a_non_positive_temperature():
    logits, targets, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match="do not align"):
        token_logprobs(logits, targets[:, 1:])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, targets, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_path_equals_projection_then_log_softmax(dtype):
    from marlhf.models.heads import Fp32Linear

    g = torch.Generator().manual_seed(1)
    head = Fp32Linear(16, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, 16, generator=g))
    hidden = torch.randn(2, 7, 16, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (2, 7), generator=g)
    w = torch.randn(2, 7, generator=g)
    got = head_token_logprobs(head, hidden, targets, chunk_elements=4 * V)  # 4 chunks
    g_h, g_w = torch.autograd.grad((got * w).sum(), (hidden, head.weight))
    want = reference(hidden.float() @ head.weight.float().T, targets)
    r_h, r_w = torch.autograd.grad((want * w).sum(), (hidden, head.weight))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)  # bf16 grads
    torch.testing.assert_close(g_h, r_h, **tol)
    torch.testing.assert_close(g_w, r_w, **tol)
    with torch.no_grad():  # no checkpointing without grad: the same values
        torch.testing.assert_close(head_token_logprobs(head, hidden, targets, chunk_elements=4 * V), got.detach())


# ------------------------------------------------------------------------------ memory kept for backward
def saved_bytes(fn) -> int:
    """Bytes of the distinct tensor storages autograd keeps for backward while ``fn()`` runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()  # the graph is usable
    return sum(seen.values())


def plain(logits, targets):  # the former answer_logprobs
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return x.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(x, dim=-1)


@pytest.mark.parametrize("vocab", [32_000, 256_000])
def test_bf16_logits_are_kept_once_not_copied_to_float32(vocab):
    """B·A = 16 positions (the saved bytes scale with B·A·V; the numbers of the issue's B = 8, A = 512 are
    256 times these)."""
    rows = 16
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, 8, generator=g).to(torch.bfloat16).requires_grad_()
    proj = torch.randn(8, vocab, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    logits_bytes = rows * vocab * 2
    matmul = saved_bytes(lambda: (hidden @ proj).float().sum(-1))  # what the projection itself keeps
    before = saved_bytes(lambda: plain(hidden @ proj, targets)) - matmul
    after = saved_bytes(lambda: token_logprobs(hidden @ proj, targets)) - matmul
    assert before >= rows * vocab * 4  # the float32 copy of the logits
    assert logits_bytes <= after <= logits_bytes + rows * 16  # the bf16 logits, (rows,) normalisers and targets
    print(f"V={vocab}: kept for backward beyond the projection's inputs: plain {before} B, chunked {after} B")


def test_the_head_path_keeps_no_vocabulary_sized_tensor():
    from marlhf.models.heads import Fp32Linear

    vocab, rows = 256_000, 16
    head = Fp32Linear(8, vocab, bias=False).to(torch.bfloat16)
    hidden = torch.randn(rows, 8).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    got = saved_bytes(lambda: head_token_logprobs(head, hidden, targets, chunk_elements=4 * vocab))
    assert got <= hidden.untyped_storage().nbytes() + rows * 8  # the hidden states and the targets


# ------------------------------------------------------------------------------ --logprob_temperature
@pytest.fixture(scope="module")
def nano_model():
    from transformers import AutoModelForCausalLM

    from marlhf import embedded

    return AutoModelForCausalLM.from_pretrained(embedded.prepare(size="nano").model_dir).eval()


def test_policy_logprobs_are_log_softmax_of_logits_over_t(nano_model):
    from marlhf.models.forward import position_ids_from_mask
    from marlhf.rlhf.rollout import policy_logprobs

    g = torch.Generator().manual_seed(2)
    seq = torch.randint(5, nano_model.config.vocab_size, (3, 10), generator=g)
    mask = torch.ones_like(seq)
    mask[1, :2] = 0  # a left-padded prompt
    P = 4
    with torch.no_grad():
        full = nano_model(input_ids=seq, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        for T in (1.0, 0.8):
            want = torch.log_softmax(full[:, P - 1:-1].double() / T, -1).gather(-1, seq[:, P:, None]).squeeze(-1)
            got = policy_logprobs(nano_model, seq, mask, P, T)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


def test_sampling_temperature_makes_pi_old_the_distribution_that_sampled(nano_model):
    """π_old with ``--logprob_temperature sampling`` equals HF generate's own log-probs of the drawn tokens
    (temperature-scaled scores, no top-k / top-p) up to the KV cache's float32 rounding; with '1' it is off by
    far more."""

    from marlhf.rlhf.rollout import policy_logprobs
    from marlhf.rlhf.sections import logprob_temperature

    T = 0.7
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, nano_model.config.vocab_size, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = nano_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=T, top_k=0,
                                  top_p=1.0, max_new_tokens=8, output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=0, eos_token_id=nano_model.config.vocab_size)  # no stop token: no
    # suppression of it either (min_new_tokens would renormalise the scores without it)
    seq, P = out.sequences, ids.shape[1]
    sampled = torch.log_softmax(torch.stack(out.scores, 1).double(), -1).gather(-1, seq[:, P:, None]).squeeze(-1)
    attn = torch.cat([mask, torch.ones_like(seq[:, P:])], 1)
    assert logprob_temperature("sampling", T) == T and logprob_temperature("1", T) == 1.0
    with torch.no_grad():
        matched = policy_logprobs(nano_model, seq, attn, P, logprob_temperature("sampling", T))
        raw = policy_logprobs(nano_model, seq, attn, P, logprob_temperature("1", T))
    assert (matched.double() - sampled).abs().max() < 1e-5  # measured 5e-7
    assert (raw.double() - sampled).abs().max() > 0.05


def test_the_first_ppo_epoch_ratio_is_exactly_one_with_the_sampling_temperature(tmp_path):
    from ppo_harness import make_trainer, prompts, rlhf_args

    from marlhf import embedded

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path / "run", temperature=0.7, logprob_temperature="sampling")
    t = make_trainer(args)
    assert t.rollout.policy.logprob_temperature == 0.7 and t.update.policy is t.rollout.policy
    ids, mask = prompts(args, t.tokenizer, 8)
    exp, _ = t.make_experience(ids, mask, step=0)
    from marlhf.rlhf.rollout import policy_logprobs

    with torch.no_grad():
        raw = policy_logprobs(t.rlhf.actor, exp.seq, exp.attention_mask, exp.prompt_width)
    assert torch.where(exp.mask, exp.logprobs - raw, 0.0).abs().max() > 1e-3  # π_old is not the raw one
    stats = t.ppo_update([exp])  # one epoch, one micro-batch of the 8 answers, before any update
    assert stats["ratio_mean"] == 1.0 and stats["approx_kl"] == 0.0 and stats["clipfrac"] == 0.0
