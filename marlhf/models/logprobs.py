"""Log-probabilities of chosen tokens without a (tokens × vocabulary) float32 tensor kept for backward.

The plain computation, ``logits.float().gather(target) - logsumexp(logits.float())``, keeps the float32 copy
of the logits for its backward: with Gemma's 256k vocabulary, 8 answers of 512 tokens in bf16 that is 4 GB
next to the model's own 2 GB of bf16 logits, and the backward allocates three more float32 tensors of that
size (softmax, one-hot, their sum) before casting the gradient back.  :func:`token_logprobs` instead works
through the positions in chunks of a bounded number of elements: forward keeps only the logits as the model
returned them (no copy: the same tensor) and one float32 log-normaliser per position; backward recomputes each
chunk's softmax in float32 and writes the gradient straight into a tensor of the logits' dtype.  Values and
gradients are the plain computation's to float32 rounding (tests/test_logprobs.py, with the measured memory).
"""

from __future__ import annotations

import torch

# Elements of one chunk's float32 temporaries: 2**25 = 128 MiB each (64 positions of a 256k vocabulary per
# chunk, so a few dozen chunks for a whole micro-batch; the Python loop is over chunks, never over tokens).
CHUNK_ELEMENTS = 1 << 25


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # float32, or float64 for float64 logits


def _rows(n: int, vocab: int, chunk_elements: int) -> int:
    return max(1, min(n, chunk_elements // max(vocab, 1)))


class _SelectedLogProb(torch.autograd.Function):
    """(N, V) logits, (N,) targets → (N,) log_softmax(logits / T)[target], chunked over N."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, chunk_elements: int):
        n, vocab = logits.shape
        cdt = _compute_dtype(logits.dtype)
        out = torch.empty(n, dtype=cdt, device=logits.device)
        lse = torch.empty(n, dtype=cdt, device=logits.device)
        step = _rows(n, vocab, chunk_elements)
        for s in range(0, n, step):
            x = logits[s:s + step].to(cdt)
            if temperature != 1.0:
                x = x / temperature  # as the sampler's temperature warper divides (not * 1/T: one rounding less)
            lse[s:s + step] = torch.logsumexp(x, dim=-1)
            out[s:s + step] = x.gather(1, targets[s:s + step, None]).squeeze(1) - lse[s:s + step]
        ctx.save_for_backward(logits, targets, lse)  # the caller's logits themselves: nothing new of size N·V
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, lse = ctx.saved_tensors
        n, vocab = logits.shape
        cdt, temperature = lse.dtype, ctx.temperature
        grad = torch.empty_like(logits)
        step = _rows(n, vocab, ctx.chunk_elements)
        g_all = grad_out.to(cdt)
        for s in range(0, n, step):
            x = logits[s:s + step].to(cdt)
            if temperature != 1.0:
                x = x / temperature
            g = g_all[s:s + step, None]
            # d/dx [x_t - logsumexp(x)] = onehot(t) - softmax(x); times 1/T through x = logits / T
            d = torch.exp(x - lse[s:s + step, None]).mul_(-g)
            d.scatter_add_(1, targets[s:s + step, None], g)
            if temperature != 1.0:
                d.div_(temperature)
            grad[s:s + step] = d
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """log softmax(logits / temperature) at ``targets``: (..., V), (...) → (...) in float32 (float64 for float64
    logits), computed in chunks of at most ``chunk_elements`` float32 elements (module docstring).

    ``targets`` must be valid token ids (callers clamp ignored labels and mask the result)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not align")
    flat = logits.reshape(-1, logits.shape[-1])
    out = _SelectedLogProb.apply(flat, targets.reshape(-1), float(temperature), int(chunk_elements))
    return out.reshape(targets.shape)


def head_token_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                        chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """log_softmax(head(hidden))[targets]: (..., H), (...) → (...) float32, where ``head`` projects onto the
    vocabulary (a reward model's likelihood term).  The positions go through the head a chunk at a time, each
    chunk under activation checkpointing, so neither the logits nor their float32 copy exist for more than one
    chunk: backward recomputes a chunk's logits from its hidden states.  The head is called as a module (ZeRO-3
    gathers its weight in the module's hooks)."""
    from torch.utils.checkpoint import checkpoint

    H = hidden.shape[-1]
    flat_h, flat_t = hidden.reshape(-1, H), targets.reshape(-1)
    if flat_t.numel() == 0:
        return hidden.new_zeros(targets.shape, dtype=_compute_dtype(hidden.dtype))
    vocab = getattr(head, "out_features", None) or head(flat_h[:1]).shape[-1]
    step = _rows(flat_t.numel(), vocab, chunk_elements)

    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return token_logprobs(head(h), t, chunk_elements=chunk_elements)

    grad = torch.is_grad_enabled()
    out = [checkpoint(piece, flat_h[s:s + step], flat_t[s:s + step], use_reentrant=False) if grad
           else piece(flat_h[s:s + step], flat_t[s:s + step]) for s in range(0, flat_t.numel(), step)]
    return torch.cat(out).reshape(targets.shape)
