"""Generation from a ZeRO-3 actor (marlhf.sampler.sample) on two CPU ranks.

* ``gather``: the parameters are gathered once and ZeRO-3's per-layer hooks are off for the call — counted: no
  parameter fetch at all while generating (gathered with ``GatheredParameters`` alone, the hooks fetched every
  layer at every token);
* both modes finish when the ranks' answers end at different lengths (rank 0's after one token, rank 1's run to
  ``max_new_tokens``): before, ``gather`` left rank 0 outside ``generate`` while rank 1 all-gathered (gloo:
  "Received data size doesn't match expected size"; NCCL hangs);
* the greedy answers equal a plain (unpartitioned) model's, token for token;
* the engine trains after generating: the hooks are back, the parameters partitioned again, and one optimizer
  step moves the weights exactly as on an engine that never generated.
"""

from __future__ import annotations

import pytest
import torch
from rank_harness import run_ranks
from test_generation import PAD, PROMPTS, left_padded

pytestmark = pytest.mark.slow

MAX_NEW = 10


def _zero3_engine(folder: str):
    from marlhf.models.loading import load_causal_lm, load_tokenizer, zero3_init_config
    from marlhf.utils.ds_engine import train_engine

    tok = load_tokenizer(folder, "<|endoftext|>")
    model = load_causal_lm(folder, tok, 0.0, ds_config=zero3_init_config(3, False, "fp32"))
    return train_engine(model, lr=1e-2, weight_decay=0.0, lora_lr=1e-2, micro_batch=3, grad_accum=1, zero_stage=3,
                        offload=False, dtype="fp32", scheduler="constant", warmup=0, total_steps=4)


def _count_fetches():
    """Patch ZeRO-3's per-module parameter fetch with a counter; returns the counter (a one-element list)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    count = [0]
    original = PartitionedParameterCoordinator.fetch_sub_module

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    PartitionedParameterCoordinator.fetch_sub_module = counted
    return count


def _train_step(engine, ids, mask):
    from marlhf.models.forward import next_token_logits

    logits = next_token_logits(engine, ids, mask, 0)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss.item()


def _gathered_weights(engine) -> dict:
    import deepspeed

    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def _body(rank: int, folder: str, mode: str) -> dict:
    from transformers import AutoModelForCausalLM

    from marlhf.sampler import GenerationConfig, sample

    ids, mask = left_padded(PROMPTS)
    vocab = AutoModelForCausalLM.from_pretrained(folder).config.vocab_size
    # rank 0 stops at any token (every answer ends after one), rank 1 at none it can produce (runs to the cap)
    stops = tuple(range(vocab)) if rank == 0 else (vocab + 7,)
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, stop_ids=stops, pad_id=PAD, temperature=1.0, top_k=0, top_p=1.0,
                           do_sample=False)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = sample(plain, ids, mask, cfg)

    engine = _zero3_engine(folder)
    count = _count_fetches()
    got = sample(engine, ids, mask, cfg, zero3_generation=mode)
    fetches = count[0]
    # every parameter partitioned again, but those ZeRO-3 keeps whole on every rank (below its persistence threshold)
    partitioned = all(p.numel() == 0 for p in engine.module.parameters() if not getattr(p, "ds_persist", False))
    # one training step after generating, and the same step on a fresh engine that never generated
    loss = _train_step(engine, ids, mask)
    after = _gathered_weights(engine)
    fresh = _zero3_engine(folder)
    fresh_loss = _train_step(fresh, ids, mask)
    fresh_after = _gathered_weights(fresh)
    return {"seq": got.seq, "expected": expected.seq, "lengths": got.lengths, "fetches": fetches,
            "partitioned": partitioned, "loss": (loss, fresh_loss),
            "max_diff": max((after[k] - fresh_after[k]).abs().max().item() for k in after)}


@pytest.mark.parametrize("mode", ["gather", "synced"])
def test_zero3_generation_on_two_ranks_with_answers_of_different_lengths(mode, tmp_path):
    from marlhf import embedded

    folder = str(embedded.prepare(size="nano").model_dir)
    results = run_ranks(_body, tmp_path, folder, mode, timeout=240)
    for rank, res in enumerate(results):
        assert torch.equal(res["seq"], res["expected"]), f"rank {rank}: greedy answers differ from the plain model's"
        assert res["partitioned"], f"rank {rank}: parameters left gathered after generate"
        assert res["loss"][0] == res["loss"][1], f"rank {rank}: the forward after generate differs"
        assert res["max_diff"] == 0.0, f"rank {rank}: the step after generate differs by {res['max_diff']}"
    assert results[0]["lengths"].tolist() == [1, 1, 1]
    assert results[1]["lengths"].tolist() == [MAX_NEW] * 3
    if mode == "gather":  # gathered once, hooks off: no per-layer fetch while generating
        assert [r["fetches"] for r in results] == [0, 0]
    else:  # fetched layer by layer at every token, and rank 0 kept stepping until rank 1's answers ended
        assert all(r["fetches"] >= MAX_NEW for r in results), [r["fetches"] for r in results]
