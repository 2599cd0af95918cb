"""The user's own reward (issue 26 §3): ``--reward_source python`` (a function in a file or module) and
``--reward_source remote`` (an HTTP server), in ``marlhf/rewards/python.py`` and ``remote.py``.

The python source is loaded from real files and modules; the remote one talks to a real HTTP server on
127.0.0.1 started by the test (no mock of the client), which records every request.  Short step-3 runs show
the rewards the function / server computed from the answers are the ones logged and reported, with a critic
started from the actor (no reward model), a critic-free estimator, and two ranks each scoring their own rows.
"""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import STEP3, deepspeed_cmd, load_main, run_launcher
from test_step3 import nano, train_rows  # noqa: F401  (nano: the module's model fixture)

from marlhf.config import RLHFArgs, parse_args
from marlhf.errors import ConfigError, RewardError, UserError, run_cli
from marlhf.rewards import build_reward_source, evaluation_sources
from marlhf.rewards.python import PythonReward
from marlhf.rewards.remote import RemoteReward
from marlhf.tasks import load_task

PROMPTS = ["p0", "p1", "p2"]
RESPONSES = ["a", "bb cc", "ddd"]
META = [{"k": 0}, {"k": 1}, {"k": 2}]


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------ python: loading
FUNCTIONS = '''
import numpy as np
import torch

def by_length(prompts, responses, meta):
    return [len(r) + 10 * m["k"] for r, m in zip(responses, meta)]

def with_ended(prompts, responses, meta, ended):
    return [1.0 if e else -1.0 for e in ended]

def with_kwargs(prompts, responses, meta, **extra):
    return [float(sorted(extra) == ["ended"] and extra["ended"][i]) for i in range(len(responses))]

def as_array(prompts, responses, meta):
    return np.array([len(r) for r in responses], dtype=np.float32)

def as_tensor(prompts, responses, meta):
    return torch.tensor([len(r) for r in responses], requires_grad=True, dtype=torch.float64) * 2

def mixed(prompts, responses, meta):
    return (True, np.float64(0.5), torch.tensor(3.0))

def mutates(prompts, responses, meta):
    meta[0]["k"] = 99
    responses.append("extra")
    return [0.0, 0.0, 0.0]

class Scorer:
    def __call__(self, *, prompts, responses, meta):
        return [-1.5] * len(responses)

scorer = Scorer()
'''


def test_python_source_loads_a_file_and_calls_it_with_keywords(tmp_path, monkeypatch):
    fn_file = write(tmp_path / "fns.py", FUNCTIONS)
    source = PythonReward(f"{fn_file}:by_length")
    assert source.score(PROMPTS, RESPONSES, META, ended=[True, False, True]) == [1.0, 15.0, 23.0]
    assert not source.takes_ended
    # a relative path is read from the working directory; the same file gives the same module back
    monkeypatch.chdir(tmp_path)
    assert PythonReward("fns.py:by_length").fn is source.fn
    # ended= only for a function that takes it (by name or **kwargs)
    assert PythonReward("fns.py:with_ended").score(PROMPTS, RESPONSES, META, ended=[True, False, True]) \
        == [1.0, -1.0, 1.0]
    assert PythonReward("fns.py:with_kwargs").score(PROMPTS, RESPONSES, META, ended=[False, True, True]) \
        == [0.0, 1.0, 1.0]
    # a callable object with keyword-only parameters
    assert PythonReward("fns.py:scorer").score(PROMPTS, RESPONSES, META) == [-1.5] * 3


def test_python_source_accepts_arrays_tensors_and_scalars(tmp_path):
    fn_file = write(tmp_path / "fns.py", FUNCTIONS)
    assert PythonReward(f"{fn_file}:as_array").score(PROMPTS, RESPONSES, META) == [1.0, 5.0, 3.0]
    assert PythonReward(f"{fn_file}:as_tensor").score(PROMPTS, RESPONSES, META) == [2.0, 10.0, 6.0]
    out = PythonReward(f"{fn_file}:mixed").score(PROMPTS, RESPONSES, META)
    assert out == [1.0, 0.5, 3.0] and all(type(x) is float for x in out)


def test_python_source_cannot_change_the_callers_lists(tmp_path):
    fn_file = write(tmp_path / "fns.py", FUNCTIONS)
    responses, meta = list(RESPONSES), [dict(m) for m in META]
    assert PythonReward(f"{fn_file}:mutates").score(PROMPTS, responses, meta) == [0.0, 0.0, 0.0]
    assert responses == RESPONSES and meta == META


def test_python_source_loads_a_module_of_a_package(tmp_path, monkeypatch):
    write(tmp_path / "my_rewards_pkg" / "__init__.py", "")
    write(tmp_path / "my_rewards_pkg" / "scoring.py",
          "def words(prompts, responses, meta):\n    return [len(r.split()) for r in responses]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = build_reward_source("python", function="my_rewards_pkg.scoring:words")
    assert isinstance(source, PythonReward)
    assert source.score(PROMPTS, RESPONSES, META) == [1.0, 2.0, 1.0]


@pytest.mark.parametrize("name, expected", [
    ("boom", r"--reward_function .*fns\.py:boom raised ZeroDivisionError: division by zero"),
    ("too_few", r"--reward_function .*fns\.py:too_few: returned 2 rewards for 3 responses"),
    ("nan", r"fns\.py:nan: reward 1 is nan \(response 1: 'bb cc'\)"),
    ("inf", r"fns\.py:inf: reward 2 is -inf \(response 2: 'ddd'\)"),
    ("text", r"fns\.py:text: reward 0 is 'good' \(str\), not a number"),
    ("none_inside", r"fns\.py:none_inside: reward 2 is None \(NoneType\), not a number"),
    ("scalar", r"fns\.py:scalar: returned float; expected a list of 3 numbers, one per response"),
    ("matrix", r"fns\.py:matrix: returned an array of shape \(3, 1\); expected one reward per response, shape \(3,\)"),
])
def test_python_source_errors_name_the_function_and_the_fault(tmp_path, name, expected):
    fn_file = write(tmp_path / "fns.py", '''
import math
import numpy as np

def boom(prompts, responses, meta):
    return 1 / 0

def too_few(prompts, responses, meta):
    return [1.0, 2.0]

def nan(prompts, responses, meta):
    return [0.0, math.nan, 1.0]

def inf(prompts, responses, meta):
    return [0.0, 1.0, -math.inf]

def text(prompts, responses, meta):
    return ["good", 1.0, 2.0]

def none_inside(prompts, responses, meta):
    return [1, 2, None]

def scalar(prompts, responses, meta):
    return 1.0

def matrix(prompts, responses, meta):
    return np.zeros((3, 1))
''')
    source = PythonReward(f"{fn_file}:{name}")
    with pytest.raises(RewardError, match=expected) as info:
        source.score(PROMPTS, RESPONSES, META)
    assert isinstance(info.value, UserError)
    if name == "boom":
        assert isinstance(info.value.__cause__, ZeroDivisionError)  # --debug shows the function's traceback


def test_a_bad_function_spec_fails_when_the_source_is_built(tmp_path, monkeypatch):
    fn_file = write(tmp_path / "fns.py", "LIMIT = 3\n\ndef one(responses):\n    return [1.0] * len(responses)\n")
    write(tmp_path / "broken.py", "import not_a_module_anywhere_xyz\n")
    monkeypatch.chdir(tmp_path)
    cases = [
        ("fns.py", r"'fns\.py': expected FILE\.py:NAME or package\.module:NAME"),
        ("fns.py:", r"expected FILE\.py:NAME"),
        ("missing.py:score", r"missing\.py:score: no such file .*missing\.py \(a relative path is read from the "
                             r"working directory"),
        ("fns.py:score", r"fns\.py:score: fns\.py has no attribute 'score'"),
        ("fns.py:LIMIT", r"fns\.py:LIMIT: LIMIT is a int, not a function"),
        ("fns.py:one", r"fns\.py:one: cannot be called as one\(prompts=\.\.\., responses=\.\.\., meta=\.\.\.\)"),
        ("broken.py:f", r"broken\.py:f: importing .*broken\.py failed: ModuleNotFoundError"),
        ("no_such_pkg_xyz.mod:f", r"no_such_pkg_xyz\.mod:f: no module 'no_such_pkg_xyz\.mod'"),
        ("json:loads_nothing", r"json:loads_nothing: json has no attribute 'loads_nothing'"),
    ]
    for spec, expected in cases:
        with pytest.raises(ConfigError, match=expected):
            build_reward_source("python", function=spec)
    with pytest.raises(ConfigError, match=r"fns\.py:nothing: .*fns\.py has no attribute 'nothing'"):
        PythonReward(f"{fn_file}:nothing")  # an absolute path


def step3_flags(*extra: str) -> list[str]:
    return ["--actor_model_name_or_path", "unused", *extra]


def test_reward_flags_are_validated_with_the_config(tmp_path, monkeypatch):
    """At parse time: the source's own flags are required, well-formed, and refused with other sources."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "r.py", "def f(prompts, responses, meta):\n    return [0.0] * len(responses)\n")
    cases = [
        (["--reward_source", "python"], "--reward_source python needs --reward_function FILE.py:NAME"),
        (["--reward_source", "python", "--reward_function", "r.py"], "expected FILE.py:NAME"),
        (["--reward_source", "python", "--reward_function", "nope.py:f"], "nope.py:f: no such file"),
        (["--reward_source", "remote"], "--reward_source remote needs --reward_url"),
        (["--reward_source", "remote", "--reward_url", "127.0.0.1:8000/score"], "expected an http:// or https://"),
        (["--reward_source", "remote", "--reward_url", "file:///etc/passwd"], "expected an http:// or https://"),
        (["--reward_source", "remote", "--reward_url", "http://127.0.0.1:1/s", "--reward_timeout", "0"],
         "--reward_timeout must be a positive number of seconds, got 0.0"),
        (["--reward_source", "remote", "--reward_url", "http://127.0.0.1:1/s", "--reward_retries", "-1"],
         "--reward_retries must be >= 0, got -1"),
        (["--reward_function", "r.py:f"], "--reward_function is for --reward_source python, not reward_model"),
        (["--reward_source", "python", "--reward_function", "r.py:f", "--reward_url", "http://127.0.0.1:1/s"],
         "--reward_url is for --reward_source remote, not python"),
        (["--reward_source", "gold", "--reward_timeout", "5"], "--reward_timeout is for --reward_source remote"),
        (["--reward_source", "program_tests", "--reward_retries", "0"],
         "--reward_retries is for --reward_source remote"),
    ]
    for flags, expected in cases:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            parse_args(RLHFArgs, step3_flags(*flags))
    args, _ = parse_args(RLHFArgs, step3_flags("--reward_source", "remote", "--reward_url", "https://rm.example/x",
                                               "--reward_timeout", "2.5", "--reward_retries", "0"))
    assert (args.reward_url, args.reward_timeout, args.reward_retries) == ("https://rm.example/x", 2.5, 0)
    args, _ = parse_args(RLHFArgs, step3_flags("--reward_source", "python", "--reward_function", "r.py:f"))
    assert args.reward_function == "r.py:f"


def test_evaluation_reports_the_users_reward_as_reward(tmp_path):
    fn_file = write(tmp_path / "fns.py", FUNCTIONS)
    source = build_reward_source("python", function=f"{fn_file}:by_length")
    assert evaluation_sources("python", source) == {"reward": source}
    remote = build_reward_source("remote", url="http://127.0.0.1:9/score")
    assert evaluation_sources("remote", remote) == {"reward": remote}
    assert "reward" not in evaluation_sources("gold", None, task=load_task("synthetic"))


# ------------------------------------------------------------------------------------------ remote: a real server
class RewardServer:
    """An HTTP server on 127.0.0.1 (a free port) in a thread.  ``answer(i, body)`` -> (status, bytes, delay
    seconds) decides the i-th request's answer; every request's path, content type, JSON body and arrival
    time are recorded.  A delayed answer waits on an event that ``stop`` sets, so no handler outlives the test."""

    def __init__(self, answer):
        self.answer, self.requests, self.lock, self.stopping = answer, [], threading.Lock(), threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    i = len(outer.requests)
                    outer.requests.append({"path": self.path, "type": self.headers["Content-Type"], "body": body,
                                           "time": time.monotonic()})
                status, payload, delay = outer.answer(i, body)
                if delay and outer.stopping.wait(delay):
                    return
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # the client gave up (timed out) and closed the connection
                    pass

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def count(self, wait_for: int = 0, deadline_s: float = 5.0) -> int:
        """Requests received; with ``wait_for``, waits (bounded) until that many have arrived."""
        end = time.monotonic() + deadline_s
        while len(self.requests) < wait_for and time.monotonic() < end:
            time.sleep(0.01)
        return len(self.requests)


def length_rewards(body) -> list[float]:
    """The test server's reward: 0.1 x the response's characters - 1, +0.5 for an answer that ended."""
    ended = body.get("ended") or [False] * len(body["responses"])
    return [0.1 * len(r) - 1.0 + 0.5 * bool(e) for r, e in zip(body["responses"], ended)]


def ok(i, body):
    return 200, json.dumps({"rewards": length_rewards(body), "extra": "ignored"}).encode(), 0


def test_remote_source_posts_json_and_reads_the_rewards():
    with RewardServer(ok) as server:
        source = build_reward_source("remote", url=server.url, timeout=10, retries=0)
        assert isinstance(source, RemoteReward)
        got = source.score(PROMPTS, RESPONSES, META, ended=[True, False, True])
        assert got == pytest.approx([-0.4, -0.5, -0.2])
        (req,) = server.requests
    assert req["path"] == "/score" and req["type"] == "application/json"
    assert req["body"] == {"prompts": PROMPTS, "responses": RESPONSES, "meta": META, "ended": [True, False, True]}


def test_remote_source_retries_a_server_error_then_succeeds():
    def flaky(i, body):
        return (500, b'{"error": "warming up"}', 0) if i == 0 else ok(i, body)

    with RewardServer(flaky) as server:
        got = RemoteReward(server.url, timeout=10, retries=3, backoff=0.01).score(PROMPTS, RESPONSES, META)
        assert got == pytest.approx([-0.9, -0.5, -0.7])
        assert server.count() == 2  # one failure, one retry


def test_remote_source_gives_up_on_a_failing_server_after_the_retries_with_growing_waits():
    with RewardServer(lambda i, body: (503, b"overloaded", 0)) as server:
        source = RemoteReward(server.url, timeout=10, retries=2, backoff=0.05)
        with pytest.raises(RewardError, match=r"--reward_url http://127\.0\.0\.1:\d+/score: no answer after 3 "
                                              r"attempts \(1 \+ --reward_retries 2, --reward_timeout 10 s each\); "
                                              r"last error: HTTP 503 Service Unavailable b'overloaded'"):
            source.score(PROMPTS, RESPONSES, META)
        assert server.count() == 3
        times = [r["time"] for r in server.requests]
    assert times[1] - times[0] >= 0.05 and times[2] - times[1] >= 0.1  # backoff, then twice it


def test_remote_source_times_out_on_a_slow_server_after_the_retries():
    with RewardServer(lambda i, body: (*ok(i, body)[:2], 30)) as server:  # answers after 30 s: never in time
        source = RemoteReward(server.url, timeout=0.2, retries=1, backoff=0.01)
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"no answer after 2 attempts \(1 \+ --reward_retries 1, "
                                              r"--reward_timeout 0\.2 s each\); last error: .*timed out"):
            source.score(PROMPTS, RESPONSES, META)
        assert time.monotonic() - t0 < 10
        assert server.count(wait_for=2) == 2


def test_remote_source_reports_a_refused_connection_after_the_retries():
    with socket.socket() as s:  # a port nobody listens on (bound, then released)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = RemoteReward(f"http://127.0.0.1:{port}/score", timeout=5, retries=1, backoff=0.01)
    with pytest.raises(RewardError, match=r"no answer after 2 attempts .*last error: ConnectionRefusedError"):
        source.score(PROMPTS, RESPONSES, META)


@pytest.mark.parametrize("status, payload, expected", [
    (422, b'{"detail": "responses missing"}', r"HTTP 422 Unprocessable \w+ b'\{\"detail\": \"responses missing\"\}' "
                                              r"\(a client error, not retried\)"),
    (200, b"<html>rewards</html>", r"the answer is not JSON \(Expecting value.*\): b'<html>rewards</html>'"),
    (200, b'{"scores": [1, 2, 3]}', r"expected a JSON object with a 'rewards' list, got \{'scores': \[1, 2, 3\]\}"),
    (200, b'{"rewards": [1.0, 2.0]}', r"returned 2 rewards for 3 responses"),
    (200, b'{"rewards": [1.0, NaN, 2.0]}', r"reward 1 is nan"),
    (200, b'{"rewards": [1.0, "2", 2.0]}', r"reward 1 is '2' \(str\), not a number"),
])
def test_remote_source_stops_at_once_on_a_client_error_or_a_malformed_answer(status, payload, expected):
    with RewardServer(lambda i, body: (status, payload, 0)) as server:
        with pytest.raises(RewardError, match=r"--reward_url http://127\.0\.0\.1:\d+/score: " + expected):
            RemoteReward(server.url, timeout=10, retries=3, backoff=0.01).score(PROMPTS, RESPONSES, META)
        assert server.count() == 1  # no retry


def test_remote_source_refuses_meta_that_is_not_json():
    source = RemoteReward("http://127.0.0.1:9/score", retries=0)
    with pytest.raises(RewardError, match="cannot be sent as JSON .*each record's meta must hold JSON values"):
        source.score(["p"], ["r"], [{"when": object()}])


# ------------------------------------------------------------------------------------------ step 3 runs
def argv_without_rm(nano, out, *extra):  # noqa: F811
    """Step 3 on the nano model with no reward model and no critic path: the critic starts from the actor."""
    return ["--actor_model_name_or_path", str(nano), "--data_path", "synthetic:num_records=400",
            "--data_output_path", str(out / "data"), "--output_dir", str(out), "--max_prompt_seq_len", "160",
            "--max_answer_seq_len", "24", "--per_device_training_batch_size", "2", "--max_eval_samples", "4",
            "--disable_progress_bar", "--seed", "3", "--actor_learning_rate", "1e-3", "--critic_learning_rate",
            "1e-3", "--max_steps", "2", *extra]


WORDS_REWARD = '''
import json
import os

CALLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl")


def words(prompts, responses, meta, ended):
    with open(CALLS, "a") as fh:
        fh.write(json.dumps({"prompts": prompts, "responses": responses, "meta": meta, "ended": ended}) + "\\n")
    return [0.5 * len(r.split()) - 2.0 + (1.0 if e else 0.0) for r, e in zip(responses, ended)]
'''


def words_reward(call) -> list[float]:
    """The reference of WORDS_REWARD, computed here from the answers the function was given."""
    return [0.5 * len(r.split()) - 2.0 + (1.0 if e else 0.0) for r, e in zip(call["responses"], call["ended"])]


def mean(xs):
    return sum(xs) / len(xs)


def test_step3_with_a_python_reward_logs_and_reports_what_the_function_computed(nano, tmp_path):  # noqa: F811
    """GAE with the critic started from the actor: the function is called for the held-out prompts (with
    their records' meta), once per training step, then for the held-out prompts again; train/reward is the
    mean of the rewards of that step's answers and the summary's reward_score the held-out mean."""
    fn_file = write(tmp_path / "fn" / "reward.py", WORDS_REWARD)
    out = tmp_path / "run"
    argv = argv_without_rm(nano, out, "--reward_source", "python", "--reward_function", f"{fn_file}:words",
                           "--per_device_generation_batch_size", "4")
    load_main(STEP3)(argv)
    calls = [json.loads(line) for line in (tmp_path / "fn" / "calls.jsonl").read_text().splitlines()]
    assert [len(c["responses"]) for c in calls] == [4, 4, 4, 4]  # initial eval, step 1, step 2, final eval
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row, call in zip(rows, calls[1:3]):
        assert row["train/reward"] == pytest.approx(mean(words_reward(call)), abs=1e-5)
        assert torch.isfinite(torch.tensor(row["train/critic_loss"]))
    assert len({r for c in calls for r in words_reward(c)}) > 2  # the answers' rewards differ
    summary = json.loads((out / "summary.json").read_text())
    for policy, call in (("initial_policy", calls[0]), ("final_policy", calls[3])):
        rewards = words_reward(call)
        assert summary[policy]["reward_score"] == pytest.approx(mean(rewards), abs=1e-5)
        sd = math.sqrt(sum((r - mean(rewards)) ** 2 for r in rewards) / (len(rewards) - 1))
        assert summary[policy]["reward_score_se"] == pytest.approx(sd / 2, abs=1e-5)
        assert "rm_score" not in summary[policy] and "gold_score" in summary[policy]
    # the held-out prompts' record meta reached the function (the synthetic task's facts)
    from ppo_harness import phase3_data, step3_tokenizer

    args, _ = parse_args(RLHFArgs, argv)
    tok, _ = step3_tokenizer(args)
    assert calls[0]["meta"] == [item["meta"] for item in phase3_data(args, tok).eval]
    assert all("facts" in m for c in calls for m in c["meta"])
    assert (out / "critic").is_dir()  # built from the actor: no reward model was given
    assert "reward none (--reward_source python)" in (out / "train.log").read_text()
    # marlhf eval-policy with the run's flags evaluates the initial policy as step 3 did: same answers,
    # same reward_score
    eval_out = tmp_path / "eval"
    eval_argv = [a if a != str(out) else str(eval_out) for a in argv]
    assert run_cli(load_main("eval_policy"), eval_argv) == 0
    evaluated = json.loads((eval_out / "eval.json").read_text())
    calls = [json.loads(line) for line in (tmp_path / "fn" / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 5 and calls[4]["responses"] == calls[0]["responses"]
    assert evaluated["reward_score"] == pytest.approx(summary["initial_policy"]["reward_score"], abs=1e-6)
    # --eval_prompts: the validation and test halves interleave the held-out prompts, disjoint and complete
    for k, part in enumerate(("validation", "test")):
        assert run_cli(load_main("eval_policy"), [*eval_argv, "--eval_prompts", part]) == 0
        calls = [json.loads(line) for line in (tmp_path / "fn" / "calls.jsonl").read_text().splitlines()]
        assert calls[5 + k]["meta"] == calls[0]["meta"][k::2]
        assert json.loads((eval_out / "eval.json").read_text())["num_prompts"] == len(calls[0]["meta"][k::2])


def test_step3_with_a_remote_reward_and_grpo(nano, tmp_path):  # noqa: F811
    """GRPO (no critic), K = 2 answers per prompt, against a real server in this process: the server got one
    request per scoring call — the held-out prompts in batches of 2, then 2 prompts x K per step, each
    prompt's meta repeated for its K answers — and train/reward is the mean of its rewards."""
    out = tmp_path / "run"
    with RewardServer(ok) as server:
        load_main(STEP3)(argv_without_rm(nano, out, "--reward_source", "remote", "--reward_url", server.url,
                                         "--reward_timeout", "30", "--advantage_estimator", "grpo",
                                         "--num_samples_per_prompt", "2", "--per_device_generation_batch_size", "2"))
        bodies = [r["body"] for r in server.requests]
    assert [len(b["responses"]) for b in bodies] == [2, 2, 4, 4, 2, 2]
    for b in bodies[2:4]:  # a training batch: rows 2i, 2i+1 answer prompt i
        assert b["prompts"][0] == b["prompts"][1] != b["prompts"][2] == b["prompts"][3]
        assert b["meta"][0] == b["meta"][1] != b["meta"][2] == b["meta"][3] and "facts" in b["meta"][0]
        assert all(isinstance(e, bool) for e in b["ended"])
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row, body in zip(rows, bodies[2:4]):
        assert row["train/reward"] == pytest.approx(mean(length_rewards(body)), abs=1e-5)
        assert "train/critic_loss" not in row
    summary = json.loads((out / "summary.json").read_text())
    assert summary["initial_policy"]["reward_score"] == pytest.approx(
        mean(length_rewards(bodies[0]) + length_rewards(bodies[1])), abs=1e-5)
    assert summary["final_policy"]["reward_score"] == pytest.approx(
        mean(length_rewards(bodies[4]) + length_rewards(bodies[5])), abs=1e-5)
    assert not (out / "critic").exists()


RECORDING_REWARD = '''
CALLS = []


def chars(prompts, responses, meta, ended):
    CALLS.append({"responses": responses, "ended": ended, "meta": meta})
    return [0.1 * len(r) - 1.0 + 0.5 * e for r, e in zip(responses, ended)]
'''


@pytest.mark.parametrize("estimator", ["gae", "rloo", "grpo", "reinforce"])
def test_every_estimator_scores_its_experience_with_the_python_reward(nano, tmp_path, estimator):  # noqa: F811
    """One experience batch per estimator (K = 2 answers to 2 prompts): the experience's scores are the
    function's rewards of the decoded answers, row for row, and the logged reward their mean."""
    from ppo_harness import make_trainer, prompts, rlhf_args

    fn_file = write(tmp_path / "rec.py", RECORDING_REWARD)
    args = rlhf_args(nano, tmp_path, advantage_estimator=estimator, num_samples_per_prompt=2,
                     per_device_generation_batch_size=2, per_device_training_batch_size=4,
                     reward_source="python", reward_function=f"{fn_file}:chars")
    source = build_reward_source("python", function=args.reward_function)
    t = make_trainer(args, reward=source)
    ids, mask = prompts(args, t.tokenizer, 2)
    exp, stats = t.make_experience(ids, mask, step=0, meta=[{"i": 0}, {"i": 1}])
    (call,) = source.fn.__globals__["CALLS"]
    assert call["meta"] == [{"i": 0}, {"i": 0}, {"i": 1}, {"i": 1}]
    assert call["ended"] == exp_ended(exp, t)
    want = [0.1 * len(r) - 1.0 + 0.5 * e for r, e in zip(call["responses"], call["ended"])]
    assert exp.scores.tolist() == pytest.approx(want, abs=1e-6)
    assert stats["reward"] == pytest.approx(mean(want), abs=1e-6)
    assert (t.rlhf.critic is None) == (estimator != "gae")
    assert all(math.isfinite(v) for v in t.ppo_update([exp]).values())


def exp_ended(exp, trainer) -> list[bool]:
    """Which answers stopped at the end token, read off the experience: its last real token is a stop token."""
    stops = set(trainer.gen_cfg.stop_ids)
    P, out = exp.prompt_width, []
    for row, m in zip(exp.seq, exp.attention_mask):
        answer = row[P:][m[P:].bool()].tolist()
        out.append(bool(answer) and answer[-1] in stops)
    return out


def test_step3_stops_with_the_functions_error(nano, tmp_path, capsys):  # noqa: F811
    """A reward function returning nan stops step 3 (at the first scoring call, the initial evaluation) with
    one line naming the function, exit status 1."""
    fn_file = write(tmp_path / "nan.py", "def f(prompts, responses, meta):\n    return [float('nan')] * "
                                          "len(responses)\n")
    code = run_cli(load_main(STEP3), argv_without_rm(nano, tmp_path / "run", "--reward_source", "python",
                                                     "--reward_function", f"{fn_file}:f",
                                                     "--per_device_generation_batch_size", "4"))
    assert code == 1
    assert f"error: --reward_function {fn_file}:f: reward 0 is nan (response 0: " in capsys.readouterr().err


def test_step3_refuses_a_bad_function_before_training(nano, tmp_path):  # noqa: F811
    fn_file = write(tmp_path / "r.py", "score = 3\n")
    with pytest.raises(ConfigError, match=r"r\.py:score: score is a int, not a function"):
        load_main(STEP3)(argv_without_rm(nano, tmp_path / "run", "--reward_source", "python",
                                         "--reward_function", f"{fn_file}:score"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_two_ranks_each_send_their_own_rows_to_the_server(nano, tmp_path):  # noqa: F811
    """Two deepspeed ranks (GAE, critic from the actor) against one server: every scoring call of every rank
    is one request with that rank's rows only — the held-out prompts split 2 + 2, then 3 prompts per rank per
    step, the two ranks' prompts disjoint — 2 ranks x (1 + 2 steps + 1) requests, 2 x (2 + 3 + 3 + 2) rows."""
    out = tmp_path / "run"
    with RewardServer(ok) as server:
        run_launcher([*deepspeed_cmd(2, 29697), str(STEP3),
                      *argv_without_rm(nano, out, "--reward_source", "remote", "--reward_url", server.url,
                                       "--per_device_generation_batch_size", "3", "--per_device_training_batch_size",
                                       "3", "--per_device_eval_generation_batch_size", "2")], timeout=600)
        bodies = [r["body"] for r in server.requests]
    # the ranks meet in a collective after each scoring phase (the evaluation's sum, the update's gradients),
    # so requests arrive in pairs: initial evaluation, step 1, step 2, final evaluation
    assert [len(b["responses"]) for b in bodies] == [2, 2, 3, 3, 3, 3, 2, 2]
    assert sum(len(b["responses"]) for b in bodies) == 2 * (2 + 3 + 3 + 2)
    for pair in (bodies[0:2], bodies[2:4], bodies[4:6], bodies[6:8]):
        assert not set(pair[0]["prompts"]) & set(pair[1]["prompts"])  # each rank scores its own rows
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row, pair in zip(rows, (bodies[2:4], bodies[4:6])):  # rank 0 logs its own batch's mean
        assert any(row["train/reward"] == pytest.approx(mean(length_rewards(b)), abs=1e-5) for b in pair)
    summary = json.loads((out / "summary.json").read_text())  # the evaluation sums over both ranks
    assert summary["initial_policy"]["reward_score"] == pytest.approx(
        mean(length_rewards(bodies[0]) + length_rewards(bodies[1])), abs=1e-5)
    assert summary["final_policy"]["num_prompts"] == 4


def test_a_reward_error_is_reported_by_the_rank_that_met_it(monkeypatch, capsys):
    """run_cli prints user errors from rank 0 only (every rank has the same bad flag); a reward error can be
    one rank's alone (its rows, its request), so that rank prints it, tagged."""
    def fails(error):
        def main(argv):
            raise error
        return main

    monkeypatch.setenv("RANK", "1")
    assert run_cli(fails(RewardError("--reward_url http://127.0.0.1:9/score: reward 0 is nan")), []) == 1
    assert capsys.readouterr().err == "error: [rank 1] --reward_url http://127.0.0.1:9/score: reward 0 is nan\n"
    assert run_cli(fails(ConfigError("--reward_retries must be >= 0, got -1")), []) == 1
    assert capsys.readouterr().err == ""  # rank 0 says it
    monkeypatch.setenv("RANK", "0")
    assert run_cli(fails(RewardError("reward 0 is nan")), []) == 1
    assert capsys.readouterr().err == "error: reward 0 is nan\n"
