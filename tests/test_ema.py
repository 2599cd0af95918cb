"""--enable_ema keeps the average in float32 (issue 29, item 3).

A bf16 actor takes many tiny optimizer steps (an fp32 master moved by lr per step, rounded to bf16 as the
DeepSpeed bf16 engine holds it).  The float32 EMA follows an fp64 EMA of the same bf16 weights to float32
rounding; the old bf16 average (``lerp`` in bf16) kept only a small share of the movement.  A bf16 step-3
engine builds its EMA in float32 and a checkpoint round trip keeps it bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from marlhf.rlhf.rlhf_engine import update_ema

DECAY = 0.992  # the --ema_decay default
STEPS = 300


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1)
    return LlamaForCausalLM(cfg)


def run(lr: float) -> dict[str, float]:
    """STEPS tiny updates of a bf16 actor; returns the share of the true (fp64 EMA) movement each EMA captured,
    and the float32 EMA's largest deviation from the fp64 one relative to that movement."""
    actor = tiny_llama().to(torch.bfloat16)
    names = [n for n, _ in actor.named_parameters()]
    master = {n: p.detach().double().clone() for n, p in actor.named_parameters()}  # the optimizer's fp32 master
    init = {n: p.detach().double().clone() for n, p in actor.named_parameters()}
    ema32 = tiny_llama()  # the EMA engine's module: float32, starts from the same weights as the actor
    with torch.no_grad():
        for n, p in ema32.named_parameters():
            p.copy_(init[n])
    ref64 = dict(init)  # the reference EMA loop in float64
    old_bf16 = {n: p.detach().clone() for n, p in actor.named_parameters()}  # the former bf16 average
    g = torch.Generator().manual_seed(1)
    direction = {n: torch.randn(master[n].shape, generator=g, dtype=torch.float64) for n in names}
    for _ in range(STEPS):
        with torch.no_grad():
            for n, p in actor.named_parameters():  # an Adam-like step: about lr per weight, a steady drift + noise
                noise = torch.randn(master[n].shape, generator=g, dtype=torch.float64)
                master[n] += lr * (direction[n].sign() + 0.5 * noise)
                p.copy_(master[n].to(torch.bfloat16))  # the engine's bf16 weights
        update_ema(SimpleNamespace(module=actor), SimpleNamespace(module=ema32), DECAY)
        bf = dict(actor.named_parameters())
        for n in names:
            ref64[n] = DECAY * ref64[n] + (1 - DECAY) * bf[n].detach().double()
            old_bf16[n] = torch.lerp(bf[n].detach(), old_bf16[n], DECAY)  # the code before the fix, in bf16
    e32 = dict(ema32.named_parameters())
    move = torch.cat([(ref64[n] - init[n]).flatten() for n in names])
    moved32 = torch.cat([(e32[n].detach().double() - init[n]).flatten() for n in names])
    moved16 = torch.cat([(old_bf16[n].double() - init[n]).flatten() for n in names])
    err32 = torch.cat([(e32[n].detach().double() - ref64[n]).flatten() for n in names])
    scale = torch.cat([ref64[n].flatten() for n in names]).abs().max().item()
    share = lambda moved: (moved @ move / (move @ move)).item()  # noqa: E731 - projection onto the true movement
    return {"captured32": share(moved32), "captured16": share(moved16),
            "err32": err32.abs().max().item(), "move": move.abs().max().item(), "scale": scale,
            "dtype": str(e32[names[0]].dtype)}


# the paper's actor rates for Gemma-2B and Gemma-7B; the share of the movement the bf16 average kept was
# measured 0.34 and 0.024 here (the issue measured 0.09 and 0.006 on its model)
@pytest.mark.parametrize("lr,bf16_share", [(1.5e-5, 0.5), (1e-6, 0.05)])
def test_float32_ema_tracks_an_fp64_ema_where_a_bf16_one_stalls(lr, bf16_share):
    r = run(lr)
    assert r["dtype"] == "torch.float32"
    # float32 rounding: each of the 300 updates rounds once (2^-24 relative to the weights' size)
    assert r["err32"] <= STEPS * r["scale"] * 2 ** -24, r
    assert abs(r["captured32"] - 1) < 1e-3, r
    assert r["captured16"] < bf16_share, r


def test_a_bf16_step3_engine_keeps_its_ema_in_float32_through_a_checkpoint(tmp_path):
    from ppo_harness import make_trainer, rlhf_args

    from marlhf import embedded
    from marlhf.utils import checkpoint

    nano = embedded.prepare(size="nano").model_dir
    args = rlhf_args(nano, tmp_path / "run", dtype="bf16", enable_ema=True, ema_decay=0.5)
    t = make_trainer(args)
    rlhf = t.rlhf
    assert {p.dtype for p in rlhf.actor.module.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in rlhf.ema.module.parameters()} == {torch.float32}
    with torch.no_grad():  # an actor that moved by less than a bf16 step of the EMA's weights would stay visible
        for p in rlhf.actor.module.parameters():
            p.add_(torch.full_like(p, 2 ** -12))
    before = {n: p.detach().clone() for n, p in rlhf.ema.module.named_parameters()}
    update_ema(rlhf.actor, rlhf.ema, args.ema_decay)
    actor = dict(rlhf.actor.module.named_parameters())
    for n, p in rlhf.ema.module.named_parameters():
        want = before[n] + 0.5 * (actor[n].detach().float() - before[n])
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=2 ** -24 * (1 + want.abs().max().item()))
    saved = {n: p.detach().clone() for n, p in rlhf.ema.module.named_parameters()}
    root = tmp_path / "ckpt"
    checkpoint.save_checkpoint(root, rlhf.trainable(), 1, {"epoch": 0, "batches_done": 1})
    with torch.no_grad():
        for p in rlhf.ema.module.parameters():
            p.zero_()
    checkpoint.load_checkpoint(root, rlhf.trainable())
    for n, p in rlhf.ema.module.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), saved[n]), n
