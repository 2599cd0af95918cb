"""--attn_implementation (marlhf/models/loading.py): auto picks per architecture, every load passes the choice to
transformers, and flash_attention_2 where it cannot run is refused with the reason."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GemmaConfig, LlamaConfig, Qwen2Config

from marlhf.errors import PlatformError
from marlhf.models import loading

DIMS = dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {"llama": LlamaConfig(**DIMS), "gemma": GemmaConfig(**DIMS, head_dim=8),
           "gemma2": Gemma2Config(**DIMS, head_dim=8, sliding_window=64), "qwen2": Qwen2Config(**DIMS)}
# on a CPU: SDPA wherever transformers' class supports it; Gemma-2 declares no SDPA (its soft-capped attention
# logits: transformers/models/gemma2/modeling_gemma2.py, `_supports_sdpa = False`), so eager
CPU_CHOICE = {"llama": "sdpa", "gemma": "sdpa", "gemma2": "eager", "qwen2": "sdpa"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, embedded):
    from marlhf.models.loading import load_tokenizer

    tok = load_tokenizer(str(embedded.model_dir))
    out = {}
    for name, cfg in CONFIGS.items():
        folder = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        out[name] = str(folder)
    return out, tok


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_auto_per_architecture_as_loaded(arch, folders, caplog):
    paths, tok = folders
    caplog.set_level("INFO", logger="marlhf")
    lm = loading.load_causal_lm(paths[arch], tok)
    assert lm.config._attn_implementation == CPU_CHOICE[arch]
    value = loading.load_value_model(paths[arch], tok, dtype=torch.bfloat16)
    assert value.config._attn_implementation == CPU_CHOICE[arch]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention of")]
    assert lines == [f"attention of {CONFIGS[arch].model_type} (causal LM): {CPU_CHOICE[arch]} "
                     f"(--attn_implementation auto)",
                     f"attention of {CONFIGS[arch].model_type} (value model): {CPU_CHOICE[arch]} "
                     f"(--attn_implementation auto)"]


def test_the_flag_wins_and_reaches_loads_inside_the_entry_points_block(folders):
    paths, tok = folders
    assert loading.load_causal_lm(paths["llama"], tok, attn_implementation="eager").config._attn_implementation \
        == "eager"
    with loading.attention_implementation("eager"):  # step 3's engines load inside this block
        assert loading.load_reward_model(paths["qwen2"], tok).config._attn_implementation == "eager"
        assert loading.load_causal_lm(paths["gemma"], tok, **loading.load_options("fp32", 0, False)) \
            .config._attn_implementation == "eager"
    assert loading.load_causal_lm(paths["gemma"], tok).config._attn_implementation == "sdpa"


def test_flash_attention_on_a_cpu_machine_is_refused_saying_why(folders):
    paths, tok = folders
    with pytest.raises(PlatformError, match="flash_attention_2: it runs on CUDA GPUs only and this machine has "
                                            "none; use --attn_implementation auto"):
        loading.load_causal_lm(paths["llama"], tok, attn_implementation="flash_attention_2")


def test_auto_takes_flash_attention_on_a_gpu_with_the_package_in_16_bit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: object() if name == "flash_attn"
                        else real(name))
    for arch in CONFIGS:  # Gemma-2's soft-capping runs in transformers 5's flash-attention kernels
        assert loading.resolve_attn_implementation(CONFIGS[arch], "auto", torch.bfloat16) == "flash_attention_2"
        # fp32: flash-attention kernels take 16-bit only
        assert loading.resolve_attn_implementation(CONFIGS[arch], "auto", torch.float32) == CPU_CHOICE[arch]
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None if name == "flash_attn"
                        else real(name))
    assert loading.resolve_attn_implementation(CONFIGS["gemma2"], "auto", torch.bfloat16) == "eager"
    with pytest.raises(PlatformError, match="the flash-attn package is not installed"):
        loading.resolve_attn_implementation(CONFIGS["llama"], "flash_attention_2", torch.bfloat16)


def test_every_step_and_eval_tool_takes_the_flag():
    from marlhf.config import DPOArgs, PolicyEvalArgs, RewardArgs, RLHFArgs, SFTArgs, build_parser

    for cls in (SFTArgs, RewardArgs, DPOArgs, RLHFArgs, PolicyEvalArgs):
        ns = build_parser(cls).parse_args(["--attn_implementation", "eager"])
        assert ns.attn_implementation == "eager"


def test_a_class_transformers_does_not_map_keeps_its_own_choice():
    from transformers import PretrainedConfig

    class RemoteConfig(PretrainedConfig):  # what trust_remote_code brings: no class in transformers' tables
        model_type = "my_remote_lm"

    assert loading.resolve_attn_implementation(RemoteConfig(), "auto") is None
    assert loading._attn_kwargs(RemoteConfig(), torch.float32, False, "auto") == {}
    assert loading.resolve_attn_implementation(RemoteConfig(), "eager") == "eager"


def test_soft_capped_attention_never_gets_sdpa(monkeypatch):
    """Gemma-2's attention logits are soft-capped, which SDPA cannot compute; transformers before 5.21 declared
    sdpa for Gemma-2 anyway and ran it without the cap.  Whatever the class declares, auto picks eager for a
    soft-capped config and sdpa asked for by name is refused, naming the cap."""
    from transformers import Gemma2ForCausalLM

    monkeypatch.setattr(Gemma2ForCausalLM, "_supports_sdpa", True)  # what transformers < 5.21 declared
    gemma2 = CONFIGS["gemma2"]
    assert gemma2.attn_logit_softcapping == 50.0
    assert loading.resolve_attn_implementation(gemma2, "auto", torch.float32) == "eager"
    with pytest.raises(PlatformError, match=r"sdpa: gemma2's attention logits are soft-capped "
                                            r"\(attn_logit_softcapping=50.0\), which SDPA cannot compute"):
        loading.resolve_attn_implementation(gemma2, "sdpa")
    uncapped = type(gemma2).from_dict({**gemma2.to_dict(), "attn_logit_softcapping": None})
    assert loading.resolve_attn_implementation(uncapped, "auto", torch.float32) == "sdpa"
