"""Test-side dispatch over the termination rules' tensor functions (marlhf/rlhf/macro.py): the maths tests name a
rule and its inputs in one call.  Production code builds a rule component instead (marlhf/rlhf/termination)."""

from __future__ import annotations

import torch

from marlhf.rlhf.macro import (
    fixed_starts,
    ppl_starts,
    randomized_starts,
    segments_from_starts,
    split_last_token,
    word_starts,
)

RULES = ("fixed", "randomized", "ppl", "word")


def segments_for_rule(
    rule: str,
    mask: torch.Tensor,
    *,
    ngram: float | None = None,
    lengths: tuple[int, ...] = (2, 3, 5, 10),
    repeat_times: int = 3,
    generator: torch.Generator | None = None,
    ref_logprobs: torch.Tensor | None = None,
    ppl_max_len: int | None = None,
    input_ids: torch.Tensor | None = None,
    word_start_table: torch.Tensor | None = None,
    split_last: bool = False,
) -> torch.Tensor:
    """Dispatch ``--termination_condition`` to a rule and return seg (B, T); unknown rules raise.

    ``split_last`` adds the compatibility split of the last token (see :func:`split_last_token`).
    The parsing rule produces its own ``starts`` (it needs a parser) and calls segments_from_starts.
    """
    if rule not in RULES:
        raise ValueError(f"termination_condition={rule!r} is not valid; choose one of {', '.join(RULES)}")
    if rule == "fixed":
        starts = fixed_starts(mask, ngram)
    elif rule == "randomized":
        starts = randomized_starts(mask, lengths, repeat_times, generator)
    elif rule == "ppl":
        if ref_logprobs is None:
            raise ValueError("termination_condition='ppl' needs ref_logprobs (B, T)")
        starts = ppl_starts(mask, ref_logprobs, ppl_max_len)
    else:
        if input_ids is None or word_start_table is None:
            raise ValueError("termination_condition='word' needs input_ids (B, T) and word_start_table (V,)")
        starts = word_starts(mask, input_ids, word_start_table)
    if split_last:
        starts = split_last_token(starts, mask)
    return segments_from_starts(starts, mask)


def rollout_section(**change):
    """The step-3 rollout section of the default flags, with ``change`` applied (marlhf/rlhf/sections.py)."""
    import dataclasses

    from marlhf.config import RLHFArgs
    from marlhf.rlhf.sections import RolloutSection

    return dataclasses.replace(RolloutSection.from_args(RLHFArgs()), **change)


def critic_free_advantages(estimator: str, scores, logprobs, ref_logprobs, mask, *, group_size: int, kl_ctl: float,
                           clip_reward_value, kl_penalty: str = "reward", grpo_normalization: str = "std",
                           valid=None):
    """A critic-free estimator component (marlhf/rlhf/advantages) called on one batch, the answer one macro
    action: (token advantages (N, T), each row's return as its first token carries it (N,), stats)."""
    from marlhf.rlhf.advantages import AdvantageBatch, build_estimator

    est = build_estimator(rollout_section(advantage_estimator=estimator, num_samples_per_prompt=group_size,
                                          kl_ctl=kl_ctl, clip_reward_value=clip_reward_value, kl_penalty=kl_penalty,
                                          grpo_normalization=grpo_normalization))
    mask = mask.bool()
    valid = torch.ones(mask.shape[0], dtype=torch.bool) if valid is None else valid
    seg = segments_for_rule("fixed", mask, ngram=None)
    adv, returns, stats = est(AdvantageBatch(mask, valid, seg, logprobs, ref_logprobs, None, None, scores))
    return adv, returns[:, 0], stats  # the sequence return sits on every answer token (0 on an empty answer)
