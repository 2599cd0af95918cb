"""Parser-independent core of the parsing termination rule (paper Appendix B.4, item 3).

Everything here works in *character space* of one response text: a parser backend turns the text into
a tree of `Node`s with character spans, the policy tokenizer's offsets give each policy token a
character *anchor*, and the DFS below cuts the tree into macro actions counted in policy tokens.

Rule, precisely (C = cutoff):
1. Top-level units are "barrier" nodes (sentences for text, statements for code).  A macro action never
   crosses a barrier's start or end.
2. Depth-first: a node covering n policy tokens with n < C is one unit (stop descending); a node with
   n >= C is split into its children; a parser leaf (a word, a code token) is one unit whatever its n.
   Tokens whose anchor lies between the children of a node ("leaves between phrases", e.g. characters
   a parser skipped) become single-token units at that position.
3. Units are grouped into macro actions, within one barrier group, left to right:
   - a single-token unit joins the previous macro action (the paper's rule, so punctuation is not an
     action of its own) while that has fewer than C tokens, and always when it is the group's last unit
     (trailing punctuation, the ':' ending a code header); otherwise it opens a new macro action;
   - a unit of >= 2 tokens opens a new macro action, except that a macro action built only from
     single-token units (a group's leading word, or singles after a full action) absorbs it when the sum
     stays <= C.

Guarantee (tested): every macro action has <= C tokens, except
   (a) C + 1 tokens when its last token is its group's final single-token unit, or
   (b) it contains exactly one parser leaf of >= C tokens (a long word or literal the policy tokenizer
       splits finely), plus possibly its group's final single-token unit.
Single-token macro actions remain only for one-token groups (e.g. a `pass` statement) and for a
single-token unit that follows a full action and precedes a unit too large to absorb it.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

_NON_SPACE = re.compile(r"\S")


class Node:
    """A parse-tree node with a half-open character span [start, end).

    `kids` is None for a parser leaf, a list of children (in text order), or a zero-argument callable
    building that list on first use: most nodes are never descended (they are already < C tokens), so
    backends whose tree objects are expensive to wrap create children lazily.
    """

    __slots__ = ("start", "end", "barrier", "_kids")

    def __init__(
        self,
        start: int,
        end: int,
        kids: list[Node] | Callable[[], list[Node]] | None = None,
        barrier: bool = False,
    ) -> None:
        self.start = start
        self.end = end
        self.barrier = barrier
        self._kids = kids

    @property
    def is_leaf(self) -> bool:
        return self._kids is None

    def children(self) -> list[Node]:
        if callable(self._kids):
            self._kids = self._kids()
        return self._kids or []

    def __repr__(self) -> str:
        kind = "leaf" if self.is_leaf else "node"
        return f"Node({self.start}, {self.end}, {kind}{', barrier' if self.barrier else ''})"


class AlignmentError(Exception):
    """A sample whose policy offsets cannot be aligned with its text; `reason` is the counted key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def token_anchors(text: str, offsets: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Map policy tokens to anchor characters (first non-space char of each token's span).

    Returns (token indices that have an anchor, their anchors), anchors non-decreasing. Tokens with an
    empty span (special tokens) or a whitespace-only span have no anchor: they never start a macro
    action and belong to the preceding one. Raises AlignmentError when the offsets are out of range,
    go backwards, or leave a non-space character of the text uncovered (offsets of another text).
    """
    n_chars = len(text)
    tok_idx: list[int] = []
    anchors: list[int] = []
    prev_start = 0
    reach = 0  # every char before `reach` is covered by some token span (or is whitespace)
    for k, span in enumerate(offsets):
        try:
            s, e = int(span[0]), int(span[1])
        except (TypeError, ValueError, IndexError) as err:
            raise AlignmentError("offsets_invalid", f"token {k}: {span!r}") from err
        if s == e:
            continue
        if s < 0 or e < s or e > n_chars:
            raise AlignmentError("offsets_out_of_range", f"token {k}: ({s}, {e}) for {n_chars} chars")
        if s < prev_start:
            raise AlignmentError("offsets_not_monotonic", f"token {k} starts at {s} < {prev_start}")
        if s > reach and _NON_SPACE.search(text, reach, s):
            raise AlignmentError("text_not_covered", f"chars {reach}..{s} before token {k}")
        prev_start = s
        reach = max(reach, e)
        m = _NON_SPACE.search(text, s, e)
        if m is not None:
            tok_idx.append(k)
            anchors.append(m.start())
    if _NON_SPACE.search(text, reach):
        raise AlignmentError("text_not_covered", f"chars {reach}..{n_chars} after the last token")
    return tok_idx, anchors


@dataclass
class Unit:
    """A run of anchored tokens [a, b) (indices into the anchor list) emitted by the DFS."""

    a: int
    b: int
    group: int
    big_leaf: bool = False  # a parser leaf with >= C tokens


@dataclass
class Macro:
    """One macro action: anchored tokens [a, b) plus bookkeeping used by tests and logs."""

    a: int
    b: int
    group: int
    singles_only: bool
    big_leaf: bool = False
    trailing_single: bool = False  # absorbed its group's final single-token unit beyond C
    units: list[Unit] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.b - self.a


def _has_inner_barrier(node: Node) -> bool:
    """A barrier strictly inside `node` (e.g. the `pass` statement inside a 3-token `else: pass`)."""
    stack = list(node.children()) if not node.is_leaf else []
    while stack:
        n = stack.pop()
        if n.barrier:
            return True
        if not n.is_leaf:
            stack.extend(n.children())
    return False


def dfs_units(root: Node, anchors: list[int], cutoff: int, nested_barriers: bool = True) -> list[Unit]:
    """Depth-first cut of the tree into units (rules 1-2 of the module docstring), iteratively.

    With `nested_barriers` (code: statements inside statements) a node below C tokens is still
    descended when a barrier lies inside it, so that barrier keeps its own macro action; text backends
    pass False (their barriers, sentences, are only children of the root) to skip that walk."""
    units: list[Unit] = []
    group = 0
    pos = 0  # anchors before `pos` are already in a unit
    stack: list[tuple[Node | None, int, bool]] = [(root, 0, False)]
    while stack:
        node, end_a, barrier = stack.pop()
        if node is None:  # end marker of a descended node: its trailing gap, then the barrier exit
            while pos < end_a:
                units.append(Unit(pos, pos + 1, group))
                pos += 1
            if barrier:
                group += 1
            continue
        a = max(bisect_left(anchors, node.start), pos)
        b = bisect_left(anchors, node.end)
        if b <= a:
            continue
        while pos < a:  # anchors between the previous unit and this node: single-token units
            units.append(Unit(pos, pos + 1, group))
            pos += 1
        if node.barrier:
            group += 1
        n = b - a
        small = n < cutoff and not (nested_barriers and _has_inner_barrier(node))
        if small or node.is_leaf or not node.children():
            units.append(Unit(a, b, group, big_leaf=n >= cutoff))
            pos = b
            if node.barrier:
                group += 1
            continue
        stack.append((None, b, node.barrier))
        for child in reversed(node.children()):
            stack.append((child, 0, False))
    while pos < len(anchors):  # anchors after the root's span
        units.append(Unit(pos, pos + 1, group))
        pos += 1
    return units


def merge_units(units: list[Unit], cutoff: int) -> list[Macro]:
    """Group units into macro actions (rule 3 of the module docstring)."""
    macros: list[Macro] = []
    for i, u in enumerate(units):
        n = u.b - u.a
        cur = macros[-1] if macros and macros[-1].group == u.group else None
        last_in_group = i + 1 == len(units) or units[i + 1].group != u.group
        if n == 1 and cur is not None and (cur.size < cutoff or last_in_group):
            cur.trailing_single = cur.size >= cutoff
            cur.b = u.b
            cur.units.append(u)
        elif n > 1 and cur is not None and cur.singles_only and cur.size + n <= cutoff:
            cur.b = u.b
            cur.singles_only = False
            cur.big_leaf = u.big_leaf
            cur.units.append(u)
        else:
            macros.append(Macro(u.a, u.b, u.group, singles_only=n == 1, big_leaf=u.big_leaf, units=[u]))
    return macros


def segment_tree(root: Node, anchors: list[int], cutoff: int, nested_barriers: bool = True) -> list[Macro]:
    """Macro actions of one parsed sample (anchored-token index ranges, in order, covering all)."""
    return merge_units(dfs_units(root, anchors, cutoff, nested_barriers), cutoff)
