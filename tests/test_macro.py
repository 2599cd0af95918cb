"""Macro-action termination rules and aggregation vs slow per-sample loop references (paper §3.2.1, D.1).

References below are written straight from the paper's formulas with Python lists, one sample at a time;
the vectorised code must agree on random right-padded batches whose samples have different lengths
(including 0 and 1 tokens).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from maths_helpers import segments_for_rule

from marlhf.rlhf import macro
from marlhf.rlhf.macro import (
    fixed_starts,
    macro_batch,
    macro_lengths,
    macro_rewards,
    macro_values,
    num_macros,
    ppl_starts,
    randomized_starts,
    segments_from_starts,
    split_last_token,
    to_tokens,
    token_weights,
    word_starts,
)

SEEDS = [0, 1, 2, 3]


# ---------------------------------------------------------------- fixtures and loop references
def random_mask(B: int, T: int, g: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Right-padded mask with lengths drawn at random, forcing an empty, a 1-token and a full sample."""
    lens = torch.randint(0, T + 1, (B,), generator=g).tolist()
    lens[0], lens[1], lens[2] = 0, 1, T
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lens):
        mask[b, :n] = True
    return mask, lens


def seg_from_macro_lengths(macro_lens: list[int], T: int) -> list[int]:
    seg: list[int] = []
    for j, n in enumerate(macro_lens):
        seg += [j] * n
    return seg + [-1] * (T - len(seg))


def macros_of(seg_row: list[int]) -> list[list[int]]:
    """Token positions of each macro action of one sample, from its segment ids."""
    out: list[list[int]] = []
    for k, s in enumerate(seg_row):
        if s < 0:
            continue
        if s == len(out):
            out.append([])
        out[s].append(k)
    return out


def ref_fixed(T_b: int, n: float | None, T: int) -> list[int]:
    if n is None or n == 0 or n == math.inf:
        return [0] * T_b + [-1] * (T - T_b)
    return [k // int(n) for k in range(T_b)] + [-1] * (T - T_b)


def ref_ppl(x: list[float], T: int, max_len: int | None = None) -> list[int]:
    """§3.2.1 literally: keep adding tokens while ppl(ω ∪ a) <= ppl(ω) (exact rational arithmetic)."""
    seg: list[int] = []
    total, count, j = Fraction(0), 0, -1
    for xi in x:
        xf = Fraction(xi)
        if count == 0 or (total + xf) / (count + 1) > total / count or count == max_len:
            j, total, count = j + 1, Fraction(0), 0
        total, count = total + xf, count + 1
        seg.append(j)
    return seg + [-1] * (T - len(seg))


def ref_sigma(L: int, sigma: str) -> list[float]:
    """σ_i for i = 0..|ω|-1 (App. D.1)."""
    if sigma == "equal":
        return [1.0 / L] * L
    if sigma == "unit":
        return [0.0] * (L - 1) + [1.0]
    H = sum(1.0 / (L - i) for i in range(L))
    return [1.0 / ((L - i) * H) for i in range(L)]


def seg_list(seg: torch.Tensor) -> list[list[int]]:
    return seg.tolist()


# ---------------------------------------------------------------- segment ids per rule
def test_fixed_hand_example():
    mask = torch.ones(1, 7, dtype=torch.bool)
    assert segments_from_starts(fixed_starts(mask, 3), mask).tolist() == [[0, 0, 0, 1, 1, 1, 2]]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, None, 0, math.inf])
def test_fixed_matches_loop(seed, n):
    g = torch.Generator().manual_seed(seed)
    mask, lens = random_mask(7, 19, g)
    seg = segments_from_starts(fixed_starts(mask, n), mask)
    assert seg_list(seg) == [ref_fixed(n_b, n, 19) for n_b in lens]


def test_infinite_ngram_is_one_macro_per_sample():
    g = torch.Generator().manual_seed(5)
    mask, lens = random_mask(9, 16, g)
    for n in (None, 0, math.inf):
        seg = segments_for_rule("fixed", mask, ngram=n)
        assert num_macros(seg).tolist() == [1 if n_b else 0 for n_b in lens]


def test_fixed_rejects_bad_n():
    mask = torch.ones(1, 4, dtype=torch.bool)
    for bad in (-1, 2.5, -math.inf, math.nan):
        with pytest.raises(ValueError, match="ngram"):
            fixed_starts(mask, bad)


def test_segments_ignore_padding_starts_and_force_first():
    mask = torch.tensor([[1, 1, 1, 0, 0]], dtype=torch.bool)
    starts = torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.bool)
    assert segments_from_starts(starts, mask).tolist() == [[0, 0, 1, -1, -1]]


def test_left_padded_mask_names_row():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="row 1"):
        fixed_starts(mask, 1)
    with pytest.raises(ValueError, match="row 1"):
        segments_from_starts(mask, mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_randomized_matches_documented_draw(seed):
    """Reference: the documented draw (rand(B, L).argsort) then a per-sample walk through the lengths."""
    lengths, repeat = (2, 3, 5, 10), 3
    mask, lens = random_mask(8, 70, torch.Generator().manual_seed(100 + seed))
    starts = randomized_starts(mask, lengths, repeat, torch.Generator().manual_seed(seed))
    seg = segments_from_starts(starts, mask)
    pool = list(lengths) * repeat
    perm = torch.rand(8, len(pool), generator=torch.Generator().manual_seed(seed)).argsort(dim=1).tolist()
    for b, n_b in enumerate(lens):
        macro_lens, left = [], n_b
        for idx in perm[b]:
            if left == 0:
                break
            macro_lens.append(min(pool[idx], left))
            left -= macro_lens[-1]
        if left:
            macro_lens.append(left)  # the remainder after the list is one last macro action
        assert seg[b].tolist() == seg_from_macro_lengths(macro_lens, 70)


def test_randomized_properties():
    lengths, repeat, T = (2, 3, 5, 10), 3, 80
    mask, lens = random_mask(16, T, torch.Generator().manual_seed(9))
    def draw(seed: int) -> torch.Tensor:
        starts = randomized_starts(mask, lengths, repeat, torch.Generator().manual_seed(seed))
        return segments_from_starts(starts, mask)

    s1, s2, s3 = draw(42), draw(42), draw(43)
    assert torch.equal(s1, s2)  # same seed ⇒ same boundaries
    assert not torch.equal(s1, s3)
    ml = macro_lengths(s1)
    for b, n_b in enumerate(lens):
        row = [x for x in ml[b].tolist() if x > 0]
        assert sum(row) == n_b
        assert all(x in lengths for x in row[:-1])  # every macro but the last uses a listed length
        if n_b > sum(lengths) * repeat:  # long sample: the whole list is used, then the remainder
            assert sorted(row[:-1]) == sorted(list(lengths) * repeat)
            assert row[-1] == n_b - sum(lengths) * repeat
    full = [b for b, n_b in enumerate(lens) if n_b >= 40]
    firsts = {tuple(ml[b, :4].tolist()) for b in full}
    assert len(firsts) > 1  # each sample has its own shuffle


def test_ppl_hand_example():
    # -log p = 3, 1, 2, 2, 5, 1, 1, 4. Running means: 3 → 2 → 2 (tie continues) → 2; 5 > 2 opens ω_1;
    # 5 → 3 → 7/3; 4 > 7/3 opens ω_2.
    x = torch.tensor([[3.0, 1, 2, 2, 5, 1, 1, 4]])
    mask = torch.ones(1, 8, dtype=torch.bool)
    assert segments_from_starts(ppl_starts(mask, -x), mask).tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    # monotone increasing surprisal: every token its own macro action; decreasing: a single one
    inc = -torch.arange(1.0, 7.0).unsqueeze(0)
    dec = -torch.arange(6.0, 0.0, -1).unsqueeze(0)
    m6 = torch.ones(1, 6, dtype=torch.bool)
    assert segments_from_starts(ppl_starts(m6, inc), m6).tolist() == [list(range(6))]
    assert segments_from_starts(ppl_starts(m6, dec), m6).tolist() == [[0] * 6]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["continuous", "ties", "long"])
@pytest.mark.parametrize("window", [1, 3, 32])
def test_ppl_matches_loop(seed, kind, window):
    """Any starting look-ahead window gives the exact rule (the window grows while the chain needs it)."""
    g = torch.Generator().manual_seed(seed)
    mask, lens = random_mask(9, 40, g)
    if kind == "continuous":
        x = torch.rand(9, 40, generator=g) * 5 + 0.01  # float32 surprisals
    elif kind == "ties":  # coarse values: many exact ties between a token and the running mean
        x = torch.randint(0, 5, (9, 40), generator=g).float() * 0.5
    else:  # mostly decreasing surprisal with rare bumps: macro actions of tens of tokens
        x = torch.linspace(8, 0.5, 40).expand(9, 40) + (torch.rand(9, 40, generator=g) < 0.08) * 6.0
    seg = segments_from_starts(ppl_starts(mask, -x, window=window), mask)
    capped = segments_from_starts(ppl_starts(mask, -x, max_len=3), mask)
    for b, n_b in enumerate(lens):
        assert seg[b].tolist() == ref_ppl(x[b, :n_b].tolist(), 40)
        assert capped[b].tolist() == ref_ppl(x[b, :n_b].tolist(), 40, max_len=3)
    assert num_macros(seg).float().mean() > 1.5  # the rule does not collapse to one macro action
    assert not torch.equal(seg, capped)
    if kind == "long":
        assert int(macro_lengths(seg).max()) > 3 * window or window == 32


def test_ppl_rejects_non_finite_logprobs():
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    lp = torch.tensor([[-1.0, -math.inf, -2.0, math.nan]])  # NaN on padding is ignored
    with pytest.raises(ValueError, match="row 0, position 1"):
        ppl_starts(mask, lp)


def test_ppl_max_len_caps_length():
    mask = torch.ones(2, 30, dtype=torch.bool)
    dec = -torch.linspace(10, 1, 30).expand(2, 30)  # uncapped: one macro action
    seg = segments_from_starts(ppl_starts(mask, dec, max_len=8), mask)
    assert macro_lengths(seg)[0].tolist() == [8, 8, 8, 6]


def test_word_rule_matches_loop():
    g = torch.Generator().manual_seed(3)
    V = 50
    table = torch.rand(V, generator=g) < 0.3
    mask, lens = random_mask(8, 25, g)
    ids = torch.randint(0, V, (8, 25), generator=g)
    ids[~mask] = -100  # padding ids may be anything
    seg = segments_for_rule("word", mask, input_ids=ids, word_start_table=table)
    for b, n_b in enumerate(lens):
        ref, j = [], -1
        for k in range(n_b):
            if k == 0 or bool(table[ids[b, k]]):
                j += 1
            ref.append(j)
        assert seg[b].tolist() == ref + [-1] * (25 - n_b)


def test_word_rule_bad_id_names_row():
    mask = torch.ones(2, 3, dtype=torch.bool)
    ids = torch.tensor([[1, 2, 3], [1, 99, 2]])
    with pytest.raises(ValueError, match="row 1, position 1"):
        word_starts(mask, ids, torch.zeros(10, dtype=torch.bool))


@pytest.mark.parametrize("seed", SEEDS)
def test_split_last_token(seed):
    g = torch.Generator().manual_seed(seed)
    mask, lens = random_mask(8, 17, g)
    seg = segments_from_starts(split_last_token(fixed_starts(mask, 4), mask), mask)
    for b, n_b in enumerate(lens):
        ref = [k // 4 for k in range(n_b)]
        if n_b >= 2 and ref[-1] == ref[-2]:
            ref[-1] += 1
        assert seg[b].tolist() == ref + [-1] * (17 - n_b)


def test_unknown_choices_raise():
    mask = torch.ones(1, 4, dtype=torch.bool)
    seg = segments_for_rule("fixed", mask, ngram=2)
    with pytest.raises(ValueError, match="fixed, randomized, ppl, word"):
        segments_for_rule("parser", mask)
    with pytest.raises(ValueError, match="equal, unit, position"):
        macro_values(torch.zeros(1, 4), seg, mask, "mean")
    with pytest.raises(ValueError, match="sum, compat"):
        macro_rewards(torch.zeros(1, 4), seg, mask, "avg")
    with pytest.raises(ValueError, match="ref_logprobs"):
        segments_for_rule("ppl", mask)


# ---------------------------------------------------------------- aggregation
def random_segments(seed: int, B: int = 8, T: int = 21) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random batch with random boundaries (each real token opens a macro action with prob. 0.35)."""
    g = torch.Generator().manual_seed(seed)
    mask, lens = random_mask(B, T, g)
    starts = torch.rand(B, T, generator=g) < 0.35
    return segments_from_starts(starts, mask), mask, lens


@pytest.mark.parametrize("seed", SEEDS)
def test_lengths_counts_and_broadcast(seed):
    seg, _, _ = random_segments(seed)
    mb = macro_batch(seg)
    M = max(len(macros_of(r)) for r in seg.tolist())
    assert mb.lengths.shape == (8, M)
    assert num_macros(seg).tolist() == [len(macros_of(r)) for r in seg.tolist()]
    for b, row in enumerate(seg.tolist()):
        ms = macros_of(row)
        assert mb.lengths[b].tolist() == [len(w) for w in ms] + [0] * (M - len(ms))
        assert mb.macro_mask[b].tolist() == [True] * len(ms) + [False] * (M - len(ms))
    mx = torch.randn(8, M, generator=torch.Generator().manual_seed(seed))
    tok = to_tokens(mx, seg)
    for b, row in enumerate(seg.tolist()):
        assert tok[b].tolist() == [float(mx[b, s]) if s >= 0 else 0.0 for s in row]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sigma", ["equal", "unit", "position"])
def test_macro_values_match_loop(seed, sigma):
    seg, mask, _ = random_segments(seed)
    vals = torch.randn(8, 21, generator=torch.Generator().manual_seed(seed + 50), dtype=torch.float64)
    vals[~mask] = 1e6  # padding garbage must not leak in
    V, mm = macro_values(vals, seg, mask, sigma)
    for b, row in enumerate(seg.tolist()):
        ms = macros_of(row)
        ref = [sum(s * float(vals[b, k]) for s, k in zip(ref_sigma(len(w), sigma), w)) for w in ms]
        ref += [0.0] * (V.shape[1] - len(ms))
        torch.testing.assert_close(V[b], torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        assert mm[b].sum() == len(ms)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode,sigma", [("sum", "equal"), ("compat", "equal"), ("compat", "unit"),
                                        ("compat", "position")])
def test_macro_rewards_match_loop(seed, mode, sigma):
    seg, mask, _ = random_segments(seed)
    rew = torch.randn(8, 21, generator=torch.Generator().manual_seed(seed + 70), dtype=torch.float64)
    rew[~mask] = -1e6
    R, _ = macro_rewards(rew, seg, mask, mode, sigma)
    for b, row in enumerate(seg.tolist()):
        ms = macros_of(row)
        if mode == "sum":  # R_τ = Σ_i ρ^i r_{t_τ+i}, ρ = 1 (§3.2.2)
            ref = [sum(float(rew[b, k]) for k in w) for w in ms]
        else:
            ref = [sum(s * float(rew[b, k]) for s, k in zip(ref_sigma(len(w), sigma), w)) for w in ms]
        ref += [0.0] * (R.shape[1] - len(ms))
        torch.testing.assert_close(R[b], torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_position_sigma_sums_to_one_and_increases():
    mask = torch.ones(1, 1 + 2 + 5 + 9, dtype=torch.bool)
    starts = torch.zeros_like(mask)
    starts[0, [0, 1, 3, 8]] = True
    seg = segments_from_starts(starts, mask)
    w = token_weights(seg, "position")[0]
    for ms in macros_of(seg[0].tolist()):
        ws = w[ms]
        assert abs(float(ws.sum()) - 1.0) < 1e-12
        assert torch.all(ws[1:] > ws[:-1])  # weight grows toward the end of the macro action
        assert abs(float(ws[-1]) - 1.0 / sum(1.0 / j for j in range(1, len(ms) + 1))) < 1e-12
    for sigma in ("equal", "unit"):
        wt = token_weights(seg, sigma)
        sums = [float(wt[0, ms].sum()) for ms in macros_of(seg[0].tolist())]
        assert all(abs(s - 1.0) < 1e-12 for s in sums)


def test_n1_macro_values_are_token_values():
    g = torch.Generator().manual_seed(11)
    mask, _ = random_mask(6, 13, g)
    seg = segments_for_rule("fixed", mask, ngram=1)
    vals = torch.randn(6, 13, generator=g)
    for sigma in macro.SIGMAS:
        V, mm = macro_values(vals, seg, mask, sigma)
        assert torch.equal(V[mm], vals[mask])


def test_empty_batch_shapes():
    mask = torch.zeros(3, 5, dtype=torch.bool)
    seg = segments_for_rule("fixed", mask, ngram=2)
    V, mm = macro_values(torch.randn(3, 5), seg, mask, "position")
    assert V.shape == (3, 0) and mm.shape == (3, 0)
    assert to_tokens(V, seg).shape == (3, 5)
