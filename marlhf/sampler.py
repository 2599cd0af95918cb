"""Sampling answers from a policy: the one "generate → mask → decode" path of the project.

Step 3's experience collection, held-out evaluation, the ``inference/`` tools and the benchmark scripts all
call :func:`sample`.  A policy is a plain Hugging Face module or a DeepSpeed engine (ZeRO-3 parameters
gathered for the call, or fetched layer by layer with the ranks in step; the hybrid engine generates with
its own kernels).  What to sample is a small typed :class:`GenerationConfig`, not the argument bag.

Layout of a :class:`Samples` batch (P = prompt width, A = answer width)::

    seq            (N, P+A)  prompt (left-padded) + answer; every token after the stop token is padding
    attention_mask (N, P+A)  1 on real prompt tokens and real answer tokens (the stop token included)
    answer_mask    (N, A)    bool, real answer tokens (up to and including the first stop token)
    ended          (N,)      bool, the answer stopped at a stop token (False: cut at max_new_tokens)

With ``num_samples = K`` the N = B·K rows are grouped by prompt: rows i·K … i·K+K−1 answer prompt i.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch

from marlhf.models.forward import is_engine
from marlhf.utils import dist
from marlhf.utils.rng import isolated_rng


@dataclass(frozen=True)
class GenerationConfig:
    """How to sample.  ``seed=None`` draws from the global RNG (training: the run's seeded stream); an
    integer seed samples under a forked RNG seeded with ``seed + rank``, leaving the global stream as it was.
    temperature / top-k / top-p have no defaults here: their one default is step 3's flags'
    (:class:`marlhf.config.RLHFArgs`), which the tools' flags share."""

    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int
    temperature: float
    top_k: int  # 0: off
    top_p: float
    do_sample: bool = True  # False: greedy
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if not self.stop_ids:
            raise ValueError("stop_ids is empty: an answer could never end")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature} (use do_sample=False)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Samples:
    seq: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int
    answer_mask: torch.Tensor
    ended: torch.Tensor
    engine_logprobs: torch.Tensor | None = None  # (N, A): a generation engine's log π of each sampled token (vLLM)

    @property
    def answers(self) -> torch.Tensor:
        """(N, A) answer token ids (padding after the stop token)."""
        return self.seq[:, self.prompt_width:]

    @property
    def prompt_ids(self) -> torch.Tensor:
        return self.seq[:, :self.prompt_width]

    @property
    def prompt_mask(self) -> torch.Tensor:
        return self.attention_mask[:, :self.prompt_width]

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) answer lengths in tokens, the stop token included."""
        return self.answer_mask.sum(dim=1)


def answer_mask(answer: torch.Tensor, stop_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Real tokens of each generated answer (up to and including the first stop token) and whether it
    stopped.  (B, A) bool, (B,) bool."""
    is_stop = torch.isin(answer, torch.tensor(list(stop_ids), device=answer.device))  # (B, A)
    ended = is_stop.any(dim=1)  # (B,)
    first = torch.where(ended, is_stop.float().argmax(dim=1), torch.full_like(ended, answer.shape[1], dtype=torch.long))
    k = torch.arange(answer.shape[1], device=answer.device)
    return k[None, :] <= first[:, None], ended


def _zero_stage(policy) -> int:
    fn = getattr(policy, "zero_optimization_stage", None)
    return int(fn()) if callable(fn) else 0


def _is_hybrid(policy) -> bool:
    try:
        from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
    except ImportError:  # pragma: no cover - DeepSpeed is a requirement
        return False
    return isinstance(policy, DeepSpeedHybridEngine)


@contextlib.contextmanager
def _gathered_for_generation(engine):
    """A ZeRO-3 engine's parameters gathered once, with its forward hooks off, for one ``generate`` call.

    ``deepspeed.zero.GatheredParameters`` alone is not enough: ZeRO-3's per-module hooks still run at every
    forward, re-partitioning and re-gathering each layer at every token (8 tokens issued 93 all-gathers), and
    those collectives put every rank in lock-step, so a rank whose answers end first left ``generate`` while
    the others waited in an all-gather: a hang.  DeepSpeed's ``unwrap_model_for_generation`` removes the hooks
    for the call and registers them again afterwards; ``generate`` then runs without a collective and each rank
    stops when its own answers do (tests/test_zero3_generation.py).  It leaves one hook in place (DeepSpeed
    0.19.8): the top module's start-of-forward hook, whose step reset checks with a broadcast that every rank
    traced the same modules — a collective per token, which hangs as above; it is paused here too."""
    from deepspeed.runtime.zero import unwrap_model_for_generation

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    with unwrap_model_for_generation(engine), _hook_paused(getattr(offload, "fwd_pre_hook", None)):
        yield


@contextlib.contextmanager
def _hook_paused(handle):
    """The hook behind a ``torch.utils.hooks.RemovableHandle`` taken out for the block and put back after it
    (same id, so the handle still removes it)."""
    hooks = handle.hooks_dict_ref() if handle is not None else None
    fn = hooks.pop(handle.id, None) if hooks is not None else None
    try:
        yield
    finally:
        if fn is not None:
            hooks[handle.id] = fn


@torch.no_grad()
def sample(policy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cfg: GenerationConfig, *,
           num_samples: int = 1, zero3_generation: str = "gather") -> Samples:
    """``num_samples`` answers to each left-padded prompt.

    ``policy``: a Hugging Face causal LM or a DeepSpeed engine around one.  Under ZeRO-3 the parameters are
    gathered once for the whole call with ZeRO's hooks off (``zero3_generation="gather"``: fast, no collective
    while generating, needs the full model in memory) or fetched layer by layer at every token with the ranks
    kept in step until the last rank's answers end (``"synced"``: DeepSpeed-Chat's memory-safe path).  A hybrid
    engine generates with its inference kernels.  The policy's train/eval mode is restored afterwards."""
    if zero3_generation not in ("gather", "synced"):
        raise ValueError(f"zero3_generation must be 'gather' or 'synced', got {zero3_generation!r}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be ≥ 1, got {num_samples}")
    engine = is_engine(policy)
    hybrid = engine and _is_hybrid(policy)
    module = policy if hybrid or not engine else policy.module
    zero3 = engine and not hybrid and _zero_stage(policy) == 3
    gather = zero3 and zero3_generation == "gather"
    # "synced": the layers are fetched as each forward reaches them (collectives), so every rank keeps stepping,
    # on dummy tokens once its own answers ended, until all ranks' answers have (transformers' synced_gpus)
    synced = zero3 and not gather and dist.world_size() > 1
    was_training = policy.training
    policy.eval()
    # a seeded call restores every RNG stream manual_seed touches, the accelerator devices' included
    rng = contextlib.nullcontext() if cfg.seed is None else isolated_rng(cfg.seed + dist.rank())
    try:
        with rng, (_gathered_for_generation(policy) if gather else contextlib.nullcontext()):
            cache = None if hybrid or synced else shared_prefill(module, prompt_ids, prompt_mask, num_samples)
            if num_samples > 1:
                prompt_ids = prompt_ids.repeat_interleave(num_samples, dim=0)
                prompt_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
            sampling = dict(temperature=cfg.temperature, top_k=cfg.top_k or None, top_p=cfg.top_p) \
                if cfg.do_sample else {}
            seq = module.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=cfg.do_sample,
                                  max_new_tokens=cfg.max_new_tokens, eos_token_id=list(cfg.stop_ids),
                                  pad_token_id=cfg.pad_id, use_cache=True, synced_gpus=synced,
                                  **(cache or {}), **sampling)
    finally:
        policy.train(was_training)
    P = prompt_ids.shape[1]
    if seq.shape[1] == P:  # nothing generated at all: keep one padding column so shapes stay valid
        seq = torch.cat([seq, torch.full((seq.shape[0], 1), cfg.pad_id, dtype=seq.dtype, device=seq.device)], 1)
    mask, ended = answer_mask(seq[:, P:], cfg.stop_ids)
    attn = torch.cat([prompt_mask, mask.long()], dim=1)
    seq = torch.where(attn.bool(), seq, torch.full_like(seq, cfg.pad_id))  # clean tail after the stop token
    return Samples(seq, attn, P, mask, ended)


def shared_prefill(module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int):
    """With K = ``num_samples`` > 1 answers per prompt, the prompts' key/value cache computed once and repeated K
    times (all of each prompt but its last token, which ``generate`` then feeds): without it ``generate``
    runs the same prompt K times through the model, most of the cost of long prompts with short answers
    (the Monte-Carlo values' continuations, GRPO's groups).  The answers are the same, token for token, as
    K separate prefills give (positions from the left padding as ``generate`` counts them; a prefill draws
    no random numbers).  None — ``generate`` prefills each copy as usual — for one sample, a one-token prompt,
    or a model whose forward takes no ``position_ids`` or whose cache cannot be repeated.  Returns the keyword
    argument that hands the cache to ``generate``."""
    if num_samples < 2 or prompt_ids.shape[1] < 2:
        return None
    params = inspect.signature(module.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"  # transformers renamed it within 5.x
    if "position_ids" not in params or name not in params:
        return None
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = module(input_ids=prompt_ids[:, :-1], attention_mask=prompt_mask[:, :-1],
                     position_ids=positions[:, :-1], use_cache=True)
    cache = getattr(out, name, None)
    if not hasattr(cache, "batch_repeat_interleave"):
        return None
    cache.batch_repeat_interleave(num_samples)
    return {name: cache}


def decode(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Text of each row's masked tokens, special tokens (the stop token) dropped."""
    return [tokenizer.decode(i[m.bool()].tolist(), skip_special_tokens=True) for i, m in zip(ids.cpu(), mask.cpu())]


def decode_samples(tokenizer, s: Samples) -> tuple[list[str], list[str]]:
    """(prompts, answers) as text."""
    return decode(tokenizer, s.prompt_ids, s.prompt_mask), decode(tokenizer, s.answers, s.answer_mask)
