"""Shared fixtures: the embedded default (built once per machine under $MARLHF_HOME) and run helpers."""

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # the benchmark scripts' lab equipment (scripts/lab), imported as `lab`
STEP1 = REPO / "training/step1_supervised_finetuning/main.py"
STEP2 = REPO / "training/step2_reward_model_finetuning/main.py"
STEP3 = REPO / "training/step3_rlhf_finetuning/main.py"
# the quick start's step-1 model (the ``quickstart_sft`` fixture): the tiny step-1 launch script as the sweeps of
# docs/results.md ran it — their split (scripts/reproduce.py's SWEEP_SPLIT) and no weight decay (they predate it)
SFT_SCRIPT = REPO / "training/step1_supervised_finetuning/training_scripts/tiny/run_tiny.sh"
QUICKSTART_SFT_SPLIT = "2,4,4"
QUICKSTART_SFT_ENV = {"WEIGHT_DECAY": "0.0", "EXTRA_ARGS": f"--data_split {QUICKSTART_SFT_SPLIT}"}
# flags that name where a run writes, not what it trains
PATH_FLAGS = ("output_dir", "tensorboard_path", "data_output_path", "local_rank")

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


# The launch script's python, recording main.py's command line instead of training (the task lookup and the hub
# check it runs before the launch run for real).
_RECORDING_PYTHON = """#!/usr/bin/env bash
if [[ "$1" == -u ]]; then printf '%s\\0' "$@" > "$RECORDED_ARGV"; exit 0; fi
exec {python} "$@"
"""


def _script_env(*bin_dirs: Path, **env: str) -> dict:
    """The environment the launch script runs in: ``bin_dirs``, then this interpreter's python (and its deepspeed)
    first on PATH."""
    path = os.pathsep.join([*map(str, bin_dirs), str(Path(sys.executable).parent), os.environ["PATH"]])
    return {**os.environ, "PATH": path, "LAUNCHER": "auto", "PYTHONUNBUFFERED": "1", **QUICKSTART_SFT_ENV, **env}


def quickstart_sft_args() -> dict:
    """Step 1's arguments as the tiny step-1 script with ``QUICKSTART_SFT_ENV`` would run it (every field of the
    stage config, but those of ``PATH_FLAGS``): the script is run with a python that records main.py's command
    line, which the stage's own parser then reads."""
    from marlhf.config import SFTArgs, build_parser

    with tempfile.TemporaryDirectory() as tmp:
        bin_dir, argv_file = Path(tmp) / "bin", Path(tmp) / "argv"
        bin_dir.mkdir()
        (bin_dir / "python").write_text(_RECORDING_PYTHON.format(python=sys.executable))
        (bin_dir / "python").chmod(0o755)
        proc = subprocess.run(["bash", str(SFT_SCRIPT), str(Path(tmp) / "out")], cwd=tmp, capture_output=True,
                              text=True, timeout=120, env=_script_env(bin_dir, RECORDED_ARGV=str(argv_file)))
        assert proc.returncode == 0 and argv_file.exists(), f"{SFT_SCRIPT} failed:\n{proc.stdout}\n{proc.stderr}"
        argv = argv_file.read_bytes().decode().split("\0")[:-1]
    flags = argv[argv.index(next(a for a in argv if a.endswith("main.py"))) + 1:]
    ns = build_parser(SFTArgs).parse_args(flags)
    return {k: v for k, v in sorted(vars(ns).items()) if k not in PATH_FLAGS}


def quickstart_sft_model(cache: Path | None = None) -> Path:
    """The quick start's step-1 model trained by its own launch script (``SFT_SCRIPT`` with ``QUICKSTART_SFT_ENV``,
    600 steps, about 3.5 to 7 minutes on 2 CPU cores) once per machine: under ``cache`` (default
    ``$MARLHF_TEST_CACHE`` or ``~/.cache/marlhf/tests``) in a folder keyed by the arguments it trains with and the
    embedded task, tokenizer and initial model it starts from, so a change to any of them trains a new one.
    A file lock keeps concurrent callers (pytest-xdist workers) from training it twice; the run writes a
    temporary sibling that is renamed into place when complete, so a crash leaves no half model."""
    from lab.records import files_digest

    from marlhf import embedded as emb
    from marlhf.utils.cache import build_atomically

    cache = Path(cache or os.environ.get("MARLHF_TEST_CACHE") or Path.home() / ".cache/marlhf/tests")
    args = quickstart_sft_args()
    task = emb.prepare()
    inputs = [task.data_file, task.tokenizer_dir / "tokenizer.json", task.model_dir / "config.json",
              task.model_dir / "model.safetensors"]
    key = hashlib.sha256(json.dumps({"args": args, "embedded": files_digest(inputs)}, sort_keys=True).encode())
    target = cache / f"quickstart-sft-{key.hexdigest()[:16]}"
    if (target / "model.safetensors").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / "model.safetensors").exists():  # another worker trained it while we waited
            return target

        def train(tmp: Path) -> None:
            t0 = time.time()
            env = _script_env(DATA_OUTPUT_PATH=str(Path(tmp) / "data"), MASTER_PORT="29689")
            proc = subprocess.run(["bash", str(SFT_SCRIPT), str(tmp)], cwd=REPO, capture_output=True, text=True,
                                  timeout=3600, env=env)
            assert proc.returncode == 0, f"{SFT_SCRIPT} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            shutil.rmtree(Path(tmp) / "data", ignore_errors=True)
            (Path(tmp) / "trained.json").write_text(json.dumps(
                {"args": args, "seconds": round(time.time() - t0, 1), "env": QUICKSTART_SFT_ENV}, indent=1) + "\n")

        build_atomically(target, train, replace=False)
    return target


@pytest.fixture(scope="session")
def quickstart_sft(embedded) -> Path:
    """The quick start's step-1 model (:func:`quickstart_sft_model`), trained once per machine."""
    return quickstart_sft_model()


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
