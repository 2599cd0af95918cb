"""Sandboxed execution of generated programs against unit tests, and the compiler-signal reward (paper B.5).

Every test runs in a fresh jail (see ``_supervisor.py`` for the process tree): its own session and
process group; its own pid, network and mount namespaces where the OS allows it; a root filesystem of
read-only system directories, the interpreter and the program, with an empty ``/tmp`` (its working
directory, removed afterwards) the only writable place; a minimal environment; an unprivileged uid of its
own when we are root; rlimits on CPU time, address space, processes, file size and open files; a
wall-clock limit; stdout captured up to a cap.  A test's verdict is one of :data:`VERDICTS`; a program's
verdict and reward follow from its tests' verdicts.

Isolation levels (``isolation=`` argument, "auto" picks the one that works here):
- ``"root"``: the caller is root: namespaces + the jail + a per-run unprivileged uid (the program cannot
  see the host's files outside the system directories, nor its processes, nor the network).
- ``"userns"``: unprivileged callers with user namespaces enabled: the same jail; the program keeps the
  caller's (non-root) uid and holds no capabilities.
- ``"none"``: no namespaces available (refused as root).  A warning is logged: the network is blocked
  only inside Python (socket constructors replaced); orphans are still killed (the supervisor is a child
  subreaper) but the program runs with the caller's uid and can see its files and processes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
SUPERVISOR = _HERE / "_supervisor.py"
HARNESS = _HERE / "_harness.py"

PASS, WRONG_ANSWER, RUNTIME_ERROR, TIMEOUT, COMPILE_ERROR = (
    "pass", "wrong_answer", "runtime_error", "timeout", "compile_error")
VERDICTS = (PASS, WRONG_ANSWER, RUNTIME_ERROR, TIMEOUT, COMPILE_ERROR)
ISOLATIONS = ("root", "userns", "none")
SANDBOX_UID_BASE = 1_000_000_000  # jailed uid = base + supervisor pid: unique among concurrent runs
MAX_SOURCE_BYTES = 1 << 20


class SandboxError(RuntimeError):
    """The sandbox itself could not run (never raised for anything a program does)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-test resource limits.  Defaults follow the APPS harness (4 s per test)."""

    time_s: float = 4.0  # wall clock; the CPU-time rlimit is ceil(time_s) (+1 s hard)
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    max_processes: int = 32  # processes + threads of the jailed uid (RLIMIT_NPROC): stops fork bombs
    file_size_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)
    output_kb: int = 8192  # stdout beyond this kills the test (runtime error, "output limit exceeded")
    open_files: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"Limits.{field.name} must be > 0, got {getattr(self, field.name)!r}")

    def as_job(self) -> dict:
        return {
            "time_s": self.time_s,
            "cpu_s": max(1, math.ceil(self.time_s)),
            "memory_bytes": self.memory_mb << 20,
            "max_processes": self.max_processes,
            "file_size_bytes": self.file_size_mb << 20,
            "output_bytes": self.output_kb << 10,
            "open_files": self.open_files,
        }


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class TestCase:
    """One unit test.  ``kind`` "stdin": ``input`` is the text on stdin, ``expected`` the text on stdout.
    ``kind`` "call": ``input`` is the list of arguments of ``fn_name``, ``expected`` its return value."""

    __test__ = False  # not a pytest class

    kind: str
    input: object
    expected: object
    fn_name: str | None = None

    def __post_init__(self):
        if self.kind not in ("stdin", "call"):
            raise ValueError(f"TestCase.kind must be 'stdin' or 'call', got {self.kind!r}")
        if self.kind == "call" and not (self.fn_name and isinstance(self.input, list)):
            raise ValueError("a call test needs fn_name and a list of arguments as input")
        if self.kind == "stdin" and not isinstance(self.input, str):
            raise ValueError(f"a stdin test needs text input, got {type(self.input).__name__}")


@dataclasses.dataclass(frozen=True)
class TestResult:
    __test__ = False

    verdict: str
    detail: str = ""  # why (last line of the traceback, "output limit exceeded", ...), empty on a pass
    wall_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class ProgramResult:
    verdict: str
    passed: int
    total: int
    reward: float
    tests: tuple[TestResult, ...]

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "passed": self.passed,
            "total": self.total,
            "reward": self.reward,
            "tests": [t.verdict for t in self.tests],
            "details": [t.detail for t in self.tests],
        }


# ------------------------------------------------------------------------------------------------ rewards
def program_verdict(verdicts: Sequence[str]) -> str:
    """The program's verdict from its tests': the worst one, in the order compile > runtime > timeout > WA."""
    if not verdicts:
        raise ValueError("a program needs at least one test to get a verdict")
    for v in (COMPILE_ERROR, RUNTIME_ERROR, TIMEOUT, WRONG_ANSWER):
        if v in verdicts:
            return v
    return PASS


def compiler_signal_reward(verdict: str, passed: int, total: int) -> float:
    """Paper B.5 (after Shojaee et al. 2023; Liu et al. 2023):

    R = -1.0 on a compile error, -0.6 on a runtime error, else -0.3 + 1.3 * N_pass / (N_pass + N_fail).

    A timeout counts as a runtime error, as in the APPS harness those works evaluate with (it reports a
    timed-out test like a crashed one); wrong answers are the N_fail of a program that ran.
    """
    if verdict not in VERDICTS:
        raise ValueError(f"unknown verdict {verdict!r}; expected one of {VERDICTS}")
    if total <= 0 or not 0 <= passed <= total:
        raise ValueError(f"need 0 <= passed <= total and total > 0, got passed={passed}, total={total}")
    if verdict == COMPILE_ERROR:
        return -1.0
    if verdict in (RUNTIME_ERROR, TIMEOUT):
        return -0.6
    return -0.3 + 1.3 * passed / total


# ------------------------------------------------------------------------------------------- comparison
def _text(value) -> str:
    """APPS stores some inputs/outputs as lists of lines."""
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def outputs_match(test: TestCase, stdout: str) -> bool:
    """APPS semantics.  stdin tests: equal after normalising whitespace (tokens split on any whitespace).
    call tests: the returned JSON value equals the expected one, or its only element (APPS wraps some
    expected values in a one-element list)."""
    if test.kind == "stdin":
        return stdout.split() == _text(test.expected).split()
    lines = stdout.strip().splitlines()
    if not lines:
        return False
    try:
        got = json.loads(lines[-1])
    except json.JSONDecodeError:
        return False
    want = test.expected
    return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])


def check_compiles(source: str) -> str | None:
    """None if ``source`` compiles, else the reason (syntax errors never reach the sandbox)."""
    if len(source.encode("utf-8", "replace")) > MAX_SOURCE_BYTES:
        return f"program larger than {MAX_SOURCE_BYTES} bytes"
    try:
        compile(source, "program.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _test_verdict(test: TestCase, raw: dict, isolation: str) -> TestResult:
    if raw.get("setup_error"):
        raise SandboxError(f"could not build the sandbox (isolation {isolation!r}): {raw['setup_error'].strip()}")
    wall, code = raw["wall_s"], raw["exit_code"]
    if raw["state"] == "timeout" or code == 128 + signal.SIGXCPU:
        return TestResult(TIMEOUT, "time limit exceeded", wall)
    if raw["state"] == "output_limit":
        return TestResult(RUNTIME_ERROR, "output limit exceeded", wall)
    if code != 0:
        lines = raw["stderr_tail"].strip().splitlines()
        why = lines[-1] if lines else ""
        if code - 128 in signal.valid_signals():  # (an exit status above 128 may also be the program's own)
            why = f"killed by {signal.Signals(code - 128).name}" + (f" ({why})" if why else "")
        return TestResult(RUNTIME_ERROR, why or f"exit code {code}", wall)
    if outputs_match(test, raw["stdout"]):
        return TestResult(PASS, "", wall)
    return TestResult(WRONG_ANSWER, "output differs from the expected one", wall)


# --------------------------------------------------------------------------------------------- running
@functools.cache
def _interpreter(python: str) -> tuple[str, str]:
    """(real path, installation prefix) of the interpreter that runs programs; the jail binds the prefix
    read-only at its own path."""
    real = os.path.realpath(python)
    out = subprocess.run([real, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"],
                         capture_output=True, text=True, check=True)
    prefix = os.path.realpath(out.stdout.strip())
    if os.path.commonpath([prefix, real]) != prefix:
        raise SandboxError(f"interpreter {real} is not inside its prefix {prefix}; pass python= explicitly")
    return real, prefix


def _supervise(job: dict, timeout: float) -> tuple[list[dict] | None, str]:
    """Run one supervisor; (raw results or None, its stderr)."""
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(SUPERVISOR)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    try:
        out, err = proc.communicate(json.dumps(job).encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = b"", b"supervisor exceeded its own time budget"
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing of this run survives it
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = err.decode("utf-8", "replace")
    if proc.returncode != 0 or not out.strip():
        return None, text
    return json.loads(out), text


def _run_chunk(source: str, tests: Sequence[TestCase], first_index: int, limits: Limits, isolation: str,
               python: str) -> list[TestResult]:
    executable, prefix = _interpreter(python)
    work_dir = tempfile.mkdtemp(prefix="marlhf-sandbox-")
    try:
        os.chmod(work_dir, 0o755)  # isolation "none" + a dropped uid: the program must reach its test dir
        code_dir = Path(work_dir, "code")
        code_dir.mkdir(mode=0o755)
        (code_dir / "program.py").write_text(source, encoding="utf-8")
        shutil.copyfile(HARNESS, code_dir / "harness.py")
        for f in code_dir.iterdir():
            f.chmod(0o444)
        job = {
            "isolation": isolation,
            "uid_base": SANDBOX_UID_BASE if isolation == "root" else None,
            "python": executable,
            "python_prefix": prefix,
            "work_dir": work_dir,
            "code_dir": str(code_dir),
            "limits": limits.as_job(),
            "first_index": first_index,
            "tests": [{"kind": t.kind, "fn_name": t.fn_name,
                       "stdin": _text(t.input) if t.kind == "stdin" else json.dumps(t.input)} for t in tests],
        }
        budget = len(tests) * (limits.time_s + 5.0) + 10.0
        raws, stderr = _supervise(job, budget)
        if raws is None:
            if isolation != "none":
                raise SandboxError(f"sandbox supervisor failed: {stderr.strip()[-2000:]}")
            # Without a pid namespace the program can reach the supervisor (same uid): that is its fault.
            return [TestResult(RUNTIME_ERROR, "the program killed the sandbox supervisor")] * len(tests)
        return [_test_verdict(t, raw, isolation) for t, raw in zip(tests, raws)]
    finally:
        _remove_tree(work_dir)


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(func, p, _exc):
        os.chmod(os.path.dirname(p), 0o700)
        func(p)

    shutil.rmtree(path, onerror=make_writable_and_retry)


@functools.cache
def resolve_isolation(isolation: str = "auto", python: str | None = None) -> str:
    """The isolation level to use: ``isolation`` itself, or for "auto" the strongest that works here."""
    if isolation != "auto":
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be 'auto' or one of {ISOLATIONS}, got {isolation!r}")
        if isolation == "none" and os.geteuid() == 0:
            raise SandboxError("refusing to run untrusted programs as root without namespaces (isolation "
                               "'none'): a program could signal or overwrite anything on this machine")
        if isolation == "userns" and os.geteuid() == 0:
            raise SandboxError("isolation 'userns' is for unprivileged callers: as root the program would be "
                               "root in its user namespace (mapped to the host's root); use 'root'")
        return isolation
    python = python or sys.executable
    probe = [TestCase("stdin", "", "ok")]
    reasons = []
    for level in ("root",) if os.geteuid() == 0 else ("userns",):
        try:
            if _run_chunk("print('ok')", probe, 0, Limits(), level, python)[0].verdict == PASS:
                return level
            reasons.append(f"{level}: probe program failed")
        except SandboxError as err:
            reasons.append(f"{level}: {err}")
    if os.geteuid() == 0:
        raise SandboxError("no namespaces available as root and isolation 'none' is refused as root: "
                           + "; ".join(reasons))
    logger.warning("sandbox: no namespaces available (%s); running programs WITHOUT network/pid/mount "
                   "isolation: sockets are blocked only inside Python and programs share this uid",
                   "; ".join(reasons))
    return "none"


def run_programs(programs: Sequence[tuple[str, Sequence[TestCase]]], limits: Limits = Limits(),
                 workers: int = 1, isolation: str = "auto", python: str | None = None,
                 tests_per_process: int = 8) -> list[ProgramResult]:
    """Run each (source, tests) and return one :class:`ProgramResult` per program, in order.

    Work is cut into chunks of at most ``tests_per_process`` tests of one program (one supervisor each,
    every test still in its own jail) and run by ``workers`` concurrent supervisors.  Every test starts
    from the same clean state, so the results do not depend on ``workers`` or on the chunking.
    """
    if workers < 1 or tests_per_process < 1:
        raise ValueError(f"workers and tests_per_process must be >= 1, got {workers}, {tests_per_process}")
    python = python or sys.executable
    level = resolve_isolation(isolation, python)
    compile_errors = [check_compiles(source) for source, _ in programs]
    chunks = []
    for p, (_source, tests) in enumerate(programs):
        if not tests:
            raise ValueError(f"program {p} has no tests: it cannot be scored")
        if compile_errors[p] is None:
            for start in range(0, len(tests), tests_per_process):
                chunks.append((p, start, tests[start:start + tests_per_process]))
    results: dict[tuple[int, int], list[TestResult]] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_run_chunk, programs[p][0], tests, start, limits, level, python): (p, start)
                   for p, start, tests in chunks}
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
    out = []
    for p, (_, tests) in enumerate(programs):
        if compile_errors[p] is not None:
            per_test = [TestResult(COMPILE_ERROR, compile_errors[p])] * len(tests)
        else:
            per_test = [r for start in range(0, len(tests), tests_per_process) for r in results[(p, start)]]
        verdicts = [r.verdict for r in per_test]
        verdict = program_verdict(verdicts)
        passed = verdicts.count(PASS)
        out.append(ProgramResult(verdict, passed, len(tests), compiler_signal_reward(verdict, passed, len(tests)),
                                 tuple(per_test)))
    return out


def run_program(source: str, tests: Sequence[TestCase], limits: Limits = Limits(), workers: int = 1,
                isolation: str = "auto", python: str | None = None) -> ProgramResult:
    """One program against its tests (the tests are spread over ``workers`` supervisors)."""
    per_process = max(1, math.ceil(len(tests) / workers)) if tests else 1
    return run_programs([(source, tests)], limits, workers, isolation, python, per_process)[0]
