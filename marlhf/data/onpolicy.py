"""Preference pairs on a policy's own answers, labelled by a simulated annotator (``marlhf label``).

A reward model trained only on pairs whose flaws a generator drew does not hold on the answers step 3
explores: the policy's own mistakes.  summarize_from_feedback and InstructGPT collected preferences on policy
samples for that reason, and AlpacaFarm simulated its annotators on them.  This module does the same with any
reward source as the annotator (the embedded task's gold scorer, a step-2 reward model, a Python function, a
remote service):

    marlhf generate --model SFT --data_path D --split train --num_samples 2 --output answers.jsonl
    marlhf label --generations answers.jsonl --annotator gold --tau 0.1 --output pairs/

The K answers of a prompt give K // 2 disjoint pairs (answers 0-1, 2-3, ...; ``pairing="disjoint"``) or all
K(K−1)/2 of them (``pairing="all"``: InstructGPT's comparisons from a ranking of K answers — more pairs for
the same generation cost, pairs of one prompt sharing answers).  The annotator scores every answer once; a
pair (a, b) is labelled a ≻ b with the Bradley–Terry probability

    P(a ≻ b) = σ((g_a − g_b) / τ)                 (τ = 0: the higher score wins, a tie by a coin flip)

drawn from a generator seeded by (seed, prompt id, pair index), so the labels are the same for a seed
whatever order or batch size the rows are scored in.  Pairs of identical answers carry no preference and are
dropped (counted), as are pairs with an empty answer (no text to train on); so are pairs the annotator scores
equal with ``ties="drop"`` (an annotator's "about the
same", which labelled by a coin teaches the reward model noise).  The result is a folder of ``train.jsonl`` /
``test.jsonl`` (a seeded held-out share of the prompts) with ``prompt`` / ``chosen`` / ``rejected`` rows that
``--data_path`` reads as any local dataset, and ``label.json`` with the settings and counts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from marlhf.data.records import DataError
from marlhf.errors import ConfigError

log = logging.getLogger("marlhf")


def preference_probability(score_a: float, score_b: float, tau: float) -> float:
    """P(a ≻ b) of a Bradley–Terry annotator with temperature ``tau`` (0: deterministic, ties at 1/2)."""
    if tau < 0 or not math.isfinite(tau):
        raise ConfigError(f"--tau must be a finite number >= 0, got {tau}")
    diff = score_a - score_b
    if tau == 0:
        return 0.5 if diff == 0 else float(diff > 0)
    z = diff / tau
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def pair_rng(seed: int, prompt_id: str, pair: int) -> random.Random:
    """The generator of one pair's label: a function of (seed, prompt id, pair index) only."""
    digest = hashlib.sha256(f"{seed}\0{prompt_id}\0{pair}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


@dataclass(frozen=True)
class Answer:
    prompt_id: str
    sample: int
    prompt: str
    response: str
    ended: bool


def read_generations(path: str | Path) -> dict[str, list[Answer]]:
    """``marlhf generate``'s rows grouped by prompt id, each group ordered by sample index; a bad row is a
    DataError naming the file, row and field."""
    groups: dict[str, list[Answer]] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(str(path), n, "(line)", f"not JSON ({err.msg})") from None
            for field, kind in (("prompt_id", str), ("sample", int), ("prompt", str), ("response", str)):
                if not isinstance(row.get(field), kind):
                    raise DataError(str(path), n, field, f"missing or not a {kind.__name__}")
            groups.setdefault(row["prompt_id"], []).append(
                Answer(row["prompt_id"], row["sample"], row["prompt"], row["response"], bool(row.get("ended", True))))
    if not groups:
        raise ConfigError(f"{path}: no generations")
    for pid, answers in groups.items():
        answers.sort(key=lambda a: a.sample)
        if len({a.prompt for a in answers}) != 1:
            raise ConfigError(f"{path}: prompt id {pid!r} has answers to different prompts")
    return groups


def pool_generations(sources: Sequence[dict[str, list[Answer]]], max_samples: int = 0) -> dict[str, list[Answer]]:
    """Several policies' answers to the same prompts, pooled per prompt id: the first ``max_samples`` of each
    source's answers to a prompt (0: all), in source order, numbered 0, 1, ... across the pool — how an iterated
    round compares a new policy's answers with an earlier one's (Llama 2 sampled each comparison from two model
    versions).  A prompt id missing from a source pools what the others have; one whose prompt text differs
    between sources is an error."""
    if max_samples < 0:
        raise ConfigError(f"--max_samples must be >= 0, got {max_samples}")
    pooled: dict[str, list[Answer]] = {}
    for source in sources:
        for pid, answers in source.items():
            group = pooled.setdefault(pid, [])
            if group and group[0].prompt != answers[0].prompt:
                raise ConfigError(f"prompt id {pid!r} names different prompts in two --generations files")
            for a in answers[:max_samples or None]:
                group.append(Answer(pid, len(group), a.prompt, a.response, a.ended))
    return pooled


Scorer = Callable[[Sequence[str], Sequence[str], Sequence[bool]], Sequence[float]]


def answer_pairs(k: int, pairing: str) -> list[tuple[int, int]]:
    """Index pairs of a prompt's ``k`` answers: ``disjoint`` (0-1, 2-3, ...) or ``all`` (i < j), in a fixed order
    (a pair's position in it seeds its label)."""
    if pairing == "disjoint":
        return [(2 * i, 2 * i + 1) for i in range(k // 2)]
    if pairing == "all":
        return [(i, j) for i in range(k) for j in range(i + 1, k)]
    raise ConfigError(f"--pairing must be disjoint or all, got {pairing!r}")


def label_pairs(groups: dict[str, list[Answer]], scorer: Scorer, tau: float, seed: int, pairing: str = "disjoint",
                ties: str = "keep") -> tuple[list[dict], dict]:
    """Pairs ``{prompt, chosen, rejected, meta}`` labelled by ``scorer`` (prompts, responses, ended -> scores)
    with noise ``tau``, and counts: pairs, identical answers dropped, annotator ties (kept or dropped), labels
    against the annotator's order."""
    preference_probability(0.0, 0.0, tau)  # validates tau before any scoring
    answer_pairs(2, pairing)
    if ties not in ("keep", "drop"):
        raise ConfigError(f"--ties must be keep or drop, got {ties!r}")
    answers = [a for group in groups.values() for a in group]
    scores = [float(s) for s in scorer([a.prompt for a in answers], [a.response for a in answers],
                                       [a.ended for a in answers])]
    if len(scores) != len(answers) or not all(math.isfinite(s) for s in scores):
        raise ConfigError(f"the annotator returned {len(scores)} scores for {len(answers)} answers, or a "
                          f"non-finite one")
    score_of = {(a.prompt_id, a.sample): s for a, s in zip(answers, scores)}
    pairs, identical, empty, flipped, ties_seen = [], 0, 0, 0, 0
    for pid, group in groups.items():
        for k, (i, j) in enumerate(answer_pairs(len(group), pairing)):
            a, b = group[i], group[j]
            if a.response == b.response:
                identical += 1
                continue
            if not a.response.strip() or not b.response.strip():  # no text to train a reward model on
                empty += 1
                continue
            ga, gb = score_of[(pid, a.sample)], score_of[(pid, b.sample)]
            ties_seen += ga == gb
            if ga == gb and ties == "drop":
                continue
            p = preference_probability(ga, gb, tau)
            a_wins = pair_rng(seed, pid, k).random() < p
            chosen, rejected = (a, b) if a_wins else (b, a)
            g_chosen, g_rejected = (ga, gb) if a_wins else (gb, ga)
            flipped += g_chosen < g_rejected
            pairs.append({"prompt": a.prompt, "chosen": chosen.response, "rejected": rejected.response,
                          "meta": {"prompt_id": pid, "pair": k, "annotator_scores": [g_chosen, g_rejected],
                                   "p_chosen": p if a_wins else 1 - p}})
    counts = {"answers": len(answers), "pairs": len(pairs), "identical_dropped": identical, "empty_dropped": empty,
              "against_annotator_order": flipped, "annotator_ties": ties_seen,
              "ties_dropped": ties_seen if ties == "drop" else 0}
    return pairs, counts


def split_by_prompt(pairs: list[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, test): a seeded share ``eval_fraction`` of the prompts (with all their pairs) held out."""
    if not 0 <= eval_fraction < 1:
        raise ConfigError(f"--eval_fraction must be in [0, 1), got {eval_fraction}")
    ids = sorted({p["meta"]["prompt_id"] for p in pairs})
    random.Random(seed).shuffle(ids)
    held = set(ids[:round(len(ids) * eval_fraction)])
    return ([p for p in pairs if p["meta"]["prompt_id"] not in held],
            [p for p in pairs if p["meta"]["prompt_id"] in held])


def write_pairs(folder: str | Path, train: list[dict], test: list[dict], settings: dict) -> None:
    """``train.jsonl``, ``test.jsonl`` and ``label.json``, each written whole and then renamed into place."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        tmp = folder / f".{name}.tmp"
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(folder / name)
    tmp = folder / ".label.json.tmp"
    tmp.write_text(json.dumps(settings, indent=1) + "\n")
    tmp.replace(folder / "label.json")
