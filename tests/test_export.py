"""marlhf export: a tiny step-1 run exports to a clean HF folder that plain transformers loads with the
source model's logits, a card naming data and final metrics; a LoRA adapter folder is merged; a folder that
is no step output is a one-line user error."""

import json

import pytest
import torch
from conftest import STEP1, TINY_DATA, load_main

from marlhf.errors import run_cli
from marlhf.utils.tracking import read_metrics

EXPORT = "export"
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def sft_run(embedded, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    load_main(STEP1)(["--data_path", TINY_DATA, "--max_seq_len", "128", "--per_device_train_batch_size", "4",
                      "--per_device_eval_batch_size", "16", "--max_eval_samples", "16", "--disable_progress_bar",
                      "--seed", "1", "--output_dir", str(out / "model"), "--data_output_path", str(out / "data"),
                      "--max_steps", "2", "--save_steps", "2"])
    return out / "model"


def test_step1_export_is_clean_and_equal(sft_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dest = tmp_path / "release"
    assert load_main(EXPORT)(["--input", str(sft_run), "--output_dir", str(dest)]) == 0
    names = {p.name for p in dest.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "conversation_format.json", "README.md"} <= names
    assert not names & {"checkpoints", "metrics.jsonl", "args.json", "train.log"}  # training leftovers stay behind
    assert json.loads((dest / "config.json").read_text())["use_cache"] is True
    tok = AutoTokenizer.from_pretrained(dest)
    eot = tok.convert_tokens_to_ids(EOT)
    assert eot in GenerationConfig.from_pretrained(dest).eos_token_id
    assert json.loads((dest / "conversation_format.json").read_text())["end_of_conversation_token"] == EOT
    ids = tok(["SUBREDDIT: r/pets\nPOST: a cat hides\nTL;DR:", "hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(sft_run)(**ids).logits
        b = AutoModelForCausalLM.from_pretrained(dest)(**ids).logits
    assert torch.equal(a, b)
    card = (dest / "README.md").read_text()
    assert "synthetic:num_records=1200" in card and "Step:** 1" in card and "embedded default" in card
    last = {}
    for row in read_metrics(sft_run):
        last.update({k: v for k, v in row.items() if k not in ("step", "time")})
    assert "eval/perplexity" in last and "train/loss" in last
    for key, value in last.items():  # every final metric, with its value, is in the table
        assert f"| {key} | {value:.6g} |" in card
    assert '"max_steps": 2' in card  # the run's flags


def test_lora_adapter_folder_is_merged(embedded, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marlhf.models.loading import load_tokenizer

    tok = load_tokenizer(str(embedded.model_dir), EOT)
    base = AutoModelForCausalLM.from_pretrained(embedded.model_dir)
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in peft.named_parameters():
            if "lora_B" in name:  # B starts at zero: give the adapter an effect
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    adapter = tmp_path / "adapter"
    peft.save_pretrained(adapter)
    tok.save_pretrained(adapter)
    ids = tok(["TL;DR: we tried a crate"], return_tensors="pt")
    with torch.no_grad():
        expected = peft(**ids).logits
        plain = AutoModelForCausalLM.from_pretrained(embedded.model_dir)(**ids).logits
    assert run_cli(load_main(EXPORT), ["--input", str(adapter), "--output_dir", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        got = merged(**ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)
    assert "LoRA adapter merged" in (tmp_path / "merged" / "README.md").read_text()


def test_not_a_step_output_is_a_one_line_error(sft_run, tmp_path, capsys):
    main = load_main(EXPORT)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    cases = {
        str(tmp_path / "junk"): "is not a training step's output",
        str(tmp_path / "missing"): "no such folder",
        str(sft_run / "checkpoints"): "is not a training step's output",
    }
    for folder, message in cases.items():
        assert run_cli(main, ["--input", folder, "--output_dir", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert run_cli(main, ["--input", str(sft_run), "--output_dir", str(tmp_path / "full")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err


def test_step3_critic_export_scores_equal(tmp_path):
    """A step-3 layout (args.json + actor/ + critic/): --model critic exports the value model with equal scores."""
    from transformers import AutoModelForSequenceClassification

    from marlhf import embedded
    from marlhf.data.formatting import ConversationFormat, write_format
    from marlhf.models.loading import load_tokenizer, load_value_model

    nano = str(embedded.prepare(size="nano").model_dir)
    tok = load_tokenizer(nano, EOT)
    run = tmp_path / "ppo"
    critic = load_value_model(nano, tok)
    critic.save_pretrained(run / "critic")
    tok.save_pretrained(run / "critic")
    write_format(run / "critic", ConversationFormat(EOT, "raw"))
    (run / "actor").mkdir()
    (run / "args.json").write_text(json.dumps({"actor_model_name_or_path": "out/sft", "data_path": ["synthetic"],
                                               "critic_model_name_or_path": "out/rm", "ngram": 5}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 7, "time": 0, "eval/gold_score": 0.25}) + "\n")
    assert run_cli(load_main(EXPORT), ["--input", str(run), "--model", "critic",
                                       "--output_dir", str(tmp_path / "rel")]) == 0
    ids = tok(["TL;DR: a cat" + EOT], return_tensors="pt")
    with torch.no_grad():
        a = AutoModelForSequenceClassification.from_pretrained(run / "critic")(**ids).logits
        b = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rel")(**ids).logits
    assert torch.equal(a, b)
    card = (tmp_path / "rel" / "README.md").read_text()
    assert "Step:** 3" in card and "critic" in card and "`out/sft`" in card and "| eval/gold_score | 0.25 | 7 |" in card
    # the actor folder is empty: asking for it is a one-line user error, not a traceback
    assert run_cli(load_main(EXPORT), ["--input", str(run), "--output_dir", str(tmp_path / "rel2")]) == 1


def test_lora_zero3_checkpoint_exports_the_trained_model(embedded, tmp_path):
    """--from_checkpoint on a ZeRO-3 LoRA run: the model rebuilt from args.json, the partitions merged by
    zero_to_fp32 and LoRA merged gives the same logits as the run's own (gathered, merged) export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "lora3"
    load_main(STEP1)(["--data_path", TINY_DATA, "--max_seq_len", "128", "--per_device_train_batch_size", "4",
                      "--per_device_eval_batch_size", "16", "--max_eval_samples", "16", "--disable_progress_bar",
                      "--seed", "1", "--output_dir", str(run), "--data_output_path", str(tmp_path / "data"),
                      "--max_steps", "2", "--save_steps", "2", "--zero_stage", "3", "--lora_dim", "4"])
    assert (run / "checkpoints/step00000002/sft/zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    dest = tmp_path / "from_ckpt"
    assert run_cli(load_main(EXPORT), ["--input", str(run), "--from_checkpoint", "--output_dir", str(dest)]) == 0
    tok = AutoTokenizer.from_pretrained(dest)
    ids = tok(["SUBREDDIT: r/pets\nPOST: a cat hides\nTL;DR:", "hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(run)(**ids).logits
        got = AutoModelForCausalLM.from_pretrained(dest)(**ids).logits
        base = AutoModelForCausalLM.from_pretrained(embedded.model_dir)(**ids).logits
    assert torch.equal(got, want)
    assert not torch.allclose(got, base, atol=1e-3)  # trained weights, not the base model's
    assert not any(p.name == "lora_adapter" or "lora" in p.name for p in dest.iterdir())  # merged, plain HF
    assert "DeepSpeed checkpoint `step00000002/sft`" in (dest / "README.md").read_text()
    # a folder without checkpoints is a one-line user error
    assert run_cli(load_main(EXPORT), ["--input", str(dest), "--from_checkpoint",
                                       "--output_dir", str(tmp_path / "x")]) == 1


def test_checkpoint_without_full_weights_is_a_clear_error(tmp_path, capsys):
    """A ZeRO-partitioned engine with no optimizer partitions (a frozen EMA) cannot be merged: one-line error."""
    step = tmp_path / "run" / "checkpoints" / "step00000003"
    (step / "ema").mkdir(parents=True)
    (step / "ema" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    (step / "trainer_state.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step00000003")
    (tmp_path / "run" / "args.json").write_text(json.dumps({"actor_model_name_or_path": ""}))
    argv = ["--input", str(tmp_path / "run"), "--from_checkpoint", "--model", "actor_ema",
            "--output_dir", str(tmp_path / "o")]
    assert run_cli(load_main(EXPORT), argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without optimizer states" in err[0], err
    assert run_cli(load_main(EXPORT), [*argv[:3], "--model", "critic", *argv[5:]]) == 1
    assert "no 'critic' engine checkpoint (it has ema)" in capsys.readouterr().err
