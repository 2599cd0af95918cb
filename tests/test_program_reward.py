"""The program-test reward source: responses scored from the tests in Record.meta (paper B.5)."""

import pytest

from marlhf.code.sandbox import Limits
from marlhf.rewards.program_tests import ProgramTestReward, run_responses

DOUBLE = {"input_output": {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]}, "difficulty": "introductory"}
NEG = {"input_output": {"fn_name": "neg", "inputs": [[1], [-3]], "outputs": [-1, 3]}}


def test_rewards_of_each_outcome():
    responses = [
        "```python\nprint(2 * int(input()))\n```",  # both pass: -0.3 + 1.3 = 1.0
        "print(4)",  # one of two: -0.3 + 0.65
        "print(1 / 0)",  # runtime error
        "```python\nprint(2 *\n```",  # compile error
        "def neg(x):\n    return -x",
        "def neg(x):\n    return x",  # neither test passes: -0.3
    ]
    metas = [DOUBLE] * 4 + [NEG] * 2
    scores = ProgramTestReward(Limits(time_s=2.0), workers=2).score(["p"] * 6, responses, metas)
    assert scores == pytest.approx([1.0, -0.3 + 1.3 / 2, -0.6, -1.0, 1.0, -0.3])


def test_duplicates_run_once_and_keep_their_place():
    results = run_responses(["print(4)", "print(2 * int(input()))", "print(4)"], [DOUBLE] * 3, Limits(time_s=2.0))
    assert [r.passed for r in results] == [1, 2, 1]
    assert results[0] is results[2]


def test_missing_tests_are_named():
    with pytest.raises(ValueError, match="sample 1: meta has no 'input_output'"):
        run_responses(["print(1)", "print(2)"], [DOUBLE, {}])
    with pytest.raises(ValueError, match="2 responses but 1 meta"):
        run_responses(["a", "b"], [DOUBLE])
