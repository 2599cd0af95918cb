"""`ParseSegmenter`: response texts + policy offsets -> macro-action start flags (paper Appendix B.4).

The trainer calls `starts()` once per experience batch (CPU side, before the vectorised loss path);
`seg = starts.cumsum(-1) - 1` then gives the segment ids of docs/design.md "Macro actions, precisely".
Samples whose parse cannot be aligned fall back to fixed-n starts and are counted by reason — the
paper "reverts to standard PPO" there; we revert to the `fixed` rule, which is what the step expects.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from marlhf.parsing.backends import (
    BACKENDS,
    CODE_BACKENDS,
    DEFAULT_BENEPAR_MODEL,
    TEXT_BACKENDS,
    ParseFailure,
    benepar_model_available,
)
from marlhf.parsing.core import AlignmentError, Macro, Node, segment_tree, token_anchors

logger = logging.getLogger(__name__)

KINDS = {"text": TEXT_BACKENDS, "code": CODE_BACKENDS}


@dataclass
class SampleSegmentation:
    """Segmentation of one sample: `starts` are token indices where a macro action begins."""

    starts: list[int]
    fell_back: bool = False
    reason: str | None = None
    detail: str = ""
    macros: list[Macro] = field(default_factory=list)  # empty on fallback
    anchor_tokens: list[int] = field(default_factory=list)  # token index of each anchored token

    def macro_token_ranges(self, num_tokens: int) -> list[tuple[int, int]]:
        """[start, end) token ranges of the macro actions, covering 0..num_tokens."""
        bounds = [*self.starts, num_tokens]
        return [(bounds[i], bounds[i + 1]) for i in range(len(self.starts))]


def resolve_backend(kind: str, backend: str) -> str:
    """Validate (kind, backend) and resolve "auto": benepar if its model is installed, else spaCy, for
    text; tree-sitter for code (it parses unfinished code, which redbaron cannot)."""
    if kind not in KINDS:
        raise ValueError(f"ParseSegmenter kind must be one of {sorted(KINDS)}, got {kind!r}")
    valid = KINDS[kind]
    if backend == "auto":
        if kind == "code":
            return "treesitter"
        # The project-built benepar model is weaker than spaCy's parser: "auto" picks benepar only for
        # the released model; `backend="benepar"` uses the project-built one when that is missing.
        if benepar_model_available(DEFAULT_BENEPAR_MODEL):
            logger.info("parsing backend auto -> benepar (the released %r is installed)", DEFAULT_BENEPAR_MODEL)
            return "benepar"
        logger.info("parsing backend auto -> spacy (benepar model %r not installed)", DEFAULT_BENEPAR_MODEL)
        return "spacy"
    if backend not in valid:
        raise ValueError(
            f"parsing backend {backend!r} is not valid for kind={kind!r}; valid: {['auto', *valid]}"
        )
    return backend


class ParseSegmenter:
    """Parsing-based termination rule (paper Appendix B.4 item 3; rule details in `core`).

    kind: "text" (sentences, constituents) or "code" (Python statements, syntax nodes).
    backend: "auto", or one of benepar/spacy (text), treesitter/redbaron (code).
    cutoff: C; a node with fewer than C policy tokens is one macro action.
    fallback_n: n of the fixed-n starts given to samples that cannot be aligned.
    model: optional spaCy pipeline / benepar model name or path (backend default otherwise; for benepar
        the released benepar_en3 if installed, else the project-built model, see `backends`).
    """

    def __init__(
        self,
        kind: str = "text",
        backend: str = "auto",
        cutoff: int = 5,
        fallback_n: int = 5,
        model: str | None = None,
    ) -> None:
        if cutoff < 2:
            raise ValueError(f"parser cutoff C must be >= 2 (nodes with < C tokens are macros), got {cutoff}")
        if fallback_n < 1:
            raise ValueError(f"fallback_n must be >= 1, got {fallback_n}")
        self.kind = kind
        self.backend_name = resolve_backend(kind, backend)
        self.backend = BACKENDS[self.backend_name](model)  # RuntimeError if package/model missing
        self.cutoff = cutoff
        self.fallback_n = fallback_n
        self.num_samples = 0
        self.num_fallbacks = 0
        self.fallback_reasons: Counter[str] = Counter()
        self.last_details: list[str] = []  # fallback details of the last call, for debugging

    # ------------------------------------------------------------------------------------- per sample
    def _fallback(self, num_tokens: int, reason: str, detail: str = "") -> SampleSegmentation:
        starts = list(range(0, num_tokens, self.fallback_n))
        return SampleSegmentation(starts, fell_back=True, reason=reason, detail=detail)

    def _segment_parsed(
        self, aligned: tuple[list[int], list[int]], tree: Node | ParseFailure, T_b: int
    ) -> SampleSegmentation:
        if isinstance(tree, ParseFailure):
            return self._fallback(T_b, tree.reason, tree.detail)
        tok_idx, anchors = aligned
        if not anchors:  # whitespace or special tokens only: one macro action
            return SampleSegmentation([0])
        macros = segment_tree(tree, anchors, self.cutoff, self.backend.nested_barriers)
        starts = [tok_idx[m.a] for m in macros]
        starts[0] = 0  # leading anchor-less tokens (e.g. a BOS-like or space token) join the first
        return SampleSegmentation(starts, macros=macros, anchor_tokens=tok_idx)

    def _parse(self, texts: list[str]) -> list[Node | ParseFailure]:
        """Parse a batch; if the parser raises on the batch, parse one by one so only the offending
        samples fall back. A missing parser or model is not a sample's fault: `load` raises."""
        self.backend.load()
        try:
            return self.backend.parse(texts)
        except Exception:  # noqa: BLE001
            out: list[Node | ParseFailure] = []
            for text in texts:
                try:
                    out.extend(self.backend.parse([text]))
                except Exception as err:  # noqa: BLE001
                    out.append(ParseFailure("parse_error", f"{self.backend_name}: {type(err).__name__}: {err}"))
            return out

    def segment_batch(
        self, texts: Sequence[str], offsets: Sequence[Sequence[Sequence[int]]], T: int | None = None
    ) -> list[SampleSegmentation]:
        """Per-sample segmentations (no tensors, no counting); see `starts` for the contract."""
        if len(texts) != len(offsets):
            raise ValueError(f"ParseSegmenter: {len(texts)} texts but {len(offsets)} offset lists")
        results: list[SampleSegmentation | None] = [None] * len(texts)
        to_parse: list[int] = []
        aligned: dict[int, tuple[list[int], list[int]]] = {}
        for b, (text, offs) in enumerate(zip(texts, offsets, strict=True)):
            T_b = len(offs)
            if T_b == 0:
                results[b] = SampleSegmentation([])
            elif T is not None and T_b > T:
                results[b] = self._fallback(T, "more_tokens_than_T", f"{T_b} offsets for T={T}")
            elif not isinstance(text, str):
                results[b] = self._fallback(T_b, "text_not_str", type(text).__name__)
            else:
                try:
                    aligned[b] = token_anchors(text, offs)  # cheap check before paying for the parse
                except AlignmentError as err:
                    results[b] = self._fallback(T_b, err.reason, str(err))
                    continue
                if text.strip():
                    to_parse.append(b)
                else:
                    results[b] = SampleSegmentation([0])
        parsed = self._parse([texts[b] for b in to_parse]) if to_parse else []
        for b, tree in zip(to_parse, parsed, strict=True):
            try:
                results[b] = self._segment_parsed(aligned[b], tree, len(offsets[b]))
            except RecursionError:
                results[b] = self._fallback(len(offsets[b]), "tree_too_deep")
            except Exception as err:  # noqa: BLE001 - never crash a training step on one sample
                results[b] = self._fallback(len(offsets[b]), "internal_error", f"{type(err).__name__}: {err}")
        return [r for r in results if r is not None]

    # ------------------------------------------------------------------------------------------ batch
    def starts(
        self, texts: Sequence[str], offsets: Sequence[Sequence[Sequence[int]]], T: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Macro-action start flags for a batch.

        texts[b]: decoded response b; offsets[b][k] = (char_start, char_end) of policy token k in texts[b]
        (T_b = len(offsets[b]) <= T real tokens; special tokens have an empty span).
        Returns starts (B, T) bool — True where a macro action begins, starts[b, 0] True iff T_b > 0,
        False on padding k >= T_b — and fell_back (B,) bool for samples given fixed-n starts
        (k % fallback_n == 0) because their parse could not be aligned (counted by reason).
        """
        segs = self.segment_batch(texts, offsets, T)
        B = len(segs)
        starts = torch.zeros((B, T), dtype=torch.bool)
        fell_back = torch.zeros(B, dtype=torch.bool)
        rows: list[int] = []
        cols: list[int] = []
        self.last_details = []
        for b, seg in enumerate(segs):
            rows.extend([b] * len(seg.starts))
            cols.extend(seg.starts)
            if seg.fell_back:
                fell_back[b] = True
                self.num_fallbacks += 1
                self.fallback_reasons[seg.reason or "unknown"] += 1
                self.last_details.append(f"sample {b}: {seg.reason} {seg.detail}".strip())
        if rows:
            starts[torch.tensor(rows), torch.tensor(cols)] = True
        self.num_samples += B
        return starts, fell_back

    def stats(self) -> dict[str, float]:
        """Cumulative counters for the trainer's logs."""
        out: dict[str, float] = {
            "parsing/samples": float(self.num_samples),
            "parsing/fallbacks": float(self.num_fallbacks),
            "parsing/fallback_rate": self.num_fallbacks / max(self.num_samples, 1),
        }
        for reason, count in sorted(self.fallback_reasons.items()):
            out[f"parsing/fallback/{reason}"] = float(count)
        return out
