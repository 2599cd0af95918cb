"""MA-PPO's training loop (paper Algorithm 1); each step a named call into one module:

  1. sample answers for ``--generation_batches`` prompt batches       (:func:`marlhf.generation.sample`)
  2. one forward each of actor, reference, critic; score each answer  (:mod:`marlhf.rlhf.rollout`)
  3. termination rule → segment ids → advantages (macro GAE)        (:mod:`marlhf.rlhf.termination`,
                                                                        :mod:`marlhf.rlhf.advantages`)
  4. ``--ppo_epochs`` passes of clipped policy + value loss (+ ptx)    (:mod:`marlhf.rlhf.update`)
  5. EMA; the loop (:mod:`marlhf.loop`) logs, evaluates and checkpoints.
"""

from __future__ import annotations

import logging
import time

import torch

from marlhf import loop
from marlhf.data.pipeline import PromptCollator, ResumableSampler, SFTCollator, make_loader, plan_steps
from marlhf.generation import GenerationConfig, Samples
from marlhf.models.loading import stop_token_ids
from marlhf.rewards import RewardModelSource, RewardSource, score_samples
from marlhf.rlhf import macro
from marlhf.rlhf.advantages import build_estimator
from marlhf.rlhf.rlhf_engine import RLHFEngine, update_ema
from marlhf.rlhf.rollout import Experience, RolloutParts, make_experience
from marlhf.rlhf.sections import MacroSection, RolloutSection, UpdateSection
from marlhf.rlhf.segmentation import MacroSegmenter
from marlhf.rlhf.update import ppo_update
from marlhf.utils import dist
from marlhf.utils.optim_step import StepGuard
from marlhf.utils.timing import NO_TIMER

log = logging.getLogger("marlhf")


class MAPPOTrainer(loop.Recipe):
    """MA-PPO as a recipe of the one training loop (:mod:`marlhf.loop`)."""

    name = "ma-ppo"

    def __init__(self, args, rlhf: RLHFEngine, tokenizer, reward: RewardSource | None = None):
        self.args, self.rlhf, self.tokenizer = args, rlhf, tokenizer
        self.stop_ids = stop_token_ids(tokenizer, args.end_of_conversation_token)
        self.pad_id = tokenizer.pad_token_id
        self.gen_cfg = GenerationConfig.from_args(args, self.stop_ids, self.pad_id)
        self.segmenter = MacroSegmenter(MacroSection.from_args(args), tokenizer, args.seed)
        self.rollout, self.update = RolloutSection.from_args(args), UpdateSection.from_args(args)
        self.estimator = build_estimator(self.rollout)
        # the reward source (marlhf.rewards): the frozen reward engine unless another is given
        self.reward = reward if reward is not None else RewardModelSource(rlhf.reward)
        self.guard = StepGuard(args.max_skipped_steps)  # drops non-finite updates, stops after too many
        self.timer = NO_TIMER  # a marlhf.utils.timing.PhaseTimer times each phase (the cost benchmark)

    # -- 1-3. experience (marlhf.rlhf.rollout) ------------------------------------------------------------
    def make_experience(self, prompt_ids, prompt_mask, step: int, batch: int = 0,
                        meta: list[dict] | None = None) -> tuple[Experience, dict]:
        """Generate, score and segment answers to one prompt batch (``batch``: its index in the step;
        ``meta``: each prompt's record meta, for the reward source)."""
        K = self.args.num_samples_per_prompt
        # sample() puts prompt i's K answers in rows i*K .. i*K+K-1: each gets its prompt's meta
        meta_rows = None if meta is None else [m for m in meta for _ in range(K)]

        def score(s: Samples) -> torch.Tensor:
            return score_samples(self.reward, self.tokenizer, s, meta_rows)

        parts = RolloutParts(self.rlhf.actor, self.rlhf.ref, self.rlhf.critic, score, self.segmenter, self.estimator,
                             self.gen_cfg, self.rollout)
        return make_experience(parts, prompt_ids, prompt_mask, step, batch, self.timer)

    # -- 4. PPO update (marlhf.rlhf.update) ---------------------------------------------------------------
    def ppo_update(self, exps: list[Experience], ptx_batches=None) -> dict:
        """``--ppo_epochs`` passes over the experience (:func:`marlhf.rlhf.update.ppo_update`)."""
        return ppo_update(self.rlhf.actor, self.rlhf.critic, self.guard, exps, self.update, ptx_batches, self.timer)

    # -- the loop (marlhf.loop): each step 1-3 for --generation_batches prompt batches, 4, then EMA and logs ------
    def engines(self) -> dict:
        return self.rlhf.trainable()

    def step(self, batches: list[dict], step: int) -> dict:
        dev = dist.device()
        exps, gen_stats = [], []
        for k, batch in enumerate(batches):  # 1-3. experience
            exp, s = self.make_experience(batch["prompt_ids"].to(dev), batch["prompt_mask"].to(dev), step, k,
                                          batch["meta"])
            exps.append(exp)
            gen_stats.append(s)
        t0 = time.time()
        train_stats = self.ppo_update(exps, self._ptx)  # 4. PPO epochs over the experience
        train_stats.update(self.guard.end_step(step + 1))
        if self.rlhf.ema is not None:
            update_ema(self.rlhf.actor, self.rlhf.ema, self.args.ema_decay)
        stats = {k: sum(s[k] for s in gen_stats) / len(gen_stats) for k in gen_stats[0]}
        stats.update(train_stats, train_seconds=time.time() - t0, actor_lr=self.rlhf.actor.get_lr()[0])
        if self.args.print_answers and (step + 1) % self.args.print_answers_interval == 0:
            self._print_sample(exps[0])
        return stats

    def evaluate(self) -> dict | None:
        return None if self._evaluate is None else self._evaluate()

    def postfix(self, stats: dict) -> dict:
        return {"reward": f"{stats['reward']:.3f}", "kl": f"{stats['kl']:.3f}"}

    def describe(self, steps_per_epoch: int, total: int, start: int) -> None:
        a = self.args
        log.info("MA-PPO: %d prompts, %d steps/epoch, %d steps (from %d); rule %s n=%s, σ %s, ratio %s",
                 self._num_prompts, steps_per_epoch, total, start, a.termination_condition, a.ngram, a.value_function,
                 a.policy_ratio)
        log.info("advantages: %s, K=%d samples per prompt, KL in the %s", a.advantage_estimator,
                 a.num_samples_per_prompt, a.kl_penalty)

    def train(self, prompts: list[dict], ptx_items: list[dict] | None = None, evaluate=None) -> int:
        """MA-PPO over ``prompts`` in the one loop (:func:`marlhf.loop.run`); ``evaluate()`` (held-out metrics) is
        logged as ``eval/*`` every ``--eval_interval`` steps (the evaluations before and after are the caller's).
        Returns the steps done."""
        a = self.args
        bs = a.per_device_generation_batch_size
        sampler = ResumableSampler(len(prompts), a.seed)
        loader = make_loader(prompts, bs, sampler, PromptCollator(self.pad_id))
        steps_per_epoch, total = plan_steps(len(prompts), bs, a.generation_batches, a.num_train_epochs,
                                            a.max_steps, what="prompts")
        self._ptx, self._evaluate, self._num_prompts = self._ptx_iterator(ptx_items), evaluate, len(prompts)
        return loop.run(self, loader, sampler, loop.LoopSection.from_args(a), steps_per_epoch=steps_per_epoch,
                        total=total, batches_per_step=a.generation_batches, items_per_batch=bs)

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
