"""applications/<task>/ folders: every task of the paper loads, its prompt format matches what the dataset
adapters build, post-processing cuts/extracts responses, judge templates render, bad folders are named."""

import json
import shutil

import pytest

from marlhf.applications import ApplicationError, list_applications, load_application
from marlhf.data.adapters import available_datasets
from marlhf.data.adapters.rows import ASSISTANT, HUMAN, apps_prompt, tldr_prompt
from marlhf.eval.judge import parse_verdict, render_template


def test_all_four_tasks_load():
    assert list_applications() == ["code", "dialogue", "qa", "summarization"]
    for name in list_applications():
        app = load_application(name)
        assert app.name == name
        assert set(app.datasets) <= set(available_datasets()), name
        rendered = render_template(app.judge_template, "PROMPT", "FIRST", "SECOND")
        assert rendered.index("PROMPT") < rendered.index("FIRST") < rendered.index("SECOND")
    assert load_application("code").reward_source == "program_tests"
    assert load_application("code").parsing_kind == "code"
    assert load_application("code").metrics == ("pass@1", "pass@5")
    assert {load_application(n).reward_source for n in ("dialogue", "qa", "summarization")} == {"reward_model"}


def test_prompt_formats_match_the_adapters():
    assert load_application("dialogue").format_prompt("Hi?") == f"{HUMAN} Hi?{ASSISTANT}"
    assert load_application("qa").format_prompt("Why?") == f"{HUMAN} Why?{ASSISTANT}"
    assert load_application("summarization").format_prompt("my post") == tldr_prompt(None, None, "my post")
    assert load_application("code").format_prompt("Add two numbers.") == apps_prompt("Add two numbers.", "", False)


def test_postprocessing():
    assert load_application("dialogue").postprocess(" Sure!\n\nHuman: and?\n\nAssistant: x") == "Sure!"
    assert load_application("summarization").postprocess(" my cat is sick\n\nPOST: more") == "my cat is sick"
    code = load_application("code").postprocess("Here you go:\n```python\nprint(int(input()) * 2)\n```\nDone.")
    assert code == "print(int(input()) * 2)\n"


def test_judge_answer_shapes_of_each_task():
    # the answer shape each judge prompt asks for parses with that task's verdict format
    assert parse_verdict("B", load_application("summarization").verdict_format) == "second"
    assert parse_verdict('{"comparison": "...", "choice": "A"}', load_application("dialogue").verdict_format) == "first"
    qa = '{"factual accuracy": "A", "coherence": "A", "usefulness overall": "B", "reason": "..."}'
    assert parse_verdict(qa, load_application("qa").verdict_format) == "second"


def test_bad_task_folders_are_named(tmp_path):
    with pytest.raises(ApplicationError, match="known tasks: code, dialogue, qa, summarization"):
        load_application("translation")
    folder = tmp_path / "mine"
    shutil.copytree(load_application("dialogue").folder, folder)
    spec = json.loads((folder / "task.json").read_text())
    assert load_application(folder).name == "dialogue"  # a folder path works too

    def broken(change, match):
        bad = dict(spec)
        change(bad)
        (folder / "task.json").write_text(json.dumps(bad))
        with pytest.raises(ApplicationError, match=match):
            load_application(folder)

    broken(lambda s: s.pop("metrics"), r"task.json: field 'metrics': missing")
    broken(lambda s: s.update(reward_source="vibes"), r"field 'reward_source': expected one of")
    broken(lambda s: s.update(prompt_template="no slot"), r"field 'prompt_template': lacks")
    broken(lambda s: s.update(judge={"template": "absent.txt"}), r"field 'judge.template': .*absent.txt")
    (folder / "task.json").write_text(json.dumps(spec))
    (folder / "judge.txt").write_text("only {prompt}")
    with pytest.raises(ApplicationError, match="response_a"):
        load_application(folder)
