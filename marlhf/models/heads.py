"""Heads that sit on a transformer's hidden states: the float32 scalar head of reward models and critics
(:class:`Fp32Linear`) and the reward model's likelihood term (:class:`LikelihoodTerm`, step 2's
``--likelihood_term``)."""

from __future__ import annotations

import torch
from torch import nn

from marlhf.models.logprobs import head_token_logprobs


class Fp32Linear(nn.Linear):
    """A linear head computed in float32 whatever the dtype of its weights and inputs: the reward model's and
    critic's scalar ``score`` head and the likelihood term's next-token head.

    A bf16 ``nn.Linear`` rounds its output to bf16 (2^-9 relative: ±0.02 at a value of 8, more than the
    per-token KL rewards it is compared with); ``.float()`` after it cannot undo that.  DeepSpeed's bf16 / fp16
    engines cast every parameter to the run dtype (``_cast_module_mixed_precision``; only buffers can be kept in
    fp32), so the weights stay bf16 (their fp32 master copy lives in the optimizer) and this forward computes
    ``hidden.float() @ W.float()ᵀ (+ b.float())`` instead.  Same parameters and state-dict keys as ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.linear(x.float(), self.weight.float(), bias)


def fp32_head(linear: nn.Module) -> nn.Module:
    """Make a plain ``nn.Linear`` head compute in float32 (:class:`Fp32Linear`), in place; other modules as they are."""
    if type(linear) is nn.Linear:
        linear.__class__ = Fp32Linear
    return linear


class LikelihoodTerm(nn.Module):
    """α · Σ log p(answer token | what precedes it), from a next-token head over the reward model's hidden states
    (``norm="mean"``: α times the mean log p over the answer's tokens).

    A score head reading the last position does not learn from a few thousand pairs whether each answer token
    was to be expected — a fact replaced by another of its kind reads as fluently as the right one; the SFT
    model's next-token head knows (it learnt to copy facts from the prompt).  Step 2 trains the head and α with
    the rest of the model under the pairwise loss."""

    def __init__(self, hidden_size: int, vocab_size: int, norm: str = "sum"):
        super().__init__()
        if norm not in LIKELIHOOD_NORMS:
            raise ValueError(f"likelihood term: norm must be one of {LIKELIHOOD_NORMS}, got {norm!r}")
        self.lm_head = Fp32Linear(hidden_size, vocab_size, bias=False)
        self.scale = nn.Parameter(torch.ones(1))  # 1-d: DeepSpeed broadcasts parameters as bytes
        self.norm = norm  # "sum": α·Σ log p; "mean": α·(Σ log p) / (answer tokens so far), no length bias

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                response_start: torch.Tensor) -> torch.Tensor:
        """(B, T): α times the answer's log-probability up to and including each position (0 before the answer).
        ``response_start`` (B,): the column of each row's first answer token."""
        # only the columns that predict an answer token go through the vocabulary-wide projection: from the
        # one before the earliest answer start (the prompt is most of a sequence); none when no row has one
        first = min(max(int(response_start.min()) - 1, 0), input_ids.shape[1] - 1)
        # column t: log p(token first + t + 1), from the float32 head (Fp32Linear) a chunk of positions at a
        # time: no (B, T, V) logits kept for backward
        logp = head_token_logprobs(self.lm_head, hidden[:, first:-1], input_ids[:, first + 1:])
        column = torch.arange(first + 1, input_ids.shape[1], device=input_ids.device)[None]
        answer = (column >= response_start[:, None]) & attention_mask[:, first + 1:].bool()
        cumulative = torch.nn.functional.pad((logp * answer).cumsum(1), (first + 1, 0))
        if self.norm == "mean":  # the mean over the answer's tokens so far: a longer answer is not lower by itself
            count = torch.nn.functional.pad(answer.cumsum(1), (first + 1, 0))
            cumulative = cumulative / count.clamp(min=1)
        return self.scale.float() * cumulative


LIKELIHOOD_NORMS = ("sum", "mean")


def attach_likelihood_term(model: nn.Module, norm: str | None = None) -> None:
    """Give a value model an (uninitialised) :class:`LikelihoodTerm` and mark its config, so that an export
    writes the term and :func:`load_reward_model` reads it back.  ``norm``: the term's ("sum" or "mean"); None:
    what the config records ("sum" for a model that records none)."""
    norm = norm or getattr(model.config, "likelihood_norm", None) or "sum"
    model.likelihood = LikelihoodTerm(model.score.in_features, full_shape(model.get_input_embeddings().weight)[0],
                                      norm)
    model.config.likelihood_term = True
    model.config.likelihood_norm = norm


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape, also when ZeRO-3 partitioned it (its own shape is then (0,))."""
    return getattr(param, "ds_shape", param.shape)
