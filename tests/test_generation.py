"""The generation seam (marlhf/sampler.py): grouping of num_samples, seeding, masks and padding after the
stop token, greedy decoding against a plain argmax loop, and the policy's train/eval mode restored."""

from __future__ import annotations

import pytest
import torch

from marlhf.sampler import GenerationConfig, answer_mask, sample

PAD = 0


@pytest.fixture(scope="module")
def nano():
    from transformers import AutoModelForCausalLM

    from marlhf import embedded

    model = AutoModelForCausalLM.from_pretrained(embedded.prepare(size="nano").model_dir)
    return model.eval()


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = torch.tensor(r)
        mask[i, T - len(r):] = 1
    return ids, mask


PROMPTS = [[5, 17, 42, 99, 7], [300, 12], [8, 8, 64, 250, 31, 77, 120]]  # different lengths: left padding


def cfg(**kw) -> GenerationConfig:
    return GenerationConfig(**{"max_new_tokens": 12, "stop_ids": (3,), "pad_id": PAD, "temperature": 1.0,
                               "top_k": 0, "top_p": 1.0, **kw})


# ------------------------------------------------------------------------------------------ answer_mask
def loop_answer_mask(answer: torch.Tensor, stop_ids) -> tuple[list[list[bool]], list[bool]]:
    """Reference: walk each row, keep tokens up to and including the first stop token."""
    masks, ended = [], []
    for row in answer.tolist():
        keep, stopped = [], False
        for tok in row:
            keep.append(not stopped)
            if not stopped and tok in stop_ids:
                stopped = True
        masks.append(keep)
        ended.append(stopped)
    return masks, ended


@pytest.mark.parametrize("seed", range(5))
def test_answer_mask_matches_a_loop(seed):
    g = torch.Generator().manual_seed(seed)
    answer = torch.randint(0, 8, (7, 9), generator=g)  # stop ids 3 and 5 appear often, sometimes twice
    answer[0] = 1  # never stops
    answer[1, 0] = 3  # stops at once
    mask, ended = answer_mask(answer, (3, 5))
    want_mask, want_ended = loop_answer_mask(answer, (3, 5))
    assert mask.tolist() == want_mask and ended.tolist() == want_ended
    assert ended[1] and not ended[0] and mask[1].sum() == 1 and mask[0].all()


# ------------------------------------------------------------------------------------------ sampling
def test_num_samples_groups_rows_by_prompt(nano):
    ids, mask = left_padded(PROMPTS)
    K = 3
    out = sample(nano, ids, mask, cfg(seed=1), num_samples=K)
    assert out.seq.shape[0] == len(PROMPTS) * K
    for i, prompt in enumerate(PROMPTS):
        for row in range(i * K, i * K + K):
            assert out.prompt_ids[row][out.prompt_mask[row].bool()].tolist() == prompt, row
    # the K answers to one prompt are K draws, not one answer copied
    for i in range(len(PROMPTS)):
        group = out.answers[i * K:i * K + K]
        assert len({tuple(r.tolist()) for r in group}) > 1, i


def test_a_fixed_seed_repeats_and_leaves_the_global_rng_alone(nano):
    ids, mask = left_padded(PROMPTS)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = sample(nano, ids, mask, cfg(seed=7))
    assert torch.equal(torch.get_rng_state(), state)  # the training stream is untouched
    second = sample(nano, ids, mask, cfg(seed=7))
    other = sample(nano, ids, mask, cfg(seed=8))
    assert torch.equal(first.seq, second.seq) and torch.equal(first.attention_mask, second.attention_mask)
    assert not torch.equal(first.seq, other.seq)
    # seed=None draws from the global stream: it moves, and the same global seed repeats the draw
    torch.manual_seed(5)
    a = sample(nano, ids, mask, cfg())
    assert not torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(5)
    assert torch.equal(sample(nano, ids, mask, cfg()).seq, a.seq)


def test_masks_and_padding_after_the_stop_token(nano):
    ids, mask = left_padded(PROMPTS)
    probe = sample(nano, ids, mask, cfg(seed=3, max_new_tokens=10), num_samples=4)
    # make a frequent token the stop token, so some answers stop early and some do not
    counts = torch.bincount(probe.answers.flatten(), minlength=nano.config.vocab_size)
    stop = int(counts.argmax())
    out = sample(nano, ids, mask, cfg(seed=3, max_new_tokens=10, stop_ids=(stop,)), num_samples=4)
    P = out.prompt_width
    want_mask, want_ended = loop_answer_mask(out.answers, (stop,))
    assert out.answer_mask.tolist() == want_mask and out.ended.tolist() == want_ended
    assert any(want_ended) and not all(want_ended)
    assert torch.equal(out.attention_mask[:, P:].bool(), out.answer_mask)
    assert torch.equal(out.attention_mask[:, :P], mask.repeat_interleave(4, dim=0))
    for row in range(out.seq.shape[0]):
        n = int(out.answer_mask[row].sum())
        assert (out.answers[row, n:] == PAD).all(), row  # everything after the stop token is padding
        if out.ended[row]:
            assert out.answers[row, n - 1] == stop and (out.answers[row, :n - 1] != stop).all()
        else:
            assert n == out.answers.shape[1] == 10
    assert out.lengths.tolist() == [sum(r) for r in want_mask]


@torch.no_grad()
def greedy_loop(model, prompt: list[int], max_new: int, stop: int) -> list[int]:
    """Reference: one unpadded prompt, the full sequence re-run at every step, argmax of the last logits."""
    ids, answer = list(prompt), []
    for _ in range(max_new):
        tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        answer.append(tok)
        ids.append(tok)
        if tok == stop:
            break
    return answer


@pytest.fixture(scope="module")
def varied(nano):
    """The nano model with seeded large random weights: its greedy answers vary from token to token (the
    initialised nano model only repeats the prompt's last token, which a wrong position would not change)."""
    import copy

    model = copy.deepcopy(nano)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 1.0))
    return model.eval()


def test_greedy_is_the_argmax_loop(varied):
    ids, mask = left_padded(PROMPTS)
    free = [greedy_loop(varied, p, 8, stop=-1) for p in PROMPTS]
    assert all(len(set(f)) > 2 for f in free)
    stop = free[0][3]  # answer 0 stops at its 4th token; the others run to the limit unless they meet it
    assert stop not in free[0][:3]
    want = [greedy_loop(varied, p, 8, stop=stop) for p in PROMPTS]
    out = sample(varied, ids, mask, cfg(do_sample=False, max_new_tokens=8, stop_ids=(stop,)))
    got = [a[m].tolist() for a, m in zip(out.answers, out.answer_mask)]
    assert got == want
    assert len(got[0]) == 4 and out.ended[0]
    assert out.ended.tolist() == [w[-1] == stop for w in want]


@pytest.mark.parametrize("do_sample", [False, True])
def test_k_answers_share_one_prefill_of_their_prompt(varied, monkeypatch, do_sample):
    """num_samples = K: the prompts (all but their last token) go through the model once, B rows, and generate
    starts from that cache repeated K times — feeding K·B rows of one token — with the same answers, token for
    token, as K separate prefills (greedy: each copy the argmax loop; sampling: the same seeded draws)."""
    import marlhf.sampler as generation

    ids, mask = left_padded(PROMPTS)
    K, shapes = 3, []
    hook = varied.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                            with_kwargs=True)
    try:
        shared = sample(varied, ids, mask, cfg(do_sample=do_sample, seed=11, max_new_tokens=8), num_samples=K)
        assert shapes[:2] == [(len(PROMPTS), ids.shape[1] - 1), (len(PROMPTS) * K, 1)]
        monkeypatch.setattr(generation, "shared_prefill", lambda *a: None)  # K prefills, as generate alone does
        shapes.clear()
        separate = sample(varied, ids, mask, cfg(do_sample=do_sample, seed=11, max_new_tokens=8), num_samples=K)
        assert shapes[0] == (len(PROMPTS) * K, ids.shape[1])
    finally:
        hook.remove()
    assert torch.equal(shared.seq, separate.seq) and torch.equal(shared.answer_mask, separate.answer_mask)
    if not do_sample:
        got = [a[m].tolist() for a, m in zip(shared.answers, shared.answer_mask)]
        assert got == [greedy_loop(varied, p, 8, stop=3) for p in PROMPTS for _ in range(K)]
    else:  # sampled: the K answers to a prompt are K draws
        assert len({tuple(r.tolist()) for r in shared.answers[:K]}) > 1


@pytest.mark.parametrize("training", [True, False])
def test_the_policys_mode_is_restored(nano, training):
    ids, mask = left_padded(PROMPTS[:1])
    nano.train(training)
    try:
        seen = []
        handle = nano.register_forward_pre_hook(lambda m, args: seen.append(m.training))
        sample(nano, ids, mask, cfg(seed=0, max_new_tokens=2))
        handle.remove()
        assert seen and not any(seen)  # generation itself runs in eval mode (no dropout)
        assert nano.training is training
    finally:
        nano.eval()


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="stop_ids is empty"):
        cfg(max_new_tokens=4, stop_ids=())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        cfg(max_new_tokens=4, stop_ids=(1,), temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        cfg(max_new_tokens=0, stop_ids=(1,))
