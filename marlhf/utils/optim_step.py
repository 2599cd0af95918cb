"""What goes into one optimizer step: exact loss aggregation and a guard against non-finite steps.

Both training loops (steps 1-2 in :mod:`marlhf.supervised`, step 3 in :mod:`marlhf.rlhf.trainer`) call
DeepSpeed's ``engine.backward(loss)`` / ``engine.step()`` once per micro-batch.  Two things sit between
their loss and those calls, written once here (docs/design.md, "One optimizer step"):

**Aggregation.**  DeepSpeed divides every micro-batch loss by ``gradient_accumulation_steps`` G (``backward``
with ``scale_wrt_gas``) and averages gradients over the W data-parallel ranks, so the applied gradient is
(1 / (W·G)) Σ_{ranks, micro-batches} ∇loss_mb.  With ``token_mean`` (the default) each micro-batch passes
``loss_sum · W·G / N`` where N counts the real tokens (pairs, for the reward model) of the whole
accumulation window on all ranks: the step then follows ∇(Σ loss_sum / N), the true token mean, whatever
the micro-batch size, G or W.  ``microbatch_mean`` keeps DeepSpeed-Chat's mean of per-micro-batch means
(answers differ in length, so it depends on how the batch is cut).

**Non-finite guard.**  A NaN / inf loss is backpropagated multiplied by NaN, so the window's gradient is
certainly non-finite; every optimizer then drops the whole step on every rank together: ZeRO 1-3 and
DeepSpeed's bf16 optimizer check the (all-reduced) gradient norm themselves, and the plain optimizer of
ZeRO 0 / fp32 gets the same check from :func:`guard_optimizer`.  A dropped step changes nothing: no weight,
no Adam moment and no learning-rate step, exactly as if that batch had not been there.  :class:`StepGuard`
counts the drops and stops the run after ``--max_skipped_steps`` consecutive ones.
"""

from __future__ import annotations

import logging

import torch

from marlhf.utils import dist

log = logging.getLogger("marlhf")

LOSS_AGGREGATIONS = ("token_mean", "microbatch_mean")
QUANTITIES = ("loss", "actor loss", "critic loss", "ptx loss")  # what StepGuard.backward may be told


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient; the run stops."""


def loss_multipliers(counts: list[int], windows: list[int], grad_accum: int, mode: str) -> list[float]:
    """Per micro-batch, the factor that turns its MEAN loss into its share of the optimizer step's loss.

    ``counts[i]``: real tokens (or pairs) micro-batch i's mean was taken over; ``windows[i]``: the
    accumulation window (optimizer step) it belongs to, numbered from 0 the same way on every rank.
    token_mean: count_i · W·G / N_window (N summed over the window on all ranks: one all-reduce for all
    windows); microbatch_mean: 1.  A window without a single real token contributes a zero loss anyway."""
    if mode == "microbatch_mean":
        return [1.0] * len(counts)
    if mode != "token_mean":
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    if not counts:
        return []
    totals = torch.zeros(max(windows) + 1, dtype=torch.float64)
    totals.index_add_(0, torch.tensor(windows), torch.tensor(counts, dtype=torch.float64))
    totals = all_reduce_sum(totals)
    scale = dist.world_size() * grad_accum
    return [c * scale / max(totals[w].item(), 1.0) for c, w in zip(counts, windows)]


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of a small CPU tensor over all ranks (returned on the CPU)."""
    if dist.world_size() > 1:
        import torch.distributed as tdist

        y = x.to(dist.device())
        tdist.all_reduce(y)
        x = y.cpu()
    return x


def guard_optimizer(optimizer):
    """Give a plain torch optimizer the ``overflow`` flag DeepSpeed's own optimizers have.

    DeepSpeed reads ``optimizer.overflow`` after ``step()``: when set it skips the learning-rate step and
    counts ``engine.skipped_steps``.  ZeRO 1-3 and the bf16 optimizer set it on a non-finite gradient norm;
    ZeRO 0 in fp32 hands the user's optimizer the (already all-reduced) gradients directly and would write
    NaN into the weights.  Here ``step`` first checks every gradient and does nothing if one is non-finite
    (gradients are identical on all ranks after DeepSpeed's all-reduce, so all ranks decide alike)."""
    base = type(optimizer)

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None and p.grad.numel()]
        # max |g| is finite exactly when every entry is (amax propagates NaN): 0.8 ms for the tiny model's
        # 39 tensors, where isfinite(g).all() per tensor took 5 ms
        peaks = [g.abs().amax() for g in grads]
        self.overflow = bool(peaks) and not bool(torch.isfinite(torch.stack(peaks)).all())
        if self.overflow:
            return None
        return base.step(self, closure)

    # a subclass rather than a patched attribute: torch's LR schedulers wrap ``step`` as a bound method
    optimizer.__class__ = type(f"NonFiniteGuarded{base.__name__}", (base,), {"step": step})
    optimizer.overflow = False
    return optimizer


class StepGuard:
    """Keeps non-finite losses out of the weights and counts the optimizer steps that were dropped.

    Per micro-batch call :meth:`backward` (instead of ``engine.backward``) and :meth:`step` (instead of
    ``engine.step``); once per training step call :meth:`end_step`, which returns the metrics and raises
    :class:`NonFiniteError` after ``max_skipped`` consecutive training steps with a dropped update
    (0: never stop)."""

    def __init__(self, max_skipped: int):
        self.max_skipped = max_skipped
        self.consecutive = 0
        self.total = 0
        self._dropped = 0  # optimizer steps dropped during the current training step
        self._bad: dict[str, int] = {}  # which quantity was non-finite (local to this rank)

    @property
    def dropped(self) -> int:
        """Optimizer updates dropped so far in the current training step."""
        return self._dropped

    def backward(self, engine, loss: torch.Tensor, what: str, drop: bool = False) -> None:
        """``engine.backward(loss)``; a non-finite loss (or ``drop``) is multiplied by NaN so its update is
        dropped (``drop``: the caller knows the window's data is bad, e.g. the actor dropped it)."""
        if what not in QUANTITIES:
            raise ValueError(f"unknown quantity {what!r}; one of {QUANTITIES}")
        if not bool(torch.isfinite(loss.detach()).all()):
            self._bad[what] = self._bad.get(what, 0) + 1
            drop = True
        if drop:
            loss = loss * float("nan")  # every gradient it reaches is NaN, even where ∂loss/∂θ is 0
        engine.backward(loss)

    def step(self, engine) -> None:
        before = engine.skipped_steps
        engine.step()
        self._dropped += engine.skipped_steps - before

    def end_step(self, step: int) -> dict:
        """Metrics of the training step just finished; raises after too many consecutive dropped steps."""
        bad, dropped = self._bad, self._dropped
        self._bad, self._dropped = {}, 0
        if not dropped:
            self.consecutive = 0
            return {"skipped_updates": 0.0, "skipped_steps_total": float(self.total)}
        # DeepSpeed dropped the update on every rank alike, so this all-reduce is reached by all of them; it
        # tells every rank which quantity was non-finite anywhere (one rank's NaN loss drops all ranks' step)
        counts = all_reduce_sum(torch.tensor([float(bad.get(q, 0)) for q in QUANTITIES]))
        what = ", ".join(f"{q} ({int(n)} micro-batches)" for q, n in zip(QUANTITIES, counts.tolist()) if n) \
            or "gradient norm"
        self.total += 1
        self.consecutive += 1
        log.warning("step %d: non-finite %s: dropped %d optimizer update(s) on every rank (%d step(s) in a row)",
                    step, what, dropped, self.consecutive)
        if self.max_skipped and self.consecutive >= self.max_skipped:
            raise NonFiniteError(
                f"step {step}: {self.consecutive} consecutive steps had a non-finite {what}; stopping "
                f"(--max_skipped_steps {self.max_skipped}). The last checkpoint is intact; check the data, lower "
                f"the learning rate, or train in fp32.")
        return {"skipped_updates": float(dropped), "skipped_steps_total": float(self.total)}
