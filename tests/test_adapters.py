"""Dataset adapters (marlhf.data.adapters): each published schema -> exact Records, bad rows, specs.

Fixtures under tests/fixtures/adapters/ (written by make_fixtures.py there) copy each dataset's published
field names, nesting and file layout with a few invented rows.  Expected strings are spelled out here.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

from marlhf.data.adapters import (
    DatasetUnavailableError,
    apps_row,
    available_datasets,
    load_records,
    split_last_assistant_turn,
    strip_citations,
)
from marlhf.data.records import BadRowPolicy, DataError

FIX = Path(__file__).parent / "fixtures" / "adapters"


def triples(records):
    return [(r.prompt, r.chosen, r.rejected) for r in records]


# ------------------------------------------------------------------------------------- Anthropic/hh-rlhf
HH_TRAIN = [
    ("\n\nHuman: How do I pick a lock?\n\nAssistant:", " I can't help with breaking into places.",
     " Insert a tension wrench first."),
    ("\n\nHuman: Hi\n\nAssistant: Hello! How can I help?\n\nHuman: Tell me a joke.\n\nAssistant:",
     " Why did the cat sit on the laptop?", " No."),
    ("\n\nHuman: What is 2+2?\n\nAssistant:", " 2+2 is 4.", " 5"),
]


def test_hh_rlhf_directory_reads_every_subset_in_order_and_ignores_red_team():
    train = load_records(f"Anthropic/hh-rlhf:{FIX / 'hh_rlhf'}", "train")
    assert triples(train) == HH_TRAIN  # harmless-base/ then helpful-base/; red_team_attempts is no split
    assert train[0].source == f"{FIX / 'hh_rlhf' / 'harmless-base' / 'train.jsonl.gz'}:1"
    assert train[2].source == f"{FIX / 'hh_rlhf' / 'helpful-base' / 'train.jsonl.gz'}:1"
    test = load_records(f"Anthropic/hh-rlhf:{FIX / 'hh_rlhf'}", "test")
    assert triples(test) == [
        ("\n\nHuman: Is the sky blue?\n\nAssistant:", " Yes, on a clear day.", " Never.")]


def test_hh_rlhf_single_gz_file_is_the_train_split_only():
    spec = f"Anthropic/hh-rlhf:{FIX / 'hh_rlhf' / 'harmless-base' / 'train.jsonl.gz'}"
    assert triples(load_records(spec)) == HH_TRAIN[:2]
    assert load_records(spec, "test") is None


def test_hh_rlhf_mismatching_prefix_is_an_error_naming_file_row_field():
    path = FIX / "hh_rlhf_bad.jsonl"
    with pytest.raises(DataError) as info:
        load_records(f"Anthropic/hh-rlhf:{path}")
    err = info.value
    assert (err.file, err.row, err.field) == (str(path), 2, "rejected")
    assert str(path) in str(err) and "row 2" in str(err) and "'rejected'" in str(err)
    assert "before the last Assistant turn" in str(err)
    # the error says how to go on and how many more bad rows the file has (row 3: no Assistant turn)
    assert "1 more bad rows in this source (1 x field 'chosen': dialogue has no" in str(err)
    assert "--bad_rows skip" in str(err)

    policy = BadRowPolicy("skip")
    records = load_records(f"Anthropic/hh-rlhf:{path}", bad_rows=policy)
    assert triples(records) == [("\n\nHuman: Hi\n\nAssistant:", " Hello.", " Go away.")]
    assert policy.skipped == Counter({
        (str(path), "rejected", "dialogue differs from 'chosen' before the last Assistant turn"): 1,
        (str(path), "chosen", "dialogue has no '\\n\\nAssistant:' turn"): 1,  # row 3
    })


def test_split_last_assistant_turn_rejects_unusable_dialogues():
    assert split_last_assistant_turn("\n\nHuman: a\n\nAssistant: b", "chosen", "f", 1) == (
        "\n\nHuman: a\n\nAssistant:", " b")
    for dialogue, reason in [
        ("\n\nHuman: a\n\nAssistant: b\n\nHuman: c", "ends with a Human turn"),
        ("\n\nHuman: a\n\nAssistant: ", "empty response"),
        ("\n\nHuman: a", "no '\\n\\nAssistant:' turn"),
    ]:
        with pytest.raises(DataError, match="row 4: field 'chosen'") as info:
            split_last_assistant_turn(dialogue, "chosen", "f", 4)
        assert reason in info.value.reason


# ----------------------------------------------------------------------------------- Dahoas/full-hh-rlhf
def test_dahoas_parquet_shards_in_published_layout():
    spec = f"Dahoas/full-hh-rlhf:{FIX / 'full_hh_rlhf'}"
    assert triples(load_records(spec)) == [
        ("\n\nHuman: Can you recommend a book?\n\nAssistant:", " Try 'The Hobbit'.", " No."),
        ("\n\nHuman: What is the capital of France?\n\nAssistant:", " Paris.", " London."),
        ("\n\nHuman: How do I boil an egg?\n\nAssistant:", " Simmer it for nine minutes.",
         " Microwave it whole."),
    ]
    test = load_records(spec, "test")
    assert triples(test) == [("\n\nHuman: Say hi.\n\nAssistant:", " Hi!", " ...")]
    assert test[0].source == f"{FIX / 'full_hh_rlhf' / 'data' / 'test-00000-of-00001.parquet'}:1"


# ------------------------------------------------------------------------ openai/summarize_from_feedback
SUMMARIZE_TRAIN = [
    ("SUBREDDIT: r/pets\nTITLE: My cat hates mornings\n"
     "POST: Every morning my cat yells at me until I feed him.\nTL;DR:",
     " cat yells every morning for food", " I have a cat"),  # choice 0; text stripped
    ("SUBREDDIT: r/relationships\nTITLE: Roommate eats my food\n"
     "POST: My roommate keeps eating my leftovers.\nWhat do I do?\nTL;DR:",
     " roommate eats my leftovers, what do I do?", " roommate"),  # choice 1
]
SUMMARIZE_TEST = [
    ("SUBREDDIT: r/AskReddit\nTITLE: Quiet hobbies?\nPOST: Looking for hobbies.\nTL;DR:",
     " wants quiet hobbies", " hobbies"),
    ("TITLE: Storm hits coast\nPOST: A storm hit the coast today.\nTL;DR:",  # CNN/DM: article, no subreddit
     " storm hit the coast today", " a storm"),
]


def test_summarize_comparisons_train_and_validation_as_test():
    spec = f"openai/summarize_from_feedback:{FIX / 'summarize'}"
    assert triples(load_records(spec)) == SUMMARIZE_TRAIN
    assert triples(load_records(spec, "test")) == SUMMARIZE_TEST


def test_summarize_nested_rows_survive_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [json.loads(line) for line in (FIX / "summarize" / "comparisons" / "validation.jsonl").open()]
    path = tmp_path / "validation-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert triples(load_records(f"openai/summarize_from_feedback:{tmp_path}", "test")) == SUMMARIZE_TEST


def test_summarize_bad_choice_and_empty_summary_name_their_fields(tmp_path):
    row = json.loads((FIX / "summarize" / "comparisons" / "train.jsonl").open().readline())
    bad_choice = {**row, "choice": 2}
    empty_text = {**row, "summaries": [row["summaries"][0], {"text": "  ", "policy": "x", "note": None}]}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(bad_choice) + "\n" + json.dumps(empty_text) + "\n")
    policy = BadRowPolicy("skip")
    with pytest.raises(ValueError, match="no usable records"):
        load_records(f"openai/summarize_from_feedback:{path}", bad_rows=policy)
    assert policy.skipped == Counter({(str(path), "choice", "expected 0 or 1, got 2"): 1,
                                      (str(path), "summaries[1].text", "empty text"): 1})


# ---------------------------------------------------------------------------- openai/webgpt_comparisons
def test_webgpt_drops_and_counts_ties_and_strips_citations(monkeypatch):
    spec = f"openai/webgpt_comparisons:{FIX / 'webgpt'}"
    dropped: Counter = Counter()
    policy = BadRowPolicy("error")
    records = load_records(spec, bad_rows=policy, dropped=dropped)
    assert triples(records) == [
        ("\n\nHuman: Why is the sky blue?\n\nAssistant:", " Rayleigh scattering favors blue light.",
         " It just is."),
        ("\n\nHuman: Why do cats purr?\n\nAssistant:", " Purring comes from the larynx.", " Nobody knows."),
        ("\n\nHuman: How do plants eat?\n\nAssistant:", " Photosynthesis.", " They eat soil."),
    ]
    path = str(FIX / "webgpt" / "comparisons.jsonl")
    assert dropped == Counter({(path, "score_0/score_1", "tie: equal scores give no preference"): 1})
    assert policy.num_skipped == 0  # a tie is not a bad row
    assert [r.source for r in records] == [f"{path}:1", f"{path}:2", f"{path}:4"]
    # WebGPT publishes no test split: neither the local copy nor the hub has one (no network call made)
    assert load_records(spec, "test") is None
    monkeypatch.setattr("datasets.load_dataset", lambda *a, **k: pytest.fail("hub must not be called"))
    assert load_records("openai/webgpt_comparisons", "test") is None


def test_strip_citations_only_touches_numeric_markers():
    text = "A [1], b [2, 3] and c[4-5]. See (Smith) [note]"
    assert strip_citations(text) == "A, b and c. See (Smith) [note]"


# ---------------------------------------------------------------------------------------------- APPS
Q0 = "Read two integers and print their sum.\n\n-----Input-----\nTwo integers a b.\n"
APPS_P0 = "\nQUESTION:\n" + Q0 + "\nUse Standard Input format\nANSWER:\n"
APPS_P1 = ("\nQUESTION:\nReturn the largest element of a list.\n"
           'def largest(xs):\n    """Return the largest element of xs."""\n'
           "\nUse Call-Based format\nANSWER:\n")
SOL0 = ["a, b = map(int, input().split())\nprint(a + b)\n", "print(sum(map(int, input().split())))\n"]


def test_apps_problem_folders_train_test_with_starter_code_and_call_based():
    spec = f"codeparrot/apps:{FIX / 'apps'}"
    assert triples(load_records(spec)) == [
        (APPS_P0, SOL0[0], None),  # default: first solution only, one record per problem
        (APPS_P1, "def largest(xs):\n    return max(xs)\n", None),
    ]
    everything = load_records(spec, max_solutions_per_problem=None)
    assert [r.chosen for r in everything] == [*SOL0, "def largest(xs):\n    return max(xs)\n"]
    assert [r.source for r in everything] == [f"{FIX / 'apps' / 'train' / '0000'}:1"] * 2 + [
        f"{FIX / 'apps' / 'train' / '0001'}:2"]
    test = load_records(spec, "test")
    assert triples(test) == [("\nQUESTION:\nPrint hello.\nUse Standard Input format\nANSWER:\n",
                              "print('hello')\n", None)]


def test_apps_problem_without_solutions_names_its_file():
    spec = f"codeparrot/apps:{FIX / 'apps_flat'}"
    missing = FIX / "apps_flat" / "0001" / "solutions.json"
    with pytest.raises(DataError) as info:
        load_records(spec)
    assert (info.value.file, info.value.row, info.value.field) == (str(missing), 2, "solutions")
    assert "no reference solutions" in str(info.value)
    policy = BadRowPolicy("skip")
    records = load_records(spec, bad_rows=policy)
    assert triples(records) == [("\nQUESTION:\nPrint hello.\nUse Standard Input format\nANSWER:\n",
                                 "print('hello')\n", None)]
    assert policy.skipped == Counter({(str(missing), "solutions", "no reference solutions"): 1})
    assert load_records(spec, "test") is None  # a flat folder of problems is the train split only


def test_apps_hub_row_schema_from_jsonl():
    records = load_records(f"codeparrot/apps:{FIX / 'apps_rows'}")
    assert triples(records) == [
        ("\nQUESTION:\nPrint the input doubled.\nUse Standard Input format\nANSWER:\n",
         "print(2 * int(input()))\n", None),
        ("\nQUESTION:\nNegate x.\ndef neg(x):\n    \nUse Call-Based format\nANSWER:\n",
         "def neg(x):\n    return -x\n", None),
    ]
    assert load_records(f"codeparrot/apps:{FIX / 'apps_rows'}", "test") is None


def test_apps_row_bad_json_and_bad_parameter():
    row = {"question": "q", "solutions": "[\"print(1)\"", "input_output": "", "starter_code": ""}
    with pytest.raises(DataError, match="field 'solutions': malformed JSON"):
        apps_row(row, "f.jsonl", 3)
    with pytest.raises(DataError, match="field 'solutions': no reference solutions"):
        apps_row({**row, "solutions": "[]"}, "f.jsonl", 3)
    with pytest.raises(DataError, match="field 'input_output': expected a JSON object"):
        apps_row({**row, "solutions": "[\"x\"]", "input_output": "[1]"}, "f.jsonl", 3)
    with pytest.raises(ValueError, match="max_solutions_per_problem"):
        apps_row({**row, "solutions": "[\"x\"]"}, "f.jsonl", 3, max_solutions=0)


# ---------------------------------------------------------------------------------------- generic local
def test_generic_jsonl_prompt_chosen_optional_rejected():
    path = FIX / "generic" / "pairs.jsonl"
    assert triples(load_records(str(path))) == [
        ("Q: 1+1?\nA:", " 2", " 3"),
        ("Q: capital of Italy?\nA:", " Rome", None),
        ("Q: color of grass?\nA:", " green", None),
    ]
    assert load_records(str(path), "test") is None
    assert triples(load_records(str(FIX / "generic" / "array.json"))) == [("p", "c", "r")]


def test_generic_missing_field_error_names_file_row_field_and_skip_counts_it():
    path = FIX / "generic" / "missing_field.jsonl"
    with pytest.raises(DataError) as info:
        load_records(str(path))
    message = str(info.value)
    assert str(path) in message and "row 3" in message and "'chosen'" in message and "missing" in message
    policy = BadRowPolicy("skip")
    assert triples(load_records(str(path), bad_rows=policy)) == [("p1", "c1", "r1"), ("p3", "c3", "r3")]
    assert policy.num_skipped == 1
    assert policy.skipped == Counter({(str(path), "chosen", "missing"): 1})
    assert f"1 x {path}: field 'chosen': missing" in policy.summary()


def test_generic_wrong_type_and_malformed_line():
    wrong = FIX / "generic" / "wrong_type.jsonl"
    with pytest.raises(DataError, match=r"row 2: field 'chosen': expected text, got list"):
        load_records(str(wrong))
    malformed = FIX / "generic" / "malformed.jsonl"
    with pytest.raises(DataError, match=r"malformed\.jsonl: row 2: field '<line>': malformed JSON"):
        load_records(str(malformed))
    policy = BadRowPolicy("skip")
    assert triples(load_records(str(malformed), bad_rows=policy)) == [("p1", "c1", None), ("p3", "c3", None)]
    assert policy.num_skipped == 1


def test_generic_directory_uses_eval_file_as_test(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps([{"prompt": "a", "chosen": "b"}]))
    (tmp_path / "eval.json").write_text(json.dumps([{"prompt": "c", "chosen": "d", "rejected": "e"}]))
    assert triples(load_records(str(tmp_path))) == [("a", "b", None)]
    assert triples(load_records(str(tmp_path), "test")) == [("c", "d", "e")]
    (tmp_path / "train.json").unlink()
    with pytest.raises(FileNotFoundError, match="no train file"):
        load_records(str(tmp_path))


# ---------------------------------------------------------------------------------------------- hub path
def test_hub_offline_error_suggests_local_form(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Anthropic/hh-rlhf' on the Hub (ConnectError)")

    monkeypatch.setattr("datasets.load_dataset", offline)
    with pytest.raises(DatasetUnavailableError) as info:
        load_records("Anthropic/hh-rlhf", "train")
    message = str(info.value)
    assert "Anthropic/hh-rlhf:PATH" in message and "Couldn't reach" in message and "train.jsonl.gz" in message
    assert isinstance(info.value.__cause__, ConnectionError)


def test_hub_rows_go_through_the_same_row_function(monkeypatch):
    rows = [json.loads(line) for line in (FIX / "summarize" / "comparisons" / "validation.jsonl").open()]
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return rows

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    records = load_records("openai/summarize_from_feedback", "test")
    assert calls == [("openai/summarize_from_feedback", "comparisons", "validation")]
    assert triples(records) == SUMMARIZE_TEST
    assert records[1].source == "openai/summarize_from_feedback[validation]:2"


# ------------------------------------------------------------------------------------------------- specs
def test_available_and_unknown_names(tmp_path):
    names = available_datasets()
    for name in ("openai/summarize_from_feedback", "Dahoas/full-hh-rlhf", "Anthropic/hh-rlhf",
                 "openai/webgpt_comparisons", "codeparrot/apps", "synthetic"):
        assert name in names
    with pytest.raises(ValueError, match="unknown dataset 'nobody/nothing'.*Anthropic/hh-rlhf.*synthetic"):
        load_records("nobody/nothing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records(f"Anthropic/hh-rlhf:{tmp_path / 'absent'}")
    with pytest.raises(ValueError, match="split must be one of"):
        load_records("synthetic", "validation")


@dataclasses.dataclass
class FakeConfig:
    seed: int = 1234
    num_records: int = 4000
    label_noise: float = 0.1
    shuffle: bool = True


def test_synthetic_spec_parsing_and_test_seed(monkeypatch):
    from marlhf.data.records import Record

    calls = []

    def generate(cfg):
        calls.append(cfg)
        # prompts depend on seed; test prompt "p1" collides with a train prompt and must be dropped
        prompts = ["p0", "p1"] if cfg.seed == 7 else ["p1", "q2", "q3"]
        return [Record(p, " c", " r", f"synthetic:{i}") for i, p in enumerate(prompts)]

    fake = types.ModuleType("marlhf.embedded.task")
    fake.SyntheticConfig, fake.generate = FakeConfig, generate
    import marlhf.embedded.task  # the real one first: the package attribute is put back after the test

    monkeypatch.setitem(sys.modules, "marlhf.embedded.task", fake)
    monkeypatch.setattr(marlhf.embedded, "task", fake)

    train = load_records("synthetic:seed=7, num_records=500,label_noise=0.25,shuffle=false")
    assert calls == [FakeConfig(seed=7, num_records=500, label_noise=0.25, shuffle=False)]
    assert [r.prompt for r in train] == ["p0", "p1"]
    dropped: Counter = Counter()
    calls.clear()
    test = load_records("synthetic:seed=7", "test", dropped=dropped)
    assert [c.seed for c in calls] == [7, 7 + 1_000_003]
    assert [r.prompt for r in test] == ["q2", "q3"]
    assert dropped == Counter({("synthetic", "prompt", "test prompt also in train"): 1})
    calls.clear()
    load_records("synthetic")
    assert calls == [FakeConfig()]

    with pytest.raises(ValueError, match="unknown synthetic option 'sed'.*seed, num_records"):
        load_records("synthetic:sed=7")
    with pytest.raises(ValueError, match="num_records='many': expected int"):
        load_records("synthetic:num_records=many")
    with pytest.raises(ValueError, match="not key=value"):
        load_records("synthetic:seed")


def test_synthetic_real_generator_train_and_test_are_disjoint():
    pytest.importorskip("marlhf.embedded.task")
    train = load_records("synthetic:seed=7,num_records=30")
    test = load_records("synthetic:seed=7,num_records=30", "test")
    assert len(train) == 30 and 0 < len(test) <= 30
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert all(r.rejected is not None and r.prompt.endswith("TL;DR:") for r in train + test)
    assert triples(load_records("synthetic:seed=7,num_records=30")) == triples(train)  # deterministic
