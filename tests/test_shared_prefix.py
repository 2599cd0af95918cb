"""Step 2 runs each preference pair's shared prefix once (``PairCollator`` + ``pair_hidden_states``).

A pair's chosen and rejected sequences share the prompt (and often the first answer words); the collator lays
the pair out so that those columns are identical in both rows, and the reward model computes them for one row
and lets both rows' remaining columns attend to them through the KV cache.  Checked against a loop of
unpadded single-sequence forwards of plain transformers, for Llama, Gemma, Gemma-2 (with a sliding window
shorter than the prompts) and GPT-2: the per-token values, the scores, the pairwise loss and its gradient;
and a hook on the embeddings counts the tokens that went through the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForSequenceClassification

from marlhf.data.pipeline import PairCollator
from marlhf.models.forward import last_token_index, pair_hidden_states, sequence_scores, token_values
from marlhf.supervised import divergence_span, reward_loss

V = 37
ARCHS = {
    "llama": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1),
    "gemma": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16),
    "gemma2": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, sliding_window=4),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2),
}
# (prompt, chosen answer, rejected answer); the two answers of a pair may share their first tokens
SHAPES = [(6, [9, 9, 9], [9, 9, 4, 4, 4]),   # answers share two tokens
          (3, [7, 8], [5]),                  # differ at once; rejected ends first
          (9, [6, 6, 6, 6], [6, 6, 6, 6, 2]),  # chosen is a prefix of rejected
          (4, [3, 5], [3, 5])]               # identical: each row keeps its last token


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_labels=1,
                               **ARCHS[arch])
    model = AutoModelForSequenceClassification.from_config(cfg).eval()
    # float32 for Gemma-2: in float64 transformers' Gemma-2 makes whole left-padded rows NaN
    return model if arch == "gemma2" else model.double()


def _pairs(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, chosen, rejected in SHAPES:
        prompt = torch.randint(3, V, (p,), generator=g).tolist()
        out.append({"chosen_ids": prompt + chosen, "rejected_ids": prompt + rejected,
                    "chosen_start": p, "rejected_start": p})
    return out


def _loop(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """(T, H) last hidden states of each sequence, one unpadded forward per sequence."""
    base = getattr(model, model.base_model_prefix)
    with torch.no_grad():
        return [base(input_ids=torch.tensor([s])).last_hidden_state[0].double() for s in seqs]


def _tol(model) -> float:
    """Float64 rounding, or float32's: Gemma's RMSNorm computes in float32 whatever the model's dtype."""
    exact = next(model.parameters()).dtype == torch.float64 and model.config.model_type != "gemma"
    return 1e-10 if exact else 2e-5


def _row_seqs(pairs: list[dict]) -> list[list[int]]:
    """The distinct sequences of ``pairs`` in the collator's row order: first seen among the chosen, then the
    rejected ones."""
    out = []
    for seq in [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs]:
        if seq not in out:
            out.append(seq)
    return out


def _shared(batch: dict) -> dict:
    return {"prefix_width": batch["prefix_width"], "prefix_index": batch["prefix_index"]}


def test_collator_lays_each_pair_out_around_its_shared_prefix():
    pairs = _pairs()
    batch = PairCollator(0)(pairs)
    ids, mask, start, P = batch["input_ids"], batch["attention_mask"], batch["response_start"], batch["prefix_width"]
    # distinct pairs: chosen rows [0, B) over rejected rows [B, 2B), except the identical pair's one row
    assert batch["chosen"].tolist() == [0, 1, 2, 3] and batch["rejected"].tolist() == [4, 5, 6, 3]
    assert batch["prefix_index"].tolist() == [0, 1, 2, 3, 0, 1, 2]
    # shared: the prompt plus the answers' common start, each side keeping one token of its own
    shared = [6 + 2, 3, 9 + 3, 4 + 1]
    assert P == max(shared) == 12
    for i, (pair, k) in enumerate(zip(pairs, shared)):
        c, r = batch["chosen"][i], batch["rejected"][i]
        assert torch.equal(ids[c, :P], ids[r, :P]) and torch.equal(mask[c, :P], mask[r, :P])
        for row, seq, s in ((c, pair["chosen_ids"], pair["chosen_start"]),
                            (r, pair["rejected_ids"], pair["rejected_start"])):
            real = mask[row].bool()
            assert ids[row][real].tolist() == seq  # the sequence, in order, padding removed
            assert mask[row, :P].sum() == k and mask[row, P:].sum() == len(seq) - k  # left pad, then right pad
            assert ids[row, start[row]].item() == seq[s]  # the first answer token, moved with its row
            assert start[row] == s + P - k
            assert last_token_index(mask)[row] == P + len(seq) - k - 1
    # DeepSpeed-Chat's divergence span, in the columns of this layout (rows of each pair: chosen over rejected)
    rows = torch.cat([batch["chosen"], batch["rejected"]])
    first, end = divergence_span(ids[rows], mask[rows])
    assert first.tolist() == [P, P, P + 1, P] and end.tolist() == [P + 3, P + 2, P + 2, P + 1]


def _ranked(seed: int, k: int = 4) -> list[dict]:
    """All pairs of ``k`` answers to each of two prompts (``marlhf label``'s pairs, InstructGPT's batches),
    then one pair of a third prompt; answers may share their first tokens, and one prompt is longer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in (5, 8):
        prompt = torch.randint(3, V, (p,), generator=g).tolist()
        answers = [[9] + torch.randint(3, V, (n,), generator=g).tolist() for n in range(1, k + 1)]
        out += [{"chosen_ids": prompt + answers[a], "rejected_ids": prompt + answers[b], "chosen_start": p,
                 "rejected_start": p} for a in range(k) for b in range(a + 1, k)]
    return out + _pairs(seed)[:1]


def test_the_pairs_of_one_prompt_share_their_rows_and_its_prefix():
    pairs = _ranked(0)
    batch = PairCollator(0)(pairs)
    ids, mask, P = batch["input_ids"], batch["attention_mask"], batch["prefix_width"]
    seqs = _row_seqs(pairs)
    assert len(seqs) == ids.shape[0] == 4 + 4 + 2  # 12 + 1 pairs, 10 distinct sequences
    for row, seq in enumerate(seqs):
        assert ids[row][mask[row].bool()].tolist() == seq
    for i, pair in enumerate(pairs):
        assert seqs[batch["chosen"][i]] == pair["chosen_ids"] and seqs[batch["rejected"][i]] == pair["rejected_ids"]
    group = batch["prefix_index"].tolist()
    assert sorted(set(group)) == [0, 1, 2] and [group.count(k) for k in range(3)] == [4, 4, 2]
    # a group's rows agree on its shared columns: its prompt and the answers' common first token
    for k, shared in ((0, 5 + 1), (1, 8 + 1)):
        members = [r for r in range(len(seqs)) if group[r] == k]
        for r in members:
            assert torch.equal(ids[r, :P], ids[members[0], :P]) and mask[r, :P].sum() == shared


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hidden_states_values_and_scores_match_unpadded_forwards(arch):
    model = _model(arch)
    for pairs in (_pairs(1), _ranked(1)):  # distinct pairs; all pairs of 4 answers to each of two prompts
        batch = PairCollator(0)(pairs)
        want = _loop(model, _row_seqs(pairs))
        ids, mask, P, index = batch["input_ids"], batch["attention_mask"], batch["prefix_width"], batch["prefix_index"]
        _check_rows(model, ids, mask, P, index, want)


def _check_rows(model, ids, mask, P, index, want):
    base = getattr(model, model.base_model_prefix)
    tol = _tol(model)
    with torch.no_grad():
        for width in (P, 0):  # shared prefix run once, and the plain forward of the same layout
            hidden = pair_hidden_states(base, ids, mask, width, index)
            for row, expected in enumerate(want):
                torch.testing.assert_close(hidden[row][mask[row].bool()].double(), expected, rtol=tol, atol=tol)
            # the head's values (taken in float32) on every real token, and the score at the last one
            values = token_values(model, ids, mask, prefix_width=width, prefix_index=index)
            for row, expected in enumerate(want):
                head = model.score(expected.to(next(model.parameters()).dtype))[:, 0].float()
                torch.testing.assert_close(values[row][mask[row].bool()], head, rtol=2e-5, atol=2e-5)
            scores = sequence_scores(model, ids, mask, prefix_width=width, prefix_index=index)
            torch.testing.assert_close(scores, values.gather(1, last_token_index(mask)[:, None])[:, 0])


def _loop_loss(model, pairs: list[dict], label_smoothing: float, kind: str) -> torch.Tensor:
    """The reward loss and accuracy as a loop over pairs, each sequence run alone and unpadded."""
    terms, right = [], 0
    for p in pairs:
        c = model(input_ids=torch.tensor([p["chosen_ids"]])).logits[0, 0].float()
        r = model(input_ids=torch.tensor([p["rejected_ids"]])).logits[0, 0].float()
        right += int(c > r)
        if kind == "last":
            deltas = (c - r)[None]
        else:  # per-token rewards from the first differing position to the end of the longer one
            base = getattr(model, model.base_model_prefix)
            vc = model.score(base(input_ids=torch.tensor([p["chosen_ids"]])).last_hidden_state)[0, :, 0].float()
            vr = model.score(base(input_ids=torch.tensor([p["rejected_ids"]])).last_hidden_state)[0, :, 0].float()
            a, b = p["chosen_ids"], p["rejected_ids"]
            end = max(len(a), len(b))
            first = next((t for t in range(end) if t >= min(len(a), len(b)) or a[t] != b[t]), end - 1)
            first = min(first, end - 1)
            deltas = torch.stack([vc[min(t, len(a) - 1)] - vr[min(t, len(b) - 1)] for t in range(first, end)])
        per = -((1 - label_smoothing) * F.logsigmoid(deltas) + label_smoothing * F.logsigmoid(-deltas))
        terms.append(per.mean())
    return torch.stack(terms).mean(), right / len(pairs)


@pytest.mark.parametrize("kind", ["last", "divergence"])
@pytest.mark.parametrize("ranked", [False, True])
def test_loss_and_gradient_equal_a_loop_over_the_pairs(kind, ranked):
    pairs = _ranked(2) if ranked else _pairs(2)
    batch = PairCollator(0)(pairs)
    grads, losses, accuracies = [], [], []
    for width in (batch["prefix_width"], 0, "loop"):
        model = _model("llama").train()
        if width == "loop":
            loss, accuracy = _loop_loss(model, pairs, 0.1, kind)
        else:
            loss, metrics = reward_loss(model, {**batch, "prefix_width": width}, 0.1, kind)
            accuracies.append(metrics["accuracy"].item())
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    # float64 model, the head's values taken in float32 (as for every dtype): equal to float32 rounding
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and losses[0] == pytest.approx(losses[2], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grads[0], grads[2], rtol=1e-4, atol=1e-7)
    assert grads[0].abs().sum() > 0
    assert accuracies == pytest.approx([accuracy, accuracy], rel=1e-6)


@pytest.mark.parametrize("ranked", [False, True])
def test_the_shared_columns_go_through_the_model_once(ranked):
    model = _model("llama")
    pairs = _ranked(3) if ranked else _pairs(3)
    batch = PairCollator(0)(pairs)
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    with torch.no_grad():
        token_values(model, batch["input_ids"], batch["attention_mask"], **_shared(batch))
    rows, width = batch["input_ids"].shape
    P, groups = batch["prefix_width"], int(batch["prefix_index"].max()) + 1
    assert (rows, groups) == ((10, 3) if ranked else (7, 4))  # distinct sequences, prompts
    assert seen == [groups * P, rows * (width - P)]
    assert sum(seen) < rows * width < 2 * len(pairs) * width


def _checkpointing(model, on: bool) -> None:
    """transformers >= 5.23 calls it activation checkpointing, older releases gradient checkpointing."""
    name = "enable" if on else "disable"
    (getattr(model, f"activation_checkpointing_{name}", None) or getattr(model, f"gradient_checkpointing_{name}"))()


def test_gradient_checkpointing_takes_the_plain_forward():
    """Under gradient checkpointing transformers drops the KV cache in training: the pair runs unshared."""
    model = _model("llama").train()
    _checkpointing(model, True)
    batch = PairCollator(0)(_pairs(4))
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    loss, _ = reward_loss(model, batch)
    loss.backward()
    assert seen[0] == batch["input_ids"].numel()
    _checkpointing(model, False)
    model.eval()
    with torch.no_grad():
        plain = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    model.train()
    _checkpointing(model, True)
    seen.clear()
    with torch.no_grad():
        model.eval()  # eval: the shared path again (prefix of one row per prompt, then every row's rest)
        shared = sequence_scores(model, batch["input_ids"], batch["attention_mask"], **_shared(batch))
    rows, width = batch["input_ids"].shape
    P, groups = batch["prefix_width"], int(batch["prefix_index"].max()) + 1
    assert P > 0 and seen == [groups * P, rows * (width - P)]
    torch.testing.assert_close(shared, plain, rtol=1e-6, atol=1e-6)


def test_likelihood_term_reads_the_moved_answer_start():
    """A reward model with the likelihood term (the tiny scripts' step 2): α · Σ log p(answer) is read from the
    answer columns of the shared layout; scores equal those of the plain right-padded layout of step 2."""
    from marlhf import embedded
    from marlhf.data.pipeline import _pad
    from marlhf.models.loading import load_reward_model, load_tokenizer

    folder = str(embedded.prepare(size="nano").model_dir)
    tok = load_tokenizer(folder, "<|endoftext|>")
    model = load_reward_model(folder, tok, likelihood_term=True).eval()
    g = torch.Generator().manual_seed(5)
    pairs = []
    for p, chosen, rejected in SHAPES:
        prompt = torch.randint(3, 200, (p,), generator=g).tolist()
        pairs.append({"chosen_ids": prompt + [c + 20 for c in chosen], "chosen_start": p,
                      "rejected_ids": prompt + [r + 20 for r in rejected], "rejected_start": p})
    batch = PairCollator(tok.pad_token_id)(pairs)
    seqs = [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs]
    ids, mask = _pad(seqs, tok.pad_token_id)
    starts = torch.tensor([p["chosen_start"] for p in pairs] + [p["rejected_start"] for p in pairs])
    rows = torch.cat([batch["chosen"], batch["rejected"]])
    with torch.no_grad():
        plain = sequence_scores(model, ids, mask, starts)
        shared = sequence_scores(model, batch["input_ids"], batch["attention_mask"], batch["response_start"],
                                 **_shared(batch))[rows]
        head_only = sequence_scores(model, batch["input_ids"], batch["attention_mask"],
                                    batch["input_ids"].shape[1], **_shared(batch))[rows]
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-4)
    assert (shared < head_only - 1).all()  # the term is there: every answer's log-probability is well below 0


def test_step_2_batches_a_prompts_pairs_together():
    """The reward objective's sampler groups (a pair's prompt tokens) + the collator: ranked data's batches run
    each answer once; distinct pairs keep the plain sampler's batches."""
    from marlhf.data.pipeline import ResumableSampler
    from marlhf.supervised import reward_objective

    objective = reward_objective(0)
    ranked = _ranked(4, k=4)[:12] + _ranked(5, k=4)[:12]  # 4 prompts, 6 pairs each
    keys = [objective.group(p) for p in ranked]
    assert len(set(keys)) == 4 and all(keys[i] == keys[6 * (i // 6)] for i in range(len(ranked)))
    order = list(ResumableSampler(len(ranked), 0, batch_size=6, groups=keys))
    batches = [objective.collator([ranked[i] for i in order[b:b + 6]]) for b in range(0, len(order), 6)]
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 4, 4]  # 6 pairs of 4 answers: 4 rows, not 12
    assert all(int(b["prefix_index"].max()) == 0 for b in batches)  # one prompt per batch, its prefix run once
    distinct = _pairs(0) + _pairs(1) + _pairs(2)
    groups = [objective.group(p) for p in distinct]
    assert len(set(groups)) == len(distinct)
    assert list(ResumableSampler(len(distinct), 0, groups=groups)) == list(ResumableSampler(len(distinct), 0))
