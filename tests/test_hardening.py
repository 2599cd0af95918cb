"""Review fixes in the maths and the segmenter: bounded memory of the ppl rule (still exact), float32 maths
for bf16 callers, empty batches and NaN padding, and per-generation-batch seeding of the randomized rule."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_macro import ref_ppl

from marlhf.embedded import default_model
from marlhf.rlhf.macro import ppl_starts, segments_from_starts
from marlhf.rlhf.ppo_math import compute_advantages, policy_loss, token_rewards, value_loss


# ------------------------------------------------------------------------------------------- ppl memory
def test_ppl_rule_bounds_its_temporaries_and_stays_exact(monkeypatch):
    """Repetitive text (non-increasing surprisal for long stretches) grows the look-ahead to T; processing it
    in blocks keeps every (B, block, W) temporary within chunk_elements and gives the loop's answer."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 120
    x = torch.linspace(6, 1, T).expand(B, T).clone()  # one long macro action per row ...
    x[:, 70] += 8.0 * (torch.rand(B, generator=g) < 0.5)  # ... broken at t = 70 in about half the rows
    lens = [120, 119, 64, 100, 120, 7]
    mask = torch.arange(T)[None, :] < torch.tensor(lens)[:, None]
    sizes = []
    real_addcmul = torch.addcmul

    def spy(*args, **kw):
        out = real_addcmul(*args, **kw)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(torch, "addcmul", spy)
    budget = 3000  # tiny, so the windows (up to W = T = 120) are cut into many blocks
    seg = segments_from_starts(ppl_starts(mask, -x, window=4, chunk_elements=budget), mask)
    # the window grew (rows 0 and 4 are one macro action of T tokens) and each pass was cut into blocks of
    # budget // (B·W) starts: every temporary stays within the budget, the last passes had W = T
    assert max(sizes) <= budget and 4 * B * T in sizes
    for b, n in enumerate(lens):
        assert seg[b].tolist() == ref_ppl(x[b, :n].tolist(), T)
    unbounded = segments_from_starts(ppl_starts(mask, -x, window=4, chunk_elements=1 << 40), mask)
    assert torch.equal(seg, unbounded)
    # the size argument at the worst case, B = 64, T = W = 2048: one float64 + one bool per element
    from marlhf.rlhf.macro import PPL_CHUNK_ELEMENTS

    assert 64 * 2048 * 2048 * 9 / 2**30 > 2.2  # GiB without blocks
    assert PPL_CHUNK_ELEMENTS * 9 / 2**20 < 200  # MiB with them (plus O(B·T) buffers)


# ------------------------------------------------------------------------------------------ dtypes, NaN
def _batch(dtype):
    g = torch.Generator().manual_seed(1)
    B, T = 4, 9
    mask = torch.arange(T)[None, :] < torch.tensor([9, 5, 1, 7])[:, None]
    lp = (-torch.rand(B, T, generator=g) * 3).to(dtype)
    old = (lp.float() + torch.randn(B, T, generator=g) * 0.1).to(dtype)
    adv = torch.randn(B, T, generator=g).to(dtype)
    return mask, lp, old, adv


def test_bf16_inputs_give_the_float32_numbers():
    mask, lp, old, adv = _batch(torch.bfloat16)
    loss16, stats16 = policy_loss(lp, old, adv, mask, 0.2)
    loss32, stats32 = policy_loss(lp.float(), old.float(), adv.float(), mask, 0.2)
    assert loss16.dtype == torch.float32 and torch.equal(loss16, loss32)
    assert all(torch.equal(stats16[k], stats32[k]) for k in stats32)
    score = torch.tensor([0.3, -1.7, 2.2, 0.9], dtype=torch.bfloat16)
    r16 = token_rewards(lp, old, mask, score, 0.05, 5.0)
    r32 = token_rewards(lp.float(), old.float(), mask, score.float(), 0.05, 5.0)
    assert r16.dtype == torch.float32 and torch.equal(r16, r32)
    v16, _ = value_loss(adv, old, lp, mask, 0.2)
    assert torch.equal(v16, value_loss(adv.float(), old.float(), lp.float(), mask, 0.2)[0])


def test_nan_in_padding_reaches_neither_losses_nor_gradients():
    mask, lp, old, adv = _batch(torch.float32)
    pad = ~mask
    lp = lp.clone().requires_grad_()
    values = adv.clone().requires_grad_()
    nan_old, nan_adv = old.masked_fill(pad, math.nan), adv.masked_fill(pad, math.nan)
    with torch.no_grad():
        lp_nan = lp.masked_fill(pad, math.nan)
    lp_nan.requires_grad_()
    pl, _ = policy_loss(lp_nan, nan_old, nan_adv, mask, 0.2, seg=segments_from_starts(mask, mask), ratio="macro")
    pl.backward()
    assert torch.isfinite(pl) and torch.isfinite(lp_nan.grad).all() and (lp_nan.grad[pad] == 0).all()
    ref, _ = policy_loss(lp, old, adv, mask, 0.2, seg=segments_from_starts(mask, mask), ratio="macro")
    assert torch.equal(pl, ref)
    vl, _ = value_loss(values, nan_old, nan_adv, mask, 0.2)
    vl.backward()
    assert torch.isfinite(vl) and torch.isfinite(values.grad).all()
    seg = segments_from_starts(mask, mask)
    A, Q, stats = compute_advantages(adv.masked_fill(pad, math.nan), old.masked_fill(pad, math.inf), mask, seg)
    assert torch.isfinite(A).all() and torch.isfinite(Q).all() and all(torch.isfinite(v) for v in stats.values())


def test_compute_advantages_on_an_empty_batch_has_zero_statistics():
    empty = torch.zeros(0, 6)
    mask = torch.zeros(0, 6, dtype=torch.bool)
    A, Q, stats = compute_advantages(empty, empty, mask, torch.full((0, 6), -1))
    assert A.shape == Q.shape == (0, 6)
    assert {k: float(v) for k, v in stats.items()} == {k: 0.0 for k in stats}


# ----------------------------------------------------------------------------------- randomized seeding
def test_randomized_rule_differs_per_generation_batch_and_repeats_per_seed(embedded):
    from marlhf.models.loading import load_tokenizer
    from marlhf.rlhf.sections import MacroSection
    from marlhf.rlhf.segmentation import MacroSegmenter

    section = MacroSection(termination_condition="randomized", ngram=5, repeat_times=3, parser_backend="auto",
                           parser_cutoff=5, parser_model="", response_kind="text", lowprob_threshold=0.1,
                           lowprob_model="reference", split_last=False)
    seg_fn = MacroSegmenter(section, load_tokenizer(default_model("")), seed=0)
    mask = torch.ones(8, 60, dtype=torch.bool)
    answer = torch.zeros(8, 60, dtype=torch.long)
    lp = torch.zeros(8, 60)
    first, _ = seg_fn(answer, mask, lp, step=3, batch=0)
    second, _ = seg_fn(answer, mask, lp, step=3, batch=1)
    again, _ = seg_fn(answer, mask, lp, step=3, batch=0)
    assert torch.equal(first, again)  # seeded: a resumed run draws the same boundaries
    assert all(not torch.equal(first[i], second[i]) for i in range(8))  # row i differs between the batches
    assert not torch.equal(first, seg_fn(answer, mask, lp, step=4, batch=0)[0])


@pytest.mark.parametrize("parts", [(0, 1, 0, 0), (0, 0, 101, 0), (0, 0, 0, 101)])
def test_stream_seeds_do_not_collide(parts):
    from marlhf.rlhf.segmentation import stream_seed

    assert stream_seed(*parts) != stream_seed(0, 0, 0, 0) and stream_seed(*parts) == stream_seed(*parts)


# --------------------------------------------------------------------------------------- plain-text ptx
@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_plain_text_ptx_trains_on_every_token(embedded, tmp_path, kind):
    from marlhf.data.pipeline import SFTCollator
    from marlhf.models.loading import load_tokenizer
    from marlhf.rlhf.ptx import ptx_items
    from marlhf.sections import DataSection

    docs = ["The cat sat on the mat. " * 6, "A second document, about dogs and parks. " * 5, "Short one."]
    if kind == "txt":
        path = tmp_path / "corpus.txt"
        path.write_bytes(b"\xef\xbb\xbf" + "\n\n".join(docs).encode())
    else:
        path = tmp_path / "corpus.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = load_tokenizer(default_model(""))
    data = DataSection(data_path=(), data_output_path="", split_seed=0, eval_fraction=0.0, max_eval_samples=0,
                       max_seq_len=0, max_prompt_seq_len=24, end_of_conversation_token="<|endoftext|>",
                       prompt_format="raw")
    items = ptx_items(str(path), tok, data, max_answer_seq_len=16)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    expected = []
    for d in docs:
        text = d.strip() if kind == "txt" else d  # paragraphs of a .txt are stripped, json text kept as is
        expected += tok(text, add_special_tokens=False)["input_ids"] + [eot]
    assert [t for it in items for t in it["input_ids"]] == expected  # nothing dropped, nothing reordered
    assert all(len(it["input_ids"]) == 40 for it in items[:-1])  # blocks of max_prompt + max_answer tokens
    batch = SFTCollator(tok.pad_token_id)(items)
    real = batch["attention_mask"].bool()
    assert torch.equal(batch["labels"] != -100, real)  # loss on every token (only padding ignored)


def test_prompt_chosen_ptx_data_keeps_the_response_loss(embedded):
    from marlhf.models.loading import load_tokenizer
    from marlhf.rlhf.ptx import ptx_items
    from marlhf.sections import DataSection

    data = DataSection(data_path=(), data_output_path="", split_seed=0, eval_fraction=0.0, max_eval_samples=0,
                       max_seq_len=0, max_prompt_seq_len=160, end_of_conversation_token="<|endoftext|>",
                       prompt_format="raw")
    items = ptx_items("synthetic:num_records=50", load_tokenizer(default_model("")), data, max_answer_seq_len=64)
    assert items and all(it["response_start"] > 0 for it in items)
