"""LoRA adapters (peft) on the Linear layers DeepSpeed-Chat's ``--lora_module_name`` names."""

from __future__ import annotations

import logging
import re

from torch import nn

log = logging.getLogger("marlhf")


def lora_targets(model: nn.Module, module_names: str) -> list[str]:
    """Names of the Linear layers that get LoRA: those containing one of the comma-separated substrings
    (DeepSpeed-Chat's --lora_module_name), or every Linear inside the decoder blocks when empty."""
    wanted = [s for s in module_names.split(",") if s.strip()]
    names = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or name.endswith(("lm_head", "score")):
            continue
        in_block = re.search(r"\.layers?\.\d+\.|\.h\.\d+\.|\.blocks?\.\d+\.", f".{name}")
        if (any(w in name for w in wanted) if wanted else in_block):
            names.append(name)
    if not names:
        raise ValueError(f"--lora_module_name {module_names!r} matches no Linear layer of {type(model).__name__}")
    return names


def apply_lora(model: nn.Module, dim: int, module_names: str, only_optimize_lora: bool, task: str = "CAUSAL_LM"):
    """Wrap ``model`` with peft LoRA adapters; unless ``only_optimize_lora``, the base weights train too."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=dim, lora_alpha=dim, lora_dropout=0.0, target_modules=lora_targets(model, module_names),
                     task_type=task, modules_to_save=["score"] if task == "SEQ_CLS" else None)
    peft_model = get_peft_model(model, cfg)
    if not only_optimize_lora:
        for p in peft_model.parameters():
            p.requires_grad_(True)
    n_train = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in peft_model.parameters())
    from peft.tuners.lora import LoraLayer

    n_modules = sum(isinstance(m, LoraLayer) for m in peft_model.modules())  # wrapped layers, not name patterns
    log.info("LoRA r=%d on %d modules; trainable %d / %d parameters", dim, n_modules, n_train, n_all)
    return peft_model
