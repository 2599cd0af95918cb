"""The four models of step 3 (DeepSpeed-Chat's ``DeepSpeedRLHFEngine``), each its own DeepSpeed engine.

actor     = the SFT model, trained (own ZeRO stage, optional LoRA / gradient checkpointing / offload)
reference = a frozen copy of the SFT model (ZeRO-3 partitioned when the actor is; optionally offloaded)
critic    = the step-2 reward model, trained as the value function (own ZeRO stage); with a reward source
            other than the reward model and no critic given, the SFT model with a fresh value head (B.5);
            None for the critic-free estimators (--advantage_estimator rloo / grpo / reinforce)
reward    = the step-2 reward model, frozen (None when the reward comes from another source and no
            --reward_model_name_or_path is given); --reward_ensemble's other reward models beside it, frozen
ema       = optional exponential moving average of the actor (a frozen engine updated after each step)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from marlhf.errors import ConfigError, PlatformError
from marlhf.models.loading import (
    load_causal_lm,
    load_options,
    load_reward_model,
    load_value_model,
    resolve_model_path,
    torch_dtype,
    zero3_init_config,
)
from marlhf.models.lora import apply_lora
from marlhf.rlhf.sections import BatchSection, ModelsSection
from marlhf.utils import dist
from marlhf.utils.ds_engine import engine_from_section, frozen_engine, with_learning_rate
from marlhf.utils.zero3 import local_partition, materialized

if TYPE_CHECKING:
    from marlhf.sections import EngineSection

log = logging.getLogger("marlhf")


@dataclass
class RLHFEngine:
    actor: object
    ref: object
    critic: object | None  # None: a critic-free estimator (nothing built, loaded or saved)
    reward: object | None  # None: the reward source is not the reward model
    ema: object | None = None
    reward_ensemble: list = field(default_factory=list)  # --reward_ensemble's other frozen reward models
    learning_rates: dict = field(default_factory=dict)  # role -> peak learning rate in force (the run context's)

    def trainable(self) -> dict:
        """The engines whose state a checkpoint must hold."""
        out = {"actor": self.actor}
        if self.critic is not None:
            out["critic"] = self.critic
        if self.ema is not None:
            out["ema"] = self.ema
        return out


def model_paths(actor: str, critic: str, reward: str, reward_source: str,
                default: Callable[[], str]) -> dict[str, str | None]:
    """Step 3's model paths from the flags (the actor already resolved): without a reward model (gold scorer,
    program tests, the user's function or server) the critic starts from the SFT model, as the paper does for
    APPS (B.5), its value head new; with one, an empty critic flag is ``default()`` (the entry point's default
    model).  The reward model is the reward source, or (given explicitly) only reported in the held-out
    evaluation."""
    uses_rm = reward_source in ("reward_model", "rm")
    critic_path = critic or (default() if uses_rm else actor)
    reward_path = (reward or critic_path) if uses_rm else (reward or None)
    return {"actor_model_name_or_path": actor, "critic_model_name_or_path": critic_path,
            "reward_model_name_or_path": reward_path}


def hybrid_engine_config(models: ModelsSection) -> dict | None:
    """The actor's ``hybrid_engine`` section (DeepSpeed-Chat's settings), or None when the flag is off."""
    if not models.enable_hybrid_engine:
        return None
    return {"hybrid_engine": {"enabled": True, "max_out_tokens": models.max_out_tokens,
                              "inference_tp_size": models.inference_tp_size,
                              "release_inference_cache": models.release_inference_cache,
                              "pin_parameters": not models.unpin_actor_parameters,
                              "tp_gather_partition_size": models.tp_gather_partition_size}}


# DeepSpeed 0.19's hybrid engine generates through its inference kernels, one container per decoder-layer class
# (deepspeed/module_inject/replace_policy.py); a model without one has no ``_generate`` and fails on the first
# rollout.  Read against DeepSpeed 0.19.8 and transformers 5, per model_type, why it cannot run:
_HYBRID_REFUSED = {
    "llama": "the injected layer returns a tuple where transformers 5's LlamaModel takes a tensor, grouped-query "
             "attention (num_key_value_heads) is not passed to the kernel, and Llama-3's 'llama3' rope scaling is "
             "not implemented",
    "gpt2": "the injected layer returns a tuple where transformers 5's GPT2Model takes a tensor",
    "gptj": "the injected layer returns a tuple where transformers 5's GPTJModel takes a tensor",
    "gpt_neox": "the injected layer returns a tuple where transformers 5's GPTNeoXModel takes a tensor",
    "opt": "DeepSpeed skips OPT's kernel for transformers' cache-based decoder layers",
    "bloom": "DeepSpeed refuses its BLOOM kernel with transformers newer than 4.43.4",
}
# the one architecture with a kernel whose model reads the layer's output as a tuple: not refused here, not run
# by us on a GPU either (the README's "Running on GPU" says so)
HYBRID_ENGINE_ARCHITECTURES = ("gpt_neo",)


def hybrid_engine_refusal(model_type: str, lora: bool) -> str | None:
    """Why ``--enable_hybrid_engine`` cannot run this actor (None: DeepSpeed has a kernel that may).

    Decided from the model's config before anything is built: the failure would otherwise come at the first
    generation, after every model was loaded.  A peft (LoRA) actor is refused whatever its architecture: the
    kernels read the base weights and ignore the adapter (DeepSpeed-Chat fuses its own LoRA layers, not peft's)."""
    if lora:
        return "the actor has LoRA adapters (peft), which the hybrid engine's kernels ignore"
    if model_type in HYBRID_ENGINE_ARCHITECTURES:
        return None
    return _HYBRID_REFUSED.get(model_type, "DeepSpeed 0.19 has no inference kernel (container) for it")


def check_hybrid_engine(models: ModelsSection) -> None:
    """Refuse ``--enable_hybrid_engine`` (ConfigError) for an actor it cannot generate with, naming why."""
    if not models.enable_hybrid_engine:
        return
    from transformers import AutoConfig

    actor_path = models.actor_path
    model_type = AutoConfig.from_pretrained(actor_path).model_type
    reason = hybrid_engine_refusal(model_type, bool(models.actor_lora_dim))
    if reason:
        raise ConfigError(f"--enable_hybrid_engine cannot run the actor {actor_path} (model_type {model_type!r}): "
                          f"{reason}. For fast rollouts use --generation_backend vllm instead (a vLLM engine per "
                          f"rank, the actor's weights pushed into it after each update; pip install "
                          f"'marlhf[vllm]'), or drop the flag: generation then runs through the model's own "
                          f"generate() (under ZeRO-3 see --zero3_generation). DeepSpeed 0.19 has kernels that may "
                          f"run for: {', '.join(HYBRID_ENGINE_ARCHITECTURES)}.")


def frozen_zero_stage(stage: int, offload: bool) -> int:
    """The ZeRO stage of a frozen model (reference, EMA, reward model) beside a trained one at ``stage``.

    DeepSpeed offloads parameters only under ZeRO-3, so ``--offload_reference_model`` builds the frozen models
    at stage 3 (partitioned, parameters on the CPU, gathered layer by layer per forward) whatever the trained
    model's stage; without it they follow the trained model (stage 3 partitioned, stages 0-2 whole)."""
    return 3 if offload else stage


def mixed_precision_lora_config(models: ModelsSection) -> dict | None:
    """DeepSpeed-Chat's --enable_mixed_precision_lora: ZeRO-3 keeps the frozen (non-LoRA) actor weights
    quantized, partitioned hierarchically per node; only the LoRA weights train in full precision."""
    if not models.enable_mixed_precision_lora:
        return None
    if not models.actor_lora_dim or models.actor_zero_stage != 3:
        raise ConfigError("--enable_mixed_precision_lora needs LoRA on the actor (--actor_lora_dim > 0) and "
                         "--actor_zero_stage 3")
    if not models.only_optimize_lora:
        # DeepSpeed quantizes the non-trainable weights only: with the base weights training, nothing is
        raise ConfigError("--enable_mixed_precision_lora quantizes the frozen base weights, so it needs "
                         "--only_optimize_lora (without it every weight trains and none is quantized)")
    # hpZ keeps a secondary copy of the weights within a node: its partition is the node's ranks, not the
    # devices a rank can see (a launcher may give each rank one visible device)
    return {"zero_optimization": {"zero_quantized_nontrainable_weights": True,
                                  "zero_hpz_partition_size": dist.local_world_size()}}


def _gpu_only_error(flags: list[str], err: Exception) -> PlatformError:
    from deepspeed.accelerator import get_accelerator

    return PlatformError(f"{' and '.join(flags)}: DeepSpeed could not start the actor on the "
                        f"'{get_accelerator().device_name()}' accelerator ({err}). These features need DeepSpeed's GPU "
                        f"kernels (hybrid engine: inference kernels; mixed-precision LoRA: the ZeRO-3 quantizer) "
                        f"on CUDA/ROCm; drop the flag(s) to run here.")


def optimizer_steps(batches: BatchSection, ppo_steps: int, with_ptx: bool = False) -> int:
    """Optimizer (= scheduler) steps an engine takes in ``ppo_steps`` PPO steps.

    Each PPO step runs ``--ppo_epochs`` passes over ``--generation_batches`` experience batches split into
    micro-batches of ``--per_device_training_batch_size``; every micro-batch is one DeepSpeed micro-step
    (two for the actor with a ptx loss), and ``--gradient_accumulation_steps`` micro-steps make one update."""
    micro = batches.actor_micro_steps * (2 if with_ptx else 1)
    return max(1, ppo_steps * micro // batches.schedule.gradient_accumulation_steps)


# The EMA's weights are float32 in every run.  A step moves the average by (1 - decay)·(actor - ema): at
# --ema_decay 0.992 and the paper's learning rates that is far below a bf16 weight's resolution (2^-8 of it),
# so a bf16 average rounded most steps' movement away (of the true movement over 300 steps it kept 9 % at lr
# 1.5e-5 and 0.6 % at 1e-6 in issue 29's measurement, 34 % and 2.4 % on tests/test_ema.py's tiny Llama).
# It costs 4 bytes a parameter where the actor's bf16 copy costs 2 (partitioned under ZeRO-3, and then on
# the CPU with --offload_reference_model).  The export keeps float32: the average is the point of the model, a
# consumer casts it to its own dtype when loading.
EMA_DTYPE = "fp32"


def build_rlhf_engine(models: ModelsSection, actor_section: EngineSection, critic_section: EngineSection,
                      batches: BatchSection, tokenizer, total_steps: int) -> RLHFEngine:
    """The step-3 engines; ``total_steps`` counts PPO steps (schedulers get their optimizer-step totals)."""
    if models.enable_ema and models.actor_lora_dim:
        raise ConfigError("--enable_ema with a LoRA actor is not supported: the EMA tracks full weights; "
                         "drop --enable_ema or LoRA")
    actor_path = resolve_model_path(models.actor_path)
    critic_path = resolve_model_path(models.critic_path)
    reward_path = models.reward_path
    actor_total = optimizer_steps(batches, total_steps, models.with_ptx)
    critic_total = optimizer_steps(batches, total_steps)
    mb = batches.training_batch

    check_hybrid_engine(models)  # before any model is loaded
    # every model is loaded in the run's dtype, and built partitioned when its engine is ZeRO-3
    dtype = torch_dtype(models.dtype)
    hybrid, mp_lora = hybrid_engine_config(models), mixed_precision_lora_config(models)
    gpu_only = [f for f, on in (("--enable_hybrid_engine", hybrid), ("--enable_mixed_precision_lora", mp_lora)) if on]
    eot = models.end_of_conversation_token
    learning_rates = {}
    try:
        # actor: the SFT policy, trained (built under ZeRO-3 with the engine's quantization / hpZ settings)
        actor = load_causal_lm(actor_path, tokenizer, models.actor_dropout, dtype, end_of_conversation_token=eot,
                               ds_config=zero3_init_config(models.actor_zero_stage, models.offload, models.dtype,
                                                           mp_lora))
        if models.actor_lora_dim > 0:
            actor = apply_lora(actor, models.actor_lora_dim, models.actor_lora_module_name, models.only_optimize_lora)
        actor_section = with_learning_rate(actor_section, actor)
        learning_rates["actor"] = actor_section.learning_rate
        actor = engine_from_section(actor, actor_section, actor_total, mb,
                                    extra_config={**(hybrid or {}), **(mp_lora or {})})
    except (ValueError, RuntimeError, NotImplementedError) as err:
        if not gpu_only:
            raise
        raise _gpu_only_error(gpu_only, err) from err
    # reference: frozen SFT policy for the KL penalty
    offload_frozen = models.offload_reference_model
    ref_stage = frozen_zero_stage(models.actor_zero_stage, offload_frozen)
    ref = frozen_engine(load_causal_lm(actor_path, tokenizer, 0.0, **load_options(models.dtype, ref_stage,
                                                                                   offload_frozen)),
                        zero_stage=ref_stage, offload=offload_frozen, dtype=models.dtype)
    ema = None
    if models.enable_ema:
        # float32 whatever --dtype (EMA_DTYPE): checkpointed, resumed and exported (actor_ema/) in float32; under
        # ZeRO-3 built partitioned like the reference, in float32
        ema = frozen_engine(load_causal_lm(actor_path, tokenizer, 0.0, end_of_conversation_token=eot,
                                           **load_options(EMA_DTYPE, ref_stage, offload_frozen)),
                            zero_stage=ref_stage, offload=offload_frozen, dtype=EMA_DTYPE)
    # critic: the reward model as initial value function, trained (macro GAE only); its score head only, not a
    # likelihood term the reward model may have (values are read from where no answer has started)
    critic = None
    if models.needs_critic:
        critic = load_value_model(critic_path, tokenizer, models.critic_dropout,
                                  **load_options(models.dtype, models.critic_zero_stage, models.offload))
        if models.critic_lora_dim > 0:
            critic = apply_lora(critic, models.critic_lora_dim, models.critic_lora_module_name,
                                models.only_optimize_lora, task="SEQ_CLS")
        critic_section = with_learning_rate(critic_section, critic)
        learning_rates["critic"] = critic_section.learning_rate
        critic = engine_from_section(critic, critic_section, critic_total, mb)
    # reward: frozen scorer (only when the reward source is the reward model, or one is given for the evaluation),
    # and the ensemble's other members beside it
    reward_stage = frozen_zero_stage(models.critic_zero_stage, offload_frozen)

    def frozen_reward(path: str):
        return frozen_engine(load_reward_model(resolve_model_path(path), tokenizer, 0.0,
                                               **load_options(models.dtype, reward_stage, offload_frozen)),
                             zero_stage=reward_stage, offload=offload_frozen, dtype=models.dtype)

    reward = frozen_reward(reward_path) if reward_path is not None else None
    ensemble = [frozen_reward(path) for path in models.reward_ensemble]
    log.info("RLHF engine: actor %s (ZeRO-%d), critic %s (ZeRO-%d), reward %s, EMA %s", actor_path,
             models.actor_zero_stage, critic_path if critic is not None else "none (a critic-free estimator)",
             models.critic_zero_stage, reward_path or f"none (--reward_source {models.reward_source})",
             models.enable_ema)
    if ensemble:
        log.info("reward ensemble: %s and %s", reward_path, ", ".join(models.reward_ensemble))
    return RLHFEngine(actor, ref, critic, reward, ema, ensemble, learning_rates)


@torch.no_grad()
def update_ema(actor, ema, decay: float) -> None:
    """ema ← decay · ema + (1 − decay) · actor, parameter by parameter, in the EMA's dtype (float32,
    :data:`EMA_DTYPE`) from the actor's weights as the engine holds them (bf16 in a bf16 run: each differs from
    the optimizer's float32 master by at most half a bf16 step, an error that does not accumulate, unlike
    rounding the average itself).

    Each rank updates what it holds, with no communication: under ZeRO-3 the EMA's partition of each parameter
    from the actor's same partition (the actor at ZeRO-3: the same partitioning, both built alike) or from the
    matching slice of the actor's whole parameter (the actor at stages 0-2, the EMA partitioned by
    ``--offload_reference_model``).  Gathering every parameter and broadcasting it from rank 0 moved the whole
    model between ranks twice a step (~51 GB at 7B).  A parameter ZeRO-3 keeps whole on every rank (below its
    persistence threshold) is updated whole and its partition rewritten from it."""
    a_params = dict(actor.module.named_parameters())  # same architecture, no LoRA (build_rlhf_engine): by name
    for name, p_ema in ema.module.named_parameters():
        p = a_params[name]
        if hasattr(p_ema, "ds_id"):  # this rank's flat ZeRO-3 partition, from the actor's same share
            part = p_ema.ds_tensor
            source = p.ds_tensor if hasattr(p, "ds_id") else local_partition(p.data, p_ema)
            if source.numel() != part.numel():
                raise RuntimeError(f"EMA update: the actor's and the EMA's ZeRO-3 partitions of {name} differ in size "
                                   f"({source.numel()} vs {part.numel()})")
            part.lerp_(source.to(part.device, part.dtype), 1.0 - decay)
        if materialized(p_ema):  # held whole (below ZeRO-3, or a persistent ZeRO-3 parameter once fetched)
            p_ema.data.lerp_(_whole(p).to(p_ema.device, p_ema.dtype), 1.0 - decay)


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: itself, unless ZeRO-3 partitioned it (then gathered: collective, and only
    reached when the EMA holds a parameter whole that the actor does not, which does not happen: ZeRO-3 makes
    the same parameters persistent in both, and the actor's are fetched at every training step)."""
    if materialized(p):
        return p.data
    import deepspeed

    with deepspeed.zero.GatheredParameters([p]):
        return p.data.clone()
