"""MA-PPO's training loop (paper Algorithm 1); each step a named call into one module:

  1. sample answers for ``--generation_batches`` prompt batches       (:func:`marlhf.sampler.sample`)
  2. one forward each of actor, reference, critic; score each answer  (:mod:`marlhf.rlhf.rollout`)
  3. termination rule → segment ids → advantages (macro GAE)        (:mod:`marlhf.rlhf.termination`,
                                                                        :mod:`marlhf.rlhf.advantages`)
  4. ``--ppo_epochs`` passes of clipped policy + value loss (+ ptx)    (:mod:`marlhf.rlhf.update`)
  5. EMA; the loop (:mod:`marlhf.loop`) logs, evaluates and checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from marlhf import loop
from marlhf.data.pipeline import PromptCollator, ResumableSampler, SFTCollator, make_loader, plan_steps
from marlhf.rewards import RewardSource, score_samples
from marlhf.rewards.reward_model import RewardModelSource
from marlhf.rlhf import macro
from marlhf.rlhf.advantages import build_estimator
from marlhf.rlhf.rlhf_engine import RLHFEngine, update_ema
from marlhf.rlhf.rollout import Experience, RolloutParts, make_experience
from marlhf.rlhf.sections import BatchSection, MacroSection, ReportSection, RolloutSection, UpdateSection
from marlhf.rlhf.segmentation import MacroSegmenter
from marlhf.rlhf.update import ppo_update
from marlhf.sampler import GenerationConfig, Samples
from marlhf.sections import LoopSection, RobustnessSection
from marlhf.utils import dist
from marlhf.utils.optim_step import StepGuard
from marlhf.utils.timing import NO_TIMER

log = logging.getLogger("marlhf")


@dataclass(frozen=True)
class MAPPOSections:
    """Everything MA-PPO reads, in sections: the termination rule's, the rollout's, the update's, the batches',
    the loop's and the sampling settings, plus the step's own extras."""

    macro: MacroSection
    rollout: RolloutSection
    update: UpdateSection
    batches: BatchSection
    loop: LoopSection
    generation: GenerationConfig
    robustness: RobustnessSection  # --max_skipped_steps
    ema_decay: float
    report: ReportSection  # printed answers


class MAPPOTrainer(loop.Recipe):
    """MA-PPO as a recipe of the one training loop (:mod:`marlhf.loop`)."""

    name = "ma-ppo"

    def __init__(self, rlhf: RLHFEngine, tokenizer, sections: MAPPOSections, reward: RewardSource | None = None,
                 engine=None):
        """``engine``: a generation engine (:class:`marlhf.vllm_sampler.VLLMSampler`) that samples the answers;
        the actor's weights are pushed into it before the first rollout and after every update."""
        self.rlhf, self.tokenizer, self.sections = rlhf, tokenizer, sections
        self.engine, self._engine_stale = engine, engine is not None
        self.pad_id = tokenizer.pad_token_id
        self.gen_cfg = sections.generation
        self.segmenter = MacroSegmenter(sections.macro, tokenizer, sections.batches.schedule.seed)
        self.rollout, self.update = sections.rollout, sections.update
        self.estimator = build_estimator(self.rollout)
        # the reward source (marlhf.rewards): the frozen reward engine unless another is given
        self.reward = reward if reward is not None else RewardModelSource(rlhf.reward)
        self.guard = StepGuard(sections.robustness.max_skipped_steps)  # drops non-finite updates, stops after too many
        self.timer = NO_TIMER  # a marlhf.utils.timing.PhaseTimer times each phase (the cost benchmark)

    # -- 1-3. experience (marlhf.rlhf.rollout) ------------------------------------------------------------
    def make_experience(self, prompt_ids, prompt_mask, step: int, batch: int = 0,
                        meta: list[dict] | None = None) -> tuple[Experience, dict]:
        """Generate, score and segment answers to one prompt batch (``batch``: its index in the step;
        ``meta``: each prompt's record meta, for the reward source)."""
        K = self.rollout.num_samples_per_prompt
        # sample() puts prompt i's K answers in rows i*K .. i*K+K-1: each gets its prompt's meta
        meta_rows = None if meta is None else [m for m in meta for _ in range(K)]

        def score(s: Samples, rows: list[int] | None = None) -> torch.Tensor:
            meta = meta_rows if rows is None or meta_rows is None else [meta_rows[r] for r in rows]
            return score_samples(self.reward, self.tokenizer, s, meta)

        generation = self.gen_cfg
        if self.engine is not None:  # the engine's sampling stream is not in a checkpoint: a seed per (step, batch)
            generation = dataclasses.replace(generation, seed=self.sections.batches.schedule.seed * 1_000_003
                                             + step * 1_009 + batch)
        parts = RolloutParts(self.rlhf.actor, self.rlhf.ref, self.rlhf.critic, score, self.segmenter, self.estimator,
                             generation, self.rollout, self.refreshed_engine())
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
        t_step = time.time()
        exps, gen_stats = [], []
        for k, batch in enumerate(batches):  # 1-3. experience
            exp, s = self.make_experience(batch["prompt_ids"].to(dev), batch["prompt_mask"].to(dev), step, k,
                                          batch["meta"])
            exps.append(exp)
            gen_stats.append(s)
        t0 = time.time()
        if self.engine is not None:
            self.engine.sleep()  # --vllm_enable_sleep_mode: the engine's memory free while the models train
        train_stats = self.ppo_update(exps, self._ptx)  # 4. PPO epochs over the experience
        self._engine_stale = self.engine is not None  # the engine's copy of the actor is now old
        train_stats.update(self.guard.end_step(step + 1))
        if self.rlhf.ema is not None:
            update_ema(self.rlhf.actor, self.rlhf.ema, self.sections.ema_decay)
        stats = {k: sum(s[k] for s in gen_stats) / len(gen_stats) for k in gen_stats[0]}
        stats.update(train_stats, train_seconds=time.time() - t0, actor_lr=self.rlhf.actor.get_lr()[0])
        stats["step_seconds"] = time.time() - t_step  # the whole step: experience and update (wall-clock parity)
        every = self.sections.report.every
        if every and (step + 1) % every == 0:
            self._print_sample(exps[0])
        return stats

    def refreshed_engine(self):
        """The generation engine holding the actor's current weights (pushed now if an update, or a resume, came
        since the last push; every rank calls it: a ZeRO-3 push gathers); None without one."""
        if self.engine is not None:
            self.engine.wake_up()  # --vllm_enable_sleep_mode: its memory back before the push and the rollouts
        if self._engine_stale:
            with self.timer("generation/push"):
                self.engine.push_weights(self.rlhf.actor)
            self._engine_stale = False
        return self.engine

    def restored(self) -> None:
        self._engine_stale = self.engine is not None  # the actor now holds the checkpoint's weights

    def evaluate(self) -> dict | None:
        return None if self._evaluate is None else self._evaluate()

    def postfix(self, stats: dict) -> dict:
        return {"reward": f"{stats['reward']:.3f}", **({"kl": f"{stats['kl']:.3f}"} if "kl" in stats else {})}

    def describe(self, steps_per_epoch: int, total: int, start: int) -> None:
        m, r = self.sections.macro, self.rollout
        n = m.ngram if m.ngram is not None else "inf"
        log.info("MA-PPO: %d prompts, %d steps/epoch, %d steps (from %d); rule %s n=%s, σ %s, ratio %s",
                 self._num_prompts, steps_per_epoch, total, start, m.termination_condition, n, r.value_function,
                 self.update.policy_ratio)
        log.info("advantages: %s, K=%d samples per prompt, KL in the %s", r.advantage_estimator,
                 r.num_samples_per_prompt, r.policy.kl_penalty)

    def train(self, prompts: list[dict], ptx_items: list[dict] | None = None, evaluate=None) -> int:
        """MA-PPO over ``prompts`` in the one loop (:func:`marlhf.loop.run`); ``evaluate()`` (held-out metrics) is
        logged as ``eval/*`` every ``--eval_interval`` steps (the evaluations before and after are the caller's).
        Returns the steps done."""
        b = self.sections.batches
        sampler = ResumableSampler(len(prompts), b.schedule.seed)
        loader = make_loader(prompts, b.generation_batch, sampler, PromptCollator(self.pad_id))
        steps_per_epoch, total = plan_steps(len(prompts), b.generation_batch, b.generation_batches,
                                            b.schedule.num_train_epochs, b.schedule.max_steps, what="prompts")
        self._ptx, self._evaluate, self._num_prompts = self._ptx_iterator(ptx_items), evaluate, len(prompts)
        return loop.run(self, loader, sampler, self.sections.loop, steps_per_epoch=steps_per_epoch,
                        total=total, batches_per_step=b.generation_batches, items_per_batch=b.generation_batch)

    def _ptx_iterator(self, items):
        if not items:
            return None
        dev = dist.device()
        b = self.sections.batches
        loader = make_loader(items, b.training_batch, ResumableSampler(len(items), b.schedule.seed + 1),
                             SFTCollator(self.pad_id))

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
