"""Reward source ``gold``: the embedded task's gold scorer (:mod:`marlhf.embedded.task`), which knows each post's
facts — the reward of ``--reward_source gold`` and the held-out ``gold_score`` of every evaluation on that task.
A task declares it by name (``"gold_scorer": "synthetic"`` in its task.json); :func:`gold_of` builds it."""

from __future__ import annotations

import json
from pathlib import Path

from marlhf.embedded import task as embedded_task
from marlhf.tasks import Task, load_task, task_of_datasets
from marlhf.utils.run import RUN_CONTEXT


class GoldScorer:
    """The embedded task's gold scorer (:mod:`marlhf.embedded.task`): reward source ``gold``, and the held-out
    ``gold_score`` of every evaluation on that task.

    :meth:`score` reads each post's facts from ``meta["facts"]`` (written by the synthetic generator and
    carried through the data cache), and parses the prompt text only for data without them; ``ended`` says
    which answers stopped at an end token.  ``details`` returns every component as well (printed next to the
    total); calling the scorer, ``(prompts, answers, ended) -> scores``, parses the prompts."""

    def __init__(self):

        self._synthetic = embedded_task
        self.components = embedded_task.GOLD_COMPONENTS

    def __call__(self, prompts, answers, ended=None) -> list[float]:
        return self._synthetic.gold_scores(prompts, answers, ended)

    def score(self, prompts, responses, meta=None, *, ended=None) -> list[float]:
        return [d["total"] for d in self.details(prompts, responses, ended, meta)]

    def details(self, prompts, answers, ended=None, meta=None) -> list[dict[str, float]]:
        return self._synthetic.gold_score_details(prompts, answers, ended, self._facts(meta, len(prompts)))

    def _facts(self, meta, n: int):
        if meta is None:
            return None
        if len(meta) != n:
            raise ValueError(f"gold scorer: {n} prompts but {len(meta)} meta entries")
        facts = self._synthetic.PostFacts.from_meta
        return [facts(m["facts"]) if m and "facts" in m else None for m in meta]


def gold_of(task: Task | None) -> GoldScorer | None:
    """The gold scorer ``task`` declares (its ``gold_scorer``), or None: no task, or a task without one."""
    return GoldScorer() if task is not None and task.gold_scorer == "synthetic" else None


def recorded_task(model_dir: str):
    """The task of the run that wrote ``model_dir`` (its args.json, beside it or one level up): the task it
    resolved (its run context), else the task of its recorded --data_path; None when it had none."""

    for folder in (Path(model_dir), Path(model_dir).parent):
        path = folder / "args.json"
        if path.is_file():
            recorded = json.loads(path.read_text())
            if RUN_CONTEXT in recorded:
                name = recorded[RUN_CONTEXT].get("task")
                return load_task(name) if name else None
            return task_of_datasets(recorded.get("data_path") or [])
    return None


def gold_scorer(mode: str, data_path: list[str] | None, reward_model: str):
    """``--gold``: "off" None, "on" the embedded task's gold scorer, "auto" the gold scorer of the task (the task
    declaring ``data_path``'s datasets, else the reward model's run's task) when it has one.  Called as
    ``(prompts, answers[, ended])``."""

    if mode == "off":
        return None
    if mode == "on":
        return embedded_task.gold_scores
    task = task_of_datasets(data_path) if data_path else recorded_task(reward_model)
    return gold_of(task)
