"""Advantage estimators as components: each is one class in one file of this package, registered by name
(``--advantage_estimator``), built once from the ``rollout`` section, and asked for a batch's advantages.

    estimator = build_estimator(RolloutSection.build(args))     # marlhf.rlhf.sections
    estimator.needs_critic                                          # the engine builds a critic or not
    advantages, returns, stats = estimator(batch)                   # (B, A), (B, A), detached scalars

``gae`` is MA-PPO's macro GAE with the critic (paper §3.2.2); ``rloo`` / ``grpo`` / ``reinforce`` score the
answer as one action against a baseline without a critic (:class:`SequenceEstimator`).  The maths behind them
is pure tensor functions (:mod:`marlhf.rlhf.ppo_math`, :mod:`marlhf.rlhf.estimators`) tested against loop
references.

Adding an estimator: a new module here with an :class:`AdvantageEstimator` subclass decorated with
``@register("name")`` (this package imports every module in it), its :meth:`~AdvantageEstimator.check` of the
options it makes meaningless (the config calls it through :func:`check_estimator_options`), and its test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from marlhf.errors import ConfigError
from marlhf.rlhf.estimators import GRPO_NORMALIZATIONS, KL_PENALTIES, broadcast_to_tokens, sequence_returns
from marlhf.rlhf.macro import num_macros
from marlhf.rlhf.ppo_math import whiten
from marlhf.rlhf.registry import Registry
from marlhf.rlhf.sections import RolloutSection


@dataclass
class AdvantageBatch:
    """One rollout batch after its forwards: what an estimator may read (token tensors (B, A), right-padded)."""

    mask: torch.Tensor  # bool, answer tokens in the loss
    valid: torch.Tensor  # (B,) bool, answers long enough to train on
    seg: torch.Tensor  # macro-action segment ids, -1 on padding
    logprobs: torch.Tensor  # log π_old
    ref_logprobs: torch.Tensor  # log π_ref
    values: torch.Tensor | None  # critic V(s_t); None without a critic
    rewards: torch.Tensor  # per-token rewards (KL penalty + the clipped score on the last token)
    scores: torch.Tensor  # (B,) the reward source's sequence scores
    mc_values: torch.Tensor | None = None  # (B, M) Monte-Carlo V̂ of each macro action's start state (mc_values)


@dataclass(frozen=True)
class EstimatorOptions:
    """The flags an estimator's :meth:`~AdvantageEstimator.check` judges (``--advantage_estimator`` and MA-PPO's
    options it may make meaningless); ``*_changed``: the flag differs from its default."""

    estimator: str
    num_samples_per_prompt: int
    kl_penalty: str
    grpo_normalization: str
    policy_ratio: str
    termination_changed: bool  # --termination_condition / --ngram
    value_function: str
    macro_reward: str
    gamma: float
    lam_changed: bool  # --lam / --lam_critic / --adaptive_lam_alpha
    whiten_advantages: bool


class AdvantageEstimator:
    """``estimator(batch)`` → (advantages (B, A), returns (B, A), stats {name: 0-d tensor}).
    ``needs_critic``: the run builds and trains a critic for it; ``min_group``: the samples per prompt
    (``--num_samples_per_prompt``) it needs at least."""

    name: ClassVar[str] = ""
    needs_critic: ClassVar[bool] = False
    min_group: ClassVar[int] = 1
    mc_values: ClassVar[bool] = False  # it samples continuations from each macro boundary (in :meth:`prepare`)
    macro_level: ClassVar[bool] = False  # its advantages differ between the macro actions of an answer
    group_normalization: ClassVar[bool] = False  # it reads --grpo_normalization

    def __init__(self, settings: RolloutSection):
        self.settings = settings

    @classmethod
    def check(cls, o: EstimatorOptions) -> None:
        """Reject flags that would do nothing or something other than what they say with this estimator
        (:class:`marlhf.errors.ConfigError` naming them).  Here the ones every estimator shares — the choices,
        K ≥ :attr:`min_group`, --grpo_normalization for the one that reads it; a subclass adds its own after
        ``super().check(o)``.  An estimator with a critic (gae) keeps everything MA-PPO offers."""
        for flag, value, valid in (("kl_penalty", o.kl_penalty, KL_PENALTIES),
                                   ("grpo_normalization", o.grpo_normalization, GRPO_NORMALIZATIONS)):
            if value not in valid:
                raise ConfigError(f"--{flag} {value!r} is not one of {', '.join(valid)}")
        if o.num_samples_per_prompt < 1:
            raise ConfigError(f"--num_samples_per_prompt must be >= 1, got {o.num_samples_per_prompt}")
        if o.num_samples_per_prompt < cls.min_group:
            raise ConfigError(f"--advantage_estimator {o.estimator} needs --num_samples_per_prompt >= {cls.min_group} "
                              f"(a sample's baseline comes from the other samples of its prompt), got "
                              f"{o.num_samples_per_prompt}")
        if o.grpo_normalization != "std" and not cls.group_normalization:
            raise ConfigError(f"--grpo_normalization {o.grpo_normalization} only applies to --advantage_estimator "
                              f"grpo (got {o.estimator})")

    def prepare(self, batch: AdvantageBatch, rollout) -> AdvantageBatch:
        """Called by the rollout before the estimate: what the estimator needs beyond the rollout's forwards,
        asked of ``rollout`` (:class:`marlhf.rlhf.rollout.RolloutContext`, e.g. its Monte-Carlo values of the
        macro boundaries).  Returns the batch to estimate on; by default the batch as it is."""
        return batch

    def __call__(self, batch: AdvantageBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:  # pragma: no cover
        raise NotImplementedError


class SequenceEstimator(AdvantageEstimator):
    """The critic-free estimators: the answer is one action whose return R is its (clipped) score minus the
    β-weighted KL to the reference summed over its tokens (:func:`~marlhf.rlhf.estimators.sequence_returns`),
    and its advantage — R against a baseline, :meth:`advantages` — is on every one of its tokens.  The segments
    only serve ``--policy_ratio macro`` (the ratio and its clipping per macro action)."""

    def advantages(self, returns: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """(N,) advantages of the (N,) sequence returns; ``valid`` marks the rows that count."""
        raise NotImplementedError

    @classmethod
    def check(cls, o: EstimatorOptions) -> None:
        """No critic and the response is one action: rejected are --value_function other than equal (σ weights
        critic values), --macro_reward compat (it keeps the RM score out of a σ-average of values), --gamma ≠ 1
        and --lam (discounting / GAE between steps of a one-step response), and a termination rule or n with
        --policy_ratio token (segments computed and never used; with --policy_ratio macro the ratio and its
        clipping are per macro action of any rule, n = ∞ one sequence-level ratio).  KL in the reward (RLOO
        paper) or as a loss (GRPO paper) are both meaningful."""
        super().check(o)
        no_critic = f"--advantage_estimator {o.estimator} has no critic and treats the response as one action"
        if o.value_function != "equal":
            raise ConfigError(f"{no_critic}: --value_function {o.value_function} weights critic values inside a "
                              f"macro action and would do nothing; drop it")
        if o.macro_reward != "sum":
            raise ConfigError(f"{no_critic}: --macro_reward {o.macro_reward} keeps the last token apart for a "
                              f"critic's σ-average and would do nothing; drop it")
        if o.gamma != 1.0 or o.lam_changed:
            raise ConfigError(f"{no_critic}: --gamma/--lam/--lam_critic/--adaptive_lam_alpha discount between steps "
                              f"of a response; its return is the undiscounted sum (use --advantage_estimator gae for "
                              f"GAE)")
        if o.policy_ratio == "token" and o.termination_changed:
            raise ConfigError(f"{no_critic}: --termination_condition/--ngram only enter through the macro-level "
                              f"ratio; add --policy_ratio macro or drop them")

    @torch.no_grad()  # advantages weight the policy loss; never backpropagate into them
    def __call__(self, batch: AdvantageBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        s, mask, valid = self.settings, batch.mask, batch.valid.bool()
        R = sequence_returns(batch.scores, batch.logprobs, batch.ref_logprobs, mask, s.policy.kl_ctl,
                             s.clip_reward_value, s.policy.kl_penalty)  # (N,)
        A = self.advantages(R, valid)
        n = valid.sum().clamp(min=1)
        mean = torch.where(valid, A, 0.0).sum() / n
        stats = {"adv_mean": mean,
                 "adv_std": (torch.where(valid, A - mean, 0.0).pow(2).sum() / n).sqrt(),
                 "return_mean": torch.where(valid, R, 0.0).sum() / n,
                 # share of valid rows whose advantage is 0, e.g. groups where every sample scored the same
                 "zero_adv_frac": ((A.abs() < 1e-6) & valid).sum().double() / n}
        advantages = broadcast_to_tokens(A, mask)
        if s.whiten_advantages:  # the config rejects it with grpo (already normalised)
            advantages = whiten(advantages, mask)
        n_macro = num_macros(batch.seg).double()  # (B,)
        stats["num_macros"] = n_macro.sum() / max(batch.seg.shape[0], 1)
        stats["macro_len"] = mask.sum().double() / n_macro.sum().clamp(min=1)
        return advantages, torch.where(mask, R[:, None], 0.0), stats


ESTIMATORS = Registry(__name__, "advantage estimator", "advantage_estimator")
register = ESTIMATORS.register
estimator_class = ESTIMATORS.lookup


def build_estimator(settings: RolloutSection) -> AdvantageEstimator:
    """The estimator ``settings.advantage_estimator`` names, built once for a run."""
    return estimator_class(settings.advantage_estimator)(settings)


def check_estimator_options(options: EstimatorOptions) -> None:
    """Reject combinations of ``--advantage_estimator`` with MA-PPO's options that would do nothing or something
    other than what they say (:class:`marlhf.errors.ConfigError` naming the flags): the estimator named checks
    its own (:meth:`AdvantageEstimator.check`)."""
    name = options.estimator
    if name not in ESTIMATORS and name in ESTIMATORS.module_names():  # added since the package's import
        estimator_class(name)
    if name not in ESTIMATORS:
        raise ConfigError(f"--advantage_estimator {name!r} is not one of {', '.join(ESTIMATORS)}")
    ESTIMATORS[name].check(options)


ESTIMATORS.discover()  # every estimator module registers itself
