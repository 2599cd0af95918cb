"""REINFORCE (Williams, 1992) with the batch's mean return as the baseline; one sample per prompt is enough."""

from marlhf.rlhf.advantages import SequenceEstimator, register
from marlhf.rlhf.estimators import groups, reinforce_advantages


@register("reinforce")
class Reinforce(SequenceEstimator):
    def advantages(self, returns, valid):
        groups(returns, self.settings.num_samples_per_prompt)  # the batch still holds whole groups
        return reinforce_advantages(returns, valid)
