"""RLOO (Ahmadian et al. 2024): each answer's return against the mean return of the other K − 1 answers to its
prompt."""

from marlhf.rlhf.advantages import SequenceEstimator, register
from marlhf.rlhf.estimators import rloo_advantages


@register("rloo")
class RLOO(SequenceEstimator):
    min_group = 2

    def advantages(self, returns, valid):
        return rloo_advantages(returns, self.settings.num_samples_per_prompt, valid)
