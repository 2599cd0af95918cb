"""MA-PPO: experience collection, macro-action segmentation and the PPO update (paper Algorithm 1).

One step of :meth:`MAPPOTrainer.train`:
  1. generate answers for ``--generation_batches`` prompt batches            (:func:`generate`)
  2. one forward each of actor, reference, critic, reward on the sequences   (:func:`make_experience`)
  3. termination rule → segment ids → macro values / rewards → GAE           (:func:`compute_macro_advantages`)
  4. ``--ppo_epochs`` passes of clipped policy + value loss (+ ptx)          (:meth:`MAPPOTrainer.ppo_update`)
  5. log, EMA, checkpoint.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from tqdm import tqdm

from marlhf.data.pipeline import PromptCollator, ResumableSampler, SFTCollator, make_loader, plan_steps
from marlhf.generation import GenerationConfig, decode, sample
from marlhf.models.loading import position_ids_from_mask, sequence_scores, stop_token_ids, token_values
from marlhf.rlhf import macro
from marlhf.rlhf.ppo_math import compute_advantages, policy_loss, token_rewards, value_loss
from marlhf.rlhf.rlhf_engine import RLHFEngine, update_ema
from marlhf.utils import checkpoint, dist
from marlhf.utils.optim_step import StepGuard, loss_multipliers
from marlhf.utils.tracking import Tracker

log = logging.getLogger("marlhf")


@dataclass
class Experience:
    """One generation batch, everything the PPO update needs.  P = prompt width, A = answer width."""

    seq: torch.Tensor  # (B, P+A) prompt (left-padded) + answer (right-padded)
    attention_mask: torch.Tensor  # (B, P+A)
    prompt_width: int  # P
    mask: torch.Tensor  # (B, A) bool, real answer tokens used in the loss (EOS included)
    logprobs: torch.Tensor  # (B, A) actor log π_old(a_t | s_t)
    ref_logprobs: torch.Tensor  # (B, A) reference log π_ref
    values: torch.Tensor  # (B, A) critic V(s_t)
    scores: torch.Tensor  # (B,) sequence score (reward model or gold)
    rewards: torch.Tensor  # (B, A) per-token rewards (KL penalty + score on the last token)
    seg: torch.Tensor  # (B, A) macro-action segment ids, -1 on padding
    advantages: torch.Tensor  # (B, A) macro advantages broadcast to tokens
    returns: torch.Tensor  # (B, A) macro returns (Q) broadcast to tokens

    def split(self, size: int) -> list[Experience]:
        """Micro-batches of ``size`` samples (the tensors' batch dimension is sliced)."""
        B = self.seq.shape[0]
        out = []
        for i in range(0, B, size):
            kw = {f.name: getattr(self, f.name) for f in fields(self)}
            out.append(Experience(**{k: v[i:i + size] if torch.is_tensor(v) else v for k, v in kw.items()}))
        return out


def answer_logprobs(logits: torch.Tensor, seq: torch.Tensor, P: int) -> torch.Tensor:
    """log π(a_t | s_t) of the answer tokens from full-sequence logits (B, P+A, V) → (B, A)."""
    logits = logits[:, P - 1:-1].float()  # position t predicts token t+1
    tokens = seq[:, P:]
    return logits.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _forward_logits(model, seq, attention_mask):
    return model(input_ids=seq, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                 use_cache=False).logits


def stream_seed(*parts: int) -> int:
    """A 63-bit seed that differs for every tuple of integers (no arithmetic collisions like a*101 + b)."""
    digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class MacroSegmenter:
    """``--termination_condition`` as one call: answers → segment ids (B, A) (+ parse fallbacks counted)."""

    def __init__(self, args, tokenizer):
        self.args, self.tokenizer = args, tokenizer
        self.rule = args.termination_condition
        self.n = args.ngram_n
        self.parser = None
        self.word_table = None
        if self.rule == "parsing":
            from marlhf.rlhf.parsing import ParseSegmenter

            self.parser = ParseSegmenter(kind=args.response_kind, backend=args.parser_backend,
                                         cutoff=args.parser_cutoff, fallback_n=self.n or 5,
                                         model=args.parser_model or None)
        if self.rule == "word":
            from marlhf.models.tokenizer import word_start_table

            self.word_table = word_start_table(tokenizer)

    def __call__(self, answer: torch.Tensor, mask: torch.Tensor, ref_logprobs: torch.Tensor, step: int,
                 batch: int = 0):
        """Segment ids (B, A) and the number of samples whose parse fell back to fixed n-grams.

        The randomized rule draws from a generator seeded by (seed, step, generation batch, rank), so row i
        of every generation batch on every rank gets its own boundaries, and a resumed run the same ones."""
        split_last = self.args.macro_reward == "compat"
        if self.rule != "parsing":
            gen = torch.Generator().manual_seed(stream_seed(self.args.seed, step, batch, dist.rank()))
            seg = macro.segments_for_rule(self.rule, mask, ngram=self.n, repeat_times=self.args.repeat_times,
                                          generator=gen, ref_logprobs=ref_logprobs, input_ids=answer,
                                          word_start_table=self.word_table, split_last=split_last)
            return seg, 0
        texts, offsets = self._texts_and_offsets(answer, mask)
        starts, fell_back = self.parser.starts(texts, offsets, answer.shape[1])
        starts = starts.to(mask.device)
        if split_last:
            starts = macro.split_last_token(starts, mask)
        return macro.segments_from_starts(starts, mask), int(fell_back.sum())

    def _texts_and_offsets(self, answer, mask):
        """Decoded answers and each policy token's character span in them.

        The text is re-tokenized with offsets; where that does not reproduce the generated ids (a
        non-canonical tokenization) the offsets are left inconsistent on purpose, so the parser falls back
        for that sample and counts it instead of guessing an alignment."""
        texts, offsets = [], []
        special = set(self.tokenizer.all_special_ids)
        for ids in [a[m].tolist() for a, m in zip(answer.cpu(), mask.cpu())]:
            body = [i for i in ids if i not in special]
            text = self.tokenizer.decode(body, skip_special_tokens=True)
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            spans = [tuple(o) for o in enc["offset_mapping"]]
            if enc["input_ids"] != body:
                spans = [(0, 0)] * len(body)  # cannot align: the parser will fall back
            spans += [(len(text), len(text))] * (len(ids) - len(body))  # EOS: empty span at the end
            texts.append(text)
            offsets.append(spans)
        return texts, offsets


class MAPPOTrainer:
    def __init__(self, args, rlhf: RLHFEngine, tokenizer, scorer=None):
        self.args, self.rlhf, self.tokenizer = args, rlhf, tokenizer
        self.stop_ids = stop_token_ids(tokenizer, args.end_of_conversation_token)
        self.pad_id = tokenizer.pad_token_id
        self.gen_cfg = GenerationConfig.from_args(args, self.stop_ids, self.pad_id)
        self.segmenter = MacroSegmenter(args, tokenizer)
        self.scorer = scorer  # optional (prompts, answers) -> scores, replaces the reward model
        self.guard = StepGuard(args.max_skipped_steps)  # drops non-finite updates, stops after too many

    # -- 2. experience ------------------------------------------------------------------------------------
    @torch.no_grad()
    def make_experience(self, prompt_ids, prompt_mask, step: int, batch: int = 0) -> tuple[Experience, dict]:
        """Generate, score and segment answers to one prompt batch (``batch``: its index in the step)."""
        a = self.args
        t0 = time.time()
        out = sample(self.rlhf.actor, prompt_ids, prompt_mask, self.gen_cfg, zero3_generation=a.zero3_generation)
        gen_time = time.time() - t0
        P, seq, attn, mask, ended = out.prompt_width, out.seq, out.attention_mask, out.answer_mask, out.ended
        answer = out.answers
        length = mask.sum(dim=1)
        content = length - ended.long()  # tokens before the stop token
        valid = content >= 2  # empty and one-token answers are masked out of the loss (and counted)

        logprobs = answer_logprobs(_forward_logits(self.rlhf.actor, seq, attn), seq, P)
        ref_logprobs = answer_logprobs(_forward_logits(self.rlhf.ref, seq, attn), seq, P)
        values = token_values(self.rlhf.critic, seq, attn)[:, P - 1:-1]
        if self.scorer is not None:
            scores = torch.tensor(self.scorer(self._decode(prompt_ids, prompt_mask), self._decode(answer, mask),
                                              ended.tolist()), dtype=torch.float32, device=seq.device)
        else:
            scores = sequence_scores(self.rlhf.reward, seq, attn)

        loss_mask = mask & valid[:, None]
        rewards = token_rewards(logprobs, ref_logprobs, loss_mask, scores, a.kl_ctl, a.clip_reward_value)
        t1 = time.time()
        seg, fallbacks = self.segmenter(answer, loss_mask, ref_logprobs, step, batch)
        advantages, returns, mstats = compute_advantages(values, rewards, loss_mask, seg, a.value_function,
                                                         a.macro_reward, a.gamma, a.lam, a.whiten_advantages)
        macro_time = time.time() - t1
        exp = Experience(seq, attn, P, loss_mask, logprobs, ref_logprobs, values, scores, rewards, seg,
                         advantages, returns)
        kl = torch.where(loss_mask, logprobs - ref_logprobs, 0.0).sum(dim=1)
        n_valid = valid.sum().clamp(min=1)
        stats = {"reward": scores.mean().item(),
                 "reward_valid": (scores * valid).sum().item() / n_valid.item(),
                 "kl": (kl.sum() / n_valid).item(),
                 "return": returns[:, 0].mean().item() if returns.shape[1] else 0.0,
                 "response_len": length.float().mean().item(),
                 "eos_rate": ended.float().mean().item(),
                 "invalid_answers": float((~valid).sum().item()),
                 "parse_fallbacks": float(fallbacks),
                 "gen_seconds": gen_time, "macro_seconds": macro_time,
                 **{k: float(v) for k, v in mstats.items()}}
        return exp, stats

    def _decode(self, ids, mask) -> list[str]:
        return decode(self.tokenizer, ids, mask)

    # -- 4. PPO update --------------------------------------------------------------------------------------
    def ppo_update(self, exps: list[Experience], ptx_batches=None) -> dict:
        """``--ppo_epochs`` passes over the experience in micro-batches of ``--per_device_training_batch_size``.

        Every loss is a token mean over the whole optimizer step by default (``--loss_aggregation``,
        :mod:`marlhf.utils.optim_step`): the real tokens of each accumulation window are counted on all
        ranks before the first backward. The actor steps on the policy loss and, with ptx, once more on the
        ptx loss (DeepSpeed-Chat's order), so with ptx its micro-steps alternate policy / ptx."""
        a = self.args
        actor, critic = self.rlhf.actor, self.rlhf.critic
        G = a.gradient_accumulation_steps
        plan = [mb for _ in range(a.ppo_epochs) for exp in exps for mb in exp.split(a.per_device_training_batch_size)]
        ptx = [next(ptx_batches) for _ in plan] if ptx_batches is not None else None
        per_actor = 2 if ptx is not None else 1  # actor micro-steps per micro-batch
        tokens = [int(mb.mask.sum()) for mb in plan]
        pl_mult = loss_multipliers(tokens, [per_actor * i // G for i in range(len(plan))], G, a.loss_aggregation)
        vl_mult = loss_multipliers(tokens, [i // G for i in range(len(plan))], G, a.loss_aggregation)
        if ptx is not None:
            ptx_tokens = [int((b["labels"][:, 1:] != -100).sum()) for b in ptx]
            ptx_mult = loss_multipliers(ptx_tokens, [(2 * i + 1) // G for i in range(len(plan))], G,
                                        a.loss_aggregation)
        totals: dict[str, float] = {}
        for i, mb in enumerate(plan):
            if i % G == 0:
                dropped_before = self.guard.dropped  # the critic's window starts
            P = mb.prompt_width
            logprobs = answer_logprobs(_forward_logits(actor, mb.seq, mb.attention_mask), mb.seq, P)
            pl, pstats = policy_loss(logprobs, mb.logprobs, mb.advantages, mb.mask, a.cliprange,
                                     seg=mb.seg, ratio=a.policy_ratio)
            self.guard.backward(actor, pl * pl_mult[i], "actor loss")
            self.guard.step(actor)
            values = token_values(critic, mb.seq, mb.attention_mask)[:, P - 1:-1]
            vl, vstats = value_loss(values, mb.values, mb.returns, mb.mask, a.cliprange_value)
            # an actor update dropped in this window (non-finite advantages, any rank) drops the critic's too:
            # the step then skips that data as a whole
            actor_dropped = i % G == G - 1 and self.guard.dropped > dropped_before
            self.guard.backward(critic, vl * vl_mult[i], "critic loss", drop=actor_dropped)
            self.guard.step(critic)
            stats = {"actor_loss": pl.item(), "critic_loss": vl.item(),
                     **{k: float(v) for k, v in {**pstats, **vstats}.items()}}
            if ptx is not None:
                out = actor(**ptx[i], use_cache=False).loss
                self.guard.backward(actor, a.unsup_coef * out * ptx_mult[i], "ptx loss")
                self.guard.step(actor)
                stats["ptx_loss"] = out.item()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        return {k: v / max(len(plan), 1) for k, v in totals.items()}

    # -- the loop ----------------------------------------------------------------------------------------
    def train(self, prompts: list[dict], ptx_items: list[dict] | None = None, evaluate=None) -> int:
        """MA-PPO over ``prompts``; ``evaluate()`` (held-out metrics) is logged as ``eval/*`` every
        ``--eval_interval`` steps (the final evaluation is the caller's)."""
        a = self.args
        bs = a.per_device_generation_batch_size
        sampler = ResumableSampler(len(prompts), a.seed)
        loader = make_loader(prompts, bs, sampler, PromptCollator(self.pad_id))
        steps_per_epoch, total = plan_steps(len(prompts), bs, a.generation_batches, a.num_train_epochs,
                                            a.max_steps, what="prompts")
        ptx = self._ptx_iterator(ptx_items)
        ckpt_root = Path(a.output_dir) / "checkpoints"
        tracker = Tracker(a.output_dir, a.tensorboard_path, a.enable_tensorboard, a.print_loss)
        step, epoch, done = 0, 0, 0
        if a.resume:
            state = checkpoint.load_checkpoint(ckpt_root, self.rlhf.trainable())
            if state is not None:
                step, epoch, done = state["step"], state["epoch"], state["batches_done"]
        log.info("MA-PPO: %d prompts, %d steps/epoch, %d steps (from %d); rule %s n=%s, σ %s, ratio %s", len(prompts),
                 steps_per_epoch, total, step, a.termination_condition, a.ngram, a.value_function, a.policy_ratio)
        bar = tqdm(total=total, initial=step, desc="ma-ppo", disable=not dist.is_main() or a.disable_progress_bar)
        dev = dist.device()
        while step < total:
            sampler.set_epoch(epoch, skip=done * bs)
            it = iter(loader)
            while done < steps_per_epoch and step < total:
                # 1-3. experience for --generation_batches prompt batches
                exps, gen_stats = [], []
                for k in range(a.generation_batches):
                    batch = next(it)
                    exp, s = self.make_experience(batch["prompt_ids"].to(dev), batch["prompt_mask"].to(dev), step, k)
                    exps.append(exp)
                    gen_stats.append(s)
                done += 1
                # 4. PPO epochs over the experience
                t0 = time.time()
                train_stats = self.ppo_update(exps, ptx)
                train_stats.update(self.guard.end_step(step + 1))
                if self.rlhf.ema is not None:
                    update_ema(self.rlhf.actor, self.rlhf.ema, a.ema_decay, a.actor_zero_stage)
                step += 1
                # 5. log, print, checkpoint
                stats = {k: sum(s[k] for s in gen_stats) / len(gen_stats) for k in gen_stats[0]}
                stats.update(train_stats, train_seconds=time.time() - t0, epoch=epoch,
                             actor_lr=self.rlhf.actor.get_lr()[0])
                tracker.log(step, stats, prefix="train/")
                if evaluate is not None and a.eval_interval and step % a.eval_interval == 0 and step < total:
                    tracker.log(step, evaluate(), prefix="eval/", echo=True)
                bar.update(1)
                bar.set_postfix(reward=f"{stats['reward']:.3f}", kl=f"{stats['kl']:.3f}")
                if a.print_answers and step % a.print_answers_interval == 0:
                    self._print_sample(exps[0])
                if a.save_steps and step % a.save_steps == 0:
                    checkpoint.save_checkpoint(ckpt_root, self.rlhf.trainable(), step,
                                               {"epoch": epoch, "batches_done": done}, a.keep_checkpoints)
            if done >= steps_per_epoch:
                epoch, done = epoch + 1, 0
        bar.close()
        tracker.close()
        return step

    def _ptx_iterator(self, items):
        if not items:
            return None
        dev = dist.device()
        loader = make_loader(items, self.args.per_device_training_batch_size,
                             ResumableSampler(len(items), self.args.seed + 1), SFTCollator(self.pad_id))

        def forever():
            epoch = 0
            while True:
                loader.sampler.set_epoch(epoch)
                for batch in loader:
                    yield {k: v.to(dev) for k, v in batch.items()}
                epoch += 1

        return forever()

    def _print_sample(self, exp: Experience) -> None:
        if not dist.is_main():
            return
        P = exp.prompt_width
        prompt = self.tokenizer.decode(exp.seq[0, :P][exp.attention_mask[0, :P].bool()], skip_special_tokens=True)
        answer = self.tokenizer.decode(exp.seq[0, P:][exp.attention_mask[0, P:].bool()], skip_special_tokens=True)
        n = int(macro.num_macros(exp.seg[:1])[0]) if exp.seg.numel() else 0
        log.info("--- prompt ---\n%s\n--- answer (score %.3f, %d macro actions) ---\n%s", prompt,
                 exp.scores[0].item(), n, answer)


@torch.no_grad()
def evaluate_policy(actor, reward, tokenizer, prompts: list[dict], args, gold_scorer=None, seed: int = 0,
                    ref=None) -> dict:
    """Mean reward-model score, answer length and EOS rate (and the gold score with its components when the
    task has one; the KL to ``ref`` — Σ_t log π(a_t|s_t) − log π_ref(a_t|s_t) per answer — when given) of the
    actor's answers to held-out prompts, sampled with the training settings under a fixed seed that leaves
    the training RNG untouched."""
    stop_ids = stop_token_ids(tokenizer, args.end_of_conversation_token)
    pad = tokenizer.pad_token_id
    gen_cfg = GenerationConfig.from_args(args, stop_ids, pad)
    loader = make_loader(prompts, args.per_device_generation_batch_size,
                         ResumableSampler(len(prompts), seed, shuffle=False), PromptCollator(pad))
    dev = dist.device()
    # output key -> the gold scorer's field: the total, then the components of a scorer that has them
    gold_fields = {"gold_score": "total"} | {f"gold_{k}": k for k in getattr(gold_scorer, "components", ())}
    keys = ("rm_score", "response_len", "eos_rate") + (tuple(gold_fields) if gold_scorer is not None else ()) \
        + (("kl",) if ref is not None else ())
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
            if ref is not None:
                lp = answer_logprobs(_forward_logits(actor, seq, attn), seq, P)
                lp_ref = answer_logprobs(_forward_logits(ref, seq, attn), seq, P)
                sums.append(torch.where(mask, lp - lp_ref, 0.0).sum().item())
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
