"""pass@k of generated programs on APPS problems, per difficulty and overall (paper §4.4, Table 3).

    marlhf pass-at-k --problems APPS_SPLIT_DIR --samples samples.jsonl --k 1 5 --workers 2

``samples.jsonl`` rows: {"problem_id": "0001", "response": "..."} (a model response: its code block is
extracted) — every problem needs at least max(k) samples.  Each sample runs in the sandbox; a sample is
correct when it passes all of its problem's tests.  Prints one JSON object: the pass@k table and the
per-problem (n, c) counts; ``--output`` also writes it to a file.
"""

import argparse
import json
import logging
import sys
from pathlib import Path

from marlhf.code.apps import extract_code, load_problem
from marlhf.code.sandbox import Limits, run_programs
from marlhf.data.adapters.files import iter_file_rows
from marlhf.data.records import DataError
from marlhf.errors import ConfigError, run_cli
from marlhf.eval.pass_at_k import pass_at_k_table


def read_samples(path: str) -> dict[str, list[str]]:
    """Responses per problem id; a bad row is a DataError naming file, row and field."""

    if not Path(path).is_file():
        raise ConfigError(f"samples file {path!r} does not exist")
    by_problem: dict[str, list[str]] = {}
    for file, n, row in iter_file_rows(Path(path)):
        if isinstance(row, DataError):
            raise row
        pid, response = row.get("problem_id"), row.get("response")
        if not isinstance(pid, (str, int)) or isinstance(pid, bool):
            raise DataError(file, n, "problem_id", "missing" if pid is None
                            else f"expected text or an integer, got {type(pid).__name__}")
        if not isinstance(response, str):
            raise DataError(file, n, "response", "missing" if response is None
                            else f"expected text, got {type(response).__name__}")
        by_problem.setdefault(str(pid), []).append(response)
    return by_problem


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", required=True, help="folder of APPS problem folders (<id>/...)")
    parser.add_argument("--samples", required=True, help="jsonl of {problem_id, response}")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--time_limit", type=float, default=Limits.time_s)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    samples = read_samples(args.samples)
    problems = {pid: load_problem(Path(args.problems) / pid) for pid in sorted(samples)}
    jobs = [(pid, extract_code(r)) for pid in sorted(samples) for r in samples[pid]]
    logging.info("running %d programs of %d problems with %d workers", len(jobs), len(problems), args.workers)
    results = run_programs([(src, problems[pid].tests) for pid, src in jobs], Limits(time_s=args.time_limit),
                           workers=args.workers)
    counts: dict[str, list[int]] = {pid: [0, 0] for pid in problems}
    for (pid, _), result in zip(jobs, results):
        counts[pid][0] += 1
        counts[pid][1] += result.verdict == "pass"
    table = pass_at_k_table([(problems[p].difficulty or "unknown", n, c) for p, (n, c) in counts.items()], args.k)
    report = {"pass_at_k": table, "problems": {p: {"n": n, "c": c, "difficulty": problems[p].difficulty}
                                                for p, (n, c) in counts.items()}}
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
