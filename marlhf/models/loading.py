"""Load tokenizers, policies and value models — the one place that knows Hugging Face's classes.

The reward model and critic are ``AutoModelForSequenceClassification`` with one label: a base transformer
plus a scalar ``score`` head.  Plain transformers loads our step-2 output as a reward model (it scores the
last non-pad token, as we do); :func:`token_values` runs the same head on every position, which is what
the critic needs in step 3.

A reward model may also carry a :class:`LikelihoodTerm` (step 2's ``--likelihood_term``): α times the
answer's log-probability under a next-token head over the same hidden states, added to the head's value.
Plain transformers loads such a folder without the term (its weights are extra keys); :func:`load_reward_model`
loads both.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

from marlhf.data.formatting import read_format, resolve_format
from marlhf.models.heads import attach_likelihood_term, fp32_head, full_shape
from marlhf.utils import dist
from marlhf.utils.ds_config import eval_config
from marlhf.utils.ds_engine import _merge

log = logging.getLogger("marlhf")

# Config attribute names different architectures use for dropout probabilities.
_DROPOUT_KEYS = ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout", "resid_pdrop",
                 "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob")


def resolve_model_path(path: str) -> str:
    """A model folder or hub name to load.  A path that cannot be a hub name ("org/name" or "name") must exist
    locally; an empty one is refused (the entry points resolve it: :func:`marlhf.embedded.default_model`)."""
    if not path:
        from marlhf.errors import ConfigError

        raise ConfigError("no model given (an entry point passes the embedded default model for an empty flag)")
    p = Path(path).expanduser()
    if not p.exists() and (p.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1):
        from marlhf.errors import ConfigError

        raise ConfigError(f"model folder {path!r} does not exist (give a local model folder or a Hugging Face "
                          f"hub name)")
    return path


def load_tokenizer(path: str, end_of_conversation_token: str = "", padding_side: str = "right",
                   add_eot_token: bool = False):
    """The policy tokenizer with a pad token distinct from its EOS and end-of-conversation tokens.

    ``add_eot_token`` registers a token that is not in the vocabulary as a new special token (DeepSpeed-Chat's
    --add_eot_token; the embedding grows by one untrained row)."""
    tok = _plain_tokenizer(path, end_of_conversation_token, add_eot_token)
    _distinct_pad(tok, end_of_conversation_token)
    tok.padding_side = padding_side
    return tok


def load_tokenizer_and_format(path: str, end_of_conversation_token: str = "", prompt_format: str = "auto",
                              padding_side: str = "right", add_eot_token: bool = False):
    """(tokenizer, :class:`~marlhf.data.formatting.ConversationFormat`) of a model folder: the flags win,
    then what the folder records (a model trained here), then the tokenizer's own end-of-turn token."""

    path = resolve_model_path(path)
    recorded = read_format(path)
    tok = _plain_tokenizer(path, end_of_conversation_token or recorded.get("end_of_conversation_token", ""),
                           add_eot_token)
    fmt = resolve_format(tok, recorded, end_of_conversation_token, prompt_format)
    _distinct_pad(tok, fmt.end_of_conversation_token)
    tok.padding_side = padding_side
    return tok, fmt


def _plain_tokenizer(path: str, end_of_conversation_token: str, add_eot_token: bool):
    tok = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if add_eot_token and end_of_conversation_token and end_of_conversation_token not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": [end_of_conversation_token]})
        log.warning("added %r to the vocabulary as a new special token (--add_eot_token)", end_of_conversation_token)
    return tok


def _distinct_pad(tok, end_of_conversation_token: str) -> None:
    """Make the pad token differ from the EOS and end-of-conversation tokens.

    Plain transformers' sequence classifier scores the last token that is not the pad token, so a pad equal
    to the end token would move every exported reward model's score one token early (SmolLM2 and GPT-2 pad
    with their EOS; Llama-3 has no pad).  The unknown token, which never ends a text, is used when there is
    one; otherwise a ``<|pad|>`` special token is added (its embedding row is never read: padding is masked)."""
    ends = {tok.eos_token_id}
    if end_of_conversation_token:
        ends.add(tok.convert_tokens_to_ids(end_of_conversation_token))
    ends.discard(None)
    if tok.pad_token_id is not None and tok.pad_token_id not in ends:
        return
    before = tok.pad_token
    if tok.unk_token_id is not None and tok.unk_token_id not in ends:
        tok.pad_token = tok.unk_token
    else:
        tok.add_special_tokens({"pad_token": "<|pad|>"})
    log.info("pad token %r -> %r (distinct from the end-of-answer token, so reward scores are read at the right "
             "position)", before, tok.pad_token)


ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "flash_attention_2", "eager")
# the --attn_implementation of the loads inside :func:`attention_implementation` (an entry point's models)
_REQUESTED_ATTN = contextvars.ContextVar("marlhf_attn_implementation", default="auto")


@contextlib.contextmanager
def attention_implementation(requested: str):
    """Models loaded inside use ``requested`` attention (``--attn_implementation``), also where a library function
    loads them for the entry point (step 3's engines)."""
    token = _REQUESTED_ATTN.set(requested)
    try:
        yield
    finally:
        _REQUESTED_ATTN.reset(token)


def _model_class(cfg, value_head: bool):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    mapping = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING if value_head else MODEL_FOR_CAUSAL_LM_MAPPING
    return mapping.get(type(cfg), None)


def _flash_attention_usable() -> str | None:
    """None when flash_attention_2 can run here, else why not."""
    import torch

    if not torch.cuda.is_available():
        return "it runs on CUDA GPUs only and this machine has none"
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed (pip install flash-attn)"
    return None


def resolve_attn_implementation(cfg, requested: str | None = None, dtype: torch.dtype = torch.float32,
                                value_head: bool = False) -> str | None:
    """The attention a model of ``cfg`` runs with.  ``auto`` picks per architecture from what its transformers
    class declares: flash_attention_2 where the class supports it, flash-attn is installed, a GPU is present and
    the dtype is 16-bit (its kernels take no fp32); else sdpa where the class supports it; else eager.  A model
    whose attention logits are soft-capped (Gemma-2's ``attn_logit_softcapping``) never gets sdpa, which cannot
    compute the cap, whatever its class declares: transformers before 5.21 declared sdpa for Gemma-2 and ran it
    without the cap; eager and transformers 5's flash-attention kernels apply it.  So Gemma-2 gets eager on a CPU
    and flash_attention_2 on a GPU with flash-attn.  A class transformers does not map (remote code) gets None
    under auto: transformers' own choice.  flash_attention_2 requested where it cannot run, or sdpa requested
    for soft-capped attention, is a :class:`~marlhf.errors.PlatformError` saying why."""
    requested = requested or _REQUESTED_ATTN.get()
    if requested not in ATTN_IMPLEMENTATIONS:
        from marlhf.errors import ConfigError

        raise ConfigError(f"--attn_implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, got {requested!r}")
    cls = _model_class(cfg, value_head)
    if requested == "flash_attention_2":
        why = _flash_attention_usable()
        if why is None and cls is not None and not getattr(cls, "_supports_flash_attn", False):
            why = f"transformers' {cls.__name__} does not support it"
        if why:
            from marlhf.errors import PlatformError

            raise PlatformError(f"--attn_implementation flash_attention_2: {why}; use --attn_implementation auto "
                                f"(sdpa or eager, whichever the architecture supports)")
        return requested
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if requested == "sdpa" and softcap:
        from marlhf.errors import PlatformError

        raise PlatformError(f"--attn_implementation sdpa: {getattr(cfg, 'model_type', 'this model')}'s attention "
                            f"logits are soft-capped (attn_logit_softcapping={softcap}), which SDPA cannot compute; "
                            f"use --attn_implementation auto (eager, or flash_attention_2 on a GPU)")
    if requested != "auto":
        return requested
    if cls is None:  # remote code: its class says what it supports, transformers reads it
        return None
    if getattr(cls, "_supports_flash_attn", False) and dtype in (torch.bfloat16, torch.float16) \
            and _flash_attention_usable() is None:
        return "flash_attention_2"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) and not softcap else "eager"


def _attn_kwargs(cfg, dtype: torch.dtype, value_head: bool, requested: str | None) -> dict:
    choice = resolve_attn_implementation(cfg, requested, dtype, value_head)
    log.info("attention of %s (%s): %s (--attn_implementation %s)", getattr(cfg, "model_type", "?"),
             "value model" if value_head else "causal LM", choice or "transformers' default",
             requested or _REQUESTED_ATTN.get())
    return {"attn_implementation": choice} if choice else {}


def _config(path: str, dropout: float | None, **extra):
    cfg = AutoConfig.from_pretrained(path, **extra)
    if dropout is not None:
        for key in _DROPOUT_KEYS:
            if hasattr(cfg, key):
                setattr(cfg, key, dropout)
    return cfg


def _fit_vocab(model: nn.Module, tokenizer) -> None:
    """Grow the embedding when the tokenizer gained tokens (e.g. the end-of-conversation token); transformers
    gathers a ZeRO-3 partitioned embedding to resize it."""
    n = len(tokenizer)
    if full_shape(model.get_input_embeddings().weight)[0] < n:
        model.resize_token_embeddings(n)


def _partition_new_parameters(model: nn.Module, ds_config: dict | None) -> None:
    """Under ZeRO-3, partition the parameters built whole after loading: transformers makes a resized
    embedding (:func:`_fit_vocab`) a full tensor on every rank.  DeepSpeed converts them, broadcasting each
    from rank 0 first, so the ranks' copies of the new rows agree."""
    if not ds_config or not any(not hasattr(p, "ds_id") for p in model.parameters()):
        return
    import deepspeed

    deepspeed.zero.Init(module=model, config_dict_or_path=ds_config)


def zero3_init_config(zero_stage: int, offload: bool, dtype: str, extra: dict | None = None) -> dict | None:
    """The DeepSpeed config a model that will run under ZeRO-3 is built with (:func:`zero3_construction`),
    or None below stage 3.  Partitioning, parameter offload and dtype are what ``deepspeed.zero.Init`` reads;
    they are the engine's (:func:`~marlhf.utils.ds_config.eval_config` / ``train_config`` share them)."""
    if zero_stage != 3:
        return None

    cfg = eval_config(zero_stage=3, offload=offload, dtype=dtype, world_size=dist.world_size())
    _merge(cfg, extra or {})
    return cfg


def load_options(dtype: str, zero_stage: int, offload: bool, attn_implementation: str | None = None) -> dict:
    """Keyword arguments of the load functions for a model of an engine at ``zero_stage`` in ``dtype``: the
    dtype, under ZeRO-3 construction already partitioned, and the attention (None: the entry point's,
    :func:`attention_implementation`)."""
    options = {"dtype": torch_dtype(dtype), "ds_config": zero3_init_config(zero_stage, offload, dtype)}
    return {**options, "attn_implementation": attn_implementation} if attn_implementation else options


@contextlib.contextmanager
def zero3_construction(ds_config: dict | None):
    """Models loaded inside are built by ``deepspeed.zero.Init`` when ``ds_config`` is a ZeRO-3 config.

    transformers' ``from_pretrained`` does so while an ``HfDeepSpeedConfig`` is alive (it keeps a weak
    reference): each parameter is partitioned as it is created, rank 0 reads the checkpoint and each tensor is
    scattered from it, so no rank ever holds the whole model (without it every rank builds the full model
    first, and DeepSpeed partitions it only in ``deepspeed.initialize``).  The reference is dropped on exit:
    later loads (a ZeRO-0 critic beside a ZeRO-3 actor) must not be partitioned."""
    if not ds_config or ds_config.get("zero_optimization", {}).get("stage") != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 - alive for the block: from_pretrained finds it by weakref
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def load_causal_lm(path: str, tokenizer, dropout: float | None = None, dtype: torch.dtype = torch.float32,
                   end_of_conversation_token: str = "", ds_config: dict | None = None,
                   attn_implementation: str | None = None):
    """A causal LM in ``dtype`` (the run's: a bf16 run never holds an fp32 copy), built partitioned when
    ``ds_config`` is a ZeRO-3 config (:func:`zero3_construction`), with ``attn_implementation`` (default: the
    entry point's :func:`attention_implementation`; :func:`resolve_attn_implementation`)."""
    path = resolve_model_path(path)
    cfg = _config(path, dropout)
    attn = _attn_kwargs(cfg, dtype, False, attn_implementation)
    with zero3_construction(ds_config):
        model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=dtype, **attn)
        _fit_vocab(model, tokenizer)
        _partition_new_parameters(model, ds_config)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = False
    if model.generation_config is not None:  # generation must stop at the end-of-conversation token too
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = stop_token_ids(tokenizer, end_of_conversation_token)
    return model


def stop_token_ids(tokenizer, end_of_conversation_token: str = "") -> list[int]:
    """Token ids that end an answer: the tokenizer's EOS and the end-of-conversation token."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    eot = tokenizer.convert_tokens_to_ids(end_of_conversation_token) if end_of_conversation_token else None
    if eot is not None and eot != tokenizer.unk_token_id and eot not in ids:
        ids.append(eot)
    return ids


_LIKELIHOOD_KEYS = r"^likelihood\."


@contextlib.contextmanager
def _expected_unexpected_keys(cfg, pattern: str | None):
    """While loading, transformers' load report leaves out keys matching ``pattern`` (a regex) — the weights
    of a reward model's likelihood term, which :func:`load_reward_model` loads after ``from_pretrained``, and
    which the report would otherwise list as UNEXPECTED on every load.  A class transformers does not map
    (remote code) keeps its full report."""
    cls = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING.get(type(cfg), None) if pattern else None
    if cls is None:
        yield
        return
    attr = "_keys_to_ignore_on_load_unexpected"
    had, saved = attr in cls.__dict__, cls.__dict__.get(attr)
    setattr(cls, attr, [*(getattr(cls, attr) or []), pattern])
    try:
        yield
    finally:
        if had:
            setattr(cls, attr, saved)
        else:
            delattr(cls, attr)


def load_value_model(path: str, tokenizer, dropout: float | None = None, dtype: torch.dtype = torch.float32,
                     ds_config: dict | None = None, attn_implementation: str | None = None):
    """A reward model / critic: base LM + scalar head (freshly initialised when ``path`` is a causal LM; under
    ZeRO-3 transformers initialises it on rank 0 and scatters it).  ``dtype`` / ``ds_config``: as
    :func:`load_causal_lm`."""
    path = resolve_model_path(path)
    cfg = _config(path, dropout, num_labels=1)
    cfg.pad_token_id = tokenizer.pad_token_id
    # a likelihood term's weights are extra keys to transformers; load_reward_model reads them itself
    extra = _LIKELIHOOD_KEYS if getattr(cfg, "likelihood_term", False) else None
    attn = _attn_kwargs(cfg, dtype, True, attn_implementation)
    with _expected_unexpected_keys(cfg, extra), zero3_construction(ds_config):
        model = AutoModelForSequenceClassification.from_pretrained(path, config=cfg, dtype=dtype, **attn)
        _fit_vocab(model, tokenizer)
        _partition_new_parameters(model, ds_config)
    fp32_head(model.score)  # the value computed in float32 even when the engine runs bf16 (Fp32Linear)
    model.config.use_cache = False
    return model


def load_reward_model(path: str, tokenizer, dropout: float | None = None, dtype: torch.dtype = torch.float32,
                      likelihood_term: bool = False, ds_config: dict | None = None, likelihood_norm: str = "sum",
                      likelihood_scale: float = 1.0, attn_implementation: str | None = None):
    """A reward model: :func:`load_value_model`, plus the folder's :class:`LikelihoodTerm` when it has one.

    ``likelihood_term`` adds a fresh term (summing, or with ``likelihood_norm="mean"`` averaging, the answer's
    log-probabilities) to a model that has none (step 2 from an SFT model): its next-token
    head starts as the folder's LM head (or the input embeddings, when the model ties them) and α as
    ``likelihood_scale``, so the untrained reward model already ranks answers by how likely the SFT model finds
    them (a folder's term keeps its own α).  Under ZeRO-3
    (``ds_config``) the term is built partitioned too and its weights are written in from rank 0."""
    import deepspeed

    path = resolve_model_path(path)
    model = load_value_model(path, tokenizer, dropout, dtype, ds_config, attn_implementation)
    has_term = bool(getattr(model.config, "likelihood_term", False))
    if not (has_term or likelihood_term):
        return model
    zero3 = hasattr(model.score.weight, "ds_id")
    with deepspeed.zero.Init(config_dict_or_path=ds_config) if zero3 else contextlib.nullcontext():
        attach_likelihood_term(model, None if has_term else likelihood_norm)  # a folder's term keeps its own
    if not zero3:
        model.likelihood.to(model.score.weight.dtype)  # (zero.Init builds it in the config's dtype)
    if has_term:
        weights = _folder_tensors(path, ("likelihood.lm_head.weight", "likelihood.scale"))
        head, scale = weights["likelihood.lm_head.weight"], weights["likelihood.scale"]
    else:
        head = _folder_tensors(path, ("lm_head.weight",), required=False).get("lm_head.weight")
        if head is None:
            if not getattr(model.config, "tie_word_embeddings", False):
                raise ValueError(f"{path}: no lm_head.weight to start the likelihood term from (is it a causal LM?)")
            embedding = model.get_input_embeddings().weight
            with deepspeed.zero.GatheredParameters([embedding], enabled=zero3):
                head = embedding.detach().clone()
        scale = torch.tensor(float(likelihood_scale))
    term = model.likelihood
    vocab = full_shape(term.lm_head.weight)[0]
    if head.shape[0] < vocab:  # the tokenizer gained tokens (_fit_vocab): they start at the mean row
        head = torch.cat([head, head.float().mean(0, keepdim=True).to(head.dtype).expand(vocab - head.shape[0], -1)])

    # under ZeRO-3 rank 0 writes the gathered tensors and they are partitioned again on exit
    with deepspeed.zero.GatheredParameters(list(term.parameters()), modifier_rank=0, enabled=zero3), torch.no_grad():
        if not zero3 or dist.is_main():
            term.lm_head.weight.copy_(head[:vocab])
            term.scale.copy_(scale)
    return model


def _folder_tensors(path: str, names: tuple[str, ...], required: bool = True) -> dict[str, torch.Tensor]:
    """Named tensors of a Hugging Face folder's safetensors weights (one file or shards with an index)."""
    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        weight_map = json.loads(index.read_text())["weight_map"]
        files = {folder / weight_map[n] for n in names if n in weight_map}
    elif (folder / "model.safetensors").is_file():
        files = {folder / "model.safetensors"}
    else:
        raise ValueError(f"{path}: no model.safetensors (or its index) to read {', '.join(names)} from")
    out = {}
    for file in files:  # each file opened once
        with safe_open(file, framework="pt") as f:
            stored = set(f.keys())
            out.update({n: f.get_tensor(n) for n in names if n in stored})
    missing = [n for n in names if n not in out]
    if missing and required:
        raise ValueError(f"{path}: its weights lack {', '.join(missing)} (the config says the reward model has a "
                         f"likelihood term; was the folder written by step 2 with --likelihood_term?)")
    return out


def torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
