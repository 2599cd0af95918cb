"""Issue 29's GPU traps caught on CPU: the hybrid engine refused for architectures DeepSpeed 0.19 cannot
generate with (decided from tiny configs of the real architectures, checked against the installed DeepSpeed's
own policy table), --offload refused where ZeRO-Offload cannot run, --offload_reference_model offloading at
every actor stage, mixed-precision LoRA's preconditions and node-local hpZ partition, and no optimizer that
JIT-compiles CUDA code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import load_main

from marlhf.config import RLHFArgs, SFTArgs, parse_args
from marlhf.errors import ConfigError
from marlhf.rlhf.rlhf_engine import (
    HYBRID_ENGINE_ARCHITECTURES,
    check_hybrid_engine,
    frozen_zero_stage,
    hybrid_engine_refusal,
    mixed_precision_lora_config,
)

# the smallest configs of the paper's family and of the models users bring, by model_type
TINY = {
    "gemma": dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16),
    "gemma2": dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1),
    "llama": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),  # Llama-3.x
    "bloom": dict(hidden_size=32, n_head=2),
    "gpt2": dict(n_embd=32, n_head=2),
    "gpt_neo": dict(hidden_size=32, num_heads=2, attention_types=[[["global"], 2]]),
}


@pytest.fixture(scope="module")
def nano():
    from marlhf import embedded

    return embedded.prepare(size="nano").model_dir


def tiny_config(model_type: str):
    from transformers import AutoConfig

    layers = {"bloom": "n_layer", "gpt2": "n_layer", "gpt_neo": "num_layers"}.get(model_type, "num_hidden_layers")
    return AutoConfig.for_model(model_type, vocab_size=128, **{layers: 2}, **TINY[model_type])


def deepspeed_layer_classes() -> set[type]:
    """The decoder-layer classes the installed DeepSpeed's hybrid engine has an inference container for, found
    the way ``DeepSpeedHybridEngine.populate_all_inference_policies`` finds them."""
    from deepspeed.module_inject.replace_policy import replace_policies

    out = set()
    for policy in replace_policies:
        try:
            policy(None)
        except Exception:  # a policy for a library that is not installed (megatron, ...)
            continue
        cls = policy._orig_layer_class
        out |= {c for c in (cls if isinstance(cls, list) else [cls]) if c is not None}
    return out


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_hybrid_engine_decision_agrees_with_deepspeeds_kernels(model_type):
    """A model with no layer DeepSpeed has a kernel for is refused with "no inference kernel"; one that has a
    kernel is refused only for a named reason (llama, bloom) or let through (gpt_neo)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    has_kernel = bool({type(m) for m in model.modules()} & deepspeed_layer_classes())
    reason = hybrid_engine_refusal(model_type, lora=False)
    assert has_kernel == (model_type in ("llama", "bloom", "gpt2", "gpt_neo"))
    if not has_kernel:
        assert reason == "DeepSpeed 0.19 has no inference kernel (container) for it"
    assert (reason is None) == (model_type in HYBRID_ENGINE_ARCHITECTURES)


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "qwen2", "llama"])
def test_hybrid_engine_refused_before_loading_naming_the_architecture(model_type, tmp_path):
    tiny_config(model_type).save_pretrained(tmp_path)  # a config alone: refused before any weight is read
    models = SimpleNamespace(enable_hybrid_engine=True, actor_lora_dim=0, actor_path=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        check_hybrid_engine(models)
    msg = str(err.value)
    assert f"model_type '{model_type}'" in msg and "the model's own generate()" in msg
    assert "use --generation_backend vllm instead" in msg  # where fast rollouts are
    if model_type == "llama":
        assert "grouped-query attention" in msg and "'llama3' rope scaling" in msg


def test_hybrid_engine_refuses_a_peft_actor_of_a_kernel_architecture(tmp_path):
    tiny_config("gpt_neo").save_pretrained(tmp_path)
    check_hybrid_engine(SimpleNamespace(enable_hybrid_engine=True, actor_lora_dim=0, actor_path=str(tmp_path)))
    with pytest.raises(ConfigError, match="LoRA adapters \\(peft\\), which the hybrid engine's kernels ignore"):
        check_hybrid_engine(SimpleNamespace(enable_hybrid_engine=True, actor_lora_dim=8, actor_path=str(tmp_path)))
    # the flag off: nothing is read (a folder without a config passes)
    check_hybrid_engine(SimpleNamespace(enable_hybrid_engine=False, actor_lora_dim=8, actor_path=str(tmp_path / "x")))


def test_hybrid_engine_on_a_kernel_architecture_fails_clearly_on_cpu(nano, tmp_path):
    """A tiny GPT-Neo actor (an architecture with a kernel) passes the check and reaches DeepSpeed, which
    refuses the inference kernels on the CPU backend; the message names the flag and what it needs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(nano)
    neo = tmp_path / "gpt_neo"
    cfg = tiny_config("gpt_neo")
    cfg.vocab_size, cfg.pad_token_id = len(tok), tok.pad_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(neo)
    tok.save_pretrained(neo)
    argv = ["--actor_model_name_or_path", str(neo), "--critic_model_name_or_path", str(nano),
            "--data_path", "synthetic:num_records=400", "--data_output_path", str(tmp_path / "data"),
            "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--enable_hybrid_engine",
            "--max_prompt_seq_len", "160", "--max_answer_seq_len", "24", "--disable_progress_bar"]
    with pytest.raises(RuntimeError, match="--enable_hybrid_engine: DeepSpeed could not start the actor on the "
                                           "'cpu'.*not been implemented on CPU"):
        load_main("ppo")(argv)


def test_step3_refuses_the_hybrid_engine_on_the_embedded_llama(nano, tmp_path):
    """Through step 3's entry point: the refusal comes first, with nothing written but the run's set-up."""
    argv = ["--actor_model_name_or_path", str(nano), "--critic_model_name_or_path", str(nano),
            "--data_path", "synthetic:num_records=400", "--data_output_path", str(tmp_path / "data"),
            "--output_dir", str(tmp_path), "--max_steps", "1", "--enable_hybrid_engine", "--disable_progress_bar"]
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        load_main("ppo")(argv)
    assert not (tmp_path / "initial_policy.json").exists()


def test_offload_refused_at_zero_stage_0():
    with pytest.raises(ValueError, match="--offload needs ZeRO stage 1, 2 or 3.*--zero_stage is 0"):
        parse_args(SFTArgs, ["--offload"])
    assert parse_args(SFTArgs, ["--offload", "--zero_stage", "1"])[0].offload
    with pytest.raises(ValueError, match="--actor_zero_stage and --critic_zero_stage are 0.*"
                                         "set --actor_zero_stage 2 and --critic_zero_stage 2"):
        parse_args(RLHFArgs, ["--offload"])
    with pytest.raises(ValueError, match="--actor_zero_stage is 0"):
        parse_args(RLHFArgs, ["--offload", "--critic_zero_stage", "2"])
    # a critic-free estimator trains no critic, whose stage then does not matter
    args, _ = parse_args(RLHFArgs, ["--offload", "--actor_zero_stage", "2", "--advantage_estimator", "grpo",
                                    "--num_samples_per_prompt", "2"])
    assert args.offload


def test_frozen_models_offloaded_at_every_actor_stage(nano, tmp_path):
    """--offload_reference_model with a ZeRO-2 actor: the reference, EMA and reward model are ZeRO-3 engines
    with their parameters partitioned on the CPU (before, stage 0 ignored the offload), and the reference
    still gives the actor's log-probabilities (it is the same model)."""
    from ppo_harness import make_trainer, rlhf_args

    assert [frozen_zero_stage(s, True) for s in range(4)] == [3, 3, 3, 3]
    assert [frozen_zero_stage(s, False) for s in range(4)] == [0, 1, 2, 3]
    args = rlhf_args(nano, tmp_path, actor_zero_stage=2, offload_reference_model=True, enable_ema=True)
    rlhf = make_trainer(args).rlhf
    for role in ("ref", "ema", "reward"):
        engine = getattr(rlhf, role)
        assert engine.zero_optimization_stage() == 3, role
        params = list(engine.module.parameters())
        assert all(hasattr(p, "ds_id") and p.ds_tensor.device.type == "cpu" for p in params), role
        assert engine.config["zero_optimization"]["offload_param"]["device"] == "cpu", role  # the config given
    assert rlhf.actor.zero_optimization_stage() == 2
    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    with torch.no_grad():
        want = rlhf.actor.module(input_ids=ids).logits
        got = rlhf.ref.module(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mixed_precision_lora_preconditions_and_node_local_hpz(monkeypatch):
    base = dict(enable_mixed_precision_lora=True, actor_lora_dim=8, actor_zero_stage=3)
    with pytest.raises(ConfigError, match="needs --only_optimize_lora"):
        mixed_precision_lora_config(SimpleNamespace(**base, only_optimize_lora=False))
    # 2 nodes of 4 ranks: hpZ partitions within the node's 4 ranks, whatever a rank sees as devices
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = mixed_precision_lora_config(SimpleNamespace(**base, only_optimize_lora=True))
    assert cfg["zero_optimization"] == {"zero_quantized_nontrainable_weights": True, "zero_hpz_partition_size": 4}
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    cfg = mixed_precision_lora_config(SimpleNamespace(**base, only_optimize_lora=True))
    assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 1  # one process, no launcher


def test_optimizer_never_jit_compiles(monkeypatch):
    """On an accelerator the optimizer is torch's fused AdamW, not DeepSpeed's FusedAdam (an nvcc build at the
    first run); DeepSpeedCPUAdam only for --offload."""
    import deepspeed.ops.adam as ds_adam
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from marlhf.utils import ds_engine

    class Refuse:
        def __init__(self, *a, **k):
            raise AssertionError("FusedAdam built")

    class Cuda:
        def device_name(self, *a):
            return "cuda"

    monkeypatch.setattr(ds_adam, "FusedAdam", Refuse)
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: Cuda())
    w = torch.nn.Parameter(torch.ones(3))
    opt = ds_engine.make_optimizer([{"params": [w], "weight_decay": 0.0}], 1e-3, offload=False)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert isinstance(ds_engine.make_optimizer([{"params": [w], "weight_decay": 0.0}], 1e-3, offload=True),
                      DeepSpeedCPUAdam)
