"""The word rule: a macro action per word (a token that starts a word opens one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from marlhf.rlhf.macro import word_starts
from marlhf.rlhf.termination import Answers, TerminationRule, register

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def word_start_table(tokenizer: PreTrainedTokenizerBase, size: int | None = None) -> torch.Tensor:
    """BoolTensor (size,): True where a token starts a new word; ``table[ids]`` flags a batch of ids.

    A token starts a word when its surface form begins with whitespace — SentencePiece "▁", byte-level BPE
    "Ġ" (space) / "Ċ" (newline) / "ĉ" (tab), a literal space/newline, or a whitespace byte-fallback
    piece ``<0x0A>``, ``<0x20>``, ``<0x09>`` — and when it is a special/added token.  ``size`` defaults to
    ``len(tokenizer)``; pass the model's (possibly padded) embedding size, extra rows count as starts.
    """
    size = len(tokenizer) if size is None else size
    if size < len(tokenizer):
        raise ValueError(f"word_start_table: size {size} < tokenizer length {len(tokenizer)}")
    table = torch.ones(size, dtype=torch.bool)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special_ids = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    whitespace_bytes = {"<0x0A>", "<0x20>", "<0x09>", "<0x0D>"}
    for i, tok in enumerate(tokens):
        if i in special_ids or tok is None:
            continue
        table[i] = tok.startswith(("▁", "Ġ", "Ċ", "ĉ", " ", "\n", "\t")) or tok in whitespace_bytes
    return table


@register("word")
class Word(TerminationRule):
    def __init__(self, section, tokenizer):
        super().__init__(section, tokenizer)

        self.table = word_start_table(tokenizer)  # (V,) bool: the token starts a word

    def starts(self, answers: Answers):
        return word_starts(answers.mask, answers.ids, self.table)
