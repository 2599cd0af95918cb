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
import logging
import re
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

from marlhf.models.logprobs import head_token_logprobs

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
    from marlhf.data.formatting import read_format, resolve_format

    path = resolve_model_path(path)
    recorded = read_format(path)
    tok = _plain_tokenizer(path, end_of_conversation_token or recorded.get("end_of_conversation_token", ""),
                           add_eot_token)
    fmt = resolve_format(tok, recorded, end_of_conversation_token, prompt_format)
    _distinct_pad(tok, fmt.end_of_conversation_token)
    tok.padding_side = padding_side
    return tok, fmt


def run_tokenizer(args, path: str, padding_side: str = "right"):
    """(tokenizer, format) of a training run's model folder: :func:`load_tokenizer_and_format` with the run's
    ``--end_of_conversation_token``, ``--prompt_format`` and ``--add_eot_token``.  The resolved token and format
    are written back into ``args``, so the data pipeline, the trainer and the saved args.json use the values
    actually in force rather than the flags' empty / "auto" defaults."""
    tok, fmt = load_tokenizer_and_format(path, args.end_of_conversation_token, args.prompt_format,
                                         padding_side=padding_side, add_eot_token=args.add_eot_token)
    args.end_of_conversation_token, args.prompt_format = fmt.end_of_conversation_token, fmt.prompt_format
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


def _config(path: str, dropout: float | None, **extra):
    cfg = AutoConfig.from_pretrained(path, **extra)
    if dropout is not None:
        for key in _DROPOUT_KEYS:
            if hasattr(cfg, key):
                setattr(cfg, key, dropout)
    return cfg


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape, also when ZeRO-3 partitioned it (its own shape is then (0,))."""
    return getattr(param, "ds_shape", param.shape)


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
    from marlhf.utils import dist
    from marlhf.utils.ds_config import eval_config
    from marlhf.utils.ds_engine import _merge

    cfg = eval_config(zero_stage=3, offload=offload, dtype=dtype, world_size=dist.world_size())
    _merge(cfg, extra or {})
    return cfg


def load_options(args, zero_stage: int | None = None, offload: bool | None = None) -> dict:
    """Keyword arguments of the load functions for a training run's model: its ``--dtype``, and under ZeRO-3
    (``zero_stage``, default ``--zero_stage``) construction already partitioned."""
    stage = args.zero_stage if zero_stage is None else zero_stage
    off = args.offload if offload is None else offload
    return {"dtype": torch_dtype(args.dtype), "ds_config": zero3_init_config(stage, off, args.dtype)}


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
                   end_of_conversation_token: str = "", ds_config: dict | None = None):
    """A causal LM in ``dtype`` (the run's: a bf16 run never holds an fp32 copy), built partitioned when
    ``ds_config`` is a ZeRO-3 config (:func:`zero3_construction`)."""
    path = resolve_model_path(path)
    cfg = _config(path, dropout)
    with zero3_construction(ds_config):
        model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=dtype)
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
                     ds_config: dict | None = None):
    """A reward model / critic: base LM + scalar head (freshly initialised when ``path`` is a causal LM; under
    ZeRO-3 transformers initialises it on rank 0 and scatters it).  ``dtype`` / ``ds_config``: as
    :func:`load_causal_lm`."""
    path = resolve_model_path(path)
    cfg = _config(path, dropout, num_labels=1)
    cfg.pad_token_id = tokenizer.pad_token_id
    # a likelihood term's weights are extra keys to transformers; load_reward_model reads them itself
    extra = _LIKELIHOOD_KEYS if getattr(cfg, "likelihood_term", False) else None
    with _expected_unexpected_keys(cfg, extra), zero3_construction(ds_config):
        model = AutoModelForSequenceClassification.from_pretrained(path, config=cfg, dtype=dtype)
        _fit_vocab(model, tokenizer)
        _partition_new_parameters(model, ds_config)
    fp32_head(model.score)  # the value computed in float32 even when the engine runs bf16 (Fp32Linear)
    model.config.use_cache = False
    return model


def load_reward_model(path: str, tokenizer, dropout: float | None = None, dtype: torch.dtype = torch.float32,
                      likelihood_term: bool = False, ds_config: dict | None = None):
    """A reward model: :func:`load_value_model`, plus the folder's :class:`LikelihoodTerm` when it has one.

    ``likelihood_term`` adds a fresh term to a model that has none (step 2 from an SFT model): its next-token
    head starts as the folder's LM head (or the input embeddings, when the model ties them) and α as 1, so
    the untrained reward model already ranks answers by how likely the SFT model finds them.  Under ZeRO-3
    (``ds_config``) the term is built partitioned too and its weights are written in from rank 0."""
    import deepspeed

    path = resolve_model_path(path)
    model = load_value_model(path, tokenizer, dropout, dtype, ds_config)
    has_term = bool(getattr(model.config, "likelihood_term", False))
    if not (has_term or likelihood_term):
        return model
    zero3 = hasattr(model.score.weight, "ds_id")
    with deepspeed.zero.Init(config_dict_or_path=ds_config) if zero3 else contextlib.nullcontext():
        attach_likelihood_term(model)
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
        scale = torch.tensor(1.0)
    term = model.likelihood
    vocab = full_shape(term.lm_head.weight)[0]
    if head.shape[0] < vocab:  # the tokenizer gained tokens (_fit_vocab): they start at the mean row
        head = torch.cat([head, head.float().mean(0, keepdim=True).to(head.dtype).expand(vocab - head.shape[0], -1)])
    from marlhf.utils import dist

    # under ZeRO-3 rank 0 writes the gathered tensors and they are partitioned again on exit
    with deepspeed.zero.GatheredParameters(list(term.parameters()), modifier_rank=0, enabled=zero3), torch.no_grad():
        if not zero3 or dist.is_main():
            term.lm_head.weight.copy_(head[:vocab])
            term.scale.copy_(scale)
    return model


class Fp32Linear(nn.Linear):
    """A linear head computed in float32 whatever the dtype of its weights and inputs: the reward model's and
    critic's scalar ``score`` head and the likelihood term's next-token head.

    A bf16 ``nn.Linear`` rounds its output to bf16 (2^-9 relative: ±0.02 at a value of 8, more than the
    per-token KL rewards it is compared with); ``.float()`` after it cannot undo that.  DeepSpeed's bf16 / fp16
    engines cast every parameter to the run dtype (``_cast_module_mixed_precision``; only buffers can be kept in
    fp32), so the weights stay bf16 (their fp32 master copy lives in the optimizer) and this forward computes
    ``hidden.float() @ W.float()ᵀ (+ b.float())`` instead.  Same parameters and state-dict keys as ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.linear(x.float(), self.weight.float(), bias)


def fp32_head(linear: nn.Module) -> nn.Module:
    """Make a plain ``nn.Linear`` head compute in float32 (:class:`Fp32Linear`), in place; other modules as they are."""
    if type(linear) is nn.Linear:
        linear.__class__ = Fp32Linear
    return linear


class LikelihoodTerm(nn.Module):
    """α · Σ log p(answer token | what precedes it), from a next-token head over the reward model's hidden states.

    A score head reading the last position does not learn from a few thousand pairs whether each answer token
    was to be expected — a fact replaced by another of its kind reads as fluently as the right one; the SFT
    model's next-token head knows (it learnt to copy facts from the prompt).  Step 2 trains the head and α with
    the rest of the model under the pairwise loss."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.lm_head = Fp32Linear(hidden_size, vocab_size, bias=False)
        self.scale = nn.Parameter(torch.ones(1))  # 1-d: DeepSpeed broadcasts parameters as bytes

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                response_start: torch.Tensor) -> torch.Tensor:
        """(B, T): α times the answer's log-probability up to and including each position (0 before the answer).
        ``response_start`` (B,): the column of each row's first answer token."""
        # only the columns that predict an answer token go through the vocabulary-wide projection: from the
        # one before the earliest answer start (the prompt is most of a sequence); none when no row has one
        first = min(max(int(response_start.min()) - 1, 0), input_ids.shape[1] - 1)
        # column t: log p(token first + t + 1), from the float32 head (Fp32Linear) a chunk of positions at a
        # time: no (B, T, V) logits kept for backward
        logp = head_token_logprobs(self.lm_head, hidden[:, first:-1], input_ids[:, first + 1:])
        column = torch.arange(first + 1, input_ids.shape[1], device=input_ids.device)[None]
        answer = (column >= response_start[:, None]) & attention_mask[:, first + 1:].bool()
        cumulative = torch.nn.functional.pad((logp * answer).cumsum(1), (first + 1, 0))
        return self.scale.float() * cumulative


def attach_likelihood_term(model: nn.Module) -> None:
    """Give a value model an (uninitialised) :class:`LikelihoodTerm` and mark its config, so that an export
    writes the term and :func:`load_reward_model` reads it back."""
    model.likelihood = LikelihoodTerm(model.score.in_features, full_shape(model.get_input_embeddings().weight)[0])
    model.config.likelihood_term = True


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


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside DeepSpeed / peft wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):  # DeepSpeedEngine
            model = model.module
        elif hasattr(model, "get_base_model"):  # peft
            model = model.get_base_model()
        else:
            return model


def first_labelled_column(labels: torch.Tensor) -> int:
    """The column whose logits predict the batch's earliest labelled token (labels -100 elsewhere): what
    :func:`next_token_logits` needs to start from.  T - 1 (nothing to project) when no token is labelled."""
    labelled = (labels[:, 1:] != -100).any(dim=0)  # column t predicts token t + 1
    return int(labelled.long().argmax()) if bool(labelled.any()) else labels.shape[1] - 1


def next_token_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int,
                      **kwargs) -> torch.Tensor:
    """(B, T - 1 - start, V) logits of columns start .. T - 2, column j predicting token start + j + 1.

    Only these columns go through the vocabulary projection (transformers' ``logits_to_keep``, after which
    the model's own logit post-processing, e.g. Gemma-2's soft-capping, still applies): the prompt is most of
    a sequence and its predictions are never used, nor is the last column's."""
    keep = torch.arange(start, input_ids.shape[1] - 1, device=input_ids.device)
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep,
                 **kwargs).logits


def labelled_logits(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits that predict a right-padded batch's labelled tokens and their targets, aligned: (B, K, V),
    (B, K) with -100 where nothing is labelled (the SFT loss, DPO's and the likelihood scorer's log-probs)."""
    start = first_labelled_column(batch["labels"])
    logits = next_token_logits(model, batch["input_ids"], batch["attention_mask"], start)
    return logits, batch["labels"][:, start + 1:]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding — what ``generate`` uses, so training forwards must use them too."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def pair_hidden_states(base: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       prefix_width: int = 0) -> torch.Tensor:
    """Last hidden states (R, T, H) of a batch, where a :class:`~marlhf.data.pipeline.PairCollator` batch's
    shared prefix is computed once: rows [0, B) and [B, 2B) hold the same tokens in columns [0, prefix_width)
    (a pair's prompt and whatever its two answers start with), so those columns run for the first B rows
    only, and each row's remaining columns attend to their keys and values through the KV cache.

    The result equals one forward over all rows (causal attention: a column sees only the columns before it).
    ``prefix_width`` 0 is that plain forward; so is a model under gradient checkpointing, which drops the
    cache in training."""
    positions = position_ids_from_mask(attention_mask)
    rows, width = input_ids.shape
    checkpointing = base.training and getattr(base, "gradient_checkpointing", False)
    if prefix_width <= 0 or prefix_width >= width or rows % 2 or checkpointing:
        return base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                    position_ids=positions).last_hidden_state
    half, P = rows // 2, prefix_width
    prefix = base(input_ids=input_ids[:half, :P], attention_mask=attention_mask[:half, :P],
                  position_ids=positions[:half, :P], use_cache=True)
    # transformers 5.24 renamed the KV cache `cache`, output field and forward argument alike (`past_key_values`
    # warns there and goes in 5.40); 5.20-5.23 call both `past_key_values`
    name = "cache" if "cache" in prefix else "past_key_values"
    cache = prefix[name]
    cache.batch_select_indices(torch.arange(half, device=input_ids.device).repeat(2))  # pair i -> rows i, B + i
    rest = base(input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=positions[:, P:],
                use_cache=True, **{name: cache}).last_hidden_state
    return torch.cat([prefix.last_hidden_state.repeat(2, 1, 1), rest], dim=1)


def token_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 response_start: torch.Tensor | int | None = None, prefix_width: int = 0) -> torch.Tensor:
    """Scalar head on every position: (B, T) values (the critic) / per-token rewards.  A reward model with a
    :class:`LikelihoodTerm` adds it, which needs ``response_start``: each row's first answer column (B,), or
    one column for all rows (left-padded prompts).  ``prefix_width``: a pair batch's shared columns, run
    once (:func:`pair_hidden_states`)."""
    inner = _unwrap(model)
    base = getattr(inner, inner.base_model_prefix)
    hidden = pair_hidden_states(base, input_ids, attention_mask, prefix_width)
    values = inner.score(hidden).squeeze(-1).float()  # (B, T); the head computes in float32 (Fp32Linear)
    term = getattr(inner, "likelihood", None)
    if term is None:
        return values
    if response_start is None:
        raise ValueError("this reward model has a likelihood term: scoring needs where each answer starts")
    if not torch.is_tensor(response_start):
        response_start = torch.full((input_ids.shape[0],), int(response_start), device=input_ids.device)
    return values + term(hidden, input_ids, attention_mask, response_start.to(input_ids.device))


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last real token (its rightmost unmasked column, whatever padding precedes it): (B,)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(dim=1)


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_start: torch.Tensor | int | None = None, prefix_width: int = 0) -> torch.Tensor:
    """Reward-model score of each sequence: the head's value at its last real token, plus the likelihood term
    over the answer when the model has one (which needs ``response_start``, as :func:`token_values`).  (B,)"""
    values = token_values(model, input_ids, attention_mask, response_start, prefix_width)
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
    from peft.tuners.lora import LoraLayer

    n_modules = sum(isinstance(m, LoraLayer) for m in peft_model.modules())  # wrapped layers, not name patterns
    log.info("LoRA r=%d on %d modules; trainable %d / %d parameters", dim, n_modules, n_train, n_all)
    return peft_model


def torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
