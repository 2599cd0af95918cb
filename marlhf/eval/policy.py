"""Held-out evaluation of a policy: its answers to evaluation prompts, sampled with the training settings
under a fixed seed, scored by every reward source given (reward model, gold scorer, program tests)."""

from __future__ import annotations

import dataclasses
import math

import torch

from marlhf.data.pipeline import PromptCollator, ResumableSampler, make_loader
from marlhf.rewards import score_samples
from marlhf.rlhf.rollout import policy_logprobs
from marlhf.rlhf.sections import EvalSection
from marlhf.sampler import GenerationConfig, decode_samples, sample
from marlhf.utils import dist
from marlhf.utils.optim_step import all_reduce_sum
from marlhf.utils.rng import isolated_rng


def _fields(name: str, source) -> dict[str, str]:
    """Output key -> the source's detail field: ``<name>_score`` for the total, then ``<name>_<component>`` for
    each component of a source that explains itself (``components`` + ``details``, e.g. the gold scorer)."""
    parts = tuple(getattr(source, "components", ())) if hasattr(source, "details") else ()
    return {f"{name}_score": "total"} | {f"{name}_{k}": k for k in parts}


@torch.no_grad()
def evaluate_policy(actor, tokenizer, prompts: list[dict], section: EvalSection, generation: GenerationConfig,
                    sources: dict, seed: int = 0, ref=None, engine=None) -> dict:
    """Mean answer length and EOS rate, and the mean score of each reward source in ``sources`` (name ->
    source, e.g. ``{"rm": ..., "gold": ...}`` gives ``rm_score``, ``gold_score`` and the gold components) of
    the actor's answers to held-out prompts, sampled with the training settings under a fixed seed that
    leaves the training RNG untouched.  Each prompt's record meta goes to the sources, as in training.
    With ``ref``: ``kl``, the mean over answers of Σ_t log π(a_t|s_t) − log π_ref(a_t|s_t).  Each source's
    total also gets its standard error over the answers, ``<name>_score_se`` (sample standard deviation /
    √n): 64 held-out answers leave ~0.04 on the embedded task's gold score, so a reader sees what a
    difference between two policies is worth.  ``engine``: a generation engine (vLLM, holding the actor's
    current weights) that samples the answers instead of the actor, batch b under seed ``seed`` · 10⁶ + b."""
    pad = tokenizer.pad_token_id
    loader = make_loader(prompts, section.batch,
                         ResumableSampler(len(prompts), seed, shuffle=False), PromptCollator(pad))
    dev = dist.device()
    fields = {name: _fields(name, src) for name, src in sources.items()}
    keys = ("response_len", "eos_rate") + tuple(k for f in fields.values() for k in f)
    keys += ("kl",) if ref is not None else ()
    totals = torch.zeros(len(keys) + len(sources) + 1, dtype=torch.float64)  # sums of `keys`, of each source's
    # squared totals, then the count
    with isolated_rng(seed + dist.rank()):  # training's CPU and accelerator streams continue afterwards
        for b, batch in enumerate(loader):
            p_ids, p_mask = batch["prompt_ids"].to(dev), batch["prompt_mask"].to(dev)
            out = sample(actor, p_ids, p_mask, generation, zero3_generation=section.zero3_generation) \
                if engine is None else \
                engine.sample(p_ids, p_mask, dataclasses.replace(generation, seed=seed * 10 ** 6 + b))
            sums, squares = [out.answer_mask.sum().item(), out.ended.sum().item()], []
            for name, src in sources.items():
                if len(fields[name]) > 1:  # a source that explains itself: the components next to the total
                    prompts_text, answers = decode_samples(tokenizer, out)
                    rows = src.details(prompts_text, answers, out.ended.tolist(), batch["meta"])
                    sums += [sum(r[field] for r in rows) for field in fields[name].values()]
                    squares.append(sum(float(r["total"]) ** 2 for r in rows))
                else:
                    scores = score_samples(src, tokenizer, out, batch["meta"]).double()
                    sums.append(scores.sum().item())
                    squares.append(scores.square().sum().item())
            if ref is not None:
                T = section.policy.logprob_temperature  # the KL of training's π and π_ref (--logprob_temperature)
                lp = policy_logprobs(actor, out.seq, out.attention_mask, out.prompt_width, T)
                lp_ref = policy_logprobs(ref, out.seq, out.attention_mask, out.prompt_width, T)
                sums.append(torch.where(out.answer_mask, lp - lp_ref, 0.0).sum().item())
            totals += torch.tensor(sums + squares + [out.seq.shape[0]], dtype=torch.float64)
    totals = all_reduce_sum(totals)
    n = totals[-1].clamp(min=1).item()
    result = {k: totals[i].item() / n for i, k in enumerate(keys)}
    for j, name in enumerate(sources):
        mean, mean_square = result[f"{name}_score"], totals[len(keys) + j].item() / n
        variance = max(mean_square - mean * mean, 0.0) * n / (n - 1) if n > 1 else 0.0
        result[f"{name}_score_se"] = math.sqrt(variance / n)
    result["num_prompts"] = n
    return result
