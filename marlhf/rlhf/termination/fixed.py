"""The fixed rule: a macro action every n tokens (n = 1: vanilla PPO; n = ∞: the whole answer is one action)."""

from marlhf.rlhf.macro import fixed_starts
from marlhf.rlhf.termination import Answers, TerminationRule, register


@register("fixed")
class Fixed(TerminationRule):
    def starts(self, answers: Answers):
        return fixed_starts(answers.mask, self.section.ngram)
