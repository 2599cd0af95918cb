"""scripts/bench_trl.py: the cost comparison with TRL's GRPOTrainer — its statistics, prompts and reward, and its
refusal to start without TRL.  (The benchmark itself runs outside the suite: TRL is not a dependency.)"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

import bench_trl
import pytest
from transformers import PreTrainedTokenizerFast


def steps(seconds, tokens=None):
    return [{"seconds": s, **({} if tokens is None else {"tokens": t})} for s, t in zip(seconds, tokens or seconds)]


def test_summary_medians_over_timed_steps_and_ratios_to_trl_at_the_same_beta():
    rounds = {"ours_grpo": [steps([50, 2, 4], [1, 100, 100]), steps([60, 3, 5], [1, 100, 100])],
              "trl_grpo": [steps([70, 4, 6], [1, 200, 200]), steps([80, 8, 8], [1, 200, 200])],
              "ours_grpo_kl": [steps([9, 5, 5], [1, 50, 50])],
              "trl_grpo_kl": [steps([9, 10, 10], [1, 50, 50])]}
    rows = bench_trl.summarise(rounds, warmup=1)
    ours, trl = rows["ours_grpo"], rows["trl_grpo"]
    # the warm-up step (first of each round) is out: medians of [2, 4, 3, 5] and [4, 6, 8, 8]
    assert (ours["median_seconds"], trl["median_seconds"], ours["steps_timed"]) == (3.5, 7.0, 4)
    assert ours["round_medians"] == [3.0, 4.0] and trl["round_medians"] == [5.0, 8.0]
    assert ours["ratio_to_trl"] == pytest.approx(0.5) and ours["ratio_to_trl_against"] == "trl_grpo"
    # per token: ours 14 s over 400 tokens, TRL 26 s over 800
    assert ours["seconds_per_1k_tokens"] == pytest.approx(35.0)
    assert ours["per_token_ratio_to_trl"] == pytest.approx(35.0 / 32.5)
    # β = 0.05 compares with TRL at β = 0.05
    assert rows["ours_grpo_kl"]["ratio_to_trl_against"] == "trl_grpo_kl"
    assert rows["ours_grpo_kl"]["ratio_to_trl"] == pytest.approx(0.5)
    assert "| ours_grpo | 0.0 | 3.50 | 3.00 / 4.00 | 100 | 35.00 | 0.50 | 1.08 |" in bench_trl.render(
        {"machine": "m", "torch": "t", "trl": "1.16.0", "rows": rows,
         "settings": {"threads": 2, "answers": 8, "answer_len": 64, "prompt_len": 128, "rounds": 2, "steps": 3,
                      "warmup": 1}})


def test_prompts_are_single_turn_and_short(tmp_path, monkeypatch, embedded):
    rows = [{"chosen": "\n\nHuman: hi there\n\nAssistant: hello", "rejected": "x"},
            {"chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d", "rejected": "x"},  # two turns
            {"chosen": "\n\nHuman: " + "word " * 300 + "\n\nAssistant: ok", "rejected": "x"},  # too long
            {"chosen": "\n\nHuman: tell me\n\nAssistant: sure", "rejected": "x"}]
    hh = tmp_path / "hh.jsonl.gz"
    with gzip.open(hh, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    monkeypatch.setattr(bench_trl, "HH", hh)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(embedded.tokenizer_dir)
    out = tmp_path / "prompts.jsonl"
    assert bench_trl.write_prompts(tokenizer, out, 5, max_tokens=64) == 2
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["prompt"] for w in written] == ["\n\nHuman: hi there\n\nAssistant:", "\n\nHuman: tell me\n\nAssistant:"]
    assert written[0]["chosen"] == " hello"
    assert bench_trl.write_prompts(tokenizer, out, 1, max_tokens=64) == 1  # stops at the count


def test_the_reward_is_the_same_for_both_call_shapes():
    answers = ["one two three", " ".join(["w"] * 30)]
    ours = bench_trl.word_count_reward(prompts=["p", "p"], responses=answers, meta=[{}, {}])
    trl = bench_trl.word_count_reward(prompts=["p", "p"], completions=answers, completion_ids=[[1], [2]])
    assert ours == trl == [pytest.approx(-27 / 30), 0.0]


def test_it_names_the_missing_trl_and_checks_its_own_flags(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl raises ImportError
    monkeypatch.setattr(sys, "argv", ["bench_trl.py", "--configs", "ours_grpo", "trl_grpo"])
    with pytest.raises(SystemExit, match="TRL is not installed: pip install -r requirements-bench.txt"):
        bench_trl.main()
    monkeypatch.setattr(sys, "argv", ["bench_trl.py", "--steps", "2", "--warmup", "2"])
    with pytest.raises(SystemExit):
        bench_trl.main()
    assert "leaves no timed step" in capsys.readouterr().err


def test_our_configurations_run_the_flags_they_are_named_for(tmp_path, monkeypatch):
    """Each of our configurations launches ``marlhf ppo`` with its own estimator, batch and KL placement, and
    reads its steps back from the run's metrics (a fake run here: the command is recorded, not run)."""
    seen = {}

    def fake_run(cmd, stdout, stderr, env):
        out = Path(cmd[cmd.index("--output_dir") + 1])
        seen[out.name] = cmd
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
            {"step": 1, "train/step_seconds": 2.0, "train/gen_seconds": 1.0, "train/response_len": 40.0},
            {"step": 1, "eval/gold_score": 0.5},
            {"step": 2, "train/step_seconds": 3.0, "train/gen_seconds": 1.5, "train/response_len": 50.0}]))
        assert env["OMP_NUM_THREADS"] == "2"
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench_trl.subprocess, "run", fake_run)
    args = argparse.Namespace(answers=8, prompt_len=128, answer_len=64, steps=2, seed=1, threads=2)
    got = {c: bench_trl.run_ours(c, args, "MODEL", tmp_path / "p.jsonl", tmp_path / c)
           for c in ("ours_grpo", "ours_grpo_kl", "ours_grpo_kl_loss", "ours_ma_ppo")}
    assert got["ours_grpo"] == [{"seconds": 2.0, "gen_seconds": 1.0, "tokens": 320.0},
                                {"seconds": 3.0, "gen_seconds": 1.5, "tokens": 400.0}]

    def flag(config, name):
        cmd = seen[config]
        return cmd[cmd.index(name) + 1] if name in cmd else None

    for config in ("ours_grpo", "ours_grpo_kl", "ours_grpo_kl_loss"):  # one prompt x 8 answers
        assert (flag(config, "--advantage_estimator"), flag(config, "--num_samples_per_prompt"),
                flag(config, "--per_device_generation_batch_size")) == ("grpo", "8", "1")
    assert [flag(c, "--kl_ctl") for c in ("ours_grpo", "ours_grpo_kl", "ours_grpo_kl_loss")] == ["0.0", "0.05", "0.05"]
    assert [flag(c, "--kl_penalty") for c in ("ours_grpo_kl", "ours_grpo_kl_loss")] == [None, "loss"]
    # MA-PPO: 8 prompts x 1 answer, 5-grams, a critic from the same model
    assert (flag("ours_ma_ppo", "--advantage_estimator"), flag("ours_ma_ppo", "--ngram"),
            flag("ours_ma_ppo", "--per_device_generation_batch_size"),
            flag("ours_ma_ppo", "--critic_model_name_or_path")) == (None, "5", "8", "MODEL")
