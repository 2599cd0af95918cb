"""DeepSpeed config dictionaries for training and frozen (inference-only) engines, built from our flags."""

from __future__ import annotations

from deepspeed.accelerator import get_accelerator

from marlhf.errors import PlatformError


def check_dtype(dtype: str) -> None:
    """Fail early, with the reason, when the accelerator cannot train in ``dtype``."""
    acc = get_accelerator()
    if dtype == "fp16" and not acc.is_fp16_supported():
        raise PlatformError(
            f"--dtype fp16 needs an accelerator with fp16 support (DeepSpeed's fp16 loss scaling); this machine's "
            f"accelerator is '{acc.device_name()}', which has none. Use --dtype bf16 or fp32.")
    if dtype == "bf16" and not acc.is_bf16_supported():
        raise PlatformError(f"--dtype bf16 is not supported on accelerator '{acc.device_name()}'. Use fp32.")


def _precision(dtype: str) -> dict:
    if dtype == "fp16":
        return {"fp16": {"enabled": True, "loss_scale_window": 100, "initial_scale_power": 16}}
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    return {}


def train_config(*, micro_batch: int, grad_accum: int, world_size: int, zero_stage: int = 0,
                 offload: bool = False, dtype: str = "fp32", grad_clip: float = 1.0,
                 tensorboard_dir: str | None = None, job_name: str = "marlhf") -> dict:
    """A training engine's config (DeepSpeed-Chat's ``get_train_ds_config`` in spirit)."""
    check_dtype(dtype)
    device = "cpu" if offload else "none"
    zero = {"stage": zero_stage,
            "offload_param": {"device": device},
            "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False}
    if zero_stage < 3:
        zero.pop("offload_param")
    cfg = {"train_batch_size": micro_batch * grad_accum * world_size,
           "train_micro_batch_size_per_gpu": micro_batch,
           "gradient_accumulation_steps": grad_accum,
           "steps_per_print": 10 ** 9,  # we log ourselves
           "zero_optimization": zero,
           "gradient_clipping": grad_clip,
           "prescale_gradients": False,
           "wall_clock_breakdown": False,
           **_precision(dtype)}
    if tensorboard_dir:
        cfg["tensorboard"] = {"enabled": False, "output_path": tensorboard_dir, "job_name": job_name}
    return cfg


def eval_config(*, zero_stage: int = 0, offload: bool = False, dtype: str = "fp32", micro_batch: int = 1,
                world_size: int = 1) -> dict:
    """A frozen engine (reference / reward model): ZeRO-3 partitions params, lower stages hold them whole."""
    check_dtype(dtype)
    zero = {"stage": zero_stage if zero_stage == 3 else 0,
            "stage3_param_persistence_threshold": 1e4,
            "offload_param": {"device": "cpu" if offload else "none"},
            "memory_efficient_linear": False}
    return {"train_batch_size": micro_batch * world_size,
            "train_micro_batch_size_per_gpu": micro_batch,
            "steps_per_print": 10 ** 9,
            "zero_optimization": zero,
            "prescale_gradients": False,
            "wall_clock_breakdown": False,
            **_precision(dtype)}
