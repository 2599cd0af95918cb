"""The critic-free estimators wired into step 3 (issue 11): K samples per prompt kept together as groups,
RLOO advantages on the wire equal a loop reference over the actual scores, no critic built / saved /
exported, and a critic-free checkpoint resumes exactly."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import STEP3, load_main
from ppo_harness import make_trainer, prompts, rlhf_args
from safetensors.torch import load_file
from test_step3 import nano, step3_argv, train_rows  # noqa: F401  (nano: the module's model fixture)


class LengthSource:
    """A text reward source that records the meta it is given and scores an answer by its length, so the
    K samples of a prompt get different scores."""

    def __init__(self):
        self.calls = []

    def score(self, prompts, responses, meta, *, ended=None):
        self.calls.append((list(prompts), list(meta)))
        return [0.1 * len(r) - 1.0 for r in responses]


@pytest.fixture(scope="module")
def rloo_experience(nano, tmp_path_factory):  # noqa: F811
    args = rlhf_args(nano, tmp_path_factory.mktemp("rloo"), advantage_estimator="rloo", num_samples_per_prompt=4,
                     per_device_generation_batch_size=2, kl_ctl=0.05, clip_reward_value=2.0)
    source = LengthSource()
    t = make_trainer(args, reward=source)
    ids, mask = prompts(args, t.tokenizer, 2)
    exp, stats = t.make_experience(ids, mask, step=0, meta=[{"prompt": 0}, {"prompt": 1}])
    return t, source, ids, mask, exp, stats


def test_critic_free_trainer_builds_no_critic(rloo_experience):
    t, _, _, _, exp, stats = rloo_experience
    assert t.rlhf.critic is None
    assert set(t.rlhf.trainable()) == {"actor"}
    assert exp.values is None
    assert "critic_loss" not in t.ppo_update([exp])  # the update runs without a value loss


def test_k_samples_per_prompt_form_groups_with_their_prompts_meta(rloo_experience):
    _, source, ids, mask, exp, _ = rloo_experience
    K, P = 4, exp.prompt_width
    assert exp.seq.shape[0] == 2 * K
    for i in range(2):  # rows i*K .. i*K+K-1 answer prompt i
        for j in range(K):
            assert torch.equal(exp.seq[i * K + j, :P], ids[i]) and torch.equal(exp.attention_mask[i * K + j, :P],
                                                                             mask[i])
    (prompt_texts, metas), = source.calls
    assert metas == [{"prompt": 0}] * K + [{"prompt": 1}] * K
    assert len(set(prompt_texts[:K])) == 1 and len(set(prompt_texts[K:])) == 1 and prompt_texts[0] != prompt_texts[K]


def test_rloo_advantages_on_the_wire_equal_a_loop_reference(rloo_experience):
    """A_i = R_i − mean of R_j over the other valid samples j of i's group, R_i = clip(score_i) − β Σ_t KL_t,
    computed by loops from the experience's own scores and log-probs, on every real token of the answer."""
    _, _, _, _, exp, stats = rloo_experience
    K, beta, c = 4, 0.05, 2.0
    N, A = exp.mask.shape
    valid = [bool(exp.mask[i].any()) for i in range(N)]
    R = []
    for i in range(N):
        kl = sum(float(exp.logprobs[i, t] - exp.ref_logprobs[i, t]) for t in range(A) if exp.mask[i, t])
        R.append(max(-c, min(c, float(exp.scores[i]))) - beta * kl)
    assert len({round(float(s), 6) for s in exp.scores}) > 2  # the scores differ inside the groups
    for i in range(N):
        g = i // K
        others = [R[j] for j in range(g * K, g * K + K) if j != i and valid[j]]
        expected = R[i] - sum(others) / len(others) if valid[i] and others else 0.0
        for t in range(A):
            want = expected if exp.mask[i, t] else 0.0
            assert float(exp.advantages[i, t]) == pytest.approx(want, abs=1e-5), (i, t)
            if exp.mask[i, t]:
                assert float(exp.returns[i, t]) == pytest.approx(R[i], abs=1e-5)
    assert stats["return_mean"] == pytest.approx(sum(r for r, v in zip(R, valid) if v) / max(sum(valid), 1),
                                                 abs=1e-5)


def test_a_batch_with_a_partial_group_is_refused():
    from maths_helpers import critic_free_advantages

    m = torch.ones(6, 3, dtype=torch.bool)
    z = torch.zeros(6, 3)
    with pytest.raises(ValueError, match="partial group"):
        critic_free_advantages("rloo", torch.arange(6.0), z, z, m, group_size=4, kl_ctl=0.1, clip_reward_value=5.0)


def critic_free_argv(nano, out):  # noqa: F811
    # RLOO with K = 2, its advantage under the macro ratio (n = 3), the KL as a k3 loss term
    return step3_argv(nano, out, "--advantage_estimator", "rloo", "--num_samples_per_prompt", "2",
                      "--per_device_generation_batch_size", "2", "--policy_ratio", "macro", "--ngram", "3",
                      "--kl_penalty", "loss", "--max_steps", "2", "--save_steps", "1", "--keep_checkpoints", "5")


def test_critic_free_run_saves_no_critic_and_resumes_exactly(nano, tmp_path):  # noqa: F811
    main = load_main(STEP3)
    main(critic_free_argv(nano, tmp_path / "full"))
    full = tmp_path / "full"
    assert not (full / "critic").exists()
    for ckpt in ("step00000001", "step00000002"):
        assert sorted(p.name for p in (full / "checkpoints" / ckpt).iterdir() if p.is_dir()) == ["actor"]
    rows = train_rows(full)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "train/critic_loss" not in r
        for key in ("train/actor_loss", "train/kl_loss", "train/kl", "train/return_mean"):
            assert torch.isfinite(torch.tensor(r[key])), key
        assert 1 <= r["train/macro_len"] <= 3
    # 2 prompts x K = 2 experiences per generation batch, micro-batch 2: 2 optimizer steps per PPO step, 4 in
    # all, so after step 1 the cosine schedule is halfway (the K samples count in the schedule)
    assert rows[0]["train/actor_lr"] == pytest.approx(5e-4, rel=1e-6)

    stopped = tmp_path / "stopped"
    shutil.copytree(full / "checkpoints/step00000001", stopped / "checkpoints/step00000001")
    (stopped / "checkpoints/latest").write_text("step00000001")
    shutil.copy(full / "initial_policy.json", stopped / "initial_policy.json")
    main([*critic_free_argv(nano, stopped), "--resume"])
    a, b = load_file(full / "actor/model.safetensors"), load_file(stopped / "actor/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    init = load_file(next(iter(sorted(nano.glob("*.safetensors")))))
    assert any(not torch.equal(a[k], init[k]) for k in a if k in init)  # the actor trained
    assert [r["step"] for r in train_rows(stopped)] == [2]
    assert not (stopped / "critic").exists()


@pytest.mark.slow
def test_two_ranks_grpo_keeps_groups_on_their_rank(nano, tmp_path):  # noqa: F811
    """GRPO with K = 2 on 2 ranks: each rank samples K answers to its own prompts and estimates their
    advantages before micro-batching (micro-batch 1 cuts every group; a partial group at estimation would
    raise), so the run completes, and it saves and exports no critic."""
    from conftest import deepspeed_cmd, run_launcher

    run_launcher([*deepspeed_cmd(2, 29693), str(STEP3),
                  *step3_argv(nano, tmp_path, "--advantage_estimator", "grpo", "--num_samples_per_prompt", "2",
                              "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "1",
                              "--max_steps", "2", "--save_steps", "2")], timeout=600)
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "train/critic_loss" not in r
        assert torch.isfinite(torch.tensor(r["train/actor_loss"]))
        assert 0.0 <= r["train/zero_adv_frac"] <= 1.0
    assert not (tmp_path / "critic").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints/step00000002").iterdir() if p.is_dir()) == ["actor"]
