"""Run one program against one APPS problem folder in the sandbox and print one JSON line.

    marlhf execute --problem DIR --program FILE [--time_limit S] [--memory_mb M] [--workers W]

The line holds verdict, passed, total, reward (paper B.5) and the per-test verdicts and details.  The exit
status is 0 whatever the program did: its misbehaviour is a verdict, not an error of this tool.  A fenced
code block in FILE (a raw model response) is extracted first.
"""

import argparse
import json
import logging
import sys

from marlhf.code.apps import extract_code, load_problem
from marlhf.code.sandbox import Limits, run_program


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", required=True, help="APPS problem folder (input_output.json, ...)")
    parser.add_argument("--program", required=True, help="file with the program or a model response")
    parser.add_argument("--time_limit", type=float, default=Limits.time_s, help="seconds per test")
    parser.add_argument("--memory_mb", type=int, default=Limits.memory_mb, help="address space per test")
    parser.add_argument("--workers", type=int, default=1, help="tests run by this many concurrent sandboxes")
    parser.add_argument("--isolation", default="auto", choices=["auto", "root", "userns", "none"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    problem = load_problem(args.problem)
    with open(args.program, encoding="utf-8", errors="replace") as f:
        source = extract_code(f.read())
    result = run_program(source, problem.tests, Limits(time_s=args.time_limit, memory_mb=args.memory_mb),
                         workers=args.workers, isolation=args.isolation)
    print(json.dumps({"problem": problem.problem_id, "difficulty": problem.difficulty, **result.to_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
