"""Steps 1 and 2 on the tiny model, one rank in-process: they learn, export loadable HF models, resume.

Numbers asserted here were measured with these fixed seeds (see the comments); they leave a wide margin.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import STEP1, STEP2, TINY_DATA, load_main
from safetensors.torch import load_file

from marlhf.utils.tracking import read_metrics

COMMON = ["--data_path", TINY_DATA, "--max_seq_len", "256", "--per_device_train_batch_size", "8",
          "--per_device_eval_batch_size", "16", "--max_eval_samples", "64", "--disable_progress_bar", "--seed", "1"]


def sft_argv(out: Path, data: Path, *extra: str) -> list[str]:
    return [*COMMON, "--output_dir", str(out), "--data_output_path", str(data), "--learning_rate", "2e-3",
            "--num_warmup_steps", "3", *extra]


@pytest.fixture(scope="module")
def sft_run(embedded, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    load_main(STEP1)(sft_argv(out / "model", out / "data", "--max_steps", "30", "--enable_tensorboard",
                              "--gradient_checkpointing"))
    return out / "model"


def eval_history(out: Path) -> list[dict]:
    return [m for m in read_metrics(out) if "eval/perplexity" in m]


def test_sft_lowers_held_out_perplexity(sft_run):
    history = eval_history(sft_run)
    first, last = history[0]["eval/perplexity"], history[-1]["eval/perplexity"]
    # measured: ~2000 (uniform over a 2000-token vocabulary) -> ~60 after 30 steps
    assert history[0]["step"] == 0 and history[-1]["step"] == 30
    assert last < first / 10, (first, last)
    losses = [m["train/loss"] for m in read_metrics(sft_run) if "train/loss" in m]
    assert len(losses) == 30 and all(map(torch.isfinite, torch.tensor(losses)))
    assert list((sft_run / "tensorboard").glob("events.out.tfevents.*"))  # --enable_tensorboard wrote events


def test_sft_export_loads_in_plain_transformers(sft_run, embedded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sft_run)
    model = AutoModelForCausalLM.from_pretrained(sft_run)
    assert (sft_run / "model.safetensors").exists() and (sft_run / "tokenizer.json").exists()
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert eot in model.generation_config.eos_token_id  # generation stops at the end of an answer
    base = AutoModelForCausalLM.from_pretrained(embedded.model_dir)
    moved = [n for n, p in model.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert len(moved) > 10  # training changed the weights that were exported


def test_export_round_trip_logits_equal(embedded, tmp_path):
    """The exported folder reproduces the trained module's logits exactly."""
    from transformers import AutoModelForCausalLM

    from marlhf.models.export import export_hf
    from marlhf.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(embedded.model_dir))
    model = load_causal_lm(str(embedded.model_dir), tok)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    export_hf(model, tok, tmp_path / "out")
    ids = tok(["SUBREDDIT: r/pets\nPOST: a cat", "TL;DR: hi"], return_tensors="pt", padding=True)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, again(**ids).logits)


def test_resume_reproduces_the_uninterrupted_run(embedded, tmp_path):
    """Stop after 3 of 6 steps (the checkpoint of step 3 is the newest complete one), resume, compare."""
    main = load_main(STEP1)
    argv = lambda out: sft_argv(out, tmp_path / "data", "--max_steps", "6", "--save_steps", "3",
                                "--keep_checkpoints", "5", "--dropout", "0.1")
    main(argv(tmp_path / "full"))
    # the "stopped" run: its output holds what a run killed during step 4-6 would have left behind
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step00000003", tmp_path / "stopped/checkpoints/step00000003")
    (tmp_path / "stopped/checkpoints/latest").write_text("step00000003")
    # a crash while saving step 6: a half-written folder that `latest` never pointed to
    (tmp_path / "stopped/checkpoints/step00000006/sft").mkdir(parents=True)
    main([*argv(tmp_path / "stopped"), "--resume"])
    full = load_file(tmp_path / "full" / "model.safetensors")
    resumed = load_file(tmp_path / "stopped" / "model.safetensors")
    assert full.keys() == resumed.keys()
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    steps = [m["step"] for m in read_metrics(tmp_path / "stopped") if "train/loss" in m]
    assert steps == [4, 5, 6]  # continued where it stopped, nothing repeated
    state = json.loads((tmp_path / "stopped/checkpoints/step00000006/trainer_state.json").read_text())
    assert state["step"] == 6


def test_lora_adapter_saved_in_peft_format_and_mergeable(embedded, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "lora"
    load_main(STEP1)(sft_argv(out, tmp_path / "data", "--max_steps", "4", "--lora_dim", "4",
                              "--only_optimize_lora", "--lora_learning_rate", "1e-2"))
    assert (out / "lora_adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(embedded.model_dir)
    base.resize_token_embeddings(merged.get_input_embeddings().weight.shape[0])
    peft_model = PeftModel.from_pretrained(base, out / "lora_adapter").merge_and_unload()
    ids = AutoTokenizer.from_pretrained(out)(["TL;DR: we tried a crate"], return_tensors="pt")
    with torch.no_grad():
        a, b = merged(**ids).logits, peft_model(**ids).logits
        plain = AutoModelForCausalLM.from_pretrained(embedded.model_dir)(**ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a, plain, atol=1e-4)  # the adapter changed something


def test_max_steps_inside_an_epoch_still_evaluates_the_final_model(embedded, tmp_path):
    load_main(STEP1)(sft_argv(tmp_path / "o", tmp_path / "d", "--max_steps", "2"))  # 30 steps per epoch
    assert [m["step"] for m in eval_history(tmp_path / "o")] == [0, 2]


def run_log_handlers() -> list:
    import logging

    return [h for h in logging.getLogger("marlhf").handlers if isinstance(h, logging.FileHandler)]


def test_a_run_in_process_closes_its_log_file_when_it_ends_or_fails(embedded, tmp_path, monkeypatch):
    """After main returns or raises, nothing holds the run's train.log: later logging in the same process goes to
    no run's file, and does not fail once the folder is gone (as pytest removes a passed test's tmp_path)."""
    import logging

    from deepspeed.accelerator import get_accelerator

    out = tmp_path / "o"
    load_main(STEP1)(sft_argv(out, tmp_path / "d", "--max_steps", "1"))
    assert run_log_handlers() == []
    logging.getLogger("marlhf.after").info("logged after the run")
    text = (out / "train.log").read_text()
    assert "command:" in text and "logged after the run" not in text
    shutil.rmtree(out)
    logging.getLogger("marlhf.after").info("logged after its folder was removed")  # raised FileNotFoundError before
    # a run refused after it started (its log open) leaves nothing behind either
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    with pytest.raises(RuntimeError, match="fp16 needs an accelerator"):
        load_main(STEP1)(sft_argv(tmp_path / "bad", tmp_path / "d", "--dtype", "fp16", "--max_steps", "1"))
    assert "command:" in (tmp_path / "bad" / "train.log").read_text()
    assert run_log_handlers() == []


def test_fp16_without_accelerator_support_fails_with_the_reason(embedded, tmp_path, monkeypatch):
    """Where the accelerator has no fp16 (most CPUs), the run stops before training, saying why."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    with pytest.raises(RuntimeError, match="fp16 needs an accelerator"):
        load_main(STEP1)(sft_argv(tmp_path / "o", tmp_path / "d", "--dtype", "fp16", "--max_steps", "1"))
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_fp16_where_supported_trains_with_finite_loss(embedded, tmp_path):
    """Some CPUs (oneDNN fp16) and every GPU report fp16: then DeepSpeed's loss-scaled fp16 path trains."""
    from deepspeed.accelerator import get_accelerator

    out = tmp_path / "o"
    argv = sft_argv(out, tmp_path / "d", "--dtype", "fp16", "--max_steps", "2")
    if not get_accelerator().is_fp16_supported():
        with pytest.raises(RuntimeError, match="fp16 needs an accelerator"):
            load_main(STEP1)(argv)
        return
    load_main(STEP1)(argv)
    losses = [m["train/loss"] for m in read_metrics(out) if "train/loss" in m]
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))


@pytest.fixture(scope="module")
def reward_run(sft_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    load_main(STEP2)([*COMMON, "--model_name_or_path", str(sft_run), "--output_dir", str(out / "model"),
                      "--data_output_path", str(out / "data"), "--learning_rate", "1e-3", "--max_steps", "60",
                      "--max_eval_samples", "256", "--eval_interval", "20", "--num_warmup_steps", "5"])
    return out / "model"


def test_reward_model_beats_chance_on_held_out_pairs(reward_run):
    evals = [m for m in read_metrics(reward_run) if "eval/accuracy" in m]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 60
    # measured on 256 held-out pairs (label noise 0.1 caps it near 0.9): 0.543 at step 0, 0.629 after 60
    # steps (the 4M-parameter model must compare the summary with the post's facts); SE ~0.03
    assert evals[0]["eval/accuracy"] < 0.58
    assert evals[-1]["eval/accuracy"] >= 0.6, evals
    assert evals[-1]["eval/chosen_score"] > evals[-1]["eval/rejected_score"]


def test_reward_model_loads_as_sequence_classifier(reward_run):
    """Plain transformers scores the last non-pad token — the same number our step-2 code trains."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from marlhf.models.forward import sequence_scores
    from marlhf.models.loading import load_value_model

    tok = AutoTokenizer.from_pretrained(reward_run)
    hf = AutoModelForSequenceClassification.from_pretrained(reward_run)
    ours = load_value_model(str(reward_run), tok)
    batch = tok(["TL;DR: I got a dog.<|endoftext|>", "TL;DR: We tried a crate, it did not help.<|endoftext|>"],
                return_tensors="pt", padding=True)
    with torch.no_grad():
        a = hf(**batch).logits.squeeze(-1)
        b = sequence_scores(ours, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_reward_model_with_likelihood_term(sft_run, tmp_path):
    """--likelihood_term: the exported folder scores prompt + answer as its score head plus α times the answer's
    log-likelihood under its next-token head; α is learnt; marlhf export keeps the term."""
    from marlhf.rewards.reward_model import LikelihoodScorer, Scorer, _items

    out = tmp_path / "rm"
    load_main(STEP2)([*COMMON, "--model_name_or_path", str(sft_run), "--output_dir", str(out),
                      "--data_output_path", str(tmp_path / "data"), "--learning_rate", "1e-4", "--max_steps", "20",
                      "--max_eval_samples", "64", "--eval_interval", "20", "--num_warmup_steps", "2",
                      "--likelihood_term"])
    evals = [m for m in read_metrics(out) if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 20]
    config = json.loads((out / "config.json").read_text())
    assert config["likelihood_term"] is True
    rm = Scorer(str(out))
    assert rm.model.likelihood.scale.item() != 1.0  # α is learnt
    # the exported model's score = its head + α · Σ log p under its own next-token head: the head alone and
    # the likelihood under a causal LM with the term's head, from the folder's weights
    prompts, answers = ["TL;DR: I got a dog.", "TL;DR: We tried a crate."], [" A dog.", " It did not help."]
    got = rm(prompts, answers)
    lm = LikelihoodScorer(str(sft_run))
    with torch.no_grad():
        lm.model.model.load_state_dict(rm.model.model.state_dict())
        lm.model.lm_head.weight.copy_(rm.model.likelihood.lm_head.weight)
    items = _items(rm.tok, prompts, answers, eot=rm.eot, prompt_format=rm.format.prompt_format, max_seq_len=1024)
    with torch.no_grad():
        heads = [rm.model(input_ids=torch.tensor([x["input_ids"]])).logits[0, 0].item() for x in items]
    alpha = rm.model.likelihood.scale.item()
    assert got == pytest.approx([h + alpha * ll for h, ll in zip(heads, lm(prompts, answers))], abs=1e-4)
    # marlhf export keeps the term (and says so on the model card)

    load_main("export")(["--input", str(out), "--output_dir", str(tmp_path / "release")])
    assert Scorer(str(tmp_path / "release"))(prompts, answers) == pytest.approx(got, abs=1e-5)
    assert "--likelihood_term" in (tmp_path / "release" / "README.md").read_text()


def test_bf16_with_linear_warmup_schedule(embedded, tmp_path):
    """bf16 under DeepSpeed on CPU; the logged learning rates follow linear warmup (ratio 0.5 of 4 steps
    = 2 warmup steps) then linear decay: 0.5, 1.0, 0.5, 0.0 times the peak."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "bf16"
    load_main(STEP1)([*COMMON, "--output_dir", str(out), "--data_output_path", str(tmp_path / "data"),
                      "--dtype", "bf16", "--learning_rate", "1e-3", "--lr_scheduler_type", "linear",
                      "--warmup_ratio", "0.5", "--max_steps", "4"])
    rows = [m for m in read_metrics(out) if "train/lr" in m]
    assert [r["train/lr"] for r in rows] == pytest.approx([5e-4, 1e-3, 5e-4, 0.0])
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert next(model.parameters()).dtype == torch.bfloat16  # exported in the dtype it trained in


def test_divergence_reward_loss_against_a_loop():
    """DeepSpeed-Chat's divergence loss: per pair, from the first position where chosen and rejected differ to
    the end of the longer one, the mean of −(1−ε) log σ(r⁺_t − r⁻_t) − ε log σ(r⁻_t − r⁺_t), a finished
    sequence holding its last value; averaged over pairs.  Checked against plain loops on right-padded pairs
    of different lengths, a pair differing only in its last token, and identical sequences."""
    import math

    import torch

    from marlhf.supervised import divergence_pairwise_loss, divergence_span

    pad = 0
    pairs = [([5, 6, 7, 8, 9], [5, 6, 3, 4]),          # diverge at 2; chosen longer
             ([5, 6, 7], [5, 6, 7, 2, 2, 2]),          # chosen is a prefix: diverge where it ends
             ([4, 4, 4, 4, 1], [4, 4, 4, 4, 2]),       # differ only in the last token
             ([3, 3], [3, 3])]                         # identical
    T = 7
    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    ids = torch.tensor([x + [pad] * (T - len(x)) for x in rows])
    mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in rows])
    values = torch.randn(len(rows), T, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def loop(eps):
        total = 0.0
        for i, (c, r) in enumerate(pairs):
            end = max(len(c), len(r))
            start = next((t for t in range(end) if t >= len(c) or t >= len(r) or c[t] != r[t]), end)
            start = min(start, end - 1)
            vc = [values[i, min(t, len(c) - 1)].item() for t in range(T)]
            vr = [values[len(pairs) + i, min(t, len(r) - 1)].item() for t in range(T)]
            terms = []
            for t in range(start, end):
                d = vc[t] - vr[t]
                terms.append(-(1 - eps) * math.log(1 / (1 + math.exp(-d))) - eps * math.log(1 / (1 + math.exp(d))))
            total += sum(terms) / len(terms)
        return total / len(pairs)

    start, end = divergence_span(ids, mask)
    assert start.tolist() == [2, 3, 4, 1] and end.tolist() == [5, 6, 5, 2]
    for eps in (0.0, 0.1):
        got = divergence_pairwise_loss(values, ids, mask, eps).item()
        assert got == pytest.approx(loop(eps), rel=1e-6)  # the loss is taken in fp32
    # only the span counts: changing a value before the divergence or in the padding changes nothing
    moved = values.clone()
    moved[0, 1] += 5.0
    moved[len(pairs) + 3, 5] -= 3.0
    assert divergence_pairwise_loss(moved, ids, mask).item() == pytest.approx(loop(0.0), rel=1e-6)


def test_pairwise_loss_with_label_smoothing_against_a_loop():
    """−(1−ε) log σ(Δ) − ε log σ(−Δ) per pair, averaged; ε = 0 is the plain Bradley–Terry loss.  Under label
    smoothing the loss is minimised at a finite margin, log((1−ε)/ε), instead of pushing Δ → ∞."""
    import math

    import torch

    from marlhf.supervised import pairwise_loss

    chosen, rejected = torch.tensor([1.0, -0.5, 3.0, 0.2]), torch.tensor([0.0, 0.5, -1.0, 0.2])
    for eps in (0.0, 0.1, 0.3):
        ref = 0.0
        for c, r in zip(chosen.tolist(), rejected.tolist()):
            d = c - r
            ref += -(1 - eps) * math.log(1 / (1 + math.exp(-d))) - eps * math.log(1 / (1 + math.exp(d)))
        assert pairwise_loss(chosen, rejected, eps).item() == pytest.approx(ref / 4, rel=1e-6)
    delta = torch.linspace(0, 6, 6001)
    losses = torch.stack([pairwise_loss(d[None], torch.zeros(1), 0.1) for d in delta])
    best = delta[losses.argmin()]
    assert best.item() == pytest.approx(math.log(0.9 / 0.1), abs=2e-3)
