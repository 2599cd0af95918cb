"""A step's memory plan from its parsed flags (:mod:`marlhf.models.memory_plan` holds the estimates): which models
the step builds and at which ZeRO stage, dtype, batch and lengths; the plan printed at its start, refused when it
cannot fit the device, and the flags that would make it fit; ``--plan_only``.  Entry-point glue: it reads the
flags, which the library below ``cli/`` never receives."""

from __future__ import annotations

import dataclasses
import logging

from marlhf.models.memory_plan import (
    HEADROOM_BYTES,
    Plan,
    _attn_of,
    device_memory_bytes,
    fits,
    format_plan,
    gib,
    plan_eval,
    plan_rlhf,
    plan_supervised,
    planned_world_size,
    shape_of,
)

log = logging.getLogger("marlhf")


def step_shapes(step: str, args, model: str) -> dict:
    """The :class:`ModelShape` of each model the step builds, from the folders' configs (``model``: the folder the
    step starts from, resolved).  Step 3 resolves the critic and reward model as it will load them."""
    from transformers import AutoConfig

    def shape(path, value_head=False, lora_dim=0, lora_modules=""):
        return shape_of(AutoConfig.from_pretrained(path), value_head, lora_dim, lora_modules)

    if step in ("sft", "dpo"):
        shapes = {"policy": shape(model, False, args.lora_dim, args.lora_module_name)}
        if step == "dpo":
            shapes["reference"] = shape(args.ref_model_name_or_path or model)
        return shapes
    if step == "rm":
        return {"policy": shape(model, True, args.lora_dim, args.lora_module_name)}
    if step == "eval":
        shapes = {"policy": shape(model)}
        if args.ref_model_name_or_path:
            shapes["reference"] = shape(args.ref_model_name_or_path)
        if args.reward_model_name_or_path or args.critic_model_name_or_path:
            shapes["reward"] = shape(args.reward_model_name_or_path or args.critic_model_name_or_path, True)
        return shapes
    from marlhf.embedded import default_model
    from marlhf.rlhf.advantages import estimator_class
    from marlhf.rlhf.rlhf_engine import model_paths

    paths = model_paths(model, args.critic_model_name_or_path, args.reward_model_name_or_path, args.reward_source,
                        default=lambda: default_model(""))
    shapes = {"actor": shape(model, False, args.actor_lora_dim or args.lora_dim,
                             args.actor_lora_module_name or args.lora_module_name)}
    if args.enable_ema:
        shapes["ema"] = shape(model)
    if estimator_class(args.advantage_estimator).needs_critic:
        shapes["critic"] = shape(paths["critic_model_name_or_path"], True, args.critic_lora_dim,
                                 args.critic_lora_module_name)
    if paths["reward_model_name_or_path"] is not None:
        shapes["reward"] = shape(paths["reward_model_name_or_path"], True)
    return shapes


def plan_step(step: str, args, shapes: dict, world_size: int, attn: str = "sdpa") -> Plan:
    """The step's :class:`Plan` at its flags (``args``: the step's config dataclass)."""
    if step == "eval":
        return plan_eval(shapes, world_size=world_size, dtype=args.dtype, zero_stage=args.actor_zero_stage,
                         offload=args.offload_reference_model,
                         generation_rows=(args.per_device_eval_generation_batch_size
                                          or args.per_device_generation_batch_size) * args.num_samples_per_prompt,
                         prompt_len=args.max_prompt_seq_len, answer_len=args.max_answer_seq_len)
    if step == "ppo":
        return plan_rlhf(shapes, world_size=world_size, dtype=args.dtype, actor_zero_stage=args.actor_zero_stage,
                         critic_zero_stage=args.critic_zero_stage, offload=args.offload,
                         offload_reference_model=args.offload_reference_model,
                         generation_rows=args.per_device_generation_batch_size * args.num_samples_per_prompt,
                         training_rows=args.per_device_training_batch_size, prompt_len=args.max_prompt_seq_len,
                         answer_len=args.max_answer_seq_len, actor_checkpointing=args.actor_gradient_checkpointing,
                         critic_checkpointing=args.critic_gradient_checkpointing, lora_only=args.only_optimize_lora,
                         attn=attn)
    return plan_supervised(step, shapes["policy"], world_size=world_size, dtype=args.dtype,
                           zero_stage=args.zero_stage, offload=args.offload, batch=args.per_device_train_batch_size,
                           seq_len=args.max_seq_len, checkpointing=args.gradient_checkpointing,
                           lora_only=args.only_optimize_lora, attn=attn, reference=shapes.get("reference"),
                           logits=step != "rm" or bool(getattr(args, "likelihood_term", False)))


def _remedies(step: str, args) -> list[tuple[str, dict]]:
    """Flag changes that lower the plan, least intrusive first: (the flags as typed, the fields they set)."""
    out = []
    if args.dtype == "fp32":
        out.append(("--dtype bf16", {"dtype": "bf16", "bf16": False}))
    if step == "eval":
        if args.actor_zero_stage != 3:
            out.append(("--actor_zero_stage 3", {"actor_zero_stage": 3}))
        if not args.offload_reference_model:
            out.append(("--offload_reference_model", {"offload_reference_model": True}))
        flag = "per_device_eval_generation_batch_size"
        if (getattr(args, flag) or args.per_device_generation_batch_size) > 1:
            out.append((f"--{flag} 1", {flag: 1}))
        return out
    if step == "ppo":
        ckpt = {f: True for f in ("actor_gradient_checkpointing", "critic_gradient_checkpointing")
                if not getattr(args, f)}
        if ckpt:
            out.append((" ".join(f"--{f}" for f in ckpt), ckpt))
        stages = {f: 3 for f in ("actor_zero_stage", "critic_zero_stage") if getattr(args, f) != 3}
        if stages:
            out.append((" ".join(f"--{f} 3" for f in stages), stages))
        if not args.offload_reference_model:
            out.append(("--offload_reference_model", {"offload_reference_model": True}))
        batch_flags = ("per_device_generation_batch_size", "per_device_training_batch_size")
    else:
        if not args.gradient_checkpointing:
            out.append(("--gradient_checkpointing", {"gradient_checkpointing": True}))
        if args.zero_stage != 3:
            out.append(("--zero_stage 3", {"zero_stage": 3}))
        batch_flags = ("per_device_train_batch_size",)
    if not args.offload:  # --offload needs ZeRO >= 1 for every offloaded engine; stage 3 offloads the weights too
        zero = {"zero_stage": 3} if step != "ppo" else {"actor_zero_stage": 3, "critic_zero_stage": 3}
        out.append(("--offload " + " ".join(f"--{f} 3" for f in zero), {"offload": True, **zero}))
    for flag in batch_flags:
        if getattr(args, flag) > 1:
            out.append((f"--{flag} 1", {flag: 1}))
    return out


def fitting_flags(step: str, args, shapes: dict, world_size: int, device_bytes: int, attn: str = "sdpa") -> list[str]:
    """Ways to make the plan fit ``device_bytes``: each single flag change that fits alone, else the shortest
    run of the changes (in :func:`_remedies`' order) that fits together; empty when nothing does."""
    remedies = _remedies(step, args)

    def fit(changes: dict) -> Plan | None:
        plan = plan_step(step, dataclasses.replace(args, **changes), shapes, world_size, attn)
        return plan if fits(plan, device_bytes) else None

    singles = [(flags, plan) for flags, changes in remedies if (plan := fit(changes))]
    if singles:
        return [f"{flags} ({gib(plan.peak)})" for flags, plan in singles]
    combined, flags = {}, []
    for typed, changes in remedies:
        combined.update(changes)
        for flag in typed.split(" --"):  # each flag once (--offload repeats the --zero_stage 3 before it)
            flag = flag if flag.startswith("--") else f"--{flag}"
            if flag not in flags:
                flags.append(flag)
        plan = fit(combined)
        if plan:
            return [f"{' '.join(flags)} ({gib(plan.peak)})"]
    return []


def check_memory(step: str, args, model: str, *, world_size: int | None = None, device_bytes: int | None = None,
                 mode: str | None = None, printer=None) -> Plan | None:
    """Plan the step's memory, show it (rank 0; ``printer``: print for --plan_only, else the run's log), and with
    ``mode`` (``--memory_check``) ``refuse`` raise a :class:`~marlhf.errors.ConfigError` naming the flags that
    would fit when the plan does not fit the device (``warn``: log it; ``off``: no plan at all)."""
    mode = mode or args.memory_check
    if mode == "off" and not args.plan_only:
        return None
    from transformers import AutoConfig

    from marlhf.utils import dist

    world_size = world_size or planned_world_size(args.plan_world_size)
    device_bytes = device_bytes if device_bytes is not None else device_memory_bytes(args.plan_device_memory_gb)
    try:
        shapes = step_shapes(step, args, model)
    except (OSError, ValueError, TypeError, RuntimeError, ImportError, AttributeError) as err:
        if args.plan_only:
            from marlhf.errors import ConfigError

            raise ConfigError(f"no memory plan: the models could not be built from their configs ({err})") from err
        # a model transformers cannot build on the meta device (remote code, a config it does not know): the run
        # goes on unplanned; its load reports what is wrong with the folder
        log.warning("no memory plan: the models could not be built from their configs (%s)", err)
        return None
    attn = _attn_of(AutoConfig.from_pretrained(model), args.attn_implementation, args.dtype, step == "rm")
    plan = plan_step(step, args, shapes, world_size, attn)
    if dist.is_main():
        (printer or log.info)(format_plan(plan, device_bytes))
    if device_bytes is None or fits(plan, device_bytes) or mode == "off":
        return plan
    ways = fitting_flags(step, args, shapes, world_size, device_bytes, attn)
    message = (f"the memory plan needs {gib(plan.peak)} per GPU ({world_size} rank{'s' if world_size > 1 else ''}) "
               f"and the device has {gib(device_bytes)} ({gib(HEADROOM_BYTES)} kept free); ")
    message += ("it fits with " + "; or ".join(ways) if ways else
                "no flag change makes it fit: use more GPUs (ZeRO-3 divides the model states over them) or a "
                "smaller model")
    message += " (--memory_check warn runs anyway)"
    if mode == "refuse":
        from marlhf.errors import ConfigError

        raise ConfigError(message)
    if dist.is_main():
        (printer or log.warning)(message)
    return plan


def plan_only(step: str, args, model: str) -> int:
    """``--plan_only``: print the plan (and, when it does not fit, the flags that would) from the configs alone;
    exit status 0."""
    check_memory(step, args, model, mode="warn", printer=print)
    return 0
