"""MA-PPO maths (token rewards, macro GAE, losses) vs slow per-sample loop references (§3.2.2, App. E)."""

from __future__ import annotations

import math

import pytest
import torch
from maths_helpers import segments_for_rule

from marlhf.rlhf.macro import macro_rewards, macro_values, segments_from_starts
from marlhf.rlhf.ppo_math import (
    compute_advantages,
    gae,
    masked_mean,
    policy_loss,
    token_rewards,
    value_loss,
    whiten,
)

SEEDS = [0, 1, 2]


# ---------------------------------------------------------------- fixtures and loop references
def random_batch(seed: int, B: int = 8, T: int = 19, p_start: float = 0.4):
    """Right-padded batch with an empty, a 1-token and a full sample, random boundaries, float64 data."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, T + 1, (B,), generator=g).tolist()
    lens[0], lens[1], lens[2] = 0, 1, T
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lens):
        mask[b, :n] = True
    seg = segments_from_starts(torch.rand(B, T, generator=g) < p_start, mask)

    def rnd() -> torch.Tensor:
        return torch.randn(B, T, generator=g, dtype=torch.float64)

    return g, mask, lens, seg, rnd


def macros_of(seg_row: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for k, s in enumerate(seg_row):
        if s >= 0:
            if s == len(out):
                out.append([])
            out[s].append(k)
    return out


def ref_gae(V: list[float], R: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """One sample, reverse loop: δ_τ = R_τ + γV_{τ+1} - V_τ (V = 0 after the end), A_τ = δ_τ + γλA_{τ+1}."""
    A, last = [0.0] * len(V), 0.0
    for t in reversed(range(len(V))):
        nv = V[t + 1] if t + 1 < len(V) else 0.0
        last = R[t] + gamma * nv - V[t] + gamma * lam * last
        A[t] = last
    return A, [a + v for a, v in zip(A, V)]


def dschat_token_gae(values: torch.Tensor, rewards: torch.Tensor, gamma: float, lam: float):
    """DeepSpeed-Chat-style token GAE: one reverse loop over the padded time axis, padding zeroed."""
    T = values.shape[1]
    last = torch.zeros(values.shape[0], dtype=values.dtype)
    adv = []
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        last = delta + gamma * lam * last
        adv.append(last)
    adv = torch.stack(adv[::-1], dim=1)
    return adv, adv + values


# ---------------------------------------------------------------- token rewards
@pytest.mark.parametrize("seed", SEEDS)
def test_token_rewards_match_loop(seed):
    g, mask, lens, _, rnd = random_batch(seed)
    lp, ref = rnd(), rnd()
    score = torch.randn(8, generator=g, dtype=torch.float64) * 4
    r = token_rewards(lp, ref, mask, score, kl_ctl=0.1, clip_reward_value=2.5)
    for b, n_b in enumerate(lens):
        exp = [-0.1 * (float(lp[b, k]) - float(ref[b, k])) for k in range(n_b)] + [0.0] * (19 - n_b)
        if n_b:
            exp[n_b - 1] += max(-2.5, min(2.5, float(score[b])))
        torch.testing.assert_close(r[b], torch.tensor(exp, dtype=torch.float64), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- GAE
def test_gae_hand_example():
    # V = [1, 2], R = [0.5, 1], γ = 1, λ = 0.5: δ = [0.5 + 2 - 1, 1 + 0 - 2] = [1.5, -1];
    # A_1 = -1, A_0 = 1.5 + 0.5·(-1) = 1.0; Q = A + V = [2, 1]. Second row: padding after one step.
    V = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    R = torch.tensor([[0.5, 1.0], [1.0, 9.0]])
    mm = torch.tensor([[True, True], [True, False]])
    A, Q = gae(V, R, mm, gamma=1.0, lam=0.5)
    torch.testing.assert_close(A, torch.tensor([[1.0, -1.0], [-2.0, 0.0]]))
    torch.testing.assert_close(Q, torch.tensor([[2.0, 1.0], [1.0, 0.0]]))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.7, 0.0)])
def test_gae_matches_loop(seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    B, M = 7, 15
    n = torch.randint(0, M + 1, (B,), generator=g).tolist()
    n[0], n[1] = 0, 1
    mm = torch.arange(M)[None, :] < torch.tensor(n)[:, None]
    V = torch.randn(B, M, generator=g, dtype=torch.float64)
    R = torch.randn(B, M, generator=g, dtype=torch.float64)
    A, Q = gae(V, R, mm, gamma, lam)
    for b, n_b in enumerate(n):
        ra, rq = ref_gae(V[b, :n_b].tolist(), R[b, :n_b].tolist(), gamma, lam)
        exp_a = torch.tensor(ra + [0.0] * (M - n_b), dtype=torch.float64)
        exp_q = torch.tensor(rq + [0.0] * (M - n_b), dtype=torch.float64)
        torch.testing.assert_close(A[b], exp_a, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(Q[b], exp_q, rtol=1e-12, atol=1e-12)


def test_gae_rejects_bad_discount():
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.5, lam=0.9)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sigma,mode", [("equal", "sum"), ("unit", "sum"), ("position", "sum"),
                                        ("equal", "compat"), ("position", "compat")])
def test_compute_advantages_matches_loop(seed, sigma, mode):
    """Whole pipeline: macro values/rewards → per-sample GAE loop → broadcast to tokens."""
    _, mask, _, seg, rnd = random_batch(seed)
    values, rewards = rnd(), rnd()
    adv, ret, stats = compute_advantages(values, rewards, mask, seg, sigma, mode, gamma=0.95, lam=0.9)
    V, _ = macro_values(values, seg, mask, sigma)
    R, _ = macro_rewards(rewards, seg, mask, mode, sigma)
    l2a, l2q = [], []
    for b, row in enumerate(seg.tolist()):
        nm = len(macros_of(row))
        ra, rq = ref_gae(V[b, :nm].tolist(), R[b, :nm].tolist(), 0.95, 0.9)
        exp_a = [ra[s] if s >= 0 else 0.0 for s in row]
        exp_q = [rq[s] if s >= 0 else 0.0 for s in row]
        torch.testing.assert_close(adv[b], torch.tensor(exp_a, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ret[b], torch.tensor(exp_q, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        l2a.append(math.sqrt(sum(a * a for a in ra)))
        l2q.append(math.sqrt(sum(q * q for q in rq)))
    assert abs(float(stats["adv_l2"]) - sum(l2a) / len(l2a)) < 1e-10
    assert abs(float(stats["q_l2"]) - sum(l2q) / len(l2q)) < 1e-10
    n_macros = [len(macros_of(r)) for r in seg.tolist()]
    assert abs(float(stats["num_macros"]) - sum(n_macros) / len(n_macros)) < 1e-12
    assert abs(float(stats["macro_len"]) - int(mask.sum()) / sum(n_macros)) < 1e-12


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("compat", [False, True])
def test_n1_equals_token_level_ppo(seed, compat):
    """n = 1 is vanilla PPO (§3.2.3): identical to a DeepSpeed-Chat-style per-token reverse GAE loop."""
    _, mask, _, _, rnd = random_batch(seed)
    values = torch.where(mask, rnd(), 0.0)
    rewards = torch.where(mask, rnd(), 0.0)
    seg = segments_for_rule("fixed", mask, ngram=1, split_last=compat)
    for sigma in ("equal", "unit", "position"):
        adv, ret, _ = compute_advantages(values, rewards, mask, seg, sigma, "compat" if compat else "sum",
                                         gamma=1.0, lam=0.95)
        ref_a, ref_q = dschat_token_gae(values, rewards, 1.0, 0.95)
        torch.testing.assert_close(adv[mask], ref_a[mask], rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(ret[mask], ref_q[mask], rtol=1e-13, atol=1e-13)
        assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_infinite_ngram_is_bandit(seed):
    """n = ∞ (§3.2.3): one macro action, A = Σ r - V(ω) for every token (γ = 1), returns = Σ r."""
    _, mask, lens, _, rnd = random_batch(seed)
    values, rewards = rnd(), rnd()
    seg = segments_for_rule("fixed", mask, ngram=math.inf)
    adv, ret, stats = compute_advantages(values, rewards, mask, seg, "equal", "sum", gamma=1.0, lam=0.95)
    for b, n_b in enumerate(lens):
        if n_b:
            total = float(rewards[b, :n_b].sum())
            v = float(values[b, :n_b].mean())
            torch.testing.assert_close(adv[b, :n_b], torch.full((n_b,), total - v, dtype=torch.float64))
            torch.testing.assert_close(ret[b, :n_b], torch.full((n_b,), total, dtype=torch.float64))
    assert abs(float(stats["num_macros"]) - sum(1 for n in lens if n) / len(lens)) < 1e-12


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rule", ["fixed", "ppl", "word"])
def test_batch_invariance(seed, rule):
    """A sample's advantages/returns are identical alone (trimmed to its own length) and inside a batch."""
    g, mask, lens, _, rnd = random_batch(seed)
    values, rewards, ref_lp = rnd(), rnd(), -rnd().abs()
    ids = torch.randint(0, 30, (8, 19), generator=g)
    table = torch.rand(30, generator=g) < 0.4
    kw = {"ngram": 3, "ref_logprobs": ref_lp, "input_ids": ids, "word_start_table": table}
    seg = segments_for_rule(rule, mask, **kw)
    adv, ret, _ = compute_advantages(values, rewards, mask, seg, "position", "sum", 1.0, 0.95)
    for b, n_b in enumerate(lens):
        sl = slice(b, b + 1)
        kw1 = dict(kw, ref_logprobs=ref_lp[sl, :n_b], input_ids=ids[sl, :n_b])
        seg1 = segments_for_rule(rule, mask[sl, :n_b], **kw1)
        assert torch.equal(seg1[0], seg[b, :n_b])
        a1, q1, _ = compute_advantages(values[sl, :n_b], rewards[sl, :n_b], mask[sl, :n_b], seg1, "position",
                                       "sum", 1.0, 0.95)
        torch.testing.assert_close(a1[0], adv[b, :n_b], rtol=0, atol=1e-13)
        torch.testing.assert_close(q1[0], ret[b, :n_b], rtol=0, atol=1e-13)


def test_whiten():
    _, mask, _, seg, rnd = random_batch(4)
    x = rnd() * 3 + 2
    w = whiten(x, mask)
    n = int(mask.sum())
    assert abs(float(w[mask].mean())) < 1e-12
    assert abs(float(w[mask].std(unbiased=True)) - 1.0) < 1e-6
    assert torch.all(w[~mask] == 0)
    w2 = whiten(x, mask, shift_mean=False)
    assert abs(float(w2[mask].mean()) - float(x[mask].mean())) < 1e-12
    assert n > 2
    adv, _, _ = compute_advantages(x, rnd(), mask, seg, whiten_advantages=True)
    assert abs(float(adv[mask].mean())) < 1e-12 and torch.all(adv[~mask] == 0)


def test_compute_advantages_checks_seg():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    bad = torch.tensor([[0, 0, 0]])
    with pytest.raises(ValueError, match="seg"):
        compute_advantages(torch.zeros(1, 3), torch.zeros(1, 3), mask, bad)
    with pytest.raises(ValueError, match="sum, compat"):
        good = torch.tensor([[0, 0, -1]])
        compute_advantages(torch.zeros(1, 3), torch.zeros(1, 3), mask, good, "equal", "x")


# ---------------------------------------------------------------- losses
def ref_policy_loss(lp, old, adv, seg, eps, ratio, weights=None):
    """Per sample, per macro action: the clipped surrogate (times the token's importance weight, when given)
    summed over tokens, / number of real tokens."""
    total, count = 0.0, 0
    for b, row in enumerate(seg.tolist()):
        for w in macros_of(row):
            macro_lr = sum(float(lp[b, k]) - float(old[b, k]) for k in w)
            for k in w:
                r = math.exp(macro_lr if ratio == "macro" else float(lp[b, k]) - float(old[b, k]))
                a = float(adv[b, k])
                weight = 1.0 if weights is None else float(weights[b, k])
                total += weight * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
                count += 1
    return total / max(count, 1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ratio", ["token", "macro"])
def test_truncated_importance_weights_and_their_loss_match_loop(seed, ratio):
    """TIS for a generation engine's answers: w_t = min(π_old / π_engine, C) per real token, and the policy loss
    with each token's term times w_t — against loops over the tokens."""
    from marlhf.rlhf.ppo_math import truncated_is_weights

    _, mask, _, seg, rnd = random_batch(seed)
    old, cap = rnd(), 1.5
    engine = old + 0.5 * rnd()  # some ratios beyond the cap, some below 1
    lp = old + 0.3 * rnd()
    adv = torch.where(mask, rnd(), 0.0)
    weights, stats = truncated_is_weights(old, torch.where(mask, engine, -1e4), mask, cap)  # padding: no effect
    B, T = mask.shape
    ref = [[min(math.exp(float(old[b, t]) - float(engine[b, t])), cap) if mask[b, t] else 1.0 for t in range(T)]
           for b in range(B)]
    assert torch.allclose(weights, torch.tensor(ref, dtype=weights.dtype), atol=1e-6)
    real = [(b, t) for b in range(B) for t in range(T) if mask[b, t]]
    above = sum(math.exp(float(old[b, t]) - float(engine[b, t])) > cap for b, t in real)
    assert float(stats["tis_truncated"]) == pytest.approx(above / len(real)) and 0 < above < len(real)
    assert float(stats["tis_weight_mean"]) == pytest.approx(sum(ref[b][t] for b, t in real) / len(real))
    loss, _ = policy_loss(lp, old, adv, mask, 0.2, seg=seg, ratio=ratio, is_weights=weights)
    assert abs(float(loss) - ref_policy_loss(lp, old, adv, seg, 0.2, ratio, weights)) < 1e-9
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(old, engine, mask, 0.0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ratio", ["token", "macro"])
def test_policy_loss_matches_loop(seed, ratio):
    _, mask, _, seg, rnd = random_batch(seed)
    old = rnd()
    lp = old + 0.3 * rnd()  # some ratios beyond 1 ± ε, some inside
    adv = torch.where(mask, rnd(), 0.0)
    lp_pad = torch.where(mask, lp, 50.0)  # padding garbage must not matter
    loss, stats = policy_loss(lp_pad, old, adv, mask, 0.2, seg=seg, ratio=ratio)
    assert abs(float(loss) - ref_policy_loss(lp, old, adv, seg, 0.2, ratio)) < 1e-12
    assert 0.0 < float(stats["clipfrac"]) < 1.0
    tok = (lp - old)[mask]
    assert abs(float(stats["approx_kl"]) - float((tok.exp() - 1 - tok).mean())) < 1e-12
    assert not stats["approx_kl"].requires_grad


def test_policy_loss_hand_example():
    # One sample, two tokens, one macro action, A = 1, ε = 0.2, log-ratios 0.1 and 0.2.
    # token: r = e^0.1 = 1.105 (unclipped), e^0.2 = 1.221 → clipped to 1.2; loss = -(1.10517 + 1.2)/2.
    # macro: r = e^0.3 = 1.35 → clipped to 1.2 for both tokens; loss = -1.2.
    lp = torch.tensor([[0.1, 0.2]])
    old = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    seg = torch.tensor([[0, 0]])
    loss_t, st = policy_loss(lp, old, adv, mask, 0.2, seg, "token")
    assert abs(float(loss_t) + (math.exp(0.1) + 1.2) / 2) < 1e-6 and abs(float(st["clipfrac"]) - 0.5) < 1e-7
    loss_m, st = policy_loss(lp, old, adv, mask, 0.2, seg, "macro")
    assert abs(float(loss_m) + 1.2) < 1e-6 and float(st["clipfrac"]) == 1.0


@pytest.mark.parametrize("ratio", ["token", "macro"])
def test_policy_loss_gradients(ratio):
    """Autograd vs finite differences (gradcheck) and vs the analytic gradient of the surrogate."""
    _, mask, _, seg, rnd = random_batch(7)
    old = rnd()
    adv = torch.where(mask, rnd(), 0.0)
    lp = (old + 0.3 * rnd()).requires_grad_(True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return policy_loss(x, old, adv, mask, 0.2, seg=seg, ratio=ratio)[0]

    assert torch.autograd.gradcheck(f, (lp,), eps=1e-6, atol=1e-7)
    f(lp).backward()
    # analytic: d/dlogπ_t of max(-A r, -A clip(r)) is -A r where the unclipped term is active, else 0;
    # with the macro ratio every token of ω shares r_ω and receives Σ over ω's tokens of that term.
    n = int(mask.sum())
    exp = torch.zeros_like(old)
    for b, row in enumerate(seg.tolist()):
        for w in macros_of(row):
            lr = [float(lp.detach()[b, k] - old[b, k]) for k in w]
            if ratio == "token":
                for k, x in zip(w, lr):
                    r, a = math.exp(x), float(adv[b, k])
                    exp[b, k] = -a * r / n if -a * r >= -a * min(max(r, 0.8), 1.2) else 0.0
            else:
                r = math.exp(sum(lr))
                g_ = sum(-float(adv[b, k]) * r for k in w if -float(adv[b, k]) * r >= -float(adv[b, k])
                         * min(max(r, 0.8), 1.2))
                for k in w:
                    exp[b, k] = g_ / n
    torch.testing.assert_close(lp.grad, exp, rtol=1e-10, atol=1e-12)
    assert torch.all(lp.grad[~mask] == 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_loop(seed):
    _, mask, lens, _, rnd = random_batch(seed)
    old, ret = rnd(), rnd()
    v = (old + 0.5 * rnd()).requires_grad_(True)
    loss, stats = value_loss(v, old, ret, mask, 0.2)
    total, count, clipped = 0.0, 0, 0
    for b, n_b in enumerate(lens):
        for k in range(n_b):
            vv, o, q = float(v.detach()[b, k]), float(old[b, k]), float(ret[b, k])
            vc = min(max(vv, o - 0.2), o + 0.2)
            total += 0.5 * max((vv - q) ** 2, (vc - q) ** 2)
            clipped += (vc - q) ** 2 > (vv - q) ** 2
            count += 1
    assert abs(float(loss.detach()) - total / count) < 1e-12
    assert abs(float(stats["vf_clipfrac"]) - clipped / count) < 1e-12
    loss.backward()
    assert torch.all(v.grad[~mask] == 0) and v.grad[mask].abs().sum() > 0


def test_losses_empty_batch_are_zero():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    z = torch.zeros(2, 3)
    seg = segments_for_rule("fixed", mask, ngram=2)
    assert float(policy_loss(z, z, z, mask, 0.2, seg, "macro")[0]) == 0.0
    assert float(value_loss(z, z, z, mask, 0.2)[0]) == 0.0
    assert float(masked_mean(z, mask)) == 0.0
