"""The perplexity rule: a macro action ends where its perplexity under the reference model stops falling."""

from marlhf.rlhf.macro import ppl_starts
from marlhf.rlhf.termination import Answers, TerminationRule, register


@register("ppl")
class Perplexity(TerminationRule):
    @classmethod
    def inputs(cls, section):
        return frozenset({"ref_logprobs"})

    def starts(self, answers: Answers):
        return ppl_starts(answers.mask, answers.ref_logprobs, None)
