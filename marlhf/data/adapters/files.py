"""Reading local copies of datasets: row files (.jsonl[.gz], .json[.gz], .parquet) and APPS problem folders.

Row numbers are 1-based everywhere: the line number in a JSON-lines file (blank lines are skipped but still
counted, so the number is what an editor shows), the element number in a JSON array, the row number in a
parquet file, the position of a problem folder in sorted order for APPS.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from marlhf.data.records import DataError
from marlhf.errors import ConfigError

BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark that Windows tools put at the start of text files

ROW_EXTENSIONS = (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".parquet")

# (file, 1-based row number, row) — row is a DataError when the row could not even be parsed.
Row = tuple[str, int, "dict | DataError"]


def row_extension(name: str) -> str | None:
    """The row-file extension ``name`` ends with, or None."""
    return next((ext for ext in ROW_EXTENSIONS if name.endswith(ext)), None)


def iter_file_rows(path: Path) -> Iterator[Row]:
    """Rows of one file.  Unparseable JSON lines come out as DataErrors so the bad-row policy decides."""
    ext = row_extension(path.name)
    if ext is None:
        raise ConfigError(f"{path}: unsupported file type (expected one of {', '.join(ROW_EXTENSIONS)})")
    if ext == ".parquet":
        yield from _parquet_rows(path)
        return
    opener = gzip.open if ext.endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(4096).removeprefix(BOM).lstrip()
    if ext in (".json", ".json.gz") and head.startswith(b"["):
        yield from _json_array_rows(path, opener)
        return
    yield from _json_lines_rows(path, opener)  # .jsonl, or a .json file holding JSON lines


def _json_lines_rows(path: Path, opener) -> Iterator[Row]:
    file = str(path)
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:
                raw = raw.removeprefix(BOM)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield file, lineno, DataError(file, lineno, "<line>", "not UTF-8 text")
                continue
            if not line.strip():
                continue
            try:
                yield file, lineno, json.loads(line)
            except json.JSONDecodeError as err:
                reason = f"malformed JSON: {err.msg} (column {err.colno})"
                yield file, lineno, DataError(file, lineno, "<line>", reason)


def _json_array_rows(path: Path, opener) -> Iterator[Row]:
    """A JSON array of row objects.  A broken array has no usable rows, so it raises whatever the policy."""
    file = str(path)
    with opener(path, "rb") as f:
        try:
            rows = json.loads(f.read().removeprefix(BOM).decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            line = getattr(err, "lineno", 0)
            raise DataError(file, line, "<file>", f"not a valid JSON array: {err}") from None
    for index, row in enumerate(rows, 1):
        yield file, index, row


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq  # lazy: only needed for parquet copies

    file, index = str(path), 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            index += 1
            yield file, index, row


def iter_rows(paths: Sequence[Path]) -> Iterator[Row]:
    """Rows of several files, one after the other."""
    for path in paths:
        yield from iter_file_rows(path)


def find_split_files(root: Path, stems: Sequence[str]) -> list[Path]:
    """Row files under ``root`` (any depth) holding the split whose published file stems are ``stems``.

    A file matches a stem when it is named ``<stem>.<ext>`` or ``<stem>-<shard>.<ext>`` (Hugging Face parquet
    shards) or sits in a folder named ``<stem>`` (the hub's parquet export).  Stems are tried in order, the
    first with any match wins, so a directory may hold e.g. both ``validation`` and ``test`` files.
    Sub-folders (e.g. Anthropic/hh-rlhf's harmless-base/, helpful-base/, ...) are read in sorted order.
    """
    candidates = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        ext = row_extension(path.name)
        if ext is None or any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        candidates.append((path, path.name[: -len(ext)], rel.parent.name if rel.parent.parts else ""))
    for stem in stems:
        hits = [p for p, name, parent in candidates
                if name == stem or name.startswith(stem + "-") or parent == stem]
        if hits:
            return hits
    return []


# --------------------------------------------------------------------------------------------------- APPS
# Files of one problem folder in the original APPS release, by the row field they hold.
APPS_FILES = {
    "question": "question.txt",
    "solutions": "solutions.json",
    "input_output": "input_output.json",
    "starter_code": "starter_code.py",
}


def is_apps_problem(path: Path) -> bool:
    return path.is_dir() and (path / "question.txt").is_file()


def apps_problem_dirs(root: Path) -> list[Path]:
    """Problem folders directly under ``root`` (``<id>/question.txt, ...``), sorted by name."""
    if is_apps_problem(root):
        return [root]
    return sorted(p for p in root.iterdir() if is_apps_problem(p)) if root.is_dir() else []


def apps_problem_row(folder: Path, index: int) -> dict:
    """One problem folder as a row of the published (codeparrot/apps) schema.

    ``solutions`` and ``input_output`` stay JSON strings, exactly as in the hub rows, so the same row
    function parses both; a missing file becomes a missing field.  metadata.json gives ``difficulty`` (kept
    in the record's meta for per-difficulty pass@k).
    """
    row: dict = {"problem_id": int(folder.name) if folder.name.isdigit() else folder.name}
    meta_path = folder / "metadata.json"
    if meta_path.is_file():
        try:
            metadata = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(str(meta_path), index, "difficulty", f"unreadable metadata.json: {err}") from None
        if isinstance(metadata, dict) and metadata.get("difficulty") is not None:
            row["difficulty"] = metadata["difficulty"]
    for field, name in APPS_FILES.items():
        path = folder / name
        if path.is_file():
            try:
                row[field] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise DataError(str(path), index, field, "not UTF-8 text") from None
    return row


def apps_file_of(folder: str, field: str) -> str:
    """The file of an APPS problem folder that holds ``field`` (e.g. 'solutions[2]' -> solutions.json)."""
    name = APPS_FILES.get(field.split("[", 1)[0])
    return str(Path(folder) / name) if name else folder
