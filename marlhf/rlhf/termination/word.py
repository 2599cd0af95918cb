"""The word rule: a macro action per word (a token that starts a word opens one)."""

from marlhf.models.tokenizer import word_start_table
from marlhf.rlhf.macro import word_starts
from marlhf.rlhf.termination import Answers, TerminationRule, register


@register("word")
class Word(TerminationRule):
    def __init__(self, section, tokenizer):
        super().__init__(section, tokenizer)

        self.table = word_start_table(tokenizer)  # (V,) bool: the token starts a word

    def starts(self, answers: Answers):
        return word_starts(answers.mask, answers.ids, self.table)
