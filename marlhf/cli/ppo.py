"""Step 3: RLHF with MA-PPO — PPO over macro actions (paper §3.2; n = 1 is vanilla PPO).

    deepspeed --module marlhf.cli.ppo --actor_model_name_or_path out/sft \\
        --critic_model_name_or_path out/rm --termination_condition fixed --ngram 5 --output_dir out/ppo
    # the code task (paper B.5): programs run against each problem's tests, no reward model, critic = SFT
    deepspeed --module marlhf.cli.ppo --actor_model_name_or_path out/sft \
        --data_path synthetic_code --data_split 2,0,8 --reward_source program_tests --output_dir out/ppo-code

Writes <output_dir>/actor (and critic, actor_ema) in Hugging Face format, metrics.jsonl, and
summary.json comparing the initial (SFT) and final policy on held-out prompts (and naming the machine, so
timings are compared only between runs on one kind of CPU). A critic-free
--advantage_estimator (rloo, grpo, reinforce) builds and writes no critic.
"""

import json
import sys
from pathlib import Path

from marlhf.cli._run import data_section, entry_point, start, step3_context, step3_trainer
from marlhf.config import RLHFArgs, parse_args
from marlhf.errors import run_cli


@entry_point
def main(argv=None):
    args, _ = parse_args(RLHFArgs, argv)
    # the library (torch, DeepSpeed) after the flags: --help and a bad flag answer at once
    from marlhf.cli._memory import check_memory, plan_only
    from marlhf.data.formatting import check_same_format
    from marlhf.data.pipeline import build_phase_data, held_out_part, plan_steps
    from marlhf.embedded import default_model
    from marlhf.eval.policy import evaluate_policy
    from marlhf.models.export import export_hf
    from marlhf.models.loading import attention_implementation
    from marlhf.rewards import evaluation_sources, require_meta
    from marlhf.rlhf.ptx import ptx_items
    from marlhf.rlhf.sections import EvalSection
    from marlhf.utils import dist
    from marlhf.utils.checkpoint import resumed_record
    from marlhf.utils.machine import machine_info
    from marlhf.utils.run import record_run_context

    if args.plan_only:  # the memory plan from the models' configs alone
        return plan_only("ppo", args, default_model(args.actor_model_name_or_path))

    # 1. the run: tokenizer (left padding for generation), format (the flags, else what step 1 recorded in the
    #    actor's folder), task, model paths and response kind; the RLHF share of the prompts
    run = start(args, "actor_model_name_or_path", padding_side="left")
    tokenizer, fmt, task = run.tokenizer, run.fmt, run.task
    context = step3_context(args, run.model, task)
    record_run_context(args.output_dir, **context)
    check_memory("ppo", args, run.model)  # before any weight loads: refuses a plan the GPU cannot hold
    check_same_format(fmt, context["critic_model_name_or_path"], context["reward_model_name_or_path"],
                      *args.reward_ensemble)
    data_flags = data_section(args, fmt)
    data = build_phase_data(data_flags, tokenizer, phase=3)
    if args.reward_source == "program_tests":  # each prompt's unit tests must have come through the cache
        require_meta(data.train + data.eval, "input_output", "--reward_source program_tests")
    _, total_steps = plan_steps(len(data.train), args.per_device_generation_batch_size, args.generation_batches,
                                args.num_train_epochs, args.max_steps, what="prompts")
    # 2. actor / reference / critic / reward (+ EMA) engines, and the reward source (reward model, gold scorer,
    #    program tests, the user's function or server) in the MA-PPO recipe
    with attention_implementation(args.attn_implementation):  # every model the engines load
        trainer, learning_rates = step3_trainer(args, run.model, tokenizer, fmt, context, task, total_steps)
    record_run_context(args.output_dir, learning_rates=learning_rates)
    rlhf = trainer.rlhf
    # 3. what the held-out evaluation reports: the reward model's score, the gold score, the training reward
    sources = evaluation_sources(args.reward_source, trainer.reward, rlhf.reward, task)
    # 4. the initial (SFT) policy on held-out prompts, then MA-PPO (evaluated every --eval_interval steps, with
    #    the KL to the reference), then the final policy
    eval_section = EvalSection.build(args)
    held_out = held_out_part(data.eval, args.eval_prompts)

    def evaluate():
        return evaluate_policy(rlhf.actor, tokenizer, held_out, eval_section, trainer.gen_cfg, sources,
                               ref=rlhf.ref, engine=trainer.refreshed_engine())

    initial = Path(args.output_dir) / "initial_policy.json"  # kept so a resumed run reports it too
    before = resumed_record(initial, args.resume)  # read on rank 0, so all ranks evaluate or none
    if before is None:
        before = evaluate()
        if dist.is_main():
            initial.write_text(json.dumps(before))
    ptx = ptx_items(args.unsupervised_dataset_name, tokenizer, data_flags, args.max_answer_seq_len) \
        if args.unsup_coef != 0 else None
    steps = trainer.train(data.train, ptx, evaluate=evaluate)
    after = evaluate()
    # 5. export actor / critic / EMA as Hugging Face folders and write the summary
    out = Path(args.output_dir)
    export_hf(rlhf.actor, tokenizer, out / "actor", conversation=fmt)
    if rlhf.critic is not None:  # critic-free estimators have none
        export_hf(rlhf.critic, tokenizer, out / "critic", conversation=fmt)
    if rlhf.ema is not None:
        export_hf(rlhf.ema, tokenizer, out / "actor_ema", conversation=fmt)
    if dist.is_main():
        summary = {"steps": steps, "initial_policy": before, "final_policy": after, "machine": machine_info()}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(run_cli(main))
