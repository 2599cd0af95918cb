"""Parsing-based termination rule for macro actions (paper Appendix B.4, item 3).

    seg = ParseSegmenter(kind="text")              # spaCy (or benepar if benepar_en3 is installed)
    seg = ParseSegmenter(kind="text", backend="benepar", model=None)  # released model, else project-built
    starts, fell_back = seg.starts(texts, offsets, T)  # (B, T) bool, (B,) bool
    seg.stats()                                    # fallback counters for the logs
"""

from marlhf.parsing.backends import ParseFailure, available_backends
from marlhf.parsing.core import AlignmentError, Macro, Node, segment_tree, token_anchors
from marlhf.parsing.segmenter import ParseSegmenter, SampleSegmentation, resolve_backend

__all__ = [
    "AlignmentError",
    "Macro",
    "Node",
    "ParseFailure",
    "ParseSegmenter",
    "SampleSegmentation",
    "available_backends",
    "resolve_backend",
    "segment_tree",
    "token_anchors",
]
