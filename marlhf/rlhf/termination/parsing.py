"""The parsing rule (paper App. B.4): macro actions are the constituents of the answer's parse tree (text) or
syntax tree (code) smaller than ``--parser_cutoff`` tokens; a sample the parser cannot handle falls back to
fixed n-grams and is counted."""

from __future__ import annotations

import torch

from marlhf.parsing import ParseSegmenter
from marlhf.rlhf.termination import Answers, TerminationRule, register


@register("parsing")
class Parsing(TerminationRule):
    def __init__(self, section, tokenizer):
        super().__init__(section, tokenizer)

        self.tokenizer = tokenizer
        self.parser = ParseSegmenter(kind=section.response_kind, backend=section.parser_backend,
                                     cutoff=section.parser_cutoff, fallback_n=section.ngram or 5,
                                     model=section.parser_model or None)

    def starts(self, answers: Answers) -> torch.Tensor:
        texts, offsets = self._texts_and_offsets(answers.ids, answers.mask)
        starts, fell_back = self.parser.starts(texts, offsets, answers.ids.shape[1])
        self.fallbacks = int(fell_back.sum())
        return starts.to(answers.mask.device)

    def _texts_and_offsets(self, answer: torch.Tensor, mask: torch.Tensor):
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
