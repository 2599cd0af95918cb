"""Step 3: RLHF with MA-PPO — PPO over macro actions (paper §3.2; n = 1 is vanilla PPO).

    deepspeed --module marlhf.cli.ppo --actor_model_name_or_path out/sft \\
        --critic_model_name_or_path out/rm --termination_condition fixed --ngram 5 --output_dir out/ppo
    # the code task (paper B.5): programs run against each problem's tests, no reward model, critic = SFT
    deepspeed --module marlhf.cli.ppo --actor_model_name_or_path out/sft \
        --data_path synthetic_code --data_split 2,0,8 --reward_source program_tests --output_dir out/ppo-code

Writes <output_dir>/actor (and critic, actor_ema) in Hugging Face format, metrics.jsonl, and
summary.json comparing the initial (SFT) and final policy on held-out prompts. A critic-free
--advantage_estimator (rloo, grpo, reinforce) builds and writes no critic.
"""

import json
import sys
from pathlib import Path

from marlhf.config import RLHFArgs, parse_args
from marlhf.data.formatting import check_same_format
from marlhf.data.pipeline import build_phase_data, plan_steps
from marlhf.errors import run_cli
from marlhf.eval.policy import evaluate_policy
from marlhf.models.export import export_hf
from marlhf.models.loading import run_tokenizer
from marlhf.rewards import evaluation_sources, require_meta, reward_source_from_args
from marlhf.rlhf.rlhf_engine import build_rlhf_engine
from marlhf.rlhf.tasks import ptx_items
from marlhf.rlhf.trainer import MAPPOTrainer
from marlhf.utils import dist
from marlhf.utils.checkpoint import resumed_record
from marlhf.utils.run import setup_run


def main(argv=None):
    args, _ = parse_args(RLHFArgs, argv)
    setup_run(args)
    # 1. tokenizer (left padding for generation) and the RLHF share of the prompts
    #    (end-of-answer token and prompt format: the flags, else what step 1 recorded in the actor's folder)
    tokenizer, fmt = run_tokenizer(args, args.actor_model_name_or_path, padding_side="left")
    check_same_format(fmt, args.critic_model_name_or_path, args.reward_model_name_or_path)
    data = build_phase_data(args, tokenizer, phase=3)
    if args.reward_source == "program_tests":  # each prompt's unit tests must have come through the cache
        require_meta(data.train + data.eval, "input_output", "--reward_source program_tests")
    _, total_steps = plan_steps(len(data.train), args.per_device_generation_batch_size, args.generation_batches,
                                args.num_train_epochs, args.max_steps, what="prompts")
    # 2. actor / reference / critic / reward (+ EMA) engines
    rlhf = build_rlhf_engine(args, tokenizer, total_steps)
    # 3. the reward source (reward model, gold scorer, program tests, the user's function or server) and what
    #    the evaluation reports
    reward = reward_source_from_args(args, rlhf.reward)
    trainer = MAPPOTrainer(args, rlhf, tokenizer, reward=reward)
    sources = evaluation_sources(args.reward_source, reward, rlhf.reward, args.data_path)
    # 4. the initial (SFT) policy on held-out prompts, then MA-PPO (evaluated every --eval_interval steps, with
    #    the KL to the reference), then the final policy
    def evaluate():
        return evaluate_policy(rlhf.actor, tokenizer, data.eval, args, sources, ref=rlhf.ref)

    initial = Path(args.output_dir) / "initial_policy.json"  # kept so a resumed run reports it too
    before = resumed_record(initial, args.resume)  # read on rank 0, so all ranks evaluate or none
    if before is None:
        before = evaluate()
        if dist.is_main():
            initial.write_text(json.dumps(before))
    steps = trainer.train(data.train, ptx_items(args, tokenizer), evaluate=evaluate)
    after = evaluate()
    # 5. export actor / critic / EMA as Hugging Face folders and write the summary
    out = Path(args.output_dir)
    export_hf(rlhf.actor, tokenizer, out / "actor", args.actor_zero_stage, conversation=fmt)
    if rlhf.critic is not None:  # critic-free estimators have none
        export_hf(rlhf.critic, tokenizer, out / "critic", args.critic_zero_stage, conversation=fmt)
    if rlhf.ema is not None:
        export_hf(rlhf.ema, tokenizer, out / "actor_ema", args.actor_zero_stage, conversation=fmt)
    if dist.is_main():
        summary = {"steps": steps, "initial_policy": before, "final_policy": after}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(run_cli(main))
