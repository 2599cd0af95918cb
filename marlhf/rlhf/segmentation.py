"""Macro-action segmentation: answers → segment ids with the run's termination rule (paper §3.2.1).

The rule is a component of :mod:`marlhf.rlhf.termination`, built once from the ``macro`` section; this module
gives it the batch's own random stream — seeded by (run seed, step, generation batch, rank) via
:func:`stream_seed`, so the randomized rule draws other boundaries for every batch and the same ones when a run
resumes — and turns its starts into segment ids (with the released code's split of the last token under
``--macro_reward compat``).
"""

from __future__ import annotations

import hashlib

import torch

from marlhf.rlhf import macro
from marlhf.rlhf.sections import MacroSection
from marlhf.rlhf.termination import Answers, build_rule
from marlhf.utils import dist


def stream_seed(*parts: int) -> int:
    """A 63-bit seed that differs for every tuple of integers (no arithmetic collisions like a*101 + b)."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class MacroSegmenter:
    """The run's termination rule as one call: answers → (segment ids (B, A), samples that fell back)."""

    def __init__(self, section: MacroSection, tokenizer, seed: int):
        self.section, self.seed = section, seed
        self.rule = build_rule(section, tokenizer)

    def __call__(self, answer: torch.Tensor, mask: torch.Tensor, ref_logprobs: torch.Tensor, step: int,
                 batch: int = 0, logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(stream_seed(self.seed, step, batch, dist.rank()))
        starts = self.rule.starts(Answers(answer, mask, ref_logprobs, gen, logprobs))
        if self.section.split_last:
            starts = macro.split_last_token(starts, mask)
        return macro.segments_from_starts(starts, mask), self.rule.fallbacks
