"""Preference pairs on a policy's own answers (marlhf/data/onpolicy.py, ``marlhf label``): the simulated
annotator's label rate against its Bradley–Terry formula, labels that depend on the seed only, pairing, and the
command's folder (readable by --data_path, cached by its inputs)."""

import json
import math
import random

import pytest

from marlhf.cli.label import main as label_main
from marlhf.data.onpolicy import Answer, label_pairs, preference_probability, split_by_prompt


def sigmoid(x):
    return 1 / (1 + math.exp(-x)) if x >= 0 else 1 - 1 / (1 + math.exp(x))


def test_probability_is_the_bradley_terry_formula():
    for a, b, tau in ((1.0, 0.5, 0.1), (0.2, 0.9, 0.3), (5.0, -5.0, 0.01), (-700.0, 700.0, 0.5), (0.3, 0.3, 0.2)):
        assert preference_probability(a, b, tau) == pytest.approx(sigmoid((a - b) / tau), abs=1e-12)
    assert [preference_probability(a, b, 0) for a, b in ((1, 0), (0, 1), (2, 2))] == [1.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="--tau"):
        preference_probability(0, 0, -1)


def groups_of(diffs: list[float], per_diff: int, seed: int = 0) -> tuple[dict, dict]:
    """Prompts with two answers whose scores differ by each of ``diffs``; returns (groups, score table)."""
    groups, table = {}, {}
    for d in diffs:
        for i in range(per_diff):
            pid = f"d{d}-{i}"
            a, b = f"{pid} first", f"{pid} second"
            groups[pid] = [Answer(pid, 0, pid, a, True), Answer(pid, 1, pid, b, True)]
            table[a], table[b] = 0.5 + d, 0.5
    return groups, table


def scorer_of(table):
    return lambda prompts, responses, ended: [table[r] for r in responses]


def test_label_rate_matches_the_formula_over_many_pairs():
    """Over 3,000 pairs per score difference, the share labelled 'first answer preferred' is σ(d/τ) within 4
    binomial standard errors (a false alarm about once in 16,000 runs per difference; the draws are seeded, so
    the test is deterministic)."""
    tau, n, diffs = 0.2, 3000, [0.0, 0.05, 0.2, 0.5]
    groups, table = groups_of(diffs, n)
    pairs, counts = label_pairs(groups, scorer_of(table), tau, seed=11)
    assert counts["pairs"] == len(diffs) * n and counts["identical_dropped"] == 0
    for d in diffs:
        wins = sum(p["chosen"].endswith("first") for p in pairs if p["meta"]["prompt_id"].startswith(f"d{d}-"))
        p_true = sigmoid(d / tau)
        se = math.sqrt(p_true * (1 - p_true) / n)
        assert abs(wins / n - p_true) <= 4 * se, (d, wins / n, p_true)
    # every label is recorded with its probability and the annotator's scores in (chosen, rejected) order
    for p in pairs[:50]:
        g_c, g_r = p["meta"]["annotator_scores"]
        assert p["meta"]["p_chosen"] == pytest.approx(sigmoid((g_c - g_r) / tau))
    assert counts["against_annotator_order"] == sum(p["meta"]["annotator_scores"][0] <
                                                    p["meta"]["annotator_scores"][1] for p in pairs)


def test_tau_zero_follows_the_annotator_and_flips_coins_on_ties():
    groups, table = groups_of([0.0, 0.3], 400)
    pairs, counts = label_pairs(groups, scorer_of(table), 0.0, seed=3)
    assert all(p["chosen"].endswith("first") for p in pairs if p["meta"]["prompt_id"].startswith("d0.3"))
    tie_wins = sum(p["chosen"].endswith("first") for p in pairs if p["meta"]["prompt_id"].startswith("d0.0"))
    assert 400 * 0.5 - 4 * 10 <= tie_wins <= 400 * 0.5 + 4 * 10  # binomial(400, 1/2): sd 10
    assert counts["annotator_ties"] == 400 and counts["against_annotator_order"] == 0


def test_labels_depend_on_the_seed_only_not_on_order():
    groups, table = groups_of([0.1], 300)
    first, _ = label_pairs(groups, scorer_of(table), 0.3, seed=5)
    shuffled = list(groups.items())
    random.Random(0).shuffle(shuffled)
    again, _ = label_pairs(dict(shuffled), scorer_of(table), 0.3, seed=5)
    key = lambda p: p["meta"]["prompt_id"]  # noqa: E731
    assert sorted(first, key=key) == sorted(again, key=key)
    other, _ = label_pairs(groups, scorer_of(table), 0.3, seed=6)
    assert sum(a["chosen"] != b["chosen"] for a, b in zip(first, other)) > 30


def test_k_answers_make_disjoint_pairs_and_identical_ones_are_dropped():
    answers = [Answer("p", k, "P", text, True) for k, text in enumerate(["a", "b", "c", "c", "e"])]
    pairs, counts = label_pairs({"p": answers}, lambda p, r, e: [float(ord(x)) for x in r], 0.0, seed=0)
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("b", "a")]  # c-c dropped, e has no partner
    assert (counts["pairs"], counts["identical_dropped"], counts["answers"]) == (1, 1, 5)


def test_all_pairs_of_k_answers_and_dropped_ties():
    """``pairing="all"``: the K(K−1)/2 pairs of a prompt, each once, against a brute-force enumeration;
    ``ties="drop"``: the pairs the annotator scores equal leave, counted; the other labels are unchanged."""
    texts = ["a", "b", "c", "c", "e"]
    score = {"a": 1.0, "b": 2.0, "c": 2.0, "e": 0.5}
    answers = [Answer("p", k, "P", t, True) for k, t in enumerate(texts)]
    scorer = lambda p, r, e: [score[x] for x in r]  # noqa: E731
    pairs, counts = label_pairs({"p": answers}, scorer, 0.0, seed=0, pairing="all")
    expected = [(texts[i], texts[j]) for i in range(5) for j in range(i + 1, 5) if texts[i] != texts[j]]
    assert len(pairs) == len(expected) == 9 and counts["identical_dropped"] == 1
    assert sorted(tuple(sorted((p["chosen"], p["rejected"]))) for p in pairs) == sorted(
        tuple(sorted(e)) for e in expected)
    for p in pairs:  # tau 0: the higher score is chosen; b-c (2 vs 2) twice is a coin flip
        if score[p["chosen"]] != score[p["rejected"]]:
            assert score[p["chosen"]] > score[p["rejected"]]
    assert counts["annotator_ties"] == 2 and counts["ties_dropped"] == 0
    dropped, dcounts = label_pairs({"p": answers}, scorer, 0.0, seed=0, pairing="all", ties="drop")
    assert dcounts["pairs"] == 7 and dcounts["ties_dropped"] == dcounts["annotator_ties"] == 2
    assert dropped == [p for p in pairs if score[p["chosen"]] != score[p["rejected"]]]
    with pytest.raises(ValueError, match="--pairing"):
        label_pairs({"p": answers}, scorer, 0.0, seed=0, pairing="ring")
    with pytest.raises(ValueError, match="--ties"):
        label_pairs({"p": answers}, scorer, 0.0, seed=0, ties="coin")


def test_pairs_with_an_empty_answer_are_dropped_and_counted():
    """A policy answer that is only the end token decodes to "" (or blanks): no record can hold it."""
    answers = [Answer("p", k, "P", text, True) for k, text in enumerate(["a", "", "b", "  "])]
    pairs, counts = label_pairs({"p": answers}, lambda p, r, e: [float(len(x)) for x in r], 0.0, seed=0,
                                pairing="all")
    assert [(p["chosen"], p["rejected"]) in (("a", "b"), ("b", "a")) for p in pairs] == [True]
    assert counts["empty_dropped"] == 5 and counts["identical_dropped"] == 0


def test_annotator_errors_are_caught():
    groups, table = groups_of([0.1], 2)
    with pytest.raises(ValueError, match="non-finite"):
        label_pairs(groups, lambda p, r, e: [float("nan")] * len(r), 0.1, seed=0)
    with pytest.raises(ValueError, match="3 scores for 4 answers"):
        label_pairs(groups, lambda p, r, e: [0.0] * 3, 0.1, seed=0)


def test_split_holds_out_whole_prompts():
    groups, table = groups_of([0.1, 0.2], 50)
    pairs, _ = label_pairs(groups, scorer_of(table), 0.1, seed=0)
    train, test = split_by_prompt(pairs, 0.2, seed=1)
    assert len(test) == 20 and len(train) == 80
    assert not {p["meta"]["prompt_id"] for p in train} & {p["meta"]["prompt_id"] for p in test}
    assert split_by_prompt(pairs, 0.2, seed=1) == (train, test)


def write_generations(path, prompts_answers):
    rows = [{"prompt_id": f"train-{i}", "sample": k, "prompt": prompt, "response": resp, "ended": True}
            for i, (prompt, answers) in enumerate(prompts_answers) for k, resp in enumerate(answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_command_labels_synthetic_answers_with_the_gold_scorer(tmp_path):
    """Answers to the embedded task's prompts: a right summary against a dropped-fact one is labelled as the gold
    scorer orders them (τ = 0), the folder reads back as a local dataset, and a rerun with the same inputs finds
    it done while another τ relabels."""
    from marlhf.data.adapters.loader import load_records
    from marlhf.embedded.task import SyntheticConfig, generate, gold_score

    recs = generate(SyntheticConfig(num_records=40, seed=3))
    gen = tmp_path / "answers.jsonl"
    write_generations(gen, [(r.prompt, [r.rejected, r.chosen]) for r in recs])
    out = tmp_path / "pairs"
    assert label_main(["--generations", str(gen), "--annotator", "gold", "--tau", "0", "--eval_fraction", "0.25",
                       "--output", str(out)]) == 0
    train = load_records(str(out), split="train")
    test = load_records(str(out), split="test")
    assert len(train) + len(test) == sum(r.chosen != r.rejected for r in recs) and len(test) == 10
    for rec in [*train, *test]:
        assert gold_score(rec.prompt, rec.chosen) >= gold_score(rec.prompt, rec.rejected)
    info = json.loads((out / "label.json").read_text())
    assert info["counts"]["against_annotator_order"] == 0 and info["settings"]["tau"] == 0.0
    stamp = (out / "train.jsonl").stat().st_mtime_ns
    assert label_main(["--generations", str(gen), "--annotator", "gold", "--tau", "0", "--eval_fraction", "0.25",
                       "--output", str(out)]) == 0
    assert (out / "train.jsonl").stat().st_mtime_ns == stamp  # cached: same inputs
    assert label_main(["--generations", str(gen), "--annotator", "gold", "--tau", "5", "--eval_fraction", "0.25",
                       "--output", str(out)]) == 0
    assert json.loads((out / "label.json").read_text())["settings"]["tau"] == 5.0
    for flag, value in (("--pairing", "all"), ("--ties", "drop")):  # each input that changes the pairs relabels
        assert label_main(["--generations", str(gen), "--annotator", "gold", "--tau", "5", "--eval_fraction", "0.25",
                           flag, value, "--output", str(out)]) == 0
        assert json.loads((out / "label.json").read_text())["settings"][flag[2:]] == value


def test_command_errors_name_the_problem(tmp_path):
    from marlhf.errors import ConfigError, UserError

    gen = tmp_path / "g.jsonl"
    gen.write_text(json.dumps({"prompt_id": "a", "sample": 0, "prompt": "p", "response": "r"}) + "\n"
                   + json.dumps({"prompt_id": "a", "sample": "one", "prompt": "p", "response": "r"}) + "\n")
    with pytest.raises(UserError, match=r"g\.jsonl.*2.*sample"):
        label_main(["--generations", str(gen), "--output", str(tmp_path / "o")])
    write_generations(gen, [("p", ["only one"])])
    with pytest.raises(ConfigError, match="num_samples 2"):
        label_main(["--generations", str(gen), "--output", str(tmp_path / "o")])
    with pytest.raises(ConfigError, match="--annotator"):
        write_generations(gen, [("p", ["x", "y"])])
        label_main(["--generations", str(gen), "--annotator", "oracle", "--output", str(tmp_path / "o")])


def test_experiment_script_scores_pairs_against_the_gold_order(tmp_path):
    """scripts/onpolicy_reward.py's accuracy: right when the model orders a pair as the gold scores do
    (whatever the annotator's coin said), per gold-gap bucket; ties count against the label."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("onpolicy_reward", REPO / "scripts" / "onpolicy_reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    golds = [(0.9, 0.5), (0.5, 0.9), (0.60, 0.55), (0.7, 0.7), (0.7, 0.7)]  # 2nd: the annotator's coin flipped
    said = [(1.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 0.0), (0.0, 1.0)]  # model's (chosen, rejected) scores
    pairs, scores = tmp_path / "p.jsonl", tmp_path / "s.jsonl"
    pairs.write_text("".join(json.dumps({"meta": {"annotator_scores": list(g)}}) + "\n" for g in golds))
    scores.write_text("".join(json.dumps({"chosen_score": c, "rejected_score": r}) + "\n" for c, r in said))
    acc = mod.pair_accuracy(pairs, scores)
    assert acc["gap >= 0.1"] == {"accuracy": 0.5, "pairs": 2}  # right on the first, wrong on the flipped one
    assert acc["0 < gap < 0.1"] == {"accuracy": 0.0, "pairs": 1}
    assert acc["tie"] == {"accuracy": 0.5, "pairs": 2}
    assert acc["gold separated"] == {"accuracy": 1 / 3, "pairs": 3}
    assert acc["all pairs"] == {"accuracy": 0.4, "pairs": 5}
    assert mod.mean_se([1.0, 2.0, 3.0]) == (2.0, pytest.approx(math.sqrt(1 / 3), abs=1e-15))  # lab/summary.py


def test_pooled_generations_take_the_first_answers_of_each_file_in_order():
    """An iterated round pools a new policy's answers with an earlier one's: per prompt, the first
    ``max_samples`` of each source in source order, renumbered 0, 1, ...; a prompt missing from a source pools
    what the others have; the same id naming two prompts is an error."""
    from marlhf.data.onpolicy import pool_generations
    from marlhf.errors import ConfigError

    def source(tag, prompts):
        return {pid: [Answer(pid, k, f"prompt {pid}", f"{tag}{k}", True) for k in range(n)] for pid, n in prompts}

    new, old = source("new", [("a", 2), ("b", 2)]), source("old", [("a", 4), ("c", 3)])
    pooled = pool_generations([new, old], max_samples=2)
    assert {pid: [x.response for x in g] for pid, g in pooled.items()} == {
        "a": ["new0", "new1", "old0", "old1"], "b": ["new0", "new1"], "c": ["old0", "old1"]}
    assert [x.sample for x in pooled["a"]] == [0, 1, 2, 3] and pooled["a"][2].prompt == "prompt a"
    assert [x.response for x in pool_generations([new, old])["a"]] == ["new0", "new1", "old0", "old1", "old2", "old3"]
    # all 6 pairs of a pooled prompt: one within each policy, four across
    pairs, counts = label_pairs({"a": pooled["a"]}, lambda p, r, e: [float(x.startswith("new")) + int(x[-1])
                                                                     for x in r], 0.0, seed=0, pairing="all")
    assert counts["pairs"] == 6 and sum(p["chosen"][:3] != p["rejected"][:3] for p in pairs) == 4
    clash = {"a": [Answer("a", 0, "another prompt", "x", True)]}
    with pytest.raises(ConfigError, match="'a'.*different prompts"):
        pool_generations([new, clash])
    with pytest.raises(ConfigError, match="--max_samples"):
        pool_generations([new], max_samples=-1)


def test_command_pools_several_files_and_caches_by_all_of_them(tmp_path):
    """``marlhf label --generations NEW OLD --max_samples 2``: the pairs mix both files' answers, and the folder
    is relabelled when either file or --max_samples changes."""
    from marlhf.embedded.task import SyntheticConfig, generate

    recs = [r for r in generate(SyntheticConfig(num_records=30, seed=4)) if r.chosen != r.rejected][:10]
    new, old, out = tmp_path / "new.jsonl", tmp_path / "old.jsonl", tmp_path / "pairs"
    write_generations(new, [(r.prompt, [r.chosen, r.rejected]) for r in recs])
    write_generations(old, [(r.prompt, [r.chosen + " Old.", r.rejected + " Old.", "ccc"]) for r in recs])
    argv = ["--generations", str(new), str(old), "--max_samples", "2", "--pairing", "all", "--eval_fraction", "0",
            "--output", str(out)]
    assert label_main(argv) == 0
    info = json.loads((out / "label.json").read_text())
    assert info["counts"]["answers"] == 40 and info["counts"]["pairs"] == 60  # 4 answers, 6 pairs per prompt
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert sum(r["chosen"].endswith("Old.") != r["rejected"].endswith("Old.") for r in rows) == 40  # 4 of 6 across
    assert not any("ccc" in r["chosen"] + r["rejected"] for r in rows)  # the third old answer is not taken
    stamp = (out / "train.jsonl").stat().st_mtime_ns
    assert label_main(argv) == 0 and (out / "train.jsonl").stat().st_mtime_ns == stamp  # cached
    write_generations(old, [(r.prompt, [r.chosen + " Changed.", r.rejected + " Old."]) for r in recs])
    assert label_main(argv) == 0 and (out / "train.jsonl").stat().st_mtime_ns != stamp  # one file changed
    assert label_main(argv[:3] + ["--max_samples", "1"] + argv[5:]) == 0
    assert json.loads((out / "label.json").read_text())["counts"]["answers"] == 20
