"""The program-test reward source (paper B.5): responses -> programs -> sandboxed unit tests -> rewards.

Implements the reward-source shape ``score(prompts, responses, meta) -> scores`` with the problem's tests
taken from each record's ``meta`` (``input_output`` as kept by the APPS adapter), so nothing re-parses the
prompt.  Identical (program, tests) pairs in a batch run once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from marlhf.code.apps import extract_code, unit_tests_of
from marlhf.code.sandbox import DEFAULT_LIMITS, VERDICTS, Limits, ProgramResult, run_programs

# What a held-out evaluation reports next to the mean reward (``program_<component>``, means over answers):
# one 0/1 indicator per verdict — the verdict mix; the mean of ``pass`` (every test passed) is pass@1 with one
# sample per problem, Table 3's metric — and ``tests_passed``, the share of its tests an answer passes.
COMPONENTS = VERDICTS + ("tests_passed",)


def run_responses(responses: Sequence[str], metas: Sequence[dict], limits: Limits = DEFAULT_LIMITS, workers: int = 1,
                  isolation: str = "auto") -> list[ProgramResult]:
    """One :class:`ProgramResult` per response: its code block run against ``meta["input_output"]``."""
    if len(responses) != len(metas):
        raise ValueError(f"{len(responses)} responses but {len(metas)} meta entries")
    keys, jobs, index = [], [], {}
    for k, (response, meta) in enumerate(zip(responses, metas)):
        if not isinstance(meta, dict) or not meta.get("input_output"):
            raise ValueError(f"sample {k}: meta has no 'input_output' tests (not an APPS-style record?)")
        source = extract_code(response)
        key = (source, json.dumps(meta["input_output"], sort_keys=True))
        if key not in index:
            index[key] = len(jobs)
            jobs.append((source, unit_tests_of(meta["input_output"], f"sample {k}: meta['input_output']")))
        keys.append(index[key])
    results = run_programs(jobs, limits, workers=workers, isolation=isolation)
    return [results[i] for i in keys]


class ProgramTestReward:
    """Reward source ``program_tests``: the compiler-signal reward of each response (App. B.5)."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS, workers: int = 1, isolation: str = "auto"):
        self.limits, self.workers, self.isolation = limits, workers, isolation
        self.components = COMPONENTS

    def score(self, prompts: Sequence[str], responses: Sequence[str], meta: Sequence[dict], *,
              ended: Sequence[bool] | None = None) -> list[float]:
        """``ended`` is not used: an answer cut at the length limit is still run (a cut program usually fails
        to compile, and the verdict says so)."""
        return [r.reward for r in self._run(prompts, responses, meta)]

    def details(self, prompts: Sequence[str], responses: Sequence[str], ended: Sequence[bool] | None = None,
                meta: Sequence[dict] | None = None) -> list[dict[str, float]]:
        """Per answer: ``total`` (the reward) and the :data:`COMPONENTS` (verdict indicators, share of tests)."""
        return [result_details(r) for r in self._run(prompts, responses, meta)]

    def _run(self, prompts, responses, meta) -> list[ProgramResult]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if meta is None:
            raise ValueError("program tests need each prompt's record meta (its 'input_output' tests)")
        return run_responses(responses, meta, self.limits, self.workers, self.isolation)


def result_details(result: ProgramResult) -> dict[str, float]:
    """``total`` = the B.5 reward, a 0/1 indicator per verdict, and ``tests_passed`` (the share of tests)."""
    return ({"total": result.reward} | {v: float(result.verdict == v) for v in VERDICTS}
            | {"tests_passed": result.passed / result.total})
