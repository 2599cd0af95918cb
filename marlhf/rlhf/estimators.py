"""Critic-free advantage estimators — RLOO, GRPO (and Dr. GRPO), REINFORCE — as pure tensor functions.

The paper places MA-PPO between token-level PPO (n = 1) and the sequence-level methods RLOO (Ahmadian et
al., 2024), REINFORCE (Williams, 1992) and GRPO (Shao et al., 2024) (§3.2.3 "connection to previous methods", App.
C.3). Those baselines need no critic: the whole response is one action, scored once, and a baseline built
from other samples replaces the value function.

Layout (what :func:`marlhf.sampler.sample` returns with ``num_samples = K``): N = G·K rows, rows
i·K … i·K+K−1 answer prompt i (one *group*). A rank estimates advantages over the rows it generated itself,
before they are cut into micro-batches, so a group is never split by micro-batching or ranks; a batch that
holds a partial group is an error (:func:`groups`).

Per-token tensors are response-only (N, T) with right padding and ``mask`` (N, T) as in
:mod:`marlhf.rlhf.ppo_math`; ``valid`` (N,) marks rows that take part in the loss (the trainer masks out
empty and one-token answers): an invalid row gets advantage 0 and is left out of every baseline.

The sequence return of row i is R_i = clip(score_i) − β Σ_t (log π − log π_ref) with the KL penalty in the
reward (``kl_penalty="reward"``, the RLOO paper's and step 3's per-token penalty summed over the response,
equal to Σ_t of :func:`marlhf.rlhf.ppo_math.token_rewards`), or R_i = clip(score_i) with the KL as a loss
term (``kl_penalty="loss"``, GRPO's choice; :func:`kl_loss`). Its advantage A_i is broadcast to every token
of the response; macro actions compose through the policy ratio (``policy_ratio="macro"``: the ratio and
its clipping are per macro action, :func:`marlhf.rlhf.ppo_math.policy_loss`).

The estimators as run components (registered by name, each told whether it needs a critic) are in
:mod:`marlhf.rlhf.advantages`, where each also says which combinations with MA-PPO's options mean something
(:meth:`marlhf.rlhf.advantages.AdvantageEstimator.check`).
"""

from __future__ import annotations

import torch

from marlhf.rlhf.macro import check_choice, check_mask
from marlhf.rlhf.sections import KL_PENALTIES, kl_in_reward  # noqa: F401  (KL_PENALTIES: the flag's choices)

GRPO_NORMALIZATIONS = ("std", "none")


# --------------------------------------------------------------------------------------------------------
# groups
# --------------------------------------------------------------------------------------------------------
def groups(x: torch.Tensor, K: int) -> torch.Tensor:
    """(N,) → (G, K): row i·K + j is sample j of prompt i. A partial group (N not a multiple of K) means the
    batch was cut inside a group — its baseline would come from the wrong samples — so it is an error."""
    if K < 1:
        raise ValueError(f"group size K must be >= 1, got {K}")
    if x.dim() != 1:
        raise ValueError(f"expected a (N,) tensor of sequence scores, got shape {tuple(x.shape)}")
    N = x.shape[0]
    if N % K:
        whole = N - N % K
        raise ValueError(f"{N} rows do not form whole groups of K={K}: rows {whole}..{N - 1} are a partial "
                         f"group (a group's K samples must be generated and scored on one rank, together)")
    return x.reshape(N // K, K)


def _valid(valid: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
    if valid is None:
        return torch.ones_like(scores, dtype=torch.bool)
    if valid.shape != scores.shape:
        raise ValueError(f"valid: expected shape {tuple(scores.shape)}, got {tuple(valid.shape)}")
    return valid.bool()


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


# --------------------------------------------------------------------------------------------------------
# sequence-level advantages (N,)
# --------------------------------------------------------------------------------------------------------
def rloo_advantages(returns: torch.Tensor, K: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: A_i = R_i − mean of the *other* valid samples of i's group (Ahmadian et al., 2024, eq. 7).

    The baseline does not depend on sample i, so the estimate stays unbiased. A row with no valid
    group-mate has no baseline and gets 0 (so does an invalid row). Returns (N,)."""
    R = _float(returns)
    v = _valid(valid, R)
    Rg, vg = groups(R, K), groups(v, K)  # (G, K)
    Rg = torch.where(vg, Rg, 0.0)
    n = vg.sum(dim=1, keepdim=True)  # (G, 1) valid samples per group
    others = (Rg.sum(dim=1, keepdim=True) - Rg) / (n - 1).clamp(min=1)  # (G, K) leave-one-out mean
    A = torch.where(vg & (n >= 2), Rg - others, 0.0)
    return A.reshape(-1)


def grpo_advantages(returns: torch.Tensor, K: int, valid: torch.Tensor | None = None,
                    normalization: str = "std", eps: float = 1e-4) -> torch.Tensor:
    """GRPO outcome advantages: A_i = (R_i − mean_g) / (std_g + eps) over the valid samples of the group
    (Shao et al., 2024, §4.1.2; std with Bessel's correction, as torch.std and the released GRPO code).

    ``normalization="none"`` is Dr. GRPO (Liu et al., 2025): A_i = R_i − mean_g, without the division that
    up-weights groups whose samples barely differ. A group with fewer than two valid samples gets 0."""
    check_choice("grpo normalization", normalization, GRPO_NORMALIZATIONS)
    R = _float(returns)
    v = _valid(valid, R)
    Rg, vg = groups(R, K), groups(v, K)  # (G, K)
    Rg = torch.where(vg, Rg, 0.0)
    n = vg.sum(dim=1, keepdim=True)  # (G, 1)
    mean = Rg.sum(dim=1, keepdim=True) / n.clamp(min=1)  # (G, 1)
    centred = torch.where(vg, Rg - mean, 0.0)  # (G, K)
    A = centred
    if normalization == "std":
        std = (centred.pow(2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # (G, 1)
        A = centred / (std + eps)
    A = torch.where(vg & (n >= 2), A, 0.0)
    return A.reshape(-1)


def reinforce_advantages(returns: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline: A_i = R_i − mean of the valid rows of this batch (Williams,
    1992). Including R_i in its own baseline scales the expected gradient by (1 − 1/N), a constant, and
    keeps the estimator one line; groups play no part. Returns (N,), 0 on invalid rows."""
    R = _float(returns)
    v = _valid(valid, R)
    mean = torch.where(v, R, 0.0).sum() / v.sum().clamp(min=1)
    return torch.where(v, R - mean, 0.0)


# --------------------------------------------------------------------------------------------------------
# returns, broadcast, KL loss
# --------------------------------------------------------------------------------------------------------
def sequence_returns(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                     mask: torch.Tensor, kl_ctl: float, clip_reward_value: float | None,
                     kl_penalty: str = "reward") -> torch.Tensor:
    """R_i = clip(score_i, ±c) − β Σ_{t real} (log π − log π_ref) (``kl_penalty="reward"``: the sum of step 3's
    per-token rewards over the response), or clip(score_i, ±c) (``"loss"``: the KL is a loss term). (N,)."""
    in_reward = kl_in_reward(kl_penalty)
    m = check_mask(mask)  # (N, T)
    s = _float(scores).reshape(-1)
    if s.shape[0] != m.shape[0]:
        raise ValueError(f"scores: expected shape ({m.shape[0]},), got {tuple(scores.shape)}")
    if clip_reward_value is not None:
        s = s.clamp(-clip_reward_value, clip_reward_value)
    if not in_reward:
        return s
    kl = torch.where(m, _float(logprobs) - _float(ref_logprobs), 0.0).sum(dim=1)  # (N,)
    return s - kl_ctl * kl.to(s.dtype)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_i on every real token of response i, 0 on padding: (N,) → (N, T)."""
    m = check_mask(mask)
    return torch.where(m, advantages[:, None], 0.0)


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked token mean of the k3 estimator exp(d) − d − 1, d = log π_ref − log π: a non-negative, unbiased
    estimate of KL(π ‖ π_ref) per token with a gradient through log π (GRPO, Shao et al., 2024, eq. 4).
    Padding never reaches the value or the gradient."""
    m = check_mask(mask)
    d = torch.where(m, _float(ref_logprobs) - _float(logprobs), 0.0)  # (N, T)
    k3 = torch.expm1(d) - d  # (N, T) 0 on padding
    return k3.sum() / m.sum().clamp(min=1)
