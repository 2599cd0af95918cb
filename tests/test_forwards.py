"""A rollout runs only the forwards something reads (issue 30 §3): π_ref when the KL's β ≠ 0 or the rule segments
on it, π_old when an update comes between the rollout and its micro-batches or the reward / rule reads it.
Skipping changes no number: one GRPO step with the skipped forwards equals the same step with both forwards
run (the ratio is 1 either way; the update's forward stands in for π_old)."""

import dataclasses

import pytest
import torch

from marlhf.rlhf.sections import needed_forwards


def test_the_forwards_each_configuration_needs():
    base = dict(kl_ctl=0.0, kl_penalty="loss", ppo_epochs=1, actor_micro_steps=2, gradient_accumulation_steps=2,
                rule_inputs=frozenset())
    assert needed_forwards(**base) == (False, False)  # GRPO at β = 0, one optimizer step: neither
    assert needed_forwards(**{**base, "kl_ctl": 0.05}) == (False, True)  # the KL loss reads π_ref
    assert needed_forwards(**{**base, "kl_ctl": 0.05, "kl_penalty": "reward"}) == (True, True)  # KL in the reward
    assert needed_forwards(**{**base, "ppo_epochs": 2}) == (True, False)  # the second epoch follows an update
    assert needed_forwards(**{**base, "gradient_accumulation_steps": 1}) == (True, False)  # two updates a step
    assert needed_forwards(**{**base, "rule_inputs": frozenset({"ref_logprobs"})}) == (False, True)  # ppl
    assert needed_forwards(**{**base, "rule_inputs": frozenset({"logprobs"})}) == (True, False)  # lowprob policy
    # the defaults of step 3 (MA-PPO, KL in the reward): both, as before
    from marlhf.config import RLHFArgs, parse_args
    from marlhf.rlhf.sections import RolloutSection

    args, _ = parse_args(RLHFArgs, [])
    r = RolloutSection.build(args, rule_inputs=frozenset())
    assert (r.policy_forward, r.reference_forward) == (True, True)


def actor_weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.rlhf.actor.module.named_parameters()}


@pytest.mark.parametrize("kl_ctl", [0.0, 0.1])
def test_a_step_without_the_skipped_forwards_equals_the_two_pass_step(tmp_path, kl_ctl):
    from ppo_harness import make_trainer, prompts, rlhf_args

    from marlhf import embedded

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path, advantage_estimator="grpo", num_samples_per_prompt=2,
                     per_device_generation_batch_size=4, per_device_training_batch_size=8, kl_penalty="loss",
                     kl_ctl=kl_ctl)
    runs = {}
    for two_pass in (False, True):
        t = make_trainer(args)
        if two_pass:
            t.rollout = dataclasses.replace(t.rollout, rule_inputs=frozenset({"logprobs", "ref_logprobs"}))  # both read
        else:
            assert (t.rollout.policy_forward, t.rollout.reference_forward) == (False, kl_ctl != 0)
        ids, mask = prompts(args, t.tokenizer, 4)
        before = actor_weights(t)
        exp, stats = t.make_experience(ids, mask, step=0)
        update = t.ppo_update([exp])
        runs[two_pass] = (exp, stats, update, before, actor_weights(t))
    (e1, s1, u1, b1, w1), (e2, s2, u2, b2, w2) = runs[False], runs[True]
    assert e1.logprobs is None and e2.logprobs is not None
    assert (e1.ref_logprobs is None) == (kl_ctl == 0) and e2.ref_logprobs is not None
    assert torch.equal(e1.seq, e2.seq) and torch.equal(e1.advantages, e2.advantages)  # the same samples
    assert all(torch.equal(b1[n], b2[n]) for n in b1)
    moved = max((w2[n] - b2[n]).abs().max().item() for n in w2)
    gap = max((w1[n] - w2[n]).abs().max().item() for n in w1)
    assert moved > 1e-4 and gap < 1e-7  # measured: moves of 1e-3, gap 0 (bit-identical weights)
    assert u1["actor_loss"] == pytest.approx(u2["actor_loss"], abs=1e-6)
    if kl_ctl:
        assert u1["kl_loss"] == pytest.approx(u2["kl_loss"], abs=1e-6)
    assert "kl" not in s1 and "kl" in s2  # a rollout without π_old reports no KL of its own
