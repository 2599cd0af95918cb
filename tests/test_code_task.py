"""The code task in step 3 (paper §4.4, B.5): the generated ``synthetic_code`` problems in APPS layout, and
MA-PPO with ``--reward_source program_tests`` end to end on the nano model — no reward model, the critic
initialised from the actor, every score one of the B.5 values of its verdict."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, STEP1, STEP3, load_main

from marlhf.data.adapters import load_records
from marlhf.embedded.code_task import SyntheticCodeConfig, generate
from marlhf.rewards.program_tests import ProgramTestReward, run_responses
from marlhf.utils.tracking import read_metrics

DATA = "synthetic_code:num_records=48"


def b5_values(total: int) -> set[float]:
    """Every reward of App. B.5 for a problem with ``total`` tests."""
    return {-1.0, -0.6} | {round(-0.3 + 1.3 * k / total, 6) for k in range(total + 1)}


def test_generated_problems_have_runnable_tests_in_apps_layout():
    records = load_records(DATA)
    assert records == generate(SyntheticCodeConfig(num_records=48))  # deterministic
    assert load_records(DATA, split="test") is None  # the caller holds out part of train
    call = [r for r in records if r.meta["fn_name"]]
    stdin = [r for r in records if not r.meta["fn_name"]]
    assert call and stdin
    for r in records:
        io = r.meta["input_output"]
        assert len(io["inputs"]) == len(io["outputs"]) == 4 and r.meta["difficulty"] == "introductory"
        assert r.prompt.startswith("\nQUESTION:\n") and r.prompt.endswith("\nANSWER:\n")
        assert ("Use Call-Based format" in r.prompt) == bool(r.meta["fn_name"])
        assert json.loads(json.dumps(r.meta)) == r.meta
    reward = ProgramTestReward(workers=2)
    prompts, meta = [r.prompt for r in records], [r.meta for r in records]
    assert reward.score(prompts, [r.chosen for r in records], meta) == [1.0] * len(records)
    wrong = reward.score(prompts, [r.rejected for r in records], meta)
    assert all(w < 1.0 for w in wrong) and {round(w, 6) for w in wrong} <= b5_values(4)


def test_each_verdict_gets_its_b5_reward():
    r = next(x for x in generate(SyntheticCodeConfig(num_records=20)) if not x.meta["fn_name"])
    answers = {
        "pass": f"```python\n{r.chosen}```",  # the code block of a chatty answer is what runs
        "wrong": "print(0)\n",
        "runtime": "x = int(input())\nprint(x // 0)\n",
        "compile": "def (:\n",
        "empty": "",
    }
    results = run_responses(list(answers.values()), [r.meta] * len(answers))
    got = {k: (res.verdict, res.reward) for k, res in zip(answers, results)}
    assert got["pass"] == ("pass", 1.0)
    assert got["wrong"][1] == pytest.approx(-0.3) and got["empty"][1] == pytest.approx(-0.3)
    assert got["runtime"] == ("runtime_error", -0.6)
    assert got["compile"] == ("compile_error", -1.0)


def test_generator_knobs_keep_problems_and_flaw_only_demonstrations():
    base = generate(SyntheticCodeConfig(num_records=200))
    flawed = generate(SyntheticCodeConfig(num_records=200, flaw_rate=0.3))
    # the flaws come from their own random stream: prompts, tests and rejected programs are unchanged
    assert [(r.prompt, r.meta, r.rejected) for r in flawed] == [(r.prompt, r.meta, r.rejected) for r in base]
    changed = [(b, f) for b, f in zip(base, flawed) if b.chosen != f.chosen]
    assert 0.2 < len(changed) / 200 < 0.4
    for b, f in changed:  # the bug: the result off by one, the program otherwise the reference
        assert f.chosen.replace(" + 1\n", "\n").replace(" + 1)\n", ")\n") == b.chosen
    reward = ProgramTestReward(workers=2)
    bad = [f for _, f in changed[:8]]
    scores = reward.score([r.prompt for r in bad], [r.chosen for r in bad], [r.meta for r in bad])
    assert all(s < 1.0 for s in scores)  # a flawed demonstration fails its own tests
    small = generate(SyntheticCodeConfig(num_records=60, operations=2, max_constant=2, call_based_share=0))
    assert {r.chosen.splitlines()[1] for r in small} <= {"print(2 * x + 1)", "print(2 * x + 2)", "print(x * x - 2)"}
    assert not any(r.meta["fn_name"] for r in small)
    for bad_cfg in ({"flaw_rate": 1.5}, {"operations": 0}, {"operations": 9}, {"max_constant": 1}):
        with pytest.raises(ValueError, match=next(iter(bad_cfg))):
            SyntheticCodeConfig(**bad_cfg)
    assert load_records("synthetic_code:num_records=20,flaw_rate=0.5") == generate(
        SyntheticCodeConfig(num_records=20, flaw_rate=0.5))


def test_program_reward_details_give_the_verdict_mix():
    r = next(x for x in generate(SyntheticCodeConfig(num_records=20)) if not x.meta["fn_name"])
    answers = [r.chosen, "print(0)\n", "x = int(input())\nprint(x // 0)\n", "def (:\n"]
    reward = ProgramTestReward(workers=1)
    rows = reward.details([r.prompt] * 4, answers, None, [r.meta] * 4)
    assert [d["total"] for d in rows] == reward.score([r.prompt] * 4, answers, [r.meta] * 4)
    assert [max(reward.components[:5], key=d.get) for d in rows] == [
        "pass", "wrong_answer", "runtime_error", "compile_error"]
    for d in rows:  # exactly one verdict per answer
        assert sum(d[v] for v in reward.components[:5]) == 1.0 and set(d) == {"total", *reward.components}
    assert rows[0]["tests_passed"] == 1.0 and rows[3]["tests_passed"] == 0.0
    with pytest.raises(ValueError, match="record meta"):
        reward.details([r.prompt], [r.chosen], None, None)


@pytest.fixture(scope="module")
def code_run(tmp_path_factory):
    from marlhf import embedded

    nano = embedded.prepare(size="nano").model_dir
    out = tmp_path_factory.mktemp("code_ppo")
    # no critic, no reward model: the critic starts from the actor, the reward is the program tests
    load_main(STEP3)(["--actor_model_name_or_path", str(nano), "--data_path", DATA,
                      "--data_output_path", str(out / "data"), "--output_dir", str(out), "--data_split", "2,0,8",
                      "--reward_source", "program_tests", "--reward_workers", "2", "--max_prompt_seq_len", "128",
                      "--max_answer_seq_len", "16", "--per_device_generation_batch_size", "4",
                      "--per_device_training_batch_size", "4", "--max_steps", "3", "--max_eval_samples", "4",
                      "--termination_condition", "parsing", "--ngram", "3", "--disable_progress_bar",
                      "--seed", "3", "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3",
                      "--save_steps", "3"])
    return out, nano


def test_step3_with_program_tests_runs_end_to_end(code_run):
    out, nano = code_run
    rows = [m for m in read_metrics(out) if "train/actor_loss" in m]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("train/actor_loss", "train/critic_loss", "train/kl"):
            assert torch.isfinite(torch.tensor(r[key])), key
        # the batch mean of 4 B.5 rewards (the untrained model writes garbage: mostly -1.0)
        assert -1.0 <= r["train/reward"] <= 1.0
        assert any(abs(4 * r["train/reward"] - sum(c)) < 1e-5
                   for c in _combinations(sorted(b5_values(4)), 4)), r["train/reward"]
    summary = json.loads((out / "summary.json").read_text())
    for policy in ("initial_policy", "final_policy"):
        assert {"program_score", "program_pass", "program_compile_error", "program_tests_passed", "response_len",
                "eos_rate"} <= summary[policy].keys()
        verdicts = ("pass", "wrong_answer", "runtime_error", "timeout", "compile_error")
        assert sum(summary[policy][f"program_{v}"] for v in verdicts) == pytest.approx(1.0)
        assert "rm_score" not in summary[policy] and "gold_score" not in summary[policy]
        assert -1.0 <= summary[policy]["program_score"] <= 1.0
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic").state_dict()
    actor_init = AutoModelForCausalLM.from_pretrained(nano).state_dict()
    # the critic's body started from the actor's (SFT) model: 3 Adam steps of lr 1e-3 move each weight by
    # at most ~3e-3, far less than the ~0.02 spread of a fresh initialisation; its value head is new
    assert critic["score.weight"].shape[0] == 1
    for key in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"):
        assert (critic[key] - actor_init[key]).abs().max() < 5e-3, key


def test_step3_checkpoint_exports_actor_and_critic(code_run, tmp_path):
    """marlhf export --from_checkpoint on a step-3 run without a reward model: the actor and the critic
    (which step 3 started from the actor, not from the embedded default) rebuilt from the DeepSpeed checkpoint
    of the last step give the logits / values of the run's own exported models."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from marlhf.errors import run_cli

    out, _ = code_run
    recorded = json.loads((out / "args.json").read_text())
    assert recorded["critic_model_name_or_path"] == ""  # the flag as given; what the run resolved:
    context = recorded["run_context"]
    assert context["critic_model_name_or_path"] == context["actor_model_name_or_path"]  # the actor (B.5)
    assert context["reward_model_name_or_path"] is None and context["task"] == "synthetic_code"
    assert context["response_kind"] == "code" and set(context["learning_rates"]) == {"actor", "critic"}
    assert (out / "checkpoints" / "step00000003").is_dir()
    export = load_main("export")
    for part, cls in (("actor", AutoModelForCausalLM), ("critic", AutoModelForSequenceClassification)):
        dest = tmp_path / part
        assert run_cli(export, ["--input", str(out), "--from_checkpoint", "--model", part,
                                "--output_dir", str(dest)]) == 0
        tok = AutoTokenizer.from_pretrained(dest)
        ids = tok(["\nQUESTION:\nprint x\nANSWER:\n", "x = 1"], return_tensors="pt", padding=True)
        with torch.no_grad():
            want = cls.from_pretrained(out / part)(**ids).logits
            got = cls.from_pretrained(dest)(**ids).logits
        assert torch.equal(got, want), part
        assert "Step:** 3" in (dest / "README.md").read_text()


def _combinations(values, k):
    import itertools

    return itertools.combinations_with_replacement(values, k)


def test_program_tests_need_tests_in_meta(tmp_path):
    from marlhf import embedded
    from marlhf.errors import ConfigError

    nano = embedded.prepare(size="nano").model_dir
    with pytest.raises(ConfigError, match="have no 'input_output' in their record meta"):
        load_main(STEP3)(["--actor_model_name_or_path", str(nano), "--data_path", "synthetic:num_records=100",
                          "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path),
                          "--reward_source", "program_tests", "--max_steps", "1", "--disable_progress_bar"])


# A code task small enough to learn in a minute: stdin programs of two formulas with constants <= 2, half of
# the demonstrations carrying the off-by-one bug.  A short SFT copies the bug at about that rate; the program
# tests are the only thing that tells it apart.
LEARN_DATA = "synthetic_code:num_records=600,operations=2,max_constant=2,call_based_share=0,flaw_rate=0.5"
# measured once on 2 cores (seed 1): held-out reward 0.347 -> 0.630, pass rate 0.533 -> 0.733 on 30 problems
SFT_STEPS, RL_STEPS, RL_LR = "80", "10", "1e-4"
MIN_REWARD_GAIN, MIN_PASS_GAIN = 0.15, 0.1


def test_bench_answer_forms_sort_answers_into_reference_bug_and_other():
    """``bench_code_task`` reads a reward gain in the programs: each answer is the problem's reference program,
    the SFT data's off-by-one bug or something else — whitespace and a chatty code block aside."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_code_task", REPO / "scripts/bench_code_task.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    data = "synthetic_code:num_records=6,operations=2,max_constant=3,flaw_rate=0.5"
    records = load_records(data)
    clean = generate(SyntheticCodeConfig(num_records=6, operations=2, max_constant=3, flaw_rate=0.0))
    buggy = generate(SyntheticCodeConfig(num_records=6, operations=2, max_constant=3, flaw_rate=1.0))
    assert {r.chosen == ok.chosen for r, ok in zip(records, clean)} == {True, False}  # the data shows both
    responses = []
    for ok, bad, r in zip(clean, buggy, records):  # n = 3 answers per problem
        responses += [f"```python\n{ok.chosen.replace(' = ', '  =  ')}```", bad.chosen, r.rejected]
    forms = bench.answer_forms(responses, records, 3, data)
    assert forms == pytest.approx({"reference": 1 / 3, "off_by_one": 1 / 3, "other": 1 / 3})
    # the first problem's three answers alone: exact shares of n = 3
    assert bench.answer_forms(responses[:3] + [clean[1].chosen] * 3, records[:2], 3, data) == \
        pytest.approx({"reference": 4 / 6, "off_by_one": 1 / 6, "other": 1 / 6})
    with pytest.raises(SystemExit, match="synthetic_code"):
        bench.answer_forms(responses, records, 3, "synthetic")

@pytest.mark.slow
def test_step3_program_tests_raise_the_held_out_reward(tmp_path):
    """Step 1 on the tiny model, then a few GRPO steps of step 3 with ``--reward_source program_tests``: on the
    held-out problems (same prompts, same sampling seed before and after) the mean B.5 reward and the pass
    rate rise, and so does the training reward."""
    from marlhf import embedded

    tiny = embedded.prepare(size="tiny").model_dir
    common = ["--data_path", LEARN_DATA, "--data_split", "5,0,5", "--data_output_path", str(tmp_path / "data"),
              "--disable_progress_bar", "--seed", "1"]
    load_main(STEP1)(["--model_name_or_path", str(tiny), "--output_dir", str(tmp_path / "sft"),
                      "--max_seq_len", "160", "--per_device_train_batch_size", "16", "--learning_rate", "2e-3",
                      "--num_train_epochs", "100", "--max_steps", SFT_STEPS, "--lr_scheduler_type", "constant",
                      "--max_eval_samples", "8", *common])
    out = tmp_path / "rl"
    load_main(STEP3)(["--actor_model_name_or_path", str(tmp_path / "sft"), "--output_dir", str(out),
                      "--reward_source", "program_tests", "--reward_workers", "2", "--max_prompt_seq_len", "128",
                      "--max_answer_seq_len", "40", "--advantage_estimator", "grpo", "--num_samples_per_prompt", "4",
                      "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "16",
                      "--max_steps", RL_STEPS, "--max_eval_samples", "32", "--kl_ctl", "0", "--temperature", "1.0",
                      "--top_k", "0", "--actor_learning_rate", RL_LR, "--lr_scheduler_type", "constant", *common])
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["initial_policy"], summary["final_policy"]
    assert before["num_prompts"] == after["num_prompts"] >= 16
    # the SFT policy writes the bug on about half of its answers: room to improve
    assert 0.1 < before["program_pass"] < 0.7, before
    assert after["program_score"] > before["program_score"] + MIN_REWARD_GAIN, (before, after)
    assert after["program_pass"] > before["program_pass"] + MIN_PASS_GAIN, (before, after)
    rewards = [m["train/reward"] for m in read_metrics(out) if "train/reward" in m]
    half = len(rewards) // 2
    assert sum(rewards[half:]) / (len(rewards) - half) > sum(rewards[:half]) / half, rewards
