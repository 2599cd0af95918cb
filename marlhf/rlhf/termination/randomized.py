"""The randomized rule: lengths drawn from {2, 3, 5, 10} repeated ``--repeat_times`` times, one draw per sample."""

from marlhf.rlhf.macro import randomized_starts
from marlhf.rlhf.termination import Answers, TerminationRule, register

LENGTHS = (2, 3, 5, 10)


@register("randomized")
class Randomized(TerminationRule):
    def starts(self, answers: Answers):
        return randomized_starts(answers.mask, LENGTHS, self.section.repeat_times, answers.generator)
