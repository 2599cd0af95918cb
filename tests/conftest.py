"""Shared fixtures: the embedded default (built once per machine under $MARLHF_HOME) and run helpers."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # the benchmark scripts' lab equipment (scripts/lab), imported as `lab`
STEP1 = REPO / "training/step1_supervised_finetuning/main.py"
STEP2 = REPO / "training/step2_reward_model_finetuning/main.py"
STEP3 = REPO / "training/step3_rlhf_finetuning/main.py"
# the quick start's step-1 model as the sweep recorded it (test_gold_rl starts from it; test_launch_scripts checks
# that the current tiny step-1 script trains that model)
RECORDED_SFT = REPO / "docs/results/runs/base/step1"
RECORDED_SFT_SPLIT = "2,4,4"  # the data split it was trained on (scripts/reproduce.py's SWEEP_SPLIT)

# The suite runs on two pytest-xdist workers sharing the machine's cores (pyproject.toml).  Each worker, and every
# process it starts, computes on one thread: with torch's default of a thread per core, two training runs at
# once oversubscribe 2 cores and each ran 2-4x slower than alone (measured on 2 CPU cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

# small, fast settings shared by the training tests (the quick start uses larger ones)
TINY_DATA = "synthetic:num_records=1200"


# The two longest files (~6 and ~3 minutes alone on 2 CPU cores: the quick sweep; two RL runs), then the other
# files with end-to-end runs (marked ``slow``), then the rest.
LONGEST_FILES = ("test_reproduce.py", "test_gold_rl.py")


def pytest_collection_modifyitems(config, items):
    """Long files first.  The default options run the suite on two pytest-xdist workers, a file each at a time,
    in this order (pyproject.toml): started on the long files, the workers finish together on short ones
    instead of one of them running a long file alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item) -> tuple[int, bool]:
        name = item.path.name
        first = LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)
        return first, item.path not in slow_files

    items.sort(key=rank)  # stable: the order within each group is kept


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
    from marlhf.parsing import benepar_model

    return benepar_model.prepare()


def load_main(path: Path | str):
    """The ``main`` of an entry point: a script such as a step's main.py (a Path), or a ``marlhf.cli`` module by
    name (a str: ``"generate"`` is ``marlhf generate``)."""
    import importlib
    import importlib.util

    if isinstance(path, str):
        return importlib.import_module(f"marlhf.cli.{path}").main
    spec = importlib.util.spec_from_file_location(f"main_{path.parent.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def cli_cmd(name: str) -> list[str]:
    """The command line of a ``marlhf.cli`` entry point in a new process (``python -m marlhf.cli.NAME``)."""
    return [sys.executable, "-m", f"marlhf.cli.{name}"]


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


def save_seeded_reward_model(out: Path, seed: int = 0, sign: float = 1.0) -> Path:
    """The nano embedded model as a value model with a seeded N(0, 1) score head (scores of order 1; ``sign``
    -1 negates it, so the model scores every sequence minus what ``sign`` 1 does), saved in ``out`` as a step-2
    output folder would be: a reward model for the scoring tools' tests."""
    import torch

    from marlhf import embedded
    from marlhf.models.loading import load_tokenizer, load_value_model

    nano = str(embedded.prepare(size="nano").model_dir)
    tok = load_tokenizer(nano, "<|endoftext|>")
    model = load_value_model(nano, tok)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        model.score.weight.copy_(sign * torch.randn(model.score.weight.shape, generator=g))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
