"""What a run needs from the Hugging Face hub, checked once before any rank starts.

Without this, a model or dataset that cannot be had (no network, a misspelt or gated name) was met by every rank
at once, each printing its own connection traceback.  :func:`check_model` and :func:`check_data` raise one
:class:`~marlhf.errors.ConfigError` naming the model or dataset, why it cannot be had, and how to pass a local copy.

A local folder or file is never looked up on the hub; a hub name found in the local cache is used as it is (the
libraries read the cache when ``HF_HUB_OFFLINE=1``); anything else is one metadata request with a short timeout,
skipped under ``HF_HUB_OFFLINE=1``, where the cache is all there is.
"""

from __future__ import annotations

import os
from pathlib import Path

from marlhf.errors import ConfigError

TIMEOUT_S = 10.0  # one metadata request: the hub answers in well under a second when it can be reached


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE`` / ``HF_DATASETS_OFFLINE``) set to a true value."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def could_be_hub_name(name: str) -> bool:
    """``org/name`` or ``name``: a path that is absolute, starts with ``.`` or ``~`` or has two slashes is a
    folder (as :func:`marlhf.models.loading.resolve_model_path` reads it)."""
    return not (Path(name).is_absolute() or name.startswith((".", "~")) or name.count("/") > 1)


def _in_cache(name: str, repo_type: str) -> bool:
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{name.replace('/', '--')}"
    if (folder / "snapshots").is_dir() and any((folder / "snapshots").iterdir()):
        return True
    if repo_type == "dataset":  # what datasets.load_dataset prepared before (its own cache)
        cache = Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
        return (cache / name.replace("/", "___")).is_dir()
    return False


def _hub_problem(name: str, repo_type: str) -> str | None:
    """Why the hub repository ``name`` cannot be had, or None when it can."""
    if _in_cache(name, repo_type):
        return None
    if offline():
        return "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    api = HfApi()
    try:
        (api.model_info if repo_type == "model" else api.dataset_info)(name, timeout=TIMEOUT_S)
    except GatedRepoError:
        return ("it is gated: accept its licence on huggingface.co and log in (`hf auth login` or HF_TOKEN), "
                "or use a local copy")
    except RepositoryNotFoundError:
        return "the hub has no such repository (a misspelt name, or a private one without a token)"
    except Exception as err:  # noqa: BLE001 - no network, a proxy, a timeout: all mean the same to the user
        return f"the hub cannot be reached ({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''})"
    return None


def check_model(name: str, flag: str = "--model_name_or_path") -> None:
    """Raise a :class:`ConfigError` when the model ``name`` (a folder or a hub name; ``flag`` is where it came
    from) cannot be had here; an empty name is the embedded model and always can."""
    if not name or Path(name).expanduser().exists():
        return
    if not could_be_hub_name(name):
        raise ConfigError(f"model folder {name!r} ({flag}) does not exist")
    problem = _hub_problem(name, "model")
    if problem:
        raise ConfigError(
            f"model {name!r} ({flag}) cannot be had: {problem}.  Pass a local copy instead: download it where the "
            f"hub can be reached (`hf download {name} --local-dir DIR`) and give DIR as {flag} (the launch scripts "
            f"and the quick start: MODEL_PATH=DIR); or, with it in the Hugging Face cache already, set "
            f"HF_HUB_OFFLINE=1")


def check_data(specs: list[str] | tuple[str, ...]) -> None:
    """Raise a :class:`ConfigError` for the first ``--data_path`` spec that cannot be had here (an unknown
    name, a missing local copy, a hub dataset the hub cannot give)."""
    from marlhf.data.adapters.loader import parse_spec

    for spec in specs:
        try:
            kind, adapter, _ = parse_spec(spec)
        except FileNotFoundError as err:
            raise ConfigError(f"--data_path {err}") from None
        if kind != "hub":
            continue
        problem = _hub_problem(adapter.name, "dataset")
        if problem:
            raise ConfigError(
                f"dataset {adapter.name!r} (--data_path) cannot be had: {problem}.  Pass a local copy instead: "
                f"download the published files where the hub can be reached and give '{adapter.name}:PATH' (PATH: "
                f"one row file or a directory holding {adapter.local_hint}; the launch scripts and the quick "
                f"start: DATA_PATH='{adapter.name}:PATH'); or, with it in the Hugging Face cache already, set "
                f"HF_HUB_OFFLINE=1")


def main(argv: list[str] | None = None) -> int:
    """``python -m marlhf.preflight FLAG...``: the launch scripts' check before any rank starts.  Reads the models
    (``--model_name_or_path``, ``--actor_model_name_or_path``, ``--critic_model_name_or_path``) and ``--data_path``
    out of a step's flags (the others are ignored; the last of a repeated flag counts, as in the step); exit 2 with
    one line naming what cannot be had."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m marlhf.preflight", add_help=False)
    flags = ("model_name_or_path", "actor_model_name_or_path", "critic_model_name_or_path")
    for flag in flags:
        parser.add_argument(f"--{flag}", default="")
    parser.add_argument("--data_path", nargs="+", default=[])
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        for flag in flags:
            check_model(getattr(args, flag), f"--{flag}")
        check_data(args.data_path)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
