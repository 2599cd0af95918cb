"""The judge client against a real chat-completions server on 127.0.0.1 (started here, in a thread):
verdict parsing of every answer form, order randomisation recorded and undone, retries on 429 / 500 /
timeouts / malformed bodies, the on-disk cache (a rerun sends no request), the key never logged or
written, win/tie/loss with Wilson intervals, and a scorer as a local judge."""

import contextlib
import json
import logging
import math
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import cli_cmd

from marlhf.eval import judge as jm
from marlhf.eval.judge import (
    FIRST,
    SECOND,
    TIE,
    ChatCompletionsJudge,
    JudgeError,
    ScorerJudge,
    compare_policies,
    parse_verdict,
    presentation_order,
    summarize,
    wilson_interval,
)
from marlhf.tasks import VerdictFormat, render_template

KEY = "sk-test-SECRET-0123456789"
TEMPLATE = "Q: {prompt}\nRESPONSE A: {response_a}\nRESPONSE B: {response_b}\nVerdict:"


class FakeModel:
    """The judge model: prefers the response containing GOOD and answers in the form the prompt names.

    Prompt markers script the server's behaviour: ``fmt=json|letter|free|garbage|tie`` the answer form;
    ``flaky429`` / ``flaky500`` / ``slow`` / ``badbody`` fail the first request of that prompt that way;
    ``down`` always answers 500.
    """

    def __init__(self):
        self.requests: list[dict] = []  # every request received: body + whether the key was sent
        self.seen: dict[str, int] = {}
        self.lock = threading.Lock()

    def answer(self, content: str) -> str:
        first_good = content.find("GOOD") < content.lower().rfind("response b:")
        letter = "A" if first_good else "B"
        if "fmt=json" in content:
            return json.dumps({"comparison": "one is better", "choice": letter})
        if "fmt=free" in content:
            return f"Response {letter} is better: it answers the question.\n"
        if "fmt=garbage" in content:
            return "I like turtles."
        if "fmt=tie" in content:
            return "Both are equally good.\nE"
        return letter


def start_server(model: FakeModel):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output quiet
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            content = body["messages"][0]["content"]
            with model.lock:
                model.requests.append({"body": body, "auth": self.headers.get("Authorization")})
                n = model.seen[content] = model.seen.get(content, 0) + 1
            if self.path != "/v1/chat/completions":
                return self.reply(404, b"{}")
            if "down" in content or ("flaky500" in content and n == 1):
                return self.reply(500, b'{"error": "overloaded"}')
            if "flaky429" in content and n == 1:
                return self.reply(429, b'{"error": "rate limited"}', {"Retry-After": "0"})
            if "slow" in content and n == 1:
                time.sleep(1.5)  # longer than the client's timeout
            if "badbody" in content and n == 1:
                return self.reply(200, b"<html>not json</html>")
            answer = model.answer(content)
            self.reply(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode())

        def reply(self, code, data, headers=None):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def endpoint():
    model = FakeModel()
    server = start_server(model)
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", model
    server.shutdown()
    server.server_close()


def make_judge(url, cache_dir, **kw):
    options = dict(api_key=KEY, cache_dir=cache_dir, concurrency=3, max_retries=3, backoff_s=0.01, timeout_s=0.5)
    options.update(kw)
    return ChatCompletionsJudge(url, "judge-model", TEMPLATE, **options)


# ------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text,expected", [
    ("A", FIRST), (" b\n", SECOND), ("E", TIE), ("**B**.", SECOND), ("'A'", FIRST), ("Summary B", SECOND),
    ('{"comparison": "B is more helpful", "choice": "B"}', SECOND),
    ('Sure.\n```json\n{"Comparison": "...", "Choice": "A"}\n```', FIRST),
    ('{"factual accuracy": "A", "coherence": "B", "usefulness overall": "E", "reason": "..."}', None),
    ("Choice: A", FIRST), ("My verdict is Response B.", SECOND), ("Winner: tie", TIE),
    ("Response A is better than B because it is concrete.", FIRST),
    ("The first is a bit long and rambling.\nB", SECOND),  # "a bit" is not a verdict; the last line is
    ("Both responses are equally good.", TIE),
    ("I like turtles.", None), ("", None), ("A is short. B is long.", None),
])
def test_parse_verdict_forms(text, expected):
    assert parse_verdict(text) == expected


def test_parse_verdict_uses_the_tasks_json_key():
    webgpt = VerdictFormat(json_key="usefulness overall")
    answer = '{"factual accuracy": "A", "coherence": "B", "usefulness overall": "E", "reason": "..."}'
    assert parse_verdict(answer, webgpt) == TIE
    assert parse_verdict('{"usefulness overall": "Answer B"}', webgpt) == SECOND


def test_render_template_substitutes_once():
    out = render_template("P={prompt} A={response_a} B={response_b}", "x {response_b}", "{a}", "b")
    assert out == "P=x {response_b} A={a} B=b"
    with pytest.raises(ValueError, match="response_b"):
        render_template("{prompt} {response_a}", "p", "a", "b")


# ------------------------------------------------------------------------------------ order, rates, CI
def test_order_randomised_recorded_and_undone():
    class FirstAlwaysWins:
        def judge_pairs(self, pairs):
            return [jm.Judgement(FIRST, "A") for _ in pairs]

    n = 40
    outcomes = compare_policies(FirstAlwaysWins(), ["p"] * n, ["a"] * n, ["b"] * n, seed=3)
    swaps = [o.swapped for o in outcomes]
    assert swaps == [presentation_order(3, i) for i in range(n)]
    assert 0 < sum(swaps) < n  # both orders occur
    # a position-biased judge makes whichever policy was shown first win: undone per pair
    assert [o.outcome for o in outcomes] == ["B" if s else "A" for s in swaps]
    assert swaps != [o.swapped for o in compare_policies(FirstAlwaysWins(), ["p"] * n, ["a"] * n, ["b"] * n, seed=4)]


def test_wilson_interval_against_formula():
    lo, hi = wilson_interval(7, 10)
    z = 1.959963984540054
    p, n = 0.7, 10
    centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    half = z / (1 + z**2 / n) * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    assert (lo, hi) == (pytest.approx(centre - half), pytest.approx(centre + half))
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_summarize_counts_everything():
    mk = lambda outcome: jm.PairOutcome(0, False, outcome, "", "", False)
    outcomes = [mk("A")] * 5 + [mk("B")] * 2 + [mk("tie")] * 3 + [mk("unparseable")] * 4 + [mk("error")]
    s = summarize(outcomes)
    counts = (s["pairs"], s["judged"], s["win"], s["loss"], s["tie"], s["unparseable"], s["errors"])
    assert counts == (15, 10, 5, 2, 3, 4, 1)
    assert (s["win_rate"], s["loss_rate"], s["tie_rate"]) == (0.5, 0.2, 0.3)
    assert s["win_ci95"] == list(wilson_interval(5, 10))


def test_scorer_as_local_judge():
    length = ScorerJudge(lambda prompts, responses: [float(len(r)) for r in responses], tie_margin=0.5)
    outcomes = compare_policies(length, ["p"] * 4, ["long answer", "x", "same", "longer one"],
                                ["short", "much longer", "size", "longer"], seed=0)
    assert [o.outcome for o in outcomes] == ["A", "B", "tie", "A"]
    bad = ScorerJudge(lambda prompts, responses: [0.0])
    with pytest.raises(ValueError, match="1/1 scores for 2 pairs"):
        bad.judge_pairs([("p", "a", "b"), ("p", "a", "b")])


# ------------------------------------------------------------------------------------ over real HTTP
def test_http_judge_formats_retries_cache_and_key(endpoint, tmp_path, caplog):
    url, model = endpoint
    caplog.set_level(logging.DEBUG)
    markers = ["fmt=json", "fmt=letter", "fmt=free", "fmt=garbage", "fmt=tie",
               "fmt=json flaky429", "fmt=letter flaky500", "fmt=free slow", "fmt=json badbody", "fmt=json down"]
    prompts = [f"q{i} {m}" for i, m in enumerate(markers)]
    good_a = ["GOOD answer"] * len(prompts)  # policy A is always better
    bad_b = ["weak answer"] * len(prompts)
    judge = make_judge(url, tmp_path / "cache")
    outcomes = compare_policies(judge, prompts, good_a, bad_b, seed=1)
    got = {m: o.outcome for m, o in zip(markers, outcomes)}
    assert got == {"fmt=json": "A", "fmt=letter": "A", "fmt=free": "A", "fmt=garbage": "unparseable",
                   "fmt=tie": "tie", "fmt=json flaky429": "A", "fmt=letter flaky500": "A", "fmt=free slow": "A",
                   "fmt=json badbody": "A", "fmt=json down": "error"}
    assert "HTTP 500" in outcomes[-1].error and outcomes[-1].raw == ""
    assert any(o.swapped for o in outcomes) and not all(o.swapped for o in outcomes)
    # 9 answered prompts: 1 request each + 1 retry for each of 4 flaky ones; "down": 1 + 3 retries
    assert len(model.requests) == judge.requests_sent == 9 + 4 + 4
    assert all(r["auth"] == "Bearer " + KEY for r in model.requests)  # the key is sent ...
    summary = summarize(outcomes)
    assert (summary["win"], summary["tie"], summary["unparseable"], summary["errors"]) == (7, 1, 1, 1)

    # ... a rerun is answered from the cache: the server sees only the retry of the failed pair
    before = len(model.requests)
    rerun = make_judge(url, tmp_path / "cache")
    again = compare_policies(rerun, prompts, good_a, bad_b, seed=1)
    assert [o.outcome for o in again] == [o.outcome for o in outcomes]
    assert sum(o.cached for o in again) == 9
    new = model.requests[before:]
    assert len(new) == 4 and all("down" in r["body"]["messages"][0]["content"] for r in new)

    # ... and is never written or logged
    for path in (tmp_path / "cache").rglob("*"):
        if path.is_file():
            assert KEY not in path.read_text()
    assert KEY not in caplog.text and KEY not in repr(judge)
    assert "HTTP 429" in caplog.text and "HTTP 500" in caplog.text  # retries are logged


def test_http_judge_concurrency_limit(endpoint, tmp_path):
    url, model = endpoint
    in_flight, peak = [0], [0]
    lock = threading.Lock()
    original = ChatCompletionsJudge._post

    def counting_post(self, body):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            time.sleep(0.05)
            return original(self, body)
        finally:
            with lock:
                in_flight[0] -= 1

    judge = make_judge(url, None, concurrency=2)
    judge._post = counting_post.__get__(judge)
    outcomes = compare_policies(judge, [f"p{i} fmt=letter" for i in range(8)], ["GOOD"] * 8, ["bad"] * 8)
    assert [o.outcome for o in outcomes] == ["A"] * 8
    assert peak[0] == 2


def test_http_judge_permanent_errors_raise(endpoint, tmp_path):
    url, _ = endpoint
    wrong_path = make_judge(url.replace("/v1", "/v2"), None)
    with pytest.raises(JudgeError, match="HTTP 404"):
        wrong_path.judge_pairs([("p", "a", "b")])
    with pytest.raises(ValueError, match="placeholders"):
        ChatCompletionsJudge(url, "m", "no placeholders here")


def test_judge_cli_end_to_end(endpoint, tmp_path):
    url, model = endpoint
    repo = Path(__file__).parents[1]
    prompts = [f"\n\nHuman: question {i}?\n\nAssistant:" for i in range(6)]
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    # the dialogue task cuts responses at the next "Human:" turn before judging
    a.write_text("".join(json.dumps({"prompt": p, "response": " GOOD reply\n\nHuman: more"}) + "\n" for p in prompts))
    b.write_text("".join(json.dumps({"prompt": p, "response": " weak reply"}) + "\n" for p in prompts))
    env = {**os.environ, "PYTHONPATH": str(repo), "JUDGE_KEY": KEY}
    cmd = [*cli_cmd("judge"), "--task", "dialogue", "--a", str(a), "--b", str(b),
           "--base_url", url, "--model", "m", "--api_key_env", "JUDGE_KEY", "--cache_dir", str(tmp_path / "c"),
           "--output", str(tmp_path / "out.jsonl"), "--seed", "5"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    # the dialogue judge prompt asks for JSON; the fake model answers a bare letter, which parses too
    assert (summary["win"], summary["judged"], summary["requests_sent"]) == (6, 6, 6)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["swapped"] for r in rows] == [presentation_order(5, i) for i in range(6)]
    sent = model.requests[0]["body"]["messages"][0]["content"]
    assert "Which reply is more helpful" in sent and "Human: more" not in sent
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert json.loads(again.stdout)["requests_sent"] == 0 and len(model.requests) == 6
    for text in (out.stdout, out.stderr, again.stderr, (tmp_path / "out.jsonl").read_text()):
        assert KEY not in text
    mismatched = tmp_path / "m.jsonl"
    mismatched.write_text(json.dumps({"prompt": "other", "response": "x"}) + "\n")
    at = cmd.index("--a")
    bad = subprocess.run(cmd[:at] + ["--a", str(mismatched)] + cmd[at + 2:], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "rows" in bad.stderr
