"""MA-PPO maths as pure tensor functions (MA-RLHF paper §3.2.2, App. E): token rewards, macro GAE, losses.

All per-token tensors are response-only (B, T) with right padding and ``mask`` (B, T); macro tensors are
(B, M) with ``macro_mask``. Nothing here loops over tokens, macro actions or samples. Statistics are
returned as detached 0-dim tensors so the caller decides when to synchronise (``.item()``).
"""

from __future__ import annotations

import torch

from marlhf.rlhf.macro import (
    REWARD_MODES,
    SIGMAS,
    check_choice,
    check_mask,
    macro_batch,
    macro_rewards,
    macro_values,
    num_macros,
    segment_sum,
    to_tokens,
)

RATIOS = ("token", "macro")


def _real(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x in float32 (or wider) with padding set to 0 BEFORE any arithmetic: a NaN / inf in padding would
    otherwise reach the gradient (torch.where passes 0 · ∂f = 0 · NaN = NaN back through the unused branch),
    and bf16 callers get the same numbers as fp32 ones."""
    return torch.where(m, x.to(torch.promote_types(x.dtype, torch.float32)), 0.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over real entries (0 when there are none, so an empty batch cannot produce NaN)."""
    m = mask.bool()
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def token_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    score: torch.Tensor,
    kl_ctl: float,
    clip_reward_value: float | None,
) -> torch.Tensor:
    """Per-token reward r_t = -β(log π - log π_ref), plus clip(score, ±c) on each sample's last real token.

    docs/design.md "Data flow"; samples with no response tokens receive nothing. Returns (B, T) float32
    (or wider), 0 on padding.
    """
    m = check_mask(mask)  # (B, T)
    r = -kl_ctl * (_real(logprobs, m) - _real(ref_logprobs, m))  # (B, T)
    s = score.to(torch.promote_types(r.dtype, score.dtype)).reshape(-1)  # (B,)
    if s.shape[0] != m.shape[0]:
        raise ValueError(f"score: expected shape ({m.shape[0]},), got {tuple(score.shape)}")
    if clip_reward_value is not None:
        s = s.clamp(-clip_reward_value, clip_reward_value)
    k = torch.arange(m.shape[1], device=m.device)  # (T,)
    last = (k[None, :] == (m.sum(dim=1) - 1)[:, None]) & m  # (B, T) one-hot, empty rows all False
    return r + torch.where(last, s[:, None], 0.0)  # (B, T)


def discount_matrix(M: int, gamma_lam: float, device: torch.device | None = None) -> torch.Tensor:
    """Upper-triangular D[i, j] = (γλ)^(j-i) for j >= i, float64 (M, M).

    With γλ <= 1 every entry is in [0, 1], so unlike the "divide by (γλ)^t, cumsum, multiply back" trick
    nothing under- or overflows.
    """
    i = torch.arange(M, device=device)
    e = i[None, :] - i[:, None]  # (M, M) j - i
    powers = torch.pow(torch.tensor(float(gamma_lam), dtype=torch.float64, device=device), i.double())  # (M,)
    return torch.where(e >= 0, powers[e.clamp(min=0)], 0.0)  # (M, M) Toeplitz lookup, not M² pow calls


def gae(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over macro steps (§3.2.2; token-level PPO is the case of one token per step).

    δ_τ = R_τ + γ V_{τ+1} - V_τ with V = 0 after a sample's last step; A_τ = Σ_l (γλ)^l δ_{τ+l};
    returns Q_τ = A_τ + V_τ. Vectorised as A = δ Dᵀ with the discount matrix D (float64): O(B·M²) flops
    and O(M²) memory — 64 × 512² ≈ 17 M multiply-adds for token-level PPO at T = 512. ``lam`` may be a (B,)
    tensor, one λ per sample (the length-adaptive λ of :func:`adaptive_lam`): then D is per sample, O(B·M²)
    memory. Inputs (B, M), outputs (B, M), 0 on padding.
    """
    per_sample = torch.is_tensor(lam)
    lam_values = lam.double() if per_sample else torch.tensor([float(lam)], dtype=torch.float64)
    if not (0.0 <= gamma <= 1.0 and bool(((lam_values >= 0) & (lam_values <= 1)).all())):
        raise ValueError(f"gamma={gamma} and lam={lam} must lie in [0, 1]")
    m = mask.bool()  # (B, M)
    out_dtype = torch.promote_types(values.dtype, torch.float32)
    V = torch.where(m, values.double(), 0.0)  # (B, M)
    R = torch.where(m, rewards.double(), 0.0)  # (B, M)
    V_next = torch.cat([V[:, 1:], V.new_zeros(V.shape[0], 1)], dim=1)  # (B, M) 0 past the last step
    delta = torch.where(m, R + gamma * V_next - V, 0.0)  # (B, M)
    if per_sample:
        if lam.shape != (m.shape[0],):
            raise ValueError(f"lam: a tensor of one λ per sample, shape ({m.shape[0]},), got {tuple(lam.shape)}")
        M = m.shape[1]
        i = torch.arange(M, device=m.device)
        e = (i[None, :] - i[:, None]).double()  # (M, M) j - i
        base = (gamma * lam_values.to(m.device))[:, None, None]  # (B, 1, 1)
        D = torch.where(e >= 0, base ** e.clamp(min=0), 0.0)  # (B, M, M) D[b, i, j] = (γλ_b)^(j-i)
        A = torch.einsum("bij,bj->bi", D, delta)  # (B, M)
    else:
        D = discount_matrix(m.shape[1], gamma * float(lam), m.device)  # (M, M)
        A = delta @ D.T  # (B, M) A[b, i] = Σ_j D[i, j] δ[b, j]
    A = torch.where(m, A, 0.0)
    Q = torch.where(m, A + V, 0.0)  # (B, M)
    return A.to(out_dtype), Q.to(out_dtype)


def adaptive_lam(num_macros: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive λ (2025) over macro actions: λ_b = 1 − 1/(α·L_b), L_b the sample's number of macro
    actions, clamped to [0, 1] (an answer with α·L_b ≤ 1 gets λ = 0: a one-step TD advantage).  A long answer
    keeps λ near 1, so its first action still sees the final reward; a short one leans on the critic."""
    if not alpha > 0:
        raise ValueError(f"adaptive λ: alpha must be > 0, got {alpha}")
    L = num_macros.double()
    return torch.where(L > 0, 1.0 - 1.0 / (alpha * L.clamp(min=1)), 0.0).clamp(0.0, 1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening over all real entries of the batch (unbiased variance); 0 on padding."""
    m = mask.bool()
    n = m.sum()
    mean = masked_mean(x, m)
    var = torch.where(m, (x - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
    w = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        w = w + mean
    return torch.where(m, w, torch.zeros_like(w))


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages_tok: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    seg: torch.Tensor | None = None,
    ratio: str = "token",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped policy loss with macro advantages broadcast to tokens (§3.2.2).

    ratio="token": r_t = exp(log π - log π_old) per token (the released code, default).
    ratio="macro": r_ω = exp(Σ_{t∈ω} (log π - log π_old)), the paper's π(ω|s)/π_old(ω|s), given to every
    token of ω (needs ``seg``). Either way the clipped objective is averaged over all real tokens of the
    batch. Stats (detached): clipfrac (share of tokens where clipping is active), approx_kl (mean
    per-token r - 1 - log r), ratio_mean.  ``is_weights`` (B, T): each token's term multiplied by its weight
    (the truncated importance-sampling correction of answers a generation engine sampled,
    :func:`truncated_is_weights`).
    """
    check_choice("ratio", ratio, RATIOS)
    m = mask.bool()  # (B, T)
    log_ratio = _real(logprobs, m) - _real(old_logprobs, m)  # (B, T) float32, 0 on padding
    advantages_tok = _real(advantages_tok, m)  # (B, T)
    if ratio == "macro":
        if seg is None:
            raise ValueError("policy_loss(ratio='macro') needs seg (B, T)")
        M = int(num_macros(seg).max()) if seg.shape[0] else 0
        lr = to_tokens(segment_sum(log_ratio, seg, M), seg)  # (B, T) log π(ω|s) - log π_old(ω|s)
    else:
        lr = log_ratio
    r = torch.exp(lr)  # (B, T)
    pg1 = -advantages_tok * r  # (B, T)
    pg2 = -advantages_tok * torch.clamp(r, 1.0 - clip_eps, 1.0 + clip_eps)  # (B, T)
    per_token = torch.maximum(pg1, pg2)
    if is_weights is not None:
        per_token = per_token * _real(is_weights, m).detach()
    loss = masked_mean(per_token, m)
    with torch.no_grad():
        tok_lr = log_ratio.detach()
        stats = {
            "clipfrac": masked_mean((pg2 > pg1).to(loss.dtype), m),
            "approx_kl": masked_mean(torch.expm1(tok_lr) - tok_lr, m),
            "ratio_mean": masked_mean(r.detach(), m),
        }
    return loss, stats


def truncated_is_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling (TIS) for answers sampled by a generation engine whose numbers differ from
    the actor's: w_t = min(π_old(a_t|s_t) / π_engine(a_t|s_t), C), C = ``cap``, per real token (B, T), 1 on
    padding, detached — the policy gradient is then an expectation under π_old although the tokens came from
    π_engine.  Stats: tis_weight_mean, tis_truncated (share of tokens where the cap binds)."""
    if not cap > 0:
        raise ValueError(f"the truncated importance-sampling cap must be > 0, got {cap}")
    m = mask.bool()
    ratio = torch.exp(_real(old_logprobs, m) - _real(engine_logprobs, m)).detach()  # (B, T), 1 on padding
    weights = torch.where(m, ratio.clamp(max=cap), torch.ones_like(ratio))
    stats = {"tis_weight_mean": masked_mean(weights, m), "tis_truncated": masked_mean((ratio > cap).float(), m)}
    return weights, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns_tok: torch.Tensor,
    mask: torch.Tensor,
    clip_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss 0.5·max((v - Q)², (clip(v, v_old ± c) - Q)²), masked mean over tokens (App. E).

    Every token of a macro action regresses onto the macro return Q broadcast to it.
    """
    m = mask.bool()  # (B, T)
    values, old_values, returns_tok = _real(values, m), _real(old_values, m), _real(returns_tok, m)  # (B, T)
    v_clip = torch.clamp(values, old_values - clip_value, old_values + clip_value)  # (B, T)
    l1 = (values - returns_tok) ** 2  # (B, T)
    l2 = (v_clip - returns_tok) ** 2  # (B, T)
    loss = 0.5 * masked_mean(torch.maximum(l1, l2), m)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((l2 > l1).to(loss.dtype), m)}
    return loss, stats


def _row_l2(x: torch.Tensor) -> torch.Tensor:
    """Mean over samples of the per-sample L2 norm (0 for an empty batch, not NaN)."""
    return x.double().pow(2).sum(dim=1).sqrt().sum() / max(x.shape[0], 1)


@torch.no_grad()  # advantages and returns are regression/weighting targets: never backpropagate into them
def compute_advantages(
    values: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    seg: torch.Tensor,
    sigma: str = "equal",
    reward_mode: str = "sum",
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_advantages: bool = False,
    lam_critic: float | None = None,
    adaptive_lam_alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Token values/rewards + segment ids → token advantages and returns (App. E, Algorithm 1).

    Macro values V(ω) = Σσ_i V_i, macro rewards R(ω) ("sum" = paper, "compat" = released code), GAE over
    macro steps, then A and Q broadcast to every token of their macro action; optional token-level
    whitening of A (tokens are what the loss averages over). The actor's advantages use ``lam`` — or, with
    ``adaptive_lam_alpha`` > 0, each sample's :func:`adaptive_lam` over its macro actions — and the critic's
    returns Q = A + V use ``lam_critic`` (None: ``lam``; when that is the actor's λ, one GAE; VAPO decouples them,
    λ_critic = 1 giving unbiased Monte-Carlo value targets). Returns adv_tok (B, T), returns_tok (B, T)
    and stats: adv_l2 / q_l2 (mean per-sample L2 norm over macro steps, the paper's Fig. 11), the same
    over tokens (adv_l2_tok / q_l2_tok), num_macros (mean per sample), macro_len (mean |ω|).
    """
    check_choice("value_function (sigma)", sigma, SIGMAS)
    check_choice("reward_mode", reward_mode, REWARD_MODES)
    m = check_mask(mask)  # (B, T)
    if seg.shape != m.shape or not bool(((seg >= 0) == m).all()):
        raise ValueError("seg: must have mask's shape and be >= 0 exactly on real tokens")
    macros = macro_batch(seg)
    V, macro_mask = macro_values(values, seg, m, sigma)  # (B, M), (B, M)
    R, _ = macro_rewards(rewards, seg, m, reward_mode, sigma)  # (B, M)
    actor_lam = adaptive_lam(macro_mask.sum(1), adaptive_lam_alpha) if adaptive_lam_alpha > 0 else lam
    A, Q = gae(V, R, macro_mask, gamma, actor_lam)  # (B, M), (B, M)
    critic_lam = lam if lam_critic is None else lam_critic
    if adaptive_lam_alpha > 0 or critic_lam != lam:
        _, Q = gae(V, R, macro_mask, gamma, critic_lam)  # the critic's targets with its own λ
    adv_tok = to_tokens(A, seg)  # (B, T)
    ret_tok = to_tokens(Q, seg)  # (B, T)
    with torch.no_grad():
        n_macro = macro_mask.sum()
        stats = {
            "adv_l2": _row_l2(A),
            "q_l2": _row_l2(Q),
            "adv_l2_tok": _row_l2(adv_tok),
            "q_l2_tok": _row_l2(ret_tok),
            "num_macros": macro_mask.sum().double() / max(macro_mask.shape[0], 1),
            "macro_len": macros.lengths.sum().double() / n_macro.clamp(min=1),
        }
    if whiten_advantages:
        adv_tok = whiten(adv_tok, m)
    return adv_tok, ret_tok, stats
