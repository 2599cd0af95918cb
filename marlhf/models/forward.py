"""Forward passes over loaded models: the logits that predict labelled tokens, the critic's per-token values, a
reward model's sequence scores (with its likelihood term), a preference pair's shared prompt run once.  Pure
functions of (model, tensors)."""

from __future__ import annotations

import torch
from torch import nn


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside DeepSpeed / peft wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):  # DeepSpeedEngine
            model = model.module
        elif hasattr(model, "get_base_model"):  # peft
            model = model.get_base_model()
        else:
            return model


def first_labelled_column(labels: torch.Tensor) -> int:
    """The column whose logits predict the batch's earliest labelled token (labels -100 elsewhere): what
    :func:`next_token_logits` needs to start from.  T - 1 (nothing to project) when no token is labelled."""
    labelled = (labels[:, 1:] != -100).any(dim=0)  # column t predicts token t + 1
    return int(labelled.long().argmax()) if bool(labelled.any()) else labels.shape[1] - 1


def next_token_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int,
                      **kwargs) -> torch.Tensor:
    """(B, T - 1 - start, V) logits of columns start .. T - 2, column j predicting token start + j + 1.

    Only these columns go through the vocabulary projection (transformers' ``logits_to_keep``, after which
    the model's own logit post-processing, e.g. Gemma-2's soft-capping, still applies): the prompt is most of
    a sequence and its predictions are never used, nor is the last column's."""
    keep = torch.arange(start, input_ids.shape[1] - 1, device=input_ids.device)
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep,
                 **kwargs).logits


def labelled_logits(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits that predict a right-padded batch's labelled tokens and their targets, aligned: (B, K, V),
    (B, K) with -100 where nothing is labelled (the SFT loss, DPO's and the likelihood scorer's log-probs)."""
    start = first_labelled_column(batch["labels"])
    logits = next_token_logits(model, batch["input_ids"], batch["attention_mask"], start)
    return logits, batch["labels"][:, start + 1:]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding — what ``generate`` uses, so training forwards must use them too."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def pair_hidden_states(base: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       prefix_width: int = 0, prefix_index: torch.Tensor | None = None) -> torch.Tensor:
    """Last hidden states (R, T, H) of a batch, where a :class:`~marlhf.data.pipeline.PairCollator` batch's
    shared prefixes are computed once: the rows of one group (``prefix_index`` (R,), each row's group) hold the
    same tokens in columns [0, prefix_width) (a prompt and whatever its answers start with), so those columns
    run for one row per group, and each row's remaining columns attend to their keys and values through the KV
    cache.

    The result equals one forward over all rows (causal attention: a column sees only the columns before it).
    ``prefix_width`` 0 (or no ``prefix_index``) is that plain forward; so is a model under gradient
    checkpointing, which drops the cache in training."""
    positions = position_ids_from_mask(attention_mask)
    rows, width = input_ids.shape
    checkpointing = base.training and getattr(base, "gradient_checkpointing", False)
    if prefix_width <= 0 or prefix_width >= width or prefix_index is None or checkpointing:
        return base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                    position_ids=positions).last_hidden_state
    P, prefix_index = prefix_width, prefix_index.to(input_ids.device)
    groups = int(prefix_index.max()) + 1
    first = torch.full((groups,), rows, device=input_ids.device).scatter_reduce(
        0, prefix_index, torch.arange(rows, device=input_ids.device), "amin")  # one row of each group
    prefix = base(input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P],
                  position_ids=positions[first, :P], use_cache=True)
    # transformers 5.24 renamed the KV cache `cache`, output field and forward argument alike (`past_key_values`
    # warns there and goes in 5.40); earlier versions call both `past_key_values`
    name = "cache" if "cache" in prefix else "past_key_values"
    cache = prefix[name]
    cache.batch_select_indices(prefix_index)  # group g's keys and values -> each of its rows
    rest = base(input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=positions[:, P:],
                use_cache=True, **{name: cache}).last_hidden_state
    return torch.cat([prefix.last_hidden_state[prefix_index], rest], dim=1)


def token_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 response_start: torch.Tensor | int | None = None, prefix_width: int = 0,
                 prefix_index: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar head on every position: (B, T) values (the critic) / per-token rewards.  A reward model with a
    :class:`LikelihoodTerm` adds it, which needs ``response_start``: each row's first answer column (B,), or
    one column for all rows (left-padded prompts).  ``prefix_width``: a pair batch's shared columns, run
    once per group of ``prefix_index`` (:func:`pair_hidden_states`)."""
    inner = _unwrap(model)
    if getattr(inner, "likelihood", None) is not None:
        if response_start is None:
            raise ValueError("this reward model has a likelihood term: scoring needs where each answer starts")
        if not torch.is_tensor(response_start):
            response_start = torch.full((input_ids.shape[0],), int(response_start), device=input_ids.device)
        response_start = response_start.to(input_ids.device)

    def values_of(input_ids, attention_mask, response_start, prefix_index):
        base = getattr(inner, inner.base_model_prefix)
        hidden = pair_hidden_states(base, input_ids, attention_mask, prefix_width, prefix_index)
        values = inner.score(hidden).squeeze(-1).float()  # (B, T); the head computes in float32 (Fp32Linear)
        term = getattr(inner, "likelihood", None)
        if term is None:
            return values
        return values + term(hidden, input_ids, attention_mask, response_start)

    return through_engine(model, values_of, input_ids, attention_mask, response_start, prefix_index)


def is_engine(model) -> bool:
    """A DeepSpeed engine (training or frozen): it wraps the model as ``.module`` and has an ``optimizer`` slot."""
    return hasattr(model, "module") and isinstance(model.module, nn.Module) and hasattr(model, "optimizer")


def through_engine(model: nn.Module, fn, *tensors):
    """``fn(*tensors)`` — a forward that reads parts of the model (its base, its heads) rather than calling it
    whole — run as the forward of ``model`` when ``model`` is a DeepSpeed engine, else called directly.

    DeepSpeed's bookkeeping lives in ``engine.forward``: it arms the backward hooks that scale a micro-batch's
    gradient by 1 / accumulation and tell ZeRO where a micro-step ends.  A forward that bypasses it trains
    right at ZeRO-0/1/2 but, under ZeRO-3 with gradient accumulation, each micro-batch's gradient overwrote the
    one before (tests/test_update_invariance.py).  So ``fn`` stands in for the wrapped module's ``forward`` for
    the one call (an instance attribute shadows the method; the module's ZeRO-3 hooks run as for any call)."""
    if not is_engine(model):
        return fn(*tensors)
    module = model.module
    module.forward = fn
    try:
        return model(*tensors)
    finally:
        del module.forward


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last real token (its rightmost unmasked column, whatever padding precedes it): (B,)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(dim=1)


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_start: torch.Tensor | int | None = None, prefix_width: int = 0,
                    prefix_index: torch.Tensor | None = None) -> torch.Tensor:
    """Reward-model score of each sequence: the head's value at its last real token, plus the likelihood term
    over the answer when the model has one (which needs ``response_start``, as :func:`token_values`).  (B,)"""
    values = token_values(model, input_ids, attention_mask, response_start, prefix_width, prefix_index)
    idx = last_token_index(attention_mask)
    return values.gather(1, idx[:, None]).squeeze(1)
