"""The training loop of steps 1 and 2 — written once; the steps differ only in their :class:`Objective`.

Step 1 (SFT): next-token loss on response tokens, evaluated as perplexity.
Step 2 (reward model): pairwise loss -log σ(r⁺ - r⁻) on the score at each sequence's last real token,
evaluated as accuracy and mean chosen / rejected scores.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from marlhf.data.pipeline import PairCollator, ResumableSampler, SFTCollator, make_loader, plan_steps
from marlhf.models.forward import labelled_logits, last_token_index, sequence_scores, token_values
from marlhf.models.logprobs import token_logprobs
from marlhf.utils import checkpoint, dist, events
from marlhf.utils.ds_engine import engine_from_args
from marlhf.utils.optim_step import StepGuard, all_reduce_sum, loss_multipliers
from marlhf.utils.tracking import Tracker

log = logging.getLogger("marlhf")


# --------------------------------------------------------------------------------------------------------
# objectives
# --------------------------------------------------------------------------------------------------------
@dataclass
class Objective:
    name: str
    collator: Callable
    loss: Callable  # (model, batch) -> (loss, {metric: 0-d tensor}); the loss is a mean over count(batch) units
    evaluate: Callable  # (model, loader) -> {metric: float}
    count: Callable = None  # batch -> units the loss averages over (response tokens / pairs), see optim_step
    length: Callable = None  # example -> its tokens, for --group_by_length


def answer_nll(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL of the labelled (response) tokens, and their count (a device tensor: nothing is
    read on the host); only the columns that predict one go through the vocabulary projection
    (:func:`~marlhf.models.forward.labelled_logits`)."""
    logits, targets = labelled_logits(model, batch)
    # chunked float32 log-probs (marlhf.models.logprobs): cross_entropy on a float32 copy of the logits would
    # keep that (B, K, V) copy for backward
    logp = token_logprobs(logits, targets.clamp(min=0))
    labelled = targets != -100
    return -torch.where(labelled, logp, 0.0).sum(), labelled.sum()


def sft_loss(model, batch: dict):
    nll, count = answer_nll(model, batch)
    loss = nll / count.clamp(min=1)
    return loss, {"loss": loss.detach()}  # read on the host once per step, by the loop


@torch.no_grad()
def sft_evaluate(model, loader) -> dict:
    """Perplexity over response tokens = exp(total NLL / total tokens), summed over all ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for batch in loader:
        nll, count = answer_nll(model, _to_device(batch))
        total += torch.tensor([nll.item(), count.item()], dtype=torch.float64)
    model.train()
    total = all_reduce_sum(total)
    loss = (total[0] / total[1].clamp(min=1)).item()
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Bradley–Terry loss −log σ(r⁺ − r⁻), averaged over pairs.  With label smoothing ε each pair counts as
    chosen-better with probability 1 − ε: −(1 − ε) log σ(Δ) − ε log σ(−Δ).  For preference labels flipped at
    rate ε this is the matched likelihood; the plain loss keeps pushing Δ of a flipped pair towards −∞ and so
    learns the noise on a second pass over the data."""
    delta = (chosen - rejected).float()
    return -((1 - label_smoothing) * F.logsigmoid(delta) + label_smoothing * F.logsigmoid(-delta)).mean()


def divergence_span(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For chosen rows [0, B) stacked over rejected rows [B, 2B) (a :class:`PairCollator` batch: a pair's two
    rows padded alike up to where they differ): per pair, the first column where the two sequences differ
    (the shared prompt and answer prefix end) and the column after the longer one's last token,
    ``(start, end)``, each (B,).  Identical sequences give the span of their last token."""
    ids_c, ids_r = input_ids.chunk(2)
    m_c, m_r = attention_mask.long().chunk(2)
    last_c, last_r = last_token_index(attention_mask).chunk(2)
    end = torch.maximum(last_c, last_r) + 1
    positions = torch.arange(ids_c.shape[1], device=ids_c.device)
    differ = ((ids_c != ids_r) | (m_c != m_r)) & (positions[None] < end[:, None])
    first = torch.where(differ, positions[None], end[:, None]).min(1).values
    return torch.minimum(first, end - 1), end


def divergence_pairwise_loss(values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             label_smoothing: float = 0.0) -> torch.Tensor:
    """DeepSpeed-Chat's reward loss: the pairwise loss of the per-token rewards at every position from where
    chosen and rejected diverge to the end of the longer one, averaged over those positions, then over pairs.
    A sequence that has ended keeps its final reward (its score) for the positions after its last token, so
    the span's last term compares the two scores.  ``values``: (2B, T) per-token rewards, chosen rows first."""
    start, end = divergence_span(input_ids, attention_mask)
    last = last_token_index(attention_mask)  # (2B,)
    positions = torch.arange(values.shape[1], device=values.device)
    # a finished sequence's value at t > last is its value at last
    held = values.gather(1, torch.minimum(positions[None], last[:, None]))
    v_c, v_r = held.chunk(2)
    delta = (v_c - v_r).float()
    per_token = -((1 - label_smoothing) * F.logsigmoid(delta) + label_smoothing * F.logsigmoid(-delta))
    span = (positions[None] >= start[:, None]) & (positions[None] < end[:, None])
    return ((per_token * span).sum(1) / span.sum(1)).mean()


def reward_loss(model, batch: dict, label_smoothing: float = 0.0, kind: str = "last"):
    """``kind`` "last": Bradley–Terry on the final-token scores (the score step 3 uses); "divergence": on the
    per-token rewards of the span where the pair differs (DeepSpeed-Chat's).  Accuracy is on the scores."""
    values = token_values(model, batch["input_ids"], batch["attention_mask"], batch["response_start"],
                          batch.get("prefix_width", 0))  # (2B, T)
    scores = values.gather(1, last_token_index(batch["attention_mask"])[:, None]).squeeze(1)
    chosen, rejected = scores.chunk(2)
    if kind == "divergence":
        loss = divergence_pairwise_loss(values, batch["input_ids"], batch["attention_mask"], label_smoothing)
    else:
        loss = pairwise_loss(chosen, rejected, label_smoothing)
    return loss, {"loss": loss.detach(), "accuracy": (chosen > rejected).float().mean()}


@torch.no_grad()
def reward_evaluate(model, loader) -> dict:
    model.eval()
    total = torch.zeros(4, dtype=torch.float64)  # correct, chosen sum, rejected sum, count
    for batch in loader:
        batch = _to_device(batch)
        chosen, rejected = sequence_scores(model, batch["input_ids"], batch["attention_mask"],
                                           batch["response_start"], batch.get("prefix_width", 0)).chunk(2)
        total += torch.tensor([(chosen > rejected).sum().item(), chosen.sum().item(), rejected.sum().item(),
                               chosen.numel()], dtype=torch.float64)
    model.train()
    total = all_reduce_sum(total)
    n = total[3].clamp(min=1)
    return {"accuracy": (total[0] / n).item(), "chosen_score": (total[1] / n).item(),
            "rejected_score": (total[2] / n).item()}


def sft_count(batch: dict) -> int:
    """Response tokens the next-token loss averages over (labels shifted by one, -100 ignored)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def pair_count(batch: dict) -> int:
    return batch["input_ids"].shape[0] // 2


def sft_length(example: dict) -> int:
    return len(example["input_ids"])


def pair_length(example: dict) -> int:
    return len(example["chosen_ids"]) + len(example["rejected_ids"])


def sft_objective(pad_id: int) -> Objective:
    return Objective("sft", SFTCollator(pad_id), sft_loss, sft_evaluate, sft_count, sft_length)


REWARD_LOSSES = ("last", "divergence")


def reward_objective(pad_id: int, label_smoothing: float = 0.0, kind: str = "last") -> Objective:
    if kind not in REWARD_LOSSES:
        raise ValueError(f"reward loss must be one of {REWARD_LOSSES}, got {kind!r}")
    loss = functools.partial(reward_loss, label_smoothing=label_smoothing, kind=kind)
    return Objective("reward", PairCollator(pad_id), loss, reward_evaluate, pair_count, pair_length)


def _to_device(batch: dict) -> dict:
    dev = dist.device()
    return {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}


# --------------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------------
def train(args, model, tokenizer, train_items: list[dict], eval_items: list[dict], objective: Objective):
    """Train ``model`` on ``train_items`` with ``objective`` under DeepSpeed; returns the engine.

    Evaluates before training and every ``--eval_interval`` steps / epoch end, checkpoints every
    ``--save_steps`` (resumable with ``--resume``), logs to ``<output_dir>/metrics.jsonl`` (+ TensorBoard)."""
    mb, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    lengths = [objective.length(item) for item in train_items] if args.group_by_length else None
    sampler = ResumableSampler(len(train_items), args.seed, lengths=lengths, batch_size=mb)
    loader = make_loader(train_items, mb, sampler, objective.collator)
    eval_loader = make_loader(eval_items, args.per_device_eval_batch_size,
                              ResumableSampler(len(eval_items), args.seed, shuffle=False), objective.collator)
    steps_per_epoch, total = plan_steps(len(train_items), mb, ga, args.num_train_epochs, args.max_steps)
    engine = engine_from_args(model, args, total, mb)
    ckpt_root = Path(args.output_dir) / "checkpoints"
    tracker = Tracker(args.output_dir, args.tensorboard_path, args.enable_tensorboard, args.print_loss)
    step, epoch, done_in_epoch = 0, 0, 0
    dist.seed_rank_streams(args.seed)  # the models are built: dropout masks differ between ranks from here
    if args.resume:
        state = checkpoint.load_checkpoint(ckpt_root, {objective.name: engine})
        if state is not None:
            step, epoch, done_in_epoch = state["step"], state["epoch"], state["batches_done"]
        else:
            log.info("--resume: no checkpoint in %s, starting from scratch", ckpt_root)
    if step == 0:
        tracker.log(0, objective.evaluate(engine, _device_iter(eval_loader)), prefix="eval/", echo=True)
    log.info("%s: %d examples, %d steps/epoch, %d steps total (starting at %d), world %d", objective.name,
             len(train_items), steps_per_epoch, total, step, dist.world_size())

    bar = tqdm(total=total, initial=step, desc=objective.name, disable=not dist.is_main() or args.disable_progress_bar)
    guard = StepGuard(args.max_skipped_steps)
    engine.train()
    while step < total:
        # done_in_epoch counts optimizer steps; each consumed ga micro-batches of mb items
        sampler.set_epoch(epoch, skip=done_in_epoch * ga * mb)
        it = iter(loader)
        while done_in_epoch < steps_per_epoch and step < total:
            # one optimizer step: its ga micro-batches are counted (on all ranks) before the first backward
            window = [next(it) for _ in range(ga)]  # counted on the host, before they move to the device
            mults = loss_multipliers([objective.count(b) for b in window], [0] * ga, ga, args.loss_aggregation)
            for batch, mult in zip(window, mults):
                loss, metrics = objective.loss(engine, _to_device(batch))
                guard.backward(engine, loss * mult, "loss")
                guard.step(engine)
            done_in_epoch += 1
            step += 1
            metrics = dict(zip(metrics, torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(())
                                                     for v in metrics.values()]).tolist()))  # one host read
            metrics.update(guard.end_step(step))
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}")
            tracker.log(step, {**metrics, "lr": engine.get_lr()[0], "epoch": epoch}, prefix="train/")
            if args.eval_interval and step % args.eval_interval == 0:
                tracker.log(step, objective.evaluate(engine, _device_iter(eval_loader)), prefix="eval/", echo=True)
            if args.save_steps and step % args.save_steps == 0:
                checkpoint.save_checkpoint(ckpt_root, {objective.name: engine}, step,
                                           {"epoch": epoch, "batches_done": done_in_epoch}, args.keep_checkpoints)
            events.reached("step", step)  # between two checkpoints
        if done_in_epoch >= steps_per_epoch:  # epoch finished
            epoch, done_in_epoch = epoch + 1, 0
            if not (args.eval_interval and step % args.eval_interval == 0):
                tracker.log(step, objective.evaluate(engine, _device_iter(eval_loader)), prefix="eval/", echo=True)
        elif step >= total and step > 0 and not (args.eval_interval and step % args.eval_interval == 0):
            # stopped by --max_steps inside an epoch: the final model is still evaluated
            tracker.log(step, objective.evaluate(engine, _device_iter(eval_loader)), prefix="eval/", echo=True)
    bar.close()
    tracker.close()
    return engine


def _device_iter(loader):
    for batch in loader:
        yield _to_device(batch)
