"""Advantage estimators as components: each is one class in one file of this package, registered by name
(``--advantage_estimator``), built once from the ``rollout`` section, and asked for a batch's advantages.

    estimator = build_estimator(RolloutSection.from_args(args))     # marlhf.rlhf.sections
    estimator.needs_critic                                          # the engine builds a critic or not
    advantages, returns, stats = estimator(batch)                   # (B, A), (B, A), detached scalars

``gae`` is MA-PPO's macro GAE with the critic (paper §3.2.2); ``rloo`` / ``grpo`` / ``reinforce`` score the
answer as one action against a baseline without a critic (:class:`SequenceEstimator`).  The maths behind them
is pure tensor functions (:mod:`marlhf.rlhf.ppo_math`, :mod:`marlhf.rlhf.estimators`) tested against loop
references.

Adding an estimator: a new module here with an :class:`AdvantageEstimator` subclass decorated with
``@register("name")`` (this package imports every module in it), and its test.
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


class AdvantageEstimator:
    """``estimator(batch)`` → (advantages (B, A), returns (B, A), stats {name: 0-d tensor}).
    ``needs_critic``: the run builds and trains a critic for it; ``min_group``: the samples per prompt
    (``--num_samples_per_prompt``) it needs at least."""

    name: ClassVar[str] = ""
    needs_critic: ClassVar[bool] = False
    min_group: ClassVar[int] = 1
    mc_values: ClassVar[bool] = False  # the rollout samples continuations from each macro boundary for it
    macro_level: ClassVar[bool] = False  # its advantages differ between the macro actions of an answer

    def __init__(self, settings: RolloutSection):
        self.settings = settings

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

    @torch.no_grad()  # advantages weight the policy loss; never backpropagate into them
    def __call__(self, batch: AdvantageBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        s, mask, valid = self.settings, batch.mask, batch.valid.bool()
        R = sequence_returns(batch.scores, batch.logprobs, batch.ref_logprobs, mask, s.kl_ctl, s.clip_reward_value,
                             s.kl_penalty)  # (N,)
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


def check_estimator_options(
    *,
    estimator: str,
    num_samples_per_prompt: int,
    kl_penalty: str,
    grpo_normalization: str,
    policy_ratio: str,
    termination_changed: bool,
    value_function: str,
    macro_reward: str,
    gamma: float,
    lam_changed: bool,
    whiten_advantages: bool,
) -> None:
    """Reject combinations of ``--advantage_estimator`` with MA-PPO's options that would do nothing or
    something other than what they say. Raises :class:`marlhf.errors.ConfigError` naming the flags.

    Meaningful:
      gae        everything MA-PPO offers; K ≥ 1 samples per prompt; KL in the reward or as a loss term.
      rloo/grpo  K ≥ 2; KL in the reward (RLOO paper) or as a loss (GRPO paper); --policy_ratio token (the
                 standard methods) or macro: the response's advantage with the ratio and its clipping per
                 macro action of any termination rule (n = ∞ gives one sequence-level ratio).
      reinforce  as rloo, with K ≥ 1 (its baseline is the batch mean).
      mc_macro   any termination rule, γ, --macro_reward, either ratio; no critic values or λ.
    Rejected for the critic-free estimators (there is no critic and the response is one action):
      --value_function other than equal (σ weights critic values), --macro_reward compat (it exists to keep
      the RM score out of a σ-average of values), --gamma ≠ 1 and --lam (discounting/GAE between steps of a
      response that is one step), a termination rule or n with --policy_ratio token (segments would be
      computed and never used), --whiten_advantages with grpo (already normalised per group).
    --grpo_normalization none is only meaningful with grpo.
    """

    if estimator not in ESTIMATORS and estimator in ESTIMATORS.module_names():  # added since the package's import
        estimator_class(estimator)
    for name, value, valid in (("advantage_estimator", estimator, tuple(ESTIMATORS)),
                               ("kl_penalty", kl_penalty, KL_PENALTIES),
                               ("grpo_normalization", grpo_normalization, GRPO_NORMALIZATIONS)):
        if value not in valid:
            raise ConfigError(f"--{name} {value!r} is not one of {', '.join(valid)}")
    if num_samples_per_prompt < 1:
        raise ConfigError(f"--num_samples_per_prompt must be >= 1, got {num_samples_per_prompt}")
    need = ESTIMATORS[estimator].min_group
    if num_samples_per_prompt < need:
        raise ConfigError(f"--advantage_estimator {estimator} needs --num_samples_per_prompt >= {need} (a sample's "
                          f"baseline comes from the other samples of its prompt), got {num_samples_per_prompt}")
    if grpo_normalization != "std" and estimator != "grpo":
        raise ConfigError(f"--grpo_normalization {grpo_normalization} only applies to --advantage_estimator grpo "
                          f"(got {estimator})")
    if ESTIMATORS[estimator].needs_critic:  # macro GAE: everything MA-PPO offers
        return
    if ESTIMATORS[estimator].macro_level:  # macro advantages without a critic (mc_macro): no critic values, no GAE
        if value_function != "equal" or lam_changed:
            raise ConfigError(f"--advantage_estimator {estimator} has no critic and no GAE: --value_function / --lam "
                              f"/ --lam_critic / --adaptive_lam_alpha would do nothing; drop them")
        return
    no_critic = f"--advantage_estimator {estimator} has no critic and treats the response as one action"
    if value_function != "equal":
        raise ConfigError(f"{no_critic}: --value_function {value_function} weights critic values inside a macro "
                          f"action and would do nothing; drop it")
    if macro_reward != "sum":
        raise ConfigError(f"{no_critic}: --macro_reward {macro_reward} keeps the last token apart for a critic's "
                          f"σ-average and would do nothing; drop it")
    if gamma != 1.0 or lam_changed:
        raise ConfigError(f"{no_critic}: --gamma/--lam/--lam_critic/--adaptive_lam_alpha discount between steps of a "
                          f"response; its return is the undiscounted sum (use --advantage_estimator gae for GAE)")
    if policy_ratio == "token" and termination_changed:
        raise ConfigError(f"{no_critic}: --termination_condition/--ngram only enter through the macro-level ratio; "
                          f"add --policy_ratio macro or drop them")
    if whiten_advantages and estimator == "grpo":
        raise ConfigError("--whiten_advantages with --advantage_estimator grpo: its advantages are already "
                          "normalised per group; drop one")


ESTIMATORS.discover()  # every estimator module registers itself
