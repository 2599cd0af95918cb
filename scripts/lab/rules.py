"""A dispatcher over the termination rules' tensor functions (marlhf/rlhf/macro.py) by name: the maths tests and
the macro benchmark name a rule and its inputs in one call.  Runs build a rule component instead
(marlhf/rlhf/termination)."""

from __future__ import annotations

import torch

from marlhf.rlhf.macro import (
    fixed_starts,
    lowprob_starts,
    ppl_starts,
    randomized_starts,
    segments_from_starts,
    split_last_token,
    word_starts,
)

RULES = ("fixed", "randomized", "ppl", "word", "lowprob")


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
    lowprob_threshold: float = 0.1,
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
    elif rule == "lowprob":
        if ref_logprobs is None:
            raise ValueError("termination_condition='lowprob' needs ref_logprobs (B, T)")
        starts = lowprob_starts(mask, ref_logprobs, lowprob_threshold)
    else:
        if input_ids is None or word_start_table is None:
            raise ValueError("termination_condition='word' needs input_ids (B, T) and word_start_table (V,)")
        starts = word_starts(mask, input_ids, word_start_table)
    if split_last:
        starts = split_last_token(starts, mask)
    return segments_from_starts(starts, mask)
