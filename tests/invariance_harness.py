"""Train every model of every step for two optimizer steps on a fixed global batch, at one placement (ranks,
ZeRO stage, gradient accumulation, dtype): what tests/test_update_invariance.py compares across placements.

A global batch of ``GLOBAL`` examples per optimizer step is split over ``world`` ranks × ``accum``
micro-batches of ``GLOBAL / (world·accum)``; every split of the same batch must give the same update (the losses
are token / pair means over the whole optimizer step: marlhf.utils.optim_step).  Each model is built, wrapped
and stepped by the project's own code: steps 1-2's recipe (``SupervisedRecipe.step``) for SFT, the reward model
and DPO, step 3's trainer (``build_trainer`` from its flags, ``ppo_update`` and the EMA) for actor and critic.
Returned: each model's weights after the steps, float32 master copies where DeepSpeed keeps them, flattened."""

from __future__ import annotations

from pathlib import Path

import torch

GLOBAL = 4  # examples per optimizer step
STEPS = 2
LR = 2e-3


def _shares(world: int, accum: int, rank: int) -> list[list[list[int]]]:
    """Per optimizer step, per micro-step of this rank: the global example indices it trains on."""
    micro = GLOBAL // (world * accum)
    return [[[k * GLOBAL + (rank * accum + j) * micro + i for i in range(micro)] for j in range(accum)]
            for k in range(STEPS)]


def _seq_items(n: int, seed: int, vocab: int) -> list[dict]:
    """SFT examples of different lengths: a prompt and an answer (labels on the answer)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, a = int(torch.randint(3, 8, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
        out.append({"input_ids": torch.randint(5, vocab, (p + a,), generator=g).tolist(), "response_start": p})
    return out


def _pair_items(n: int, seed: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(3, 7, (1,), generator=g))
        prompt = torch.randint(5, vocab, (p,), generator=g).tolist()
        a, b = (torch.randint(5, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
                for _ in range(2))
        out.append({"chosen_ids": prompt + a, "chosen_start": p, "rejected_ids": prompt + b, "rejected_start": p})
    return out


def _master_weights(engine) -> dict[str, torch.Tensor]:
    """Each parameter's float32 master copy (DeepSpeed's, under bf16 or ZeRO), else the parameter: collective
    under ZeRO-3 (every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        if full is None:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                full = p.detach().float().clone()
        out[name] = full.detach().float().cpu().reshape(-1)
    return out


def _section(stage: str, zero: int, accum: int, dtype: str):
    from marlhf.sections import EngineSection, ScheduleSection

    return EngineSection(stage=stage, learning_rate=LR, weight_decay=0.0, lora_learning_rate=LR, zero_stage=zero,
                         offload=False, dtype=dtype, gradient_checkpointing=False,
                         schedule=ScheduleSection(gradient_accumulation_steps=accum, lr_scheduler_type="constant"))


def _supervised(folder: str, rm_folder: str, world: int, accum: int, zero: int, dtype: str, rank: int) -> dict:
    from marlhf.dpo import dpo_objective
    from marlhf.models.loading import load_causal_lm, load_options, load_reward_model, load_tokenizer
    from marlhf.supervised import SupervisedRecipe, reward_objective, sft_objective
    from marlhf.utils import dist
    from marlhf.utils.ds_engine import engine_from_section, frozen_engine

    tok = load_tokenizer(folder, "<|endoftext|>")
    vocab = 200
    shares = _shares(world, accum, rank)
    micro = GLOBAL // (world * accum)
    out = {}
    seq_items = _seq_items(GLOBAL * STEPS, 1, vocab)
    pair_items = _pair_items(GLOBAL * STEPS, 2, vocab)

    def run(name, model, objective, items):
        dist.set_seed(0)
        engine = engine_from_section(model, _section(name, zero, accum, dtype), STEPS, micro)
        recipe = SupervisedRecipe(engine, objective, None, "token_mean", 0, len(items))
        engine.train()
        for k, windows in enumerate(shares):
            recipe.step([objective.collator([items[i] for i in idx]) for idx in windows], k)
        out[name] = _master_weights(engine)

    opts = load_options(dtype, zero, False)
    run("sft", load_causal_lm(folder, tok, 0.0, **opts), sft_objective(tok.pad_token_id), seq_items)
    run("reward", load_reward_model(rm_folder, tok, 0.0, likelihood_term=True, **opts),
        reward_objective(tok.pad_token_id), pair_items)
    frozen_stage = 3 if zero == 3 else 0
    reference = frozen_engine(load_causal_lm(folder, tok, 0.0, **load_options(dtype, frozen_stage, False)),
                              zero_stage=frozen_stage, offload=False, dtype=dtype)
    run("dpo", load_causal_lm(folder, tok, 0.0, **opts), dpo_objective(tok.pad_token_id, reference, beta=0.5),
        pair_items)
    return out


def _experience(actor_folder: str, n: int, seed: int):
    """A fixed experience batch: prompts left-padded, answers of different lengths, π_old from the SFT model."""
    from transformers import AutoModelForCausalLM

    from marlhf.rlhf.rollout import Experience, policy_logprobs

    g = torch.Generator().manual_seed(seed)
    P, A = 6, 8
    seq = torch.randint(5, 200, (n, P + A), generator=g)
    prompt_len = torch.randint(3, P + 1, (n,), generator=g)
    answer_len = torch.randint(2, A + 1, (n,), generator=g)
    cols = torch.arange(P + A)
    attn = ((cols[None] >= P - prompt_len[:, None]) & (cols[None] < P + answer_len[:, None])).long()
    seq = torch.where(attn.bool(), seq, 0)
    mask = attn[:, P:].bool()
    plain = AutoModelForCausalLM.from_pretrained(actor_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        old = policy_logprobs(plain, seq, attn, P) + 0.05 * torch.randn((n, A), generator=g)
    rnd = lambda: torch.randn((n, A), generator=g) * mask  # noqa: E731
    seg = torch.where(mask, cols[:A][None] // 3, -1)
    return Experience(seq, attn, P, mask, old * mask, rnd(), rnd(), torch.randn(n, generator=g), rnd(), seg, rnd(),
                      rnd())


def _ptx_items(n: int, vocab: int = 200) -> list[dict]:
    return _seq_items(n, 3, vocab)


def _step3(folder: str, rm_folder: str, world: int, accum: int, zero: int, dtype: str, rank: int,
           out_dir: str) -> dict:
    import ppo_harness

    from marlhf.data.pipeline import SFTCollator
    from marlhf.rlhf.rlhf_engine import update_ema

    micro = GLOBAL // (world * accum)
    flags = {"actor_zero_stage": zero, "critic_zero_stage": zero, "gradient_accumulation_steps": accum,
             "dtype": dtype, "per_device_training_batch_size": micro,
             "per_device_generation_batch_size": micro * accum * STEPS, "enable_ema": True, "ema_decay": 0.5,
             "actor_learning_rate": LR, "critic_learning_rate": LR, "critic_model_name_or_path": rm_folder,
             "output_dir": str(Path(out_dir) / f"step3-{rank}"),
             "unsupervised_dataset_name": "synthetic:num_records=50", "unsup_coef": 0.5}
    args = ppo_harness.rlhf_args(folder, Path(out_dir) / f"step3-{rank}", **flags)
    trainer = ppo_harness.make_trainer(args)
    exp = _experience(folder, GLOBAL * STEPS, 4)
    ptx_all = _ptx_items(GLOBAL * STEPS)
    collate = SFTCollator(trainer.tokenizer.pad_token_id)
    for k, windows in enumerate(_shares(world, accum, rank)):
        rows = [i for idx in windows for i in idx]
        mine = _rows(exp, rows)
        ptx_batches = iter([collate([ptx_all[i] for i in idx]) for idx in windows])
        trainer.ppo_update([mine], ptx_batches)
        trainer.guard.end_step(k + 1)
        update_ema(trainer.rlhf.actor, trainer.rlhf.ema, 0.5)
    return {"actor": _master_weights(trainer.rlhf.actor), "critic": _master_weights(trainer.rlhf.critic),
            "ema": _master_weights(trainer.rlhf.ema)}


def _rows(exp, rows: list[int]):
    import dataclasses

    picked = {}
    for f in dataclasses.fields(exp):
        v = getattr(exp, f.name)
        picked[f.name] = v[rows] if torch.is_tensor(v) and v.dim() > 0 else v
    return type(exp)(**picked)


def body(rank: int, folder: str, rm_folder: str, out_dir: str, configs: list[tuple]) -> dict:
    """Every (zero, accum, dtype, models) of ``configs`` at this world size; {config: {model: weights}}."""
    from marlhf.utils import dist

    world = dist.world_size()
    results = {}
    for zero, accum, dtype, models in configs:
        got = {}
        if "supervised" in models:
            got.update(_supervised(folder, rm_folder, world, accum, zero, dtype, rank))
        if "step3" in models:  # actor with the ptx loss, critic, EMA
            got.update(_step3(folder, rm_folder, world, accum, zero, dtype, rank, out_dir))
        results[(world, zero, accum, dtype)] = got if rank == 0 else {}
    return results
