"""The gold scorer cannot be gamed: degenerate answers, generated per prompt over many prompts, stay below
the flawed-but-real reference summaries (issue 10).

Lines held here:
- an answer that states no key fact correctly scores <= -0.5, below every answer that gets a fact right;
- every kind of degenerate answer scores below the 5th percentile of the reference *rejected* answers on at
  least 95% of the prompts;
- between them the score is monotone in quality (fewer facts, more invented facts: strictly lower).
"""

from __future__ import annotations

import random
import re
import statistics

import pytest

from marlhf.embedded import task as embedded_task
from marlhf.embedded.task import (
    EXTRAS,
    FILLERS,
    FLOOR,
    GOLD_COMPONENTS,
    KEY_SLOTS,
    SyntheticConfig,
    generate,
    gold_score,
    oracle_summary,
    score_details,
)

NUM_PROMPTS = 300


@pytest.fixture(scope="module")
def reference():
    """The records the quick start trains on (default seed, label noise included) and their rejected p5."""
    records = generate(SyntheticConfig(num_records=2000))
    rejected = sorted(gold_score(r.prompt, r.rejected) for r in records)
    p5 = rejected[len(rejected) // 20]
    return records[:NUM_PROMPTS], p5


def _post_sentences(prompt: str) -> list[str]:
    body = prompt.split("\nPOST: ", 1)[1].rsplit("\nTL;DR:", 1)[0]
    return re.split(r"(?<=[.!?])\s+", body)


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", text.strip())


def _cut_mid_sentence(text: str, rng: random.Random) -> str:
    """The answer cut after a word that does not end a sentence, keeping 30-90% of its words."""
    words = text.split(" ")
    cuts = [k for k in range(int(0.3 * len(words)), int(0.9 * len(words)) + 1) if not words[k - 1].endswith((".", "?"))]
    return " ".join(words[: rng.choice(cuts)]).rstrip(",")


def degenerate_answers(prompt: str, other_prompt: str, rng: random.Random) -> dict[str, tuple[str, bool | None]]:
    """Kind -> (answer, ended) of every degenerate answer the issue lists, built for this prompt."""
    best = oracle_summary(prompt)
    post = _post_sentences(prompt)
    post_words = " ".join(post).split()
    sents = _sentences(best)
    return {
        "empty": ("", True),
        "few_words": (" " + " ".join(best.split()[: rng.randint(1, 4)]), True),
        "gibberish": (" " + " ".join(rng.choice(post_words) for _ in range(40)), True),
        "gibberish_no_end": (" " + " ".join(rng.choice(post_words) for _ in range(40)), False),
        "no_end_token": (best, False),  # the flawless summary, but generation ran into the length limit
        "cut_mid_sentence": (_cut_mid_sentence(best, rng), True),
        "cut_no_end_token": (_cut_mid_sentence(best, rng), False),
        "copy_of_post": (" " + " ".join(post), True),
        "near_copy_of_post": (" " + " ".join(s for s in post if s not in FILLERS), True),
        "repeated_twice": (best + best, True),
        "last_sentence_thrice": (best + (" " + sents[-1]) * 2, True),
        "one_sentence_repeated": (" " + " ".join(sents[:2] + sents[1:]), True),
        # fluent, but about another post: every fact invented (a coincidence may leave one right)
        "invented_facts": (oracle_summary(other_prompt), True),
        "far_over_length": (best + " " + " ".join(EXTRAS) + " " + " ".join(FILLERS[:4]), True),
    }


def test_components_are_reported_next_to_the_total(reference):
    records, _ = reference
    d = score_details(records[0].prompt, records[0].chosen, ended=True)
    assert set(GOLD_COMPONENTS) | {"total"} <= d.keys()
    best = score_details(records[0].prompt, oracle_summary(records[0].prompt), ended=True)
    assert best["total"] == pytest.approx(1.0)
    assert (best["coverage"], best["order"]) == (1.0, 1.0)
    assert all(best[k] == 0 for k in ("invented", "repeated", "length", "unfinished"))


def test_no_fact_right_is_the_bottom_of_the_scale(reference):
    records, _ = reference
    rng = random.Random(0)
    no_fact, some_fact = [], []
    for i, r in enumerate(records):
        answers = degenerate_answers(r.prompt, records[(i + 1) % len(records)].prompt, rng)
        answers["chosen"] = (r.chosen, True)
        answers["rejected"] = (r.rejected, True)
        for answer, ended in answers.values():
            d = score_details(r.prompt, answer, ended)
            (some_fact if d["coverage"] > 0 else no_fact).append(d["total"])
    assert len(no_fact) > NUM_PROMPTS  # empty answers alone give one per prompt
    assert max(no_fact) <= FLOOR
    assert min(some_fact) > FLOOR


def test_every_degenerate_kind_is_below_the_rejected_p5(reference):
    records, p5 = reference
    assert 0.0 < p5 < 0.5  # the flawed reference summaries sit well above the floor
    rng = random.Random(1)
    below: dict[str, list[bool]] = {}
    worst: dict[str, float] = {}
    for i, r in enumerate(records):
        for kind, (answer, ended) in degenerate_answers(r.prompt, records[(i + 1) % len(records)].prompt, rng).items():
            s = gold_score(r.prompt, answer, ended)
            below.setdefault(kind, []).append(s < p5)
            worst[kind] = max(worst.get(kind, -1.0), s)
    rates = {kind: sum(v) / len(v) for kind, v in below.items()}
    assert len(rates) == 14
    assert all(rate >= 0.95 for rate in rates.values()), (rates, worst, p5)


def _plan_summary(prompt_facts, keep, rng, invent=0):
    plan = embedded_task._base_plan(prompt_facts, rng)
    plan.keep = set(keep)
    for _ in range(invent):
        embedded_task._invent(plan, rng)
    return embedded_task._render(plan)


def test_monotone_in_quality_between_floor_and_flawless():
    """Dropping key facts one by one, or inventing more of them, lowers the score strictly every time."""
    rng = random.Random(2)
    for index in range(100):
        r_rng = embedded_task._record_rng(99, index)
        facts = embedded_task._sample_facts(r_rng)
        prompt = embedded_task._post(facts, r_rng, 0.5)
        keep = list(KEY_SLOTS)
        order = rng.sample(keep, len(keep))
        scores = []
        for k in range(len(keep) + 1):
            scores.append(gold_score(prompt, _plan_summary(facts, set(keep) - set(order[:k]), random.Random(k)), True))
        assert scores[0] == pytest.approx(1.0)
        assert all(a > b for a, b in zip(scores, scores[1:])), scores
        assert scores[-2] > FLOOR >= scores[-1]
        # invented facts: 0 > 1 > 2 (an invented detail replaces a fact or adds a sentence)
        base = _plan_summary(facts, KEY_SLOTS, random.Random(7))
        one = _plan_summary(facts, KEY_SLOTS, random.Random(7), invent=1)
        assert gold_score(prompt, base) > gold_score(prompt, one)


def test_reference_pairs_rank_by_flaws(reference):
    """The quick start's data: chosen above rejected on average, flawed summaries between floor and 1."""
    records, p5 = reference
    chosen = [gold_score(r.prompt, r.chosen) for r in records]
    rejected = [gold_score(r.prompt, r.rejected) for r in records]
    assert statistics.fmean(chosen) > statistics.fmean(rejected) + 0.15
    assert min(chosen + rejected) > FLOOR and max(chosen + rejected) <= 1.0 + 1e-9
