"""marlhf generate: N samples per prompt into JSON lines; a run SIGKILLed midway (plus a torn last line)
and started again ends with the same bytes as an uninterrupted run; a step-3 output folder samples from its
actor; resuming with other settings is refused."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, cli_cmd, load_main

from marlhf.errors import run_cli

GENERATE = "generate"


@pytest.fixture(scope="module")
def nano():
    from marlhf import embedded

    return str(embedded.prepare(size="nano").model_dir)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    texts = [f"SUBREDDIT: r/pets\nPOST: my cat number {i} hides under the bed all day.\nTL;DR:" for i in range(7)]
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path


def argv(model, prompts, out, *extra):
    return ["--model", model, "--prompts", str(prompts), "--output", str(out), "--num_samples", "3",
            "--batch_size", "2", "--max_new_tokens", "6", "--seed", "5", "--no_progress", *extra]


def test_rows_and_fields(nano, prompts_file, tmp_path):
    out = tmp_path / "g.jsonl"
    assert run_cli(load_main(GENERATE), argv(nano, prompts_file, out)) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_id"], r["sample"]) for r in rows] == [(f"p{i}", k) for i in range(7) for k in range(3)]
    assert all(1 <= r["length"] <= 6 and isinstance(r["ended"], bool) and r["policy"] == "nano-seed1234"
               for r in rows)
    assert {r["seed"] for r in rows} == {5 * 1_000_003 + b for b in range(4)}  # one seed per batch of 2 prompts
    assert len({r["response"] for r in rows}) > 7  # sampled, not one answer repeated


def test_killed_run_resumes_to_identical_file(nano, prompts_file, tmp_path):
    full = tmp_path / "full.jsonl"
    assert run_cli(load_main(GENERATE), argv(nano, prompts_file, full)) == 0
    part = tmp_path / "part.jsonl"
    marker = tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/pause_harness.py"), "generate:1", str(marker),
                             *cli_cmd(GENERATE)[1:], *argv(nano, prompts_file, part)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended before its pause point"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    stopped = part.read_bytes()
    assert stopped == b"".join(full.read_bytes().splitlines(keepends=True)[:12])  # batches 0 and 1: 2 x 2 x 3 rows
    with open(part, "ab") as f:  # what a kill inside the next write leaves: half a line
        f.write(full.read_bytes().splitlines(keepends=True)[12][:40])
    assert run_cli(load_main(GENERATE), argv(nano, prompts_file, part)) == 0
    assert part.read_bytes() == full.read_bytes()
    assert run_cli(load_main(GENERATE), argv(nano, prompts_file, part)) == 0  # finished: nothing more to do
    assert part.read_bytes() == full.read_bytes()


def test_step3_output_uses_its_actor_and_settings_must_match(nano, tmp_path, capsys):
    run = tmp_path / "step3"
    shutil.copytree(nano, run / "actor")
    (run / "critic").mkdir()
    (run / "args.json").write_text(json.dumps({"actor_model_name_or_path": "out/sft", "data_path": ["synthetic"]}))
    common = ["--data_path", "synthetic:num_records=200", "--max_prompts", "3", "--num_samples", "2",
              "--max_new_tokens", "5", "--no_progress", "--policy_name", "p"]
    main = load_main(GENERATE)
    assert run_cli(main, ["--model", str(run), "--output", str(tmp_path / "a.jsonl"), *common]) == 0
    assert run_cli(main, ["--model", str(run / "actor"), "--output", str(tmp_path / "b.jsonl"), *common]) == 0
    a = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(a) == 6 and a[0]["prompt_id"] == "eval-0" and "TL;DR:" in a[0]["prompt"]
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    capsys.readouterr()
    assert run_cli(main, ["--model", str(run), "--output", str(tmp_path / "a.jsonl"), *common,
                          "--temperature", "0.5"]) == 1
    assert "other settings (generation differ)" in capsys.readouterr().err
    assert run_cli(main, ["--model", str(run), "--output", str(tmp_path / "a.jsonl"), *common,
                          "--temperature", "0.5", "--overwrite"]) == 0
