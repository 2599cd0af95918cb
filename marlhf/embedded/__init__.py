"""Build (once) and locate the embedded default: task data, tokenizer and tiny model, all from a seed.

The quick start, the tests and the benchmarks all start from these files (docs/design.md "The embedded task",
"Runs without a GPU").  Layout under the home folder (``$MARLHF_HOME`` or ``~/.cache/marlhf``)::

    embedded-v<task version>-seed<S>-n<N>-noise<p>-vocab<V>/   one folder per task setting
        records.jsonl   tokenizer/   manifest.json
        models/<size>-seed<S>/                               one folder per model size (HF layout)

Every folder is built in a temporary sibling and renamed into place, so a crash never leaves a folder
that looks complete and concurrent callers (e.g. several DeepSpeed ranks) agree on one result.

CLI: ``python -m marlhf.embedded [--root R] [--seed S] [--size tiny] [--num_records N] [--force] [--json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
from pathlib import Path

from marlhf.data.adapters.loader import synthetic_records
from marlhf.embedded import task as embedded_task
from marlhf.embedded.model import TINY_SIZES, create_tiny_model  # cheap: torch/transformers load lazily
from marlhf.embedded.tokenizer import train_tokenizer
from marlhf.utils.cache import build_atomically, check_complete, default_home

logger = logging.getLogger(__name__)

DATA_FILE = "records.jsonl"
TOKENIZER_DIR = "tokenizer"
MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class EmbeddedPaths:
    """Where the embedded default lives.  ``model_dir`` holds the model *and* its tokenizer."""

    root: Path  # the task folder (keyed by the settings)
    data_file: Path  # JSONL of all records (prompt, chosen, rejected, source)
    tokenizer_dir: Path
    model_dir: Path

    def to_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in dataclasses.asdict(self).items()}


def task_key(seed: int, num_records: int, label_noise: float, vocab_size: int) -> str:
    """Folder name of a task setting: different settings (or task versions) never share files."""
    return (
        f"embedded-v{embedded_task.TASK_VERSION}-seed{seed}-n{num_records}-noise{label_noise:g}-vocab{vocab_size}"
    )


def prepare(
    root: str | Path | None = None,
    seed: int = 1234,
    size: str = "tiny",
    num_records: int = 4000,
    label_noise: float = 0.1,
    vocab_size: int = 2000,
    force: bool = False,
) -> EmbeddedPaths:
    """Return the paths of the embedded default, building whatever is missing (or everything if ``force``).

    ``root`` is the home folder under which the setting-keyed folder is created (default
    :func:`default_home`).  Idempotent: a complete build is returned without touching any file.
    """
    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; valid sizes: {', '.join(TINY_SIZES)}")
    cfg = embedded_task.SyntheticConfig(seed=seed, num_records=num_records, label_noise=label_noise)  # validates
    home = Path(root) if root is not None else default_home()
    task_dir = home / task_key(seed, num_records, label_noise, vocab_size)
    model_dir = task_dir / "models" / f"{size}-seed{seed}"
    paths = EmbeddedPaths(
        root=task_dir,
        data_file=task_dir / DATA_FILE,
        tokenizer_dir=task_dir / TOKENIZER_DIR,
        model_dir=model_dir,
    )
    if force or not task_dir.is_dir():
        build_atomically(task_dir, lambda tmp: _build_task(tmp, cfg, vocab_size), replace=force)
    else:
        check_complete(task_dir, [DATA_FILE, f"{TOKENIZER_DIR}/tokenizer.json", MANIFEST])
        logger.info("embedded task found at %s", task_dir)
    if force or not model_dir.is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(paths.tokenizer_dir)
        build_atomically(model_dir, lambda tmp: create_tiny_model(size, tokenizer, tmp, seed=seed), replace=force,
                         required=("config.json", "model.safetensors", "tokenizer.json"))
    else:
        check_complete(model_dir, ["config.json", "model.safetensors", "tokenizer.json"])
        logger.info("embedded model %r found at %s", size, model_dir)
    return paths


def default_model(path: str) -> str:
    """The model a training entry point starts from: ``path``, or for an empty one the embedded default tiny model
    (built offline on first use).  Only the entry points call this: the loaders refuse an empty path."""
    return path or str(prepare().model_dir)


def _build_task(out: Path, cfg: embedded_task.SyntheticConfig, vocab_size: int) -> None:
    """Records, tokenizer trained on all their text, and a manifest with measured statistics."""

    out.mkdir(parents=True)
    logger.info("generating %d records (seed %d, label noise %g)", cfg.num_records, cfg.seed, cfg.label_noise)
    records = synthetic_records(cfg)
    embedded_task.write_jsonl(records, out / DATA_FILE)
    texts = [t for r in records for t in (r.prompt, r.chosen, r.rejected)]
    logger.info("training a %d-token tokenizer on %d texts", vocab_size, len(texts))
    tokenizer = train_tokenizer(texts, out / TOKENIZER_DIR, vocab_size=vocab_size, seed=cfg.seed)
    stats = task_statistics(records, tokenizer)
    manifest = {
        "task_version": embedded_task.TASK_VERSION,
        "config": dataclasses.asdict(cfg),
        "vocab_size": vocab_size,
        "statistics": stats,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    logger.info("embedded task statistics: %s", json.dumps(stats))


def task_statistics(records: list, tokenizer) -> dict:
    """Measured label-flip rate, gold scores and token lengths (recorded in the manifest)."""
    chosen = [embedded_task.gold_score(r.prompt, r.chosen) for r in records]
    rejected = [embedded_task.gold_score(r.prompt, r.rejected) for r in records]
    responses = [x for r in records for x in (r.chosen, r.rejected)]
    resp_len = [len(ids) for ids in tokenizer(responses, add_special_tokens=False)["input_ids"]]
    prompt_len = [len(ids) for ids in tokenizer([r.prompt for r in records])["input_ids"]]
    return {
        "num_records": len(records),
        "tokenizer_size": len(tokenizer),
        "flip_rate": sum(c < r for c, r in zip(chosen, rejected)) / len(records),
        "gold_chosen_mean": statistics.fmean(chosen),
        "gold_rejected_mean": statistics.fmean(rejected),
        "response_tokens": {
            "min": min(resp_len),
            "mean": statistics.fmean(resp_len),
            "max": max(resp_len),
            "frac_30_100": sum(30 <= n <= 100 for n in resp_len) / len(resp_len),
        },
        "prompt_tokens": {
            "min": min(prompt_len),
            "mean": statistics.fmean(prompt_len),
            "max": max(prompt_len),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m marlhf.embedded", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=None, help="home folder (default: $MARLHF_HOME or ~/.cache/marlhf)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--size", default="tiny", choices=list(TINY_SIZES))
    parser.add_argument("--num_records", type=int, default=4000)
    parser.add_argument("--label_noise", type=float, default=0.1)
    parser.add_argument("--vocab_size", type=int, default=2000)
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    parser.add_argument("--json", action="store_true", help="print the paths as one JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    paths = prepare(
        root=args.root,
        seed=args.seed,
        size=args.size,
        num_records=args.num_records,
        label_noise=args.label_noise,
        vocab_size=args.vocab_size,
        force=args.force,
    )
    if args.json:
        print(json.dumps(paths.to_dict()))
    else:
        for name, value in paths.to_dict().items():
            print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
