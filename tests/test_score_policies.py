"""marlhf score-policies: per-policy reward statistics equal a hand computation over directly computed
scores, shifts are relative to the baseline, the gold scorer joins on the embedded task, the PNG is a real
image, and bad rows / unknown baselines are one-line user errors."""

import json
import math

import pytest
import torch
from conftest import load_main, save_seeded_reward_model

from marlhf.data.records import DataError
from marlhf.embedded.task import SyntheticConfig, generate, gold_score
from marlhf.errors import ConfigError, run_cli
from marlhf.eval.score_report import read_generations, summarize
from marlhf.models.forward import sequence_scores
from marlhf.models.loading import load_tokenizer, load_value_model

SCORE_POLICIES = "score_policies"
EOT = "<|endoftext|>"


def test_summarize_matches_hand_computation():
    s = summarize([4.0, 1.0, 10.0, 3.0, 2.0])
    # mean 20/5 = 4; population variance (0+9+36+1+4)/5 = 10
    assert s["n"] == 5 and s["mean"] == 4.0 and s["std"] == pytest.approx(math.sqrt(10.0))
    # sorted 1 2 3 4 10; quantile q sits at rank q*(n-1): q05 -> 0.2 -> 1.2; q25 -> 1 -> 2; q50 -> 3;
    # q75 -> 3 -> 4; q95 -> 3.8 -> 4 + 0.8*(10-4) = 8.8
    assert [s[k] for k in ("q05", "q25", "q50", "q75", "q95")] == pytest.approx([1.2, 2.0, 3.0, 4.0, 8.8])


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A freshly created value model on the nano embedded model, with a seeded score head of scale 1, saved
    as a step-2 output is (with its run's args.json naming the synthetic data, so gold scoring applies)."""
    out = save_seeded_reward_model(tmp_path_factory.mktemp("rm"))
    (out / "args.json").write_text(json.dumps({"data_path": ["synthetic:num_records=10"]}))
    return out


@pytest.fixture(scope="module")
def generations(tmp_path_factory):
    """Two files: 'sft' answers with the rejected summaries, one file holds 'ppo' (chosen) and 'oracle'."""
    recs = generate(SyntheticConfig(num_records=6))
    folder = tmp_path_factory.mktemp("gen")
    rows = {"sft": [(r.prompt, r.rejected) for r in recs], "ppo": [(r.prompt, r.chosen) for r in recs[:5]],
            "oracle": [(r.prompt, r.chosen) for r in recs[:3]]}
    (folder / "sft.jsonl").write_text("".join(json.dumps({"prompt": p, "response": a, "policy": "sft"}) + "\n"
                                              for p, a in rows["sft"]))
    (folder / "mixed.jsonl").write_text("".join(json.dumps({"prompt": p, "response": a, "policy": name}) + "\n"
                                                for name in ("ppo", "oracle") for p, a in rows[name]))
    return folder, rows


def direct_score(model_dir, prompt: str, response: str) -> float:
    tok = load_tokenizer(str(model_dir), EOT)
    model = load_value_model(str(model_dir), tok).eval()
    enc = tok(prompt + response + EOT, return_tensors="pt")
    with torch.no_grad():
        return sequence_scores(model, enc["input_ids"], enc["attention_mask"]).item()


def hand_stats(values):
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / n), sorted(values)[(n - 1) // 2] if n % 2 else None


def test_report_statistics_shifts_gold_and_png(reward_model, generations, tmp_path, capsys):
    folder, rows = generations
    out_json, out_png = tmp_path / "report.json", tmp_path / "scores.png"
    rc = load_main(SCORE_POLICIES)(["--reward_model", str(reward_model), "--generations", str(folder / "sft.jsonl"),
                             str(folder / "mixed.jsonl"), "--baseline", "sft", "--output_json", str(out_json),
                             "--output_png", str(out_png), "--batch_size", "4"])
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert set(report["scorers"]) == {"reward_model", "gold"}  # the RM's recorded data is synthetic
    for scorer, fn in (("reward_model", lambda p, a: direct_score(reward_model, p, a)), ("gold", gold_score)):
        stats = report["scorers"][scorer]
        assert set(stats) == {"sft", "ppo", "oracle"}
        means = {}
        for policy, pairs in rows.items():
            values = [fn(p, a) for p, a in pairs]
            mean, std, median = hand_stats(values)
            means[policy] = mean
            s = stats[policy]
            assert s["n"] == len(values)
            assert s["mean"] == pytest.approx(mean, abs=1e-5) and s["std"] == pytest.approx(std, abs=1e-5)
            if median is not None:
                assert s["q50"] == pytest.approx(median, abs=1e-5)
            assert min(values) - 1e-5 <= s["q05"] <= s["q25"] <= s["q50"] <= s["q75"] <= s["q95"] <= max(values) + 1e-5
        for policy in rows:
            assert stats[policy]["shift"] == pytest.approx(means[policy] - means["sft"], abs=1e-5)
        assert stats["sft"]["shift"] == 0.0
    # gold prefers chosen over rejected on most pairs of the embedded task: ppo (chosen) shifts up
    assert report["scorers"]["gold"]["ppo"]["shift"] > 0
    printed = capsys.readouterr().out
    assert "[reward_model]" in printed and "[gold]" in printed and "oracle" in printed
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from PIL import Image

    with Image.open(out_png) as img:
        assert img.size[0] > 500 and img.size[1] > 300


def test_bad_rows_and_baseline_are_user_errors(reward_model, generations, tmp_path, capsys):
    folder, _ = generations
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "response": "r", "policy": "a"}) + "\n"
                   + json.dumps({"prompt": "p", "response": 3, "policy": "a"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: row 2: field 'response'"):
        read_generations([bad])
    bad.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: row 1: field 'policy': missing"):
        read_generations([bad])
    with pytest.raises(ConfigError, match="does not exist"):
        read_generations([tmp_path / "nope.jsonl"])
    main = load_main(SCORE_POLICIES)
    argv = ["--reward_model", str(reward_model), "--generations", str(folder / "sft.jsonl"), "--gold", "off"]
    assert run_cli(main, [*argv, "--baseline", "ppo"]) == 1
    assert "--baseline 'ppo' is not one of the policies: sft" in capsys.readouterr().err
    assert run_cli(main, ["--reward_model", str(reward_model), "--generations", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 1: field 'policy'" in err[0]
