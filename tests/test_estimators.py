"""Critic-free estimators (RLOO, GRPO, Dr. GRPO, REINFORCE) and the KL loss vs slow loop references, their
group invariances, and the option combinations they reject."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from maths_helpers import critic_free_advantages, segments_for_rule

from marlhf.errors import ConfigError
from marlhf.rlhf.advantages import ESTIMATORS, EstimatorOptions, check_estimator_options, estimator_class
from marlhf.rlhf.estimators import (
    broadcast_to_tokens,
    grpo_advantages,
    kl_loss,
    reinforce_advantages,
    rloo_advantages,
    sequence_returns,
)
from marlhf.rlhf.ppo_math import policy_loss, token_rewards

SEEDS = [0, 1, 2]


# ---------------------------------------------------------------- data and loop references
def grouped(seed: int, G: int = 5, K: int = 4, p_invalid: float = 0.2):
    """Returns (N,) with ties, and a validity mask with one fully valid group and one single-valid group."""
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(G * K, generator=g, dtype=torch.float64)
    R[K:2 * K] = 0.7  # a group whose samples all scored the same
    valid = torch.rand(G * K, generator=g) >= p_invalid
    valid[:K] = True
    valid[2 * K:3 * K] = torch.tensor([False] * (K - 1) + [True])  # one valid sample: no baseline
    return R, valid


def ref_rloo(R: list[float], valid: list[bool], K: int) -> list[float]:
    out = []
    for i in range(len(R)):
        g0 = (i // K) * K
        others = [R[j] for j in range(g0, g0 + K) if j != i and valid[j]]
        out.append(R[i] - sum(others) / len(others) if valid[i] and others else 0.0)
    return out


def ref_grpo(R: list[float], valid: list[bool], K: int, normalize: bool, eps: float = 1e-4) -> list[float]:
    out = []
    for i in range(len(R)):
        g0 = (i // K) * K
        members = [R[j] for j in range(g0, g0 + K) if valid[j]]
        if not valid[i] or len(members) < 2:
            out.append(0.0)
            continue
        a = R[i] - statistics.mean(members)
        out.append(a / (statistics.stdev(members) + eps) if normalize else a)
    return out


def ref_reinforce(R: list[float], valid: list[bool]) -> list[float]:
    members = [r for r, v in zip(R, valid) if v]
    mean = sum(members) / len(members)
    return [r - mean if v else 0.0 for r, v in zip(R, valid)]


def responses(seed: int, N: int = 8, T: int = 11):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (N,), generator=g)
    lens[0] = T
    mask = torch.arange(T)[None, :] < lens[:, None]
    lp = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    lp[~mask] = float("nan")  # padding must never leak into a value
    ref[~mask] = float("inf")
    scores = torch.randn(N, generator=g, dtype=torch.float64) * 4
    return mask, lp, ref, scores


# ---------------------------------------------------------------- estimators vs loops
@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_loop(seed):
    R, valid = grouped(seed)
    got = rloo_advantages(R, 4, valid)
    want = ref_rloo(R.tolist(), valid.tolist(), 4)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    # hand check of one group: R = (1, 2, 3, 6) → baselines (11/3, 10/3, 3, 2) → A = (-8/3, -4/3, 0, 4)
    torch.testing.assert_close(rloo_advantages(torch.tensor([1.0, 2, 3, 6]), 4),
                               torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0]))
    # a group of identical returns (group 1) teaches nothing; a lone valid sample (group 2) has no baseline
    assert got[4:12].abs().max() < 1e-12


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalization", ["std", "none"])
def test_grpo_matches_loop(seed, normalization):
    R, valid = grouped(seed)
    got = grpo_advantages(R, 4, valid, normalization)
    want = ref_grpo(R.tolist(), valid.tolist(), 4, normalization == "std")
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    # hand check: R = (1, 2, 3, 6): mean 3, unbiased std sqrt((4+1+0+9)/3)
    A = grpo_advantages(torch.tensor([1.0, 2, 3, 6], dtype=torch.float64), 4, normalization=normalization, eps=0)
    scale = math.sqrt(14 / 3) if normalization == "std" else 1.0
    torch.testing.assert_close(A, torch.tensor([-2.0, -1, 0, 3], dtype=torch.float64) / scale)


def test_dr_grpo_is_grpo_times_group_std():
    R, valid = grouped(3)
    std = grpo_advantages(R, 4, valid, "std", eps=0.0)
    none = grpo_advantages(R, 4, valid, "none")
    for g in range(5):  # every group with a spread: the two differ by exactly the group's std
        sl = slice(4 * g, 4 * g + 4)
        members = R[sl][valid[sl]]
        if len(members) >= 2 and members.std() > 0:
            torch.testing.assert_close(none[sl], std[sl] * members.std())


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_matches_loop(seed):
    R, valid = grouped(seed)
    torch.testing.assert_close(reinforce_advantages(R, valid),
                               torch.tensor(ref_reinforce(R.tolist(), valid.tolist()), dtype=torch.float64))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kl_penalty", ["reward", "loss"])
def test_sequence_returns_match_loop_and_token_rewards(seed, kl_penalty):
    mask, lp, ref, scores = responses(seed)
    got = sequence_returns(scores, lp, ref, mask, kl_ctl=0.1, clip_reward_value=2.5, kl_penalty=kl_penalty)
    for i in range(mask.shape[0]):
        want = max(-2.5, min(2.5, scores[i].item()))
        if kl_penalty == "reward":
            want -= 0.1 * sum(lp[i, t].item() - ref[i, t].item() for t in range(int(mask[i].sum())))
        assert got[i].item() == pytest.approx(want, abs=1e-12)
    if kl_penalty == "reward":  # the whole response as one action: the sum of step 3's per-token rewards
        torch.testing.assert_close(got, token_rewards(lp, ref, mask, scores, 0.1, 2.5).sum(dim=1))


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_loss_matches_loop_and_ignores_padding(seed):
    mask, lp, ref, _ = responses(seed)
    lp_g = lp.clone().requires_grad_(True)
    got = kl_loss(lp_g, ref, mask)
    terms = [math.exp(ref[i, t].item() - lp[i, t].item()) - (ref[i, t].item() - lp[i, t].item()) - 1
             for i in range(mask.shape[0]) for t in range(int(mask[i].sum()))]
    assert got.item() == pytest.approx(sum(terms) / len(terms), rel=1e-12)
    assert all(x >= 0 for x in terms)
    got.backward()
    assert torch.isfinite(lp_g.grad).all() and (lp_g.grad[~mask] == 0).all()
    # identical policies: zero KL
    assert kl_loss(torch.where(mask, ref, 0.0), torch.where(mask, ref, 0.0), mask).item() == 0.0


def test_broadcast_puts_the_sequence_advantage_on_real_tokens_only():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    got = broadcast_to_tokens(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert got.tolist() == [[2.0, 2.0, 2.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


# ---------------------------------------------------------------- the full call
@pytest.mark.parametrize("estimator", ["rloo", "grpo", "reinforce"])
def test_critic_free_advantages_compose_returns_and_estimator(estimator):
    mask, lp, ref, scores = responses(5, N=8)
    valid = torch.tensor([True] * 7 + [False])
    adv, R, stats = critic_free_advantages(estimator, scores, lp, ref, mask, group_size=4, kl_ctl=0.05,
                                           clip_reward_value=3.0, valid=valid)
    want_R = sequence_returns(scores, lp, ref, mask, 0.05, 3.0)
    want = {"rloo": lambda: ref_rloo(want_R.tolist(), valid.tolist(), 4),
            "grpo": lambda: ref_grpo(want_R.tolist(), valid.tolist(), 4, True),
            "reinforce": lambda: ref_reinforce(want_R.tolist(), valid.tolist())}[estimator]()
    has_tokens = mask[:, 0].bool()
    torch.testing.assert_close(R[has_tokens], want_R[has_tokens])  # every answer token carries its return
    for i in range(8):
        real = mask[i]
        assert torch.all(adv[i, real] == adv[i, 0]) and torch.all(adv[i, ~real] == 0)
        assert adv[i, 0].item() == pytest.approx(want[i], abs=1e-12)
    assert torch.isfinite(adv).all()
    assert stats["return_mean"].item() == pytest.approx(sum(want_R[:7].tolist()) / 7)


# ---------------------------------------------------------------- groups: order, isolation, ranks
@pytest.mark.parametrize("fn", ["rloo", "grpo", "grpo_none"])
def test_group_advantages_follow_their_rows_and_ignore_other_groups(fn):
    est = {"rloo": lambda R, v: rloo_advantages(R, 4, v), "grpo": lambda R, v: grpo_advantages(R, 4, v),
           "grpo_none": lambda R, v: grpo_advantages(R, 4, v, "none")}[fn]
    R, valid = grouped(7)
    base = est(R, valid)
    # rows shuffled within each group, and groups reordered: every row keeps its advantage
    g = torch.Generator().manual_seed(1)
    group_order = torch.randperm(5, generator=g)
    perm = torch.cat([4 * int(q) + torch.randperm(4, generator=g) for q in group_order])
    torch.testing.assert_close(est(R[perm], valid[perm]), base[perm])
    # another group's scores change: this group's advantages do not
    R2 = R.clone()
    R2[8:] = R2[8:] * 10 - 3
    torch.testing.assert_close(est(R2, valid)[:8], base[:8])
    # two ranks each holding whole groups compute what one rank holding all of them computes
    torch.testing.assert_close(torch.cat([est(R[:8], valid[:8]), est(R[8:], valid[8:])]), base)


def test_a_group_cut_by_a_batch_or_rank_boundary_is_rejected():
    R = torch.arange(10, dtype=torch.float64)
    for call in (lambda: rloo_advantages(R, 4), lambda: grpo_advantages(R, 4),
                 lambda: critic_free_advantages("reinforce", R, torch.zeros(10, 3), torch.zeros(10, 3),
                                                torch.ones(10, 3, dtype=torch.bool), group_size=4, kl_ctl=0.1,
                                                clip_reward_value=None)):
        with pytest.raises(ValueError, match=r"rows 8\.\.9 are a partial group"):
            call()


def test_reinforce_baseline_is_the_batch_mean():
    R = torch.tensor([1.0, 2.0, 3.0, 10.0])
    torch.testing.assert_close(reinforce_advantages(R), torch.tensor([-3.0, -2.0, -1.0, 6.0]))


# ---------------------------------------------------------------- composition with the macro ratio
def test_sequence_advantage_with_macro_ratio_matches_loop():
    """RLOO advantages broadcast to tokens, PPO clipped per macro action (fixed n = 3) — against a loop over
    samples and macro actions of the paper's π(ω|s)/π_old(ω|s) objective."""
    mask, lp_old, ref, scores = responses(11, N=8, T=10)
    lp_old = torch.where(mask, lp_old, 0.0)
    g = torch.Generator().manual_seed(4)
    lp_new = torch.where(mask, lp_old + 0.3 * torch.randn(lp_old.shape, generator=g, dtype=torch.float64), 0.0)
    seg = segments_for_rule("fixed", mask, ngram=3)
    adv, _, _ = critic_free_advantages("rloo", scores, lp_old, torch.where(mask, ref, 0.0), mask, group_size=4,
                                       kl_ctl=0.05, clip_reward_value=5.0)
    loss, _ = policy_loss(lp_new, lp_old, adv, mask, 0.2, seg=seg, ratio="macro")
    total, count = 0.0, 0
    for i in range(8):
        n = int(mask[i].sum())
        for start in range(0, n, 3):
            toks = range(start, min(start + 3, n))
            r = math.exp(sum(lp_new[i, t].item() - lp_old[i, t].item() for t in toks))
            a = adv[i, 0].item()
            per_token = max(-a * r, -a * min(max(r, 0.8), 1.2))
            total += per_token * len(toks)
            count += len(toks)
    assert loss.item() == pytest.approx(total / count, rel=1e-10)


# ---------------------------------------------------------------- option combinations
GOOD = dict(estimator="rloo", num_samples_per_prompt=4, kl_penalty="reward", grpo_normalization="std",
            policy_ratio="token", termination_changed=False, value_function="equal", macro_reward="sum",
            gamma=1.0, lam_changed=False, whiten_advantages=False)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_samples_per_prompt": 1}, "rloo needs --num_samples_per_prompt >= 2"),
    ({"estimator": "grpo", "num_samples_per_prompt": 1}, "grpo needs --num_samples_per_prompt >= 2"),
    ({"num_samples_per_prompt": 0}, "must be >= 1"),
    ({"estimator": "ppo"}, "--advantage_estimator 'ppo' is not one of"),
    ({"kl_penalty": "both"}, "--kl_penalty 'both'"),
    ({"grpo_normalization": "none"}, "only applies to --advantage_estimator grpo"),
    ({"estimator": "gae", "grpo_normalization": "none"}, "only applies to --advantage_estimator grpo"),
    ({"value_function": "unit"}, "--value_function unit weights critic values"),
    ({"macro_reward": "compat"}, "--macro_reward compat"),
    ({"gamma": 0.99}, "--gamma/--lam"),
    ({"lam_changed": True}, "--gamma/--lam"),
    ({"termination_changed": True}, "add --policy_ratio macro"),
    ({"estimator": "grpo", "whiten_advantages": True}, "already normalised per group"),
])
def test_meaningless_combinations_are_rejected(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("|", r"\|")):
        check_estimator_options(EstimatorOptions(**{**GOOD, **change}))


@pytest.mark.parametrize("change", [
    {},
    {"policy_ratio": "macro", "termination_changed": True},  # RLOO advantages, ratio per macro action
    {"kl_penalty": "loss"},
    {"estimator": "grpo", "grpo_normalization": "none"},
    {"estimator": "reinforce", "num_samples_per_prompt": 1},
    {"estimator": "reinforce", "whiten_advantages": True},
    # gae keeps every MA-PPO option, with more samples per prompt and either KL placement
    {"estimator": "gae", "num_samples_per_prompt": 1, "value_function": "position", "macro_reward": "compat",
     "gamma": 0.99, "lam_changed": True, "termination_changed": True, "kl_penalty": "loss"},
])
def test_meaningful_combinations_pass(change):
    check_estimator_options(EstimatorOptions(**{**GOOD, **change}))


def test_only_gae_needs_a_critic():
    assert set(ESTIMATORS) == {"gae", "rloo", "grpo", "reinforce", "mc_macro"}
    assert estimator_class("gae").needs_critic
    assert not any(estimator_class(e).needs_critic for e in ("rloo", "grpo", "reinforce", "mc_macro"))
    assert [estimator_class(e).min_group for e in ("gae", "rloo", "grpo", "reinforce", "mc_macro")] == [1, 2, 2, 1, 1]
    assert [e for e in ESTIMATORS if estimator_class(e).mc_values] == ["mc_macro"]
    with pytest.raises(ValueError, match="advantage_estimator"):
        estimator_class("ppo")


# ---------------------------------------------------------------- the step-3 flags
def test_step3_flags_parse_and_validate():
    from marlhf.config import RLHFArgs, build_parser, parse_args

    args, _ = parse_args(RLHFArgs, [])
    assert (args.advantage_estimator, args.num_samples_per_prompt, args.kl_penalty, args.grpo_normalization) == \
        ("gae", 1, "reward", "std")
    ns = build_parser(RLHFArgs).parse_args(["--advantage_estimator", "grpo", "--num_samples_per_prompt", "4",
                                            "--grpo_normalization", "none", "--kl_penalty", "loss"])
    assert (ns.advantage_estimator, ns.num_samples_per_prompt, ns.grpo_normalization, ns.kl_penalty) == \
        ("grpo", 4, "none", "loss")
    # meaningful combinations parse and validate (the step-3 trainer uses them: tests/test_step3_estimators.py)
    for argv in (["--advantage_estimator", "rloo", "--num_samples_per_prompt", "2", "--policy_ratio", "macro",
                  "--ngram", "3"],
                 ["--num_samples_per_prompt", "2"], ["--kl_penalty", "loss"]):
        args, _ = parse_args(RLHFArgs, argv)
        assert args.num_samples_per_prompt in (1, 2)


@pytest.mark.parametrize(("argv", "message"), [
    (["--advantage_estimator", "rloo"], "needs --num_samples_per_prompt >= 2"),
    (["--advantage_estimator", "reinforce", "--ngram", "3"], "add --policy_ratio macro"),
    (["--advantage_estimator", "reinforce", "--termination_condition", "word"], "add --policy_ratio macro"),
    (["--advantage_estimator", "reinforce", "--lam", "0.9"], "--gamma/--lam"),
    (["--advantage_estimator", "reinforce", "--value_function", "position"], "--value_function position"),
    # K samples per prompt multiply the experiences of a generation batch: 2 prompts x 3 = 6 < 8
    (["--advantage_estimator", "grpo", "--num_samples_per_prompt", "3", "--per_device_generation_batch_size", "2",
      "--per_device_training_batch_size", "8"], "cannot exceed the experiences collected"),
])
def test_step3_flags_reject_meaningless_combinations(argv, message):
    from marlhf.config import RLHFArgs, parse_args

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_args(RLHFArgs, argv)
