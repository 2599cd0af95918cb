"""The embedded TL;DR task: determinism, the gold scorer's hand-derived values, label noise, lengths."""

from __future__ import annotations

import dataclasses
import math
import re
import statistics

import pytest

from marlhf.data.records import DataError, Record
from marlhf.embedded import task as embedded_task
from marlhf.embedded.task import (
    COPY_ALLOWANCE,
    COPY_SCALE,
    EXTRAS,
    FILLERS,
    FLOOR,
    INVENTED_FACTOR,
    LENGTH_BUDGET_WORDS,
    ORDER_WEIGHT,
    OVER_LENGTH_SCALE,
    REPEATED_FACTOR,
    REPEATED_SENTENCE_FACTOR,
    SUBREDDITS,
    UNFINISHED_FACTOR,
    VOCAB_SLOTS,
    SyntheticConfig,
    extra_flaws,
    generate,
    gold_score,
    gold_scores,
    oracle_summary,
    pair_difference,
    parse_post,
    read_jsonl,
    score_details,
    write_jsonl,
)

# A hand-written post (not from the generator): 7 key facts in this order — narrator tag, place, who,
# pet, problem, tried, question — plus distractors (pet name, duration).
PROMPT = (
    "SUBREDDIT: r/pets\nPOST: I (24F) live in an apartment with my roommate (26M). He adopted a cat named "
    "Mochi two months ago. The problem is that the cat scratches the couch. We tried a spray bottle, but "
    "nothing changed. Should I move out?\nTL;DR:"
)
S1 = "I (24F) share an apartment with my roommate (26M)."
S2 = "He got a cat that scratches the couch."
S3 = "We tried a spray bottle, but it did not help."
S4 = "Should I move out?"
GOOD = " " + " ".join([S1, S2, S3, S4])
SEVENTH = 1 / 7  # coverage + order share of one fact when everything else is right


def scaled(content: float, factor: float = 1.0) -> float:
    """The total of an answer with a fact right: FLOOR + (1 - FLOOR) x content x factor."""
    return FLOOR + (1 - FLOOR) * content * factor


def test_parse_post_recovers_the_facts_from_text():
    post = parse_post(PROMPT)
    assert post.key == (
        ("narrator", "24F"),
        ("place", "apartment"),
        ("who", "roommate (26M)"),
        ("pet", "cat"),
        ("problem", "scratches the couch"),
        ("tried", "spray bottle"),
        ("question", "move out"),
    )
    assert ("name", "mochi") in post.items and ("duration", "two months") in post.items
    assert post.tags == {"24F", "26M"}


def test_good_summary_scores_one():
    details = score_details(PROMPT, GOOD)
    assert (details["coverage"], details["order"], details["factor"]) == (1.0, 1.0, 1.0)
    assert all(details[k] == 0 for k in ("invented", "repeated", "length", "unfinished", "copied"))
    assert gold_score(PROMPT, GOOD) == pytest.approx(1.0)
    assert gold_score(PROMPT, GOOD, ended=True) == pytest.approx(1.0)


def test_hand_derived_scores_of_flawed_summaries():
    cases = {
        # one key fact dropped: lose its coverage share and its share of the order credit: 1 - 1/7
        "dropped": (" " + " ".join([S1, S2, S4]), scaled(1 - SEVENTH)),
        # an invented detail (a pet name the post does not contain)
        "invented": (GOOD + " He named it Biscuit.", scaled(1, INVENTED_FACTOR)),
        # a wrong fact = the right one dropped + an invented one
        "replaced": (GOOD.replace("spray bottle", "baby gate"), scaled(1 - SEVENTH, INVENTED_FACTOR)),
        # S2 said twice: a repeated sentence, pet and problem mentioned twice, its 8 words repeat 5 4-grams
        "repeated": (
            " " + " ".join([S1, S2, S2, S3, S4]),
            scaled(1, REPEATED_SENTENCE_FACTOR * REPEATED_FACTOR ** (2 + 5)),
        ),
        # truncated before the question's verb: question lost (1/7) and the last sentence unfinished
        "truncated": (GOOD[: GOOD.index(" move out?")], scaled(1 - SEVENTH, UNFINISHED_FACTOR)),
        # S3 before S2: (tried, pet) and (tried, problem) discordant, 19 of 21 pairs in order
        "swapped_order": (" " + " ".join([S1, S3, S2, S4]), scaled(1 - ORDER_WEIGHT + ORDER_WEIGHT * 19 / 21)),
        # the two age tags exchanged: narrator fact lost, relation with a wrong tag earns half (5.5 / 7),
        # order credit over the 6 facts still mentioned
        "swapped_tags": (
            GOOD.replace("(24F)", "(X)").replace("(26M)", "(24F)").replace("(X)", "(26M)"),
            scaled((1 - ORDER_WEIGHT) * 5.5 / 7 + ORDER_WEIGHT * 6 / 7),
        ),
        # a wrong question in the very last sentence: a late mistake costs as much as an early one
        "late_mistake": (GOOD.replace("move out", "give an ultimatum"), scaled(1 - SEVENTH, INVENTED_FACTOR)),
    }
    for name, (response, expected) in cases.items():
        assert gold_score(PROMPT, response) == pytest.approx(expected), name
        assert gold_score(PROMPT, response) < gold_score(PROMPT, GOOD), name



def test_pair_difference_names_the_components_that_set_a_pair_apart():
    assert pair_difference(PROMPT, GOOD, GOOD) == "none"
    assert pair_difference(PROMPT, GOOD, " " + " ".join([S1, S2, S4])) == "coverage"  # a fact dropped
    assert pair_difference(PROMPT, GOOD, GOOD + " He named it Biscuit.") == "invented"
    assert pair_difference(PROMPT, GOOD, GOOD.replace("spray bottle", "baby gate")) == "coverage+invented"
    assert pair_difference(PROMPT, GOOD, " " + " ".join([S1, S3, S2, S4])) == "order"
    # symmetric: which side is chosen does not change what differs
    assert pair_difference(PROMPT, " " + " ".join([S1, S3, S2, S4]), GOOD) == "order"
    # every generated pair differs in something the gold scorer sees (ties are redrawn)
    records = generate(SyntheticConfig(num_records=60))
    kinds = {pair_difference(r.prompt, r.chosen, r.rejected) for r in records}
    assert "none" not in kinds and {"coverage", "order"} <= kinds


def test_generated_pairs_record_the_flaws_that_set_them_apart():
    """meta["flaws"]: one side's list extends the other's by the 1-2 extra flaws of the pair, and a pair that
    differs in one named flaw shows that flaw in its text and gold components."""
    import collections

    records = generate(SyntheticConfig(num_records=400, label_noise=0.0))
    checked, improved = collections.Counter(), []
    for r in records:
        extra = extra_flaws(r.meta)
        flaws = r.meta["flaws"]
        assert 1 <= len(extra) <= 2
        if flaws["chosen"] == flaws["rejected"] + extra:  # an extra flaw undid one: a swap back, an invention dropped
            improved.append(extra)
            continue
        assert flaws["rejected"] == flaws["chosen"] + extra
        if len(extra) > 1:
            continue
        (flaw,) = extra
        better, worse = score_details(r.prompt, r.chosen), score_details(r.prompt, r.rejected)
        tags = re.findall(r"\((\d+[FM])\)", r.chosen)
        if flaw.startswith("drop:"):
            assert worse["coverage"] < better["coverage"] and worse["invented"] == better["invented"], r.source
        elif flaw == "invent:name":  # an appended sentence naming the pet wrongly
            assert re.fullmatch(re.escape(r.chosen) + r" (He|She) named it [A-Z]\w+\.", r.rejected), r.source
        elif flaw.startswith("invent:"):
            assert worse["invented"] == better["invented"] + 1, r.source
        elif flaw == "swap_order":
            assert worse["order"] < better["order"] and worse["coverage"] == better["coverage"], r.source
        elif flaw == "swap_tags" and len(tags) == 2:  # both tags mentioned: they trade places
            assert re.findall(r"\((\d+[FM])\)", r.rejected) == tags[::-1], r.source
        else:
            continue
        checked[flaw.split(":")[0]] += 1
    assert set(checked) == {"drop", "invent", "swap_order", "swap_tags"} and min(checked.values()) >= 5, checked
    # only a swap (back) or a drop (of an invented fact) can undo a flaw; an invention never helps
    assert len(improved) < 0.1 * len(records) and not any(all(f.startswith("invent:") for f in e) for e in improved)
    with pytest.raises(ValueError, match="no 'flaws'"):
        extra_flaws({"facts": {}})


def test_bench_reward_model_breakdown_against_the_gold_scorer():
    """scripts/bench_reward_model.py --breakdown: a scorer that is the gold scorer agrees on every pair, its
    negation on none; the label accuracy counts label noise; groups are pair_difference's, largest first."""
    import collections
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_reward_model", REPO / "scripts/bench_reward_model.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    records = generate(SyntheticConfig(num_records=80))
    noisy = sum(gold_score(r.prompt, r.chosen) < gold_score(r.prompt, r.rejected) for r in records)
    assert noisy > 0  # the task's label noise shows

    def gold(prompts, responses):
        return gold_scores(prompts, responses)

    exact = bench.gold_breakdown(gold, records)
    assert exact["pairs"] == 80 and exact["gold_agreement"] == 1.0
    assert exact["label_accuracy"] == pytest.approx(1 - noisy / 80)
    counts = collections.Counter(pair_difference(r.prompt, r.chosen, r.rejected) for r in records)
    assert {k: v["pairs"] for k, v in exact["by_difference"].items()} == dict(counts)
    assert list(exact["by_difference"]) == sorted(counts, key=lambda k: (-counts[k], k))
    assert all(v["gold_agreement"] == 1.0 for v in exact["by_difference"].values())
    flaw_counts = collections.Counter(bench.flaw_group(r.meta) for r in records)
    assert {k: v["pairs"] for k, v in exact["by_flaw"].items()} == dict(flaw_counts)
    assert "swap_tags" in flaw_counts and not any(k.startswith("drop:") for k in flaw_counts)
    inverse = bench.gold_breakdown(lambda p, r: [-x for x in gold(p, r)], records)
    assert inverse["gold_agreement"] == 0.0 and inverse["label_accuracy"] == pytest.approx(noisy / 80)
    # a scorer that only sees length: agreement per group equals a loop's
    length = bench.gold_breakdown(lambda p, r: [float(len(x)) for x in r], records)
    for kind, row in length["by_difference"].items():
        group = [r for r in records if pair_difference(r.prompt, r.chosen, r.rejected) == kind]
        agree = [(len(r.chosen) > len(r.rejected))
                 == (gold_score(r.prompt, r.chosen) > gold_score(r.prompt, r.rejected)) for r in group]
        assert row["gold_agreement"] == pytest.approx(sum(agree) / len(agree)), kind
    for group, row in length["by_flaw"].items():
        agree = [(len(r.chosen) > len(r.rejected))
                 == (gold_score(r.prompt, r.chosen) > gold_score(r.prompt, r.rejected))
                 for r in records if bench.flaw_group(r.meta) == group]
        assert row["gold_agreement"] == pytest.approx(sum(agree) / len(agree)), group
    # DPO's implicit reward ranks by the difference of two scorers: gold minus a constant orders as gold does
    implicit = bench.gold_breakdown(bench.implicit_reward(gold, lambda p, r: [1.0] * len(r)), records)
    assert implicit["gold_agreement"] == 1.0
    runs = [{"seed": 1, "accuracy": exact["label_accuracy"], "seconds": 1.0, "breakdown": exact},
            {"seed": 2, "accuracy": inverse["label_accuracy"], "seconds": 1.0, "breakdown": inverse}]
    table = bench.markdown({"sft": "sft", "data_path": "synthetic", "max_eval": 80, "label_ceiling": 1 - noisy / 80,
                            "seeds": [1, 2], "settings": [{"name": "base", "flags": [], "runs": runs,
                                                           "summary": bench.summarize(runs)}],
                            "references": [{"name": "likelihood of `m`", "breakdown": inverse}]})
    first = next(iter(exact["by_difference"]))
    assert "| base | 1 | 1.000 | 1.000 |" in table and "| base | 2 | 0.000 | 0.000 |" in table
    assert "| likelihood of `m` (reference) |  | 0.000 | 0.000 |" in table
    assert f"| {first} |" in table and f"| pairs | | 80 | {counts[first]} |" in table


def test_over_long_summary_decays_per_word_over_budget():
    long = GOOD + " " + " ".join(EXTRAS[:4])
    n_words = len(long.split())
    assert n_words > LENGTH_BUDGET_WORDS
    over = n_words - LENGTH_BUDGET_WORDS
    assert gold_score(PROMPT, long) == pytest.approx(scaled(1, math.exp(-over / OVER_LENGTH_SCALE)))


def test_no_end_token_copy_and_no_fact():
    # generation ran into the length limit: the flawless text loses three quarters of its credit
    assert gold_score(PROMPT, GOOD, ended=False) == pytest.approx(scaled(1, UNFINISHED_FACTOR))
    # the post itself: 40 words, its four sentences of 8+ words (10 + 9 + 9 + 8) copied
    copy = " " + PROMPT.split("POST: ")[1].split("\nTL;DR:")[0]
    d = score_details(PROMPT, copy)
    assert d["copied"] == pytest.approx(36 / 40)
    assert d["repeated"] == 1  # "a cat named Mochi ... the cat scratches": the pet mentioned twice
    copy_factor = math.exp(-COPY_SCALE * (36 / 40 - COPY_ALLOWANCE))
    assert d["total"] == pytest.approx(scaled(1, REPEATED_FACTOR * copy_factor))
    # no key fact: the floor, and an unfinished empty answer below it
    assert gold_score(PROMPT, " I need advice.") == pytest.approx(FLOOR)
    assert gold_score(PROMPT, "") == pytest.approx(FLOOR - (1 + FLOOR) * (1 - UNFINISHED_FACTOR))
    assert gold_score(PROMPT, " Should I move out?") > FLOOR


def test_score_depends_on_the_whole_response():
    """Every strict word prefix of the good summary scores below it: only the whole response earns 1.0."""
    words = GOOD.split(" ")
    full = gold_score(PROMPT, GOOD)
    for k in range(1, len(words)):
        assert gold_score(PROMPT, " ".join(words[:k])) < full, k


def test_text_after_end_of_conversation_is_ignored_and_case_is_not_a_fact():
    assert gold_score(PROMPT, GOOD + "<|endoftext|> Should I move out? He got a dog.") == pytest.approx(1.0)
    assert gold_score(PROMPT, GOOD.upper()) == pytest.approx(1.0)


def test_gold_scores_and_bad_inputs():
    assert gold_scores([PROMPT, PROMPT], [GOOD, " Should I move out?"]) == [
        pytest.approx(1.0),
        pytest.approx(scaled(SEVENTH)),
    ]
    assert gold_scores([PROMPT], [GOOD], ended=[False]) == [pytest.approx(scaled(1, UNFINISHED_FACTOR))]
    with pytest.raises(ValueError, match="1 prompts but 1 responses and 2 end flags"):
        gold_scores([PROMPT], [GOOD], ended=[True, False])
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        gold_scores([PROMPT, PROMPT], [GOOD])
    with pytest.raises(ValueError, match="no facts of the embedded task"):
        gold_score("Write a poem about the sea.", " The sea is blue.")


def test_vocabulary_items_never_match_inside_each_other_or_template_text():
    """The scorer's premise: a whole-word match of an item is unambiguous evidence of that one fact."""
    keys = {embedded_task._key(x).lower(): slot for slot, items in VOCAB_SLOTS.items() for x in items}
    assert len(keys) == sum(len(v) for v in VOCAB_SLOTS.values())  # no item in two slots
    for key in keys:
        others = [k for k in keys if k != key and re.search(rf"\b{re.escape(k)}\b", key)]
        assert not others, (key, others)
    for text in FILLERS + EXTRAS + SUBREDDITS:
        assert embedded_task._scan(text.lower()) == [], text


def test_same_seed_same_records_other_seed_different():
    a = generate(SyntheticConfig(seed=5, num_records=60))
    assert a == generate(SyntheticConfig(seed=5, num_records=60))
    assert a[:25] == generate(SyntheticConfig(seed=5, num_records=25))  # record i depends on (seed, i) only
    b = generate(SyntheticConfig(seed=6, num_records=60))
    assert sum(x.prompt != y.prompt for x, y in zip(a, b)) >= 55
    assert all(r.source == f"synthetic:{i}" for i, r in enumerate(a))
    assert len({r.prompt for r in a}) == 60


def test_records_are_readable_posts_with_space_led_summaries():
    for r in generate(SyntheticConfig(seed=3, num_records=200)):
        assert (
            r.prompt.startswith("SUBREDDIT: r/") and "\nPOST: " in r.prompt and r.prompt.endswith("\nTL;DR:")
        )
        assert r.chosen.startswith(" ") and r.rejected.startswith(" ") and r.chosen != r.rejected
        slots = [slot for slot, _ in parse_post(r.prompt).key]
        assert sorted(slots) == sorted(embedded_task.KEY_SLOTS)  # every post states all seven key facts
        assert slots[3:] == ["pet", "problem", "tried", "question"]  # after the intro's varied order
        assert gold_score(r.prompt, oracle_summary(r.prompt)) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def noisy_and_clean():
    noisy = generate(SyntheticConfig(seed=11, num_records=4000, label_noise=0.1))
    clean = generate(SyntheticConfig(seed=11, num_records=4000, label_noise=0.0))
    return noisy, clean


def _flipped(records: list[Record]) -> list[bool]:
    return [gold_score(r.prompt, r.chosen) < gold_score(r.prompt, r.rejected) for r in records]


def test_measured_flip_rate_matches_label_noise(noisy_and_clean):
    noisy, clean = noisy_and_clean
    flips = _flipped(noisy)
    # Binomial(4000, 0.1): standard deviation 0.0047; 0.02 is more than 4 sigma.
    assert abs(sum(flips) / len(flips) - 0.1) < 0.02
    assert sum(_flipped(clean)) == 0
    # Noise only swaps labels: same prompts and candidate pairs, swapped exactly where flipped.
    for r_noisy, r_clean, flip in zip(noisy, clean, flips):
        assert r_noisy.prompt == r_clean.prompt
        assert {r_noisy.chosen, r_noisy.rejected} == {r_clean.chosen, r_clean.rejected}
        assert (r_noisy.chosen != r_clean.chosen) == flip


def test_sft_chosen_is_good_but_leaves_room(noisy_and_clean):
    _, clean = noisy_and_clean
    chosen = [gold_score(r.prompt, r.chosen) for r in clean]
    rejected = [gold_score(r.prompt, r.rejected) for r in clean]
    assert 0.7 < statistics.fmean(chosen) < 0.9  # the oracle scores 1.0
    assert statistics.fmean(rejected) < statistics.fmean(chosen) - 0.15
    assert sum(c > 0.999 for c in chosen) / len(chosen) < 0.4  # most chosen summaries have a flaw


def test_response_token_lengths_with_the_project_tokenizer(tmp_path, noisy_and_clean):
    from marlhf.embedded.tokenizer import train_tokenizer

    records = noisy_and_clean[0][:1000]
    tok = train_tokenizer([t for r in records for t in (r.prompt, r.chosen, r.rejected)], tmp_path, 2000)
    assert 1500 < len(tok) <= 2000  # the small closed vocabularies may not fill all 2000 pieces
    lengths = [
        len(x)
        for x in tok([r.chosen for r in records] + [r.rejected for r in records], add_special_tokens=False)[
            "input_ids"
        ]
    ]
    assert sum(30 <= n <= 100 for n in lengths) / len(lengths) > 0.85
    assert 40 <= statistics.median(lengths) <= 70
    assert max(lengths) < 160


def test_config_validation():
    with pytest.raises(ValueError, match="label_noise"):
        SyntheticConfig(label_noise=0.7)
    with pytest.raises(ValueError, match="num_records"):
        SyntheticConfig(num_records=0)
    with pytest.raises(ValueError, match="flaw_weights"):
        SyntheticConfig(flaw_weights=(-1.0, 1.0))
    assert dataclasses.asdict(SyntheticConfig())["seed"] == 1234


def test_jsonl_round_trip_and_errors(tmp_path):
    records = generate(SyntheticConfig(seed=2, num_records=5)) + [Record("p", " c", None, "x:1")]
    path = tmp_path / "r.jsonl"
    write_jsonl(records, path)
    assert read_jsonl(path) == records
    path.write_text('{"prompt": "p", "chosen": " c"}\n{"prompt": "p", "chosen": ""}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"r.jsonl: row 2: field 'chosen': empty text"):
        read_jsonl(path)
    path.write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(DataError, match="row 1"):
        read_jsonl(path)


def test_bench_reward_model_settings_carry_flags_and_launch_overrides(monkeypatch, tmp_path):
    """A setting's --flag=value items reach main.py through EXTRA_ARGS, its VAR=value items the launch
    script's environment (LIKELIHOOD_TERM=0: the score head alone); anything else is refused."""
    import importlib.util
    import subprocess

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_reward_model", REPO / "scripts/bench_reward_model.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    name, flags = bench.parse_setting("plain:LIKELIHOOD_TERM=0 --learning_rate=5e-4")
    assert (name, flags) == ("plain", ["LIKELIHOOD_TERM=0", "--learning_rate=5e-4"])
    for bad in ("x:--likelihood_term", "x:lower=1", "x:5e-4"):
        with pytest.raises(SystemExit, match="--flag=value or VAR=value"):
            bench.parse_setting(bad)
    seen = {}

    def fake_run(cmd, env, **kw):
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    with pytest.raises(SystemExit, match="step 2 failed"):
        bench.run_one("sft", "", flags, 3, tmp_path)
    assert seen["LIKELIHOOD_TERM"] == "0" and seen["MODEL_PATH"] == "sft"
    assert seen["EXTRA_ARGS"] == "--seed=3 --learning_rate=5e-4"


def test_generated_records_are_cached_by_settings_and_generator(tmp_path, monkeypatch):
    """Steps 2 and 3 each read the task's train and test records: generated once, then read from
    $MARLHF_HOME/records — equal to a fresh generation, keyed by the settings (and the generator's source)."""
    from marlhf.data.adapters import loader

    monkeypatch.setenv("MARLHF_HOME", str(tmp_path))
    cfg = embedded_task.SyntheticConfig(num_records=30, seed=11)
    fresh = embedded_task.generate(cfg)
    assert loader.synthetic_records(cfg) == fresh
    files = list((tmp_path / "records").glob("*.jsonl"))
    assert len(files) == 1 and len(files[0].read_text().splitlines()) == 30

    def no_generation(_cfg):
        raise AssertionError("generated again instead of read from the cache")

    monkeypatch.setattr(embedded_task, "generate", no_generation)
    cached = loader.synthetic_records(cfg)
    assert cached == fresh and cached[3].meta == fresh[3].meta  # the facts and flaws the gold scorer reads
    with pytest.raises(AssertionError, match="generated again"):  # other settings: another file
        loader.synthetic_records(dataclasses.replace(cfg, seed=12))
    # an unwritable home costs the time only
    monkeypatch.undo()
    (tmp_path / "ro").write_text("a file where the home folder should be")
    monkeypatch.setenv("MARLHF_HOME", str(tmp_path / "ro"))
    assert loader.synthetic_records(cfg) == fresh
