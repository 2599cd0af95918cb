"""Steps 1 and 2 — one recipe in the one loop (:mod:`marlhf.loop`); the steps differ only in their :class:`Objective`.

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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from marlhf import loop
from marlhf.data.pipeline import PairCollator, ResumableSampler, SFTCollator, make_loader, plan_steps
from marlhf.models.forward import labelled_logits, last_token_index, token_values
from marlhf.models.logprobs import token_logprobs
from marlhf.utils import dist
from marlhf.utils.ds_engine import engine_from_section
from marlhf.utils.optim_step import StepGuard, all_reduce_sum, loss_multipliers

if TYPE_CHECKING:
    from marlhf.sections import EngineSection, LoopSection, SupervisedSection

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
    group: Callable = None  # example -> its group (a pair's prompt): a group's examples are batched together


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


def _pair_scores(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a :class:`PairCollator` batch (each distinct sequence run once): the rows the pairs compare, chosen
    rows then rejected rows (2B,), their per-token rewards (2B, T), and the chosen and rejected scores (B,)."""
    values = token_values(model, batch["input_ids"], batch["attention_mask"], batch["response_start"],
                          batch["prefix_width"], batch["prefix_index"])
    scores = values.gather(1, last_token_index(batch["attention_mask"])[:, None]).squeeze(1)
    rows = torch.cat([batch["chosen"], batch["rejected"]]).to(values.device)
    chosen, rejected = scores[rows].chunk(2)
    return rows, values[rows], chosen, rejected


def reward_loss(model, batch: dict, label_smoothing: float = 0.0, kind: str = "last"):
    """``kind`` "last": Bradley–Terry on the final-token scores (the score step 3 uses); "divergence": on the
    per-token rewards of the span where the pair differs (DeepSpeed-Chat's).  Accuracy is on the scores."""
    rows, values, chosen, rejected = _pair_scores(model, batch)
    if kind == "divergence":  # a group's rows share their columns: the pair's two rows stay aligned
        loss = divergence_pairwise_loss(values, batch["input_ids"][rows], batch["attention_mask"][rows],
                                        label_smoothing)
    else:
        loss = pairwise_loss(chosen, rejected, label_smoothing)
    return loss, {"loss": loss.detach(), "accuracy": (chosen > rejected).float().mean()}


@torch.no_grad()
def reward_evaluate(model, loader) -> dict:
    model.eval()
    total = torch.zeros(4, dtype=torch.float64)  # correct, chosen sum, rejected sum, count
    for batch in loader:
        batch = _to_device(batch)
        _, _, chosen, rejected = _pair_scores(model, batch)
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
    """Pairs in a :class:`PairCollator` batch, or in a DPO batch (chosen rows over rejected rows)."""
    return len(batch["chosen"]) if "chosen" in batch else batch["input_ids"].shape[0] // 2


def sft_length(example: dict) -> int:
    return len(example["input_ids"])


def pair_length(example: dict) -> int:
    return len(example["chosen_ids"]) + len(example["rejected_ids"])


def pair_prompt(example: dict) -> tuple:
    """A pair's prompt tokens: the pairs of one prompt go in one batch, where its answers run once each."""
    return tuple(example["chosen_ids"][:example["chosen_start"]])


def sft_objective(pad_id: int, prompt_loss: bool = False) -> Objective:
    return Objective("sft", SFTCollator(pad_id, prompt_loss), sft_loss, sft_evaluate, sft_count, sft_length)


REWARD_LOSSES = ("last", "divergence")


def reward_objective(pad_id: int, label_smoothing: float = 0.0, kind: str = "last") -> Objective:
    if kind not in REWARD_LOSSES:
        raise ValueError(f"reward loss must be one of {REWARD_LOSSES}, got {kind!r}")
    loss = functools.partial(reward_loss, label_smoothing=label_smoothing, kind=kind)
    return Objective("reward", PairCollator(pad_id), loss, reward_evaluate, pair_count, pair_length, pair_prompt)


def _to_device(batch: dict) -> dict:
    dev = dist.device()
    return {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}


# --------------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------------
class SupervisedRecipe(loop.Recipe):
    """Steps 1-2 in the loop (:mod:`marlhf.loop`): one optimizer step is a window of ``--gradient_accumulation_steps``
    micro-batches under ``objective``, whose losses are weighted by ``--loss_aggregation``; evaluated at the
    start, every ``--eval_interval`` steps, at epoch ends and at the end."""

    eval_at_start = eval_at_epoch_end = eval_at_end = True

    def __init__(self, engine, objective: Objective, eval_loader, loss_aggregation: str, max_skipped_steps: int,
                 num_items: int):
        self.engine, self.objective, self.eval_loader = engine, objective, eval_loader
        self.name, self.loss_aggregation, self.num_items = objective.name, loss_aggregation, num_items
        self.guard = StepGuard(max_skipped_steps)

    def engines(self) -> dict:
        return {self.objective.name: self.engine}

    def step(self, window: list, step: int) -> dict:
        # the window's micro-batches are counted (on all ranks) on the host, before the first backward
        ga = len(window)
        mults = loss_multipliers([self.objective.count(b) for b in window], [0] * ga, ga, self.loss_aggregation)
        for batch, mult in zip(window, mults):
            loss, metrics = self.objective.loss(self.engine, _to_device(batch))
            self.guard.backward(self.engine, loss * mult, "loss")
            self.guard.step(self.engine)
        metrics = dict(zip(metrics, torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(())
                                                 for v in metrics.values()]).tolist()))  # one host read
        metrics.update(self.guard.end_step(step + 1))
        return {**metrics, "lr": self.engine.get_lr()[0]}

    def evaluate(self) -> dict:
        return self.objective.evaluate(self.engine, _device_iter(self.eval_loader))

    def postfix(self, metrics: dict) -> dict:
        return {"loss": f"{metrics['loss']:.4f}"}

    def describe(self, steps_per_epoch: int, total: int, start: int) -> None:
        log.info("%s: %d examples, %d steps/epoch, %d steps total (starting at %d), world %d", self.name,
                 self.num_items, steps_per_epoch, total, start, dist.world_size())


def train(model, train_items: list[dict], eval_items: list[dict], objective: Objective, section: SupervisedSection,
          engine: EngineSection, loop_section: LoopSection):
    """Train ``model`` on ``train_items`` with ``objective`` under DeepSpeed; returns the engine.

    The loop (:func:`marlhf.loop.run`) evaluates before training and every ``--eval_interval`` steps / epoch
    end, checkpoints every ``--save_steps`` (resumable with ``--resume``), logs to
    ``<output_dir>/metrics.jsonl`` (+ TensorBoard)."""
    mb, ga = section.micro_batch, section.schedule.gradient_accumulation_steps
    lengths = [objective.length(item) for item in train_items] if section.group_by_length else None
    groups = [objective.group(item) for item in train_items] if objective.group else None
    schedule = section.schedule
    sampler = ResumableSampler(len(train_items), schedule.seed, lengths=lengths, batch_size=mb, groups=groups)
    loader = make_loader(train_items, mb, sampler, objective.collator)
    eval_loader = make_loader(eval_items, section.eval_micro_batch,
                              ResumableSampler(len(eval_items), schedule.seed, shuffle=False), objective.collator)
    steps_per_epoch, total = plan_steps(len(train_items), mb, ga, schedule.num_train_epochs, schedule.max_steps)
    ds_engine = engine_from_section(model, engine, total, mb)
    recipe = SupervisedRecipe(ds_engine, objective, eval_loader, section.robustness.loss_aggregation,
                              section.robustness.max_skipped_steps,
                              len(train_items))
    ds_engine.train()
    loop.run(recipe, loader, sampler, loop_section, steps_per_epoch=steps_per_epoch, total=total,
             batches_per_step=ga, items_per_batch=mb)
    return ds_engine


def _device_iter(loader):
    for batch in loader:
        yield _to_device(batch)
