"""MA-PPO's training loop (paper Algorithm 1); each step a named call into one module:

  1. sample answers for ``--generation_batches`` prompt batches       (:func:`marlhf.generation.sample`)
  2. one forward each of actor, reference, critic; score each answer  (:mod:`marlhf.rlhf.rollout`)
  3. termination rule → segment ids → macro values / rewards → GAE    (:mod:`marlhf.rlhf.segmentation`,
                                                                        :func:`marlhf.rlhf.rollout.macro_advantages`)
  4. ``--ppo_epochs`` passes of clipped policy + value loss (+ ptx)    (:mod:`marlhf.rlhf.update`)
  5. log, EMA, checkpoint.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from marlhf.data.pipeline import PromptCollator, ResumableSampler, SFTCollator, make_loader, plan_steps
from marlhf.generation import GenerationConfig, Samples
from marlhf.models.loading import stop_token_ids
from marlhf.rewards import RewardModelSource, RewardSource, score_samples
from marlhf.rlhf import macro
from marlhf.rlhf.rlhf_engine import RLHFEngine, update_ema
from marlhf.rlhf.rollout import Experience, RolloutSettings, make_experience
from marlhf.rlhf.segmentation import MacroSegmenter
from marlhf.rlhf.update import UpdateSettings, ppo_update
from marlhf.utils import checkpoint, dist
from marlhf.utils.optim_step import StepGuard
from marlhf.utils.timing import NO_TIMER
from marlhf.utils.tracking import Tracker

log = logging.getLogger("marlhf")


class MAPPOTrainer:
    def __init__(self, args, rlhf: RLHFEngine, tokenizer, reward: RewardSource | None = None):
        self.args, self.rlhf, self.tokenizer = args, rlhf, tokenizer
        self.stop_ids = stop_token_ids(tokenizer, args.end_of_conversation_token)
        self.pad_id = tokenizer.pad_token_id
        self.gen_cfg = GenerationConfig.from_args(args, self.stop_ids, self.pad_id)
        self.segmenter = MacroSegmenter(args, tokenizer)
        self.rollout, self.update = RolloutSettings.from_args(args), UpdateSettings.from_args(args)
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

        return make_experience(self.rlhf.actor, self.rlhf.ref, self.rlhf.critic, score, self.segmenter,
                               self.gen_cfg, self.rollout, prompt_ids, prompt_mask, step, batch, self.timer)

    # -- 4. PPO update (marlhf.rlhf.update) ---------------------------------------------------------------
    def ppo_update(self, exps: list[Experience], ptx_batches=None) -> dict:
        """``--ppo_epochs`` passes over the experience (:func:`marlhf.rlhf.update.ppo_update`)."""
        return ppo_update(self.rlhf.actor, self.rlhf.critic, self.guard, exps, self.update, ptx_batches, self.timer)

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
        dist.seed_rank_streams(a.seed)  # the models are built: each rank samples its own answers from here
        if a.resume:
            state = checkpoint.load_checkpoint(ckpt_root, self.rlhf.trainable())
            if state is not None:
                step, epoch, done = state["step"], state["epoch"], state["batches_done"]
        log.info("MA-PPO: %d prompts, %d steps/epoch, %d steps (from %d); rule %s n=%s, σ %s, ratio %s", len(prompts),
                 steps_per_epoch, total, step, a.termination_condition, a.ngram, a.value_function, a.policy_ratio)
        log.info("advantages: %s, K=%d samples per prompt, KL in the %s", a.advantage_estimator,
                 a.num_samples_per_prompt, a.kl_penalty)
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
                    exp, s = self.make_experience(batch["prompt_ids"].to(dev), batch["prompt_mask"].to(dev), step, k,
                                                  batch["meta"])
                    exps.append(exp)
                    gen_stats.append(s)
                done += 1
                # 4. PPO epochs over the experience
                t0 = time.time()
                train_stats = self.ppo_update(exps, ptx)
                train_stats.update(self.guard.end_step(step + 1))
                if self.rlhf.ema is not None:
                    update_ema(self.rlhf.actor, self.rlhf.ema, a.ema_decay)
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
