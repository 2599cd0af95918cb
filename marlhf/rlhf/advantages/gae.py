"""Macro GAE with the critic (MA-PPO, paper §3.2.2): values and rewards summed over each macro action, GAE over
the macro-action sequence, the macro advantage on every token of its action."""

from marlhf.rlhf.advantages import AdvantageBatch, AdvantageEstimator, register
from marlhf.rlhf.ppo_math import compute_advantages


@register("gae")
class MacroGAE(AdvantageEstimator):
    needs_critic = True

    def __call__(self, batch: AdvantageBatch):
        s = self.settings
        return compute_advantages(batch.values, batch.rewards, batch.mask, batch.seg, s.value_function,
                                  s.macro_reward, s.gamma, s.lam, s.whiten_advantages, s.lam_critic,
                                  s.adaptive_lam_alpha)
