"""Step 3's sections: what each part of MA-PPO reads, each flag declared once, here, where it is used.

Step 3's flat command line (:class:`marlhf.config.RLHFArgs`: DeepSpeed-Chat's flag names) is generated from
these sections and the shared ones (:mod:`marlhf.sections`); the trainer (:func:`marlhf.rlhf.trainer.mappo_sections`)
builds them from the parsed flags (:meth:`~marlhf.utils.flags.Section.build`) and hands each part its own — the
termination rule the ``macro`` section, the rollout and its advantage estimator the ``rollout`` section, the PPO
update the ``update`` section.  Torch-free: ``--help`` imports this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from marlhf.sections import ScheduleSection
from marlhf.utils.flags import Components, Section, derived, flag


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


def ngram_value(text) -> int | None:
    """``--ngram`` as the fixed rule's n: None means ∞ (one macro action per response)."""
    text = str(text).strip().lower()
    if text in ("0", "inf", "infinity", "none"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--ngram must be a positive integer, 0 or inf, got {text!r}")
    return int(text)


@dataclass(frozen=True, kw_only=True)
class ModelsSection(Section):
    """Step 3's four models (and the EMA): where each comes from, how each is built beside its engine, and each
    trained model's optimizer (``RLHFArgs.engine(role)``).  The paths are resolved by the entry point (an empty
    actor flag is the embedded model; the critic is the reward model, or the actor when the reward needs none;
    the reward model is None when the reward is not a model) and given to :meth:`build`."""

    TITLE = "models and their engines"

    actor_path: str = flag("", "The SFT model (step 1 output).", name="actor_model_name_or_path", resolved=True)
    critic_path: str = flag("", "The reward model (step 2 output); also initialises the critic.",
                            name="critic_model_name_or_path", resolved=True)
    reward_path: str | None = flag("", "A different reward model than the critic's init (default: same).",
                                   name="reward_model_name_or_path", type=str, resolved=True)
    unsupervised_dataset_name: str = flag("", "Dataset for the ptx (pre-training) loss; empty disables it.")
    actor_learning_rate: float | None = flag(None, "Actor peak learning rate (default: 1e-4 for the embedded tiny "
                                             "model, the paper's Table 5 value for the model's size otherwise).")
    critic_learning_rate: float | None = flag(None, "Critic peak learning rate (default as for the actor).")
    actor_weight_decay: float = flag(0.0, "Actor AdamW weight decay.")
    critic_weight_decay: float = flag(0.0, "Critic AdamW weight decay.")
    actor_zero_stage: int = flag(0, "ZeRO stage of the actor (and reference).", choices=(0, 1, 2, 3))
    critic_zero_stage: int = flag(0, "ZeRO stage of the critic (and reward model).", choices=(0, 1, 2, 3))
    offload_reference_model: bool = flag(False, "Keep reference/reward parameters offloaded to CPU.")
    actor_gradient_checkpointing: bool = flag(False, "Gradient checkpointing in the actor.")
    critic_gradient_checkpointing: bool = flag(False, "Gradient checkpointing in the critic.")
    actor_dropout: float | None = flag(0.0, "Actor dropout (0 makes PPO ratios exact).")
    critic_dropout: float | None = flag(0.0, "Critic dropout.")
    enable_hybrid_engine: bool = flag(False, "DeepSpeed hybrid engine for generation (GPU only).")
    inference_tp_size: int = flag(1, "Hybrid engine tensor-parallel size.")
    tp_gather_partition_size: int = flag(8, "Hybrid engine gather partition size.")
    release_inference_cache: bool = flag(False, "Hybrid engine: free the KV cache after generation.")
    unpin_actor_parameters: bool = flag(False, "Hybrid engine: unpin parameters (ZeRO-3).")
    enable_ema: bool = flag(False, "Keep an exponential moving average of the actor.")
    ema_decay: float = flag(0.992, "EMA decay.")
    enable_mixed_precision_lora: bool = flag(False, "ZeRO-3 keeps the frozen actor weights quantized, LoRA weights "
                                             "train in full precision (needs actor LoRA + ZeRO-3; GPU only).")
    actor_lora_dim: int = flag(0, "Actor LoRA rank (0 = --lora_dim).", type=int, parse=lambda v, a: v or a.lora_dim)
    actor_lora_module_name: str = flag("", "Actor LoRA modules (empty = --lora_module_name).", type=str,
                                       parse=lambda v, a: v or a.lora_module_name)
    critic_lora_dim: int = flag(0, "Critic LoRA rank.")
    critic_lora_module_name: str = flag("", "Critic LoRA modules.")
    reward_ensemble: tuple[str, ...] = derived(lambda a: tuple(a.reward_ensemble))  # RewardSection's
    needs_critic: bool = derived()  # the advantage estimator trains a critic
    with_ptx: bool = derived(lambda a: bool(a.unsupervised_dataset_name) and a.unsup_coef != 0)  # 2 micro-steps
    only_optimize_lora: bool = derived(lambda a: a.only_optimize_lora)
    offload: bool = derived(lambda a: a.offload)
    dtype: str = derived(lambda a: a.dtype)
    max_out_tokens: int = derived(lambda a: a.max_prompt_seq_len + a.max_answer_seq_len)  # hybrid engine's
    end_of_conversation_token: str = derived()  # the run's (an added token grows the actor's vocabulary)
    reward_source: str = derived(lambda a: a.reward_source)  # for the log only


@dataclass(frozen=True, kw_only=True)
class RewardSection(Section):
    """Where the sequence score comes from (:func:`marlhf.rewards.build_reward_source`)."""

    TITLE = "reward source"

    reward_source: str = flag("reward_model", "Where the sequence score comes from (marlhf/rewards/): the reward "
                              "model ('rm' is the same); the embedded task's gold scorer; program_tests: each "
                              "answer's program run against its problem's unit tests in a sandbox, reward of paper "
                              "App. B.5; python: your function (--reward_function); remote: your HTTP server "
                              "(--reward_url). The last three need no reward model: the critic starts from the "
                              "actor unless --critic_model_name_or_path is given.",
                              choices=("reward_model", "rm", "gold", "program_tests", "python", "remote"))
    reward_ensemble: tuple[str, ...] = flag([], "More reward models (step-2 outputs, e.g. other seeds) scoring beside "
                                            "the main one (--reward_model_name_or_path, else the critic's init); the "
                                            "reward is their --reward_ensemble_reduce (a conservative reward against "
                                            "over-optimisation, Coste et al. 2023). The held-out evaluation reports "
                                            "it as ensemble_score beside the main model's rm_score.")
    reward_ensemble_reduce: str = flag("mean_minus_std", "How --reward_ensemble's scores combine: mean_minus_std "
                                       "(mean - --reward_ensemble_std_coef x std over the models), mean, or min.",
                                       choices=("mean_minus_std", "mean", "min"))
    reward_ensemble_std_coef: float = flag(1.0, "k of mean_minus_std.")
    reward_workers: int = flag(1, "program_tests: worker processes running the programs of a batch in parallel "
                               "(results do not depend on it).")
    reward_function: str = flag("", "python: the reward function, FILE.py:NAME (a path from the working directory) "
                                "or package.module:NAME; called once per batch of each rank as NAME(prompts=[str], "
                                "responses=[str], meta=[dict]) — plus ended=[bool] (answer stopped at the end token) "
                                "when it has an 'ended' parameter or **kwargs — it returns one number per "
                                "response; an exception, a wrong count, nan or inf stops the run.")
    reward_url: str = flag("", "remote: the reward server's http(s) URL; each batch of each rank is one POST of "
                           "JSON {\"prompts\", \"responses\", \"meta\", \"ended\"}, answered by "
                           "{\"rewards\": [...]}, one number per response (OpenRLHF's remote reward shape).")
    reward_timeout: float = flag(60.0, "remote: seconds each attempt waits for the server (connection and each "
                                 "read).")
    reward_retries: int = flag(3, "remote: retries after a connection error, a timeout or an HTTP 5xx, waiting 1, 2, "
                               "4, ... s before each; an HTTP 4xx or a malformed answer stops the run at once.")


@dataclass(frozen=True, kw_only=True)
class BatchSection(Section):
    """How much step 3 generates and trains on per step, and for how long (``schedule``: epochs, steps,
    accumulation and the seed, shared with the engines)."""

    TITLE = "batches"

    generation_batch: int = flag(8, "Prompts per rank per generation batch.", name="per_device_generation_batch_size")
    samples_per_prompt: int = flag(1, "K answers sampled per prompt (a group: generated, scored and given advantages "
                                   "together on one rank); --per_device_generation_batch_size counts prompts, so a "
                                   "generation batch holds that many x K experiences.", name="num_samples_per_prompt")
    generation_batches: int = flag(1, "Generation batches collected before each PPO update.")
    training_batch: int = flag(8, "Experiences per rank per PPO micro-batch.", name="per_device_training_batch_size")
    ppo_epochs: int = flag(1, "PPO passes over each collected experience batch.")
    schedule: ScheduleSection

    @property
    def experiences_per_batch(self) -> int:
        return self.generation_batch * self.samples_per_prompt

    @property
    def actor_micro_steps(self) -> int:
        """The actor's micro-batches in one PPO update (without the ptx ones)."""
        return math.ceil(self.experiences_per_batch / self.training_batch) * self.generation_batches * self.ppo_epochs


@dataclass(frozen=True, kw_only=True)
class PolicySection(Section):
    """The policy distribution every part of step 3 computes log-probabilities in, and its KL to the reference —
    declared once, shared by the rollout, the update and the held-out evaluation: π = softmax(logits / T), β and
    where the β KL goes (the reward or the loss, :func:`kl_in_reward`)."""

    TITLE = "policy and KL"

    logprob_temperature: float = flag("1", "Temperature T of π = softmax(logits / T) for log π_old, log π, log π_ref "
                                      "and the KL: '1' (raw logits; DeepSpeed-Chat and the MA-RLHF code) or "
                                      "'sampling' (--temperature: the distribution the answers were sampled from, "
                                      "before top-k / top-p; TRL and OpenRLHF).", choices=("1", "sampling"), type=str,
                                      parse=lambda v, a: logprob_temperature(v, a.temperature))
    kl_ctl: float = flag(0.05, "β of the per-token KL penalty -β(logπ - logπ_ref).")
    kl_penalty: str = flag("reward", "The β = --kl_ctl KL penalty: per token in the reward (-β(logπ - logπ_ref), "
                           "DeepSpeed-Chat / the paper), or as a loss term β·KL (k3 estimator per token, GRPO).",
                           choices=KL_PENALTIES)

    @property
    def reward_kl_ctl(self) -> float:
        """β of the per-token KL penalty in the reward: 0 when the KL is a loss term instead."""
        return self.kl_ctl if kl_in_reward(self.kl_penalty) else 0.0

    @property
    def kl_in_loss(self) -> bool:
        """The policy loss gains β · the k3 KL (``--kl_penalty loss``; :func:`kl_in_reward` decides)."""
        return not kl_in_reward(self.kl_penalty)


@dataclass(frozen=True, kw_only=True)
class MacroSection(Section):
    """Where macro actions end (paper §3.2.1): what every termination rule may read."""

    TITLE = "macro actions"

    termination_condition: str = flag("fixed", "Macro-action termination rule ζ (paper §3.2.1): one module each in "
                                      "marlhf/rlhf/termination.", choices=Components("marlhf.rlhf.termination"))
    ngram: int | None = flag("5", "n of the fixed rule: 1 = vanilla PPO, 0 or inf = one macro action per response.",
                             type=str, parse=lambda v, a: ngram_value(v))
    repeat_times: int = flag(3, "Randomized rule: times the length list {2,3,5,10} is repeated.")
    parser_cutoff: int = flag(5, "Parsing rule: a tree node with fewer than C tokens is one macro action.")
    parser_backend: str = flag("auto", "Parsing rule backend.",
                               choices=("auto", "benepar", "spacy", "treesitter", "redbaron"))
    parser_model: str = flag("", "Parsing rule model: a benepar model name (e.g. benepar_en3 in nltk_data) or folder, "
                             "or a spaCy pipeline; empty: the backend's default (benepar: benepar_en3 if "
                             "installed, else the project-built model).")
    response_kind: str = flag("auto", "Parsing rule: responses are natural language or Python code; auto: the "
                              "task's (code for code and synthetic_code), else code with --reward_source "
                              "program_tests, else text.",
                              choices=("auto", "text", "code"), resolved=True)
    lowprob_threshold: float = flag(0.1, "Low-probability rule: a macro action ends at a token whose probability is "
                                    "below this τ (Segmental Advantage Estimation's forking tokens).")
    lowprob_model: str = flag("reference", "Low-probability rule: whose probability — the reference model's or the "
                              "sampling policy's (π_old at --logprob_temperature).", choices=("reference", "policy"))
    split_last: bool = derived(lambda a: a.macro_reward == "compat")  # the released code's last-token split


@dataclass(frozen=True, kw_only=True)
class RolloutSection(Section):
    """Reward shaping and the advantage estimate of a rollout (and how ZeRO-3 generates)."""

    TITLE = "rewards and advantages"

    policy: PolicySection  # π's temperature and the KL (shared with the update)
    clip_reward_value: float = flag(5.0, "RM scores are clipped to ±this.")
    value_function: str = flag("equal", "σ weights of token values inside a macro action (paper D.1).",
                               choices=("equal", "unit", "position"))
    macro_reward: str = flag("sum", "Macro reward: 'sum' (paper, ρ = 1) or 'compat' (released code: σ-weighted, "
                             "last token its own macro action).", choices=("sum", "compat"))
    gamma: float = flag(1.0, "Discount γ between macro steps.")
    lam: float = flag(0.95, "GAE λ (the actor's advantages, and the critic's returns unless --lam_critic).")
    lam_critic: float | None = flag(None, "GAE λ of the critic's returns Q = A + V (VAPO decouples it from the "
                                    "actor's; 1 gives Monte-Carlo value targets). None: --lam.")
    adaptive_lam_alpha: float = flag(0.0, "> 0: the actor's λ per answer is 1 - 1/(α·L), L its number of macro "
                                     "actions (VAPO's length-adaptive λ); 0: --lam for every answer.")
    whiten_advantages: bool = flag(False, "Whiten advantages over the batch (breaks batch invariance).")
    zero3_generation: str = flag("gather", "ZeRO-3 actor without hybrid engine: gather all parameters once per "
                                 "generate call (fast) or fetch them per layer with ranks in step (fits any size).",
                                 choices=("gather", "synced"))
    advantage_estimator: str = flag("gae", "gae: macro GAE with a critic (MA-PPO); rloo: leave-one-out baseline over "
                                    "the K samples of a prompt; grpo: (R - mean) / std over them; reinforce: "
                                    "batch-mean baseline (these three treat the response as one action); mc_macro: "
                                    "macro advantages on Monte-Carlo values of each macro boundary (--mc_rollouts). "
                                    "None but gae builds a critic (one module each in marlhf/rlhf/advantages).",
                                    choices=Components("marlhf.rlhf.advantages"))
    grpo_normalization: str = flag("std", "grpo: divide the centred group returns by the group's std (GRPO), or not "
                                   "('none': Dr. GRPO, Liu et al. 2025).", choices=("std", "none"))
    mc_rollouts: int = flag(4, "mc_macro: continuations sampled with the current policy from each macro action's "
                            "start state; their mean score is its Monte-Carlo value (VinePPO). Costs that many extra "
                            "answers per macro action.")
    critic_mc_check: int = flag(0, "> 0: with a critic (gae), sample that many continuations from every macro "
                                "boundary each step and log how well the critic's V(s_k) agrees with their mean "
                                "score (train/critic_mc_corr, train/critic_mc_rmse; VinePPO's diagnostic). Costs "
                                "that many extra answers per macro action; 0: off.")
    batches: BatchSection  # K answers per prompt; the update's micro-steps (whether π_old needs its own forward)
    with_ptx: bool = derived(lambda a: bool(a.unsupervised_dataset_name) and a.unsup_coef != 0)  # 2 micro-steps
    # what the run's termination rule reads (marlhf.rlhf.termination.rule_inputs; by default both forwards run)
    rule_inputs: frozenset[str] = derived(lambda a: frozenset({"logprobs", "ref_logprobs"}))

    @property
    def num_samples_per_prompt(self) -> int:
        """K (``--num_samples_per_prompt``)."""
        return self.batches.samples_per_prompt

    @property
    def policy_forward(self) -> bool:
        """log π_old from a forward of its own (False: the update's forward gives it, :func:`needed_forwards`)."""
        return self._forwards()[0]

    @property
    def reference_forward(self) -> bool:
        """log π_ref needs the reference's forward (False: nothing reads it)."""
        return self._forwards()[1]

    def _forwards(self) -> tuple[bool, bool]:
        b = self.batches
        return needed_forwards(kl_ctl=self.policy.kl_ctl, kl_penalty=self.policy.kl_penalty, ppo_epochs=b.ppo_epochs,
                               actor_micro_steps=b.actor_micro_steps * (2 if self.with_ptx else 1),
                               gradient_accumulation_steps=b.schedule.gradient_accumulation_steps,
                               rule_inputs=self.rule_inputs)


@dataclass(frozen=True, kw_only=True)
class UpdateSection(Section):
    """The PPO update: epochs over the experience in micro-batches (``batches``: the step's one
    :class:`BatchSection`), clipping, the losses' extra terms."""

    TITLE = "PPO update"

    batches: BatchSection  # ppo_epochs, training_batch (the micro-batch), schedule.gradient_accumulation_steps
    policy: PolicySection  # π = softmax(logits / T), as π_old was; with --kl_penalty loss, + β · k3 KL in the loss
    cliprange: float = flag(0.2, "PPO policy ratio clip ε.")
    cliprange_value: float = flag(0.2, "Value clip around the old values.")
    policy_ratio: str = flag("token", "PPO ratio per token with the macro advantage (released code) or per "
                             "macro action exp(Σ Δlogπ) (paper eq.)", choices=("token", "macro"))
    unsup_coef: float = flag(27.8, "Weight of the ptx loss.")
    tis_cap: float = flag(0.0, "With --generation_backend vllm: truncated importance sampling of the engine's "
                          "answers, each token's policy-gradient term weighted by min(π_old / π_engine, this cap) "
                          "(veRL's and OpenRLHF's correction for the engine's numbers differing from the actor's); "
                          "0: off. Needs --logprob_temperature 1 (the engine reports raw log-probabilities).",
                          name="vllm_tis_cap")
    loss_aggregation: str = derived(lambda a: a.loss_aggregation)  # RobustnessSection's


@dataclass(frozen=True, kw_only=True)
class EvalSection(Section):
    """Step 3's held-out evaluation (:func:`marlhf.eval.policy.evaluate_policy`): answers sampled as in training."""

    TITLE = "held-out evaluation"

    batch: int = flag(0, "Prompts per rank per batch of the held-out evaluation (0: "
                      "--per_device_generation_batch_size). Its answers are one seeded stream, so runs compared on "
                      "the same prompts must use the same value.", name="per_device_eval_generation_batch_size",
                      type=int, parse=lambda v, a: v or a.per_device_generation_batch_size)
    eval_prompts: str = flag("all", "Which held-out prompts the evaluation answers: all, or one of two interleaved "
                             "halves (validation: the 1st, 3rd, ...; test: the 2nd, 4th, ...), so that settings "
                             "chosen on the validation half are reported on prompts they were not chosen on.",
                             choices=("all", "validation", "test"))
    zero3_generation: str = derived(lambda a: a.zero3_generation)  # RolloutSection's
    policy: PolicySection  # T of π and π_ref in the KL, as in training


@dataclass(frozen=True, kw_only=True)
class ReportSection(Section):
    """What step 3 prints beside its metrics."""

    TITLE = "printed answers"

    print_answers: bool = flag(False, "Print a sample prompt/answer every --print_answers_interval steps.")
    print_answers_interval: int = flag(1, "Steps between printed answers.")

    @property
    def every(self) -> int:
        """Steps between printed answers (0: none)."""
        return self.print_answers_interval if self.print_answers else 0


STEP3_SECTIONS = (ModelsSection, BatchSection, PolicySection, MacroSection, RolloutSection, UpdateSection,
                  EvalSection, RewardSection, ReportSection)  # with marlhf.sections' SamplingSection
