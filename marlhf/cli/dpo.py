"""Step 2 alternative: DPO (or IPO) of the SFT policy on the reward model's preference pairs (paper App. C.3).

    deepspeed --module marlhf.cli.dpo --model_name_or_path out/sft --beta 0.1 --output_dir out/dpo

Same data share as the reward model (the 4 of --data_split 2,4,4); the policy and the frozen reference both
start from the SFT model. The result is a plain Hugging Face causal LM, evaluated like a step-3 actor.
"""

import sys

from marlhf.cli._run import data_section, entry_point, start
from marlhf.config import DPOArgs, parse_args
from marlhf.errors import run_cli


@entry_point
def main(argv=None):
    args, _ = parse_args(DPOArgs, argv)
    # the library (torch, DeepSpeed) after the flags: --help and a bad flag answer at once
    from marlhf.cli._memory import check_memory, plan_only
    from marlhf.data.pipeline import build_phase_data
    from marlhf.dpo import dpo_objective
    from marlhf.embedded import default_model
    from marlhf.models.export import export_hf
    from marlhf.models.loading import load_causal_lm, load_options
    from marlhf.models.lora import apply_lora
    from marlhf.sections import LoopSection, SupervisedSection
    from marlhf.supervised import train
    from marlhf.utils.ds_engine import frozen_engine, with_learning_rate
    from marlhf.utils.run import record_run_context

    if args.plan_only:  # the memory plan from the models' configs alone
        return plan_only("dpo", args, default_model(args.model_name_or_path))
    # 1. the run, its tokenizer and the reward model's share of the data: (prompt, chosen, rejected) pairs
    run = start(args, "model_name_or_path")
    tokenizer, fmt = run.tokenizer, run.fmt
    check_memory("dpo", args, run.model)  # before any weight loads: refuses a plan the GPU cannot hold
    data = build_phase_data(data_section(args, fmt), tokenizer, phase=2)
    # 2. the policy (optionally with LoRA) and the frozen reference, both the SFT model by default
    load = load_options(args.dtype, args.zero_stage, args.offload, args.attn_implementation)
    policy = load_causal_lm(run.model, tokenizer, args.dropout, end_of_conversation_token=fmt.end_of_conversation_token,
                            **load)
    if args.lora_dim > 0:
        policy = apply_lora(policy, args.lora_dim, args.lora_module_name, args.only_optimize_lora)
    reference = frozen_engine(load_causal_lm(args.ref_model_name_or_path or run.model, tokenizer, 0.0, **load),
                              zero_stage=args.zero_stage, offload=args.offload, dtype=args.dtype)
    # 3. train under DeepSpeed (logs and evaluates implicit rewards, their margin and pair accuracy)
    engine = with_learning_rate(args.engine(), policy)
    record_run_context(args.output_dir, learning_rate=engine.learning_rate,
                       ref_model_name_or_path=args.ref_model_name_or_path or run.model)
    model = train(policy, data.train, data.eval, dpo_objective(tokenizer.pad_token_id, reference, args.beta,
                                                               args.dpo_loss),
                  SupervisedSection.build(args), engine, LoopSection.build(args))
    # 4. export a plain Hugging Face model (ZeRO-3 weights gathered, LoRA merged)
    export_hf(model, tokenizer, args.output_dir, conversation=fmt)


if __name__ == "__main__":
    sys.exit(run_cli(main))
