"""User mistakes through the entry points' command lines: one clear line, non-zero exit, no traceback
(marlhf/errors.py); a traceback only with --debug.  Plus the data rules behind two of them: a UTF-8 BOM at
the start of a json/jsonl file is accepted, and a pair whose chosen and rejected are identical is a bad row
for step 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, STEP1, STEP2, STEP3, deepspeed_cmd

from marlhf.data.adapters import load_records
from marlhf.data.records import BadRowPolicy
from marlhf.embedded import default_model

RW_EVAL = REPO / "training/step2_reward_model_finetuning/rw_eval.py"


def run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    drop = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"}  # left by in-process runs
    env = {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def error_lines(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]


def write_jsonl(path, rows, bom=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


PAIRS = [{"prompt": f"Q: {i}?\nA:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(40)]


# -------------------------------------------------------------------------------------------- data rules
def test_byte_order_mark_is_accepted_in_jsonl_and_json(tmp_path):
    lines = write_jsonl(tmp_path / "bom.jsonl", PAIRS[:2], bom=True)
    array = tmp_path / "bom.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(PAIRS[:2]).encode())
    for path in (lines, array):
        records = load_records(str(path))
        assert [(r.prompt, r.chosen, r.rejected) for r in records] == [("Q: 0?\nA:", " yes 0", " no 0"),
                                                                     ("Q: 1?\nA:", " yes 1", " no 1")]


def test_identical_pair_is_a_bad_row_for_the_reward_model(tmp_path, embedded):
    from marlhf.data.pipeline import tokenize_phase
    from marlhf.data.records import Record
    from marlhf.models.loading import load_tokenizer

    tok = load_tokenizer(default_model(""))
    recs = [Record("p one", " same", " same", source="f.jsonl:1"), Record("p two", " good", " bad", "f.jsonl:2")]
    policy = BadRowPolicy("skip")
    kw = {"eot": "<|endoftext|>", "max_seq_len": 64, "max_prompt_len": 64}
    out = tokenize_phase(recs, 2, tok, policy=policy, **kw)
    assert len(out) == 1 and policy.skipped == {("f.jsonl", "rejected", "identical to 'chosen' (no preference to "
                                                                         "learn)"): 1}
    # step 1 still uses the row: its chosen response is a fine demonstration
    assert len(tokenize_phase(recs, 1, tok, policy=BadRowPolicy("error"), **kw)) == 2


# --------------------------------------------------------------------------------------------- the CLIs
def test_user_errors_exit_with_one_line_and_no_traceback(tmp_path, embedded):
    bad = PAIRS[:5] + [{**PAIRS[5], "rejected": PAIRS[5]["chosen"]}] + PAIRS[6:]
    data = write_jsonl(tmp_path / "pairs.jsonl", bad, bom=True)  # the BOM must not break row 1
    out = ["--output_dir", str(tmp_path / "out"), "--data_output_path", str(tmp_path / "cache"),
           "--disable_progress_bar"]
    cases = {
        "identical pair (step 2)": ([str(STEP2), "--data_path", str(data), "--data_split", "0,1,0", *out],
                                    f"{data}: row 6: field 'rejected': identical to 'chosen'"),
        "missing model folder (step 1)": ([str(STEP1), "--model_name_or_path", str(tmp_path / "no_model"), *out],
                                          f"model folder '{tmp_path / 'no_model'}' (--model_name_or_path) does not "
                                          f"exist"),
        "bad flag combination (step 3)": ([str(STEP3), "--per_device_generation_batch_size", "2",
                                           "--per_device_training_batch_size", "4", *out],
                                          "--per_device_training_batch_size cannot exceed"),
        "missing model (rw_eval)": ([str(RW_EVAL), "--model_name_or_path", "./no/such/rm", "--prompt", "p",
                                     "--response", "r"], "model folder './no/such/rm' does not exist"),
    }
    for name, (argv, message) in cases.items():
        proc = run([sys.executable, *argv])
        assert proc.returncode == 1, (name, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "Traceback" not in proc.stdout + proc.stderr, name
        assert len(error_lines(proc)) == 1 and message in error_lines(proc)[0], (name, proc.stderr[-2000:])
    # --debug keeps the traceback (and still fails)
    proc = run([sys.executable, *cases["missing model folder (step 1)"][0], "--debug"])
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


@pytest.mark.slow
def test_user_error_under_two_ranks_is_printed_once(tmp_path, embedded):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS[:3] + [{"prompt": "p", "chosen": 3}] + PAIRS[4:])
    proc = run([*deepspeed_cmd(2, 29662), str(STEP1), "--data_path", str(data), "--output_dir",
                str(tmp_path / "out"), "--data_output_path", str(tmp_path / "cache")])
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    (line,) = error_lines(proc)  # rank 0 only
    assert f"{data}: row 4: field 'chosen': expected text, got int" in line


def test_port_in_use_is_named_not_blamed_on_another_rank(capsys, monkeypatch):
    """The TCP store's bind failure is a DistNetworkError like a lost peer's; with the port taken nobody else
    stopped, so the message names the port and how to choose another."""
    import torch.distributed as tdist

    from marlhf.errors import EXIT_USER_ERROR, run_cli

    def main(argv):
        raise tdist.DistNetworkError("The server socket has failed to listen on any local network address. "
                                     "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: "
                                     "address already in use")

    monkeypatch.setenv("MASTER_PORT", "29500")
    assert run_cli(main, []) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "port 29500 is already in use" in err and "MASTER_PORT" in err and "another rank" not in err
