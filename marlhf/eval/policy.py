"""Held-out evaluation of a policy: its answers to evaluation prompts, sampled with the training settings
under a fixed seed, scored by the reward model (and the gold scorer where the task has one)."""

from __future__ import annotations

import torch

from marlhf.data.pipeline import PromptCollator, ResumableSampler, make_loader
from marlhf.generation import GenerationConfig, decode, sample
from marlhf.models.loading import sequence_scores, stop_token_ids
from marlhf.utils import dist


@torch.no_grad()
def evaluate_policy(actor, reward, tokenizer, prompts: list[dict], args, gold_scorer=None, seed: int = 0) -> dict:
    """Mean reward-model score, answer length and EOS rate (and the gold score with its components when the
    task has one) of the actor's answers to held-out prompts, sampled with the training settings under a
    fixed seed that leaves the training RNG untouched."""
    stop_ids = stop_token_ids(tokenizer, args.end_of_conversation_token)
    pad = tokenizer.pad_token_id
    gen_cfg = GenerationConfig.from_args(args, stop_ids, pad)
    loader = make_loader(prompts, args.per_device_generation_batch_size,
                         ResumableSampler(len(prompts), seed, shuffle=False), PromptCollator(pad))
    dev = dist.device()
    # output key -> the gold scorer's field: the total, then the components of a scorer that has them
    gold_fields = {"gold_score": "total"} | {f"gold_{k}": k for k in getattr(gold_scorer, "components", ())}
    keys = ("rm_score", "response_len", "eos_rate") + (tuple(gold_fields) if gold_scorer is not None else ())
    totals = torch.zeros(len(keys) + 1, dtype=torch.float64)  # sums of `keys`, then the count
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + dist.rank())
        for batch in loader:
            p_ids, p_mask = batch["prompt_ids"].to(dev), batch["prompt_mask"].to(dev)
            out = sample(actor, p_ids, p_mask, gen_cfg, zero3_generation=args.zero3_generation)
            P, seq, attn, mask, ended = out.prompt_width, out.seq, out.attention_mask, out.answer_mask, out.ended
            rm = sequence_scores(reward, seq, attn)
            sums = [rm.sum().item(), mask.sum().item(), ended.sum().item()]
            if gold_scorer is not None:
                texts = (decode(tokenizer, p_ids, p_mask), decode(tokenizer, seq[:, P:], mask), ended.tolist())
                if len(gold_fields) > 1:  # a scorer that explains itself: the components next to the total
                    rows = gold_scorer.details(*texts)
                    sums += [sum(r[field] for r in rows) for field in gold_fields.values()]
                else:
                    sums.append(sum(gold_scorer(*texts)))
            totals += torch.tensor(sums + [len(rm)], dtype=torch.float64)
    if dist.world_size() > 1:
        import torch.distributed as tdist

        t = totals.to(dev)
        tdist.all_reduce(t)
        totals = t.cpu()
    n = totals[-1].clamp(min=1).item()
    out = {k: totals[i].item() / n for i, k in enumerate(keys)}
    out["num_prompts"] = n
    return out
