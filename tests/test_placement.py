"""--device / --dtype of the inference tools (marlhf.models.placement): auto picks the GPU and bf16 when there are
some, the CPU and fp32 here; bf16 on the CPU gives close results; the model is moved where the flags say."""

from __future__ import annotations

import pytest
import torch
from conftest import save_seeded_reward_model

from marlhf.errors import ConfigError
from marlhf.models.placement import Placement, resolve_placement
from marlhf.sections import SamplingSection


def test_auto_on_this_cpu_machine_is_cpu_fp32():
    assert not torch.cuda.is_available()
    assert resolve_placement() == Placement(torch.device("cpu"), torch.float32)
    assert resolve_placement("cpu", "bf16") == Placement(torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("bf16, want", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_a_gpu_node_is_cuda_and_bf16_where_supported(monkeypatch, bf16, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_placement() == Placement(torch.device("cuda"), want)
    assert resolve_placement("cuda:1", "fp16") == Placement(torch.device("cuda", 1), torch.float16)


def test_refusals_name_the_flag():
    with pytest.raises(ConfigError, match="--device cuda: no CUDA GPU is visible"):
        resolve_placement("cuda")
    with pytest.raises(ConfigError, match="--dtype fp16 on the CPU"):
        resolve_placement("cpu", "fp16")
    with pytest.raises(ConfigError, match="--device 'gpu0': not a device"):
        resolve_placement("gpu0")


def test_the_policy_is_moved_to_the_chosen_device_and_dtype(embedded):
    """'meta' stands in for a GPU (no CUDA here): every parameter goes where the placement says, in its dtype."""
    from marlhf import embedded as emb
    from marlhf.eval.generate_tool import LoadedPolicy

    nano = str(emb.prepare(size="nano").model_dir)
    policy = LoadedPolicy(nano, device="meta", dtype="bf16")
    assert {(p.device.type, p.dtype) for p in policy.model.parameters()} == {("meta", torch.bfloat16)}
    assert policy.placement == Placement(torch.device("meta"), torch.bfloat16)


def test_bf16_on_the_cpu_scores_and_samples_close_to_fp32(embedded, tmp_path):
    from marlhf import embedded as emb
    from marlhf.eval.generate_tool import LoadedPolicy
    from marlhf.rewards.reward_model import Scorer

    rm_dir = save_seeded_reward_model(tmp_path / "rm")
    prompts = ["Who owns the red box?", "Name the capital of the second country."]
    answers = ["The red box belongs to Ada.", "It is Lorn."]
    full = Scorer(str(rm_dir), "<|endoftext|>", device="cpu", dtype="fp32")
    half = Scorer(str(rm_dir), "<|endoftext|>", device="cpu", dtype="bf16")
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    a, b = torch.tensor(full(prompts, answers)), torch.tensor(half(prompts, answers))
    # measured: differences of about 1% of the scores' size (bf16 keeps 8 bits of mantissa)
    assert torch.allclose(a, b, atol=0.05 * a.abs().max().item()), (a, b)

    nano = str(emb.prepare(size="nano").model_dir)
    p32, p16 = LoadedPolicy(nano, device="cpu", dtype="fp32"), LoadedPolicy(nano, device="cpu", dtype="bf16")
    ids, mask = p32.encode(prompts, 64)
    with torch.no_grad():
        l32 = torch.log_softmax(p32.model(input_ids=ids, attention_mask=mask).logits[:, -1].float(), -1)
        l16 = torch.log_softmax(p16.model(input_ids=ids, attention_mask=mask).logits[:, -1].float(), -1)
    assert (l32.exp() - l16.exp()).abs().sum(-1).max() < 0.05  # next-token distributions: total variation
    cfg = p16.config(SamplingSection(max_new_tokens=8), do_sample=True, seed=3)
    responses, ended, lengths = p16.sample(prompts, cfg, 2, 64)
    assert len(responses) == 4 and all(0 < n <= 8 for n in lengths)
