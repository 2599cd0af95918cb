"""Macro-action segmentation: ``--termination_condition`` as one call, answers → segment ids (paper §3.2.1).

The rules themselves are pure tensor functions in :mod:`marlhf.rlhf.macro` (and the parse-tree rule in
:mod:`marlhf.rlhf.parsing`); this module turns the step-3 flags into one :class:`MacroSegmenter` and gives
the randomized rule a seed per (run seed, step, generation batch, rank) via :func:`stream_seed`.
"""

from __future__ import annotations

import hashlib

import torch

from marlhf.rlhf import macro
from marlhf.utils import dist


def stream_seed(*parts: int) -> int:
    """A 63-bit seed that differs for every tuple of integers (no arithmetic collisions like a*101 + b)."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class MacroSegmenter:
    """``--termination_condition`` as one call: answers → segment ids (B, A) (+ parse fallbacks counted)."""

    def __init__(self, args, tokenizer):
        self.args, self.tokenizer = args, tokenizer
        self.rule = args.termination_condition
        self.n = args.ngram_n
        self.parser = None
        self.word_table = None
        if self.rule == "parsing":
            from marlhf.rlhf.parsing import ParseSegmenter

            self.parser = ParseSegmenter(kind=args.response_kind, backend=args.parser_backend,
                                         cutoff=args.parser_cutoff, fallback_n=self.n or 5,
                                         model=args.parser_model or None)
        if self.rule == "word":
            from marlhf.models.tokenizer import word_start_table

            self.word_table = word_start_table(tokenizer)

    def __call__(self, answer: torch.Tensor, mask: torch.Tensor, ref_logprobs: torch.Tensor, step: int,
                 batch: int = 0):
        """Segment ids (B, A) and the number of samples whose parse fell back to fixed n-grams.

        The randomized rule draws from a generator seeded by (seed, step, generation batch, rank), so row i
        of every generation batch on every rank gets its own boundaries, and a resumed run the same ones."""
        split_last = self.args.macro_reward == "compat"
        if self.rule != "parsing":
            gen = torch.Generator().manual_seed(stream_seed(self.args.seed, step, batch, dist.rank()))
            seg = macro.segments_for_rule(self.rule, mask, ngram=self.n, repeat_times=self.args.repeat_times,
                                          generator=gen, ref_logprobs=ref_logprobs, input_ids=answer,
                                          word_start_table=self.word_table, split_last=split_last)
            return seg, 0
        texts, offsets = self._texts_and_offsets(answer, mask)
        starts, fell_back = self.parser.starts(texts, offsets, answer.shape[1])
        starts = starts.to(mask.device)
        if split_last:
            starts = macro.split_last_token(starts, mask)
        return macro.segments_from_starts(starts, mask), int(fell_back.sum())

    def _texts_and_offsets(self, answer, mask):
        """Decoded answers and each policy token's character span in them.

        The text is re-tokenized with offsets; where that does not reproduce the generated ids (a
        non-canonical tokenization) the offsets are left inconsistent on purpose, so the parser falls back
        for that sample and counts it instead of guessing an alignment."""
        texts, offsets = [], []
        special = set(self.tokenizer.all_special_ids)
        for ids in [a[m].tolist() for a, m in zip(answer.cpu(), mask.cpu())]:
            body = [i for i in ids if i not in special]
            text = self.tokenizer.decode(body, skip_special_tokens=True)
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            spans = [tuple(o) for o in enc["offset_mapping"]]
            if enc["input_ids"] != body:
                spans = [(0, 0)] * len(body)  # cannot align: the parser will fall back
            spans += [(len(text), len(text))] * (len(ids) - len(body))  # EOS: empty span at the end
            texts.append(text)
            offsets.append(spans)
        return texts, offsets
