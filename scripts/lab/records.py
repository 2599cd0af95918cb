"""Sweep records: the few small files each finished run is read from, kept in a folder that outlives the machine.

A sweep's run folders hold checkpoints and models (gigabytes); its report reads only a handful of small
files per run (``summary.json``, ``initial_policy.json``, ``metrics.jsonl``, ``args.json``).  ``archive``
copies those of every finished run into a records folder with the same layout, so the folder can be
carried and the sweep continued on another machine or in another session: ``restore`` copies them back
into a fresh ``--out`` (finished runs are then skipped), and ``scripts/reproduce.py --report_only --out
RECORDS`` writes the report from the records alone.

Continuing is only sound from the same starting weights: ``base.json`` holds a digest of the SFT and reward
model weights the records were made from, and ``check_base`` refuses other weights instead of mixing runs
from two starting points in one table.  Retraining steps 1–2 does not give those bits back on another
machine (measured: the same code and command gave a step-0 held-out gold score of 0.721 on one 2-core
machine and 0.657 on another), so the records also keep the two models themselves (``keep_base`` /
``restore_base``, ~30 MB for the embedded tiny size): a sweep continues from exactly where it started.

A sweep kept in git is one *pack* instead (``pack``: ``docs/results/records/<sweep>.jsonl.gz``): the records
folder's small files in one deterministic gzip'd JSON-lines file, a line per folder — its path and its files,
a ``metrics.jsonl`` cut to what a report reads of it (``CURVE_KEYS``) — and no weights.
``scripts/reproduce.py --report_only --records PACK`` writes the report from it (``unpack`` puts the files back).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

RUN_FILES = ("summary.json", "initial_policy.json", "metrics.jsonl", "args.json")  # summary first: the marker
BASE_FILE = "base.json"
BASE_MODELS = ("step1", "step2")  # the sweep's SFT and reward model under <root>/base
# the main job's reward model, step 2's trained further on the SFT policy's answers (the full sweep's reward model)
ONPOLICY_RM = "step2_onpolicy/reward_model"
MODEL_FILES = ("config.json", "generation_config.json", "conversation_format.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "args.json", "metrics.jsonl")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def base_folders(base: Path) -> tuple[str, str]:
    """The model folders under ``base`` a sweep starts from: the SFT model and its reward model — step 2's trained
    further on the policy's answers when there is one (step 2's own is then not needed), else step 2's."""
    return BASE_MODELS[0], ONPOLICY_RM if (Path(base) / ONPOLICY_RM).is_dir() else BASE_MODELS[1]


class RecordsMismatch(RuntimeError):
    """The records were made from other starting weights than the sweep would continue from."""


def weights_digest(folder: str | Path) -> str:
    """sha256 over the names and bytes of a model folder's weight files (sorted by name)."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"{folder}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    return files_digest(files)


def files_digest(paths: list[Path]) -> str:
    """sha256 over each file's name and bytes, in the order given."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def check_base(records: Path, sft: str | Path, rm: str | Path) -> dict:
    """Write ``records/base.json`` (digests of the SFT and reward model) when absent; otherwise raise
    ``RecordsMismatch`` unless the given models have the recorded digests.  Returns the digests."""
    here = {"sft": weights_digest(sft), "rm": weights_digest(rm)}
    path = Path(records) / BASE_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(here, indent=1) + "\n")
        return here
    recorded = json.loads(path.read_text())
    differ = [k for k in here if recorded.get(k) != here[k]]
    if differ:
        raise RecordsMismatch(
            f"{path}: the recorded runs started from other {' and '.join(differ)} weights "
            f"({', '.join(f'{k} {str(recorded.get(k))[:12]}… recorded, {here[k][:12]}… here' for k in differ)}); "
            "another machine or code version trains other bits. Continue in a new --records folder "
            "(or remove this one) rather than mixing two starting points in one table.")
    return here


def units(root: Path, run_dirs: list[Path]) -> list[tuple[Path, list[Path]]]:
    """The finished units under ``root`` as (folder, files relative to it): each step-3 run of ``run_dirs``
    (done when its ``summary.json`` exists), DPO's SFT evaluation and seeds, the real-model track."""
    root = Path(root)
    found = [(Path(d), list(RUN_FILES)) for d in run_dirs]
    found.append((root / "dpo" / "sft_eval", ["eval.json"]))
    found += [(d, ["summary.json", "eval/eval.json", "model/metrics.jsonl", "model/args.json"])
              for d in sorted((root / "dpo").glob("seed*"))]
    found.append((root / "real", ["summary.json"]))
    done = []
    for folder, names in found:
        if (folder / names[0]).exists():  # the first file marks the unit finished
            done.append((folder, [Path(n) for n in names if (folder / n).exists()]))
    return done


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)  # a crash mid-copy never leaves a torn record


def archive(out: Path, records: Path, run_dirs: list[Path]) -> int:
    """Keep what the report needs of every finished unit of ``out`` (step-3 runs among ``run_dirs``, DPO,
    the real-model track) under the same relative paths in ``records``.  Returns the files written."""
    out, records, n = Path(out), Path(records), 0
    for folder, names in units(out, run_dirs):
        for name in names:
            src, dst = folder / name, records / folder.relative_to(out) / name
            if not dst.exists() or dst.read_bytes() != src.read_bytes():
                _copy(src, dst)
                n += 1
    return n


def restore(records: Path, out: Path, run_dirs: list[Path]) -> int:
    """Put each recorded unit back under ``out`` unless ``out`` has it finished already (a partial one there
    is overwritten: the record is the finished version), so the sweep skips it.  ``run_dirs`` are paths
    under ``out``.  Returns the files written."""
    out, records, n = Path(out), Path(records), 0
    recorded = [records / Path(d).relative_to(out) for d in run_dirs]
    for folder, names in units(records, recorded):
        target = out / folder.relative_to(records)
        if (target / names[0]).exists():
            continue
        for name in names:
            _copy(folder / name, target / name)
            n += 1
    return n


def keep_base(out: Path, records: Path) -> int:
    """Copy the sweep's SFT and reward model folders (:func:`base_folders`: weights, config, tokenizer, args,
    metrics; not logs) and steps 1–2's ``summary.json`` from ``out/base`` into ``records/base``.  Returns the
    files written."""
    out, records, n = Path(out) / "base", Path(records) / "base", 0
    for name in base_folders(out):
        src = out / name
        files = [p for p in sorted(src.iterdir()) if p.name in MODEL_FILES or p.name.endswith(WEIGHT_SUFFIXES)]
        for p in files:
            dst = records / name / p.name
            if not dst.exists() or dst.stat().st_size != p.stat().st_size or dst.read_bytes() != p.read_bytes():
                _copy(p, dst)
                n += 1
    if (out / "summary.json").exists() and not (records / "summary.json").exists():
        _copy(out / "summary.json", records / "summary.json")
        n += 1
    return n


def restore_base(records: Path, out: Path) -> bool:
    """Put the recorded SFT and reward model under ``out/base`` (with steps 1–2's summary, so they are not
    trained again) unless ``out/base`` has its own; True when restored."""
    src, dst = Path(records) / "base", Path(out) / "base"
    models = base_folders(src)
    if (dst / "summary.json").exists() or not all((src / m).is_dir() for m in models):
        return False
    for m in models:
        for p in sorted((src / m).iterdir()):
            _copy(p, dst / m / p.name)
    if (src / "summary.json").exists():
        _copy(src / "summary.json", dst / "summary.json")
    return True


# ------------------------------------------------------------------------------------------------------ packs
PACK_FORMAT = "marlhf-sweep-records/1"
PACK_FILES = (*RUN_FILES, "eval.json", BASE_FILE, "tuning.json")  # what a pack keeps of a records folder
# what a report reads of a metrics.jsonl row (lab.sweep.read_run; DPO's eval/accuracy): its step, the held-out
# evaluation, a PPO step's KL and seconds
CURVE_KEYS = ("step", "train/kl", "train/step_seconds")


def is_pack(path: str | Path) -> bool:
    return str(path).endswith(".gz")


def _curve(rows: list[dict]) -> list[dict]:
    kept = [{k: v for k, v in r.items() if k in CURVE_KEYS or k.startswith("eval/")} for r in rows]
    return [r for r in kept if set(r) - {"step"}]


def pack(records: Path, path: Path) -> int:
    """Write the records folder's ``PACK_FILES`` into the pack ``path``: a header line, then one line per folder
    (sorted by path) ``{"path": relative folder, "files": {name: parsed JSON, or a metrics.jsonl's rows cut
    to CURVE_KEYS and eval/*}}``, gzip'd without a time stamp, so the same records give the same bytes.
    Returns the folders packed."""
    records, path = Path(records), Path(path)
    folders: dict[str, dict] = {}
    for p in sorted(records.rglob("*")):
        if p.is_file() and p.name in PACK_FILES:
            text = p.read_text()
            content = _curve([json.loads(line) for line in text.splitlines() if line.strip()]) \
                if p.name.endswith(".jsonl") else json.loads(text)
            folders.setdefault(p.parent.relative_to(records).as_posix(), {})[p.name] = content
    if not folders:
        raise FileNotFoundError(f"{records}: no records ({', '.join(PACK_FILES)})")
    lines = [json.dumps({"format": PACK_FORMAT, "metrics_keys": [*CURVE_KEYS, "eval/*"]})]
    lines += [json.dumps({"path": rel, "files": files}, separators=(",", ":"))
              for rel, files in sorted(folders.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
        f.write(("\n".join(lines) + "\n").encode())
    tmp.replace(path)
    return len(folders)


def read_pack(path: Path) -> dict[str, dict]:
    """A pack's folders: relative path -> {file name: content} (a metrics.jsonl's: its list of rows)."""
    with gzip.open(path, "rt") as f:
        header, *rows = [json.loads(line) for line in f if line.strip()]
    if header.get("format") != PACK_FORMAT:
        raise ValueError(f"{path}: not a records pack of format {PACK_FORMAT} (header {header})")
    return {r["path"]: r["files"] for r in rows}


def unpack(path: Path, out: Path) -> int:
    """Write a pack's files under ``out`` with their relative paths.  Returns the files written."""
    n = 0
    for rel, files in read_pack(path).items():
        for name, content in files.items():
            dst = Path(out) / rel / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            text = "".join(json.dumps(r) + "\n" for r in content) if name.endswith(".jsonl") \
                else json.dumps(content, indent=1) + "\n"
            dst.write_text(text)
            n += 1
    return n


if __name__ == "__main__":  # python scripts/lab/records.py pack FOLDER PACK | unpack PACK FOLDER
    import sys

    what, src, dst = sys.argv[1:4]
    done = {"pack": pack, "unpack": unpack}[what](Path(src), Path(dst))
    print(f"{what}: {done} {'folders' if what == 'pack' else 'files'} of {src} into {dst}")
