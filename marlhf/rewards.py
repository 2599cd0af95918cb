"""Reward sources: one interface, ``score(prompts, responses, meta) -> scores``, behind ``--reward_source``.

    reward_model   the step-2 reward model (step 3: the frozen reward engine)    :class:`RewardModelSource`
                   or several, combined conservatively (``--reward_ensemble``)   :class:`RewardEnsembleSource`
    gold           the embedded task's gold scorer (facts from ``meta``)         :class:`~.tasks.GoldScorer`
    program_tests  generated programs run against the problem's unit tests      :class:`~.ProgramTestReward`
                   in a sandbox (paper App. B.5; :mod:`marlhf.code.reward`)
    python         the user's function, ``--reward_function FILE.py:NAME``      :class:`~.PythonReward`
    remote         the user's HTTP server, ``--reward_url URL``                 :class:`~.RemoteReward`
                   (both :mod:`marlhf.external_rewards`)

``meta`` is each prompt's ``Record.meta`` (JSON-able: APPS tests, the synthetic task's facts), carried from
the dataset through the tokenized cache and the prompt collator, so no scorer re-parses facts out of text.
``ended`` (keyword) says which answers stopped at an end token, for scorers that penalise cut answers.

A reward model scores token sequences: in step 3 it reads the generated sequences exactly as sampled
(:meth:`RewardModelSource.score_sequences`, chosen by :func:`score_samples`) rather than re-tokenizing text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from marlhf.errors import ConfigError
from marlhf.eval.reward import score_texts
from marlhf.generation import Samples, decode_samples
from marlhf.models.forward import sequence_scores

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


class RewardModelSource:
    """Reward source ``reward_model``: a value model's head at the last real token of prompt + response.

    ``model``: a Hugging Face value model or a (frozen) DeepSpeed engine around one.  For text callers,
    ``tokenizer`` and the step-2 format (end token, prompt format, length) say how to tokenize."""

    def __init__(self, model, tokenizer=None, eot: str = "", prompt_format: str = "raw", max_seq_len: int = 1024,
                 batch_size: int = 16):
        self.model, self.tokenizer = model, tokenizer
        self.eot, self.prompt_format, self.max_seq_len, self.batch_size = eot, prompt_format, max_seq_len, batch_size

    @torch.no_grad()
    def score_sequences(self, seq: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
        """(B,) scores of already-tokenized sequences: left-padded prompts ``prompt_width`` wide, then answers."""

        return sequence_scores(self.model, seq, attention_mask, prompt_width)

    def score(self, prompts, responses, meta=None, *, ended=None) -> list[float]:
        """Scores of prompt + response + end token, tokenized as step 2 tokenizes them."""
        if self.tokenizer is None:
            raise ValueError("this reward model source scores token sequences only (built without a tokenizer)")

        return score_texts(self.model, self.tokenizer, prompts, responses, eot=self.eot,
                           prompt_format=self.prompt_format, max_seq_len=self.max_seq_len,
                           batch_size=self.batch_size)


ENSEMBLE_REDUCTIONS = ("mean_minus_std", "mean", "min")


def ensemble_reward(scores: torch.Tensor, reduce: str = "mean_minus_std", std_coef: float = 1.0) -> torch.Tensor:
    """(B,) reward of an ensemble from its members' (M, B) scores (Coste et al. 2023, "Reward model ensembles
    help mitigate overoptimization"): ``mean``; ``min`` (worst case); ``mean_minus_std``: the mean less
    ``std_coef`` times the members' standard deviation (over the M members, population form: one member has
    std 0), so an answer the members disagree on — where a proxy is least to be trusted — scores lower."""
    if scores.dim() != 2 or scores.shape[0] < 1:
        raise ValueError(f"ensemble scores must be (members, batch), got shape {tuple(scores.shape)}")
    if reduce == "mean":
        return scores.mean(0)
    if reduce == "min":
        return scores.min(0).values
    if reduce == "mean_minus_std":
        return scores.mean(0) - std_coef * scores.std(0, correction=0)
    raise ValueError(f"unknown ensemble reduction {reduce!r}; choose from {', '.join(ENSEMBLE_REDUCTIONS)}")


class RewardEnsembleSource:
    """Reward source ``reward_model`` with ``--reward_ensemble``: several reward models score each answer and
    :func:`ensemble_reward` combines their scores.  ``members``: :class:`RewardModelSource` objects (the main
    reward model first)."""

    def __init__(self, members: Sequence[RewardModelSource], reduce: str = "mean_minus_std", std_coef: float = 1.0):
        if len(members) < 2:
            raise ValueError(f"an ensemble needs at least 2 reward models, got {len(members)}")
        self.members, self.reduce, self.std_coef = list(members), reduce, std_coef

    @torch.no_grad()
    def score_sequences(self, seq: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
        scores = torch.stack([m.score_sequences(seq, attention_mask, prompt_width).float() for m in self.members])
        return ensemble_reward(scores, self.reduce, self.std_coef)

    def score(self, prompts, responses, meta=None, *, ended=None) -> list[float]:
        scores = torch.tensor([m.score(prompts, responses, meta, ended=ended) for m in self.members],
                              dtype=torch.float32)
        return ensemble_reward(scores, self.reduce, self.std_coef).tolist()


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
        gold = task.gold() if task is not None else None
        if gold is None:
            raise ConfigError(f"--reward_source gold needs a task with a gold scorer (the synthetic task); the run's "
                              f"task is {task.name if task is not None else 'none'}")
        return gold
    if name == "program_tests":
        from marlhf.code.reward import ProgramTestReward

        return ProgramTestReward(workers=workers)
    if name == "python":
        from marlhf.external_rewards import PythonReward

        if not function:
            raise ConfigError("--reward_source python needs --reward_function FILE.py:NAME or package.module:NAME")
        return PythonReward(function)
    if name == "remote":
        from marlhf.external_rewards import RemoteReward

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
    sources = {"rm": RewardModelSource(reward_model)} if reward_model is not None else {}
    if isinstance(reward, RewardEnsembleSource):
        sources["ensemble"] = reward
    if task is not None and (gold := task.gold()) is not None:
        sources["gold"] = gold
    if reward_source in OWN_EVALUATION_NAMES and reward is not None:
        sources[OWN_EVALUATION_NAMES[reward_source]] = reward
    return sources
