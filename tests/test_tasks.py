"""The task registry (marlhf/tasks.py, marlhf/applications/<task>/): every task loads, its prompt format matches
what the dataset adapters build, post-processing cuts/extracts responses, judge templates render, bad folders are
named; a run's task is the flag or the task declaring its datasets (never a guess from a path), and gives the
response kind, the gold scorer and the launch scripts' values."""

import json
import shutil

import pytest

from marlhf.data.adapters import available_datasets
from marlhf.data.adapters.rows import ASSISTANT, HUMAN, apps_prompt, tldr_prompt
from marlhf.eval.judge import parse_verdict
from marlhf.rewards.gold import GoldScorer, gold_of
from marlhf.tasks import (
    TaskError,
    list_tasks,
    load_task,
    render_template,
    resolve_task,
    response_kind,
    shell_values,
    task_names,
    task_of_datasets,
)


def test_every_task_loads():
    assert list_tasks() == ["code", "dialogue", "qa", "summarization", "synthetic", "synthetic_code"]
    for name in list_tasks():
        app = load_task(name)
        assert app.name == name
        assert set(app.datasets) <= set(available_datasets()), name
        rendered = render_template(app.judge_template, "PROMPT", "FIRST", "SECOND")
        assert rendered.index("PROMPT") < rendered.index("FIRST") < rendered.index("SECOND")
    assert load_task("code").reward_source == "program_tests"
    assert load_task("code").response_kind == load_task("synthetic_code").response_kind == "code"
    assert {load_task(n).response_kind for n in ("dialogue", "qa", "summarization", "synthetic")} == {"text"}
    assert load_task("code").metrics == ("pass@1", "pass@5")
    assert {load_task(n).reward_source for n in ("dialogue", "qa", "summarization")} == {"reward_model"}


def test_prompt_formats_match_the_adapters():
    assert load_task("dialogue").format_prompt("Hi?") == f"{HUMAN} Hi?{ASSISTANT}"
    assert load_task("qa").format_prompt("Why?") == f"{HUMAN} Why?{ASSISTANT}"
    assert load_task("summarization").format_prompt("my post") == tldr_prompt(None, None, "my post")
    assert load_task("code").format_prompt("Add two numbers.") == apps_prompt("Add two numbers.", "", False)


def test_postprocessing():
    assert load_task("dialogue").postprocess(" Sure!\n\nHuman: and?\n\nAssistant: x") == "Sure!"
    assert load_task("summarization").postprocess(" my cat is sick\n\nPOST: more") == "my cat is sick"
    code = load_task("code").postprocess("Here you go:\n```python\nprint(int(input()) * 2)\n```\nDone.")
    assert code == "print(int(input()) * 2)\n"


def test_judge_answer_shapes_of_each_task():
    # the answer shape each judge prompt asks for parses with that task's verdict format
    assert parse_verdict("B", load_task("summarization").verdict_format) == "second"
    assert parse_verdict('{"comparison": "...", "choice": "A"}', load_task("dialogue").verdict_format) == "first"
    qa = '{"factual accuracy": "A", "coherence": "A", "usefulness overall": "B", "reason": "..."}'
    assert parse_verdict(qa, load_task("qa").verdict_format) == "second"


def test_bad_task_folders_are_named(tmp_path):
    with pytest.raises(TaskError, match="known tasks: code, dialogue, qa, summarization, synthetic, synthetic_code"):
        load_task("translation")
    folder = tmp_path / "mine"
    shutil.copytree(load_task("dialogue").folder, folder)
    spec = json.loads((folder / "task.json").read_text())
    assert load_task(folder).name == "dialogue"  # a folder path works too

    def broken(change, match):
        bad = dict(spec)
        change(bad)
        (folder / "task.json").write_text(json.dumps(bad))
        with pytest.raises(TaskError, match=match):
            load_task(folder)

    broken(lambda s: s.pop("metrics"), r"task.json: field 'metrics': missing")
    broken(lambda s: s.update(reward_source="vibes"), r"field 'reward_source': expected one of")
    broken(lambda s: s.update(prompt_template="no slot"), r"field 'prompt_template': lacks")
    broken(lambda s: s.update(judge={"template": "absent.txt"}), r"field 'judge.template': .*absent.txt")
    (folder / "task.json").write_text(json.dumps(spec))
    (folder / "judge.txt").write_text("only {prompt}")
    with pytest.raises(TaskError, match="response_a"):
        load_task(folder)


def test_aliases_are_the_launch_scripts_names():
    assert [load_task(a).name for a in ("tldr", "hh", "webgpt", "apps")] == ["summarization", "dialogue", "qa", "code"]
    names = task_names()
    assert {"auto", "none", "tldr", "hh", "webgpt", "apps", "synthetic", "synthetic_code"} <= set(names)
    assert len(names) == len(set(names))  # no alias shadows a name


def test_a_run_s_task_is_declared_by_its_datasets_or_given():
    assert resolve_task("auto", ["synthetic"]).name == "synthetic"
    assert resolve_task("auto", ["synthetic:num_records=60,seed=3"]).name == "synthetic"  # options do not matter
    assert resolve_task("auto", ["synthetic_code:num_records=20"]).name == "synthetic_code"
    assert resolve_task("auto", ["Dahoas/full-hh-rlhf", "Anthropic/hh-rlhf"]).name == "dialogue"
    assert resolve_task("auto", ["openai/summarize_from_feedback"]).name == "summarization"
    assert resolve_task("auto", ["synthetic", "Dahoas/full-hh-rlhf"]) is None  # two tasks' data: none
    assert resolve_task("none", ["synthetic"]) is None
    assert resolve_task("hh", ["synthetic"]).name == "dialogue"  # the flag wins


def test_a_file_named_like_a_task_belongs_to_none(tmp_path):
    """The old rule split the path at ':' and compared the head: a local file is no task's data however it is
    named, unless --task says so."""
    for name in ("synthetic.jsonl", "synthetic_code.jsonl"):
        path = tmp_path / name
        path.write_text('{"prompt": "p", "chosen": " c", "rejected": " r"}\n')
        assert task_of_datasets([str(path)]) is None
        assert resolve_task("synthetic", [str(path)]).name == "synthetic"


def test_response_kind_and_gold_scorer_come_from_the_task():
    code, synthetic = load_task("synthetic_code"), load_task("synthetic")
    assert response_kind("auto", code, "reward_model") == "code"
    assert response_kind("auto", synthetic, "program_tests") == "text"  # the task's, whatever the reward
    assert response_kind("auto", None, "program_tests") == "code"  # no task: programs are graded, so code
    assert response_kind("auto", None, "reward_model") == "text"
    assert response_kind("text", code, "program_tests") == "text"  # the flag wins
    assert isinstance(gold_of(synthetic), GoldScorer) and gold_of(None) is None
    assert [gold_of(load_task(n)) for n in ("code", "dialogue", "qa", "summarization", "synthetic_code")] == [None] * 5


def test_the_launch_scripts_read_the_registry():
    values = dict(line.split("=", 1) for line in shell_values("tldr").splitlines())
    assert values == {"TASK_NAME": "summarization", "DATASET": "openai/summarize_from_feedback", "DATA_SPLIT": "2,4,4",
                      "PROMPT_LEN": "512", "ANSWER_LEN": "512"}
    assert dict(line.split("=", 1) for line in shell_values("apps").splitlines())["DATA_SPLIT"] == "2,0,8"
    for name in list_tasks():  # every task's default dataset belongs to it
        assert resolve_task("auto", [load_task(name).launch["data_path"]]).name == name


def test_a_bad_launch_or_gold_field_is_named(tmp_path):
    folder = tmp_path / "mine"
    shutil.copytree(load_task("synthetic").folder, folder)
    (folder / "judge.txt").write_text((load_task("summarization").folder / "judge.txt").read_text())
    spec = json.loads((folder / "task.json").read_text())
    spec["judge"]["template"] = "judge.txt"
    for change, match in ((dict(gold_scorer="oracle"), "field 'gold_scorer': expected null or one of"),
                          (dict(launch={"data_path": "x"}), "field 'launch': expected an object with exactly"),
                          (dict(response_kind="image"), "field 'response_kind': expected one of")):
        (folder / "task.json").write_text(json.dumps({**spec, **change}))
        with pytest.raises(TaskError, match=match):
            load_task(folder)
