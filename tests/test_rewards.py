"""Reward sources (marlhf/rewards/__init__.py): one ``score(prompts, responses, meta)`` interface for the reward model,
the gold scorer and the program tests; ``Record.meta`` carried through the tokenized cache and the prompt
collator to the scorer; the reward model scoring the generated token sequences as they are."""

from __future__ import annotations

import json

import pytest
import torch

from marlhf.data.pipeline import PromptCollator, _pad
from marlhf.embedded import task as embedded_task
from marlhf.errors import ConfigError
from marlhf.rewards import RewardSource, SequenceScorer, build_reward_source, score_samples
from marlhf.rewards.gold import GoldScorer
from marlhf.rewards.reward_model import RewardModelSource
from marlhf.sampler import Samples
from marlhf.tasks import load_task, task_of_datasets


@pytest.fixture(scope="module")
def records():
    return embedded_task.generate(embedded_task.SyntheticConfig(seed=5, num_records=40))


def _responses(records):
    """Good, flawed, cut and junk answers to each prompt."""
    out = []
    for i, r in enumerate(records):
        out.append([r.chosen, r.rejected, embedded_task.oracle_summary(r.prompt), r.chosen[: 20 + i],
                    "I like turtles and my cat (99F)."][i % 5])
    return out


# ------------------------------------------------------------------------------------------ gold scorer
def test_gold_scores_from_meta_equal_the_parsed_ones(records):
    prompts = [r.prompt for r in records]
    responses = _responses(records)
    ended = [i % 3 != 0 for i in range(len(records))]
    meta = [json.loads(json.dumps(r.meta)) for r in records]  # as it comes back from a JSON/torch cache
    gold = GoldScorer()
    assert isinstance(gold, RewardSource)
    from_meta = gold.score(prompts, responses, meta, ended=ended)
    parsed = gold(prompts, responses, ended)
    assert from_meta == parsed  # exactly the same numbers
    assert len(set(from_meta)) > 10 and min(from_meta) < 0 < max(from_meta)  # the answers really differ
    assert gold.details(prompts, responses, ended, meta) == embedded_task.gold_score_details(prompts, responses, ended)
    # records without facts (other data) fall back to parsing the prompt
    assert gold.score(prompts, responses, [{}] * len(prompts), ended=ended) == parsed


def test_gold_facts_come_from_meta_not_from_the_prompt_text(records):
    r = records[0]
    cut = r.prompt[len(r.prompt) // 2:]  # a prompt truncated from the left lost some of its facts
    answer = embedded_task.oracle_summary(r.prompt)
    gold = GoldScorer()
    assert gold.score([r.prompt], [answer], [r.meta]) == [pytest.approx(1.0)]
    assert gold.score([cut], [answer], [r.meta]) == gold.score([r.prompt], [answer], [r.meta])
    assert gold([cut], [answer]) != gold([r.prompt], [answer])  # parsing the cut text scores it differently


def test_meta_facts_are_the_generators(records):
    for r in records:
        assert embedded_task.PostFacts.from_meta(r.meta["facts"]) == embedded_task.parse_post(r.prompt)
        assert r.meta == json.loads(json.dumps(r.meta))  # JSON-serialisable


def test_jsonl_keeps_meta(records, tmp_path):
    embedded_task.write_jsonl(records[:3], tmp_path / "r.jsonl")
    assert embedded_task.read_jsonl(tmp_path / "r.jsonl") == records[:3]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "c", "meta": [1]}) + "\n")
    with pytest.raises(ValueError, match="row 1: field 'meta': expected a JSON object"):
        embedded_task.read_jsonl(tmp_path / "bad.jsonl")


# ------------------------------------------------------------------------------------------ data flow
def test_meta_goes_through_the_tokenized_cache_and_the_collator(tmp_path, records):
    from marlhf import embedded
    from marlhf.cli._run import data_section
    from marlhf.config import RLHFArgs, parse_args
    from marlhf.data.pipeline import build_phase_data, phase_records
    from marlhf.data.records import BadRowPolicy
    from marlhf.models.loading import load_tokenizer_and_format

    nano = str(embedded.prepare(size="nano").model_dir)
    args, _ = parse_args(RLHFArgs, ["--actor_model_name_or_path", nano, "--data_path", "synthetic:num_records=60",
                                    "--data_output_path", str(tmp_path), "--max_prompt_seq_len", "160"])
    tok, fmt = load_tokenizer_and_format(nano, "", "auto", padding_side="left")
    built = build_phase_data(data_section(args, fmt), tok, phase=3)
    cached = build_phase_data(data_section(args, fmt), tok, phase=3)  # read back from the cache file
    assert len(list(tmp_path.glob("rlhf_*.pt"))) == 1
    train_recs, _ = phase_records(args.data_path, args.data_split, 3, args.seed, args.eval_fraction, BadRowPolicy())
    assert [x["meta"] for x in cached.train] == [r.meta for r in train_recs] == [x["meta"] for x in built.train]
    assert [x["meta"] for x in cached.eval] == [r.meta for r in cached.eval_records]
    batch = PromptCollator(tok.pad_token_id)(cached.train[:3] + [{"prompt_ids": [5, 6]}])
    assert batch["meta"] == [r.meta for r in train_recs[:3]] + [{}]
    assert batch["prompt_ids"].shape[0] == 4


# ------------------------------------------------------------------------------------------ reward model
@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    from conftest import save_seeded_reward_model

    from marlhf.models.loading import load_tokenizer, load_value_model

    folder = save_seeded_reward_model(tmp_path_factory.mktemp("rm"))
    tok = load_tokenizer(str(folder), "<|endoftext|>")
    return folder, tok, load_value_model(str(folder), tok).eval()


def test_reward_model_scores_the_generated_tokens_as_they_are(reward_model, records):
    from marlhf.data.formatting import PromptFormatter
    from marlhf.data.pipeline import encode_pair
    from marlhf.models.forward import sequence_scores
    from marlhf.rewards.reward_model import Scorer

    folder, tok, model = reward_model
    source = RewardModelSource(model, tok, eot="<|endoftext|>", prompt_format="raw", max_seq_len=512)
    assert isinstance(source, SequenceScorer) and isinstance(source, RewardSource)
    prompts, responses = [r.prompt for r in records[:4]], _responses(records[:4])
    text_scores = source.score(prompts, responses)
    assert text_scores == pytest.approx(Scorer(str(folder), "<|endoftext|>", 512, "raw")(prompts, responses))
    # the same prompt + answer tokens, laid out as generation leaves them (prompt left-padded, answer
    # right-padded): score_sequences reads them without re-tokenizing and gives the same scores
    fmt = PromptFormatter(tok, "raw", "<|endoftext|>")
    pairs = [encode_pair(tok, p, a, "<|endoftext|>", 512, fmt) for p, a in zip(prompts, responses)]
    p_ids, p_mask = _pad([ids[:start] for ids, start in pairs], tok.pad_token_id, left=True)
    a_ids, a_mask = _pad([ids[start:] for ids, start in pairs], tok.pad_token_id)
    seq, attn = torch.cat([p_ids, a_ids], 1), torch.cat([p_mask, a_mask], 1)
    samples = Samples(seq, attn, p_ids.shape[1], a_mask.bool(), torch.ones(4, dtype=torch.bool))
    got = score_samples(source, None, samples)  # no tokenizer needed: nothing is decoded
    assert got.tolist() == pytest.approx(text_scores, abs=1e-4)
    assert torch.equal(got, sequence_scores(model, seq, attn))


# ------------------------------------------------------------------------------------------ dispatch
class Recording:
    """A text reward source that records what it was given."""

    def __init__(self):
        self.calls = []

    def score(self, prompts, responses, meta, *, ended=None):
        self.calls.append((list(prompts), list(responses), list(meta), ended))
        return [float(len(r)) for r in responses]


def test_text_sources_get_decoded_text_meta_and_end_flags(reward_model):
    _, tok, _ = reward_model
    prompt = tok("TL;DR: hello", add_special_tokens=False)["input_ids"]
    answers = [tok(" a cat", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], [7, 8, 9]]
    p_ids, p_mask = _pad([prompt, prompt[1:]], tok.pad_token_id, left=True)
    a_ids, a_mask = _pad(answers, tok.pad_token_id)
    s = Samples(torch.cat([p_ids, a_ids], 1), torch.cat([p_mask, a_mask], 1), p_ids.shape[1], a_mask.bool(),
                torch.tensor([True, False]))
    src = Recording()
    meta = [{"facts": 1}, {"input_output": {"inputs": [], "outputs": []}}]
    scores = score_samples(src, tok, s, meta)
    (prompts, responses, got_meta, ended), = src.calls
    assert prompts == [tok.decode(prompt), tok.decode(prompt[1:])]
    assert responses == [" a cat", tok.decode([7, 8, 9])] and got_meta == meta and ended == [True, False]
    assert scores.tolist() == [6.0, float(len(responses[1]))] and scores.dtype == torch.float32
    score_samples(src, tok, s)  # no meta: empty dicts
    assert src.calls[-1][2] == [{}, {}]
    with pytest.raises(ValueError, match="2 samples but 1 meta entries"):
        score_samples(src, tok, s, meta[:1])


def test_build_reward_source():
    from marlhf.rewards import require_meta
    from marlhf.rewards.program_tests import ProgramTestReward

    assert isinstance(build_reward_source("gold", task=task_of_datasets(["synthetic:num_records=10"])), GoldScorer)
    with pytest.raises(ConfigError, match="needs a task with a gold scorer.*task is synthetic_code"):
        build_reward_source("gold", task=load_task("synthetic_code"))
    with pytest.raises(ConfigError, match="needs a task with a gold scorer.*task is none"):
        build_reward_source("gold", task=None)
    with pytest.raises(ConfigError, match="needs a reward model"):
        build_reward_source("reward_model")
    tests = build_reward_source("program_tests", workers=2)
    assert isinstance(tests, ProgramTestReward) and tests.workers == 2 and isinstance(tests, RewardSource)
    with pytest.raises(ConfigError, match="1 of 2 prompts have no 'input_output'"):
        require_meta([{"meta": {"input_output": {"inputs": ["1"], "outputs": ["1"]}}}, {"prompt_ids": [1]}],
                     "input_output", "--reward_source program_tests")


def test_make_experience_hands_the_batch_meta_to_the_reward_source(tmp_path):
    from ppo_harness import make_trainer, prompts, rlhf_args

    from marlhf import embedded

    nano = embedded.prepare(size="nano").model_dir
    src = Recording()
    args = rlhf_args(nano, tmp_path, per_device_generation_batch_size=4, per_device_training_batch_size=4)
    t = make_trainer(args, reward=src)
    ids, mask = prompts(args, t.tokenizer, 4)
    meta = [{"k": i} for i in range(4)]
    exp, stats = t.make_experience(ids, mask, step=0, meta=meta)
    (_, responses, got_meta, ended), = src.calls
    assert got_meta == meta and len(ended) == 4
    assert exp.scores.tolist() == [float(len(r)) for r in responses]
    assert stats["reward"] == pytest.approx(sum(len(r) for r in responses) / 4)


def test_likelihood_scorer_sums_each_answer_tokens_log_probability(embedded, records):
    """LikelihoodScorer (bench_reward_model --likelihood_of) against a loop that scores one answer token at a
    time from an unpadded forward over the tokens before it."""
    from transformers import AutoModelForCausalLM

    from marlhf.rewards.reward_model import LikelihoodScorer, _items

    scorer = LikelihoodScorer(str(embedded.model_dir))
    prompts = [r.prompt for r in records[:3]]
    responses = [records[0].chosen, records[1].rejected, " I (99F) need advice."]
    got = scorer(prompts, responses, batch_size=2)  # two batches, the first one padded
    model = AutoModelForCausalLM.from_pretrained(embedded.model_dir).eval()
    items = _items(scorer.tok, prompts, responses, eot=scorer.eot, prompt_format=scorer.format.prompt_format,
                   max_seq_len=1024)
    for item, value in zip(items, got):
        ids, expected = item["input_ids"], 0.0
        for t in range(item["response_start"], len(ids)):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids[:t]])).logits[0, -1].double()
            expected += logits.log_softmax(-1)[ids[t]].item()
        assert value == pytest.approx(expected, abs=1e-3)
    assert len(set(got)) == 3 and max(got) < 0
