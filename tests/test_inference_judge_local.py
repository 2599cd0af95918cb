"""marlhf judge with a local judge (reward model or gold scorer) through the same comparison as the API
judge, and the JSONL readers of judge.py and pass_at_k.py naming file, row and field of a bad row."""

import json

import pytest
from conftest import load_main, save_seeded_reward_model

from marlhf.errors import run_cli

JUDGE = "judge"
PASS_AT_K = "pass_at_k"


@pytest.fixture(scope="module")
def records():
    from marlhf.data.adapters import load_records
    from marlhf.data.records import BadRowPolicy

    return load_records("synthetic:num_records=60", split="train", bad_rows=BadRowPolicy())[:12]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gold_judge_prefers_reference_summaries(records, tmp_path, capsys):
    a = write_rows(tmp_path / "a.jsonl", [{"prompt": r.prompt, "response": r.chosen} for r in records])
    b = write_rows(tmp_path / "b.jsonl", [{"prompt": r.prompt, "response": "I do not know."} for r in records])
    out = tmp_path / "judged.jsonl"
    capsys.readouterr()
    assert run_cli(load_main(JUDGE), ["--task", "summarization", "--a", str(a), "--b", str(b), "--judge", "gold",
                                      "--seed", "3", "--output", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["win"], summary["loss"], summary["tie"], summary["judged"]) == (12, 0, 0, 12)
    assert summary["judge"] == "gold" and "requests_sent" not in summary
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert 0 < sum(r["swapped"] for r in rows) < 12  # the order was randomised, and undone: A always wins
    assert all(r["outcome"] == "A" for r in rows)


def test_reward_model_judge_matches_direct_scores(records, tmp_path, capsys):
    from marlhf.rewards.reward_model import Scorer

    rm = save_seeded_reward_model(tmp_path / "rm")
    a = write_rows(tmp_path / "a.jsonl", [{"prompt": r.prompt, "response": r.chosen} for r in records])
    b = write_rows(tmp_path / "b.jsonl", [{"prompt": r.prompt, "response": r.rejected} for r in records])
    capsys.readouterr()
    assert run_cli(load_main(JUDGE), ["--task", "summarization", "--a", str(a), "--b", str(b),
                                      "--judge", "reward_model", "--reward_model", str(rm)]) == 0
    summary = json.loads(capsys.readouterr().out)
    scorer = Scorer(str(rm))
    sa = scorer([r.prompt for r in records], [r.chosen.strip() for r in records])
    sb = scorer([r.prompt for r in records], [r.rejected.strip() for r in records])
    assert summary["win"] == sum(x > y for x, y in zip(sa, sb))
    assert summary["loss"] == sum(x < y for x, y in zip(sa, sb))
    assert 0 < summary["win"] < 12  # a random head: both outcomes occur, so the count can be wrong
    assert run_cli(load_main(JUDGE), ["--task", "summarization", "--a", str(a), "--b", str(b),
                                      "--judge", "reward_model"]) == 1
    assert "needs --reward_model" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["judge", "pass_at_k"])
def test_bad_rows_name_file_row_and_field(tool, tmp_path, capsys):
    good = {"prompt": "p", "response": "r", "problem_id": "0001"}
    bad = write_rows(tmp_path / "bad.jsonl", [good, {**good, "response": 7}])
    torn = tmp_path / "torn.jsonl"
    torn.write_text(json.dumps(good) + "\n{\"prompt\": \"p\n")
    if tool == "judge":
        ok = write_rows(tmp_path / "ok.jsonl", [good, good])
        cases = [(["--a", str(ok), "--b", str(bad)], f"{bad}: row 2: field 'response'"),
                 (["--a", str(ok), "--b", str(torn)], f"{torn}: row 2"),
                 (["--a", str(ok), "--b", str(tmp_path / "none.jsonl")], "does not exist")]
        main, base = load_main(JUDGE), ["--task", "summarization", "--judge", "gold"]
    else:
        missing = write_rows(tmp_path / "missing.jsonl", [{"response": "x"}])
        cases = [(["--samples", str(bad)], f"{bad}: row 2: field 'response'"),
                 (["--samples", str(torn)], f"{torn}: row 2"),
                 (["--samples", str(missing)], f"{missing}: row 1: field 'problem_id'")]
        main, base = load_main(PASS_AT_K), ["--problems", str(tmp_path)]
    for extra, message in cases:
        capsys.readouterr()
        assert run_cli(main, [*base, *extra]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
