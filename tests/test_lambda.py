"""The critic's own GAE λ (--lam_critic) and the length-adaptive actor λ = 1 − 1/(α·L) (--adaptive_lam_alpha, VAPO;
issue 30), checked against a backward recursion over each sample's macro actions written from the definitions:
δ_k = R_k + γ V_{k+1} − V_k, A_k = δ_k + γλ A_{k+1}, the critic's target Q_k = A_k(λ_critic) + V_k."""

import pytest
import torch
from maths_helpers import rollout_section

from marlhf.config import RLHFArgs, parse_args
from marlhf.errors import ConfigError
from marlhf.rlhf.macro import fixed_starts, segments_from_starts
from marlhf.rlhf.ppo_math import adaptive_lam, compute_advantages, gae


def loop_gae(V: list[float], R: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    A, nxt_a, out = 0.0, 0.0, []
    for k in reversed(range(len(V))):
        v_next = V[k + 1] if k + 1 < len(V) else 0.0
        delta = R[k] + gamma * v_next - V[k]
        A = delta + gamma * lam * nxt_a
        nxt_a = A
        out.append(A)
    A_list = out[::-1]
    return A_list, [a + v for a, v in zip(A_list, V)]


def macro_sums(x: torch.Tensor, seg: torch.Tensor, b: int) -> list[float]:
    n = int(seg[b].max()) + 1 if bool((seg[b] >= 0).any()) else 0
    return [float(x[b][seg[b] == k].sum()) for k in range(n)]


def batch(seed: int, B: int = 6, T: int = 17, n: int = 3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 1  # one answer of a single token: one macro action, α·L may be below 1
    mask = torch.arange(T)[None] < lengths[:, None]
    seg = segments_from_starts(fixed_starts(mask, n), mask)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    return mask, seg, values, rewards


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma, lam, lam_critic, alpha", [
    (1.0, 0.95, 1.0, 0.0), (0.9, 0.8, 0.5, 0.0), (1.0, 0.95, None, 0.5), (1.0, 0.95, 1.0, 1.2), (0.99, 0.3, 0.0, 3.0),
])
def test_decoupled_and_adaptive_lambda_equal_the_recursion(seed, gamma, lam, lam_critic, alpha):
    mask, seg, values, rewards = batch(seed)
    adv, ret, _ = compute_advantages(values, rewards, mask, seg, "unit", "sum", gamma, lam,
                                     lam_critic=lam_critic, adaptive_lam_alpha=alpha)
    for b in range(mask.shape[0]):
        # "unit" σ: the macro value is the value at the action's last token (App. D.1), the reward its sum
        first = [int((seg[b] == k).nonzero()[0, 0]) for k in range(int(seg[b].max()) + 1)]
        V = [float(values[b][seg[b] == k][-1]) for k in range(len(first))]
        R = macro_sums(rewards, seg, b)
        L = len(V)
        actor_lam = min(max(1 - 1 / (alpha * L), 0.0), 1.0) if alpha > 0 else lam
        A, _ = loop_gae(V, R, gamma, actor_lam)
        _, Q = loop_gae(V, R, gamma, lam if lam_critic is None else lam_critic)
        for k, t in enumerate(first):
            n_k = int((seg[b] == k).sum())
            assert adv[b, t:t + n_k].tolist() == pytest.approx([A[k]] * n_k, abs=1e-12)
            assert ret[b, t:t + n_k].tolist() == pytest.approx([Q[k]] * n_k, abs=1e-12)


def test_per_sample_lambda_equals_one_gae_per_sample_and_the_vapo_formula():
    mask, seg, values, rewards = batch(7, n=1)
    lam = torch.tensor([0.0, 0.3, 0.5, 0.9, 0.99, 1.0], dtype=torch.float64)
    A, Q = gae(values, rewards, mask, 0.97, lam)
    for b in range(mask.shape[0]):
        A1, Q1 = gae(values[b:b + 1], rewards[b:b + 1], mask[b:b + 1], 0.97, float(lam[b]))
        torch.testing.assert_close(A[b:b + 1], A1, rtol=0, atol=1e-12)
        torch.testing.assert_close(Q[b:b + 1], Q1, rtol=0, atol=1e-12)
    L = torch.tensor([0, 1, 2, 10, 100])
    assert adaptive_lam(L, 0.5).tolist() == pytest.approx([0.0, 0.0, 0.0, 0.8, 0.98])  # 1 - 1/(0.5 L), >= 0
    with pytest.raises(ValueError, match="one λ per sample"):
        gae(values, rewards, mask, 1.0, lam[:2])
    with pytest.raises(ValueError, match="must lie in \\[0, 1\\]"):
        gae(values, rewards, mask, 1.0, lam + 0.5)


def test_the_flags_reach_the_estimator_and_are_refused_without_a_critic():
    args, _ = parse_args(RLHFArgs, ["--lam_critic", "1.0", "--adaptive_lam_alpha", "0.05"])
    from marlhf.rlhf.sections import RolloutSection

    section = RolloutSection.build(args)
    assert (section.lam_critic, section.adaptive_lam_alpha) == (1.0, 0.05)
    assert rollout_section().lam_critic is None and rollout_section().adaptive_lam_alpha == 0.0  # defaults: off
    for flags, match in ((["--lam_critic", "1.5"], "--lam_critic must be in"),
                         (["--adaptive_lam_alpha", "-1"], "--adaptive_lam_alpha must be >= 0"),
                         (["--advantage_estimator", "grpo", "--num_samples_per_prompt", "2", "--lam_critic", "1"],
                          "--lam_critic")):
        with pytest.raises(ConfigError, match=match):
            parse_args(RLHFArgs, flags)
    # the default keeps one GAE: returns with the actor's λ, exactly as before the option existed
    mask, seg, values, rewards = batch(3)
    base = compute_advantages(values, rewards, mask, seg, "equal", "sum", 1.0, 0.95)
    same = compute_advantages(values, rewards, mask, seg, "equal", "sum", 1.0, 0.95, lam_critic=0.95)
    assert torch.equal(base[0], same[0]) and torch.equal(base[1], same[1])
