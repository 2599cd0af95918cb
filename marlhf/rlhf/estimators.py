"""Critic-free advantage estimators — RLOO, GRPO (and Dr. GRPO), REINFORCE — as pure tensor functions.

The paper places MA-PPO between token-level PPO (n = 1) and the sequence-level methods RLOO (Ahmadian et
al., 2024), REINFORCE (Williams, 1992) and GRPO (Shao et al., 2024) (§3.2.3 "connection to previous methods", App.
C.3). Those baselines need no critic: the whole response is one action, scored once, and a baseline built
from other samples replaces the value function.

Layout (what :func:`marlhf.generation.sample` returns with ``num_samples = K``): N = G·K rows, rows
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

Which combinations with MA-PPO's options mean something is decided in one place,
:func:`check_estimator_options`.
"""

from __future__ import annotations

import torch

from marlhf.rlhf.macro import check_choice, check_mask

ESTIMATORS = ("gae", "rloo", "grpo", "reinforce")
CRITIC_FREE = ("rloo", "grpo", "reinforce")
GROUP_ESTIMATORS = ("rloo", "grpo")  # need K ≥ 2 samples per prompt
KL_PENALTIES = ("reward", "loss")
GRPO_NORMALIZATIONS = ("std", "none")


def needs_critic(estimator: str) -> bool:
    """Only macro GAE learns a value function; the others build, load and save no critic."""
    check_choice("advantage_estimator", estimator, ESTIMATORS)
    return estimator == "gae"


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
    check_choice("kl_penalty", kl_penalty, KL_PENALTIES)
    m = check_mask(mask)  # (N, T)
    s = _float(scores).reshape(-1)
    if s.shape[0] != m.shape[0]:
        raise ValueError(f"scores: expected shape ({m.shape[0]},), got {tuple(scores.shape)}")
    if clip_reward_value is not None:
        s = s.clamp(-clip_reward_value, clip_reward_value)
    if kl_penalty == "loss":
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


@torch.no_grad()  # advantages weight the policy loss; never backpropagate into them
def critic_free_advantages(
    estimator: str,
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int,
    kl_ctl: float,
    clip_reward_value: float | None,
    kl_penalty: str = "reward",
    grpo_normalization: str = "std",
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Scores (N,) and log-probs (N, T) of one rank's experience batch → token advantages (N, T), the
    sequence returns (N,) and detached stats (adv_mean, adv_std, return_mean, zero_adv_frac: the share of
    valid rows whose advantage is 0 (|A| < 1e-6), e.g. groups where every sample scored the same)."""
    check_choice("advantage_estimator", estimator, CRITIC_FREE)
    R = sequence_returns(scores, logprobs, ref_logprobs, mask, kl_ctl, clip_reward_value, kl_penalty)  # (N,)
    if valid is None:
        valid = torch.ones_like(R, dtype=torch.bool)
    if estimator == "rloo":
        A = rloo_advantages(R, group_size, valid)
    elif estimator == "grpo":
        A = grpo_advantages(R, group_size, valid, grpo_normalization)
    elif estimator == "reinforce":
        groups(R, group_size)  # the batch still holds whole groups (a K > 1 run reads them together)
        A = reinforce_advantages(R, valid)
    else:  # pragma: no cover - check_choice above
        raise AssertionError(estimator)
    v = valid.bool()
    n = v.sum().clamp(min=1)
    A_v = torch.where(v, A, 0.0)
    mean = A_v.sum() / n
    stats = {
        "adv_mean": mean,
        "adv_std": (torch.where(v, A - mean, 0.0).pow(2).sum() / n).sqrt(),
        "return_mean": torch.where(v, R, 0.0).sum() / n,
        "zero_adv_frac": ((A.abs() < 1e-6) & v).sum().double() / n,
    }
    return broadcast_to_tokens(A, mask), R, stats


# --------------------------------------------------------------------------------------------------------
# which option combinations are meaningful
# --------------------------------------------------------------------------------------------------------
def check_estimator_options(
    *,
    estimator: str,
    num_samples_per_prompt: int,
    kl_penalty: str,
    grpo_normalization: str,
    policy_ratio: str,
    termination_changed: bool,
    value_function: str,
    macro_reward: str,
    gamma: float,
    lam_changed: bool,
    whiten_advantages: bool,
) -> None:
    """Reject combinations of ``--advantage_estimator`` with MA-PPO's options that would do nothing or
    something other than what they say. Raises :class:`marlhf.errors.ConfigError` naming the flags.

    Meaningful:
      gae        everything MA-PPO offers; K ≥ 1 samples per prompt; KL in the reward or as a loss term.
      rloo/grpo  K ≥ 2; KL in the reward (RLOO paper) or as a loss (GRPO paper); --policy_ratio token (the
                 standard methods) or macro: the response's advantage with the ratio and its clipping per
                 macro action of any termination rule (n = ∞ gives one sequence-level ratio).
      reinforce  as rloo, with K ≥ 1 (its baseline is the batch mean).
    Rejected for the critic-free estimators (there is no critic and the response is one action):
      --value_function other than equal (σ weights critic values), --macro_reward compat (it exists to keep
      the RM score out of a σ-average of values), --gamma ≠ 1 and --lam (discounting/GAE between steps of a
      response that is one step), a termination rule or n with --policy_ratio token (segments would be
      computed and never used), --whiten_advantages with grpo (already normalised per group).
    --grpo_normalization none is only meaningful with grpo.
    """
    from marlhf.errors import ConfigError

    for name, value, valid in (("advantage_estimator", estimator, ESTIMATORS),
                               ("kl_penalty", kl_penalty, KL_PENALTIES),
                               ("grpo_normalization", grpo_normalization, GRPO_NORMALIZATIONS)):
        if value not in valid:
            raise ConfigError(f"--{name} {value!r} is not one of {', '.join(valid)}")
    if num_samples_per_prompt < 1:
        raise ConfigError(f"--num_samples_per_prompt must be >= 1, got {num_samples_per_prompt}")
    if estimator in GROUP_ESTIMATORS and num_samples_per_prompt < 2:
        raise ConfigError(f"--advantage_estimator {estimator} needs --num_samples_per_prompt >= 2 (a sample's "
                          f"baseline comes from the other samples of its prompt), got {num_samples_per_prompt}")
    if grpo_normalization != "std" and estimator != "grpo":
        raise ConfigError(f"--grpo_normalization {grpo_normalization} only applies to --advantage_estimator grpo "
                          f"(got {estimator})")
    if estimator == "gae":
        return
    no_critic = f"--advantage_estimator {estimator} has no critic and treats the response as one action"
    if value_function != "equal":
        raise ConfigError(f"{no_critic}: --value_function {value_function} weights critic values inside a macro "
                          f"action and would do nothing; drop it")
    if macro_reward != "sum":
        raise ConfigError(f"{no_critic}: --macro_reward {macro_reward} keeps the last token apart for a critic's "
                          f"σ-average and would do nothing; drop it")
    if gamma != 1.0 or lam_changed:
        raise ConfigError(f"{no_critic}: --gamma/--lam discount between steps of a response; its return is the "
                          f"undiscounted sum (use --advantage_estimator gae for GAE)")
    if policy_ratio == "token" and termination_changed:
        raise ConfigError(f"{no_critic}: --termination_condition/--ngram only enter through the macro-level ratio; "
                          f"add --policy_ratio macro or drop them")
    if whiten_advantages and estimator == "grpo":
        raise ConfigError("--whiten_advantages with --advantage_estimator grpo: its advantages are already "
                          "normalised per group; drop one")
