"""Config parsing, phase splits, tokenization (response-only labels, over-long prompts) and the cache."""

import json
import math

import pytest
import torch

from marlhf.config import RewardArgs, RLHFArgs, SFTArgs, parse_args
from marlhf.data.formatting import LongPromptPolicy
from marlhf.data.pipeline import (
    PairCollator,
    PromptCollator,
    SFTCollator,
    build_phase_data,
    held_out_part,
    holdout_indices,
    split_indices,
    tokenize_phase,
)
from marlhf.data.records import BadRowPolicy, DataError, Record
from marlhf.errors import ConfigError
from marlhf.sections import DataSection, LoopSection

# ---------------------------------------------------------------------------------------------- config


def test_deepspeed_chat_flags_parse_with_their_meaning():
    args, ns = parse_args(RLHFArgs, ["--data_path", "a", "b", "--ngram", "inf", "--actor_zero_stage", "2",
                                     "--critic_zero_stage", "3", "--offload_reference_model", "--deepspeed",
                                     "--termination_condition", "ppl", "--value_function", "position"])
    assert args.data_path == ["a", "b"] and args.ngram_n is None
    assert (args.actor_zero_stage, args.critic_zero_stage) == (2, 3)
    assert args.offload_reference_model and ns.deepspeed
    assert parse_args(RLHFArgs, ["--ngram", "1"])[0].ngram_n == 1
    sft, _ = parse_args(SFTArgs, ["--bf16", "--output_dir", "/tmp/x"])
    assert sft.dtype == "bf16" and sft.tensorboard_path == ""  # the flag as given; the loop's default:
    assert LoopSection.build(sft).tensorboard_path == "/tmp/x/tensorboard"


@pytest.mark.parametrize("argv, message", [
    (["--data_split", "2,4"], "data_split"),
    (["--ngram", "-3"], "ngram"),
    (["--only_optimize_lora"], "lora_dim"),
    (["--per_device_training_batch_size", "16", "--per_device_generation_batch_size", "4"], "exceed"),
])
def test_bad_flag_values_are_rejected_with_the_flag_named(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(RLHFArgs, argv)


def test_unknown_choice_exits():
    with pytest.raises(SystemExit):
        parse_args(RLHFArgs, ["--termination_condition", "sentence"])


def test_config_file_is_merged_under_the_command_line(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"learning_rate": 0.5, "zero_stage": 3, "seed": 7}))
    args, _ = parse_args(RewardArgs, ["--config", str(cfg), "--seed", "9"])
    assert (args.learning_rate, args.zero_stage, args.seed) == (0.5, 3, 9)
    cfg.write_text(json.dumps({"not_a_flag": 1}))
    with pytest.raises(ValueError, match="not_a_flag"):
        parse_args(RewardArgs, ["--config", str(cfg)])


# ---------------------------------------------------------------------------------------------- splits


def test_split_is_a_deterministic_partition():
    n = 1001
    parts = [split_indices(n, "2,4,4", phase, seed=3) for phase in (1, 2, 3)]
    assert [len(p) for p in parts] == [200, 401, 400]  # cuts at round(1001 * 0.2) = 200, round(1001 * 0.6) = 601
    assert sorted(sum(parts, [])) == list(range(n))  # disjoint and complete
    assert parts == [split_indices(n, "2,4,4", phase, seed=3) for phase in (1, 2, 3)]
    assert parts[0] != split_indices(n, "2,4,4", 1, seed=4)
    assert split_indices(10, "10,0,0", 2, seed=0) == []


def test_holdout_is_disjoint_from_train():
    train, held = holdout_indices(200, 0.05, seed=1)
    assert len(held) == 10 and not set(train) & set(held) and len(train) + len(held) == 200


# ---------------------------------------------------------------------------------------------- tokenization
class CharTokenizer:
    """One id per character, BOS = 1: enough to check label masking and limits exactly."""

    def __call__(self, text):
        return {"input_ids": [1] + [ord(c) for c in text]}


def test_sft_labels_cover_exactly_the_response():
    recs = [Record("ab", " xyz", None, "f.jsonl:1")]
    items = tokenize_phase(recs, 1, CharTokenizer(), eot="$", max_seq_len=64, max_prompt_len=64,
                           policy=BadRowPolicy())
    assert items == [{"input_ids": [1, 97, 98, 32, 120, 121, 122, 36], "response_start": 3}]
    batch = SFTCollator(pad_id=0)(items + [{"input_ids": [1, 5, 6, 7], "response_start": 2}])
    assert batch["labels"].tolist() == [[-100, -100, -100, 32, 120, 121, 122, 36],
                                        [-100, -100, 6, 7, -100, -100, -100, -100]]
    assert batch["attention_mask"].sum(1).tolist() == [8, 4]
    # --prompt_loss (DeepSpeed-Chat's step 1): every real token is a label, padding still is not
    whole = SFTCollator(pad_id=0, prompt_loss=True)(items + [{"input_ids": [1, 5, 6, 7], "response_start": 2}])
    assert whole["labels"].tolist() == [[1, 97, 98, 32, 120, 121, 122, 36],
                                       [1, 5, 6, 7, -100, -100, -100, -100]]
    assert torch.equal(whole["input_ids"], batch["input_ids"])


def test_over_long_prompt_is_named_skipped_or_truncated():
    recs = [Record("a" * 10, " b", " c", "data/x.jsonl:7"), Record("a", " b", " c", "data/x.jsonl:8")]
    with pytest.raises(DataError, match=r"data/x.jsonl: row 7: field 'prompt'.*longer than the limit.*--long_prompts"):
        tokenize_phase(recs, 2, CharTokenizer(), eot="", max_seq_len=8, max_prompt_len=8, policy=BadRowPolicy(),
                       long_prompts=LongPromptPolicy("error"))
    skip = LongPromptPolicy("skip")
    items = tokenize_phase(recs, 2, CharTokenizer(), eot="", max_seq_len=8, max_prompt_len=8, policy=BadRowPolicy(),
                           long_prompts=skip)
    assert len(items) == 1 and skip.counts == {"skipped": 1}
    # RLHF prompts use the prompt limit alone
    items = tokenize_phase(recs, 3, CharTokenizer(), eot="", max_seq_len=0, max_prompt_len=11,
                           policy=BadRowPolicy(), long_prompts=LongPromptPolicy("error"))
    assert [len(i["prompt_ids"]) for i in items] == [11, 2]


HH_PROMPT = "\n\nHuman: first question\n\nAssistant: first answer\n\nHuman: why?\n\nAssistant:"


def test_long_prompts_keep_the_most_recent_turns():
    """Truncation cuts at the latest "\n\nHuman:" boundary that fits; with none fitting, the last tokens are
    kept.  The SFT labels still cover exactly the response (+ end token) in both cases."""
    tok = CharTokenizer()
    last_turn = HH_PROMPT[HH_PROMPT.rfind("\n\nHuman:"):]
    policy = LongPromptPolicy()
    limit = len(last_turn) + 1  # + BOS: only the last turn fits
    [item] = tokenize_phase([Record(HH_PROMPT, " ok", " no", "f:1")], 3, tok, eot="$", max_seq_len=0,
                            max_prompt_len=limit, policy=BadRowPolicy(), long_prompts=policy)
    assert item["prompt_ids"] == tok(last_turn)["input_ids"]
    # phase 1: the prompt must leave room for the answer, so it is cut to half of max_seq_len
    [sft] = tokenize_phase([Record(HH_PROMPT, " ok", None, "f:1")], 1, tok, eot="$", max_seq_len=2 * limit,
                           max_prompt_len=0, policy=BadRowPolicy(), long_prompts=policy)
    assert sft["input_ids"] == tok(last_turn + " ok$")["input_ids"] and sft["response_start"] == limit
    # no boundary fits: the last 10 tokens of the prompt, the response after them
    [cut] = tokenize_phase([Record(HH_PROMPT, " ok", None, "f:1")], 1, tok, eot="$", max_seq_len=20,
                           max_prompt_len=0, policy=BadRowPolicy(), long_prompts=policy)
    assert cut["input_ids"] == [ord(c) for c in HH_PROMPT[-10:] + " ok$"] and cut["response_start"] == 10
    assert policy.counts == {"truncated at a turn boundary": 2, "truncated inside a turn": 1}
    assert policy.summary("--max_seq_len").count("\n") == 0  # one line, however many lengths were seen


def test_reward_phase_needs_pairs():
    recs = [Record("p", " a", None, "apps:3")]
    with pytest.raises(DataError, match="rejected"):
        tokenize_phase(recs, 2, CharTokenizer(), eot="", max_seq_len=8, max_prompt_len=8, policy=BadRowPolicy())


def test_pair_and_prompt_collators_pad_on_the_right_side():
    pairs = PairCollator(0)([{"chosen_ids": [5, 6, 7], "rejected_ids": [5, 8], "chosen_start": 1, "rejected_start": 1},
                             {"chosen_ids": [4, 9], "rejected_ids": [4, 4, 3, 2], "chosen_start": 2,
                              "rejected_start": 3}])
    assert pairs["input_ids"].tolist() == [[5, 6, 7, 0], [4, 9, 0, 0], [5, 8, 0, 0], [4, 4, 3, 2]]
    assert pairs["response_start"].tolist() == [1, 2, 1, 3]  # chosen rows first, as the sequences
    prompts = PromptCollator(0)([{"prompt_ids": [4, 5]}, {"prompt_ids": [9]}])
    assert prompts["prompt_ids"].tolist() == [[4, 5], [0, 9]]
    assert prompts["prompt_mask"].tolist() == [[1, 1], [0, 1]]


# ---------------------------------------------------------------------------------------------- cache
class CountingTokenizer(CharTokenizer):
    name_or_path, padding_side = "char", "right"

    def __init__(self):
        self.calls = 0

    def __call__(self, text):
        self.calls += 1
        return super().__call__(text)

    def __len__(self):
        return 256


def _data(tmp_path, data_file, **kw) -> DataSection:
    base = dict(data_path=(str(data_file),), data_split="1,1,1", split_seed=0, eval_fraction=0.2, max_eval_samples=0,
                end_of_conversation_token="$", max_seq_len=64, bad_rows="error", data_output_path=str(tmp_path / "c"),
                prompt_format="raw", long_prompts="truncate")
    section = {**base, **kw}
    return DataSection(max_prompt_seq_len=section["max_seq_len"], **section)  # steps 1-2: the prompt's limit too


def test_cache_is_reused_and_keyed_by_inputs(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "chosen": " c", "rejected": " r"}) + "\n"
                            for i in range(30)))
    tok = CountingTokenizer()
    first = build_phase_data(_data(tmp_path, data), tok, phase=1)
    calls = tok.calls
    again = build_phase_data(_data(tmp_path, data), tok, phase=1)
    assert tok.calls == calls and again.train == first.train  # served from the cache
    other = build_phase_data(_data(tmp_path, data, max_seq_len=5), tok, phase=1)
    assert tok.calls > calls and other.train != first.train  # a changed input rebuilds
    assert len(first.eval) == 6 and len(first.train) == 8  # 20% held out, a third of the rest
    prompt = lambda x: tuple(x["input_ids"][:x["response_start"]])
    assert not {prompt(x) for x in first.train} & {prompt(x) for x in first.eval}
    assert torch.is_tensor(torch.tensor(first.train[0]["input_ids"]))


def test_plan_steps_counts_like_the_loaders():
    from marlhf.data.pipeline import plan_steps

    # 100 items, batch 8 -> 13 batches (last one partial), 2 batches per step -> 6 steps per epoch
    assert plan_steps(100, 8, 2, epochs=3, max_steps=0) == (6, 18)
    assert plan_steps(100, 8, 2, epochs=3, max_steps=10) == (6, 10)
    with pytest.raises(ValueError, match="too few"):
        plan_steps(3, 8, 2, epochs=1, max_steps=0)


def test_held_out_halves_interleave_disjoint_and_complete():
    items = list(range(7))
    assert held_out_part(items, "all") == items
    assert held_out_part(items, "validation") == [0, 2, 4, 6] and held_out_part(items, "test") == [1, 3, 5]
    with pytest.raises(ConfigError, match="--eval_prompts test: the held-out slice has 1 prompt"):
        held_out_part([0], "test")
    args, _ = parse_args(RLHFArgs, ["--eval_prompts", "test"])
    assert args.eval_prompts == "test" and parse_args(RLHFArgs, [])[0].eval_prompts == "all"


def test_max_eval_samples_counts_kept_examples(tmp_path):
    """The cap applies after the length rules: with every other eval prompt skipped as too long, asking for
    4 gives 4 examples (not the 2 that survive among the first 4 records), and their records."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": ("x" * 80 if i % 2 else "p") + f"{i}", "chosen": " c",
                                        "rejected": " r"}) + "\n" for i in range(60)))
    out = build_phase_data(_data(tmp_path, data, max_eval_samples=4, long_prompts="skip"), CountingTokenizer(), phase=1)
    assert len(out.eval) == 4 and len(out.eval_records) == 4
    assert all(len(r.prompt) < 10 for r in out.eval_records)
    assert [list(x["input_ids"][1:x["response_start"]]) for x in out.eval] == \
        [[ord(c) for c in r.prompt] for r in out.eval_records]


# ---------------------------------------------------------------------------------------------- sampler
def _rank_batches(n, lengths, batch, world, epoch=0, skip=0, seed=3, groups=None):
    from marlhf.data.pipeline import ResumableSampler

    out = []
    for rank in range(world):
        s = ResumableSampler(n, seed, lengths=lengths, batch_size=batch, groups=groups)
        s.rank, s.world = rank, world
        s.set_epoch(epoch, skip)
        order = list(s)
        out.append([order[i:i + batch] for i in range(0, len(order), batch)])
    return out


def test_group_by_length_batches_similar_lengths_and_sees_every_example_once():
    g = torch.Generator().manual_seed(0)
    n, batch, world = 203, 4, 2
    lengths = torch.randint(10, 200, (n,), generator=g).tolist()

    def padding(per_rank):  # padded tokens the batches carry, over all ranks
        return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for r in per_rank for b in r)

    grouped = _rank_batches(n, lengths, batch, world)
    plain = _rank_batches(n, None, batch, world)
    # every example once per epoch (ceil(n / world) per rank, the permutation wrapped to fill: one repeat)
    seen = sorted(i for r in grouped for b in r for i in b)
    assert len(seen) == 2 * math.ceil(n / world) and sorted(set(seen)) == list(range(n))
    assert sorted(seen) == sorted(i for r in plain for b in r for i in b)  # the same items as ungrouped
    assert padding(grouped) < 0.2 * padding(plain)
    # the ranks' k-th batches are one global batch, neighbours in a sorted mega-batch: a narrow length span
    spans = [max(lengths[i] for r in grouped for i in r[k]) - min(lengths[i] for r in grouped for i in r[k])
             for k in range(len(grouped[0]))]
    assert sum(spans) / len(spans) < 0.1 * (max(lengths) - min(lengths))
    # batches are not served longest-first: their order is shuffled
    firsts = [max(lengths[i] for i in b) for b in grouped[0]]
    assert firsts != sorted(firsts, reverse=True)


def test_group_by_length_is_seeded_per_epoch_and_resumes_mid_epoch():
    lengths = [(7 * i) % 31 + 1 for i in range(64)]
    a = _rank_batches(64, lengths, 4, 1, epoch=1)[0]
    assert a == _rank_batches(64, lengths, 4, 1, epoch=1)[0]
    assert a != _rank_batches(64, lengths, 4, 1, epoch=2)[0]
    resumed = _rank_batches(64, lengths, 4, 1, epoch=1, skip=12)[0]
    assert [i for b in resumed for i in b] == [i for b in a for i in b][12:]


def test_group_by_length_keeps_a_partial_last_batch_last():
    lengths = list(range(1, 11))  # 10 items in batches of 4: the last global batch holds 2
    batches = _rank_batches(10, lengths, 4, 1)[0]
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(lengths[i] for i in batches[-1]) == [1, 2]  # the two shortest: the sorted chunk's tail


def test_group_by_length_rejects_lengths_of_another_dataset():
    from marlhf.data.pipeline import ResumableSampler

    with pytest.raises(ValueError, match="3 lengths for 4 items"):
        ResumableSampler(4, 0, lengths=[1, 2, 3])
    with pytest.raises(ValueError, match="5 groups for 4 items"):
        ResumableSampler(4, 0, groups=list("abcde"))


def _grouped_items(seed: int = 0) -> list[str]:
    """Each item's group (a prompt with 1 to 6 pairs), the groups' items scattered over the dataset."""
    g = torch.Generator().manual_seed(seed)
    groups = [f"p{k}" for k in range(40) for _ in range(1 + k % 6)]
    return [groups[i] for i in torch.randperm(len(groups), generator=g).tolist()]


def _runs(order: list[int], groups: list[str]) -> int:
    """How many runs of consecutive items of one group ``order`` makes."""
    return sum(1 for i, x in enumerate(order) if i == 0 or groups[x] != groups[order[i - 1]])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("by_length", [False, True])
def test_groups_stay_together_and_every_item_is_seen_once(world, by_length):
    groups = _grouped_items()
    n, batch = len(groups), 4
    lengths = [(7 * i) % 31 + 1 for i in range(n)] if by_length else None
    ranks = _rank_batches(n, lengths, batch, world, groups=groups)
    seen = sorted(i for r in ranks for b in r for i in b)
    per_rank = math.ceil(n / world)
    assert len(seen) == per_rank * world and sorted(set(seen)) == list(range(n))
    # a group is cut only where a batch ends: within a batch its items are consecutive, and a group's items
    # lie in as many batches as its size needs at most one more
    for r in ranks:
        for b in r:
            assert _runs(b, groups) == len({groups[i] for i in b})
    batches = [b for r in ranks for b in r]
    for name in set(groups):
        size = groups.count(name)
        holding = sum(1 for b in batches if any(groups[i] == name for i in b))
        assert holding <= math.ceil(size / batch) + 1
    # the ungrouped sampler scatters them
    plain = _rank_batches(n, lengths, batch, world)
    assert sum(_runs(b, groups) for r in plain for b in r) > 1.5 * sum(_runs(b, groups) for b in batches)


def test_groups_of_one_item_are_the_plain_permutation():
    n = 50
    for lengths in (None, [(7 * i) % 31 + 1 for i in range(n)]):
        for world in (1, 2):
            assert _rank_batches(n, lengths, 4, world, epoch=2) == _rank_batches(
                n, lengths, 4, world, epoch=2, groups=[f"g{i}" for i in range(n)])


def test_grouped_order_is_seeded_per_epoch_and_resumes_mid_epoch():
    groups = _grouped_items(1)
    n = len(groups)
    a = _rank_batches(n, None, 4, 2, epoch=1, groups=groups)
    assert a == _rank_batches(n, None, 4, 2, epoch=1, groups=groups)
    assert a != _rank_batches(n, None, 4, 2, epoch=2, groups=groups)
    resumed = _rank_batches(n, None, 4, 2, epoch=1, skip=6, groups=groups)
    for rank in range(2):
        assert [i for b in resumed[rank] for i in b] == [i for b in a[rank] for i in b][6:]
