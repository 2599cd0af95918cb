"""Monte-Carlo macro values without a critic (VinePPO, ICML 2025; SPO, NeurIPS 2025): V̂(s_k) of each macro
action's start state is the mean score of ``--mc_rollouts`` continuations sampled from it (the estimator asks
the rollout for them in :meth:`MonteCarloMacro.prepare`; :func:`marlhf.rlhf.rollout.monte_carlo_values`), and
macro action k's advantage is the TD error on those values, A_k = R_k + γ V̂(s_{k+1}) − V̂(s_k) (V̂ after the
last action = 0; R_k the macro reward, the score in the last) — GAE with λ = 0 over the Monte-Carlo values."""

import dataclasses

from marlhf.errors import ConfigError
from marlhf.rlhf.advantages import AdvantageBatch, AdvantageEstimator, EstimatorOptions, register
from marlhf.rlhf.macro import macro_rewards, to_tokens
from marlhf.rlhf.ppo_math import gae, whiten


@register("mc_macro")
class MonteCarloMacro(AdvantageEstimator):
    mc_values = True
    macro_level = True

    @classmethod
    def check(cls, o: EstimatorOptions) -> None:
        """Any termination rule, γ, --macro_reward and ratio; no critic values (σ) and no GAE (λ)."""
        super().check(o)
        if o.value_function != "equal" or o.lam_changed:
            raise ConfigError(f"--advantage_estimator {o.estimator} has no critic and no GAE: --value_function / "
                              f"--lam / --lam_critic / --adaptive_lam_alpha would do nothing; drop them")

    def prepare(self, batch: AdvantageBatch, rollout) -> AdvantageBatch:
        """V̂(s_k) of every macro boundary: the mean clipped score of --mc_rollouts continuations from it."""
        return dataclasses.replace(batch, mc_values=rollout.monte_carlo_values(batch.seg, self.settings.mc_rollouts))

    def __call__(self, batch: AdvantageBatch):
        s = self.settings
        if batch.mc_values is None:
            raise ValueError("mc_macro: the rollout gave no Monte-Carlo values of the macro boundaries")
        R, macro_mask = macro_rewards(batch.rewards, batch.seg, batch.mask, s.macro_reward, "equal")  # (B, M)
        V = batch.mc_values[:, :R.shape[1]]
        A, Q = gae(V, R, macro_mask, s.gamma, 0.0)  # A_k = R_k + γ V̂_{k+1} − V̂_k
        adv, ret = to_tokens(A, batch.seg), to_tokens(Q, batch.seg)
        if s.whiten_advantages:
            adv = whiten(adv, batch.mask)
        n = macro_mask.sum().clamp(min=1)
        stats = {"mc_value_mean": (V * macro_mask).sum() / n,
                 "num_macros": macro_mask.sum().double() / max(macro_mask.shape[0], 1),
                 "macro_len": batch.mask.sum().double() / n}
        return adv, ret, stats
