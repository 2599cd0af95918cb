"""Reward sources: one interface, ``score(prompts, responses, meta) -> scores``, behind ``--reward_source``.

    reward_model   the step-2 reward model (step 3: the frozen reward engine),   :mod:`.reward_model`
                   or several combined conservatively (``--reward_ensemble``)
    gold           the embedded task's gold scorer (facts from ``meta``)         :mod:`.gold`
    program_tests  generated programs run against the problem's unit tests      :mod:`.program_tests`
                   in a sandbox (paper App. B.5)
    python         the user's function, ``--reward_function FILE.py:NAME``      :mod:`.python`
    remote         the user's HTTP server, ``--reward_url URL``                 :mod:`.remote`

One module per source; this one is the registry (:data:`REWARD_SOURCES`, :func:`build_reward_source`) and
imports a source only when it is built, so reading the flags does not load torch.

``meta`` is each prompt's ``Record.meta`` (JSON-able: APPS tests, the synthetic task's facts), carried from
the dataset through the tokenized cache and the prompt collator, so no scorer re-parses facts out of text.
``ended`` (keyword) says which answers stopped at an end token, for scorers that penalise cut answers.

A reward model scores token sequences: in step 3 it reads the generated sequences exactly as sampled
(:meth:`RewardModelSource.score_sequences`, chosen by :func:`score_samples`) rather than re-tokenizing text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from marlhf.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from marlhf.sampler import Samples

REWARD_SOURCES = ("reward_model", "gold", "program_tests", "python", "remote")
# The training rewards that need no reward model, and the name the held-out evaluation reports each under
# (``<name>_score``): the program tests' verdicts, and the user's own reward (function or server) as "reward".
OWN_EVALUATION_NAMES = {"program_tests": "program", "python": "reward", "remote": "reward"}

@runtime_checkable
class RewardSource(Protocol):
    def score(self, prompts: Sequence[str], responses: Sequence[str], meta: Sequence[dict], *,
              ended: Sequence[bool] | None = None) -> list[float]:
        """One score per response (``meta[i]`` belongs to ``prompts[i]``)."""
        ...


@runtime_checkable
class SequenceScorer(Protocol):
    """A reward source that can score token sequences directly (a reward model)."""

    def score_sequences(self, seq: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
        ...


def metas_for(meta: Sequence[dict] | None, n: int) -> list[dict]:
    """``meta`` as a list of ``n`` dicts (empty ones when the data carries none)."""
    if meta is None:
        return [{} for _ in range(n)]
    meta = list(meta)
    if len(meta) != n:
        raise ValueError(f"{n} samples but {len(meta)} meta entries")
    return meta


def score_samples(source, tokenizer, s: Samples, meta: Sequence[dict] | None = None) -> torch.Tensor:
    """(N,) float32 scores of sampled answers: a :class:`SequenceScorer` reads the generated sequences as they
    are; any other source gets the decoded prompts and answers, ``meta`` and the end flags."""
    import torch

    from marlhf.sampler import decode_samples

    if isinstance(source, SequenceScorer):
        return source.score_sequences(s.seq, s.attention_mask, s.prompt_width).float()
    prompts, responses = decode_samples(tokenizer, s)
    scores = source.score(prompts, responses, metas_for(meta, len(responses)), ended=s.ended.tolist())
    return torch.tensor(scores, dtype=torch.float32, device=s.seq.device)


def build_reward_source(name: str, *, reward_model=None, task=None, workers: int = 1, function: str = "",
                        url: str = "", timeout: float = 60.0, retries: int = 3, ensemble: Sequence = (),
                        ensemble_reduce: str = "mean_minus_std", ensemble_std_coef: float = 1.0):
    """The ``--reward_source`` of step 3: ``reward_model`` (the frozen reward engine; with ``ensemble``, more
    frozen reward models, the combination of all of them by ``ensemble_reduce``), ``gold`` (the gold scorer
    of ``task``, a :class:`marlhf.tasks.Task`: the embedded task has one), ``program_tests`` (the sandboxed unit
    tests in each record's meta), ``python`` (the ``function`` spec, imported now so a bad one fails before
    training) or ``remote`` (the server at ``url``, with ``timeout`` seconds per attempt and ``retries``
    retries)."""

    from marlhf.rewards.gold import gold_of
    from marlhf.rewards.reward_model import RewardEnsembleSource, RewardModelSource

    if name in ("reward_model", "rm"):
        if reward_model is None:
            raise ConfigError("--reward_source reward_model needs a reward model (--critic_model_name_or_path or "
                              "--reward_model_name_or_path)")
        if ensemble:
            return RewardEnsembleSource([RewardModelSource(m) for m in (reward_model, *ensemble)], ensemble_reduce,
                                        ensemble_std_coef)
        return RewardModelSource(reward_model)
    if ensemble:
        raise ConfigError(f"--reward_ensemble combines reward models: it needs --reward_source reward_model, "
                          f"not {name}")
    if name == "gold":
        gold = gold_of(task)
        if gold is None:
            raise ConfigError(f"--reward_source gold needs a task with a gold scorer (the synthetic task); the run's "
                              f"task is {task.name if task is not None else 'none'}")
        return gold
    if name == "program_tests":
        from marlhf.rewards.program_tests import ProgramTestReward

        return ProgramTestReward(workers=workers)
    if name == "python":
        from marlhf.rewards.python import PythonReward

        if not function:
            raise ConfigError("--reward_source python needs --reward_function FILE.py:NAME or package.module:NAME")
        return PythonReward(function)
    if name == "remote":
        from marlhf.rewards.remote import RemoteReward

        if not url:
            raise ConfigError("--reward_source remote needs --reward_url http(s)://HOST[:PORT]/PATH")
        return RemoteReward(url, timeout=timeout, retries=retries)
    raise ValueError(f"unknown reward source {name!r}; choose from {', '.join(REWARD_SOURCES)}")


def require_meta(items: list[dict], key: str, what: str) -> None:
    """Every prompt example carries ``meta[key]`` (e.g. the unit tests ``input_output``), else a clear error."""

    missing = sum(1 for it in items if not (it.get("meta") or {}).get(key))
    if missing:
        raise ConfigError(f"{what}: {missing} of {len(items)} prompts have no '{key}' in their record meta "
                          f"(an APPS-style dataset keeps each problem's tests there: codeparrot/apps or "
                          f"synthetic_code)")


def evaluation_sources(reward_source: str, reward, reward_model=None, task=None) -> dict:
    """What step 3's held-out evaluation reports (name -> source): the reward model's score when there is
    one, the gold score on the embedded task, and the training reward when it needs no reward model (the
    program tests as ``program``, the user's function or server as ``reward``: :data:`OWN_EVALUATION_NAMES`), and
    an ensemble's combined reward as ``ensemble`` (``rm`` stays the main reward model's, comparable across runs)."""
    from marlhf.rewards.gold import gold_of
    from marlhf.rewards.reward_model import RewardEnsembleSource, RewardModelSource

    sources = {"rm": RewardModelSource(reward_model)} if reward_model is not None else {}
    if isinstance(reward, RewardEnsembleSource):
        sources["ensemble"] = reward
    if (gold := gold_of(task)) is not None:
        sources["gold"] = gold
    if reward_source in OWN_EVALUATION_NAMES and reward is not None:
        sources[OWN_EVALUATION_NAMES[reward_source]] = reward
    return sources
