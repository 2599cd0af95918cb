"""The step-3 settings in sections: what each part of MA-PPO reads, built once from the flat flags.

The command line stays flat (DeepSpeed-Chat's flag names, :class:`marlhf.config.RLHFArgs`, where every default
is declared once); the recipe (:class:`marlhf.rlhf.trainer.MAPPOTrainer`) cuts it into these frozen sections
and hands each part its own — the termination rule the ``macro`` section, the rollout and its advantage
estimator the ``rollout`` section, the PPO update the ``update`` section.  The sections have no defaults of
their own: a field missing from the flags is an error here, not a second default that can disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def logprob_temperature(choice: str, temperature: float) -> float:
    """T of the policy distribution π = softmax(logits / T) that π_old, π, π_ref and the KL are computed from
    (``--logprob_temperature``): 1 (raw logits: DeepSpeed-Chat and the MA-RLHF code, the default) or
    ``sampling``: the sampling ``temperature`` (TRL and OpenRLHF), so that π_old is the temperature-scaled
    distribution the answers were drawn from (top-k / top-p truncation is not applied: a token outside the
    truncated set would get log π = -inf)."""
    choice = str(choice)
    if choice == "sampling":
        return float(temperature)
    if choice in ("1", "1.0"):
        return 1.0
    raise ValueError(f"--logprob_temperature must be '1' or 'sampling', got {choice!r}")


KL_PENALTIES = ("reward", "loss")


def kl_in_reward(kl_penalty: str) -> bool:
    """Where the β = ``--kl_ctl`` KL to the reference goes, decided here and nowhere else (``--kl_penalty``):
    True, per token in the reward, −β(log π − log π_ref) (step 3's reward shaping, DeepSpeed-Chat and the
    RLOO paper; so also in a critic-free return R_i); False, as GRPO's k3 term in the policy loss.  Every
    reader asks it: which forwards a rollout needs, the rewards, R_i and the update's loss."""
    if kl_penalty not in KL_PENALTIES:
        raise ValueError(f"kl_penalty={kl_penalty!r} is not valid; choose one of {', '.join(KL_PENALTIES)}")
    return kl_penalty == "reward"


def needed_forwards(*, kl_ctl: float, kl_penalty: str, ppo_epochs: int, actor_micro_steps: int,
                    gradient_accumulation_steps: int, rule_inputs: frozenset[str]) -> tuple[bool, bool]:
    """(policy forward, reference forward) a rollout must run; skipping one changes no number.

    The reference's log-probabilities are read by the KL (β = ``kl_ctl`` ≠ 0) and by rules that segment on them
    (ppl, lowprob).  π_old needs a forward of its own unless the update's forward gives the same values: one PPO
    epoch whose actor micro-steps (``actor_micro_steps``, ptx ones included) make exactly one optimizer step, so
    no update comes between the rollout and any of its micro-batches — then log π_old = log π of that forward,
    detached (the ratio is 1, its gradient A·∇log π; TRL's num_iterations = 1) — and nothing else reads π_old at
    rollout time: no KL in the reward, no rule on the policy's probabilities."""
    reference = kl_ctl != 0 or "ref_logprobs" in rule_inputs
    reward_kl = kl_ctl != 0 and kl_in_reward(kl_penalty)
    one_update = ppo_epochs == 1 and actor_micro_steps == gradient_accumulation_steps
    policy = not (one_update and not reward_kl and "logprobs" not in rule_inputs)
    return policy, reference


@dataclass(frozen=True)
class PolicySection:
    """The policy distribution every part of step 3 computes log-probabilities in, and its KL to the reference —
    declared once, shared by the rollout, the update and the held-out evaluation: π = softmax(logits / T), β and
    where the β KL goes (the reward or the loss, :func:`kl_in_reward`)."""

    logprob_temperature: float  # T of π = softmax(logits / T) for π_old, π and π_ref
    kl_ctl: float  # β
    kl_penalty: str  # reward | loss

    @classmethod
    def from_args(cls, args) -> PolicySection:
        return cls(logprob_temperature=logprob_temperature(args.logprob_temperature, args.temperature),
                   kl_ctl=args.kl_ctl, kl_penalty=args.kl_penalty)

    @property
    def reward_kl_ctl(self) -> float:
        """β of the per-token KL penalty in the reward: 0 when the KL is a loss term instead."""
        return self.kl_ctl if kl_in_reward(self.kl_penalty) else 0.0

    @property
    def kl_in_loss(self) -> bool:
        """The policy loss gains β · the k3 KL (``--kl_penalty loss``; :func:`kl_in_reward` decides)."""
        return not kl_in_reward(self.kl_penalty)


@dataclass(frozen=True)
class MacroSection:
    """Where macro actions end (paper §3.2.1): what every termination rule may read."""

    termination_condition: str
    ngram: int | None  # the fixed rule's n; None = one macro action per answer
    repeat_times: int  # randomized rule
    parser_backend: str  # parsing rule
    parser_cutoff: int
    parser_model: str
    response_kind: str  # text | code
    lowprob_threshold: float  # lowprob rule: τ
    lowprob_model: str  # lowprob rule: reference | policy
    split_last: bool  # the released code's split of the last token (--macro_reward compat)

    @classmethod
    def from_args(cls, args, response_kind: str) -> MacroSection:
        """The flags, with the run's resolved ``response_kind`` (:func:`marlhf.tasks.response_kind`)."""
        return cls(termination_condition=args.termination_condition, ngram=args.ngram_n,
                   repeat_times=args.repeat_times, parser_backend=args.parser_backend,
                   parser_cutoff=args.parser_cutoff, parser_model=args.parser_model,
                   response_kind=response_kind, lowprob_threshold=args.lowprob_threshold,
                   lowprob_model=args.lowprob_model, split_last=args.macro_reward == "compat")


@dataclass(frozen=True)
class RolloutSection:
    """Reward shaping and the advantage estimate of a rollout (and how ZeRO-3 generates)."""

    policy: PolicySection  # π's temperature and the KL (shared with the update)
    clip_reward_value: float | None
    value_function: str
    macro_reward: str
    gamma: float
    lam: float
    lam_critic: float | None  # the critic's GAE λ (None: lam)
    adaptive_lam_alpha: float  # > 0: the actor's λ per sample, 1 − 1/(α·L) (VAPO)
    whiten_advantages: bool
    zero3_generation: str
    advantage_estimator: str
    num_samples_per_prompt: int  # K
    grpo_normalization: str
    mc_rollouts: int  # mc_macro: continuations sampled from each macro boundary
    critic_mc_check: int  # > 0: with a critic, that many continuations per boundary to check its values
    policy_forward: bool  # log π_old from a forward of its own (False: the update's forward gives it)
    reference_forward: bool  # log π_ref (False: nothing reads it)

    @classmethod
    def from_args(cls, args, rule_inputs: frozenset[str] = frozenset({"logprobs", "ref_logprobs"}),
                  policy: PolicySection | None = None) -> RolloutSection:
        """The flags; ``rule_inputs``: what the run's termination rule reads (the trainer passes the rule's own,
        :func:`marlhf.rlhf.termination.rule_inputs`; by default both forwards run); ``policy``: the run's one
        :class:`PolicySection` (built from the flags when not given)."""
        with_ptx = bool(getattr(args, "unsupervised_dataset_name", "")) and args.unsup_coef != 0
        micro = math.ceil(args.per_device_generation_batch_size * args.num_samples_per_prompt
                          / args.per_device_training_batch_size) * args.generation_batches * args.ppo_epochs
        policy = policy or PolicySection.from_args(args)
        own_forward, reference = needed_forwards(
            kl_ctl=policy.kl_ctl, kl_penalty=policy.kl_penalty, ppo_epochs=args.ppo_epochs,
            actor_micro_steps=micro * (2 if with_ptx else 1),
            gradient_accumulation_steps=args.gradient_accumulation_steps, rule_inputs=rule_inputs)
        return cls(policy=policy, clip_reward_value=args.clip_reward_value,
                   value_function=args.value_function, macro_reward=args.macro_reward, gamma=args.gamma,
                   lam=args.lam, lam_critic=args.lam_critic, adaptive_lam_alpha=args.adaptive_lam_alpha,
                   whiten_advantages=args.whiten_advantages, zero3_generation=args.zero3_generation,
                   advantage_estimator=args.advantage_estimator, num_samples_per_prompt=args.num_samples_per_prompt,
                   grpo_normalization=args.grpo_normalization, mc_rollouts=args.mc_rollouts,
                   critic_mc_check=args.critic_mc_check,
                   policy_forward=own_forward, reference_forward=reference)


@dataclass(frozen=True)
class BatchSection:
    """How much step 3 generates and trains on per step, and for how long."""

    generation_batch: int  # prompts per rank per generation batch (--per_device_generation_batch_size)
    samples_per_prompt: int  # K (--num_samples_per_prompt)
    generation_batches: int  # generation batches per PPO step
    training_batch: int  # experiences per PPO micro-batch (--per_device_training_batch_size)
    ppo_epochs: int
    gradient_accumulation_steps: int
    num_train_epochs: int
    max_steps: int
    seed: int  # the prompt sampler's (the ptx sampler's: seed + 1)

    @classmethod
    def from_args(cls, args) -> BatchSection:
        return cls(generation_batch=args.per_device_generation_batch_size,
                   samples_per_prompt=args.num_samples_per_prompt, generation_batches=args.generation_batches,
                   training_batch=args.per_device_training_batch_size, ppo_epochs=args.ppo_epochs,
                   gradient_accumulation_steps=args.gradient_accumulation_steps,
                   num_train_epochs=args.num_train_epochs, max_steps=args.max_steps, seed=args.seed)

    @property
    def experiences_per_batch(self) -> int:
        return self.generation_batch * self.samples_per_prompt


@dataclass(frozen=True)
class UpdateSection:
    """The PPO update: epochs over the experience in micro-batches (``batches``: the step's one
    :class:`BatchSection`), clipping, the losses' extra terms."""

    batches: BatchSection  # ppo_epochs, training_batch (the micro-batch), gradient_accumulation_steps
    loss_aggregation: str
    cliprange: float
    cliprange_value: float
    policy_ratio: str
    unsup_coef: float
    policy: PolicySection  # π = softmax(logits / T), as π_old was; with --kl_penalty loss, + β · k3 KL in the loss

    @classmethod
    def from_args(cls, args, policy: PolicySection | None = None,
                  batches: BatchSection | None = None) -> UpdateSection:
        return cls(batches=batches or BatchSection.from_args(args), loss_aggregation=args.loss_aggregation,
                   cliprange=args.cliprange, cliprange_value=args.cliprange_value, policy_ratio=args.policy_ratio,
                   unsup_coef=args.unsup_coef, policy=policy or PolicySection.from_args(args))


@dataclass(frozen=True)
class EvalSection:
    """Step 3's held-out evaluation (:func:`marlhf.eval.policy.evaluate_policy`): answers sampled as in training."""

    batch: int  # prompts per rank per batch
    zero3_generation: str
    policy: PolicySection  # T of π and π_ref in the KL, as in training

    @classmethod
    def from_args(cls, args) -> EvalSection:
        return cls(batch=args.per_device_eval_generation_batch_size or args.per_device_generation_batch_size,
                   zero3_generation=args.zero3_generation, policy=PolicySection.from_args(args))
