"""Export a trained model (a DeepSpeed engine, a peft model or a plain transformers model) as a Hugging Face
folder: ZeRO-3 partitions gathered on rank 0, LoRA merged (the adapter kept beside it), the conversation format
recorded, every file complete before it replaces the old one."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from marlhf.utils import dist

log = logging.getLogger("marlhf")


def gather_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU state dict on rank 0 (ZeRO-3 partitions gathered one parameter at a time); {} elsewhere.

    Whether a parameter is partitioned is read from the parameter itself (ZeRO-3 marks it), not from a flag:
    a frozen engine can be ZeRO-3 beside a trained one that is not (the EMA under --offload_reference_model),
    and exporting it at the actor's stage copied its empty partitions."""
    import deepspeed

    out = {}
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id"):
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if dist.is_main():
                    out[name] = param.detach().cpu().clone()
        elif dist.is_main():
            out[name] = param.detach().cpu().clone()
    if dist.is_main():
        persistent = set(model.state_dict().keys())  # non-persistent buffers (e.g. RoPE tables) are rebuilt
        for name, buf in model.named_buffers():
            if name in persistent:
                out.setdefault(name, buf.detach().cpu().clone())
    return out


def export_hf(model: nn.Module, tokenizer, out_dir: str | Path, dtype: torch.dtype | None = None,
              conversation=None) -> None:
    """Write ``model`` (a DeepSpeed engine, peft model or plain transformers model) as a Hugging Face folder.

    Rank 0 rebuilds the architecture on the meta device, assigns the gathered weights, merges LoRA (and
    keeps the adapter in peft's format under ``lora_adapter/``), and writes config + safetensors +
    tokenizer into a temporary folder whose complete files are then moved into ``out_dir`` (config last).
    ``conversation`` (a :class:`~marlhf.data.formatting.ConversationFormat`) is recorded beside them, so the
    next step and the evaluation tools use the end token and prompt format this model was trained with.
    The config keeps ``use_cache: true`` (training turns the KV cache off; inference wants it).
    All ranks must call this (ZeRO-3 gathering is collective)."""
    module = model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
    state = gather_state_dict(module)
    if dist.is_main():
        out_dir = Path(out_dir)
        tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        clean = _rebuild(module, state, tmp)
        if dtype is not None:
            clean = clean.to(dtype)
        training_cache, clean.config.use_cache = clean.config.use_cache, True  # the config object is shared
        clean.save_pretrained(tmp, safe_serialization=True)
        clean.config.use_cache = training_cache
        tokenizer.save_pretrained(tmp)
        if conversation is not None:
            from marlhf.data.formatting import write_format

            write_format(tmp, conversation)
        out_dir.mkdir(parents=True, exist_ok=True)
        # move file by file: out_dir also holds logs and checkpoints, which must survive
        for entry in sorted(tmp.iterdir(), key=lambda e: e.name == "config.json"):  # config last
            target = out_dir / entry.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(entry, target)
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("exported Hugging Face model to %s", out_dir)
    dist.barrier()


def _rebuild(module: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> nn.Module:
    """A fresh CPU copy of ``module``'s architecture holding ``state`` (LoRA merged)."""
    is_peft = hasattr(module, "peft_config")
    base = module.get_base_model() if is_peft else module
    with torch.device("meta"):
        fresh = type(base)(base.config)
        if getattr(base, "likelihood", None) is not None:  # a reward model's likelihood term
            from marlhf.models.heads import attach_likelihood_term

            attach_likelihood_term(fresh)
    if is_peft:
        from peft import get_peft_model

        fresh = get_peft_model(fresh, module.peft_config["default"])
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise RuntimeError(f"unexpected weights while exporting: {unexpected[:5]}")
    (fresh.get_base_model() if is_peft else fresh).tie_weights()
    still_meta = [n for n, p in fresh.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"weights missing while exporting: {still_meta[:5]} (missing keys {missing[:5]})")
    if is_peft:
        fresh.save_pretrained(folder / "lora_adapter")
        fresh = fresh.merge_and_unload()
    if getattr(fresh, "generation_config", None) is not None and getattr(base, "generation_config", None):
        fresh.generation_config = base.generation_config
    return fresh
