"""The task descriptions in ``applications/<task>/`` (prompt format, post-processing, judge prompt, reward
source, metrics): one folder per task of the paper, read here so every tool uses the same definition.

    app = load_application("dialogue")
    prompt = app.format_prompt("How do I bake bread?")
    answer = app.postprocess(generated_text)
    judge_prompt = app.judge_template  # {prompt} {response_a} {response_b}
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from marlhf.eval.judge import VerdictFormat, render_template

# The repository's applications/ folder; MARLHF_APPLICATIONS points elsewhere (e.g. an installed copy).
APPLICATIONS_DIR = Path(os.environ.get("MARLHF_APPLICATIONS", Path(__file__).resolve().parents[1] / "applications"))
POSTPROCESSORS = ("strip", "code_block")
REWARD_SOURCES = ("reward_model", "program_tests")
PARSING_KINDS = ("text", "code")
_REQUIRED = ("name", "description", "datasets", "prompt_template", "stop", "postprocess", "judge",
             "reward_source", "metrics", "parsing_kind")


class ApplicationError(ValueError):
    """A task folder that cannot be used; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class Application:
    name: str
    folder: Path
    description: str
    datasets: tuple[str, ...]
    prompt_template: str
    stop: tuple[str, ...]
    postprocess_kind: str
    judge_template: str
    verdict_format: VerdictFormat
    reward_source: str
    metrics: tuple[str, ...]
    parsing_kind: str

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


def list_applications(root: str | Path = APPLICATIONS_DIR) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir() if (p / "task.json").is_file())


def load_application(name_or_path: str | Path, root: str | Path = APPLICATIONS_DIR) -> Application:
    """A task by folder name under ``root`` or by path to its folder."""
    folder = Path(name_or_path)
    if not (folder / "task.json").is_file():
        folder = Path(root) / str(name_or_path)
    spec_path = folder / "task.json"
    if not spec_path.is_file():
        known = ", ".join(list_applications(root)) if Path(root).is_dir() else "none"
        raise ApplicationError(f"no task {str(name_or_path)!r}: {spec_path} does not exist (known tasks: {known})")
    try:
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ApplicationError(f"{spec_path}: malformed JSON: {err}") from None

    def bad(field: str, why: str) -> ApplicationError:
        return ApplicationError(f"{spec_path}: field '{field}': {why}")

    for field in _REQUIRED:
        if field not in spec:
            raise bad(field, "missing")
    for field, allowed in (("postprocess", POSTPROCESSORS), ("reward_source", REWARD_SOURCES),
                           ("parsing_kind", PARSING_KINDS)):
        if spec[field] not in allowed:
            raise bad(field, f"expected one of {allowed}, got {spec[field]!r}")
    if "{input}" not in spec["prompt_template"]:
        raise bad("prompt_template", "lacks the {input} placeholder")
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
    return Application(
        name=spec["name"], folder=folder, description=spec["description"], datasets=tuple(spec["datasets"]),
        prompt_template=spec["prompt_template"], stop=tuple(spec["stop"]), postprocess_kind=spec["postprocess"],
        judge_template=template, verdict_format=fmt, reward_source=spec["reward_source"],
        metrics=tuple(spec["metrics"]), parsing_kind=spec["parsing_kind"],
    )
