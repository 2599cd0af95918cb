"""Where the inference tools (generate, chat, best_of_n, score_policies, score_pairs, judge) run their model: the one
copy of ``--device`` / ``--dtype``.

``auto`` picks the GPU when there is one and, on a GPU with bfloat16 (Ampere and later), bf16 — half the
memory and several times the speed of fp32, close in results (tests/test_placement.py measures it); on the CPU
it keeps fp32, which CPUs run fastest and exactly.  A GPU without bf16 keeps fp32 too: fp16's narrow range can
overflow a reward model's scores."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from marlhf.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype


def add_placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="auto: bf16 on a GPU that supports it, else fp32")


def resolve_placement(device: str = "auto", dtype: str | torch.dtype = "auto") -> Placement:
    """The torch device and dtype for the flags' values, refusing what this machine cannot run."""
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ConfigError(f"--device {device!r}: not a device (auto, cpu, cuda or cuda:N)") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA GPU is visible to torch on this machine (torch "
                              f"{torch.__version__}); use --device cpu or auto")
    if isinstance(dtype, torch.dtype):
        dt = dtype
    elif dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    elif dtype in DTYPES:
        dt = DTYPES[dtype]
    else:
        raise ConfigError(f"--dtype {dtype!r}: one of auto, {', '.join(DTYPES)}")
    if dt == torch.float16 and dev.type == "cpu":
        raise ConfigError("--dtype fp16 on the CPU: many CPU kernels have no fp16 version or run it slower than "
                          "fp32; use --dtype bf16 or fp32 (or a GPU)")
    return Placement(dev, dt)
