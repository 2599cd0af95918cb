"""--advantage_estimator mc_macro (issue 30; VinePPO / SPO): Monte-Carlo values of each macro action's start state
from K continuations sampled with the current policy, and macro advantages A_k = R_k + γ V̂_{k+1} − V̂_k — checked
against loops written from those sentences, on the continuations the rollout really sampled."""

import math

import pytest
import torch

from marlhf.config import RLHFArgs, parse_args
from marlhf.errors import ConfigError
from marlhf.rlhf.macro import fixed_starts, segments_from_starts


def test_advantages_are_the_td_errors_of_the_monte_carlo_values():
    from maths_helpers import rollout_section

    from marlhf.rlhf.advantages import AdvantageBatch, build_estimator

    g = torch.Generator().manual_seed(0)
    B, T = 5, 13
    lengths = torch.tensor([13, 1, 7, 0, 10])
    mask = torch.arange(T)[None] < lengths[:, None]
    seg = segments_from_starts(fixed_starts(mask, 3), mask)
    M = int(seg.max()) + 1
    rewards = torch.where(mask, torch.randn(B, T, generator=g), 0.0)
    mc = torch.randn(B, M, generator=g)
    for gamma in (1.0, 0.9):
        est = build_estimator(rollout_section(advantage_estimator="mc_macro", gamma=gamma))
        assert not est.needs_critic and est.mc_values
        adv, ret, stats = est(AdvantageBatch(mask, lengths >= 2, seg, rewards, rewards, None, rewards,
                                             torch.zeros(B), mc))
        for b in range(B):
            n = int(seg[b].max()) + 1 if lengths[b] else 0
            R = [float(rewards[b][seg[b] == k].sum()) for k in range(n)]
            for k in range(n):
                v_next = float(mc[b, k + 1]) if k + 1 < n else 0.0
                want = R[k] + gamma * v_next - float(mc[b, k])
                cols = (seg[b] == k).nonzero().flatten()
                assert adv[b, cols].tolist() == pytest.approx([want] * len(cols), abs=1e-6)
                assert ret[b, cols].tolist() == pytest.approx([want + float(mc[b, k])] * len(cols), abs=1e-6)
            assert not adv[b, ~mask[b]].any()


def test_monte_carlo_values_average_continuations_of_each_boundary(tmp_path, monkeypatch):
    """V̂(s_k) is the mean clipped score of K continuations of s_k (the answer's prefix kept, the answer budget
    kept), by a score that depends on the whole answer; the continuations are generated in chunks of the
    longest prefixes first, each with the budget its shortest prefix needs."""
    from ppo_harness import make_trainer, prompts, rlhf_args

    from marlhf import embedded
    from marlhf.rlhf import rollout
    from marlhf.rlhf.rollout import monte_carlo_values
    from marlhf.sampler import sample

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path, advantage_estimator="mc_macro", mc_rollouts=2,
                     per_device_generation_batch_size=3, per_device_training_batch_size=3)
    t = make_trainer(args)
    ids, mask = prompts(args, t.tokenizer, 3)
    out = sample(t.rlhf.actor, ids, mask, t.gen_cfg)
    seg = segments_from_starts(fixed_starts(out.answer_mask, 3), out.answer_mask)
    calls = []

    def score(s, rows):  # a score that depends on the whole answer: its length, shifted
        calls.append((s, list(rows)))
        return s.answer_mask.sum(1).float() * 0.5 - 3

    budgets = []

    def spy(actor, ids, mask, cfg, **kw):  # each generation call's token budget
        budgets.append(cfg.max_new_tokens)
        return sample(actor, ids, mask, cfg, **kw)

    monkeypatch.setattr(rollout, "sample", spy)
    K, clip = 2, 5.0
    values, n = monte_carlo_values(t.rlhf.actor, score, out, seg, K, t.gen_cfg, clip, chunk=4)
    P, A = out.prompt_width, out.answers.shape[1]
    rows = [(s, i, r) for s, owners in calls for i, r in enumerate(owners)]

    def start(b, k):
        return int((seg[b] == k).nonzero()[0, 0])

    # generated longest prefix first, 4 states a call, each call with the budget its shortest prefix needs
    states = sorted(((b, k) for b in range(3) for k in range(int(seg[b].max()) + 1)), key=lambda s: -start(*s))
    assert n == len(states) * K == len(rows)
    assert budgets == [A - start(*states[min(lo + 3, len(states) - 1)]) for lo in range(0, len(states), 4)]
    assert budgets[0] < A  # the late boundaries' call did not generate the whole answer budget
    for i, (b, k) in enumerate(states):
        t0 = start(b, k)
        got = []
        for s, r, owner in rows[i * K:(i + 1) * K]:
            assert owner == b
            assert torch.equal(s.seq[r, :P], out.seq[b, :P]) and torch.equal(s.attention_mask[r, :P],
                                                                              out.attention_mask[b, :P])
            length = int(s.answer_mask[r].sum())
            assert t0 <= length <= A and torch.equal(s.answers[r, :t0], out.answers[b, :t0])  # the prefix is kept
            if bool(s.ended[r]):
                assert int(s.answers[r, length - 1]) in t.gen_cfg.stop_ids
            got.append(min(max(length * 0.5 - 3, -clip), clip))
        assert float(values[b, k]) == pytest.approx(sum(got) / K, abs=1e-6)
    for b in range(3):  # nothing past a sample's last action
        assert not values[b, int(seg[b].max()) + 1:].any()


def test_a_step_with_monte_carlo_macro_values(tmp_path):
    from ppo_harness import make_trainer, prompts, rlhf_args

    from marlhf import embedded

    class Length:  # the user's reward: longer answers score higher
        def score(self, prompts, responses, meta, ended=None):
            return [0.05 * len(r) for r in responses]

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path, advantage_estimator="mc_macro", mc_rollouts=2, ngram=4,
                     per_device_generation_batch_size=3, per_device_training_batch_size=3, policy_ratio="macro",
                     kl_ctl=0.0)
    t = make_trainer(args, reward=Length())
    assert t.rlhf.critic is None
    ids, mask = prompts(args, t.tokenizer, 3)
    exp, stats = t.make_experience(ids, mask, step=0)
    macros = [int(exp.seg[b].max()) + 1 for b in range(3) if bool(exp.mask[b].any())]
    assert stats["mc_continuations"] == 2 * sum(macros) and stats["mc_seconds"] > 0
    varied = [len(set(exp.advantages[b][exp.mask[b]].tolist())) > 1 for b in range(3) if bool(exp.mask[b].any())]
    assert any(varied)  # macro-level advantages: not one number per answer
    update = t.ppo_update([exp])
    assert all(math.isfinite(v) for v in update.values())


def test_mc_macro_flags():
    args, _ = parse_args(RLHFArgs, ["--advantage_estimator", "mc_macro", "--mc_rollouts", "3", "--ngram", "5",
                                    "--policy_ratio", "macro"])
    from marlhf.rlhf.sections import RolloutSection

    assert RolloutSection.build(args).mc_rollouts == 3
    with pytest.raises(ConfigError, match="--mc_rollouts must be >= 1"):
        parse_args(RLHFArgs, ["--advantage_estimator", "mc_macro", "--mc_rollouts", "0"])
    with pytest.raises(ConfigError, match="no critic and no GAE"):
        parse_args(RLHFArgs, ["--advantage_estimator", "mc_macro", "--lam", "0.5"])


def test_the_critic_is_checked_against_monte_carlo_values(tmp_path):
    """--critic_mc_check K with macro GAE: the critic's value before each macro action against the mean score of
    K continuations from there, as a correlation and an RMS gap (VinePPO's diagnostic), computed by a loop."""
    import statistics

    from marlhf.rlhf.rollout import critic_mc_agreement

    seg = torch.tensor([[0, 0, 1, 1, 2], [0, 1, -1, -1, -1], [-1, -1, -1, -1, -1]])
    values = torch.tensor([[0.5, 9.0, 1.5, 9.0, 2.0], [0.1, 0.7, 0, 0, 0], [0.0] * 5])
    mc = torch.tensor([[0.4, 1.0, 2.5], [0.0, 0.9, 0.0], [0.0, 0.0, 0.0]])
    got = critic_mc_agreement(values, mc, seg)
    critic, target = [0.5, 1.5, 2.0, 0.1, 0.7], [0.4, 1.0, 2.5, 0.0, 0.9]  # the first token of each action
    assert got["critic_mc_corr"] == pytest.approx(statistics.correlation(critic, target), abs=1e-6)
    rmse = math.sqrt(sum((a - b) ** 2 for a, b in zip(critic, target)) / 5)
    assert got["critic_mc_rmse"] == pytest.approx(rmse, abs=1e-6)

    from ppo_harness import make_trainer, prompts, rlhf_args

    from marlhf import embedded

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path, critic_mc_check=2, ngram=6, per_device_generation_batch_size=3,
                     per_device_training_batch_size=3)
    t = make_trainer(args)
    ids, mask = prompts(args, t.tokenizer, 3)
    _, stats = t.make_experience(ids, mask, step=0)
    assert stats["mc_continuations"] > 0 and -1 <= stats["critic_mc_corr"] <= 1 and stats["critic_mc_rmse"] >= 0
    with pytest.raises(ConfigError, match="--critic_mc_check must be >= 0"):
        parse_args(RLHFArgs, ["--critic_mc_check", "-1"])
