"""Helpers of the maths tests: the rules' dispatcher by name (scripts/lab/rules.py, shared with the macro benchmark)
and the critic-free estimator components called on one batch."""

from __future__ import annotations

import torch
from lab.rules import RULES, segments_for_rule  # noqa: F401  (the tests import them from here)


def rollout_section(**change):
    """The step-3 rollout section of the default flags, with ``change`` applied (marlhf/rlhf/sections.py)."""
    import dataclasses

    from marlhf.config import RLHFArgs
    from marlhf.rlhf.sections import RolloutSection

    section = RolloutSection.build(RLHFArgs())
    policy = {k: change.pop(k) for k in ("logprob_temperature", "kl_ctl", "kl_penalty") if k in change}
    batches = {"samples_per_prompt": change.pop("num_samples_per_prompt")} if "num_samples_per_prompt" in change else {}
    return dataclasses.replace(section, policy=dataclasses.replace(section.policy, **policy),
                               batches=dataclasses.replace(section.batches, **batches), **change)


def critic_free_advantages(estimator: str, scores, logprobs, ref_logprobs, mask, *, group_size: int, kl_ctl: float,
                           clip_reward_value, kl_penalty: str = "reward", grpo_normalization: str = "std",
                           valid=None):
    """A critic-free estimator component (marlhf/rlhf/advantages) called on one batch, the answer one macro
    action: (token advantages (N, T), each row's return as its first token carries it (N,), stats)."""
    from marlhf.rlhf.advantages import AdvantageBatch, build_estimator

    est = build_estimator(rollout_section(advantage_estimator=estimator, num_samples_per_prompt=group_size,
                                          kl_ctl=kl_ctl, clip_reward_value=clip_reward_value, kl_penalty=kl_penalty,
                                          grpo_normalization=grpo_normalization))
    mask = mask.bool()
    valid = torch.ones(mask.shape[0], dtype=torch.bool) if valid is None else valid
    seg = segments_for_rule("fixed", mask, ngram=None)
    adv, returns, stats = est(AdvantageBatch(mask, valid, seg, logprobs, ref_logprobs, None, None, scores))
    return adv, returns[:, 0], stats  # the sequence return sits on every answer token (0 on an empty answer)
