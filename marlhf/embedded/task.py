"""The embedded task: a miniature of TL;DR summarisation with a gold scorer (docs/design.md, "The embedded task").

A prompt is a short Reddit-style post ("SUBREDDIT: ...\\nPOST: ...\\nTL;DR:") that states seven key facts
drawn from closed, seeded vocabularies — the poster's age/gender tag, the other person (relation + tag),
the place, the pet, its problem, what was tried and the question asked — plus distractors (pet name,
duration, filler sentences) in varied phrasing and order.  A response is a summary starting with a space.

Because every fact is a phrase from a closed vocabulary, :func:`gold_score` recovers the facts from the
prompt *text alone* and can score any generation: credit for each key fact covered and for keeping the
post's order, scaled down by every flaw — invented facts, repetition, an unfinished last sentence or a
missing end token, length over a budget, copying the post.  An answer with no key fact right sits at the
bottom of the scale (<= -0.5), so no degenerate answer is a reward optimum (issue 10).  Every part of the
response counts, so a mistake late in a generation costs reward — the property that makes credit
assignment over long responses (the paper's motivation, §1) matter.

Preference pairs (:func:`generate`) are a candidate summary (0-2 flaws: dropped, swapped or invented
facts, sentences out of order) and a copy of it with 1-2 more flaws, the higher gold score chosen, with the
label flipped with probability ``label_noise``.  Most chosen candidates carry a flaw, so the SFT "chosen"
responses are good but not the best possible and RL has room to improve (a flawless summary scores 1.0).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from marlhf.data.records import DataError, Record, require_text

# Bump when generated text or scoring changes, so cached embedded builds are not silently reused.
TASK_VERSION = 2

# ---------------------------------------------------------------------------------------------------------
# Vocabularies.  Invariant (tested): no item occurs inside another item or inside any template text, so a
# whole-word match of an item is unambiguous evidence that the fact is mentioned.
# ---------------------------------------------------------------------------------------------------------
# Vocabularies are kept small (8-12 items a slot) so that a few-million-parameter model learns to copy
# every item within the quick start's budget (issue 10: a fluent SFT policy on 2 CPU cores).
RELATIONS: dict[str, str | None] = {  # relation -> fixed gender (None: either)
    "roommate": None,
    "boyfriend": "M",
    "girlfriend": "F",
    "sister": "F",
    "brother": "M",
    "mom": "F",
    "dad": "M",
    "neighbor": None,
    "coworker": None,
    "best friend": None,
}
PLACES = ["apartment", "dorm room", "house", "studio", "condo", "trailer", "loft", "cabin"]
PETS = ["cat", "dog", "puppy", "parrot", "hamster", "rabbit", "ferret", "turtle", "guinea pig", "goat"]
PROBLEMS = [  # third person singular verb phrases: "the cat <problem>"
    "scratches the couch",
    "barks all night",
    "chews my shoes",
    "bites my ankles",
    "steals food from the counter",
    "knocks cups off the table",
    "hides under the bed",
    "wakes me up at dawn",
    "eats my plants",
    "sheds on everything",
    "smells terrible",
    "pees on the carpet",
]
TRIED = [  # noun phrases with their article; the article is not part of the matched key
    "a spray bottle",
    "a new scratching post",
    "a professional trainer",
    "calming treats",
    "a bigger cage",
    "a vet visit",
    "a baby gate",
    "more exercise",
    "earplugs",
    "a pheromone diffuser",
    "a bark collar",
    "aluminium foil",
]
QUESTIONS = [  # verb phrases after "Should I ..."
    "move out",
    "report it to the building manager",
    "give an ultimatum",
    "split the cost of repairs",
    "ask for the money back",
    "find it a new home",
    "set some ground rules",
    "just let it go",
    "end the lease early",
    "apologize first",
]
PET_NAMES = [
    "Mochi",
    "Biscuit",
    "Luna",
    "Pepper",
    "Oreo",
    "Ziggy",
    "Noodle",
    "Pickles",
    "Waffles",
    "Nugget",
    "Pumpkin",
    "Olive",
    "Gizmo",
    "Peanut",
    "Sushi",
    "Kiwi",
    "Rocky",
    "Daisy",
    "Bruno",
    "Cleo",
    "Tofu",
    "Marble",
    "Clover",
    "Juniper",
]
DURATIONS = [
    "two weeks",
    "three weeks",
    "a month",
    "two months",
    "three months",
    "six months",
    "a year",
    "two years",
    "four months",
    "ten days",
]
SUBREDDITS = ["r/pets", "r/Advice", "r/relationship_advice", "r/roommates", "r/AskPets", "r/offmychest"]

FILLERS = [  # post-only sentences without facts
    "Sorry for the formatting, I am on mobile.",
    "English is not my first language.",
    "Some background first.",
    "I love animals, so this is hard for me.",
    "Everyone I asked has a different opinion.",
    "Edit: thanks for all the replies so far.",
    "I feel like I am going crazy.",
    "We used to get along really well.",
    "Long time lurker, first post.",
    "This might sound petty, but hear me out.",
    "I honestly do not know what else to do.",
    "Money is tight for both of us right now.",
]
EXTRAS = [  # summary-only sentences without key facts (used to make over-long candidates)
    "I love animals, so this is hard.",
    "Any advice is welcome.",
    "I feel stuck.",
    "We used to get along well.",
    "Money is tight right now.",
    "I do not want things to get awkward.",
    "It has been really stressful.",
    "I am out of ideas.",
]

KEY_SLOTS = ("narrator", "who", "place", "pet", "problem", "tried", "question")
# Closed vocabularies whose items are "facts": mentioning one the post does not contain is invention.
VOCAB_SLOTS: dict[str, list[str]] = {
    "who": list(RELATIONS),
    "place": PLACES,
    "pet": PETS,
    "problem": PROBLEMS,
    "tried": TRIED,
    "question": QUESTIONS,
    "name": PET_NAMES,
    "duration": DURATIONS,
}

# Gold score (DESIGN.md "The embedded task").  Content earns the credit; flaws *scale it down*:
#
#     content = COVERAGE_WEIGHT * covered + ORDER_WEIGHT * concordant * covered      (covered in [0, 1])
#     total   = FLOOR + (1 - FLOOR) * content * factor       if any key fact is right  -> (FLOOR, 1]
#     total   = FLOOR - (1 + FLOOR) * (1 - factor)           otherwise                 -> [-1, FLOOR]
#
# where ``factor`` in (0, 1] multiplies one factor per flaw.  Because every factor is positive, an answer
# with a fact right always outscores one without (issue 10: a degenerate answer must never be a reward
# optimum), and because flaws multiply rather than add, a degenerate answer (cut mid-sentence, no end
# token, copied from the post, repeated, far too long) loses most of its content credit however many facts
# it mentions.  Content flaws of real summaries (a dropped, swapped or invented fact) cost much less.
COVERAGE_WEIGHT = 0.85  # split evenly over the key facts the post contains
ORDER_WEIGHT = 0.15  # times the fraction of concordant fact pairs, times the covered fraction
FLOOR = -0.5  # the score of an answer covering no key fact (before its own flaws push it lower)
INVENTED_FACTOR = 0.75  # per distinct invented fact (vocabulary item / age tag absent from the post)
REPEATED_FACTOR = 0.8  # per extra mention of a key fact and per word 4-gram said before in the answer
REPEATED_SENTENCE_FACTOR = 0.3  # per sentence that repeats an earlier one word for word
LENGTH_BUDGET_WORDS = 45  # a flawless summary needs 22-38 words
OVER_LENGTH_SCALE = 10.0  # factor exp(-words over budget / scale)
UNFINISHED_FACTOR = 0.25  # last sentence without . ! ?; again when the answer has no end token
COPY_NGRAM = 8  # copied = share of the answer's words inside a word 8-gram that also occurs in the post
COPY_ALLOWANCE = 0.3  # summaries reuse some of the post's phrases (<= 0.31 measured); beyond, a copy
COPY_SCALE = 12.0  # factor exp(-scale * (copied - allowance)) above the allowance
END_OF_CONVERSATION = "<|endoftext|>"  # text from this marker on is not part of the response
# Names of the components :func:`score_details` reports next to the total (means in evaluations).
GOLD_COMPONENTS = ("coverage", "order", "invented", "repeated", "length", "unfinished", "copied")


@dataclasses.dataclass
class SyntheticConfig:
    """Knobs of the embedded task.  Records are a pure function of these values."""

    seed: int = 1234
    """Seed of every random choice; record i only depends on (seed, i), so a shorter run is a prefix."""
    num_records: int = 4000
    """Number of preference pairs."""
    label_noise: float = 0.1
    """Probability that a pair's label is flipped (chosen has the *lower* gold score)."""
    flaw_weights: tuple[float, ...] = (0.3, 0.5, 0.2)
    """Probability of the *chosen-side* candidate carrying 0, 1, 2 ... flaws (dropped / swapped / invented
    fact, sentences out of order).  Few flawless candidates keep SFT "chosen" below the optimum."""
    extra_flaw_weights: tuple[float, ...] = (0.0, 0.6, 0.4)
    """Probability of the *other* candidate carrying 0, 1, 2 ... flaws on top of the first one's: the pair
    differs only in those flaws, so the preference says exactly what makes a summary worse."""
    filler_prob: float = 0.5
    """Probability of each of up to two filler sentences in a post (distractors without facts)."""
    max_tie_resamples: int = 20
    """Rejected candidates are redrawn while their gold score ties the chosen one (a tie has no label)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_noise <= 0.5:
            raise ValueError(f"label_noise must be in [0, 0.5], got {self.label_noise}")
        if self.num_records < 1:
            raise ValueError(f"num_records must be >= 1, got {self.num_records}")
        for name in ("flaw_weights", "extra_flaw_weights"):
            weights = getattr(self, name)
            if not weights or min(weights) < 0 or sum(weights) <= 0:
                raise ValueError(f"{name} must be non-negative with a positive sum, got {weights}")


# ---------------------------------------------------------------------------------------------------------
# Post and summary construction
# ---------------------------------------------------------------------------------------------------------
def _a(noun: str) -> str:
    """Indefinite article for a phrase ("an apartment", "a house")."""
    return ("an " if noun[0].lower() in "aeiou" else "a ") + noun


def _key(item: str) -> str:
    """The matched part of a vocabulary item: noun phrases drop their leading article."""
    for art in ("a ", "an "):
        if item.startswith(art):
            return item[len(art) :]
    return item


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _pron(tag: str) -> str:
    return "He" if tag.endswith("M") else "She"


@dataclasses.dataclass
class _Facts:
    narrator: str  # age/gender tag, e.g. "24F"
    rel: str
    other: str  # the other person's tag
    place: str
    pet: str
    problem: str
    tried: str
    question: str
    name: str
    duration: str
    intro_order: str  # "NPW" (narrator, place, who), "WNP", "NWP"


def _sample_facts(rng: random.Random) -> _Facts:
    rel = rng.choice(list(RELATIONS))
    other_gender = RELATIONS[rel] or rng.choice("FM")
    narrator_age = rng.randint(18, 45)
    other_age = rng.randint(18, 60)
    while other_age == narrator_age:  # distinct tags, so a swapped tag is detectable
        other_age = rng.randint(18, 60)
    return _Facts(
        narrator=f"{narrator_age}{rng.choice('FM')}",
        rel=rel,
        other=f"{other_age}{other_gender}",
        place=rng.choice(PLACES),
        pet=rng.choice(PETS),
        problem=rng.choice(PROBLEMS),
        tried=rng.choice(TRIED),
        question=rng.choice(QUESTIONS),
        name=rng.choice(PET_NAMES),
        duration=rng.choice(DURATIONS),
        intro_order=rng.choice(["NPW", "NPW", "WNP", "NWP"]),
    )


def _post(f: _Facts, rng: random.Random, filler_prob: float) -> str:
    n, w, place, d = f"I ({f.narrator})", f"my {f.rel} ({f.other})", _a(f.place), f.duration
    intro = rng.choice(
        {
            "NPW": [
                f"{n} live in {place} with {w}.",
                f"{n} have been renting {place} with {w} for {d}.",
                f"So {n} moved into {place} with {w} {d} ago.",
            ],
            "WNP": [f"{_cap(w)} and {n} share {place}.", f"{_cap(w)} and {n} have lived in {place} for {d}."],
            "NWP": [f"{n} and {w} rent {place} together.", f"{n} and {w} split {place} near campus."],
        }[f.intro_order]
    )
    p = _pron(f.other)
    pet = rng.choice(
        [
            f"{p} adopted {_a(f.pet)} named {f.name} a while ago.",
            f"Recently {p.lower()} brought home {_a(f.pet)} called {f.name}.",
            f"A few weeks later {p.lower()} got {_a(f.pet)} ({f.name}) without asking me.",
            f"{p} decided to get {_a(f.pet)} and named it {f.name}.",
        ]
    )
    problem = rng.choice(
        [
            f"The problem is that the {f.pet} {f.problem}.",
            f"Every single day the {f.pet} {f.problem}.",
            f"Now the {f.pet} {f.problem} and it is driving me crazy.",
            f"Lately {f.name} {f.problem}.",
        ]
    )
    tried = rng.choice(
        [
            f"We tried {f.tried}, but nothing changed.",
            f"I already suggested {f.tried} and it did not help.",
            f"{_cap(f.tried)} made no difference at all.",
            f"We have tried {f.tried} with no luck.",
        ]
    )
    question = rng.choice(
        [
            f"Should I {f.question}?",
            f"Would it be unreasonable to {f.question}?",
            f"Do you think I should {f.question}?",
            f"Part of me wants to {f.question}. What should I do?",
        ]
    )
    sentences = [intro, pet, problem, tried, question]
    for _ in range(2):  # distractors: filler sentences anywhere before the question
        if rng.random() < filler_prob:
            sentences.insert(rng.randint(0, len(sentences) - 1), rng.choice(FILLERS))
    subreddit = rng.choice(SUBREDDITS)
    return f"SUBREDDIT: {subreddit}\nPOST: {' '.join(sentences)}\nTL;DR:"


@dataclasses.dataclass
class _Plan:
    """What a candidate summary says; flaws edit the plan before it is rendered."""

    facts: _Facts
    keep: set[str]  # key slots mentioned
    style: list[int]  # template choice per sentence
    order: list[int]  # permutation of the body sentences (pet/problem, tried, question)
    extras: list[str] = dataclasses.field(default_factory=list)  # appended sentences (invented details)
    flaws: list[str] = dataclasses.field(default_factory=list)  # flaws drawn, in order ("drop:narrator", ...)


def _render(plan: _Plan) -> str:
    f, keep, s = plan.facts, plan.keep, plan.style
    n = f"I ({f.narrator})" if "narrator" in keep else "I"
    w = f"my {f.rel} ({f.other})" if "who" in keep else None
    if "place" in keep:
        place = _a(f.place)
        # worded unlike the post's intros (the scorer counts runs of 8+ words from the post as copying)
        intros = {
            "NPW": [f"{n} share {place}" + (f" with {w}." if w else " with someone.")],
            "WNP": [f"{_cap(w)} and {n} live in {place}." if w else f"{n} live in {place}."],
            "NWP": [f"{n} and {w} live in {place}." if w else f"{n} live in {place}."],
        }
    else:
        intros = {
            "NPW": [f"{n} live with {w}." if w else f"{n} need advice."],
            "WNP": [f"{_cap(w)} and {n} live together." if w else f"{n} need advice."],
            "NWP": [f"{n} and {w} live together." if w else f"{n} need advice."],
        }
    options = intros[f.intro_order]
    intro = options[s[0] % len(options)]
    p = _pron(f.other)
    if "pet" in keep and "problem" in keep:
        pet = [
            f"{p} adopted {_a(f.pet)} that {f.problem}.",
            f"{p} got {_a(f.pet)}, and it {f.problem}.",
            f"{p} got {_a(f.pet)}. It {f.problem}.",
        ][s[1] % 3]
    elif "pet" in keep:
        pet = f"{p} got {_a(f.pet)}."
    elif "problem" in keep:
        pet = f"{p} got a new pet that {f.problem}."
    else:
        pet = ""
    tried = (
        [
            f"We tried {f.tried}, but it did not help.",
            f"{_cap(f.tried)} did not help.",
            f"Tried {f.tried} already, no luck.",
        ][s[2] % 3]
        if "tried" in keep
        else ""
    )
    question = (
        [f"Should I {f.question}?", f"Wondering if I should {f.question}.", f"Is it time to {f.question}?"][
            s[3] % 3
        ]
        if "question" in keep
        else ""
    )
    body = [pet, tried, question]
    sentences = [intro] + [body[i] for i in plan.order]
    sentences = [x for x in sentences if x] + plan.extras
    return " " + " ".join(sentences)


# Flaws of real (if imperfect) summaries.  Degenerate answers — cut, repeated, copied, far too long — are
# not among them: the gold scorer puts those below the flawed summaries (tests/test_gold_adversarial.py).
_FLAWS = ("drop", "drop", "invent", "swap_tags", "swap_order")


def _base_plan(f: _Facts, rng: random.Random) -> _Plan:
    return _Plan(
        facts=dataclasses.replace(f),
        keep=set(KEY_SLOTS),
        style=[rng.randrange(6) for _ in range(4)],
        order=[0, 1, 2],
    )


def _add_flaws(plan: _Plan, rng: random.Random, weights: Sequence[float]) -> _Plan:
    """A copy of ``plan`` with k flaws applied (k drawn from ``weights``)."""
    plan = dataclasses.replace(
        plan, facts=dataclasses.replace(plan.facts), keep=set(plan.keep), order=list(plan.order),
        extras=list(plan.extras), flaws=list(plan.flaws),
    )
    num_flaws = rng.choices(range(len(weights)), weights=weights)[0]
    for flaw in rng.choices(_FLAWS, k=num_flaws):
        if flaw == "drop":
            # The narrator tag and the question are the facts most often left out by real summaries.
            slot = rng.choice(["narrator", "narrator", "question", "tried", "place", "who", "pet", "problem"])
            plan.keep.discard(slot)
            flaw = f"drop:{slot}"
        elif flaw == "invent":
            flaw = f"invent:{_invent(plan, rng)}"
        elif flaw == "swap_tags":
            plan.facts.narrator, plan.facts.other = plan.facts.other, plan.facts.narrator
        elif flaw == "swap_order":
            i = rng.randrange(2)
            plan.order[i], plan.order[i + 1] = plan.order[i + 1], plan.order[i]
        else:  # pragma: no cover - the tuple above is the whole list
            raise AssertionError(flaw)
        plan.flaws.append(flaw)
    return plan


def _invent(plan: _Plan, rng: random.Random) -> str:
    """Replace a fact by one the post does not contain, or add an invented detail; returns which ("pet",
    "age", "name": a sentence naming the pet wrongly, ...)."""
    f = plan.facts
    kind = rng.choice(["pet", "place", "tried", "problem", "question", "name", "age"])
    if kind == "name":
        plan.extras.append(f"{_pron(f.other)} named it {rng.choice([x for x in PET_NAMES if x != f.name])}.")
    elif kind == "age":
        age, gender = int(f.narrator[:-1]), f.narrator[-1]
        taken = {f.narrator, f.other}
        f.narrator = next(t for d in (1, -1, 2, -2, 3) if (t := f"{age + d}{gender}") not in taken)
    else:
        pool = {"pet": PETS, "place": PLACES, "tried": TRIED, "problem": PROBLEMS, "question": QUESTIONS}[
            kind
        ]
        setattr(f, kind, rng.choice([x for x in pool if x != getattr(f, kind)]))
    return kind


def _record_rng(seed: int, index: int) -> random.Random:
    # String seeds are hashed with SHA-512 by `random`: stable across runs, platforms and Python versions.
    return random.Random(f"marlhf-synthetic-v{TASK_VERSION}:{seed}:{index}")


def generate(cfg: SyntheticConfig | None = None) -> list[Record]:
    """Preference pairs of the embedded task, deterministic in ``cfg`` (record i depends on seed, i only).

    A pair is one candidate summary and a copy of it with 1-2 more flaws (same wording otherwise), the
    higher gold score chosen, the label then flipped with probability ``label_noise``.  ``meta["flaws"]``
    lists the flaws each side was drawn with (:func:`extra_flaws` names what sets the pair apart).
    """
    cfg = cfg or SyntheticConfig()
    records = []
    for i in range(cfg.num_records):
        rng = _record_rng(cfg.seed, i)
        facts = _sample_facts(rng)
        prompt = _post(facts, rng, cfg.filler_prob)
        plan = _add_flaws(_base_plan(facts, rng), rng, cfg.flaw_weights)
        a = _render(plan)
        score_a = gold_score(prompt, a)
        for _ in range(cfg.max_tie_resamples):
            other = _add_flaws(plan, rng, cfg.extra_flaw_weights)
            b = _render(other)
            score_b = gold_score(prompt, b)
            if abs(score_a - score_b) > 1e-9:
                break
        else:
            raise RuntimeError(f"record {i}: no non-tied candidate pair in {cfg.max_tie_resamples} draws")
        sides = [(a, plan.flaws), (b, other.flaws)]
        if score_a < score_b:
            sides.reverse()
        if rng.random() < cfg.label_noise:
            sides.reverse()
        (chosen, chosen_flaws), (rejected, rejected_flaws) = sides
        # The flaws each side was drawn with: the copy's are the candidate's plus the 1-2 extra ones the pair
        # is about (an extra flaw can also undo one: a swap back, an invented fact dropped; ~6% of pairs).
        meta = {"facts": facts_meta(parse_post(prompt)), "flaws": {"chosen": chosen_flaws, "rejected": rejected_flaws}}
        records.append(Record(prompt=prompt, chosen=chosen, rejected=rejected, source=f"synthetic:{i}", meta=meta))
    return records


# ---------------------------------------------------------------------------------------------------------
# Gold scorer
# ---------------------------------------------------------------------------------------------------------
# All vocabulary keys (lower case) -> their slot; the hygiene invariant makes every key belong to one slot.
_ITEM_SLOT: dict[str, str] = {_key(x).lower(): slot for slot, items in VOCAB_SLOTS.items() for x in items}
# One alternation over every key, longest first, matched on lower-cased text (one pass per text).
_ITEMS = re.compile(
    r"\b(" + "|".join(re.escape(k) for k in sorted(_ITEM_SLOT, key=len, reverse=True)) + r")\b"
)
_TAG = r"\(\s*(\d{1,3})\s*([fm])\s*\)"  # "(24F)" on lower-cased text
_TAG_PATTERN = re.compile(_TAG)
_TAG_AFTER = re.compile(r"\s*" + _TAG)
_NARRATOR_PATTERN = re.compile(r"\bi\s*" + _TAG)


def _tag(m: re.Match | None) -> str | None:
    return None if m is None else f"{int(m.group(1))}{m.group(2).upper()}"


def _scan(text: str) -> list[tuple[int, str, str]]:
    """(position, slot, key) of every vocabulary item in ``text`` (lower case), in order.

    A relation's key carries the age/gender tag that directly follows it, e.g. "roommate (26M)".
    """
    out = []
    for m in _ITEMS.finditer(text):
        key, slot = m.group(1), _ITEM_SLOT[m.group(1)]
        if slot == "who":
            key = f"{key} ({_tag(_TAG_AFTER.match(text, m.end()))})"
        out.append((m.start(), slot, key))
    return out


@dataclasses.dataclass(frozen=True)
class PostFacts:
    """Facts recovered from a prompt's text.

    ``key``: (slot, value) of the first mention of each key slot, in post order; values are lower-case
    vocabulary keys, "roommate (26M)" for the other person and "24F" for the narrator's tag.
    """

    key: tuple[tuple[str, str], ...]
    items: frozenset[tuple[str, str]]  # every (slot, key) the post mentions, distractors included
    tags: frozenset[str]  # every age/gender tag in the post

    @classmethod
    def from_meta(cls, facts: dict) -> PostFacts:
        """Inverse of :func:`facts_meta` (a record's ``meta["facts"]``)."""
        return cls(key=tuple((slot, value) for slot, value in facts["key"]),
                   items=frozenset((slot, key) for slot, key in facts["items"]), tags=frozenset(facts["tags"]))


def facts_meta(facts: PostFacts) -> dict:
    """The post's facts as JSON-able data for ``Record.meta["facts"]`` (lists, items and tags sorted), so
    the gold scorer reads what the generator wrote the post from instead of parsing (possibly truncated or
    re-decoded) prompt text."""
    return {"key": [list(kv) for kv in facts.key], "items": sorted(list(kv) for kv in facts.items),
            "tags": sorted(facts.tags)}


@functools.lru_cache(maxsize=4096)
def parse_post(prompt: str) -> PostFacts:
    """Recover the key facts from the prompt text (first mention of each slot, in order of appearance)."""
    text = prompt.lower()
    found: dict[str, tuple[int, str]] = {}
    m = _NARRATOR_PATTERN.search(text)
    if m:
        found["narrator"] = (m.start(), _tag(m))
    scanned = _scan(text)
    for pos, slot, key in scanned:
        if slot in KEY_SLOTS and slot not in found and not key.endswith("(None)"):
            found[slot] = (pos, key)
    key_facts = tuple((slot, value) for slot, (_, value) in sorted(found.items(), key=lambda kv: kv[1][0]))
    items = frozenset((slot, key.split(" (")[0]) for _, slot, key in scanned)
    tags = frozenset(_tag(m) for m in _TAG_PATTERN.finditer(text))
    return PostFacts(key=key_facts, items=items, tags=tags)


_WORD = re.compile(r"[\w']+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _sentence_words(text: str) -> list[list[str]]:
    """Words of each sentence of (lower-case) ``text``."""
    return [w for s in _SENTENCE_END.split(text.strip()) if (w := _WORD.findall(s))]


def _copied_share(post: list[list[str]], answer: list[list[str]], n: int = COPY_NGRAM) -> float:
    """Share of the answer's words inside a run of ``n`` words (within one sentence) found in the post."""
    post_grams = {tuple(s[i : i + n]) for s in post for i in range(len(s) - n + 1)}
    inside = total = 0
    for s in answer:
        covered = [False] * len(s)
        for i in range(len(s) - n + 1):
            if tuple(s[i : i + n]) in post_grams:
                covered[i : i + n] = [True] * n
        inside, total = inside + sum(covered), total + len(s)
    return inside / total if total else 0.0


def score_details(prompt: str, response: str, ended: bool | None = None,
                  facts: PostFacts | None = None) -> dict[str, float]:
    """The gold score and its components (module comment above "Gold score").

    ``ended``: whether the generation stopped at an end token (False: it ran into the length limit);
    None when unknown, e.g. for reference text.  ``facts``: the post's facts as the generator recorded them
    (``Record.meta["facts"]``); None parses them from ``prompt``.  Components, as reported next to the total:

    - ``coverage``: share of the post's key facts stated correctly (a relation with a wrong tag: half);
    - ``order``: share of concordant pairs among the covered facts (1.0 with fewer than two);
    - ``invented``: facts (vocabulary items, age tags) the post does not contain;
    - ``repeated``: extra mentions of a key fact, repeated word 4-grams and repeated sentences;
    - ``length``: words beyond the budget;
    - ``unfinished``: 1 if the last sentence is cut (no . ! ?), +1 if the answer has no end token;
    - ``copied``: share of the answer's words copied from the post in runs of 8+ words of one sentence.
    """
    post = facts if facts is not None else parse_post(prompt)
    if not post.key:
        raise ValueError(f"prompt has no facts of the embedded task, cannot gold-score it: {prompt[:80]!r}")
    response = response.split(END_OF_CONVERSATION)[0]
    text = response.lower()
    scanned = _scan(text)
    # Mentions per key fact: (position, credit).  A relation with a missing or wrong tag earns half.
    mentions: dict[str, list[tuple[int, float]]] = {slot: [] for slot, _ in post.key}
    want = dict(post.key)
    if "narrator" in want:
        mentions["narrator"] = [
            (m.start(), 1.0) for m in _NARRATOR_PATTERN.finditer(text) if _tag(m) == want["narrator"]
        ]
    for pos, slot, key in scanned:
        if slot == "who" and "who" in want and key.split(" (")[0] == want["who"].split(" (")[0]:
            mentions["who"].append((pos, 1.0 if key == want["who"] else 0.5))
        elif slot in want and slot not in ("who", "narrator") and key == want[slot]:
            mentions[slot].append((pos, 1.0))
    credit, positions, fact_repeats = 0.0, [], 0
    for rank, (slot, _) in enumerate(post.key):
        if mentions[slot]:
            best = max(c for _, c in mentions[slot])
            credit += best
            positions.append((min(p for p, c in mentions[slot] if c == best), rank))
            fact_repeats += len(mentions[slot]) - 1
    positions.sort()
    ranks = [r for _, r in positions]
    pairs = [(i, j) for i in range(len(ranks)) for j in range(i + 1, len(ranks))]
    concordant = sum(ranks[i] < ranks[j] for i, j in pairs) / len(pairs) if pairs else 1.0
    invented = {(slot, key.split(" (")[0]) for _, slot, key in scanned} - post.items
    invented_tags = {_tag(m) for m in _TAG_PATTERN.finditer(text)} - post.tags
    n_invented = len(invented) + len(invented_tags)
    words = _WORD.findall(text)
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    sentence_words = _sentence_words(text)
    sentences = [" ".join(s) for s in sentence_words]
    repeated_sentences = len(sentences) - len(set(sentences))
    repeated = fact_repeats + (len(grams) - len(set(grams)))
    over = max(0, len(response.split()) - LENGTH_BUDGET_WORDS)
    unfinished = int(not response.rstrip().endswith((".", "!", "?"))) + int(ended is False)
    copied = _copied_share(_sentence_words(prompt.lower()), sentence_words)
    factor = (
        INVENTED_FACTOR**n_invented
        * REPEATED_FACTOR**repeated
        * REPEATED_SENTENCE_FACTOR**repeated_sentences
        * math.exp(-over / OVER_LENGTH_SCALE)
        * UNFINISHED_FACTOR**unfinished
        * math.exp(-COPY_SCALE * max(0.0, copied - COPY_ALLOWANCE))
    )
    covered = credit / len(post.key)
    if credit > 0:
        content = COVERAGE_WEIGHT * covered + ORDER_WEIGHT * concordant * len(positions) / len(post.key)
        total = FLOOR + (1 - FLOOR) * content * factor
    else:
        total = FLOOR - (1 + FLOOR) * (1 - factor)
    return {
        "coverage": covered,
        "order": concordant,
        "invented": float(n_invented),
        "repeated": float(repeated + repeated_sentences),
        "length": float(over),
        "unfinished": float(unfinished),
        "copied": copied,
        "factor": factor,
        "total": total,
    }


def gold_score(prompt: str, response: str, ended: bool | None = None) -> float:
    """Gold reward of a response to an embedded-task prompt: 1.0 for a flawless summary, down to -1.0.

    Text from the end-of-conversation token on is ignored (a policy may keep generating after it);
    ``ended=False`` marks an answer that ran into the length limit without an end token.
    """
    return score_details(prompt, response, ended)["total"]


def gold_scores(
    prompts: Sequence[str], responses: Sequence[str], ended: Sequence[bool] | None = None
) -> list[float]:
    """:func:`gold_score` over aligned lists (one response per prompt; ``ended`` per response or None)."""
    return [d["total"] for d in gold_score_details(prompts, responses, ended)]


def gold_score_details(
    prompts: Sequence[str],
    responses: Sequence[str],
    ended: Sequence[bool] | None = None,
    facts: Sequence[PostFacts | None] | None = None,
) -> list[dict[str, float]]:
    """:func:`score_details` over aligned lists (``facts`` per prompt, or None to parse every prompt)."""
    if len(prompts) != len(responses) or (ended is not None and len(ended) != len(responses)):
        n_ended = "" if ended is None else f" and {len(ended)} end flags"
        raise ValueError(f"gold_scores: {len(prompts)} prompts but {len(responses)} responses{n_ended}")
    if facts is not None and len(facts) != len(prompts):
        raise ValueError(f"gold_scores: {len(prompts)} prompts but {len(facts)} fact sets")
    flags = [None] * len(responses) if ended is None else [bool(e) for e in ended]
    known = [None] * len(prompts) if facts is None else list(facts)
    return [score_details(p, r, e, f) for p, r, e, f in zip(prompts, responses, flags, known)]


def pair_difference(prompt: str, chosen: str, rejected: str) -> str:
    """What sets a pair's two answers apart in the gold scorer's eyes: the components of :func:`score_details`
    that differ, joined by "+" in ``GOLD_COMPONENTS`` order ("coverage+invented": a fact replaced by one the
    post does not hold), or "none".  Groups a reward model's held-out pairs by the kind of flaw it must see."""
    a, b = score_details(prompt, chosen), score_details(prompt, rejected)
    return "+".join(k for k in GOLD_COMPONENTS if abs(a[k] - b[k]) > 1e-9) or "none"


def extra_flaws(meta: dict) -> list[str]:
    """The flaws that set a generated pair apart (from its ``meta["flaws"]``): those drawn for the copy beyond
    the candidate's, in the order drawn, e.g. ``["swap_tags"]`` or ``["drop:question", "invent:pet"]``.
    Labels do not change them (label noise swaps the sides, not the flaws)."""
    if "flaws" not in meta:
        raise ValueError("record meta has no 'flaws' (not a pair of the embedded task's generator)")
    fewer, more = sorted((meta["flaws"]["chosen"], meta["flaws"]["rejected"]), key=len)
    if more[: len(fewer)] != fewer:
        raise ValueError(f"meta['flaws']: {more} does not extend {fewer}")
    return more[len(fewer):]


def oracle_summary(prompt: str) -> str:
    """A flawless summary (gold score 1.0) of a generated prompt: the ceiling for benchmarks."""
    post = parse_post(prompt)
    key = dict(post.key)
    missing = [s for s in KEY_SLOTS if s not in key]
    if missing:
        raise ValueError(f"prompt lacks facts {missing}, cannot build an oracle summary: {prompt[:80]!r}")
    rel, other = key["who"][:-1].split(" (")
    # Intro order = order of narrator (N), who (W) and place (P) in the post; "NPW" if the post is unusual.
    order = "".join({"narrator": "N", "who": "W", "place": "P"}.get(s, "") for s, _ in post.key)
    originals = {_key(x).lower(): x for x in TRIED}
    facts = _Facts(
        narrator=key["narrator"],
        rel=rel,
        other=other,
        place=key["place"],
        pet=key["pet"],
        problem=key["problem"],
        tried=originals[key["tried"]],
        question=key["question"],
        name="",
        duration="",
        intro_order=order if order in ("NPW", "WNP", "NWP") else "NPW",
    )
    return _render(_Plan(facts=facts, keep=set(KEY_SLOTS), style=[0, 0, 0, 0], order=[0, 1, 2]))


# ---------------------------------------------------------------------------------------------------------
# JSONL helpers
# ---------------------------------------------------------------------------------------------------------
def write_jsonl(records: Iterable[Record], path: str | Path) -> None:
    """One JSON object per line with the :class:`Record` fields."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[Record]:
    """Inverse of :func:`write_jsonl`; bad rows raise a :class:`DataError` naming file, row and field."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for row_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(str(path), row_no, "<line>", f"invalid JSON: {e}") from None
            if not isinstance(row, dict):
                raise DataError(str(path), row_no, "<line>", "expected a JSON object")
            rejected = row.get("rejected")
            if rejected is not None:
                rejected = require_text(row, "rejected", str(path), row_no)
            out.append(
                Record(
                    prompt=require_text(row, "prompt", str(path), row_no),
                    chosen=require_text(row, "chosen", str(path), row_no),
                    rejected=rejected,
                    source=row.get("source") or f"{path}:{row_no}",
                    meta=_meta_field(row, str(path), row_no),
                )
            )
    return out


def _meta_field(row: dict, file: str, row_no: int) -> dict:
    meta = row.get("meta")
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise DataError(file, row_no, "meta", f"expected a JSON object, got {type(meta).__name__}")
    return meta
