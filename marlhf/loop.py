"""The one training loop of every stage: steps, epochs, resume, evaluation cadence, checkpoints, logs.

A stage supplies a :class:`Recipe` — what one optimizer step does with its batches (SFT / reward / DPO: a
window of micro-batches under one objective; MA-PPO: rollouts of prompt batches and the PPO update), how it
evaluates, and which engines a checkpoint holds — and :func:`run` owns the rest:

    resume from the last complete checkpoint (``--resume``)  →  for each epoch, the sampler skips what a
    resumed run already consumed  →  each step takes ``batches_per_step`` batches, runs the recipe, logs
    ``train/*``  →  evaluates (``eval/*``) at the start, every ``--eval_interval`` steps, at epoch ends and at
    the end, as the recipe asks  →  checkpoints every ``--save_steps``  →  announces the step
    (:mod:`marlhf.utils.events`).

The order of the sampler and loader calls is the resume contract: a run stopped anywhere and resumed draws
the same batches (and, with the RNG state restored by the checkpoint, the same dropout and samples).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from marlhf.utils import checkpoint, dist, events
from marlhf.utils.tracking import Tracker

if TYPE_CHECKING:
    from marlhf.sections import LoopSection

log = logging.getLogger("marlhf")


class Recipe:
    """What a stage does inside the loop.

    ``name``: the progress bar's and the checkpoint's label; ``engines()``: what a checkpoint saves and
    restores; ``step(batches, step)``: one optimizer step on ``batches_per_step`` batches (``step``: the steps
    done before it), returning its metrics; ``evaluate()``: held-out metrics, or None when the stage has
    no evaluation in the loop.  ``eval_at_start`` / ``eval_at_epoch_end`` / ``eval_at_end``: the evaluations
    beside ``--eval_interval``'s (steps 1-2 evaluate at all three; step 3 evaluates before and after the loop
    itself).  ``postfix(metrics)``: what the progress bar shows."""

    name = "train"
    eval_at_start = eval_at_epoch_end = eval_at_end = False

    def engines(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def step(self, batches: list, step: int) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def evaluate(self) -> dict | None:
        return None

    def restored(self) -> None:
        """Called once the engines hold a checkpoint's weights (``--resume``): anything that copied them is stale."""

    def postfix(self, metrics: dict) -> dict:
        return {}

    def describe(self, steps_per_epoch: int, total: int, start: int) -> None:
        log.info("%s: %d steps/epoch, %d steps total (starting at %d), world %d", self.name, steps_per_epoch, total,
                 start, dist.world_size())


def run(recipe: Recipe, loader, sampler, settings: LoopSection, *, steps_per_epoch: int, total: int,
        batches_per_step: int, items_per_batch: int) -> int:
    """Train ``recipe`` for ``total`` steps over ``loader`` (whose ``sampler`` is a ResumableSampler); returns
    the number of steps done.  ``items_per_batch``: the items one batch takes (what a resumed epoch skips)."""
    ckpt_root = Path(settings.output_dir) / "checkpoints"
    tracker = Tracker(settings.output_dir, settings.tensorboard_path, settings.enable_tensorboard,
                      settings.print_loss)
    step, epoch, done = 0, 0, 0
    dist.seed_rank_streams(settings.seed)  # the models are built: ranks sample and drop out differently from here
    if settings.resume:
        state = checkpoint.load_checkpoint(ckpt_root, recipe.engines())
        if state is not None:
            step, epoch, done = state["step"], state["epoch"], state["batches_done"]
            recipe.restored()
        else:
            log.info("--resume: no checkpoint in %s, starting from scratch", ckpt_root)

    def evaluate(at: int) -> None:
        metrics = recipe.evaluate()
        if metrics is not None:
            tracker.log(at, metrics, prefix="eval/", echo=True)

    def on_interval(at: int) -> bool:
        return bool(settings.eval_interval) and at % settings.eval_interval == 0

    if step == 0 and recipe.eval_at_start:
        evaluate(0)
    recipe.describe(steps_per_epoch, total, step)
    bar = tqdm(total=total, initial=step, desc=recipe.name, disable=not dist.is_main() or settings.disable_progress_bar)
    while step < total:
        sampler.set_epoch(epoch, skip=done * batches_per_step * items_per_batch)
        it: Iterator = iter(loader)
        while done < steps_per_epoch and step < total:
            batches = [next(it) for _ in range(batches_per_step)]
            metrics = recipe.step(batches, step)
            done += 1
            step += 1
            bar.update(1)
            bar.set_postfix(**recipe.postfix(metrics))
            tracker.log(step, {**metrics, "epoch": epoch}, prefix="train/")
            if on_interval(step) and (step < total or recipe.eval_at_end):
                evaluate(step)
            if settings.save_steps and step % settings.save_steps == 0:
                checkpoint.save_checkpoint(ckpt_root, recipe.engines(), step, {"epoch": epoch, "batches_done": done},
                                           settings.keep_checkpoints)
            events.reached("step", step)  # between two checkpoints
        if done >= steps_per_epoch:  # the epoch is finished
            epoch, done = epoch + 1, 0
            if recipe.eval_at_epoch_end and not on_interval(step):
                evaluate(step)
        elif step >= total and step > 0 and recipe.eval_at_end and not on_interval(step):
            evaluate(step)  # stopped by --max_steps inside an epoch: the final model is still evaluated
    bar.close()
    tracker.close()
    return step
