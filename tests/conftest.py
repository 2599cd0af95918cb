"""Shared fixtures: the embedded default (built once per machine under $MARLHF_HOME) and run helpers."""

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEP1 = REPO / "training/step1_supervised_finetuning/main.py"
STEP2 = REPO / "training/step2_reward_model_finetuning/main.py"
STEP3 = REPO / "training/step3_rlhf_finetuning/main.py"

# small, fast settings shared by the training tests (the quick start uses larger ones)
TINY_DATA = "synthetic:num_records=1200"


@pytest.fixture(autouse=True)
def _marlhf_logs_reach_caplog():
    """Entry points run in-process call ``setup_logging``, which gives the 'marlhf' logger its own handlers
    and stops propagation; restore it around every test so ``caplog`` sees the project's records."""
    logging.getLogger("marlhf").propagate = True
    yield
    logging.getLogger("marlhf").propagate = True


@pytest.fixture(scope="session")
def embedded():
    from marlhf import embedded as emb

    return emb.prepare()


@pytest.fixture(scope="session")
def benepar_silver():
    """Folder of the project-built benepar model (built once per machine under $MARLHF_HOME, ~2 min)."""
    from marlhf.rlhf.parsing import benepar_model

    return benepar_model.prepare()


def load_main(path: Path):
    """Import a step's main.py as a module (they are scripts, not package modules)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"main_{path.parent.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def run_launcher(args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real ``deepspeed`` launcher (CPU ranks over gloo); fail with its output on error."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def deepspeed_cmd(num_gpus: int, port: int) -> list[str]:
    launcher = shutil.which("deepspeed")
    assert launcher, "the deepspeed launcher is not on PATH (pip install deepspeed)"
    return [launcher, "--num_gpus", str(num_gpus), "--master_port", str(port)]


def save_seeded_reward_model(out: Path) -> Path:
    """The nano embedded model as a value model with a seeded N(0, 1) score head (scores of order 1), saved
    in ``out`` as a step-2 output folder would be: a reward model for the scoring tools' tests."""
    import torch

    from marlhf import embedded
    from marlhf.models.loading import load_tokenizer, load_value_model

    nano = str(embedded.prepare(size="nano").model_dir)
    tok = load_tokenizer(nano, "<|endoftext|>")
    model = load_value_model(nano, tok)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
