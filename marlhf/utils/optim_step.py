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
DeepSpeed's bf16 optimizer check the (all-reduced) gradient norm themselves (every stage and dtype from
DeepSpeed 0.19.8, the version pinned: before it fp32 ZeRO-1/2 and ZeRO-3 did not), and the plain optimizer of
ZeRO 0 / fp32 gets the same check from :func:`guard_optimizer`.  A dropped step changes nothing: no weight,
no Adam moment and no learning-rate step, exactly as if that batch had not been there.  :class:`StepGuard`
counts the drops and stops the run after ``--max_skipped_steps`` consecutive ones; a step with a non-finite
loss that DeepSpeed applied anyway stops the run at once.  Under fp16 a dropped step whose losses were all
finite is a loss-scale overflow: counted apart (``overflow_steps``), never toward the limit, and it does not
drop the critic's update.
"""

from __future__ import annotations

import logging

import torch

from marlhf.errors import NonFiniteError
from marlhf.utils import dist

log = logging.getLogger("marlhf")

LOSS_AGGREGATIONS = ("token_mean", "microbatch_mean")
QUANTITIES = ("loss", "actor loss", "critic loss", "ptx loss")  # what StepGuard.backward may be told


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
    totals = all_reduce_sum(totals).tolist()
    scale = dist.world_size() * grad_accum
    return [c * scale / max(totals[w], 1.0) for c, w in zip(counts, windows)]


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of a small tensor over all ranks: on the CPU when reduced, as given on a single rank (a device
    tensor stays there, so reading the result is the one host transfer)."""
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
    (0: never stop).

    Nothing here reads a device value per micro-batch: the finiteness of each loss stays a device tensor
    (the NaN factor is applied on the device), and :meth:`end_step` reads everything it needs in one
    all-reduce and one host transfer per training step.  Only an fp16 engine's dropped step costs one more
    collective, to tell a loss-scale overflow (routine: the scaler halves and retries) from a non-finite loss."""

    def __init__(self, max_skipped: int):
        self.max_skipped = max_skipped
        self.consecutive = 0
        self.total = 0
        self.total_overflow = 0
        self._dropped = 0  # optimizer updates dropped for a non-finite loss or gradient, this training step
        self._bad: dict[str, torch.Tensor] = {}  # quantity -> non-finite micro-batches (this rank, on device)
        self._window: dict[int, torch.Tensor] = {}  # engine -> its open window saw a non-finite / dropped loss
        self._windows: list[tuple[torch.Tensor | None, str]] = []  # per optimizer step: flag, what DeepSpeed did

    @property
    def dropped(self) -> int:
        """Optimizer updates dropped so far in the current training step for a non-finite loss or gradient (a
        fp16 loss-scale overflow not counted)."""
        return self._dropped

    def backward(self, engine, loss: torch.Tensor, what: str, drop: bool = False) -> None:
        """``engine.backward(loss)``; a non-finite loss (or ``drop``) is multiplied by NaN so its update is
        dropped (``drop``: the caller knows the window's data is bad, e.g. the actor dropped it)."""
        if what not in QUANTITIES:
            raise ValueError(f"unknown quantity {what!r}; one of {QUANTITIES}")
        nonfinite = ~torch.isfinite(loss.detach()).all()
        self._bad[what] = self._bad.get(what, 0) + nonfinite.to(torch.int32)
        bad = nonfinite | drop
        # every gradient the NaN reaches is NaN, even where ∂loss/∂θ is 0; 1.0 leaves a good loss exact
        loss = loss * torch.where(bad, float("nan"), 1.0).to(loss.dtype)
        key = id(engine)
        self._window[key] = bad if key not in self._window else self._window[key] | bad
        engine.backward(loss)

    def step(self, engine) -> None:
        boundary = engine.is_gradient_accumulation_boundary() \
            if hasattr(engine, "is_gradient_accumulation_boundary") else True
        before = engine.skipped_steps
        engine.step()
        if not boundary:
            return
        flag = self._window.pop(id(engine), None)
        if engine.skipped_steps == before:
            self._windows.append((flag, "applied"))
            return
        fp16 = bool(engine.fp16_enabled()) if hasattr(engine, "fp16_enabled") else False
        # DeepSpeed drops a step on every rank alike, so all ranks reach this collective together
        if fp16 and not (flag is not None and all_reduce_sum(flag.float().reshape(1)).item() > 0):
            self._windows.append((flag, "overflow"))  # finite losses everywhere: the loss scale overflowed
            return
        self._windows.append((flag, "dropped"))
        self._dropped += 1

    def end_step(self, step: int) -> dict:
        """Metrics of the training step just finished; raises after too many consecutive dropped steps, or at
        once if a step with a non-finite loss was applied (a DeepSpeed whose optimizer does not check)."""
        bad, windows = self._bad, self._windows
        self._bad, self._windows, self._window, dropped = {}, [], {}, self._dropped
        self._dropped = 0
        # one all-reduce, one host transfer: non-finite micro-batches per quantity and each window's flag, summed
        # over the ranks (one rank's NaN loss drops every rank's step)
        parts = [bad.get(q, 0) for q in QUANTITIES] + [0 if f is None else f for f, _ in windows]
        dev = next((t.device for t in parts if torch.is_tensor(t)), torch.device("cpu"))
        sums = all_reduce_sum(torch.stack([torch.as_tensor(t, dtype=torch.float32, device=dev).reshape(())
                                           for t in parts])).tolist()
        counts, flags = sums[:len(QUANTITIES)], sums[len(QUANTITIES):]
        applied_bad = sum(1 for n, (_, did) in zip(flags, windows) if n > 0 and did == "applied")
        overflow = sum(1 for _, did in windows if did == "overflow")
        self.total_overflow += overflow
        if applied_bad:
            import deepspeed

            raise NonFiniteError(
                f"step {step}: {applied_bad} optimizer step(s) with a non-finite loss were applied: this DeepSpeed "
                f"({deepspeed.__version__}) did not check the gradient for this ZeRO stage and dtype, and the "
                f"weights now hold NaN. The last checkpoint is intact; install deepspeed>=0.19.8 (the version "
                f"the tests ran) and resume.")
        metrics = {"skipped_updates": float(dropped), "overflow_steps": float(overflow)}
        if not dropped:
            self.consecutive = 0
            return {**metrics, "skipped_steps_total": float(self.total)}
        what = ", ".join(f"{q} ({int(n)} micro-batches)" for q, n in zip(QUANTITIES, counts) if n) \
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
        return {**metrics, "skipped_steps_total": float(self.total)}
