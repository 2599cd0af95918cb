"""Time the program-test sandbox: per-program overhead and program-test rewards per second.

    python scripts/bench_sandbox.py [--programs 16] [--tests 4] [--workers 1 2] [--out bench_results/sandbox.json]

Overhead: one trivial program ("print(input())") against one test, run --repeats times; the wall time is
the cost of a jail (fork, namespaces, mounts, interpreter start-up, clean-up) around a program doing nothing.
Throughput: a batch of --programs APPS-style programs (a mix: correct, wrong answer, runtime error) with
--tests stdin tests each, scored by run_programs with each --workers count; prints programs/second and
tests/second and writes --out JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from marlhf.code.sandbox import Limits, TestCase, resolve_isolation, run_program, run_programs  # noqa: E402

PROGRAMS = [
    "n = int(input())\nprint(sum(range(n + 1)))\n",  # correct
    "n = int(input())\nprint(n * (n + 1) // 2 + (n == 7))\n",  # wrong on one test
    "n = int(input())\nprint(sum(range(n + 1)) // (n - 7))\n",  # crashes on one test
    "import sys\nn = int(sys.stdin.readline())\ntotal = 0\nfor i in range(n + 1):\n    total += i\nprint(total)\n",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=16)
    parser.add_argument("--tests", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench_results/sandbox.json")
    args = parser.parse_args()
    isolation = resolve_isolation("auto")
    limits = Limits(time_s=4.0)

    one = [TestCase("stdin", "x\n", "x")]
    run_program("print(input())", one, limits)  # warm-up (interpreter lookup, page cache)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        assert run_program("print(input())", one, limits).verdict == "pass"
        times.append(time.perf_counter() - start)
    overhead = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}
    print(f"isolation {isolation}: per-program overhead (1 trivial test) median {overhead['median_ms']:.1f} ms, "
          f"min {overhead['min_ms']:.1f} ms over {args.repeats} runs")

    tests = [TestCase("stdin", f"{n}\n", str(n * (n + 1) // 2)) for n in (3, 7, 100, 12345)[: args.tests]]
    tests += [TestCase("stdin", f"{n}\n", str(n * (n + 1) // 2)) for n in range(20, 20 + args.tests - len(tests))]
    batch = [(PROGRAMS[i % len(PROGRAMS)], tests) for i in range(args.programs)]
    throughput = {}
    reference = None
    for workers in args.workers:
        start = time.perf_counter()
        results = run_programs(batch, limits, workers=workers)
        elapsed = time.perf_counter() - start
        rewards = [r.reward for r in results]
        reference = reference or rewards
        assert rewards == reference, "results changed with the number of workers"
        throughput[workers] = {"seconds": elapsed, "programs_per_s": len(batch) / elapsed,
                               "tests_per_s": len(batch) * len(tests) / elapsed}
        print(f"workers {workers}: {len(batch)} programs x {len(tests)} tests in {elapsed:.2f} s = "
              f"{len(batch) / elapsed:.1f} programs/s, {len(batch) * len(tests) / elapsed:.1f} tests/s")
    print(f"mean reward {sum(reference) / len(reference):+.3f} (same for every worker count)")

    report = {"isolation": isolation, "overhead": overhead, "throughput": throughput, "programs": args.programs,
              "tests_per_program": len(tests), "cpus": os.cpu_count(), "python": platform.python_version(),
              "machine": platform.platform()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
