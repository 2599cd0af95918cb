"""The task registry: one folder per task under ``marlhf/applications/`` (``task.json`` + a judge prompt; package data,
so an installed wheel has it), read here so that training, evaluation and the launch scripts use one definition of
each task.

A task gives its datasets, the prompt template a raw input becomes, how a response is post-processed, the judge's
prompt and answer format, its default reward source, its metrics, the kind of its responses (text or code: the
parsing rule of App. B.4), its gold scorer where it has one (the embedded task), and the data flags its launch
scripts start from.  The paper's four tasks are ``summarization`` (alias ``tldr``), ``dialogue`` (``hh``),
``qa`` (``webgpt``) and ``code`` (``apps``); the embedded demo is the task ``synthetic`` (and ``synthetic_code``).

    task = load_task("dialogue")            # or an alias ("hh"), or a folder path
    prompt = task.format_prompt("How do I bake bread?")
    answer = task.postprocess(generated_text)
    task = resolve_task("auto", ["Dahoas/full-hh-rlhf"])   # --task auto: the task that declares the dataset

A run's task is ``--task`` when given; with ``--task auto`` (the default) it is the task whose ``datasets`` list
every ``--data_path`` dataset by name (a local file of the generic layout belongs to no task: pass ``--task``);
``--task none`` uses none.  Nothing is guessed from a path's spelling: a dataset belongs to a task because the task
declares it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from marlhf.data.adapters import dataset_name

# The package's applications/ folder (shipped in the wheel: setup.py package_data); MARLHF_APPLICATIONS points
# elsewhere (a folder of the user's own tasks).
APPLICATIONS_DIR = Path(os.environ.get("MARLHF_APPLICATIONS", Path(__file__).resolve().parent / "applications"))
POSTPROCESSORS = ("strip", "code_block")
TASK_REWARD_SOURCES = ("reward_model", "program_tests")  # what a task.json may name: the others need flags of their own
RESPONSE_KINDS = ("text", "code")
GOLD_SCORERS = ("synthetic",)
LAUNCH_KEYS = ("data_path", "data_split", "max_prompt_seq_len", "max_answer_seq_len")
_REQUIRED = ("name", "description", "datasets", "aliases", "prompt_template", "stop", "postprocess", "judge",
             "reward_source", "gold_scorer", "metrics", "response_kind", "launch")
AUTO, NONE = "auto", "none"  # --task values beside the tasks' names


# ------------------------------------------------------------------------- the judge's prompt and verdict
_PLACEHOLDER = re.compile(r"\{(prompt|response_a|response_b)\}")


def render_template(template: str, prompt: str, response_a: str, response_b: str) -> str:
    """Fill ``{prompt}``, ``{response_a}``, ``{response_b}`` in one pass (braces in the texts stay as they
    are, and a response containing "{response_b}" is not substituted again)."""
    missing = {"prompt", "response_a", "response_b"} - set(_PLACEHOLDER.findall(template))
    if missing:
        raise ValueError(f"judge template lacks the placeholders {sorted(missing)}")
    values = {"prompt": prompt, "response_a": response_a, "response_b": response_b}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


@dataclasses.dataclass(frozen=True)
class VerdictFormat:
    """How a task's judge answers: the letters for first / second / tie and, for JSON answers, the key
    holding the overall choice (F.1: "choice" for HH-RLHF; WebGPT's overall criterion)."""

    first: str = "A"
    second: str = "B"
    tie: str = "E"
    json_key: str = "choice"


class TaskError(ValueError):
    """A task folder that cannot be used, or a task that cannot be found; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    folder: Path
    description: str
    datasets: tuple[str, ...]
    aliases: tuple[str, ...]
    prompt_template: str
    stop: tuple[str, ...]
    postprocess_kind: str
    judge_template: str
    verdict_format: VerdictFormat
    reward_source: str
    gold_scorer: str | None  # the name of its gold scorer (GOLD_SCORERS), None: the task has none
    metrics: tuple[str, ...]
    response_kind: str  # text | code
    launch: dict  # the launch scripts' data flags (LAUNCH_KEYS)

    def format_prompt(self, text: str) -> str:
        """A raw input (post, user turn, question, problem statement) as the policy's prompt."""
        return self.prompt_template.replace("{input}", text)

    def postprocess(self, response: str) -> str:
        """A generated response as the task uses it: cut at the first stop string, then stripped, or for
        code the program extracted from its fenced block."""
        for stop in self.stop:
            cut = response.find(stop)
            if cut >= 0:
                response = response[:cut]
        if self.postprocess_kind == "code_block":
            from marlhf.code.apps import extract_code

            return extract_code(response)
        return response.strip()


def list_tasks(root: str | Path = APPLICATIONS_DIR) -> list[str]:
    """The tasks' names (their folders under ``root``)."""
    return sorted(p.name for p in Path(root).iterdir() if (p / "task.json").is_file())


def _specs(root: str | Path) -> dict[str, dict]:
    """Folder name -> task.json, read without validating (for names and aliases)."""
    out = {}
    for name in list_tasks(root):
        try:
            out[name] = json.loads((Path(root) / name / "task.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            out[name] = {}
    return out


def task_names(root: str | Path = APPLICATIONS_DIR) -> tuple[str, ...]:
    """Every name ``--task`` accepts: the tasks, their aliases, ``auto`` and ``none``."""
    names = [AUTO, NONE]
    for name, spec in _specs(root).items():
        names += [name, *spec.get("aliases", [])]
    return tuple(names)


class TaskNames:
    """The ``choices`` of ``--task`` when asked (a folder added under ``applications/`` is a valid value at once)."""

    def __iter__(self):
        return iter(task_names())

    def __contains__(self, name) -> bool:
        return name in task_names()

    def __len__(self) -> int:
        return len(task_names())

    def __repr__(self) -> str:
        return repr(task_names())


def load_task(name_or_path: str | Path, root: str | Path = APPLICATIONS_DIR) -> Task:
    """A task by name, alias, or path to its folder."""
    folder = Path(name_or_path)
    if not (folder / "task.json").is_file():
        name = str(name_or_path)
        by_alias = {alias: task for task, spec in _specs(root).items() for alias in spec.get("aliases", [])} \
            if Path(root).is_dir() else {}
        folder = Path(root) / by_alias.get(name, name)
    spec_path = folder / "task.json"
    if not spec_path.is_file():
        known = ", ".join(list_tasks(root)) if Path(root).is_dir() else "none"
        raise TaskError(f"no task {str(name_or_path)!r}: {spec_path} does not exist (known tasks: {known})")
    try:
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TaskError(f"{spec_path}: malformed JSON: {err}") from None

    def bad(field: str, why: str) -> TaskError:
        return TaskError(f"{spec_path}: field '{field}': {why}")

    for field in _REQUIRED:
        if field not in spec:
            raise bad(field, "missing")
    for field, allowed in (("postprocess", POSTPROCESSORS), ("reward_source", TASK_REWARD_SOURCES),
                           ("response_kind", RESPONSE_KINDS)):
        if spec[field] not in allowed:
            raise bad(field, f"expected one of {allowed}, got {spec[field]!r}")
    if spec["gold_scorer"] is not None and spec["gold_scorer"] not in GOLD_SCORERS:
        raise bad("gold_scorer", f"expected null or one of {GOLD_SCORERS}, got {spec['gold_scorer']!r}")
    if "{input}" not in spec["prompt_template"]:
        raise bad("prompt_template", "lacks the {input} placeholder")
    launch = spec["launch"]
    if not isinstance(launch, dict) or sorted(launch) != sorted(LAUNCH_KEYS):
        raise bad("launch", f"expected an object with exactly {', '.join(LAUNCH_KEYS)}")
    judge = spec["judge"]
    if not isinstance(judge, dict) or "template" not in judge:
        raise bad("judge", "expected an object with a 'template' file name")
    template_path = folder / judge["template"]
    if not template_path.is_file():
        raise bad("judge.template", f"{template_path} does not exist")
    template = template_path.read_text(encoding="utf-8")
    try:
        render_template(template, "", "", "")
    except ValueError as err:
        raise bad("judge.template", f"{template_path}: {err}") from None
    fmt = VerdictFormat(**{k: judge[k] for k in ("first", "second", "tie", "json_key") if k in judge})
    return Task(
        name=spec["name"], folder=folder, description=spec["description"], datasets=tuple(spec["datasets"]),
        aliases=tuple(spec["aliases"]), prompt_template=spec["prompt_template"], stop=tuple(spec["stop"]),
        postprocess_kind=spec["postprocess"], judge_template=template, verdict_format=fmt,
        reward_source=spec["reward_source"], gold_scorer=spec["gold_scorer"], metrics=tuple(spec["metrics"]),
        response_kind=spec["response_kind"], launch=dict(launch),
    )


def task_of_datasets(data_path: list[str] | tuple[str, ...], root: str | Path = APPLICATIONS_DIR) -> Task | None:
    """The task whose ``datasets`` declare every dataset of ``data_path`` (by name: ``NAME:LOCAL_PATH`` is NAME,
    ``synthetic:k=v`` is ``synthetic``), or None when a dataset belongs to no task or they belong to different ones."""

    names = {dataset_name(spec) for spec in data_path}
    if not names or None in names:
        return None
    owners = {task for task, spec in _specs(root).items() if names <= set(spec.get("datasets", []))}
    return load_task(owners.pop(), root) if len(owners) == 1 else None


def resolve_task(flag: str, data_path: list[str] | tuple[str, ...], root: str | Path = APPLICATIONS_DIR) -> Task | None:
    """The run's task: ``--task NAME`` (a name or alias), ``auto`` the task declaring the data, ``none`` none."""
    if flag == NONE:
        return None
    if flag == AUTO:
        return task_of_datasets(data_path, root)
    return load_task(flag, root)


def response_kind(flag: str, task: Task | None, reward_source: str) -> str:
    """``--response_kind``: the flag when given; ``auto``: the task's, else code when the reward is the program
    tests (the answers are programs, paper B.4), else text."""
    if flag != AUTO:
        return flag
    if task is not None:
        return task.response_kind
    return "code" if reward_source == "program_tests" else "text"


def shell_values(name: str, root: str | Path = APPLICATIONS_DIR) -> str:
    """The launch scripts' view of a task (``training/launch_common.sh``): shell assignments of its name, default
    dataset, data split and lengths."""
    import shlex

    task = load_task(name, root)
    values = {"TASK_NAME": task.name, "DATASET": task.launch["data_path"], "DATA_SPLIT": task.launch["data_split"],
              "PROMPT_LEN": task.launch["max_prompt_seq_len"], "ANSWER_LEN": task.launch["max_answer_seq_len"]}
    return "\n".join(f"{k}={shlex.quote(str(v))}" for k, v in values.items())


if __name__ == "__main__":  # python -m marlhf.tasks NAME: the launch scripts' task table
    import sys

    try:
        print(shell_values(sys.argv[1]))
    except (IndexError, TaskError) as err:
        print(f"marlhf.tasks: {err if isinstance(err, TaskError) else 'usage: python -m marlhf.tasks NAME'}",
              file=sys.stderr)
        sys.exit(2)
