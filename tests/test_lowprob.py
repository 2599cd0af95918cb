"""The low-probability termination rule (--termination_condition lowprob, issue 30): a macro action ends at a token
whose probability is below τ — checked against a per-token loop written from that sentence, through the flags and
the segmenter, and inside a rollout on the reference model's log-probabilities of the sampled answers."""

import math

import pytest
import torch

from marlhf.config import RLHFArgs, parse_args
from marlhf.embedded import default_model
from marlhf.errors import ConfigError
from marlhf.rlhf.macro import lowprob_starts, segments_from_starts


def loop_starts(mask: torch.Tensor, logprobs: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per sample, per token: the first token starts an action; a token with p < τ ends its action, so the token
    after it (if the answer goes on) starts the next one."""
    out = torch.zeros(mask.shape, dtype=torch.bool)
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        for t in range(n):
            if t == 0 or math.exp(float(logprobs[b, t - 1])) < threshold:
                out[b, t] = True
    return out


def random_batch(seed: int, B: int = 7, T: int = 23):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # one full row, one empty
    lengths[1] = 0
    mask = torch.arange(T)[None] < lengths[:, None]
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4  # p in (e^-4, 1)
    return mask, logprobs


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("threshold", [0.05, 0.2, 0.5, 0.95])
def test_lowprob_starts_equal_the_loop(seed, threshold):
    mask, logprobs = random_batch(seed)
    got = lowprob_starts(mask, logprobs, threshold)
    assert torch.equal(got, loop_starts(mask, logprobs, threshold))
    assert not got[~mask].any() and torch.equal(got[:, 0], mask[:, 0])
    # a row alone equals the row inside the batch (no cross-sample leakage)
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        assert torch.equal(lowprob_starts(mask[b:b + 1, :n], logprobs[b:b + 1, :n], threshold)[0], got[b, :n])


def test_probability_exactly_at_the_threshold_does_not_split_and_bad_inputs_are_named():
    mask = torch.ones(1, 4, dtype=torch.bool)
    logprobs = torch.tensor([[math.log(0.2), math.log(0.1999), math.log(0.9), math.log(0.01)]], dtype=torch.float64)
    # token 0 (p = τ) continues, token 1 (p < τ) ends its action, token 3 is the last token anyway
    assert lowprob_starts(mask, logprobs, 0.2).tolist() == [[True, False, True, False]]
    with pytest.raises(ValueError, match="must be in \\(0, 1\\)"):
        lowprob_starts(mask, logprobs, 1.0)
    with pytest.raises(ValueError, match="shape"):
        lowprob_starts(mask, logprobs[:, :3], 0.2)


def test_the_flags_choose_the_threshold_and_whose_probability(embedded):
    from marlhf.models.loading import load_tokenizer
    from marlhf.rlhf.sections import MacroSection
    from marlhf.rlhf.segmentation import MacroSegmenter

    mask, ref = random_batch(11)
    _, policy = random_batch(12)
    tok = load_tokenizer(default_model(""))
    for model, source in (("reference", ref), ("policy", policy)):
        args, _ = parse_args(RLHFArgs, ["--termination_condition", "lowprob", "--lowprob_threshold", "0.3",
                                        "--lowprob_model", model])
        segmenter = MacroSegmenter(MacroSection.build(args, response_kind="text"), tok, seed=0)
        seg, fallbacks = segmenter(torch.zeros_like(mask, dtype=torch.long), mask, ref, step=0, logprobs=policy)
        assert fallbacks == 0
        assert torch.equal(seg, segments_from_starts(loop_starts(mask, source, 0.3), mask))
    with pytest.raises(ValueError, match="policy's log-probabilities"):
        segmenter(torch.zeros_like(mask, dtype=torch.long), mask, ref, step=0)
    with pytest.raises(ConfigError, match="--lowprob_threshold must be in \\(0, 1\\)"):
        parse_args(RLHFArgs, ["--termination_condition", "lowprob", "--lowprob_threshold", "0"])


def test_a_rollout_segments_at_the_reference_model_s_unlikely_tokens(tmp_path):
    from ppo_harness import make_trainer, prompts, rlhf_args

    from marlhf import embedded

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path, termination_condition="lowprob", lowprob_threshold=0.05,
                     per_device_generation_batch_size=4, per_device_training_batch_size=4, policy_ratio="macro")
    t = make_trainer(args)
    ids, mask = prompts(args, t.tokenizer, 4)
    exp, stats = t.make_experience(ids, mask, step=0)
    want = segments_from_starts(loop_starts(exp.mask, exp.ref_logprobs, 0.05), exp.mask)
    assert torch.equal(exp.seg, want)
    lengths = exp.mask.sum(1)
    assert (want.max(1).values + 1)[lengths > 0].float().mean() > 1  # some answers were cut into several actions
    assert stats["parse_fallbacks"] == 0
