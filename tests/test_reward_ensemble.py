"""A conservative reward from several reward models (issue 28, lever 3): ``--reward_ensemble`` in step 3 and in
``marlhf eval-policy`` (``marlhf/rewards/__init__.py``: :func:`ensemble_reward`, :class:`RewardEnsembleSource`).

The combination is checked against a loop written here; the runs use real reward-model folders whose scores
are known relative to each other (one the exact negation of another), so what step 3 trained on and what the
evaluation reported can be checked by value.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import STEP3, load_main, save_seeded_reward_model
from test_step3 import nano, step3_argv, train_rows  # noqa: F401  (nano: the module's model fixture)

from marlhf.config import RLHFArgs, parse_args
from marlhf.errors import ConfigError, run_cli
from marlhf.rewards import build_reward_source, evaluation_sources
from marlhf.rewards.reward_model import RewardEnsembleSource, RewardModelSource, ensemble_reward


def reference(scores: list[list[float]], reduce: str, k: float) -> list[float]:
    """Column by column: the members' mean, min, or mean - k * sqrt(mean squared deviation)."""
    out = []
    for j in range(len(scores[0])):
        col = [row[j] for row in scores]
        m = sum(col) / len(col)
        if reduce == "mean":
            out.append(m)
        elif reduce == "min":
            out.append(min(col))
        else:
            out.append(m - k * math.sqrt(sum((x - m) ** 2 for x in col) / len(col)))
    return out


@pytest.mark.parametrize("reduce", ["mean", "min", "mean_minus_std"])
@pytest.mark.parametrize("members", [1, 2, 5])
def test_ensemble_reward_equals_the_loop(reduce, members):
    g = torch.Generator().manual_seed(members)
    scores = torch.randn(members, 7, generator=g, dtype=torch.float64) * 3
    for k in (0.0, 0.5, 2.0):
        got = ensemble_reward(scores, reduce, k)
        assert got.shape == (7,)
        assert got.tolist() == pytest.approx(reference(scores.tolist(), reduce, k), abs=1e-12)


def test_ensemble_reward_known_values_and_errors():
    scores = torch.tensor([[1.0, -2.0], [3.0, -2.0]])
    assert ensemble_reward(scores, "mean").tolist() == [2.0, -2.0]
    assert ensemble_reward(scores, "min").tolist() == [1.0, -2.0]
    assert ensemble_reward(scores, "mean_minus_std", 1.0).tolist() == [1.0, -2.0]  # std 1 and 0
    assert ensemble_reward(scores, "mean_minus_std", 3.0).tolist() == [-1.0, -2.0]
    with pytest.raises(ValueError, match="unknown ensemble reduction 'median'"):
        ensemble_reward(scores, "median")
    with pytest.raises(ValueError, match=r"\(members, batch\)"):
        ensemble_reward(torch.zeros(3))


class FixedScorer:
    """A reward model stand-in: fixed scores for sequences and for texts."""

    def __init__(self, scores):
        self.scores = scores

    def score_sequences(self, seq, attention_mask, prompt_width):
        return torch.tensor(self.scores, dtype=torch.float64)

    def score(self, prompts, responses, meta=None, *, ended=None):
        return list(self.scores)


def test_the_ensemble_source_combines_its_members_for_sequences_and_texts():
    members = [FixedScorer([1.0, 4.0]), FixedScorer([3.0, 0.0]), FixedScorer([2.0, 2.0])]
    source = RewardEnsembleSource(members, "mean_minus_std", 0.5)
    expected = reference([m.scores for m in members], "mean_minus_std", 0.5)
    seq = torch.zeros(2, 3, dtype=torch.long)
    got = source.score_sequences(seq, torch.ones_like(seq), 1)
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(expected, abs=1e-6)
    assert source.score(["p", "q"], ["a", "b"]) == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="at least 2 reward models"):
        RewardEnsembleSource(members[:1])


def test_build_reward_source_makes_an_ensemble_only_of_reward_models():
    a, b = object(), object()
    src = build_reward_source("reward_model", reward_model=a, ensemble=[b], ensemble_reduce="min")
    assert isinstance(src, RewardEnsembleSource) and src.reduce == "min"
    assert [m.model for m in src.members] == [a, b]  # the main reward model first
    assert type(build_reward_source("reward_model", reward_model=a)) is RewardModelSource
    with pytest.raises(ConfigError, match="needs --reward_source reward_model, not gold"):
        build_reward_source("gold", ensemble=[b])
    # the evaluation reports the main model as rm and the combination as ensemble
    sources = evaluation_sources("reward_model", src, a)
    assert set(sources) == {"rm", "ensemble"} and sources["ensemble"] is src and sources["rm"].model is a


@pytest.mark.parametrize("flags, message", [
    (["--reward_source", "gold", "--reward_ensemble", "x"], "needs --reward_source reward_model, not gold"),
    (["--reward_ensemble_reduce", "min"], "--reward_ensemble_reduce needs --reward_ensemble"),
    (["--reward_ensemble_std_coef", "2"], "--reward_ensemble_std_coef needs --reward_ensemble"),
    (["--reward_ensemble", "x", "--reward_ensemble_std_coef", "-1"], "must be a finite number >= 0"),
    (["--reward_ensemble", "x", "--reward_ensemble_std_coef", "nan"], "must be a finite number >= 0"),
])
def test_ensemble_flags_are_validated(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(RLHFArgs, flags)
    args, _ = parse_args(RLHFArgs, ["--reward_ensemble", "a", "b", "--reward_ensemble_reduce", "min"])
    assert args.reward_ensemble == ["a", "b"] and args.reward_ensemble_reduce == "min"


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory):
    """A, its exact negation, and another seed's head."""
    root = tmp_path_factory.mktemp("rms")
    return {"a": save_seeded_reward_model(root / "a"), "neg_a": save_seeded_reward_model(root / "neg_a", sign=-1.0),
            "c": save_seeded_reward_model(root / "c", seed=5)}


def test_step3_trains_on_the_ensembles_reward(nano, reward_models, tmp_path):  # noqa: F811
    """Members A and -A with the mean: every answer's reward is exactly 0, so train/reward is 0 at every step
    while the main model's rm_score is not; the log names the members."""
    out = tmp_path / "run"
    argv = step3_argv(nano, out, "--reward_model_name_or_path", str(reward_models["a"]), "--reward_ensemble",
                      str(reward_models["neg_a"]), "--reward_ensemble_reduce", "mean", "--max_steps", "2")
    load_main(STEP3)(argv)
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/reward"] == pytest.approx(0.0, abs=1e-6) for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    for policy in ("initial_policy", "final_policy"):
        assert summary[policy]["ensemble_score"] == pytest.approx(0.0, abs=1e-6)
        assert abs(summary[policy]["rm_score"]) > 1e-3
    assert f"reward ensemble: {reward_models['a']} and {reward_models['neg_a']}" in (out / "train.log").read_text()


def test_eval_policy_reports_the_ensemble_beside_each_members_score(nano, reward_models, tmp_path):  # noqa: F811
    """The same answers (one seeded stream) scored by A, by C and by the mean / min / mean - std of both: the
    mean's held-out score is the average of the two models' scores (the mean is linear), the min's is at most
    either, and mean - 2 std is under the mean."""
    out = tmp_path / "eval"
    base = step3_argv(nano, out, "--ref_model_name_or_path", str(nano))

    def evaluate(rm, *extra):
        assert run_cli(load_main("eval_policy"), [*base, "--reward_model_name_or_path", str(rm), *extra]) == 0
        return json.loads((out / "eval.json").read_text())

    a, c = evaluate(reward_models["a"])["rm_score"], evaluate(reward_models["c"])["rm_score"]
    assert abs(a - c) > 1e-3
    both = ["--reward_ensemble", str(reward_models["c"])]
    mean = evaluate(reward_models["a"], *both, "--reward_ensemble_reduce", "mean")
    assert mean["rm_score"] == pytest.approx(a, abs=1e-6)  # rm stays the main model's
    assert mean["ensemble_score"] == pytest.approx((a + c) / 2, abs=1e-5)
    lowest = evaluate(reward_models["a"], *both, "--reward_ensemble_reduce", "min")["ensemble_score"]
    assert lowest <= min(a, c) + 1e-6
    cautious = evaluate(reward_models["a"], *both, "--reward_ensemble_std_coef", "2")["ensemble_score"]
    assert cautious < mean["ensemble_score"] - 1e-3
