"""rw_eval.py (score prompt/response pairs with a step-2 reward model): CLI scores equal the library's
``sequence_scores`` computed one sequence at a time, the jsonl mode writes every row and the pair accuracy,
and a bad row is a DataError naming file, row and field."""

import json
import re

import pytest
import torch
from conftest import REPO, load_main, save_seeded_reward_model

from marlhf.data.records import DataError
from marlhf.models.forward import sequence_scores
from marlhf.models.loading import load_tokenizer, load_value_model

RW_EVAL = REPO / "training/step2_reward_model_finetuning/rw_eval.py"
EOT = "<|endoftext|>"
PROMPT = "SUBREDDIT: r/AskPets\nPOST: Our cat hides under the bed all day. What should I do?\nTL;DR:"
SHORT = " The cat hides."
LONG = " My cat hides under the bed all day and we do not know how to help her."


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """The nano model as a value model with a seeded, larger score head (scores of order 1, so the CLI's
    4-decimal output distinguishes them), saved as a step-2 output folder would be."""
    out = save_seeded_reward_model(tmp_path_factory.mktemp("rm"))
    return out


def direct_score(model_dir, prompt: str, response: str, eot: str = EOT) -> float:
    """Reference: one unpadded sequence through sequence_scores, with the end-of-conversation token appended
    as in training (rw_eval batches and right-pads; the score must not depend on that)."""
    tok = load_tokenizer(str(model_dir), eot)
    model = load_value_model(str(model_dir), tok).eval()
    enc = tok(prompt + response + eot, return_tensors="pt")
    with torch.no_grad():
        return sequence_scores(model, enc["input_ids"], enc["attention_mask"]).item()


def test_prompt_and_responses_print_the_direct_scores(reward_model, capsys):
    rc = load_main(RW_EVAL)(["--model_name_or_path", str(reward_model), "--prompt", PROMPT,
                             "--response", SHORT, "--response", LONG])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    printed = [line.split("\t") for line in lines]
    assert [text for _, text in printed] == [repr(SHORT), repr(LONG)]
    expected = [direct_score(reward_model, PROMPT, r) for r in (SHORT, LONG)]
    assert abs(expected[0] - expected[1]) > 1e-3  # the two responses really get different scores
    for (score, _), want in zip(printed, expected):
        assert float(score) == pytest.approx(want, abs=5.1e-5)  # printed with 4 decimals


def test_end_token_is_read_from_the_model_folder(tmp_path, capsys):
    """A reward model trained with another end token than its tokenizer's default (<|endoftext|>) records it
    in conversation_format.json; rw_eval appends the recorded token without being told."""
    from marlhf.data.formatting import ConversationFormat, write_format

    rm = save_seeded_reward_model(tmp_path / "rm")
    write_format(rm, ConversationFormat("</s>", "raw"))
    assert load_main(RW_EVAL)(["--model_name_or_path", str(rm), "--prompt", PROMPT, "--response", SHORT]) == 0
    score = float(capsys.readouterr().out.split("\t")[0])
    assert score == pytest.approx(direct_score(rm, PROMPT, SHORT, eot="</s>"), abs=5.1e-5)
    assert abs(score - direct_score(rm, PROMPT, SHORT)) > 1e-3  # the tokenizer's default scores elsewhere


def test_prompt_without_response_is_a_usage_error(reward_model, capsys):
    assert load_main(RW_EVAL)(["--model_name_or_path", str(reward_model), "--prompt", PROMPT]) == 2
    assert "--response" in capsys.readouterr().err


def test_input_file_writes_scores_and_pair_accuracy(reward_model, tmp_path, capsys):
    rows = [{"prompt": PROMPT, "response": SHORT},
            {"prompt": PROMPT, "chosen": LONG, "rejected": SHORT},
            {"prompt": PROMPT, "chosen": SHORT, "rejected": LONG}]  # the pair swapped: exactly one is right
    src, dst = tmp_path / "pairs.jsonl", tmp_path / "scores.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = load_main(RW_EVAL)(["--model_name_or_path", str(reward_model), "--input", str(src),
                             "--output", str(dst), "--batch_size", "2"])
    assert rc == 0
    s_short, s_long = (direct_score(reward_model, PROMPT, r) for r in (SHORT, LONG))
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [sorted(o) for o in out] == [["prompt", "response", "score"],
                                        ["chosen_score", "prompt", "rejected_score"],
                                        ["chosen_score", "prompt", "rejected_score"]]
    assert out[0]["response"] == SHORT and out[0]["score"] == pytest.approx(s_short, abs=1e-5)
    assert out[1]["chosen_score"] == pytest.approx(s_long, abs=1e-5)
    assert out[1]["rejected_score"] == pytest.approx(s_short, abs=1e-5)
    assert out[2]["chosen_score"] == pytest.approx(s_short, abs=1e-5)
    assert out[2]["rejected_score"] == pytest.approx(s_long, abs=1e-5)
    assert abs(s_short - s_long) > 1e-3  # so exactly one of the two pairs is ranked right
    printed = capsys.readouterr().out
    pairs = re.search(r"pairs: (\d+)  accuracy (\S+)  mean chosen (\S+)  mean rejected (\S+)", printed)
    assert pairs and int(pairs[1]) == 2 and float(pairs[2]) == 0.5
    mean = (s_short + s_long) / 2
    assert float(pairs[3]) == pytest.approx(mean, abs=5.1e-5)
    assert float(pairs[4]) == pytest.approx(mean, abs=5.1e-5)
    single = re.search(r"responses: (\d+)  mean score (\S+)", printed)
    assert single and int(single[1]) == 1 and float(single[2]) == pytest.approx(s_short, abs=5.1e-5)


def test_row_without_prompt_names_file_row_and_field(reward_model, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"prompt": PROMPT, "response": SHORT}) + "\n"
                   + json.dumps({"chosen": LONG, "rejected": SHORT}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: row 2: field 'prompt': missing") as err:
        load_main(RW_EVAL)(["--model_name_or_path", str(reward_model), "--input", str(src)])
    assert (err.value.file, err.value.row, err.value.field) == (str(src), 2, "prompt")


def test_data_path_scores_the_evaluation_pairs_of_a_dataset_spec(reward_model, tmp_path, capsys):
    """--data_path takes training's dataset specs: the HH test split's pairs, formatted as in training."""
    from marlhf.data.adapters import load_records

    spec = f"Anthropic/hh-rlhf:{REPO / 'tests/fixtures/adapters/hh_rlhf'}"
    dst = tmp_path / "scores.jsonl"
    assert load_main(RW_EVAL)(["--model_name_or_path", str(reward_model), "--data_path", spec,
                               "--output", str(dst)]) == 0
    records = load_records(spec, split="test")
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(out) == len(records) > 0
    for row, rec in zip(out, records):
        assert row["chosen_score"] == pytest.approx(direct_score(reward_model, rec.prompt, rec.chosen), abs=1e-5)
        assert row["rejected_score"] == pytest.approx(direct_score(reward_model, rec.prompt, rec.rejected), abs=1e-5)
    assert f"pairs: {len(records)}  accuracy" in capsys.readouterr().out
