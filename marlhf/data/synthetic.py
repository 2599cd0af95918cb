"""The embedded task: a miniature of TL;DR summarisation with a gold scorer (docs/design.md, "The embedded task").

A prompt is a short Reddit-style post ("SUBREDDIT: ...\\nPOST: ...\\nTL;DR:") that states seven key facts
drawn from closed, seeded vocabularies — the poster's age/gender tag, the other person (relation + tag),
the place, the pet, its problem, what was tried and the question asked — plus distractors (pet name,
duration, filler sentences) in varied phrasing and order.  A response is a summary starting with a space.

Because every fact is a phrase from a closed vocabulary, :func:`gold_score` recovers the facts from the
prompt *text alone* and can score any generation: credit for each key fact covered and for keeping the
post's order, minus penalties for invented facts, repetition, an unfinished last sentence and length over
a budget.  Every part of the response counts, so a mistake late in a generation costs reward — the
property that makes credit assignment over long responses (the paper's motivation, §1) matter.

Preference pairs (:func:`generate`) are two candidate summaries of varying quality (dropped, swapped,
invented or repeated facts; truncation; over-long), the higher gold score chosen, with the label flipped
with probability ``label_noise``.  Most candidates carry at least one flaw, so the SFT "chosen" responses
are good but not the best possible and RL has room to improve (a flawless summary scores 1.0).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from marlhf.data.records import DataError, Record, require_text

# Bump when generated text or scoring changes, so cached embedded builds are not silently reused.
TASK_VERSION = 1

# ---------------------------------------------------------------------------------------------------------
# Vocabularies.  Invariant (tested): no item occurs inside another item or inside any template text, so a
# whole-word match of an item is unambiguous evidence that the fact is mentioned.
# ---------------------------------------------------------------------------------------------------------
RELATIONS: dict[str, str | None] = {  # relation -> fixed gender (None: either)
    "roommate": None,
    "boyfriend": "M",
    "girlfriend": "F",
    "husband": "M",
    "wife": "F",
    "sister": "F",
    "brother": "M",
    "mom": "F",
    "dad": "M",
    "neighbor": None,
    "coworker": None,
    "best friend": None,
    "cousin": None,
    "landlord": None,
    "partner": None,
    "stepdad": "M",
    "aunt": "F",
    "uncle": "M",
}
PLACES = [
    "apartment",
    "dorm room",
    "house",
    "studio",
    "townhouse",
    "condo",
    "basement flat",
    "trailer",
    "farmhouse",
    "loft",
    "duplex",
    "cabin",
    "bungalow",
    "attic flat",
]
PETS = [
    "cat",
    "dog",
    "puppy",
    "kitten",
    "parrot",
    "hamster",
    "rabbit",
    "ferret",
    "turtle",
    "snake",
    "guinea pig",
    "hedgehog",
    "lizard",
    "cockatiel",
    "goat",
    "chinchilla",
]
PROBLEMS = [  # third person singular verb phrases: "the cat <problem>"
    "scratches the couch",
    "barks all night",
    "chews my shoes",
    "bites my ankles",
    "steals food from the counter",
    "knocks cups off the table",
    "hides under the bed",
    "wakes me up at dawn",
    "escapes through the window",
    "screams every morning",
    "eats my plants",
    "sheds on everything",
    "growls at my guests",
    "digs up the garden",
    "chews the phone cables",
    "smells terrible",
    "pees on the carpet",
    "breaks the blinds",
    "howls when we leave",
    "attacks my socks",
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
    "a strict feeding schedule",
    "a squeaky toy",
    "earplugs",
    "a pheromone diffuser",
    "training pads",
    "a bark collar",
    "aluminium foil",
    "a motion alarm",
    "a white noise machine",
    "bitter apple spray",
    "a cardboard box fort",
    "an automatic feeder",
]
QUESTIONS = [  # verb phrases after "Should I ..."
    "move out",
    "report it to the building manager",
    "give an ultimatum",
    "split the cost of repairs",
    "ask for the money back",
    "call a family meeting",
    "find it a new home",
    "set some ground rules",
    "just let it go",
    "end the lease early",
    "take the pet to a shelter",
    "stop visiting",
    "apologize first",
    "bring it up again",
    "ask my parents for help",
    "start charging more rent",
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

# Gold-score weights, in units of a flawless summary (= 1.0).  Coverage and order share the credit.
COVERAGE_WEIGHT = 0.85  # split evenly over the key facts the post contains
ORDER_WEIGHT = 0.15  # times the fraction of concordant fact pairs, times the covered fraction
INVENTED_PENALTY = 0.15  # per distinct invented fact (vocabulary item / age tag absent from the post)
REPEATED_FACT_PENALTY = 0.1  # per extra mention of a fact
REPEATED_NGRAM_PENALTY = 0.02  # per word 4-gram that already occurred earlier in the response
LENGTH_BUDGET_WORDS = 45  # a flawless summary needs 25-42 words
OVER_BUDGET_PENALTY = 0.015  # per word beyond the budget
UNFINISHED_PENALTY = 0.1  # last sentence does not end with . ! or ?
END_OF_CONVERSATION = "<|endoftext|>"  # text from this marker on is not part of the response


@dataclasses.dataclass
class SyntheticConfig:
    """Knobs of the embedded task.  Records are a pure function of these values."""

    seed: int = 1234
    """Seed of every random choice; record i only depends on (seed, i), so a shorter run is a prefix."""
    num_records: int = 4000
    """Number of preference pairs."""
    label_noise: float = 0.1
    """Probability that a pair's label is flipped (chosen has the *lower* gold score)."""
    flaw_weights: tuple[float, ...] = (0.08, 0.42, 0.34, 0.16)
    """Probability of a candidate summary carrying 0, 1, 2, 3 ... flaws (dropped / swapped / invented /
    repeated fact, truncation, over-long).  Few flawless candidates keep SFT "chosen" below the optimum."""
    filler_prob: float = 0.5
    """Probability of each of up to two filler sentences in a post (distractors without facts)."""
    max_tie_resamples: int = 20
    """Rejected candidates are redrawn while their gold score ties the chosen one (a tie has no label)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_noise <= 0.5:
            raise ValueError(f"label_noise must be in [0, 0.5], got {self.label_noise}")
        if self.num_records < 1:
            raise ValueError(f"num_records must be >= 1, got {self.num_records}")
        if not self.flaw_weights or min(self.flaw_weights) < 0 or sum(self.flaw_weights) <= 0:
            raise ValueError(
                f"flaw_weights must be non-negative with a positive sum, got {self.flaw_weights}"
            )


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
    extras: list[str] = dataclasses.field(default_factory=list)  # appended sentences (over-long / invented)
    repeat: int | None = None  # index of a sentence said twice
    truncate: float | None = None  # keep this fraction of the words


def _render(plan: _Plan) -> str:
    f, keep, s = plan.facts, plan.keep, plan.style
    n = f"I ({f.narrator})" if "narrator" in keep else "I"
    w = f"my {f.rel} ({f.other})" if "who" in keep else None
    if "place" in keep:
        place = _a(f.place)
        intros = {
            "NPW": [
                f"{n} live in {place}" + (f" with {w}." if w else "."),
                f"{n} share {place}" + (f" with {w}." if w else " with someone."),
            ],
            "WNP": [f"{_cap(w)} and {n} share {place}." if w else f"{n} live in {place}."],
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
    if plan.repeat is not None:
        i = plan.repeat % len(sentences)
        sentences.insert(i + 1, sentences[i])
    text = " ".join(sentences)
    if plan.truncate is not None:
        words = text.split(" ")
        text = " ".join(words[: max(1, int(len(words) * plan.truncate))]).rstrip(",")
    return " " + text


_FLAWS = ("drop", "drop", "invent", "swap_tags", "swap_order", "repeat", "truncate", "long")


def _candidate(f: _Facts, rng: random.Random, cfg: SyntheticConfig) -> str:
    plan = _Plan(
        facts=dataclasses.replace(f),
        keep=set(KEY_SLOTS),
        style=[rng.randrange(6) for _ in range(4)],
        order=[0, 1, 2],
    )
    num_flaws = rng.choices(range(len(cfg.flaw_weights)), weights=cfg.flaw_weights)[0]
    for flaw in rng.sample(_FLAWS, k=num_flaws):
        if flaw == "drop":
            # The narrator tag and the question are the facts most often left out by real summaries.
            slot = rng.choice(["narrator", "narrator", "question", "tried", "place", "who", "pet", "problem"])
            plan.keep.discard(slot)
        elif flaw == "invent":
            _invent(plan, rng)
        elif flaw == "swap_tags":
            plan.facts.narrator, plan.facts.other = plan.facts.other, plan.facts.narrator
        elif flaw == "swap_order":
            i = rng.randrange(2)
            plan.order[i], plan.order[i + 1] = plan.order[i + 1], plan.order[i]
        elif flaw == "repeat":
            plan.repeat = rng.randrange(4)
        elif flaw == "truncate":
            plan.truncate = rng.uniform(0.45, 0.9)
        elif flaw == "long":
            plan.extras += [
                f"{_pron(f.other)} named it {f.name}.",
                f"This has been going on for {f.duration}.",
            ]
            plan.extras += rng.sample(EXTRAS, k=rng.randint(2, 4))
            rng.shuffle(plan.extras)
        else:  # pragma: no cover - the tuple above is the whole list
            raise AssertionError(flaw)
    return _render(plan)


def _invent(plan: _Plan, rng: random.Random) -> None:
    """Replace a fact by one the post does not contain, or add an invented detail."""
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


def _record_rng(seed: int, index: int) -> random.Random:
    # String seeds are hashed with SHA-512 by `random`: stable across runs, platforms and Python versions.
    return random.Random(f"marlhf-synthetic-v{TASK_VERSION}:{seed}:{index}")


def generate(cfg: SyntheticConfig | None = None) -> list[Record]:
    """Preference pairs of the embedded task, deterministic in ``cfg`` (record i depends on seed, i only)."""
    cfg = cfg or SyntheticConfig()
    records = []
    for i in range(cfg.num_records):
        rng = _record_rng(cfg.seed, i)
        facts = _sample_facts(rng)
        prompt = _post(facts, rng, cfg.filler_prob)
        a = _candidate(facts, rng, cfg)
        score_a = gold_score(prompt, a)
        for _ in range(cfg.max_tie_resamples):
            b = _candidate(facts, rng, cfg)
            score_b = gold_score(prompt, b)
            if abs(score_a - score_b) > 1e-9:
                break
        else:
            raise RuntimeError(f"record {i}: no non-tied candidate pair in {cfg.max_tie_resamples} draws")
        chosen, rejected = (a, b) if score_a > score_b else (b, a)
        if rng.random() < cfg.label_noise:
            chosen, rejected = rejected, chosen
        records.append(Record(prompt=prompt, chosen=chosen, rejected=rejected, source=f"synthetic:{i}"))
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


def score_details(prompt: str, response: str) -> dict[str, float]:
    """Every term of :func:`gold_score` (for tests, debugging and reward-hacking analysis)."""
    post = parse_post(prompt)
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
    credit, positions, repeats = 0.0, [], 0
    for rank, (slot, _) in enumerate(post.key):
        if mentions[slot]:
            best = max(c for _, c in mentions[slot])
            credit += best
            positions.append((min(p for p, c in mentions[slot] if c == best), rank))
            repeats += len(mentions[slot]) - 1
    positions.sort()
    ranks = [r for _, r in positions]
    pairs = [(i, j) for i in range(len(ranks)) for j in range(i + 1, len(ranks))]
    concordant = sum(ranks[i] < ranks[j] for i, j in pairs) / len(pairs) if pairs else 1.0
    invented = {(slot, key.split(" (")[0]) for _, slot, key in scanned} - post.items
    invented_tags = {_tag(m) for m in _TAG_PATTERN.finditer(text)} - post.tags
    words = re.findall(r"[\w']+", text)
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    over_budget = max(0, len(response.split()) - LENGTH_BUDGET_WORDS)
    unfinished = not response.rstrip().endswith((".", "!", "?"))
    terms = {
        "coverage": COVERAGE_WEIGHT * credit / len(post.key),
        "order": ORDER_WEIGHT * concordant * len(positions) / len(post.key),
        "invented": -INVENTED_PENALTY * (len(invented) + len(invented_tags)),
        "repeated_facts": -REPEATED_FACT_PENALTY * repeats,
        "repeated_ngrams": -REPEATED_NGRAM_PENALTY * (len(grams) - len(set(grams))),
        "length": -OVER_BUDGET_PENALTY * over_budget,
        "unfinished": -UNFINISHED_PENALTY * unfinished,
    }
    terms["total"] = sum(terms.values())
    return terms


def gold_score(prompt: str, response: str) -> float:
    """Gold reward of a response to an embedded-task prompt; 1.0 for a flawless summary, can go negative.

    Text from the end-of-conversation token on is ignored (a policy may keep generating after it).
    """
    return score_details(prompt, response)["total"]


def gold_scores(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """:func:`gold_score` over aligned lists (one response per prompt)."""
    if len(prompts) != len(responses):
        raise ValueError(f"gold_scores: {len(prompts)} prompts but {len(responses)} responses")
    return [gold_score(p, r) for p, r in zip(prompts, responses)]


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
                )
            )
    return out
