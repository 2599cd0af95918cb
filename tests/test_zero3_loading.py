"""Models load in the run's dtype, and under ZeRO-3 already partitioned (``deepspeed.zero.Init`` through
transformers' ``HfDeepSpeedConfig``): each of two CPU ranks holds half of every tensor, never the whole model,
and the partitions gathered are the saved weights."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from rank_harness import run_ranks
from safetensors.torch import load_file

NEW_TOKEN = "<|new-token|>"


def _tokenizer(folder: str):
    from marlhf.models.loading import load_tokenizer

    tok = load_tokenizer(folder, "<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": [NEW_TOKEN]})  # one more row: a resize under ZeRO-3
    return tok


def _gathered(model) -> dict[str, torch.Tensor]:
    import deepspeed

    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def _shares(model) -> dict:
    params = list(model.parameters())
    return {"partitioned": all(hasattr(p, "ds_id") and p.numel() == 0 for p in params),
            "local": sum(p.ds_tensor.numel() for p in params),
            "full": sum(p.ds_numel for p in params),
            "half": sum(math.ceil(p.ds_numel / 2) for p in params),
            "dtypes": {p.ds_tensor.dtype for p in params}}


def _zero3_body(rank: int, folder: str) -> dict:
    from transformers.integrations import is_deepspeed_zero3_enabled

    from marlhf.models.loading import load_causal_lm, load_reward_model, zero3_init_config

    tok = _tokenizer(folder)
    out = {}
    lm = load_causal_lm(folder, tok, ds_config=zero3_init_config(3, False, "fp32"))
    out["lm"], out["lm_weights"] = _shares(lm), _gathered(lm)
    out["zero3_left_on"] = is_deepspeed_zero3_enabled()
    bf16 = load_causal_lm(folder, tok, dtype=torch.bfloat16, ds_config=zero3_init_config(3, False, "bf16"))
    out["bf16"], out["bf16_weights"] = _shares(bf16), _gathered(bf16)
    # a reward model from a causal LM: fresh score head, and a likelihood term started from the (tied) embeddings
    rm = load_reward_model(folder, tok, likelihood_term=True, ds_config=zero3_init_config(3, False, "fp32"))
    out["rm"], out["rm_weights"] = _shares(rm), _gathered(rm)
    return out


def test_zero3_loading_partitions_every_model_on_two_ranks(embedded, tmp_path):
    from marlhf import embedded as emb

    folder = str(emb.prepare(size="nano").model_dir)
    saved = load_file(Path(folder) / "model.safetensors")
    r0, r1 = run_ranks(_zero3_body, tmp_path, folder)
    for r in (r0, r1):
        for kind in ("lm", "bf16", "rm"):
            shares = r[kind]
            assert shares["partitioned"], kind  # built partitioned: no rank holds a full tensor
            # each rank holds its half of every tensor (DeepSpeed pads a partition to ceil(n / 2))
            assert shares["local"] == shares["half"], kind
            assert shares["full"] / 2 <= shares["local"] <= shares["full"] / 2 + 64, kind
        assert r["lm"]["dtypes"] == {torch.float32} and r["bf16"]["dtypes"] == {torch.bfloat16}
        assert r["zero3_left_on"] is False  # later loads (a ZeRO-0 engine's) are not partitioned
    V = saved["model.embed_tokens.weight"].shape[0]
    for r in (r0, r1):
        lm, bf16, rm = r["lm_weights"], r["bf16_weights"], r["rm_weights"]
        assert lm["model.embed_tokens.weight"].shape[0] == V + 1  # the added token's row
        for name, want in saved.items():
            got = lm[name][:V] if name == "model.embed_tokens.weight" else lm[name]
            assert torch.equal(got, want), name
            assert torch.equal(bf16[name][:V] if name == "model.embed_tokens.weight" else bf16[name],
                               want.to(torch.bfloat16)), name
            if name.startswith("model."):  # the reward model's backbone is the same checkpoint
                assert torch.equal(rm[name][:V] if name == "model.embed_tokens.weight" else rm[name], want), name
        assert rm["score.weight"].abs().sum() > 0  # initialised (on rank 0, scattered) rather than left empty
        head = rm["likelihood.lm_head.weight"]
        # tied: it starts as the input embeddings, the added token's row included (gathered to be read)
        assert torch.equal(head[:V], saved["model.embed_tokens.weight"])
        assert torch.equal(head, rm["model.embed_tokens.weight"])
        assert rm["likelihood.scale"].tolist() == [1.0]
    for key in ("lm_weights", "rm_weights"):  # one model, not two: the ranks' gathered tensors agree
        assert all(torch.equal(r0[key][n], r1[key][n]) for n in r0[key]), key


def test_loading_in_the_run_dtype(embedded):
    """No fp32 copy of a bf16 run's model: the weights arrive in bf16, the saved values rounded once."""
    from marlhf import embedded as emb
    from marlhf.models.loading import load_causal_lm, load_options

    folder = str(emb.prepare(size="nano").model_dir)
    saved = load_file(Path(folder) / "model.safetensors")
    model = load_causal_lm(folder, _tokenizer(folder), dtype=torch.bfloat16)
    state = model.state_dict()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(state[name], saved[name].bfloat16())

    opts = load_options("bf16", zero_stage=3, offload=True)
    assert opts["dtype"] == torch.bfloat16
    assert opts["ds_config"]["zero_optimization"]["stage"] == 3
    assert opts["ds_config"]["zero_optimization"]["offload_param"] == {"device": "cpu"}  # as the engine's
    assert opts["ds_config"]["bf16"] == {"enabled": True}
    # stages 0-2 hold full tensors
    assert load_options("fp32", zero_stage=2, offload=False) == {"dtype": torch.float32, "ds_config": None}
