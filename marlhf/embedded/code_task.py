"""A tiny generated code task in APPS layout: small integer-arithmetic problems with unit tests.

``--data_path synthetic_code[:k=v,...]`` gives records shaped like the APPS adapter's (paper §4.4, B.5):
the APPS prompt ("QUESTION: ... Use Standard Input format / Use Call-Based format ANSWER:"), a reference
program as ``chosen``, a program with wrong constants as ``rejected`` (so a reward model could be trained
too), and the problem's tests in ``meta["input_output"]`` (stdin/stdout cases, or ``fn_name`` call-based
cases), ``difficulty`` "introductory", ``fn_name``, ``starter_code`` and ``problem_id``.  Every problem is a
one-line formula over one or two integers, so step 3 with ``--reward_source program_tests`` runs end to end
on CPU with the embedded tiny model in a handful of steps.  Deterministic in the config: problem i depends
on (seed, i) only.

Knobs for experiments (the defaults give the original task): ``operations`` keeps the first k formula
templates, ``max_constant`` bounds the constants, and ``flaw_rate`` makes that share of the demonstrations
(``chosen``, what step 1 imitates) buggy — the result off by one (``... + 1``), as scraped solutions carry bugs
— so an SFT policy writes the bug at about that rate and step 3's program tests have something to remove
(``scripts/bench_code_task.py``).  Flaws are drawn from their own random stream: the problems, tests and
``rejected`` programs do not depend on ``flaw_rate``.
"""

from __future__ import annotations

import dataclasses
import random

from marlhf.data.adapters.rows import apps_prompt
from marlhf.data.records import Record

# (formula template over x [, y], how the question says it); constants a, b are drawn per problem
FORMULAS = [
    ("{a} * x + {b}", "{a} times x plus {b}"),
    ("x * x - {a}", "the square of x minus {a}"),
    ("x % {a}", "the remainder of x divided by {a}"),
    ("(x + {a}) // {b}", "x plus {a}, divided by {b} and rounded down"),
    ("max(x, {a}) * {b}", "the larger of x and {a}, times {b}"),
    ("x * y + {a}", "x times y plus {a}"),
    ("{a} * x - y", "{a} times x minus y"),
    ("abs(x - y) + {b}", "the distance between x and y plus {b}"),
]
FN_NAMES = ["solve", "compute", "calc", "value", "answer"]


@dataclasses.dataclass(frozen=True)
class SyntheticCodeConfig:
    seed: int = 0
    num_records: int = 400
    num_tests: int = 4  # unit tests per problem
    call_based_share: float = 0.5  # share of problems asking for a function instead of a stdin program
    operations: int = len(FORMULAS)  # the first k formula templates are used
    max_constant: int = 9  # constants a in [2, max], b in [1, max]
    flaw_rate: float = 0.0  # share of demonstrations (``chosen``) whose result is off by one

    def __post_init__(self):
        if self.num_records < 1 or self.num_tests < 1:
            raise ValueError("num_records and num_tests must be >= 1")
        for name in ("call_based_share", "flaw_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 1 <= self.operations <= len(FORMULAS):
            raise ValueError(f"operations must be in [1, {len(FORMULAS)}], got {self.operations}")
        if self.max_constant < 2:
            raise ValueError(f"max_constant must be >= 2, got {self.max_constant}")


def _program(expr: str, names: list[str], fn_name: str | None) -> str:
    if fn_name:
        return f"def {fn_name}({', '.join(names)}):\n    return {expr}\n"
    read = f"{names[0]} = int(input())" if len(names) == 1 else f"{', '.join(names)} = map(int, input().split())"
    return f"{read}\nprint({expr})\n"


def problem(seed: int, index: int, cfg: SyntheticCodeConfig | None = None) -> Record:
    """Problem ``index`` of the task seeded ``seed``."""
    cfg = cfg or SyntheticCodeConfig(seed=seed)
    rng = random.Random(f"marlhf-synthetic-code-v1:{seed}:{index}")
    template, words = rng.choice(FORMULAS[:cfg.operations])
    a, b = rng.randint(2, cfg.max_constant), rng.randint(1, cfg.max_constant)
    expr, said = template.format(a=a, b=b), words.format(a=a, b=b)
    wrong = template.format(a=a + 1, b=b + 1)  # the rejected program: its constants off by one
    names = ["x", "y"] if "y" in expr else ["x"]
    call = rng.random() < cfg.call_based_share
    fn_name = rng.choice(FN_NAMES) if call else None
    cases = [[rng.randint(-20, 50) for _ in names] for _ in range(cfg.num_tests)]
    results = [eval(expr, {"max": max, "abs": abs}, dict(zip(names, c))) for c in cases]  # noqa: S307 - own text
    given = " and ".join(names)
    if call:
        question = (f"Write a function {fn_name}({', '.join(names)}) that takes the integer(s) {given} and "
                    f"returns {said}.")
        starter = f"def {fn_name}({', '.join(names)}):\n"
        io_spec = {"fn_name": fn_name, "inputs": cases, "outputs": results}
    else:
        question = (f"Read the integer(s) {given} from one line of standard input (separated by a space) and "
                    f"print {said}.")
        starter = ""
        io_spec = {"inputs": [" ".join(map(str, c)) + "\n" for c in cases], "outputs": [f"{r}\n" for r in results]}
    meta = {"problem_id": f"synthetic_code-{seed}-{index}", "difficulty": "introductory", "fn_name": fn_name,
            "starter_code": starter, "input_output": io_spec}
    flawed = random.Random(f"marlhf-synthetic-code-flaw:{seed}:{index}").random() < cfg.flaw_rate
    shown = f"{expr} + 1" if flawed else expr  # the demonstration's bug: its result off by one
    return Record(prompt=apps_prompt(question, starter, call_based=call), chosen=_program(shown, names, fn_name),
                  rejected=_program(wrong, names, fn_name), source=f"synthetic_code:{index}", meta=meta)


def generate(cfg: SyntheticCodeConfig | None = None) -> list[Record]:
    cfg = cfg or SyntheticCodeConfig()
    return [problem(cfg.seed, i, cfg) for i in range(cfg.num_records)]
