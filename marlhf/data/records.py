"""The one record type every dataset adapter produces, and the error/skip policy for bad rows.

Every source (hub dataset, local file, the embedded synthetic task) is turned into a list of
:class:`Record`: a prompt already formatted for the policy (chat template / "TL;DR:" suffix applied by
the adapter), a preferred response and, for preference data, a rejected one.  Steps 1-3 only ever see
records, so adding a dataset means writing one row -> Record function.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from marlhf.errors import UserError


@dataclasses.dataclass(frozen=True)
class Record:
    """One prompt with its responses.  ``rejected`` is None for SFT-only data (e.g. APPS).

    ``meta`` holds what a scorer needs besides the text, as JSON-able data (APPS: the problem's unit tests
    ``input_output``, ``difficulty``, ``fn_name``, ``starter_code``, ``problem_id``); empty for most data.
    """

    prompt: str
    chosen: str
    rejected: str | None = None
    source: str = ""  # "<file or dataset>:<row>" — where the record came from, for error messages
    meta: dict = dataclasses.field(default_factory=dict, hash=False)  # not hashed: records stay hashable

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class DataError(UserError, ValueError):
    """A row of an input file that cannot be used.  The message names file, row and field."""

    def __init__(self, file: str, row: int, field: str, reason: str, note: str = ""):
        self.file, self.row, self.field, self.reason = file, row, field, reason
        super().__init__(f"{file}: row {row}: field '{field}': {reason}" + (f"\n{note}" if note else ""))

    def with_note(self, note: str) -> DataError:
        """The same error with a line of advice (e.g. how many more bad rows there are, how to skip them)."""
        return DataError(self.file, self.row, self.field, self.reason, note)


def bad_rows_note(later: Counter) -> str:
    """What to tell a user whose run stopped on a bad row: the other bad rows of the source, and the flag."""
    more = sum(later.values())
    if not more:
        text = "It is the only bad row of this source"
    else:
        kinds = "; ".join(f"{n} x field '{fld}': {why}" for (fld, why), n in later.most_common(3))
        text = f"{more} more bad rows in this source ({kinds}{'; ...' if len(later) > 3 else ''})"
    return f"{text}. Pass --bad_rows skip to drop bad rows and count them in the log."


class BadRowPolicy:
    """What to do with a bad row: ``"error"`` raises its :class:`DataError`, ``"skip"`` counts it.

    Skipped rows are never silent: :meth:`summary` lists the counts per (source, field, reason) and the
    data pipeline logs it.
    """

    def __init__(self, mode: str = "error"):
        if mode not in ("error", "skip"):
            raise ValueError(f"bad_rows must be 'error' or 'skip', got {mode!r}")
        self.mode = mode
        self.skipped: Counter[tuple[str, str, str]] = Counter()

    def handle(self, err: DataError) -> None:
        if self.mode == "error":
            raise err
        self.skipped[(err.file, err.field, err.reason)] += 1

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        if not self.skipped:
            return "no rows skipped"
        lines = [f"skipped {self.num_skipped} bad rows:"]
        lines += [f"  {n} x {f}: field '{fld}': {why}" for (f, fld, why), n in sorted(self.skipped.items())]
        return "\n".join(lines)


def require_text(row: dict, field: str, file: str, index: int) -> str:
    """Return ``row[field]`` if it is a non-empty string, else raise a :class:`DataError` naming it."""
    if field not in row or row[field] is None:
        raise DataError(file, index, field, "missing")
    value = row[field]
    if not isinstance(value, str):
        raise DataError(file, index, field, f"expected text, got {type(value).__name__}")
    if not value.strip():
        raise DataError(file, index, field, "empty text")
    return value
