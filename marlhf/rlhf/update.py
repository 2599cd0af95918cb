"""The PPO update: ``--ppo_epochs`` passes of clipped policy and value loss (+ ptx) over collected experience.

Without a critic (``--advantage_estimator rloo|grpo|reinforce``) there is no value loss; with
``--kl_penalty loss`` the policy loss gains β·KL (k3 per token, :func:`marlhf.rlhf.estimators.kl_loss`).

Losses are the pure functions of :mod:`marlhf.rlhf.ppo_math`; how each micro-batch's loss is weighted so an
optimizer step is a token mean over all its micro-batches on all ranks is :mod:`marlhf.utils.optim_step`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from marlhf.rlhf.estimators import kl_loss
from marlhf.rlhf.ppo_math import policy_loss, truncated_is_weights, value_loss
from marlhf.rlhf.rollout import Experience, critic_values, policy_logprobs
from marlhf.rlhf.sections import UpdateSection
from marlhf.utils.optim_step import StepGuard, loss_multipliers
from marlhf.utils.timing import NO_TIMER


def ppo_update(actor, critic, guard: StepGuard, exps: list[Experience], settings: UpdateSection,
               ptx_batches: Iterator[dict] | None = None, timer=NO_TIMER) -> dict:
    """``ppo_epochs`` passes over the experience in micro-batches of ``training_batch``; mean statistics.

    Every loss is a token mean over the whole optimizer step by default (``--loss_aggregation``,
    :mod:`marlhf.utils.optim_step`): the real tokens of each accumulation window are counted on all
    ranks before the first backward. The actor steps on the policy loss and, with ptx, once more on the
    ptx loss (DeepSpeed-Chat's order), so with ptx its micro-steps alternate policy / ptx. ``critic`` is None
    for the critic-free estimators: no value loss.  ``timer`` (:mod:`marlhf.utils.timing`) times each model's
    forward + backward + optimizer step as ``train/actor``, ``train/critic`` and ``train/ptx``."""
    s = settings
    G = s.batches.schedule.gradient_accumulation_steps
    plan = [mb for _ in range(s.batches.ppo_epochs) for exp in exps for mb in exp.split(s.batches.training_batch)]
    ptx = [next(ptx_batches) for _ in plan] if ptx_batches is not None else None
    per_actor = 2 if ptx is not None else 1  # actor micro-steps per micro-batch
    # one host transfer for all counts (no sync per micro-batch)
    tokens = [int(n) for n in torch.stack([mb.mask.sum() for mb in plan]).tolist()] if plan else []
    pl_mult = loss_multipliers(tokens, [per_actor * i // G for i in range(len(plan))], G, s.loss_aggregation)
    vl_mult = loss_multipliers(tokens, [i // G for i in range(len(plan))], G, s.loss_aggregation)
    if ptx:
        ptx_tokens = [int(n) for n in torch.stack([(b["labels"][:, 1:] != -100).sum() for b in ptx]).tolist()]
        ptx_mult = loss_multipliers(ptx_tokens, [(2 * i + 1) // G for i in range(len(plan))], G,
                                    s.loss_aggregation)
    totals: dict[str, torch.Tensor] = {}  # summed on the device, read once at the end
    for i, mb in enumerate(plan):
        if i % G == 0:
            dropped_before = guard.dropped  # the critic's window starts
        P = mb.prompt_width
        with timer("train/actor"):
            logprobs = policy_logprobs(actor, mb.seq, mb.attention_mask, P, s.policy.logprob_temperature)
            # no π_old from the rollout: no update has come since it (one epoch, one optimizer step), so it is
            # this forward's value (sections.needed_forwards)
            old = mb.logprobs if mb.logprobs is not None else logprobs.detach()
            weights, tis = None, {}
            if s.tis_cap > 0 and mb.engine_logprobs is not None:  # answers a generation engine sampled
                weights, tis = truncated_is_weights(old, mb.engine_logprobs, mb.mask, s.tis_cap)
            pl, pstats = policy_loss(logprobs, old, mb.advantages, mb.mask, s.cliprange, seg=mb.seg,
                                     ratio=s.policy_ratio, is_weights=weights)
            pstats.update(tis)
            if s.policy.kl_in_loss and mb.ref_logprobs is not None:  # GRPO's KL term (none when β = 0)
                kl = kl_loss(logprobs, mb.ref_logprobs, mb.mask)
                pstats["kl_loss"] = kl.detach()
                pl = pl + s.policy.kl_ctl * kl
            guard.backward(actor, pl * pl_mult[i], "actor loss")
            guard.step(actor)
        stats = {"actor_loss": pl.detach(), **pstats}
        if critic is not None:
            with timer("train/critic"):
                values = critic_values(critic, mb.seq, mb.attention_mask, P)
                vl, vstats = value_loss(values, mb.values, mb.returns, mb.mask, s.cliprange_value)
                # an actor update dropped in this window (non-finite advantages, any rank) drops the critic's
                # too: the step then skips that data as a whole
                actor_dropped = i % G == G - 1 and guard.dropped > dropped_before
                guard.backward(critic, vl * vl_mult[i], "critic loss", drop=actor_dropped)
                guard.step(critic)
            stats.update(critic_loss=vl.detach(), **vstats)
        if ptx is not None:
            with timer("train/ptx"):
                out = actor(**ptx[i], use_cache=False).loss
                guard.backward(actor, s.unsup_coef * out * ptx_mult[i], "ptx loss")
                guard.step(actor)
            stats["ptx_loss"] = out.detach()
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + torch.as_tensor(v, dtype=torch.float64, device=pl.device)
    if not totals:
        return {}
    means = (torch.stack(list(totals.values())) / len(plan)).tolist()
    return dict(zip(totals, means))
