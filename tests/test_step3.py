"""Step 3 (MA-PPO) end to end on the nano model: n = 1 and n = 5, every rule through the trainer's
segmenter, EMA, ptx, resume, multi-rank ZeRO, and the hybrid-engine error on CPU."""

import json
import shutil

import pytest
import torch
from conftest import STEP3, deepspeed_cmd, load_main, run_launcher
from safetensors.torch import load_file

from marlhf.embedded import default_model
from marlhf.utils.tracking import read_metrics


@pytest.fixture(scope="module")
def nano():
    from marlhf import embedded

    return embedded.prepare(size="nano").model_dir


def step3_argv(nano, out, *extra):
    return ["--actor_model_name_or_path", str(nano), "--critic_model_name_or_path", str(nano),
            "--data_path", "synthetic:num_records=400", "--data_output_path", str(out / "data"),
            "--output_dir", str(out), "--max_prompt_seq_len", "160", "--max_answer_seq_len", "24",
            "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "2",
            "--max_eval_samples", "4", "--disable_progress_bar", "--seed", "3", "--actor_learning_rate", "1e-3",
            "--critic_learning_rate", "1e-3", *extra]


def train_rows(out):
    return [m for m in read_metrics(out) if "train/actor_loss" in m]


@pytest.fixture(scope="module")
def run_n5(nano, tmp_path_factory):
    out = tmp_path_factory.mktemp("n5")
    load_main(STEP3)(step3_argv(nano, out, "--ngram", "5", "--max_steps", "2", "--enable_ema", "--ema_decay", "0.5",
                                "--unsupervised_dataset_name", "synthetic:num_records=50", "--unsup_coef", "0.5",
                                "--print_answers", "--generation_batches", "2"))
    return out


def test_n5_run_trains_and_exports(run_n5, nano):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    rows = train_rows(run_n5)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("train/actor_loss", "train/critic_loss", "train/ptx_loss", "train/kl", "train/reward"):
            assert torch.isfinite(torch.tensor(r[key])), key
        # answers are <= 24 tokens and macro actions are 5 tokens except each sample's last one
        assert 1 <= r["train/macro_len"] <= 5
        assert r["train/num_macros"] >= r["train/response_len"] / 5 - 1e-6
    # the schedule spans the optimizer steps actually taken: per PPO step 2 generation batches x (4 / 2)
    # micro-batches x 2 (ptx) = 8 actor updates, so after step 1 of 2 the cosine is halfway (lr 1e-3 / 2)
    assert rows[0]["train/actor_lr"] == pytest.approx(5e-4, rel=1e-6)
    assert rows[1]["train/actor_lr"] == pytest.approx(0.0, abs=1e-12)
    actor = AutoModelForCausalLM.from_pretrained(run_n5 / "actor")
    ema = AutoModelForCausalLM.from_pretrained(run_n5 / "actor_ema")
    init = AutoModelForCausalLM.from_pretrained(nano).state_dict()
    a, e = actor.state_dict(), ema.state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(a[name], init[name])  # the actor trained
    assert not torch.equal(e[name], a[name]) and not torch.equal(e[name], init[name])  # EMA lies in between
    AutoModelForSequenceClassification.from_pretrained(run_n5 / "critic")
    summary = json.loads((run_n5 / "summary.json").read_text())
    assert {"rm_score", "gold_score", "gold_coverage", "gold_unfinished", "eos_rate"} <= summary["final_policy"].keys()


def test_n1_is_vanilla_ppo(nano, tmp_path):
    load_main(STEP3)(step3_argv(nano, tmp_path, "--ngram", "1", "--max_steps", "1", "--policy_ratio", "macro"))
    (row,) = train_rows(tmp_path)
    assert row["train/macro_len"] == 1.0
    assert 1 <= row["train/num_macros"] <= row["train/response_len"]


def test_parsing_rule_with_the_benepar_parser_trains(nano, benepar_silver, tmp_path):
    """MA-PPO with the paper's parsing rule through benepar (the project-built model, loaded by
    benepar.Parser in this process): the step finishes with finite losses. (The nano model's samples
    that are not canonical tokenizations cannot be aligned and fall back; they are counted.)"""
    import benepar

    from marlhf.parsing import backends

    load_main(STEP3)(step3_argv(nano, tmp_path, "--termination_condition", "parsing", "--parser_backend", "benepar",
                                "--parser_model", str(benepar_silver), "--max_steps", "1"))
    (row,) = train_rows(tmp_path)
    for key in ("train/actor_loss", "train/critic_loss", "train/kl", "train/reward"):
        assert torch.isfinite(torch.tensor(row[key])), key
    assert isinstance(backends._BENEPAR_CACHE[str(benepar_silver)], benepar.Parser)
    assert 0 <= row["train/parse_fallbacks"] <= 4  # of the 4 generated samples
    assert 1 <= row["train/macro_len"] <= 6  # phrases of <= C = 5 tokens (+ a sentence's closing token)


def test_resume_gives_the_same_weights(nano, tmp_path):
    main = load_main(STEP3)
    argv = lambda out: step3_argv(nano, out, "--max_steps", "3", "--save_steps", "1", "--keep_checkpoints", "5",
                                  "--termination_condition", "randomized", "--enable_ema")
    main(argv(tmp_path / "full"))
    shutil.copytree(tmp_path / "full/checkpoints/step00000001", tmp_path / "stopped/checkpoints/step00000001")
    (tmp_path / "stopped/checkpoints/latest").write_text("step00000001")
    shutil.copy(tmp_path / "full/initial_policy.json", tmp_path / "stopped/initial_policy.json")
    main([*argv(tmp_path / "stopped"), "--resume"])
    for part in ("actor", "critic", "actor_ema"):
        full = load_file(tmp_path / "full" / part / "model.safetensors")
        resumed = load_file(tmp_path / "stopped" / part / "model.safetensors")
        assert all(torch.equal(full[k], resumed[k]) for k in full), part
    assert [r["step"] for r in train_rows(tmp_path / "stopped")] == [2, 3]


def test_evaluating_along_the_way_does_not_change_training(nano, tmp_path):
    """Held-out evaluation draws from its own random stream: a run evaluated after every step ends with the same
    weights and the same final evaluation as one evaluated before and after only (what lets the reproduction
    sweep's tuning runs skip the evaluations in the middle)."""
    main = load_main(STEP3)
    for name, every in (("every", "1"), ("ends", "0")):
        main(step3_argv(nano, tmp_path / name, "--max_steps", "3", "--eval_interval", every))
    assert [m["step"] for m in read_metrics(tmp_path / "every") if "eval/rm_score" in m] == [1, 2]
    assert not [m for m in read_metrics(tmp_path / "ends") if "eval/rm_score" in m]
    for part in ("actor", "critic"):
        every = load_file(tmp_path / "every" / part / "model.safetensors")
        ends = load_file(tmp_path / "ends" / part / "model.safetensors")
        assert all(torch.equal(every[k], ends[k]) for k in every), part
    final = [json.loads((tmp_path / name / "summary.json").read_text())["final_policy"] for name in ("every", "ends")]
    assert final[0] == final[1] and "rm_score" in final[0]


MP_LORA = ["--enable_mixed_precision_lora", "--actor_lora_dim", "4", "--actor_zero_stage", "3", "--only_optimize_lora"]


def test_gpu_only_features_fail_clearly_on_cpu(nano, tmp_path):
    """DeepSpeed itself refuses ("not been implemented on CPU backend"); the message says which flag and why.
    (The hybrid engine's CPU refusal: tests/test_gpu_guards.py, on an architecture it has kernels for.)"""
    with pytest.raises(RuntimeError, match="--enable_mixed_precision_lora: DeepSpeed could not start the actor on "
                                           "the 'cpu'.*not been implemented on CPU"):
        load_main(STEP3)(step3_argv(nano, tmp_path, *MP_LORA, "--max_steps", "1"))


def test_mixed_precision_lora_needs_lora_and_zero3(nano, tmp_path):
    with pytest.raises(ValueError, match="needs LoRA on the actor"):
        load_main(STEP3)(step3_argv(nano, tmp_path, "--enable_mixed_precision_lora", "--max_steps", "1"))


@pytest.mark.slow
def test_two_ranks_actor_zero2_critic_zero3(nano, tmp_path):
    """Launched as a user of the installed package launches it (README): ``deepspeed --module marlhf.cli.ppo``."""
    run_launcher([*deepspeed_cmd(2, 29621), "--module", "marlhf.cli.ppo",
                  *step3_argv(nano, tmp_path, "--actor_zero_stage", "2", "--critic_zero_stage", "3",
                              "--max_steps", "2", "--ngram", "5", "--save_steps", "2")], timeout=600)
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["train/critic_loss"])) for r in rows)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    init = AutoModelForCausalLM.from_pretrained(nano).state_dict()
    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "actor").state_dict()
    critic = AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic").state_dict()
    assert all(actor[k].shape == v.shape for k, v in init.items())
    assert critic["score.weight"].shape[0] == 1
    assert (tmp_path / "checkpoints/latest").read_text() == "step00000002"


# ---------------------------------------------------------------------------------------------- segmenter
def _segmenter(rule, **kw):

    from marlhf.models.loading import load_tokenizer
    from marlhf.rlhf.sections import MacroSection
    from marlhf.rlhf.segmentation import MacroSegmenter

    tok = load_tokenizer(default_model(""))
    section = MacroSection(termination_condition=rule, ngram=kw.get("n", 5), repeat_times=3,
                           split_last=kw.get("macro_reward", "sum") == "compat", response_kind="text",
                           lowprob_threshold=0.1, lowprob_model="reference",
                           parser_backend="spacy", parser_cutoff=5, parser_model="")
    return MacroSegmenter(section, tok, seed=0), tok


def _answers(tok, texts):
    from marlhf.data.pipeline import _pad

    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|endoftext|>")]
           for t in texts]
    answer, mask = _pad(ids, tok.pad_token_id)
    return answer, mask.bool()


def test_word_rule_starts_each_word(embedded):
    seg_fn, tok = _segmenter("word")
    answer, mask = _answers(tok, [" We tried a crate, it did not help."])
    seg, fallbacks = seg_fn(answer, mask, torch.zeros(answer.shape), step=0)
    words = {}
    for k, tid in enumerate(answer[0][mask[0]].tolist()):
        words.setdefault(int(seg[0, k]), []).append(tid)
    pieces = [tok.decode(w) for w in words.values()]
    assert pieces[:4] == [" We", " tried", " a", " crate,"] and fallbacks == 0


def test_parsing_rule_respects_phrases_and_counts_a_forced_fallback(embedded):
    seg_fn, tok = _segmenter("parsing")
    texts = [" My sister adopted a small grey kitten from the shelter last spring. It hides under the bed.",
             " We tried a crate, but it did not help."]
    answer, mask = _answers(tok, texts)
    seg, fallbacks = seg_fn(answer, mask, torch.zeros(answer.shape), step=0)
    assert fallbacks == 0
    n = int(mask[0].sum())
    sizes = torch.bincount(seg[0][: n - 1])  # the EOS token (empty span) joins the last action; leave it out
    assert sizes.max() <= 6 and len(sizes) >= 4  # phrases of <= C = 5 tokens (+ a sentence's closing token)
    # a macro action never spans the sentence boundary: "." ends one, "It" starts the next
    ids = answer[0][mask[0]].tolist()
    k_it = next(k for k in range(len(ids)) if tok.decode(ids[k:k + 1]).strip() == "It")
    assert seg[0, k_it] != seg[0, k_it - 1]
    # a non-canonical tokenization (cannot be aligned) falls back to fixed n-grams and is counted
    # (" crate" spelled letter by letter: the canonical tokenization is ["▁cr", "ate"])
    pieces = tok.convert_tokens_to_ids(["▁c", "r", "a", "t", "e"])
    assert tok.unk_token_id not in pieces and tok(" crate", add_special_tokens=False)["input_ids"] != pieces
    bad = torch.tensor([pieces + [tok.convert_tokens_to_ids("<|endoftext|>")]])
    seg_b, fb = seg_fn(bad, torch.ones_like(bad, dtype=torch.bool), torch.zeros(bad.shape), step=0)
    assert fb == 1 and seg_b[0].tolist() == [0, 0, 0, 0, 0, 1]


def test_compat_mode_gives_the_last_token_its_own_macro(embedded):
    seg_fn, tok = _segmenter("fixed", n=5, macro_reward="compat")
    answer, mask = _answers(tok, [" We tried a crate and it did not help at all, sadly."])
    seg, _ = seg_fn(answer, mask, torch.zeros(answer.shape), step=0)
    n = int(mask[0].sum())
    assert seg[0, n - 1] == seg[0, n - 2] + 1 and (seg[0, : n - 1] == torch.arange(n - 1) // 5).all()


def test_lora_offload_checkpointing_and_zero3_actor(nano, tmp_path):
    """One step with the memory-saving options together: ZeRO-3 actor (parameters gathered for generation),
    CPU offload (DeepSpeedCPUAdam), offloaded reference, gradient checkpointing, LoRA on the actor."""
    from transformers import AutoModelForCausalLM

    load_main(STEP3)(step3_argv(nano, tmp_path, "--max_steps", "1", "--actor_zero_stage", "3", "--offload",
                                "--critic_zero_stage", "2", "--offload_reference_model",
                                "--actor_gradient_checkpointing", "--critic_gradient_checkpointing",
                                "--actor_lora_dim", "4", "--lora_learning_rate", "5e-2"))
    (row,) = train_rows(tmp_path)
    assert torch.isfinite(torch.tensor([row["train/actor_loss"], row["train/critic_loss"]])).all()
    assert (tmp_path / "actor" / "lora_adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "actor").state_dict()
    init = AutoModelForCausalLM.from_pretrained(nano).state_dict()
    assert all(merged[k].shape == v.shape for k, v in init.items())  # gathered from the ZeRO-3 partitions
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[name], init[name])  # the LoRA update was merged into the export


@pytest.mark.slow
def test_two_ranks_zero3_actor_generates_with_synced_ranks(nano, tmp_path):
    """Per-layer ZeRO-3 fetching during generation: ranks finishing at different lengths stay in step."""
    run_launcher([*deepspeed_cmd(2, 29622), str(STEP3),
                  *step3_argv(nano, tmp_path, "--actor_zero_stage", "3", "--critic_zero_stage", "3",
                              "--zero3_generation", "synced", "--max_steps", "1")], timeout=600)
    (row,) = train_rows(tmp_path)
    assert torch.isfinite(torch.tensor([row["train/actor_loss"], row["train/critic_loss"]])).all()
    assert json.loads((tmp_path / "args.json").read_text())["zero3_generation"] == "synced"
