"""``--data_path`` specs -> lists of :class:`Record` (DeepSpeed-Chat style: one name per source).

Spec grammar (one source; ``--data_path`` may hold several):

- ``NAME``            a hub dataset, read with ``datasets.load_dataset`` (needs the network);
- ``NAME:PATH``       the same dataset from a local copy: PATH is one row file (.json/.jsonl/.jsonl.gz/
                      .parquet; it is the train split) or a directory holding the published files
                      (``train.jsonl.gz``/``test.jsonl.gz``, ``train-00000-of-00001.parquet``, ... at any
                      depth; APPS: problem folders, or ``train/`` and ``test/`` folders of them);
- ``PATH``            a local file or directory of rows with fields prompt / chosen / rejected (optional);
- ``synthetic[:k=v,...]``  the project's embedded task (``marlhf.embedded.task``), e.g.
                      ``synthetic:seed=7,num_records=500,label_noise=0.1``;
- ``synthetic_code[:k=v,...]``  a generated code task in APPS layout (``marlhf.embedded.code_task``), e.g.
                      ``synthetic_code:num_records=200``.

``load_records`` returns None when the source has no such split (the caller then holds out part of
train).  Bad rows go through the :class:`BadRowPolicy`; rows dropped by design (WebGPT ties) are counted
in ``dropped`` and logged.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import marlhf.data.adapters.files as files
from marlhf.data.adapters.rows import (
    DroppedRow,
    anthropic_hh_row,
    apps_row,
    dahoas_row,
    generic_row,
    summarize_row,
    webgpt_row,
)
from marlhf.data.records import BadRowPolicy, DataError, Record, bad_rows_note
from marlhf.errors import ConfigError

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")
SYNTHETIC = "synthetic"
SYNTHETIC_CODE = "synthetic_code"
# Test prompts of the synthetic task come from a different seed, so they are not train prompts.
SYNTHETIC_TEST_SEED_OFFSET = 1_000_003

RowFn = Callable[[dict, str, int], "Record | list[Record]"]


class DatasetUnavailableError(RuntimeError):
    """A hub dataset could not be loaded (offline, gated, script-based...); says how to use a local copy."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One supported dataset: its row function, where its splits live on the hub and in a local copy."""

    name: str
    row_fn: RowFn
    hub_splits: Mapping[str, str]  # our split -> hub split; a split not listed does not exist
    hub_config: str | None = None
    local_stems: Mapping[str, tuple[str, ...]] = dataclasses.field(
        default_factory=lambda: {"train": ("train",), "test": ("test",)}
    )
    local_hint: str = "train.jsonl.gz / test.jsonl.gz (or .jsonl, .json, .parquet)"


_TRAIN_TEST = {"train": "train", "test": "test"}
ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        Adapter("Dahoas/full-hh-rlhf", dahoas_row, _TRAIN_TEST,
                local_hint="data/train-*.parquet / data/test-*.parquet (or train/test .jsonl, .json)"),
        Adapter("Dahoas/rm-static", dahoas_row, _TRAIN_TEST,
                local_hint="data/train-*.parquet / data/test-*.parquet (or train/test .jsonl, .json)"),
        Adapter("Anthropic/hh-rlhf", anthropic_hh_row, _TRAIN_TEST,
                local_hint="<subset>/train.jsonl.gz and <subset>/test.jsonl.gz, e.g. harmless-base/"),
        Adapter("openai/summarize_from_feedback", summarize_row, {"train": "train", "test": "validation"},
                hub_config="comparisons",
                local_stems={"train": ("train",), "test": ("validation", "valid", "test")},
                local_hint="comparisons/train-*.parquet / comparisons/validation-*.parquet (or .jsonl)"),
        Adapter("openai/webgpt_comparisons", webgpt_row, {"train": "train"},
                local_stems={"train": ("train", "comparisons"), "test": ("test",)},
                local_hint="comparisons.jsonl or train.jsonl / train-*.parquet (train only)"),
        Adapter("codeparrot/apps", apps_row, _TRAIN_TEST,
                local_hint="APPS problem folders (<id>/question.txt, solutions.json, input_output.json, "
                           "metadata.json, starter_code.py?), train/ and test/ folders of them, "
                           "or train.jsonl / test.jsonl"),
    )
}
_GENERIC_STEMS = {"train": ("train",), "test": ("test", "eval", "validation", "valid")}


def available_datasets() -> list[str]:
    """Names accepted as ``--data_path`` entries (besides local paths)."""
    return sorted(ADAPTERS) + [SYNTHETIC, SYNTHETIC_CODE]


def dropped_summary(dropped: Counter) -> str:
    """Human-readable counts of rows dropped by design, in the style of :meth:`BadRowPolicy.summary`."""
    if not dropped:
        return "no rows dropped"
    lines = [f"dropped {sum(dropped.values())} rows by design:"]
    lines += [f"  {n} x {f}: field '{fld}': {why}" for (f, fld, why), n in sorted(dropped.items())]
    return "\n".join(lines)


def load_records(
    spec: str,
    split: str = "train",
    bad_rows: BadRowPolicy | None = None,
    *,
    max_solutions_per_problem: int | None = 1,
    dropped: Counter | None = None,
) -> list[Record] | None:
    """The records of one ``--data_path`` entry's ``split`` ("train" or "test"); None if it has none.

    ``bad_rows`` decides what a bad row does (default: raise its DataError).  ``max_solutions_per_problem``
    applies to APPS (None = one record per reference solution).  ``dropped``, if given, receives the
    counts of rows left out by design, keyed by (file, field, reason) like ``BadRowPolicy.skipped``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    policy = bad_rows if bad_rows is not None else BadRowPolicy()
    drops: Counter = Counter()
    kind, adapter, rest = parse_spec(spec)
    if kind == SYNTHETIC:
        records = _load_synthetic(rest, split, drops)
    elif kind == SYNTHETIC_CODE:
        if split == "test":
            logger.info("%s: no test split; the caller holds out part of train", spec)
            return None
        records = _load_synthetic_code(rest)
    else:
        row_fn = adapter.row_fn if adapter is not None else generic_row
        if row_fn is apps_row:
            row_fn = functools.partial(apps_row, max_solutions=max_solutions_per_problem)
        if kind == "hub":
            rows = _hub_rows(adapter, split)
            source = None if rows is None else (rows, row_fn)
        else:
            source = _local_rows(adapter, Path(rest), split, row_fn)
        if source is None:
            logger.info("%s: no %s split; the caller holds out part of train", spec, split)
            return None
        records = _convert(*source, policy, drops)
    if drops:
        logger.info("%s [%s]: %s", spec, split, dropped_summary(drops))
        if dropped is not None:
            dropped.update(drops)
    if not records:
        raise ConfigError(
            f"{spec} [{split}]: no usable records ({policy.summary()}; {dropped_summary(drops)})"
        )
    return records


def parse_spec(spec: str) -> tuple[str, Adapter | None, str]:
    """(kind, adapter, rest): kind 'synthetic' (rest = options), 'hub', 'local' or 'generic' (rest = path)."""
    spec = spec.strip()
    if spec == SYNTHETIC or spec.startswith(SYNTHETIC + ":"):
        return SYNTHETIC, None, spec[len(SYNTHETIC) + 1 :]
    if spec == SYNTHETIC_CODE or spec.startswith(SYNTHETIC_CODE + ":"):
        return SYNTHETIC_CODE, None, spec[len(SYNTHETIC_CODE) + 1 :]
    if spec in ADAPTERS:
        return "hub", ADAPTERS[spec], ""
    for name, adapter in ADAPTERS.items():
        if spec.startswith(name + ":"):
            path = spec[len(name) + 1 :]
            if not Path(path).exists():
                raise FileNotFoundError(f"{spec!r}: local copy {path!r} of {name} does not exist")
            return "local", adapter, path
    if Path(spec).exists():
        return "generic", None, spec
    raise ConfigError(
        f"unknown dataset {spec!r}. Available: {', '.join(available_datasets())}; a hub name may be given a "
        f"local copy as NAME:PATH; or pass an existing .json/.jsonl/.parquet file (or directory of them) "
        f"with fields prompt / chosen / rejected, or synthetic:key=value,..."
    )


def dataset_name(spec: str) -> str | None:
    """The dataset a ``--data_path`` spec names (a hub name, also for ``NAME:LOCAL_PATH``; ``synthetic`` /
    ``synthetic_code`` whatever their options), or None for a file of the generic layout: what a task declares
    in its ``datasets`` (:mod:`marlhf.tasks`)."""
    kind, adapter, _ = parse_spec(spec)
    if kind in (SYNTHETIC, SYNTHETIC_CODE):
        return kind
    return adapter.name if adapter is not None else None


def _convert(rows: Iterable[files.Row], row_fn: RowFn, policy: BadRowPolicy, drops: Counter) -> list[Record]:
    """Apply ``row_fn`` to every row; bad rows go to the policy, dropped rows to ``drops``."""
    records: list[Record] = []
    first: DataError | None = None  # --bad_rows error: the first bad row, raised after counting the others
    later: Counter = Counter()
    for file, index, row in rows:
        try:
            if isinstance(row, DataError):
                raise row
            if not isinstance(row, dict):
                raise DataError(file, index, "<row>", f"expected an object, got {type(row).__name__}")
            out = row_fn(row, file, index)
        except DataError as err:
            if policy.mode != "error":
                policy.handle(err)
            elif first is None:
                first = err
            else:
                later[(err.field, err.reason)] += 1
            continue
        except DroppedRow as drop:
            drops[(file, drop.field, drop.reason)] += 1
            continue
        records.extend(out if isinstance(out, list) else [out])
    if first is not None:
        raise first.with_note(bad_rows_note(later))
    return records


# ------------------------------------------------------------------------------------------------------ hub
def _hub_rows(adapter: Adapter, split: str) -> Iterable[files.Row] | None:
    hub_split = adapter.hub_splits.get(split)
    if hub_split is None:
        return None
    try:
        import datasets  # lazy: heavy, and only the hub path needs it

        ds = datasets.load_dataset(adapter.name, adapter.hub_config, split=hub_split)
    except Exception as err:  # offline, gated, script-based, renamed... all end the same way for the user
        raise DatasetUnavailableError(
            f"could not load {adapter.name!r} (split {hub_split!r}) from the Hugging Face hub: "
            f"{type(err).__name__}: {err}\nWithout network access, download the published files and pass "
            f"'{adapter.name}:PATH', PATH being one row file or a directory holding {adapter.local_hint}."
        ) from err
    label = f"{adapter.name}[{hub_split}]"
    return ((label, index, row) for index, row in enumerate(ds, 1))


# ---------------------------------------------------------------------------------------------------- local
def _local_rows(adapter: Adapter | None, path: Path, split: str, row_fn: RowFn):
    """(rows, row_fn) of a local copy, or None.  A file is the train split; a directory is searched."""
    name = adapter.name if adapter is not None else "local data"
    if path.is_file():
        if files.row_extension(path.name) is None:
            expected = ", ".join(files.ROW_EXTENSIONS)
            raise ConfigError(f"{path}: unsupported file type for {name} (expected {expected})")
        return (files.iter_rows([path]), row_fn) if split == "train" else None
    if adapter is not None and adapter.row_fn is apps_row:
        apps = _apps_folder_rows(path, split, row_fn)
        if apps is not False:
            return apps
    stems = (adapter.local_stems if adapter is not None else _GENERIC_STEMS).get(split, ())
    found = files.find_split_files(path, stems)
    if found:
        return files.iter_rows(found), row_fn
    if split == "train":
        hint = adapter.local_hint if adapter is not None else "train.jsonl / train.json / train.parquet"
        raise FileNotFoundError(f"{path}: no train file of {name} found (expected {hint})")
    return None


def _apps_folder_rows(root: Path, split: str, row_fn: RowFn):
    """(rows, row_fn) of the original APPS folder layout; None if no such split; False if not that layout.

    ``root/<split>/<id>/`` is the split; problem folders directly in ``root`` are the train split only.
    The returned row_fn makes errors name the problem's file holding the bad field (``.../solutions.json``).
    """
    if files.apps_problem_dirs(root / split):
        problems = files.apps_problem_dirs(root / split)
    elif files.apps_problem_dirs(root) and not any((root / s).is_dir() for s in SPLITS):
        if split != "train":
            return None
        problems = files.apps_problem_dirs(root)
    elif any(files.apps_problem_dirs(root / s) for s in SPLITS):
        return None  # train/ or test/ folders exist, just not this split
    else:
        return False

    def rows():
        for index, folder in enumerate(problems, 1):
            try:
                yield str(folder), index, files.apps_problem_row(folder, index)
            except DataError as err:
                yield str(folder), index, err

    def folder_row_fn(row: dict, folder: str, index: int):
        try:
            return row_fn(row, folder, index)
        except DataError as err:
            raise DataError(files.apps_file_of(folder, err.field), err.row, err.field, err.reason) from None

    return rows(), folder_row_fn


# ------------------------------------------------------------------------------------------------ synthetic
def parse_synthetic_options(text: str, config_cls: type) -> dict:
    """``"seed=7,num_records=500"`` -> typed keyword arguments for ``config_cls`` (a dataclass).

    Values are converted to the type of the field's default (int, float, bool, str); an unknown key or a
    value that does not convert is a ValueError naming it and the valid keys.
    """
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    options: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key:
            raise ConfigError(f"synthetic option {item!r} is not key=value")
        if key not in fields:
            raise ConfigError(f"unknown synthetic option {key!r}; valid: {', '.join(fields)}")
        options[key] = _convert_option(key, value, fields[key])
    return options


def _convert_option(key: str, value: str, field: dataclasses.Field):
    default = field.default
    if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    kind = type(default) if default not in (None, dataclasses.MISSING) else field.type
    if isinstance(kind, str):  # annotations are strings under `from __future__ import annotations`
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, kind)
    try:
        if kind is bool:
            if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise ValueError(value)
            return value.lower() in ("1", "true", "yes")
        if kind in (int, float, str):
            return kind(value)
    except ValueError:
        raise ConfigError(f"synthetic option {key}={value!r}: expected {kind.__name__}") from None
    raise ConfigError(f"synthetic option {key!r} (type {kind}) cannot be set from a --data_path spec")


def _load_synthetic(options_text: str, split: str, drops: Counter) -> list[Record]:
    """The embedded task.  The test split is generated from seed + SYNTHETIC_TEST_SEED_OFFSET, and any test
    record whose prompt also occurs in train (possible by chance) is dropped and counted."""
    # lazy: the generator is only needed for this source
    from marlhf.embedded import task as embedded_task

    cfg = embedded_task.SyntheticConfig(**parse_synthetic_options(options_text, embedded_task.SyntheticConfig))
    if split == "train":
        return synthetic_records(cfg)
    train_prompts = {r.prompt for r in synthetic_records(cfg)}
    test_cfg = dataclasses.replace(cfg, seed=cfg.seed + SYNTHETIC_TEST_SEED_OFFSET)
    records = []
    for record in synthetic_records(test_cfg):
        if record.prompt in train_prompts:
            drops[(SYNTHETIC, "prompt", "test prompt also in train")] += 1
        else:
            records.append(record)
    return records


def synthetic_records(cfg) -> list[Record]:
    """``embedded_task.generate(cfg)``, kept under ``$MARLHF_HOME/records`` after the first call: generating and
    gold-scoring 4,000 pairs takes seconds, and steps 2 and 3 each read train and test.  The file is keyed
    by the settings and the generator's source, so a changed generator never reads old records; a home
    that cannot be written to only costs the time, and a generator with no source file is not cached."""
    from marlhf.embedded import task as embedded_task
    from marlhf.utils.cache import default_home

    if not getattr(embedded_task, "__file__", None):
        return list(embedded_task.generate(cfg))
    source = Path(embedded_task.__file__).read_bytes()
    key = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode() + source)
    path = default_home() / "records" / f"synthetic-{key.hexdigest()[:20]}.jsonl"
    if path.is_file():
        return [Record(**json.loads(line)) for line in path.read_text().splitlines()]
    records = list(embedded_task.generate(cfg))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
        os.replace(tmp, path)  # atomic: concurrent ranks and crashes never leave half a file under the name
    except OSError as err:
        logger.info("synthetic records not cached (%s): %s", path, err)
    return records


def _load_synthetic_code(options_text: str) -> list[Record]:
    """The generated code task (train only: the caller holds out part of it for evaluation)."""
    from marlhf.embedded import code_task

    options = parse_synthetic_options(options_text, code_task.SyntheticCodeConfig)
    return code_task.generate(code_task.SyntheticCodeConfig(**options))
