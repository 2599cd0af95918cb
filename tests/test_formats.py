"""End-of-answer token, prompt format and pad token — checked on small tokenizers (no pretrained model):
the defaults a model folder implies, the errors for tokens that cannot end an answer, chat messages from
HH dialogues with exact response boundaries, and an exported reward model whose tokenizer padded with its
EOS scoring identically in plain transformers."""

import logging

import pytest
import torch

from marlhf.data.formatting import (
    ConversationFormat,
    PromptFormatter,
    check_same_format,
    default_end_token,
    end_token_id,
    prompt_messages,
    read_format,
    resolve_format,
    write_format,
)
from marlhf.data.pipeline import tokenize_phase
from marlhf.data.records import BadRowPolicy, Record
from marlhf.models.forward import sequence_scores
from marlhf.models.loading import load_tokenizer, load_tokenizer_and_format, load_value_model

# A ChatML-style template whose assistant turn ends with the tokenizer's EOS (an "instruct" tokenizer).
CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
HH = "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: Name a color.\n\nAssistant:"


@pytest.fixture(scope="module")
def nano_dir():
    from marlhf import embedded

    return embedded.prepare(size="nano").model_dir


@pytest.fixture
def chat_tok(nano_dir):
    tok = load_tokenizer(str(nano_dir))
    tok.chat_template = CHATML
    return tok


def test_hh_dialogues_become_alternating_chat_messages():
    assert prompt_messages(HH) == [{"role": "user", "content": "Hi there"},
                                   {"role": "assistant", "content": "Hello! How can I help?"},
                                   {"role": "user", "content": "Name a color."}]
    tldr = "SUBREDDIT: r/pets\nPOST: my cat hides\nTL;DR:"
    assert prompt_messages(tldr) == [{"role": "user", "content": tldr}]


def test_default_end_token_and_prompt_format(nano_dir, chat_tok):
    raw = load_tokenizer(str(nano_dir))
    # the embedded tokenizer has DeepSpeed-Chat's token as its own special token and no chat template
    assert resolve_format(raw, {}, "", "auto") == ConversationFormat("<|endoftext|>", "raw")
    # an instruct tokenizer (EOS closes the assistant turn): chat template, its end-of-turn token
    assert default_end_token(chat_tok, "chat_template") == "</s>"
    assert resolve_format(chat_tok, {}, "", "auto") == ConversationFormat("</s>", "chat_template")
    # a recorded format wins over the defaults, a flag over both
    recorded = {"end_of_conversation_token": "<|endoftext|>", "prompt_format": "raw"}
    assert resolve_format(chat_tok, recorded, "", "auto") == ConversationFormat("<|endoftext|>", "raw")
    assert resolve_format(chat_tok, recorded, "</s>", "chat_template") == ConversationFormat("</s>", "chat_template")
    with pytest.raises(ValueError, match="has no chat template"):
        resolve_format(raw, {}, "", "chat_template")


def test_end_tokens_that_cannot_end_an_answer_are_errors(nano_dir):
    tok = load_tokenizer(str(nano_dir))
    with pytest.raises(ValueError, match=r"'<unk>' is the unknown token \(id 1\)"):
        end_token_id(tok, "<unk>")
    with pytest.raises(ValueError, match=r"'<\|im_end\|>' is not a token .* encodes to \d+ ids.*--add_eot_token"):
        load_tokenizer_and_format(str(nano_dir), "<|im_end|>")
    # --add_eot_token registers it (one new id, the embedding grows when the model is loaded)
    tok, fmt = load_tokenizer_and_format(str(nano_dir), "<|im_end|>", add_eot_token=True)
    assert fmt.end_of_conversation_token == "<|im_end|>" and end_token_id(tok, "<|im_end|>") == len(tok) - 1


def test_chat_training_text_is_the_templates_assistant_turn(chat_tok):
    """SFT ids = the template's rendering of the dialogue plus the answer, up to and including the end
    token; the labels start exactly at the answer (the assistant header belongs to the prompt)."""
    [item] = tokenize_phase([Record(HH, " Blue.", None, "f:1")], 1, chat_tok, eot="</s>", max_seq_len=512,
                            max_prompt_len=0, policy=BadRowPolicy(), prompt_format="chat_template")
    messages = prompt_messages(HH) + [{"role": "assistant", "content": "Blue."}]
    full = chat_tok.apply_chat_template(messages, tokenize=False)
    want = chat_tok(full, add_special_tokens=False)["input_ids"]
    assert item["input_ids"] == want[:len(item["input_ids"])] and len(want) - len(item["input_ids"]) <= 1
    assert item["input_ids"][-1] == chat_tok.eos_token_id
    prompt = PromptFormatter(chat_tok, "chat_template", "</s>").prompt_text(HH)
    assert item["response_start"] == len(chat_tok(prompt, add_special_tokens=False)["input_ids"])
    assert chat_tok.decode(item["input_ids"][item["response_start"]:]) == "Blue.</s>"


def test_format_file_round_trip_and_step3_mismatch(tmp_path):
    write_format(tmp_path / "", ConversationFormat("<|im_end|>", "chat_template"))
    assert read_format(tmp_path) == {"end_of_conversation_token": "<|im_end|>", "prompt_format": "chat_template"}
    assert read_format(tmp_path / "nothing") == {}
    with pytest.raises(ValueError, match="end_of_conversation_token '<\\|im_end\\|>'.*actor uses '</s>'"):
        check_same_format(ConversationFormat("</s>", "chat_template"), str(tmp_path))


def test_reward_model_with_pad_equal_to_eos_scores_the_same_in_plain_transformers(nano_dir, tmp_path):
    """A tokenizer that pads with its EOS, which is also the end-of-answer token (SmolLM2, GPT-2): the
    project swaps in a distinct pad, so plain transformers (last non-pad token) scores the end token."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from marlhf.models.export import export_hf

    base = AutoTokenizer.from_pretrained(nano_dir)
    base.pad_token = base.eos_token  # pad == eos == end token
    src = tmp_path / "src"
    base.save_pretrained(src)
    AutoModelForCausalLM.from_pretrained(nano_dir).save_pretrained(src)
    tok, fmt = load_tokenizer_and_format(str(src), "</s>")
    assert tok.pad_token_id not in (tok.eos_token_id, end_token_id(tok, "</s>"))
    model = load_value_model(str(src), tok)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=torch.Generator().manual_seed(0)))
    export_hf(model, tok, tmp_path / "rm", conversation=fmt)

    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert hf.config.use_cache is True and read_format(tmp_path / "rm")["end_of_conversation_token"] == "</s>"
    batch = hf_tok(["TL;DR: a dog.</s>", "TL;DR: we tried a crate, it did not help.</s>"], return_tensors="pt",
                   padding=True, add_special_tokens=False)
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()  # really padded
    with torch.no_grad():
        plain = hf(**batch).logits.squeeze(-1)
        ours = sequence_scores(model.eval(), batch["input_ids"], batch["attention_mask"])
        # what the pad == eos config did: the end token taken for padding, the token before it scored
        hf.config.pad_token_id = tok.eos_token_id
        wrong = hf(**batch).logits.squeeze(-1)
    torch.testing.assert_close(plain, ours, rtol=1e-5, atol=1e-5)
    assert (wrong - ours).abs().min() > 1e-3


def test_lora_log_counts_wrapped_modules(nano_dir, caplog):
    from transformers import AutoModelForCausalLM

    from marlhf.models.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(nano_dir)
    with caplog.at_level(logging.INFO, logger="marlhf"):
        apply_lora(model, 2, "q_proj,v_proj", only_optimize_lora=True)
    assert f"on {2 * model.config.num_hidden_layers} modules" in caplog.text


def test_default_learning_rates_by_model_size():
    from marlhf.utils.ds_engine import default_learning_rate

    assert default_learning_rate("sft", 4_000_000) == 1e-3  # the embedded tiny model keeps its rates
    assert default_learning_rate("reward", 4_000_000) == 5e-4
    assert default_learning_rate("sft", 135_000_000) == 5e-5  # SmolLM2: the paper's smallest class (2B)
    assert default_learning_rate("actor", 2_500_000_000) == 1.5e-5
    assert default_learning_rate("reward", 7_000_000_000) == 1e-6
    assert default_learning_rate("actor", 27_000_000_000) == 7e-7
