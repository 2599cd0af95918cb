"""APPS problems (Hendrycks et al. 2021) as unit tests for the sandbox, and code extraction from responses.

A problem folder holds question.txt, solutions.json, input_output.json ({"inputs", "outputs"} and, for
call-based problems, "fn_name"), metadata.json ({"difficulty", "url"}) and optionally starter_code.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from marlhf.code.sandbox import TestCase

DIFFICULTIES = ("introductory", "interview", "competition")


@dataclasses.dataclass(frozen=True)
class AppsProblem:
    problem_id: str
    question: str
    difficulty: str  # "" when the folder has no metadata.json
    fn_name: str | None  # call-based problems; None for stdin/stdout ones
    starter_code: str
    tests: tuple[TestCase, ...]
    solutions: tuple[str, ...]


def unit_tests_of(io_spec: dict, where: str = "input_output") -> tuple[TestCase, ...]:
    """The unit tests of an APPS ``input_output`` object; errors name ``where`` and the field."""
    if not isinstance(io_spec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(io_spec).__name__}")
    inputs, outputs = io_spec.get("inputs"), io_spec.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError(f"{where}: 'inputs' and 'outputs' must be lists")
    if len(inputs) != len(outputs):
        raise ValueError(f"{where}: {len(inputs)} inputs but {len(outputs)} outputs")
    fn_name = io_spec.get("fn_name")
    tests = []
    for k, (given, expected) in enumerate(zip(inputs, outputs)):
        if fn_name:
            if not isinstance(given, list):
                raise ValueError(f"{where}: inputs[{k}]: a call-based test needs a list of arguments")
            tests.append(TestCase("call", given, expected, fn_name))
        else:
            given = "\n".join(given) if isinstance(given, list) else given
            if not isinstance(given, str):
                raise ValueError(f"{where}: inputs[{k}]: expected text, got {type(given).__name__}")
            tests.append(TestCase("stdin", given, expected))
    return tuple(tests)


def load_problem(folder: str | Path) -> AppsProblem:
    """One APPS problem folder; clear errors name the file at fault."""
    folder = Path(folder)
    io_path = folder / "input_output.json"
    if not io_path.is_file():
        raise FileNotFoundError(f"{folder}: not an APPS problem folder (no input_output.json)")
    try:
        io_spec = json.loads(io_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{io_path}: malformed JSON: {err}") from None
    meta_path, sol_path, starter_path = folder / "metadata.json", folder / "solutions.json", folder / "starter_code.py"
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    solutions = json.loads(sol_path.read_text(encoding="utf-8")) if sol_path.is_file() else []
    question = (folder / "question.txt").read_text(encoding="utf-8") if (folder / "question.txt").is_file() else ""
    return AppsProblem(
        problem_id=folder.name,
        question=question,
        difficulty=str(meta.get("difficulty", "")),
        fn_name=io_spec.get("fn_name") or None,
        starter_code=starter_path.read_text(encoding="utf-8") if starter_path.is_file() else "",
        tests=unit_tests_of(io_spec, str(io_path)),
        solutions=tuple(solutions),
    )


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(response: str) -> str:
    """The program in a model response: the first fenced block labelled python (else the first fenced
    block of any label; an unterminated last fence counts); a response without fences is taken as code."""
    blocks = _FENCE.findall(response)
    for label, body in blocks:
        if label.lower() in ("python", "py", "python3"):
            return body
    if blocks:
        return blocks[0][1]
    return response
