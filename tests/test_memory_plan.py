"""The memory plan (marlhf/models/memory_plan.py; a step's, marlhf/cli/_memory.py): model states equal
DeepSpeed's own estimators to the byte, parameter counts equal DeepSpeed's count of a real model, the KV cache
equals the hand formula and a real cache, and a plan that cannot fit is refused naming the flags that fit."""

import json

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage3 import model_to_params as ds_model_to_params
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from transformers import AutoModelForCausalLM, LlamaConfig

from marlhf.cli import _memory as step_plan
from marlhf.errors import ConfigError
from marlhf.models import memory_plan as mp

GiB = 2 ** 30
# Meta-Llama-3-8B's config.json (public values); its parameter count is 8,030,261,248
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 128000,
             "eos_token_id": 128001, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def shape(params, largest=0, **dims):
    base = dict(layers=2, hidden=64, intermediate=256, heads=4, kv_heads=2, head_dim=16, vocab=1000)
    return mp.ModelShape(params=params, largest_layer=largest, **{**base, **dims})


@pytest.mark.parametrize("params", [7_000_000_000, 8_537_680_896, 123_456_789])
@pytest.mark.parametrize("gpus", [1, 2, 8, 16])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_zero2_equals_deepspeed_estimator(params, gpus, offload, dtype):
    cpu, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus, cpu_offload=offload)
    assert mp.model_states(shape(params), trained=True, zero_stage=2, world_size=gpus, dtype=dtype,
                           offload=offload) == (gpu, cpu)


@pytest.mark.parametrize("params,largest", [(7_000_000_000, 786_432_000), (27_227_128_320, 1_179_648_000),
                                            (123_456_789, 1_000_003)])
@pytest.mark.parametrize("gpus", [1, 8, 16])
@pytest.mark.parametrize("offload,offload_params", [(False, False), (True, False), (True, True)])
def test_zero3_equals_deepspeed_estimator_with_the_largest_layer(params, largest, gpus, offload, offload_params):
    cpu, gpu, largest_bytes = estimate_zero3_model_states_mem_needs(
        params, largest, num_gpus_per_node=gpus, cpu_offload=offload, cpu_offload_params=offload_params)
    assert largest_bytes == 4 * largest
    assert mp.model_states(shape(params, largest), trained=True, zero_stage=3, world_size=gpus, dtype="bf16",
                           offload=offload, offload_params=offload_params) == (gpu, cpu)


def test_the_other_cases_by_hand():
    s = shape(1_000_000_000, 100_000_000)
    P = 1_000_000_000

    def states(**kw):
        return mp.model_states(s, **{"trained": True, "world_size": 8, **kw})[0]

    # fp32 ZeRO-0 (the defaults): 4 weights + 4 gradients + 8 Adam = 16 bytes per parameter, nothing partitioned
    assert states(zero_stage=0, dtype="fp32") == 16 * P
    # mixed ZeRO-0: 2 + 18; ZeRO-1: 2 weights + 2 16-bit gradients whole, the other 16 over 8 ranks
    assert states(zero_stage=0, dtype="bf16") == 20 * P
    assert states(zero_stage=1, dtype="bf16") == 4 * P + 2 * P
    # fp32 ZeRO-2: 4 weights whole, 12 over 8; ZeRO-3: 4·largest + 16 over 8
    assert states(zero_stage=2, dtype="fp32") == 4 * P + 12 * P // 8
    assert states(zero_stage=3, dtype="fp32") == 4 * 100_000_000 + 16 * P // 8
    # frozen: the weights; at ZeRO-3 a share plus the gathered layer, none on the GPU but that with offload
    assert mp.model_states(s, trained=False, zero_stage=2, world_size=8, dtype="bf16") == (2 * P, 0)
    assert mp.model_states(s, trained=False, zero_stage=3, world_size=8, dtype="bf16") == (4 * 10 ** 8 + P // 4, 0)
    assert mp.model_states(s, trained=False, zero_stage=3, world_size=8, dtype="bf16", offload=True) \
        == (4 * 10 ** 8, int(2 * P * 1.5))
    # LoRA, adapters only trained: 2·(P + L) weights + 18·L at ZeRO-0
    lora = mp.ModelShape(**{**s.__dict__, "lora_params": 4_000_000})
    assert mp.model_states(lora, trained=True, zero_stage=0, world_size=1, dtype="bf16", lora_only=True)[0] \
        == 2 * (P + 4_000_000) + 18 * 4_000_000


def test_a_trained_model_is_planned_at_the_stage_its_engine_runs():
    from marlhf.utils.ds_engine import optimizer_zero_stage

    for dtype in ("fp32", "bf16", "fp16"):
        for stage in range(4):
            assert mp.engine_stage(stage, dtype) == optimizer_zero_stage(stage, dtype)
    # bf16 at --zero_stage 0 runs as ZeRO-1: 2 + 2 bytes whole and 16 over the ranks, not 20 whole
    line = mp._model_line("policy", shape(10 ** 9), trained=True, zero_stage=0, world_size=8, dtype="bf16")
    assert (line.zero_stage, line.gpu) == (1, 4 * 10 ** 9 + 2 * 10 ** 9)


def tiny_llama(**kw):
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128)
    return LlamaConfig(**{**cfg, **kw})


@pytest.mark.parametrize("tied", [False, True])
def test_meta_counts_equal_deepspeeds_count_of_the_real_model(tied):
    cfg = tiny_llama(tie_word_embeddings=tied)
    got = mp.shape_of(cfg)
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(cfg)
    total, largest = ds_model_to_params(real)
    assert (got.params, got.largest_layer) == (total, largest)
    # embedding 320·64 (+ an untied head), 3 layers of q,o 64·64, k,v 64·32, MLP 3·64·160, 2 norms; final norm
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + 2 * 64
    assert got.params == 320 * 64 * (1 if tied else 2) + 3 * layer + 64
    assert (got.kv_heads, got.head_dim, got.layers) == (2, 16, 3)


def test_lora_count_equals_the_trainable_parameters_peft_adds():
    from marlhf.models.lora import apply_lora

    cfg = tiny_llama()
    got = mp.shape_of(cfg, lora_dim=4)
    model = apply_lora(AutoModelForCausalLM.from_config(cfg), 4, "", only_optimize_lora=True)
    assert got.lora_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # 3 layers × r·(in + out) over q (64+64), k (64+32), v (64+32), o (64+64), gate, up (64+160), down (160+64)
    assert got.lora_params == 3 * 4 * (128 + 96 + 96 + 128 + 3 * 224)


def test_kv_cache_hand_formula_and_a_real_cache():
    cfg = tiny_llama()
    s = mp.shape_of(cfg)
    # 3 rows × 10 tokens × 3 layers × 2 (k, v) × 2 key-value heads (GQA: not the 4 query heads) × 16 × 4 bytes
    assert mp.kv_cache_bytes(s, rows=3, seq_len=10, dtype="fp32") == 3 * 10 * 3 * 2 * 2 * 16 * 4 == 23040
    assert mp.kv_cache_bytes(s, rows=3, seq_len=10, dtype="bf16") == 11520
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        cache = model(torch.ones(3, 10, dtype=torch.long), use_cache=True).past_key_values
    measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert measured == 23040


def test_activations_by_hand():
    s = shape(10 ** 6, layers=2, hidden=64, intermediate=256, heads=4, vocab=1000)
    tokens = 2 * 8
    # per layer (16-bit): 18·sbh + 4·sbI = 16·(18·64 + 4·256) = 34816 bytes; eager adds 5·a·s·sb = 5·4·8·16
    per_layer = tokens * (18 * 64 + 4 * 256)
    assert mp.activation_bytes(s, rows=2, seq_len=8, dtype="bf16", checkpointing=False, logits=False) \
        == 2 * per_layer
    assert mp.activation_bytes(s, rows=2, seq_len=8, dtype="bf16", checkpointing=False, logits=False,
                               eager_attention=True) == 2 * (per_layer + 5 * 4 * 8 * tokens)
    # checkpointing: each layer's input (2·sbh) and one layer recomputed; fp32 doubles; logits s·b·V·bytes
    assert mp.activation_bytes(s, rows=2, seq_len=8, dtype="bf16", checkpointing=True, logits=False) \
        == 2 * tokens * 64 * 2 + per_layer
    assert mp.activation_bytes(s, rows=2, seq_len=8, dtype="fp32", checkpointing=False) \
        == 2 * 2 * per_layer + tokens * 1000 * 4


@pytest.fixture
def llama3_8b(tmp_path):
    folder = tmp_path / "llama3-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    return str(folder)


def sft_args(model, *flags):
    from marlhf.config import SFTArgs, parse_args

    args, _ = parse_args(SFTArgs, ["--model_name_or_path", model, "--output_dir", "/tmp/unused", *flags])
    return args


def test_llama3_8b_from_a_config_only_folder(llama3_8b):
    shapes = step_plan.step_shapes("sft", sft_args(llama3_8b), llama3_8b)
    assert shapes["policy"].params == 8_030_261_248
    assert shapes["policy"].largest_layer == 128256 * 4096  # the embedding (and the untied head)


def test_refused_naming_the_flags_that_fit(llama3_8b):
    # fp32 ZeRO-0 on 8 ranks of 40 GiB: 16 bytes × 8.03 B = 119.7 GiB of model states alone.  bf16 alone does
    # not fit (20 bytes at ZeRO-0); ZeRO-3 does (16·P/8 + 4·largest = 17.9 GiB, plus activations)
    args = sft_args(llama3_8b, "--per_device_train_batch_size", "1", "--max_seq_len", "512")
    with pytest.raises(ConfigError) as err:
        step_plan.check_memory("sft", args, llama3_8b, world_size=8, device_bytes=40 * GiB)
    text = str(err.value)
    assert "per GPU (8 ranks) and the device has 40.0 GiB" in text
    assert "--zero_stage 3 (" in text and "--offload --zero_stage 3 (" in text
    assert "--dtype bf16" not in text
    plan = step_plan.plan_step("sft", args, step_plan.step_shapes("sft", args, llama3_8b), 8)
    assert plan.model_state_bytes == 16 * 8_030_261_248
    # warn: the same plan runs, the message logged
    assert step_plan.check_memory("sft", args, llama3_8b, world_size=8, device_bytes=40 * GiB, mode="warn").peak \
        == plan.peak


def test_flags_combined_and_nothing_fits(llama3_8b):
    args = sft_args(llama3_8b)
    # one rank of 8 GiB: only the changes together fit (ZeRO-3 with offload keeps the gathered embedding,
    # 4 · 128256 · 4096 bytes = 1.96 GiB, and one checkpointed micro-batch on the GPU); 153.6 GiB at the defaults:
    # 16 bytes × 8.03 B of model states and 8 × 512 tokens of fp32 activations
    with pytest.raises(ConfigError, match=r"needs 153.6 GiB per GPU \(1 rank\).* it fits with --dtype bf16 "
                                          r"--gradient_checkpointing --zero_stage 3 --offload \(4.4 GiB\)"):
        step_plan.check_memory("sft", args, llama3_8b, world_size=1, device_bytes=8 * GiB)
    with pytest.raises(ConfigError, match="no flag change makes it fit: use more GPUs"):
        step_plan.check_memory("sft", args, llama3_8b, world_size=1, device_bytes=3 * GiB)


def test_plan_only_from_a_config_only_folder(llama3_8b, capsys):
    from marlhf.cli import sft

    code = sft.main(["--model_name_or_path", llama3_8b, "--plan_only", "--plan_world_size", "8", "--dtype", "bf16",
                     "--zero_stage", "3", "--plan_device_memory_gb", "80", "--output_dir", "/tmp/unused"])
    out = capsys.readouterr().out
    assert code == 0
    assert "memory plan, step sft" in out and "8.03B" in out
    # bf16 ZeRO-3 over 8: 4·largest + 18·P/8 = 2.0 + 16.8 GiB of model states
    states = 4 * 128256 * 4096 + 18 * 8_030_261_248 // 8
    assert mp.gib(states) in out
    assert "80.0 GiB per GPU, 2.0 GiB kept free: fits" in out


def test_plan_only_on_the_embedded_default_reads_no_weights(embedded, capsys, monkeypatch):
    import safetensors
    import transformers.modeling_utils as mu

    def refuse(*a, **k):
        raise AssertionError("weights read")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(mu, "safe_open", refuse)
    from marlhf.cli import ppo
    from marlhf.models.loading import load_causal_lm, load_tokenizer

    with pytest.raises(AssertionError, match="weights read"):  # the stand-in does catch a load
        load_causal_lm(str(embedded.model_dir), load_tokenizer(str(embedded.model_dir)))

    code = ppo.main(["--plan_only", "--output_dir", "/tmp/unused"])
    out = capsys.readouterr().out
    assert code == 0
    cfg = mp.shape_of(__import__("transformers").AutoConfig.from_pretrained(embedded.model_dir))
    for role in ("actor", "reference", "critic", "reward model"):
        assert role in out
    assert f"{cfg.params / 1e6:.3g}M" in out
    assert "device: no accelerator (not checked)" in out


# the architectures docs/gpu.md plans, from their public config.json: the published parameter counts
PUBLISHED = {"gemma-2b": 2_506_172_416, "gemma-7b": 8_537_680_896, "gemma2-27b": 27_227_128_320,
             "llama3.2-3b": 3_212_749_824, "llama3-8b": 8_030_261_248}


def test_fixture_configs_have_the_published_parameter_counts():
    from pathlib import Path

    folder = Path(__file__).parent / "fixtures" / "model_configs"
    assert {name: mp.shape_of_folder(str(folder / name)).params for name in PUBLISHED} == PUBLISHED


def test_docs_memory_table_is_current_and_every_launch_script_fits():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("memory_table", root / "scripts" / "memory_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert table.main(["--check"]) == 0, "docs/gpu.md's memory table is stale: python scripts/memory_table.py"
    rows = [r for r in (root / "docs" / "gpu.md").read_text().splitlines() if r.startswith("| `step")]
    assert len(rows) == 20  # 6 + 4 + 4 + 6 scripts of steps 1, 2, DPO and 3
    assert all(r.endswith("| yes |") for r in rows), [r for r in rows if not r.endswith("| yes |")]


def test_a_step_refuses_before_any_weight_loads(embedded, tmp_path, monkeypatch):
    from marlhf.cli import sft
    from marlhf.models import loading

    def refuse(*a, **k):
        raise AssertionError("weights loaded before the memory check")

    monkeypatch.setattr(loading, "load_causal_lm", refuse)
    with pytest.raises(ConfigError, match=r"and the device has 1.0 GiB \(2.0 GiB kept free\); no flag change"):
        sft.main(["--plan_device_memory_gb", "1", "--output_dir", str(tmp_path / "out")])
    log = (tmp_path / "out" / "train.log").read_text()  # the plan is in the run's log
    assert "memory plan, step sft" in log and "device: 1.0 GiB per GPU, 2.0 GiB kept free: DOES NOT FIT" in log
    # warn: the same plan, logged, and the run goes on to load its model (here: the stand-in that stops it)
    with pytest.raises(AssertionError, match="weights loaded before the memory check"):
        sft.main(["--plan_device_memory_gb", "1", "--memory_check", "warn", "--output_dir", str(tmp_path / "out2")])


def test_eval_policy_plan_only(llama3_8b, capsys):
    from marlhf.cli import eval_policy

    code = eval_policy.main(["--actor_model_name_or_path", llama3_8b, "--ref_model_name_or_path", llama3_8b,
                             "--reward_model_name_or_path", llama3_8b, "--dtype", "bf16", "--plan_only",
                             "--output_dir", "/tmp/unused"])
    out = capsys.readouterr().out
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()[2:5]}
    # frozen at ZeRO-0 in bf16: 2 bytes per parameter; the reward model has a 1-wide score head for the LM head
    assert mp.gib(2 * 8_030_261_248) in lines["policy"] and mp.gib(2 * 8_030_261_248) in lines["reference"]
    assert mp.gib(2 * (8_030_261_248 - 128256 * 4096 + 4096)) in lines["reward"]


def test_a_model_the_meta_device_cannot_build_runs_unplanned(llama3_8b, monkeypatch, caplog):
    def fail(*a, **k):
        raise ValueError("Unrecognized model in the config")

    monkeypatch.setattr(step_plan, "shape_of", fail)  # as the step reads it
    args = sft_args(llama3_8b)
    assert step_plan.check_memory("sft", args, llama3_8b, world_size=8, device_bytes=GiB) is None
    assert "no memory plan: the models could not be built from their configs (Unrecognized model" in caplog.text
    with pytest.raises(ConfigError, match="no memory plan"):
        step_plan.check_memory("sft", sft_args(llama3_8b, "--plan_only"), llama3_8b, world_size=8, device_bytes=GiB)
