"""marlhf best-of-n on the nano embedded model with a seeded reward model: the table equals a loop
reference computed from the very samples it wrote; the picked reward-model score never falls as N grows over
nested prefixes; CSV / JSON / PNG are written."""

import csv
import json

import torch
from conftest import load_main, save_seeded_reward_model

from marlhf.errors import run_cli
from marlhf.eval.best_of_n import best_of_n

BEST_OF_N = "best_of_n"


def reference(samples: list[dict], temperature: float, n: int) -> dict:
    """Slow, obvious best-of-n: per prompt, walk the first n samples and keep the first highest RM score."""
    by_prompt: dict[str, list[dict]] = {}
    for s in samples:
        if s["temperature"] == temperature:
            by_prompt.setdefault(s["prompt_id"], []).append(s)
    rm_best = gold_best = rm_mean = 0.0
    for rows in by_prompt.values():
        rows = sorted(rows, key=lambda s: s["sample"])[:n]
        best = rows[0]
        for s in rows[1:]:
            if s["rm"] > best["rm"]:
                best = s
        rm_best += best["rm"]
        gold_best += best["gold"]
        rm_mean += sum(s["rm"] for s in rows) / n
    k = len(by_prompt)
    return {"rm_best": rm_best / k, "gold_best": gold_best / k, "rm_mean": rm_mean / k}


def test_table_equals_reference_and_rises_with_n(embedded, tmp_path, capsys):
    from marlhf import embedded as emb

    nano = str(emb.prepare(size="nano").model_dir)
    rm = save_seeded_reward_model(tmp_path / "rm")
    out = {k: tmp_path / f"bon.{k}" for k in ("csv", "json", "png")}
    capsys.readouterr()
    assert run_cli(load_main(BEST_OF_N), [
        "--model", nano, "--reward_model", str(rm), "--data_path", "synthetic:num_records=200", "--max_prompts", "5",
        "--n", "1", "2", "4", "8", "--temperatures", "0.7", "1.3", "--max_new_tokens", "6", "--batch_size", "2",
        "--output_csv", str(out["csv"]), "--output_json", str(out["json"]), "--output_png", str(out["png"]),
        "--samples_out", str(tmp_path / "samples.jsonl")]) == 0
    assert "| temperature | n | rm_best |" in capsys.readouterr().out
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 5 * 8  # max N sampled once per temperature and prompt
    rows = json.loads(out["json"].read_text())["rows"]
    assert [(r["temperature"], r["n"]) for r in rows] == [(t, n) for t in (0.7, 1.3) for n in (1, 2, 4, 8)]
    for r in rows:
        want = reference(samples, r["temperature"], r["n"])
        for key, value in want.items():
            assert abs(r[key] - value) < 1e-9, (r, want)
    for t in (0.7, 1.3):
        curve = [r["rm_best"] for r in rows if r["temperature"] == t]
        assert all(b >= a for a, b in zip(curve, curve[1:])) and curve[-1] > curve[0]
    assert len(list(csv.DictReader(out["csv"].open()))) == 8
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ties_pick_the_first_sample():
    rm = torch.tensor([[1.0, 3.0, 3.0, 0.0]], dtype=torch.float64)
    gold = torch.tensor([[0.5, 0.1, 0.9, 0.2]], dtype=torch.float64)
    rows = best_of_n(rm, [1, 2, 4], gold)
    assert [r["gold_best"] for r in rows] == [0.5, 0.1, 0.1]
    assert [r["rm_best"] for r in rows] == [1.0, 3.0, 3.0]
