"""The low-probability rule: a macro action ends at a token the model found unlikely (p < τ), so each action runs
from one forking token to the next (Segmental Advantage Estimation, arXiv 2601.07320: GAE bootstraps only there).
``--lowprob_threshold`` is τ; ``--lowprob_model`` whose probability: the reference model's (default) or the
sampling policy's (π_old, at ``--logprob_temperature``)."""

from marlhf.rlhf.macro import lowprob_starts
from marlhf.rlhf.termination import Answers, TerminationRule, register


@register("lowprob")
class LowProbability(TerminationRule):
    @classmethod
    def inputs(cls, section):
        return frozenset({"logprobs" if section.lowprob_model == "policy" else "ref_logprobs"})

    def starts(self, answers: Answers):
        if self.section.lowprob_model == "policy":
            if answers.logprobs is None:
                raise ValueError("--lowprob_model policy needs the policy's log-probabilities of the answers")
            return lowprob_starts(answers.mask, answers.logprobs, self.section.lowprob_threshold)
        return lowprob_starts(answers.mask, answers.ref_logprobs, self.section.lowprob_threshold)
