"""GRPO (Shao et al. 2024): each answer's return against its group's mean, divided by the group's standard
deviation (``--grpo_normalization std``) or not (``none``, Dr. GRPO)."""

from marlhf.rlhf.advantages import SequenceEstimator, register
from marlhf.rlhf.estimators import grpo_advantages


@register("grpo")
class GRPO(SequenceEstimator):
    min_group = 2

    def advantages(self, returns, valid):
        s = self.settings
        return grpo_advantages(returns, s.num_samples_per_prompt, valid, s.grpo_normalization)
