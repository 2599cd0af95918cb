"""Row -> Record functions, one per dataset, each taking the dataset's *published* row schema.

The hub path (``datasets.load_dataset``) and the local path (``NAME:PATH``) feed the same functions, so a
local copy of a dataset gives exactly the records the hub would.  Every function takes
``(row, file, index)``: ``file`` and the 1-based ``index`` only serve error messages and ``Record.source``.
A row that cannot be used raises :class:`~marlhf.data.records.DataError` naming file, row and field; a
row left out *by design* (a WebGPT tie) raises :class:`DroppedRow`, which the loader counts and logs.

Prompt formats follow the paper's Appendix B.1/B.2 (TL;DR as in Stiennon et al. 2020; Human/Assistant
template for dialogue and QA; Hendrycks et al. 2021 for APPS).  Responses of preference data start with one
space, as in the HH-RLHF dialogues, so ``prompt + chosen`` reads naturally after the final colon.
"""

from __future__ import annotations

import json
import re

from marlhf.code.apps import unit_tests_of
from marlhf.data.records import DataError, Record, require_text

HUMAN = "\n\nHuman:"
ASSISTANT = "\n\nAssistant:"


class DroppedRow(Exception):
    """A well-formed row that the adapter leaves out on purpose (not a bad row); the loader counts it."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"field '{field}': {reason}")


def _source(file: str, index: int) -> str:
    return f"{file}:{index}"


def _require_dict(row: dict, field: str, file: str, index: int) -> dict:
    value = row.get(field)
    if value is None:
        raise DataError(file, index, field, "missing")
    if not isinstance(value, dict):
        raise DataError(file, index, field, f"expected an object, got {type(value).__name__}")
    return value


def _require_number(row: dict, field: str, file: str, index: int) -> float:
    value = row.get(field)
    if value is None:
        raise DataError(file, index, field, "missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(file, index, field, f"expected a number, got {type(value).__name__}")
    return float(value)


def _nested_text(obj: dict, key: str, path: str, file: str, index: int) -> str:
    """:func:`require_text` on a nested object, reporting the field by its full ``path`` (e.g. info.post)."""
    try:
        return require_text(obj, key, file, index)
    except DataError as err:
        raise DataError(file, index, path, err.reason) from None


def _optional_text(row: dict, field: str, file: str, index: int) -> str | None:
    """``row[field]`` if present and not None (then it must be non-empty text), else None."""
    if row.get(field) is None:
        return None
    return require_text(row, field, file, index)


# ---------------------------------------------------------------------------------------------- generic
def generic_row(row: dict, file: str = "<row>", index: int = 0) -> Record:
    """A local file with fields ``prompt``, ``chosen`` and optional ``rejected`` (absent/null -> SFT)."""
    return Record(
        prompt=require_text(row, "prompt", file, index),
        chosen=require_text(row, "chosen", file, index),
        rejected=_optional_text(row, "rejected", file, index),
        source=_source(file, index),
    )


# ------------------------------------------------------------------------------------ Dahoas/full-hh-rlhf
def dahoas_row(row: dict, file: str = "<row>", index: int = 0) -> Record:
    """Dahoas/full-hh-rlhf (and Dahoas/rm-static): fields prompt, response, chosen, rejected.

    The prompt already ends in "Assistant:" and ``response`` duplicates ``chosen``, so it is not used.
    """
    return Record(
        prompt=require_text(row, "prompt", file, index),
        chosen=require_text(row, "chosen", file, index),
        rejected=require_text(row, "rejected", file, index),
        source=_source(file, index),
    )


# -------------------------------------------------------------------------------------- Anthropic/hh-rlhf
def split_last_assistant_turn(dialogue: str, field: str, file: str, index: int) -> tuple[str, str]:
    """Split a "\\n\\nHuman: ...\\n\\nAssistant: ..." dialogue before its last Assistant response.

    Returns (prompt ending in "\\n\\nAssistant:", response).  A dialogue with no Assistant turn, an empty last
    response, or one that ends with a Human turn cannot give a (prompt, response) pair.
    """
    cut = dialogue.rfind(ASSISTANT)
    if cut < 0:
        raise DataError(file, index, field, "dialogue has no '\\n\\nAssistant:' turn")
    cut += len(ASSISTANT)
    prompt, response = dialogue[:cut], dialogue[cut:]
    if HUMAN in response:
        raise DataError(file, index, field, "dialogue ends with a Human turn, not an Assistant response")
    if not response.strip():
        raise DataError(file, index, field, "empty response after the last '\\n\\nAssistant:'")
    return prompt, response


def anthropic_hh_row(row: dict, file: str = "<row>", index: int = 0) -> Record:
    """Anthropic/hh-rlhf: ``chosen`` and ``rejected`` are whole dialogues sharing all but the last turn.

    prompt = everything up to and including the last "\\n\\nAssistant:" (the same in both dialogues, else the
    row is bad: field 'rejected'); chosen / rejected = the two last responses.
    """
    chosen_text = require_text(row, "chosen", file, index)
    rejected_text = require_text(row, "rejected", file, index)
    prompt, chosen = split_last_assistant_turn(chosen_text, "chosen", file, index)
    rejected_prompt, rejected = split_last_assistant_turn(rejected_text, "rejected", file, index)
    if rejected_prompt != prompt:
        reason = "dialogue differs from 'chosen' before the last Assistant turn"
        raise DataError(file, index, "rejected", reason)
    return Record(prompt=prompt, chosen=chosen, rejected=rejected, source=_source(file, index))


# --------------------------------------------------------------------------- openai/summarize_from_feedback
def tldr_prompt(subreddit: str | None, title: str | None, body: str) -> str:
    """The TL;DR prompt of Stiennon et al. (2020); lines whose field is absent (CNN/DM rows) are left out."""
    lines = []
    if subreddit:
        lines.append(f"SUBREDDIT: r/{subreddit}")
    if title:
        lines.append(f"TITLE: {title}")
    lines.append(f"POST: {body}")
    return "\n".join(lines) + "\nTL;DR:"


def summarize_row(row: dict, file: str = "<row>", index: int = 0) -> Record:
    """openai/summarize_from_feedback, config "comparisons": info, summaries[2], choice (0/1).

    Reddit rows carry ``info.post``; the CNN/DM validation rows have ``info.post`` null and ``info.article``
    instead (and no subreddit), so the body is whichever exists.
    """
    info = _require_dict(row, "info", file, index)
    if info.get("post") is not None:
        body = _nested_text(info, "post", "info.post", file, index).strip()
    elif info.get("article") is not None:
        body = _nested_text(info, "article", "info.article", file, index).strip()
    else:
        raise DataError(file, index, "info.post", "missing (and no info.article either)")
    for key in ("subreddit", "title"):
        if info.get(key) is not None and not isinstance(info[key], str):
            raise DataError(file, index, f"info.{key}", f"expected text, got {type(info[key]).__name__}")
    prompt = tldr_prompt(info.get("subreddit"), (info.get("title") or "").strip() or None, body)

    choice = row.get("choice")
    if choice is None:
        raise DataError(file, index, "choice", "missing")
    if isinstance(choice, bool) or choice not in (0, 1):
        raise DataError(file, index, "choice", f"expected 0 or 1, got {choice!r}")
    summaries = row.get("summaries")
    if summaries is None:
        raise DataError(file, index, "summaries", "missing")
    if not isinstance(summaries, list) or len(summaries) != 2:
        raise DataError(file, index, "summaries", "expected a list of two summaries")
    texts = []
    for k, summary in enumerate(summaries):
        if not isinstance(summary, dict):
            kind = type(summary).__name__
            raise DataError(file, index, f"summaries[{k}]", f"expected an object, got {kind}")
        texts.append(" " + _nested_text(summary, "text", f"summaries[{k}].text", file, index).strip())
    return Record(prompt=prompt, chosen=texts[choice], rejected=texts[1 - choice],
                  source=_source(file, index))


# ------------------------------------------------------------------------------ openai/webgpt_comparisons
# Answers cite the browsing quotes as "[1]", "[2, 3]", "[1-3]"; the quotes are not part of the prompt, so the
# markers are removed (DeepSpeed-Chat removes bracketed text too; this pattern only touches numeric markers).
_CITATION = re.compile(r" ?\[\d+(?:\s*[,\-\u2013]\s*\d+)*\]")


def strip_citations(answer: str) -> str:
    return _CITATION.sub("", answer).strip()


def webgpt_row(row: dict, file: str = "<row>", index: int = 0) -> Record:
    """openai/webgpt_comparisons: question.full_text, answer_0/1, score_0/1 (quotes/tokens unused).

    The higher-scored answer is chosen; an equal score is no preference, so the row raises
    :class:`DroppedRow` (counted by the loader, not an error).
    """
    question = _require_dict(row, "question", file, index)
    text = _nested_text(question, "full_text", "question.full_text", file, index).strip()
    answers = []
    for k in (0, 1):
        answer = strip_citations(require_text(row, f"answer_{k}", file, index))
        if not answer:
            raise DataError(file, index, f"answer_{k}", "empty text once citation markers are removed")
        answers.append(" " + answer)
    score_0 = _require_number(row, "score_0", file, index)
    score_1 = _require_number(row, "score_1", file, index)
    if score_0 == score_1:
        raise DroppedRow("score_0/score_1", "tie: equal scores give no preference")
    chosen, rejected = (answers[0], answers[1]) if score_0 > score_1 else (answers[1], answers[0])
    return Record(prompt=f"{HUMAN} {text}{ASSISTANT}", chosen=chosen, rejected=rejected,
                  source=_source(file, index))


# -------------------------------------------------------------------------------------------- codeparrot/apps
def _load_json_field(row: dict, field: str, file: str, index: int):
    value = row.get(field)
    if not isinstance(value, str):
        raise DataError(file, index, field, f"expected a JSON string, got {type(value).__name__}")
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise DataError(file, index, field, f"malformed JSON: {err.msg} (char {err.pos})") from None


def apps_prompt(question: str, starter_code: str, call_based: bool) -> str:
    """The APPS prompt of Hendrycks et al. (2021): starter code only when the problem has some."""
    prompt = "\nQUESTION:\n" + question
    if starter_code.strip():
        prompt += "\n" + starter_code
    prompt += "\nUse Call-Based format" if call_based else "\nUse Standard Input format"
    return prompt + "\nANSWER:\n"


def apps_row(row: dict, file: str = "<row>", index: int = 0, max_solutions: int | None = 1) -> list[Record]:
    """codeparrot/apps: problem_id, question, solutions (JSON list), input_output (JSON), starter_code, ...

    SFT pairs: one Record per reference solution, at most ``max_solutions`` (None = all) in their published
    order.  The default 1 keeps one record per problem, so a prompt is never repeated within a split (a
    2,4,4 split of steps 1-3 then splits problems, and step 3 does not see the same problem many times).
    A problem without solutions (many test problems) is a bad row.
    """
    if max_solutions is not None and max_solutions < 1:
        raise ValueError(f"max_solutions_per_problem must be >= 1 or None, got {max_solutions}")
    question = require_text(row, "question", file, index)
    if row.get("solutions") in (None, ""):
        raise DataError(file, index, "solutions", "no reference solutions")
    solutions = _load_json_field(row, "solutions", file, index)
    if not isinstance(solutions, list):
        raise DataError(file, index, "solutions", f"expected a JSON list, got {type(solutions).__name__}")
    if not solutions:
        raise DataError(file, index, "solutions", "no reference solutions")
    for k, solution in enumerate(solutions):
        if not isinstance(solution, str) or not solution.strip():
            raise DataError(file, index, f"solutions[{k}]", "expected non-empty code text")

    io_spec = {}  # no tests published: not call-based
    if row.get("input_output") not in (None, ""):
        io_spec = _load_json_field(row, "input_output", file, index)
    if not isinstance(io_spec, dict):
        raise DataError(file, index, "input_output", f"expected a JSON object, got {type(io_spec).__name__}")
    starter = row.get("starter_code")
    starter = "" if starter is None else starter
    if not isinstance(starter, str):
        raise DataError(file, index, "starter_code", f"expected text, got {type(starter).__name__}")

    if io_spec:
        try:  # the tests must be runnable: a bad one is this row's error, not a crash at reward time
            unit_tests_of(io_spec)
        except ValueError as err:
            raise DataError(file, index, "input_output", str(err).removeprefix("input_output: ")) from None
    difficulty = row.get("difficulty")
    if difficulty is not None and not isinstance(difficulty, str):
        raise DataError(file, index, "difficulty", f"expected text, got {type(difficulty).__name__}")

    prompt = apps_prompt(question, starter, call_based=bool(io_spec.get("fn_name")))
    kept = solutions if max_solutions is None else solutions[:max_solutions]
    # What the program-test reward and pass@k need (paper B.5, §4.4), so no scorer re-parses the prompt.
    meta = {"problem_id": row.get("problem_id"), "difficulty": difficulty or "", "fn_name": io_spec.get("fn_name"),
            "starter_code": starter, "input_output": io_spec}
    return [Record(prompt=prompt, chosen=s, rejected=None, source=_source(file, index), meta=meta) for s in kept]
