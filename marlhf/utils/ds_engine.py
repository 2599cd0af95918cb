"""Wrap models in DeepSpeed engines: optimizer groups, schedules, trainable and frozen engines."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from marlhf.utils import dist
from marlhf.utils.ds_config import eval_config, train_config
from marlhf.utils.optim_step import guard_optimizer

if TYPE_CHECKING:  # the flags' section type only; utils/ does not import the config at run time
    from marlhf.sections import EngineSection

log = logging.getLogger("marlhf")

_NO_DECAY = ("bias", "norm", "ln_", "layernorm", "embed_tokens")


def param_groups(model: nn.Module, weight_decay: float, lr: float, lora_lr: float) -> list[dict]:
    """AdamW groups: decay / no decay (biases, norms), and LoRA weights at their own learning rate."""
    groups: dict[tuple[float, float], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd = 0.0 if any(k in name.lower() for k in _NO_DECAY) else weight_decay
        group_lr = lora_lr if "lora_" in name else lr
        groups.setdefault((wd, group_lr), []).append(p)
    return [{"params": ps, "weight_decay": wd, "lr": glr} for (wd, glr), ps in groups.items()]


def make_optimizer(groups: list[dict], lr: float, offload: bool):
    """torch's fused AdamW (one kernel over all tensors per step, on the GPU as on the CPU: 1.5 ms against
    7.1 ms per-tensor for the 3.9M tiny model on CPU, the same update, tests/test_optim_step.py); DeepSpeedCPUAdam
    only where the optimizer state lives on the CPU (``--offload``: ZeRO-Offload takes no other).  Not
    DeepSpeed's FusedAdam: it JIT-compiles a CUDA extension with nvcc at the first run, and many GPU nodes have
    the driver but no CUDA toolchain."""
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, betas=(0.9, 0.95), adamw_mode=True)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def warmup_steps(total: int, num_warmup_steps: int, warmup_ratio: float) -> int:
    return num_warmup_steps if num_warmup_steps > 0 else int(math.ceil(total * warmup_ratio))


def make_scheduler(optimizer, kind: str, warmup: int, total: int):
    from transformers import get_scheduler

    return get_scheduler(kind, optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=max(total, 1))


def train_engine(model: nn.Module, *, lr: float, weight_decay: float, lora_lr: float, micro_batch: int,
                 grad_accum: int, zero_stage: int, offload: bool, dtype: str, scheduler: str, warmup: int,
                 total_steps: int, gradient_checkpointing: bool = False, tensorboard_dir: str | None = None,
                 extra_config: dict | None = None):
    """A DeepSpeed training engine around ``model`` (DeepSpeed-Chat's actor/critic/SFT setup).

    ``extra_config`` is merged into the DeepSpeed config (e.g. the actor's ``hybrid_engine`` section)."""
    import deepspeed

    if gradient_checkpointing:
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        # transformers >= 5 calls it activation checkpointing; older releases gradient checkpointing
        if hasattr(inner, "activation_checkpointing_enable"):
            inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    zero_stage = optimizer_zero_stage(zero_stage, dtype)
    config = train_config(micro_batch=micro_batch, grad_accum=grad_accum, world_size=dist.world_size(),
                          zero_stage=zero_stage, offload=offload, dtype=dtype, tensorboard_dir=tensorboard_dir)
    _merge(config, extra_config or {})
    optimizer = make_optimizer(param_groups(model, weight_decay, lr, lora_lr), lr, offload)
    if zero_stage == 0 and dtype == "fp32":  # the one setup where DeepSpeed has no non-finite check of its own
        optimizer = guard_optimizer(optimizer)
    sched = make_scheduler(optimizer, scheduler, warmup, total_steps)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=sched, config=config)
    return engine


def optimizer_zero_stage(zero_stage: int, dtype: str) -> int:
    """The ZeRO stage a training engine is built at: the flag's, except bf16 at stage 0, which runs at stage 1.

    DeepSpeed 0.19 trains bf16 at stage 0 without float32 master weights (its "DDP bf16" path: the optimizer
    steps the bf16 weights themselves and keeps its moments in bf16), so most of each small update is rounded
    away: two steps ended 0.2-0.4 of an update away from float32, where stages 1-3 (float32 masters) end
    0.04-0.09 away (tests/test_update_invariance.py).  Stage 1 keeps the weights whole on every rank as stage 0
    does and adds the float32 master copy every mixed-precision trainer keeps, partitioned over the ranks."""
    if zero_stage == 0 and dtype == "bf16":
        log.info("bf16 at --zero_stage 0: the optimizer runs as ZeRO-1 (float32 master weights, partitioned over "
                 "the ranks; DeepSpeed's stage 0 would step the bf16 weights directly)")
        return 1
    return zero_stage


def with_learning_rate(section: EngineSection, model: nn.Module) -> EngineSection:
    """``section`` with its learning rate in force: the flag's, else the default of its stage for ``model``'s size
    (:func:`default_learning_rate`, logged).  An entry point records it in the run context."""
    if section.learning_rate is not None:
        return section
    n_params = sum(getattr(q, "ds_numel", q.numel()) for q in model.parameters())
    return dataclasses.replace(section, learning_rate=default_learning_rate(section.stage, n_params))


def engine_from_section(model: nn.Module, section: EngineSection, total_steps: int, micro_batch: int,
                        extra_config: dict | None = None):
    """A training engine for ``model`` as its section says (``args.engine()`` of steps 1-2, ``args.engine("actor")``
    / ``args.engine("critic")`` of step 3); no learning rate: the default of its stage for the model's size."""
    section = with_learning_rate(section, model)
    return train_engine(model, lr=section.learning_rate, weight_decay=section.weight_decay,
                        lora_lr=section.lora_learning_rate,
                        micro_batch=micro_batch, grad_accum=section.schedule.gradient_accumulation_steps,
                        zero_stage=section.zero_stage, offload=section.offload, dtype=section.dtype,
                        scheduler=section.schedule.lr_scheduler_type,
                        warmup=warmup_steps(total_steps, section.schedule.num_warmup_steps,
                                            section.schedule.warmup_ratio),
                        total_steps=total_steps, gradient_checkpointing=section.gradient_checkpointing,
                        extra_config=extra_config)


# Peak learning rates when none is given.  The embedded tiny model (a few million parameters) trains at
# large rates; a real pretrained model gets the paper's Table 5 values for its size class (Gemma 2B / 7B /
# 27B; smaller models take the 2B values), which a tiny-model rate would wreck.
TINY_MODEL_PARAMS = 20_000_000
TINY_LEARNING_RATES = {"sft": 1e-3, "reward": 5e-4, "actor": 1e-4, "critic": 1e-4, "dpo": 1e-4}
DPO_LEARNING_RATE = 2e-7  # App. C.3 (Gemma-2B, the only size the paper trains DPO at; reused for the others)
PAPER_LEARNING_RATES = (  # (largest parameter count of the class, rates)
    (4e9, {"sft": 5e-5, "reward": 1e-5, "actor": 1.5e-5, "critic": 1.5e-5}),  # Gemma-2B (TL;DR / HH-RLHF)
    (12e9, {"sft": 2e-5, "reward": 1e-6, "actor": 1e-6, "critic": 1e-6}),  # Gemma-7B
    (math.inf, {"sft": 5e-6, "reward": 8e-6, "actor": 7e-7, "critic": 1e-6}),  # Gemma-2-27B
)


def default_learning_rate(stage: str, num_params: int) -> float:
    """The learning rate of ``stage`` (sft / reward / actor / critic) for a model of ``num_params``, logged."""
    if num_params < TINY_MODEL_PARAMS:
        lr, why = TINY_LEARNING_RATES[stage], "the embedded tiny model's default"
    elif stage == "dpo":
        lr, why = DPO_LEARNING_RATE, "the paper's App. C.3 DPO value (Gemma-2B)"
    else:
        bound, rates = next((b, r) for b, r in PAPER_LEARNING_RATES if num_params <= b)
        size = {4e9: "up to 4B (Gemma-2B)", 12e9: "4B-12B (Gemma-7B)"}.get(bound, "over 12B (Gemma-2-27B)")
        lr, why = rates[stage], f"the paper's Table 5 value for {size} parameters"
    log.info("%s learning rate %g: no learning rate given, %.1fM parameters -> %s", stage, lr, num_params / 1e6, why)
    return lr


def _merge(config: dict, extra: dict) -> None:
    """Merge ``extra`` into ``config`` section by section (nested dicts merged, values replaced)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge(config[key], value)
        else:
            config[key] = value


def frozen_engine(model: nn.Module, *, zero_stage: int, offload: bool, dtype: str):
    """An inference-only engine (reference / reward model): ZeRO-3 partitions it, otherwise whole."""
    import deepspeed

    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    config = eval_config(zero_stage=zero_stage, offload=offload, dtype=dtype, world_size=dist.world_size())
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine
