"""Load tokenizers, policies and value models — the one place that knows Hugging Face's classes.

The reward model and critic are ``AutoModelForSequenceClassification`` with one label: a base transformer
plus a scalar ``score`` head.  Plain transformers loads our step-2 output as a reward model (it scores the
last non-pad token, as we do); :func:`token_values` runs the same head on every position, which is what
the critic needs in step 3.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

log = logging.getLogger("marlhf")

# Config attribute names different architectures use for dropout probabilities.
_DROPOUT_KEYS = ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout", "resid_pdrop",
                 "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob")


def resolve_model_path(path: str) -> str:
    """An empty path means the embedded default model (built offline on first use).  A path that cannot be a
    hub name ("org/name" or "name") must exist locally."""
    if path:
        p = Path(path).expanduser()
        if not p.exists() and (p.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1):
            from marlhf.errors import ConfigError

            raise ConfigError(f"model folder {path!r} does not exist (give a local model folder or a Hugging Face "
                              f"hub name)")
        return path
    from marlhf import embedded

    return str(embedded.prepare().model_dir)


def load_tokenizer(path: str, end_of_conversation_token: str = "<|endoftext|>", padding_side: str = "right"):
    """The policy tokenizer, with a pad token and the end-of-conversation token registered as special."""
    tok = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if end_of_conversation_token and end_of_conversation_token not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": [end_of_conversation_token]})
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else end_of_conversation_token
    tok.padding_side = padding_side
    return tok


def _config(path: str, dropout: float | None, **extra):
    cfg = AutoConfig.from_pretrained(path, **extra)
    if dropout is not None:
        for key in _DROPOUT_KEYS:
            if hasattr(cfg, key):
                setattr(cfg, key, dropout)
    return cfg


def _fit_vocab(model: nn.Module, tokenizer) -> None:
    """Grow the embedding when the tokenizer gained tokens (e.g. the end-of-conversation token)."""
    n = len(tokenizer)
    if model.get_input_embeddings().weight.shape[0] < n:
        model.resize_token_embeddings(n)


def load_causal_lm(path: str, tokenizer, dropout: float | None = None, dtype: torch.dtype = torch.float32):
    path = resolve_model_path(path)
    cfg = _config(path, dropout)
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=dtype)
    _fit_vocab(model, tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = False
    if model.generation_config is not None:  # generation must stop at the end-of-conversation token too
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = stop_token_ids(tokenizer)
    return model


def stop_token_ids(tokenizer, end_of_conversation_token: str = "<|endoftext|>") -> list[int]:
    """Token ids that end an answer: the tokenizer's EOS and the end-of-conversation token."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    eot = tokenizer.convert_tokens_to_ids(end_of_conversation_token)
    if eot is not None and eot != tokenizer.unk_token_id and eot not in ids:
        ids.append(eot)
    return ids


def load_value_model(path: str, tokenizer, dropout: float | None = None, dtype: torch.dtype = torch.float32):
    """A reward model / critic: base LM + scalar head (freshly initialised when ``path`` is a causal LM)."""
    path = resolve_model_path(path)
    cfg = _config(path, dropout, num_labels=1)
    cfg.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(path, config=cfg, dtype=dtype)
    _fit_vocab(model, tokenizer)
    model.config.use_cache = False
    return model


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside DeepSpeed / peft wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):  # DeepSpeedEngine
            model = model.module
        elif hasattr(model, "get_base_model"):  # peft
            model = model.get_base_model()
        else:
            return model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding — what ``generate`` uses, so training forwards must use them too."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def token_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar head on every position: (B, T) values (the critic) / per-token rewards."""
    inner = _unwrap(model)
    base = getattr(inner, inner.base_model_prefix)
    hidden = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                  position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
    return inner.score(hidden).squeeze(-1).float()  # (B, T)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each right-padded row: (B,)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(dim=1)


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score of each sequence: the head's value at its last real token.  (B,)"""
    values = token_values(model, input_ids, attention_mask)
    idx = last_token_index(attention_mask)
    return values.gather(1, idx[:, None]).squeeze(1)


# --------------------------------------------------------------------------------------------------------
# LoRA (peft)
# --------------------------------------------------------------------------------------------------------
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
    log.info("LoRA r=%d on %d modules; trainable %d / %d parameters", dim, len(cfg.target_modules), n_train, n_all)
    return peft_model


def torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
