"""The README's main job: marlhf quickstart runs steps 1 → 2 → 3 as the tiny launch scripts do, in order,
each step's output feeding the next (here with a few steps each; the quick start runs them in full)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from marlhf.embedded.task import GOLD_COMPONENTS
from marlhf.utils.machine import machine_info


@pytest.mark.slow
def test_pipeline_runner_chains_the_three_steps(embedded, tmp_path):
    env = {**os.environ, "DATA_OUTPUT_PATH": str(tmp_path / "data"), "MASTER_PORT": "29651"}
    proc = subprocess.run([sys.executable, "-m", "marlhf.cli.quickstart", "--output_dir", str(tmp_path / "run"),
                           "--extra_args=--max_steps=3", "--extra_args=--max_eval_samples=8",
                           "--extra_args=--disable_progress_bar", "--onpolicy_max_prompts", "24",
                           "--onpolicy_rounds", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert set(summary["seconds"]) == {"step1", "step2", "step2_onpolicy", "step2_onpolicy_round2", "step3"}
    # where each round's time went: its parts, inside the round's total
    parts = summary["stage_seconds"]
    assert set(parts["step2_onpolicy"]) == {"generate", "label", "reward_model"}
    assert set(parts["step2_onpolicy_round2"]) == {"probe", "generate", "label", "reward_model", "synthetic_eval"}
    for name, stage in parts.items():
        assert 0 < sum(stage.values()) <= summary["seconds"][name] + 0.2
    assert "step2_onpolicy_round2: " in proc.stdout and "(probe " in proc.stdout
    assert summary["step1_final_perplexity"] < 2000  # below the untrained model's ~vocabulary size
    assert 0.0 <= summary["step2_final_accuracy"] <= 1.0
    # step 2 itself trains nothing by default (--onpolicy_only): the SFT model with a new score head, evaluated
    assert json.loads((tmp_path / "run/step2/args.json").read_text())["num_train_epochs"] == 0
    assert [json.loads(line)["step"] for line in (tmp_path / "run/step2/metrics.jsonl").read_text().splitlines()] == [0]
    assert summary["steps"] == 3
    # step 3's own summary names the machine, so a sweep compares timings only between runs on one kind of CPU
    assert json.loads((tmp_path / "run/step3/summary.json").read_text())["machine"] == machine_info()
    for policy in ("initial_policy", "final_policy"):
        assert {"rm_score", "gold_score", "response_len", "eos_rate"} <= summary[policy].keys()
        # the gold score's components are reported next to the total (issue 10)
        assert {f"gold_{k}" for k in GOLD_COMPONENTS} <= summary[policy].keys()
        assert 0.0 < summary[policy]["gold_score_se"] < 1.0  # 8 answers: the score's standard error
    # between steps 2 and 3: 4 answers to each of 24 step-2 prompts from the SFT model, 2 disjoint pairs of each
    # prompt's answers labelled by the gold scorer (equal scores dropped), and step 2's reward model trained on
    # (3 steps here) before step 3 starts from it
    onpolicy = tmp_path / "run/step2_onpolicy"
    answers = [json.loads(line) for line in (onpolicy / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 96 and {a["sample"] for a in answers} == {0, 1, 2, 3}
    label = json.loads((onpolicy / "pairs/label.json").read_text())
    assert label["settings"]["annotator"] == "gold" and label["settings"]["pairing"] == "disjoint"
    counts = label["counts"]
    assert counts["pairs"] + counts["identical_dropped"] + counts["empty_dropped"] + counts["ties_dropped"] == 24 * 2
    assert counts["pairs"] > 12
    pairs = [json.loads(line) for name in ("train.jsonl", "test.jsonl")
             for line in (onpolicy / "pairs" / name).read_text().splitlines()]
    assert all(p["meta"]["annotator_scores"][0] != p["meta"]["annotator_scores"][1] for p in pairs)
    args_rm = json.loads((onpolicy / "reward_model/args.json").read_text())
    assert args_rm["model_name_or_path"].endswith("run/step2") and args_rm["max_steps"] == 3
    assert args_rm["num_train_epochs"] == 2  # --onpolicy_epochs' default (--max_steps cuts it here)
    assert args_rm["data_path"] == [str(onpolicy / "pairs")] and args_rm["data_split"] == "0,1,0"
    assert 0.0 <= summary["step2_onpolicy_accuracy"] <= 1.0
    assert "pairs of the SFT policy's answers" in proc.stdout
    # round 2: a probe step 3 against that reward model (a small evaluation of its own), 2 of its answers to
    # each prompt pooled with the first 2 of the SFT policy's, all 6 pairs labelled, round 1's model trained on
    round2 = tmp_path / "run/step2_onpolicy_round2"
    probe = json.loads((round2 / "probe/args.json").read_text())
    assert probe["critic_model_name_or_path"] == str(onpolicy / "reward_model") and probe["max_eval_samples"] == 16
    answers2 = [json.loads(line) for line in (round2 / "answers.jsonl").read_text().splitlines()]
    assert len(answers2) == 48 and {a["prompt_id"] for a in answers2} == {a["prompt_id"] for a in answers}
    label2 = json.loads((round2 / "pairs/label.json").read_text())
    assert label2["settings"]["generations"] == [str(round2 / "answers.jsonl"), str(onpolicy / "answers.jsonl")]
    assert label2["settings"]["max_samples"] == 2
    counts2 = label2["counts"]
    assert counts2["answers"] == 96
    assert sum(counts2[k] for k in ("pairs", "identical_dropped", "empty_dropped", "ties_dropped")) == 24 * 6
    args_rm2 = json.loads((round2 / "reward_model/args.json").read_text())
    assert args_rm2["model_name_or_path"] == str(onpolicy / "reward_model")
    assert args_rm2["data_path"] == [str(round2 / "pairs")] and args_rm2["learning_rate"] == args_rm["learning_rate"]
    assert 0.0 <= summary["step2_onpolicy_round2_accuracy"] <= 1.0
    # the reward model step 3 uses, evaluated on step 2's held-out synthetic pairs (8 here) without training
    synthetic = [json.loads(line) for line in (round2 / "synthetic_eval/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in synthetic] == [0] and synthetic[0]["eval/accuracy"] in {k / 8 for k in range(9)}
    assert summary["final_reward_model_synthetic_accuracy"] == synthetic[0]["eval/accuracy"]
    assert json.loads((round2 / "synthetic_eval/args.json").read_text())["model_name_or_path"] == \
        str(round2 / "reward_model")
    assert "step 3's reward model, after the rounds:" in proc.stdout
    assert "round 2: accuracy on held-out pairs" in proc.stdout
    # step 3 started from step 1's model and the last round's reward model
    args3 = json.loads((tmp_path / "run/step3/args.json").read_text())
    assert args3["actor_model_name_or_path"].endswith("run/step1")
    assert args3["critic_model_name_or_path"].endswith("run/step2_onpolicy_round2/reward_model")
    # what each step resolved is its run context, beside the flags as given (which keep "" and "auto")
    args1 = json.loads((tmp_path / "run/step1/args.json").read_text())
    assert args1["model_name_or_path"] == "" and args1["prompt_format"] == "auto"
    context1 = args1["run_context"]
    assert (Path(context1["model_name_or_path"]) / "config.json").is_file()  # the embedded default model
    assert context1["task"] == "synthetic"
    assert context1["end_of_conversation_token"] == "<|endoftext|>" and context1["prompt_format"] == "raw"
    assert context1["learning_rate"] == 1e-3
    context3 = args3["run_context"]
    assert context3["reward_model_name_or_path"] == context3["critic_model_name_or_path"] == \
        args3["critic_model_name_or_path"]
    assert context3["response_kind"] == "text" and context3["learning_rates"]["actor"] > 0
    assert (tmp_path / "run/step3/actor/model.safetensors").exists()
    assert "SFT policy" in proc.stdout and "final policy" in proc.stdout
    assert "gold_coverage" in proc.stdout and "gold_unfinished" in proc.stdout and "eos_rate" in proc.stdout
    assert "gold_score_se" in proc.stdout and "rm_score_se" in proc.stdout
    # one rank starts the installed entry point itself, without the deepspeed runner (LAUNCHER=auto), and the
    # step's log holds the launch line and the step's output, as a launch script's does
    log = (tmp_path / "run/step1/training.log").read_text()
    assert log.startswith(f"launch: {sys.executable} -u -m marlhf sft\n") and "runner.py" not in log
    assert "perplexity" in log


def test_onpolicy_stage_runs_with_step_2_and_is_reused_by_step_3_alone(tmp_path, monkeypatch):
    """When the main job trains the reward model on the policy's answers: at the end of step 2 (which by default
    runs without an epoch on its synthetic pairs; a new step 2 discards the old rounds), reused by ``--step 3``
    alone (run first when missing), never with --onpolicy_samples 0, --task or an explicit --reward_model; the
    last round's reward model then evaluated on step 2's synthetic pairs.  Round 2 (--onpolicy_rounds 2) runs a
    probe step 3 against round 1's reward model, pairs its answers with the SFT policy's and continues round 1's
    reward model; step 3 proper starts from the SFT policy against the last round's."""
    from marlhf.cli import quickstart

    calls = []

    def fake_stage(policy, rm, out, samples, **kw):
        compare = kw.get("compare_with")
        calls.append(("stage", Path(policy).relative_to(root).as_posix(), Path(rm).relative_to(root).as_posix(),
                      samples, kw["pairing"], kw["ties"], kw["epochs"],
                      compare and Path(compare).relative_to(root).as_posix()))
        (out / "reward_model").mkdir(parents=True)
        (out / "reward_model/model.safetensors").write_text("weights")
        return {"reward_model": 1.0}  # the seconds of each of its parts, as the real stage returns them

    def fake_eval(rm, step2, out):  # the last round's reward model on step 2's synthetic held-out pairs
        if (out / "metrics.jsonl").exists():
            return None  # done already, as the real one
        calls.append(("eval", Path(rm).relative_to(root).as_posix(), Path(step2).relative_to(root).as_posix()))
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
        return 1.0

    def fake_launch(cmd, log):  # the entry point run_step starts: which step, with which critic, where
        step = {"sft": 1, "rm": 2, "ppo": 3}[cmd[cmd.index("marlhf") + 1]]
        if step == 3:
            out = Path(cmd[cmd.index("--output_dir") + 1])
            critic = cmd[cmd.index("--critic_model_name_or_path") + 1]
            (out / "actor").mkdir(parents=True, exist_ok=True)
            (out / "actor/model.safetensors").write_text("weights")
            calls.append((3, Path(critic).relative_to(root).as_posix() if critic.startswith(str(root)) else critic,
                          out.relative_to(root).as_posix(), "--max_eval_samples=16" in cmd))
        else:  # step 2 without an epoch on its synthetic pairs: --onpolicy_only
            calls.append((step, "no epoch" if "--num_train_epochs=0" in cmd else None))
        return 0

    monkeypatch.setattr(quickstart, "onpolicy_reward_model", fake_stage)
    monkeypatch.setattr(quickstart, "synthetic_accuracy", fake_eval)
    monkeypatch.setattr(quickstart, "launch", fake_launch)
    root = tmp_path / "run"

    def run(*argv):
        calls.clear()
        assert quickstart.main(["--output_dir", str(root), *argv]) == 0
        return list(calls)

    r1, r2 = "step2_onpolicy/reward_model", "step2_onpolicy_round2/reward_model"
    round1 = ("stage", "step1", "step2", 4, "disjoint", "drop", 2, None)
    probe = (3, r1, "step2_onpolicy_round2/probe", True)  # step 3 against round 1's model, a small evaluation
    round2 = ("stage", "step2_onpolicy_round2/probe/actor", r1, 2, "all", "drop", 2, "step2_onpolicy/answers.jsonl")
    eval1, eval2 = ("eval", r1, "step2"), ("eval", r2, "step2")
    # the default: step 2 without an epoch on its synthetic pairs, one round on the SFT policy's answers trains it
    assert run() == [(1, None), (2, "no epoch"), round1, eval1, (3, r1, "step3", False)]
    summary = json.loads((root / "summary.json").read_text())
    assert summary["final_reward_model_synthetic_accuracy"] == 0.5
    assert summary["stage_seconds"]["step2_onpolicy"] == {"reward_model": 1.0, "synthetic_eval": 1.0}
    two = ("--onpolicy_rounds", "2")
    assert run("--step", "3", *two) == [probe, round2, eval2, (3, r2, "step3", False)]  # round 1 reused
    assert run("--step", "2", "3", *two, "--no-onpolicy_only") == [(2, None), round1, probe, round2, eval2,
                                                                    (3, r2, "step3", False)]
    summary = json.loads((root / "summary.json").read_text())
    assert summary["stage_seconds"]["step2_onpolicy_round2"].keys() == {"probe", "reward_model", "synthetic_eval"}
    (root / "step2_onpolicy/marker").write_text("from the old step 2")
    assert run("--step", "3", *two) == [(3, r2, "step3", False)]  # reused
    assert (root / "step2_onpolicy/marker").exists()
    # one round, its flags
    assert run("--step", "2", "3", "--onpolicy_samples", "2", "--onpolicy_pairing", "all", "--onpolicy_ties",
               "keep", "--onpolicy_epochs", "3") == [
        (2, "no epoch"), ("stage", "step1", "step2", 2, "all", "keep", 3, None), eval1, (3, r1, "step3", False)]
    assert not (root / "step2_onpolicy/marker").exists()  # discarded with the step 2 it came from
    assert not (root / "step2_onpolicy_round2").exists()
    assert run("--onpolicy_samples", "0")[-1] == (3, "step2", "step3", False)
    assert run("--step", "2", "--onpolicy_samples", "0") == [(2, None)]  # no rounds: step 2 keeps its epoch
    # the rounds end step 2: steps 1-2 alone (the reproduction sweep's base) leave step 3's reward model
    assert run("--step", "1", "2", *two) == [(1, None), (2, "no epoch"), round1, probe, round2, eval2]
    assert run("--step", "3", *two) == [(3, r2, "step3", False)]  # reused, not run again
    shutil.rmtree(root / "step2_onpolicy_round2/reward_model")  # round 2 stopped after its probe: the probe is kept
    assert run("--step", "3", *two) == [round2, eval2, (3, r2, "step3", False)]  # its old evaluation discarded
    shutil.rmtree(root / "step2_onpolicy")
    shutil.rmtree(root / "step2_onpolicy_round2")
    assert run("--step", "3", *two) == [round1, probe, round2, eval2, (3, r2, "step3", False)]  # missing: run first
    rm = tmp_path / "models/rm"  # a reward model of the user's, outside the run (it must exist: preflight)
    rm.mkdir(parents=True)
    assert run("--step", "3", "--reward_model", str(rm)) == [(3, str(rm), "step3", False)]
    with pytest.raises(SystemExit, match="--onpolicy_rounds"):
        quickstart.main(["--output_dir", str(root), "--onpolicy_rounds", "0"])


def test_round_reward_model_keeps_its_own_data_flags(tmp_path, monkeypatch):
    """The quick start's --extra_args reach the rounds' `marlhf rm` too, but the round's own flags win: a user's
    --extra_args=--data_split=4,3,3 (meant for the steps) once made the round's reward model train on 3/10 of its
    pairs.  The command is parsed by `marlhf rm`'s own parser, as the run would."""
    import dataclasses

    from marlhf.cli import quickstart
    from marlhf.config import RewardArgs, parse_args

    step2_args, _ = parse_args(RewardArgs, ["--model_name_or_path", "sft", "--output_dir", str(tmp_path / "step2"),
                                            "--data_split", "4,3,3", "--learning_rate", "1e-3"])
    (tmp_path / "step2").mkdir()
    (tmp_path / "step2/args.json").write_text(json.dumps(dataclasses.asdict(step2_args)))
    out = tmp_path / "round"
    (out / "pairs").mkdir(parents=True)
    (out / "pairs/label.json").write_text("{}")  # the pairs exist: only the reward model is trained
    commands = []
    monkeypatch.setattr(quickstart, "run_logged", lambda cmd, log: commands.append(cmd) or 1.0)
    user = ["--data_split", "4,3,3", "--data_path", "elsewhere", "--learning_rate", "5e-2", "--num_train_epochs",
            "7", "--max_steps", "3", "--seed", "11"]
    quickstart.onpolicy_reward_model(Path("policy"), tmp_path / "step2", out, 4, rm_args=user, epochs=2)
    (cmd,) = commands
    assert cmd[cmd.index("-m") + 1: cmd.index("-m") + 3] == ["marlhf", "rm"]
    rm_args, _ = parse_args(RewardArgs, cmd[cmd.index("-m") + 3:])
    # the round's own: its pairs, all of them for training, its output, epochs and learning rate
    assert rm_args.data_path == [str(out / "pairs")] and rm_args.data_split == "0,1,0"
    assert rm_args.output_dir == str(out / "reward_model") and rm_args.model_name_or_path == str(tmp_path / "step2")
    assert rm_args.num_train_epochs == 2 and rm_args.learning_rate == quickstart.ONPOLICY_RM_LEARNING_RATE
    # the user's flags the round does not set still apply
    assert rm_args.max_steps == 3 and rm_args.seed == 11
