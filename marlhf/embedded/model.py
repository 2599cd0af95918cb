"""Named tiny model sizes for the embedded default: real Hugging Face architectures, a few million weights.

A tiny model is created from a config (random init, seeded), sized to the project tokenizer, and saved as
a normal HF folder (safetensors + config + generation config + tokenizer).  Every entry point then loads
it with ``--model_name_or_path <folder>`` through the same code path as a downloaded Llama or Gemma, so
CPU runs exercise the real loading, generation and saving code (docs/design.md "Runs without a GPU").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from marlhf.utils.cache import save_pretrained_here
from marlhf.utils.rng import isolated_rng

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# torch / transformers are imported inside the functions: TINY_SIZES must be cheap to import (CLI choices,
# and `marlhf.embedded.prepare` returning a finished build in well under a second).

logger = logging.getLogger(__name__)

# Architecture hyper-parameters per size; "model_type" picks the HF architecture.  Dropout is 0 in all of
# them (DeepSpeed-Chat's --dropout sets it explicitly when wanted).
TINY_SIZES: dict[str, dict] = {
    # ~0.2M parameters: for unit tests of the pipeline plumbing, where only speed matters.
    "nano": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
    # ~3.9M: the embedded default (Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, untied head).
    "tiny": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    # ~2.7M: Gemma (scaled embeddings, GeGLU, multi-query attention, tied head) as in the paper's models.
    "tiny-gemma": dict(
        model_type="gemma",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    # ~14M: the tiny model at twice the width, for a reward model larger than the policy (over-optimisation
    # shrinks as the reward model grows: Gao et al. 2022; measured in docs/results/rm_levers.md).
    "small": dict(
        model_type="llama",
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    # ~3.9M: GPT-2 style (learned positions, LayerNorm, GELU MLP) for the OPT/GPT-2 family of launchers.
    "tiny-gpt2": dict(
        model_type="gpt2",
        n_embd=256,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    ),
}
MAX_POSITIONS = 1024  # prompt (<= 256) + answer (<= 256) with room to spare


def tiny_config(size: str, tokenizer: PreTrainedTokenizerBase):
    """The HF config of a named size, with vocabulary and special-token ids taken from ``tokenizer``."""
    from transformers import AutoConfig

    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; valid sizes: {', '.join(TINY_SIZES)}")
    arch = dict(TINY_SIZES[size])
    model_type = arch.pop("model_type")
    positions = (
        {"n_positions": MAX_POSITIONS} if model_type == "gpt2" else {"max_position_embeddings": MAX_POSITIONS}
    )
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(tokenizer, name) is None:
            raise ValueError(f"tiny_config: tokenizer has no {name.removesuffix('_id')} token")
    return AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **positions,
        **arch,
    )


def create_tiny_model(
    size: str, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path, seed: int = 1234
) -> Path:
    """Create a randomly initialised tiny model (seeded), save it with its tokenizer to ``out_dir``.

    Generation stops at EOS or at the end-of-conversation token (if the tokenizer has one), because
    DeepSpeed-Chat's data appends ``--end_of_conversation_token`` to every response.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(size, tokenizer)

    with isolated_rng(seed):  # seeded init without disturbing the caller's RNG streams (CPU and accelerator)
        model = AutoModelForCausalLM.from_config(config)
    stop_ids = [tokenizer.eos_token_id]
    eoc = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if eoc is not None and eoc != tokenizer.unk_token_id:
        stop_ids.append(eoc)
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    gen.eos_token_id = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_pretrained_here(model, out_dir)  # on any rank: a cache folder (marlhf.utils.cache)
    tokenizer.save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "tiny model %r (%s, %.2fM parameters) saved to %s", size, config.model_type, n_params / 1e6, out_dir
    )
    return out_dir
