"""The APPS adapter keeps each problem's tests, difficulty, fn_name and starter code in Record.meta, and
those tests run in the sandbox as they are (the reference solution passes)."""

import dataclasses
from pathlib import Path

import pytest

from marlhf.code.apps import unit_tests_of
from marlhf.code.sandbox import run_program
from marlhf.data.adapters import apps_row, load_records
from marlhf.data.records import DataError, Record

FIX = Path(__file__).parent / "fixtures"


def test_record_meta_is_backwards_compatible():
    old = Record("p", " c", None, "f:1")
    assert old.meta == {} and Record(**old.to_dict()) == old
    assert Record(**{k: v for k, v in old.to_dict().items() if k != "meta"}) == old  # cached dicts of before
    hash(Record("p", " c", meta={"tests": [1]}))  # still hashable


def test_problem_folders_keep_tests_difficulty_fn_name_starter_code():
    records = load_records(f"codeparrot/apps:{FIX / 'adapters' / 'apps'}", "train")
    by_problem = {r.meta["problem_id"]: r.meta for r in records}
    assert by_problem[1] == {"problem_id": 1, "difficulty": "interview", "fn_name": "largest",
                             "starter_code": 'def largest(xs):\n    """Return the largest element of xs."""\n',
                             "input_output": {"fn_name": "largest", "inputs": [[[1, 5, 2]]], "outputs": [5]}}
    assert by_problem[0]["fn_name"] is None and by_problem[0]["input_output"]["inputs"]


def test_hub_rows_keep_meta_and_tests_run():
    records = load_records(f"codeparrot/apps:{FIX / 'adapters' / 'apps_rows'}", "train")
    metas = [r.meta for r in records]
    assert [(m["problem_id"], m["difficulty"], m["fn_name"]) for m in metas] == [
        (7, "introductory", None), (8, "interview", "neg")]
    for record in records:
        result = run_program(record.chosen, unit_tests_of(record.meta["input_output"]))
        assert result.verdict == "pass", record.source


def test_bad_tests_are_the_rows_error():
    row = {"question": "q", "solutions": '["print(1)"]', "input_output": '{"inputs": ["1"], "outputs": []}'}
    with pytest.raises(DataError, match=r"f.jsonl: row 3: field 'input_output': 1 inputs but 0 outputs"):
        apps_row(row, "f.jsonl", 3)
    with pytest.raises(DataError, match="field 'difficulty'"):
        apps_row({**row, "input_output": "", "difficulty": 3}, "f.jsonl", 3)
    assert dataclasses.replace(apps_row({**row, "input_output": ""})[0], meta={}).meta == {}
