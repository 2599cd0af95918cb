"""GRPO (Shao et al. 2024): each answer's return against its group's mean, divided by the group's standard
deviation (``--grpo_normalization std``) or not (``none``, Dr. GRPO)."""

from marlhf.errors import ConfigError
from marlhf.rlhf.advantages import EstimatorOptions, SequenceEstimator, register
from marlhf.rlhf.estimators import grpo_advantages


@register("grpo")
class GRPO(SequenceEstimator):
    min_group = 2
    group_normalization = True

    @classmethod
    def check(cls, o: EstimatorOptions) -> None:
        super().check(o)
        if o.whiten_advantages:
            raise ConfigError("--whiten_advantages with --advantage_estimator grpo: its advantages are already "
                              "normalised per group; drop one")

    def advantages(self, returns, valid):
        s = self.settings
        return grpo_advantages(returns, s.num_samples_per_prompt, valid, s.grpo_normalization)
