"""A step-3 trainer on the nano model for tests that drive make_experience / ppo_update directly.

Imported by tests (one rank, in-process) and run as a script under the real ``deepspeed`` launcher by
``tests/test_optim_step.py`` (two ranks), which is why it is a plain module next to the tests.

    deepspeed --num_gpus 2 tests/ppo_harness.py WORK_DIR

Two-rank script: reads ``WORK_DIR/exps.pt`` (experience batches written by the one-rank test), gives rank r
samples [4r, 4r + 4) of each, and writes what the test compares into ``WORK_DIR/two_ranks.pt`` (rank 0):
  * ``split``: actor/critic weights after one update on batch 0 (2 ranks x micro-batch 4);
  * ``nan`` / ``clean``: weights after [rank 1's policy loss NaN on batch 0, then batch 1] and after
    [batch 1 alone], from fresh engines; and the guard's metrics of the NaN update.
The actor runs ZeRO-2 (DeepSpeed's own non-finite check), the critic ZeRO-0 (optim_step.guard_optimizer).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from marlhf.cli._run import data_section, step3_context, step3_trainer
from marlhf.config import RLHFArgs, parse_args
from marlhf.models.loading import load_tokenizer_and_format
from marlhf.rlhf.rollout import Experience
from marlhf.rlhf.trainer import MAPPOTrainer
from marlhf.tasks import resolve_task
from marlhf.utils import dist


def rlhf_args(nano, out, **flags) -> RLHFArgs:
    argv = ["--actor_model_name_or_path", str(nano), "--critic_model_name_or_path", str(nano),
            "--data_path", "synthetic:num_records=400", "--data_output_path", str(Path(out) / "data"),
            "--output_dir", str(out), "--max_prompt_seq_len", "160", "--max_answer_seq_len", "24",
            "--per_device_generation_batch_size", "8", "--per_device_training_batch_size", "8",
            "--disable_progress_bar", "--seed", "3", "--actor_learning_rate", "1e-3", "--critic_learning_rate",
            "1e-3", "--lr_scheduler_type", "constant", "--temperature", "1.0"]
    for k, v in flags.items():
        argv += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    args, _ = parse_args(RLHFArgs, argv)
    return args


def step3_tokenizer(args):
    """(tokenizer, format) of the actor, as step 3 resolves them (left padding for generation)."""
    return load_tokenizer_and_format(args.actor_model_name_or_path, args.end_of_conversation_token, args.prompt_format,
                                     padding_side="left", add_eot_token=args.add_eot_token)


def build_trainer(args, reward=None, total_steps: int = 4) -> MAPPOTrainer:
    """Step 3's trainer from its flags, as ``marlhf.cli.ppo`` builds it (no run folder, no logs)."""
    tok, fmt = step3_tokenizer(args)
    task = resolve_task(args.task, args.data_path)
    context = step3_context(args, args.actor_model_name_or_path, task)
    trainer, _ = step3_trainer(args, args.actor_model_name_or_path, tok, fmt, context, task, total_steps,
                               reward=reward)
    return trainer


def make_trainer(args, reward=None) -> MAPPOTrainer:
    """Fresh engines; the critic's new value head is initialised from the same seed every time."""
    dist.init_distributed()
    dist.set_seed(args.seed)
    return build_trainer(args, reward=reward)


def phase3_data(args, tok):
    """Step 3's tokenized prompts (the run's format resolved as step 3 does)."""
    from marlhf.data.pipeline import build_phase_data

    _, fmt = step3_tokenizer(args)
    return build_phase_data(data_section(args, fmt), tok, phase=3)


def evaluate(trainer, items, args, sources, **kw) -> dict:
    """Step 3's held-out evaluation of ``trainer``'s actor with the flags' evaluation settings."""
    from marlhf.eval.policy import evaluate_policy
    from marlhf.rlhf.sections import EvalSection

    return evaluate_policy(trainer.rlhf.actor if "actor" not in kw else kw.pop("actor"), trainer.tokenizer, items,
                           EvalSection.build(args), trainer.gen_cfg, sources, **kw)


def prompts(args, tok, n: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    from marlhf.data.pipeline import PromptCollator

    items = phase3_data(args, tok).train[offset:offset + n]
    batch = PromptCollator(tok.pad_token_id)(items)
    return batch["prompt_ids"], batch["prompt_mask"]


def weights(trainer) -> dict[str, torch.Tensor]:
    out = {}
    for role in ("actor", "critic"):
        for name, p in getattr(trainer.rlhf, role).module.named_parameters():
            out[f"{role}.{name}"] = p.detach().clone()
    return out


def rows(exp: Experience, lo: int, hi: int) -> Experience:
    return exp.split(hi - lo)[lo // (hi - lo)]


def main(work: Path) -> None:
    exps = torch.load(work / "exps.pt", weights_only=False)
    flags = {"per_device_generation_batch_size": 4, "per_device_training_batch_size": 4, "actor_zero_stage": 2,
             "output_dir": work / "run"}
    args = rlhf_args(exps["nano"], work / "run", **flags)
    result = {}
    t = make_trainer(args)
    r = dist.rank()
    mine = [rows(e, 4 * r, 4 * r + 4) for e in exps["batches"]]
    t.ppo_update([mine[0]])
    result["split"] = weights(t)

    bad = rows(exps["batches"][0], 4 * r, 4 * r + 4)
    if r == 1:
        bad.advantages = bad.advantages.clone()
        bad.advantages[0, 0] = float("nan")  # this rank's policy loss is NaN, rank 0's is finite
    t = make_trainer(args)
    t.ppo_update([bad])
    result["nan_metrics"] = t.guard.end_step(1)
    result["after_nan"] = weights(t)
    t.ppo_update([mine[1]])
    result["nan"] = weights(t)
    t = make_trainer(args)
    t.ppo_update([mine[1]])
    result["clean"] = weights(t)
    if dist.is_main():
        torch.save(result, work / "two_ranks.pt")
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[-1]))  # the launcher puts --local_rank=N first
