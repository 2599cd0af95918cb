"""Step 2 alternative: DPO (or IPO) of the SFT policy on the reward model's preference pairs (paper App. C.3).

    deepspeed --module marlhf.cli.dpo --model_name_or_path out/sft --beta 0.1 --output_dir out/dpo

Same data share as the reward model (the 4 of --data_split 2,4,4); the policy and the frozen reference both
start from the SFT model. The result is a plain Hugging Face causal LM, evaluated like a step-3 actor.
"""

import sys

from marlhf.config import DPOArgs, parse_args
from marlhf.data.pipeline import build_phase_data
from marlhf.dpo import dpo_objective
from marlhf.errors import run_cli
from marlhf.models.export import export_hf
from marlhf.models.loading import load_causal_lm, load_options, load_tokenizer_and_format
from marlhf.models.lora import apply_lora
from marlhf.supervised import train
from marlhf.utils.ds_engine import frozen_engine
from marlhf.utils.run import setup_run


def main(argv=None):
    args, _ = parse_args(DPOArgs, argv)
    setup_run(args)
    # 1. tokenizer and the reward model's share of the data: (prompt, chosen, rejected) pairs
    tokenizer, fmt = load_tokenizer_and_format(args.model_name_or_path, args.end_of_conversation_token,
                                               args.prompt_format, add_eot_token=args.add_eot_token)
    args.end_of_conversation_token, args.prompt_format = fmt.end_of_conversation_token, fmt.prompt_format
    data = build_phase_data(args, tokenizer, phase=2)
    # 2. the policy (optionally with LoRA) and the frozen reference, both the SFT model by default
    policy = load_causal_lm(args.model_name_or_path, tokenizer, args.dropout,
                            end_of_conversation_token=fmt.end_of_conversation_token, **load_options(args))
    if args.lora_dim > 0:
        policy = apply_lora(policy, args.lora_dim, args.lora_module_name, args.only_optimize_lora)
    reference = frozen_engine(load_causal_lm(args.ref_model_name_or_path or args.model_name_or_path, tokenizer, 0.0,
                                             **load_options(args)),
                              zero_stage=args.zero_stage, offload=args.offload, dtype=args.dtype)
    # 3. train under DeepSpeed (logs and evaluates implicit rewards, their margin and pair accuracy)
    engine = train(args, policy, tokenizer, data.train, data.eval,
                   dpo_objective(tokenizer.pad_token_id, reference, args.beta, args.dpo_loss))
    # 4. export a plain Hugging Face model (ZeRO-3 weights gathered, LoRA merged)
    export_hf(engine, tokenizer, args.output_dir, args.zero_stage, conversation=fmt)


if __name__ == "__main__":
    sys.exit(run_cli(main))
