#!/usr/bin/env python
"""Step 3: RLHF with MA-PPO — PPO over macro actions (paper §3.2; n = 1 is vanilla PPO).

    deepspeed training/step3_rlhf_finetuning/main.py --actor_model_name_or_path out/sft \\
        --critic_model_name_or_path out/rm --termination_condition fixed --ngram 5 --output_dir out/ppo

Writes <output_dir>/actor (and critic, actor_ema) in Hugging Face format, metrics.jsonl, and
summary.json comparing the initial (SFT) and final policy on held-out prompts.
"""

import json
import sys
from pathlib import Path

from marlhf.config import RLHFArgs, parse_args
from marlhf.data.formatting import check_same_format
from marlhf.data.pipeline import build_phase_data, plan_steps
from marlhf.errors import ConfigError, run_cli
from marlhf.models.loading import run_tokenizer
from marlhf.rlhf.rlhf_engine import build_rlhf_engine
from marlhf.rlhf.tasks import gold_scorer_for, ptx_items
from marlhf.rlhf.trainer import MAPPOTrainer, evaluate_policy
from marlhf.utils import dist
from marlhf.utils.checkpoint import export_hf
from marlhf.utils.run import setup_run


def main(argv=None):
    args, _ = parse_args(RLHFArgs, argv)
    setup_run(args)
    # 1. tokenizer (left padding for generation) and the RLHF share of the prompts
    #    (end-of-answer token and prompt format: the flags, else what step 1 recorded in the actor's folder)
    tokenizer, fmt = run_tokenizer(args, args.actor_model_name_or_path, padding_side="left")
    check_same_format(fmt, args.critic_model_name_or_path, args.reward_model_name_or_path)
    data = build_phase_data(args, tokenizer, phase=3)
    _, total_steps = plan_steps(len(data.train), args.per_device_generation_batch_size, args.generation_batches,
                                args.num_train_epochs, args.max_steps, what="prompts")
    # 2. actor / reference / critic / reward (+ EMA) engines
    rlhf = build_rlhf_engine(args, tokenizer, total_steps)
    gold = gold_scorer_for(args.data_path)
    trainer = MAPPOTrainer(args, rlhf, tokenizer, scorer=gold if args.reward_source == "gold" else None)
    if args.reward_source == "gold" and gold is None:
        raise ConfigError("--reward_source gold needs a task with a gold scorer (the synthetic task)")
    # 3. the initial (SFT) policy on held-out prompts, then MA-PPO, then the final policy
    initial = Path(args.output_dir) / "initial_policy.json"  # kept so a resumed run reports it too
    if initial.exists() and args.resume:
        before = json.loads(initial.read_text())
    else:
        before = evaluate_policy(rlhf.actor, rlhf.reward, tokenizer, data.eval, args, gold)
        if dist.is_main():
            initial.write_text(json.dumps(before))
    steps = trainer.train(data.train, ptx_items(args, tokenizer))
    after = evaluate_policy(rlhf.actor, rlhf.reward, tokenizer, data.eval, args, gold)
    # 4. export actor / critic / EMA as Hugging Face folders and write the summary
    out = Path(args.output_dir)
    export_hf(rlhf.actor, tokenizer, out / "actor", args.actor_zero_stage, conversation=fmt)
    export_hf(rlhf.critic, tokenizer, out / "critic", args.critic_zero_stage, conversation=fmt)
    if rlhf.ema is not None:
        export_hf(rlhf.ema, tokenizer, out / "actor_ema", args.actor_zero_stage, conversation=fmt)
    if dist.is_main():
        summary = {"steps": steps, "initial_policy": before, "final_policy": after}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(run_cli(main))
