"""The trainer's data flow, pinned: make_experience must put each value, log-prob, score and mask on the
right token.  The maths functions are pinned elsewhere by loop references; these tests fail when the
trainer feeds them one token off (docs/design.md "Data flow of one step-3 iteration").

Hand-set outputs: the critic's and the reward model's heads are replaced by the POSITION of each token in
the sequence (so a value read one token off is visibly wrong), the answers end at chosen lengths, and the
actor's log-probs are checked against a per-sample forward of the unpadded sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ppo_harness import make_trainer, prompts, rlhf_args

LENGTHS = [24, 1, 2, 3, 9, 24, 17, 5]  # 1: EOS only, 2: one token + EOS (both invalid), 3: two tokens + EOS


def ended_at(answer, stop_ids):
    lengths = torch.tensor(LENGTHS)[: answer.shape[0]].clamp(max=answer.shape[1])
    k = torch.arange(answer.shape[1])
    return k[None, :] < lengths[:, None], lengths < answer.shape[1]


def position_head(module, inputs, output):
    """Head output = the token's position in the (left-padded prompt + answer) sequence."""
    B, T, _ = output.shape
    return torch.arange(T, dtype=output.dtype)[None, :, None].expand(B, T, 1).clone()


@pytest.fixture(scope="module")
def experience(tmp_path_factory):
    from marlhf import embedded

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path_factory.mktemp("flow"), clip_reward_value=1e6, kl_ctl=0.1)
    t = make_trainer(args)
    ids, mask = prompts(args, t.tokenizer, 8)
    handles = [t.rlhf.critic.module.score.register_forward_hook(position_head),
               t.rlhf.reward.module.score.register_forward_hook(position_head)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("marlhf.sampler.answer_mask", ended_at)
        exp, stats = t.make_experience(ids, mask, step=0)
    for h in handles:
        h.remove()
    return t, exp, stats


def test_values_are_the_critic_at_each_tokens_state(experience):
    _, exp, _ = experience
    P = exp.prompt_width
    A = exp.mask.shape[1]
    # V(s_t) for answer token t is read where the model has seen the prompt and tokens < t: position P-1+t
    expected = (P - 1 + torch.arange(A)).float().expand_as(exp.values)
    assert torch.equal(exp.values[exp.mask], expected[exp.mask])


def test_score_is_read_at_the_last_real_token_and_rewarded_there(experience):
    _, exp, _ = experience
    P = exp.prompt_width
    lengths = torch.tensor(LENGTHS)
    assert torch.equal(exp.scores, (P - 1 + lengths).float())  # the EOS token, the last real one
    valid = exp.mask.any(dim=1)
    kl = -0.1 * (exp.logprobs - exp.ref_logprobs)
    for b in range(8):
        n = LENGTHS[b]
        if not valid[b]:
            assert not exp.rewards[b].any()  # invalid answers get neither KL nor score
            continue
        want = torch.where(exp.mask[b], kl[b], 0.0)
        want[n - 1] += exp.scores[b]
        assert torch.allclose(exp.rewards[b], want, atol=1e-6), b
        assert exp.rewards[b, n - 1].item() == pytest.approx(P - 1 + n, abs=1e-3)


def test_empty_and_one_token_answers_are_masked_and_counted(experience):
    _, exp, stats = experience
    rows = exp.mask.sum(dim=1).tolist()
    assert rows == [24, 0, 0, 3, 9, 24, 17, 5]  # lengths 1 and 2 (no content / one content token) masked
    assert stats["invalid_answers"] == 2.0
    assert not exp.advantages[1:3].any() and not exp.returns[1:3].any()
    assert (exp.seg[1:3] == -1).all() and (exp.seg[0] >= 0).all()
    # the attention mask covers exactly the prompt and each answer's real tokens, EOS included
    P = exp.prompt_width
    assert exp.attention_mask[:, P:].sum(dim=1).tolist() == LENGTHS


def test_logprobs_match_a_per_sample_forward_of_the_unpadded_sequence(experience):
    t, exp, _ = experience
    P = exp.prompt_width
    model = t.rlhf.actor.module
    with torch.no_grad():
        for b in range(8):
            keep = exp.attention_mask[b].bool()
            ids = exp.seq[b][keep]  # real prompt tokens + real answer tokens, no padding anywhere
            n = LENGTHS[b]
            logits = model(input_ids=ids[None]).logits[0].float()
            start = len(ids) - n  # first answer token
            ref = F.log_softmax(logits[start - 1:-1], dim=-1).gather(1, ids[start:, None]).squeeze(1)
            got = exp.logprobs[b, :n]
            assert torch.allclose(got, ref, atol=1e-5), b
            assert torch.allclose(exp.ref_logprobs[b, :n], ref, atol=1e-5), b  # the reference is the same model
            assert exp.seq[b, P:P + n].tolist() == ids[start:].tolist()
