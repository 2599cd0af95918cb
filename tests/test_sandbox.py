"""The program-test sandbox: APPS reference solutions pass, hostile programs are contained with the right
verdict, rewards follow paper B.5, and results do not depend on the number of workers.

Containment is shown through what the program prints (the expected output is what a contained program
sees) and through checks on the host after the run (files, processes, a sentinel process, our own pid).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import cli_cmd

from marlhf.code import sandbox as sb
from marlhf.code.apps import extract_code, load_problem, unit_tests_of
from marlhf.code.sandbox import Limits, TestCase, compiler_signal_reward, run_program, run_programs

APPS = Path(__file__).parent / "fixtures" / "apps_sample"
FAST = Limits(time_s=1.5, memory_mb=512, max_processes=16, output_kb=256)
ONE = [TestCase("stdin", "", "ok")]
IS_ROOT = os.geteuid() == 0


def run1(source: str, limits: Limits = FAST, tests=ONE):
    return run_program(source, tests, limits)


def processes_with(token: str) -> list[str]:
    """Pids of live processes whose command line ends with ``token`` (a unique argument of /bin/sleep)."""
    return [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).endswith(token)]


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


# ----------------------------------------------------------------------------------------- APPS problems
@pytest.mark.parametrize("problem", ["0001", "0111", "2404", "4184"])
def test_reference_solutions_pass(problem):
    p = load_problem(APPS / problem)
    result = run_program(p.solutions[0], p.tests)
    assert (result.verdict, result.passed, result.total, result.reward) == ("pass", len(p.tests), len(p.tests), 1.0)


def test_problem_folder_fields():
    p = load_problem(APPS / "4184")
    assert (p.difficulty, p.fn_name, len(p.tests)) == ("introductory", "is_prime", 8)
    assert p.tests[0] == TestCase("call", [1], [False], "is_prime")
    assert "def is_prime" in p.starter_code
    s = load_problem(APPS / "0001")
    assert (s.difficulty, s.fn_name, s.tests[0].kind) == ("interview", None, "stdin")
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        unit_tests_of({"inputs": ["a", "b"], "outputs": ["c"]})


def test_partial_and_wrong_programs_on_a_call_based_problem():
    p = load_problem(APPS / "4184")  # 8 tests; expected: F T T F F T T F
    always_false = "def is_prime(n):\n    return False\n"
    result = run_program(always_false, p.tests, FAST)
    assert (result.verdict, result.passed) == ("wrong_answer", 4)
    assert result.reward == pytest.approx(-0.3 + 1.3 * 4 / 8)
    # LeetCode-style class and a missing function
    cls = "class Solution:\n    def is_prime(self, n):\n        return n in (2, 5, 29, 53)\n"
    assert run_program(cls, p.tests, FAST).passed == 8
    missing = run_program("def other(n):\n    return 1\n", p.tests[:1], FAST)
    assert missing.verdict == "runtime_error" and "is_prime" in missing.tests[0].detail


def test_stdin_comparison_normalises_whitespace():
    tests = [TestCase("stdin", "1 2\n", "3\n"), TestCase("stdin", "", "a b\nc")]
    ok = run_program("import sys\nd=sys.stdin.read().split()\nprint(int(d[0])+int(d[1]) if d else 'a  b \\n\\nc  ')",
                     tests, FAST)
    assert [t.verdict for t in ok.tests] == ["pass", "pass"]
    assert run_program("print(4)", tests[:1], FAST).verdict == "wrong_answer"


def test_extract_code():
    assert extract_code("text\n```python\nprint(1)\n```\nmore ```py\nx\n```") == "print(1)\n"
    assert extract_code("```\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```python\nprint(3)\n") == "print(3)\n"  # cut off by max new tokens
    assert extract_code("print(4)") == "print(4)"


# -------------------------------------------------------------------------------------------- rewards
@pytest.mark.parametrize("verdict,passed,total,reward", [
    ("pass", 4, 4, 1.0),  # -0.3 + 1.3
    ("wrong_answer", 1, 4, -0.3 + 1.3 / 4),
    ("wrong_answer", 0, 4, -0.3),
    ("runtime_error", 3, 4, -0.6),
    ("timeout", 3, 4, -0.6),  # a timeout counts as a runtime error (APPS harness)
    ("compile_error", 0, 4, -1.0),
])
def test_compiler_signal_reward(verdict, passed, total, reward):
    assert compiler_signal_reward(verdict, passed, total) == pytest.approx(reward)


def test_reward_rejects_bad_inputs():
    with pytest.raises(ValueError, match="unknown verdict"):
        compiler_signal_reward("accepted", 1, 1)
    with pytest.raises(ValueError, match="total > 0"):
        compiler_signal_reward("pass", 0, 0)
    with pytest.raises(ValueError, match="no tests"):
        run_programs([("print(1)", [])])


def test_verdicts_and_rewards_of_real_runs():
    cases = {
        "print('ok')": ("pass", 1.0),
        "print('no')": ("wrong_answer", -0.3),
        "raise ValueError('boom')": ("runtime_error", -0.6),
        "def f(:\n  pass": ("compile_error", -1.0),
        "while True:\n    pass": ("timeout", -0.6),
    }
    results = run_programs([(src, ONE) for src in cases], Limits(time_s=1.0), workers=2)
    for (src, (verdict, reward)), r in zip(cases.items(), results):
        assert (r.verdict, r.reward) == (verdict, pytest.approx(reward)), src
    assert results[2].tests[0].detail == "ValueError: boom"


# ------------------------------------------------------------------------------------------ containment
def test_infinite_loop_times_out_on_wall_and_cpu():
    start = time.monotonic()
    r = run1("while True:\n    pass", Limits(time_s=1.0))
    assert r.verdict == "timeout" and time.monotonic() - start < 6
    sleeper = run1("import time\ntime.sleep(60)", Limits(time_s=1.0))  # no CPU used: the wall clock stops it
    assert sleeper.verdict == "timeout"


def test_fork_bomb_is_capped_and_cleaned_up():
    token = f"{time.time_ns() % 10**9}.0001"  # every bomb process becomes `sleep TOKEN`: easy to look for
    bomb = ("import os\nwhile True:\n    try:\n        if os.fork() == 0:\n"
            f"            os.execv('/bin/sleep', ['sleep', '{token}'])\n    except OSError:\n        pass\n")
    start = time.monotonic()
    r = run1(bomb, Limits(time_s=1.5, max_processes=16))
    assert r.verdict == "timeout" and time.monotonic() - start < 10
    plain = run1("import os\nwhile True:\n    os.fork()\n", Limits(time_s=1.5, max_processes=16))
    assert plain.verdict in ("runtime_error", "timeout")  # the first failed fork raises in some process
    assert processes_with(token) == []


def test_memory_bomb_is_a_runtime_error():
    for src in ("x = bytearray(8 << 30)", "a = []\nwhile True:\n    a.append(bytearray(1 << 24))"):
        r = run1(src, Limits(time_s=4.0, memory_mb=256))
        assert r.verdict == "runtime_error" and "MemoryError" in r.tests[0].detail, src


def test_writing_outside_its_directory_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "work"))
    (tmp_path / "work").mkdir()
    target = tmp_path / "pwned"
    src = (
        "import os\nwrote = []\n"
        f"for path in [{str(target)!r}, '/etc/pwned', '/var/tmp/pwned', '/dev/shm/pwned', "
        "os.path.expanduser('~') + '/../pwned']:\n"
        "    try:\n        open(path, 'w').write('x')\n        wrote.append(path)\n"
        "    except OSError:\n        pass\n"
        "open('mine.txt', 'w').write('fine')\n"
        "print('wrote', len(wrote), open('mine.txt').read())\n"
    )
    r = run1(src, FAST, [TestCase("stdin", "", "wrote 0 fine")])
    assert r.verdict == "pass", r.tests
    assert not target.exists() and not Path("/etc/pwned").exists() and not Path("/var/tmp/pwned").exists()
    assert list((tmp_path / "work").iterdir()) == []  # its working directory was removed


def test_file_size_limit():
    r = run1("open('big', 'wb').write(b'x' * (4 << 20))", Limits(time_s=2.0, file_size_mb=1))
    assert r.verdict == "runtime_error"


def test_parent_environment_secrets_are_invisible(monkeypatch):
    monkeypatch.setenv("MARLHF_TEST_SECRET", "hunter2")
    src = (
        "import os, glob\n"
        "seen = 'hunter2' in str(os.environ)\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n        seen = seen or b'hunter2' in open(path, 'rb').read()\n"
        "    except OSError:\n        pass\n"
        "print('visible' if seen else 'absent', sorted(os.environ))\n"
    )
    r = run1(src, FAST, [TestCase("stdin", "", "absent ['HOME', 'LANG', 'LC_ALL', 'PATH']")])
    assert r.verdict == "pass", r.tests


def test_network_is_unreachable():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    port = server.getsockname()[1]
    src = (
        "import socket\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    print('connected')\n"
        "except OSError as e:\n    print('blocked')\n"
    )
    try:
        assert run1(src, FAST, [TestCase("stdin", "", "blocked")]).verdict == "pass"
        uncaught = run1(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert uncaught.verdict == "runtime_error"
        with pytest.raises(socket.timeout):
            server.accept()  # nobody ever connected
    finally:
        server.close()


def test_printing_gigabytes_is_cut_off():
    start = time.monotonic()
    r = run1("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", Limits(time_s=10.0, output_kb=256))
    assert (r.verdict, r.tests[0].detail) == ("runtime_error", "output limit exceeded")
    assert time.monotonic() - start < 8  # killed at the cap, not at the time limit


def test_killing_its_parent_harms_nobody():
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kill_parent = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('ok')"
        r = run1(kill_parent)
        assert r.verdict in ("pass", "runtime_error")  # EPERM, or the signal is ignored: contained either way
        kill_all = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\nprint('ok')"
        assert run1(kill_all).verdict == "pass"  # it can only see (and kill) its own processes
        kill_group = "import os, signal\nos.killpg(0, signal.SIGKILL)"
        assert run1(kill_group).verdict == "runtime_error"  # killed itself only (own session)
        assert sentinel.poll() is None  # the host's processes are untouched
        assert run1("print('ok')").verdict == "pass"  # and the sandbox still works
    finally:
        sentinel.kill()
        sentinel.wait()


def test_detached_child_is_killed_afterwards():
    token = f"{time.time_ns() % 10**9}.0002"
    src = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{token}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('ok')\n"
    )
    before = time.monotonic()
    r = run1(src)
    assert r.verdict == "pass" and time.monotonic() - before < 5
    assert processes_with(token) == []


def test_results_do_not_depend_on_workers():
    p = load_problem(APPS / "4184")
    programs = [
        (p.solutions[0], p.tests),
        ("def is_prime(n):\n    return n % 2 == 1\n", p.tests),
        ("def is_prime(n):\n    raise KeyError(n)\n", p.tests[:3]),
        ("print(input())", [TestCase("stdin", "a\n", "a"), TestCase("stdin", "b\n", "c")]),
    ]
    one = run_programs(programs, FAST, workers=1, tests_per_process=8)
    two = run_programs(programs, FAST, workers=2, tests_per_process=3)
    assert [r.to_dict() for r in one] == [r.to_dict() for r in two]
    assert [r.passed for r in one] == [8, 3, 0, 1]


def test_isolation_levels():
    if IS_ROOT:
        for level, match in (("none", "refusing to run untrusted programs as root"), ("userns", "use 'root'")):
            with pytest.raises(sb.SandboxError, match=match):
                sb.resolve_isolation(level)
    with pytest.raises(ValueError, match="isolation must be"):
        sb.resolve_isolation("chroot")


UNPRIVILEGED_SCRIPT = """
import json, sys
from marlhf.code.sandbox import Limits, SandboxError, TestCase, run_program
try:
    r = run_program(sys.argv[1], [TestCase("stdin", "hi\\n", "hi")], Limits(time_s=3), isolation=sys.argv[2])
    print(json.dumps(r.to_dict()))
except SandboxError as err:
    print(json.dumps({"error": str(err)}))
"""


def run_unprivileged(program: str, isolation: str) -> dict:
    """Run the sandbox as an unprivileged caller (uid nobody when we are root) with the system
    interpreter, which that uid can read."""
    python = "/usr/bin/python3" if IS_ROOT else sys.executable
    if not os.access(python, os.X_OK):
        pytest.skip(f"no interpreter {python} readable by an unprivileged uid")
    drop = (lambda: (os.setgroups([]), os.setgid(65534), os.setuid(65534))) if IS_ROOT else None
    out = subprocess.run([python, "-c", UNPRIVILEGED_SCRIPT, program, isolation], capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(Path(__file__).parents[1]), "PATH": "/usr/bin:/bin"},
                         preexec_fn=drop, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_unprivileged_caller_uses_a_user_namespace():
    probe = ("import os, socket\nprint(input())\ntry:\n    socket.create_connection(('127.0.0.1', 9), 1)\n"
             "    raise SystemExit('network reachable')\nexcept OSError:\n    pass\n"
             "assert not os.path.exists('/work') and not os.path.exists('/home')\n"
             "try:\n    os.chroot('/usr')\n    raise SystemExit('chroot allowed')\nexcept PermissionError:\n    pass\n")
    row = run_unprivileged(probe, "userns")
    if "error" in row:  # unprivileged user namespaces are disabled here: the error says what failed
        assert "could not build the sandbox (isolation 'userns')" in row["error"]
    else:
        assert row["verdict"] == "pass", row


def test_without_namespaces_sockets_are_blocked_and_orphans_killed():
    probe = ("import os, socket\nprint(input())\n"
             "try:\n    socket.socket()\n    raise SystemExit('socket allowed')\nexcept PermissionError:\n    pass\n"
             "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
             "        os.execv('/bin/sleep', ['sleep', '77.0123'])\n    os._exit(0)\n")
    row = run_unprivileged(probe, "none")
    assert row["verdict"] == "pass", row
    time.sleep(0.2)
    assert processes_with("77.0123") == []
    forks = run_unprivileged("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                             "        pass\n", "none")
    assert forks["verdict"] == "timeout"


def test_execute_cli(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text("```python\ndef is_prime(n):\n    return n in (2, 5, 29, 53)\n```")
    out = subprocess.run([*cli_cmd("execute"),
                          "--problem", str(APPS / "4184"), "--program", str(program), "--time_limit", "2"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert (row["verdict"], row["passed"], row["total"], row["reward"]) == ("pass", 8, 8, 1.0)
    assert row["tests"] == ["pass"] * 8
    program.write_text("import os\nos.kill(os.getppid(), 9)\nwhile True: pass")
    bad = subprocess.run([*cli_cmd("execute"),
                          "--problem", str(APPS / "0001"), "--program", str(program), "--time_limit", "1"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert bad.returncode == 0
    assert json.loads(bad.stdout.strip().splitlines()[-1])["verdict"] in ("runtime_error", "timeout")


def test_concurrent_runs_from_threads():
    # Two callers at once (e.g. reward workers) never share a jail or a uid.
    results = [None, None]

    def go(i):
        results[i] = run1("import os\nprint('ok')")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.verdict for r in results] == ["pass", "pass"]


def test_signals_are_named():
    r = run1("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert r.verdict == "runtime_error" and "SIGSEGV" in r.tests[0].detail
    assert signal.SIGXCPU  # the CPU limit's signal exists here (maps to timeout)
    assert run1("raise SystemExit(200)").tests[0].detail == "exit code 200"  # 72 is no signal: no crash
