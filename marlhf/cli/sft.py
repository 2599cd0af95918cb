"""Step 1: supervised fine-tuning of a causal LM on prompt + chosen response (loss on the response).

    deepspeed --module marlhf.cli.sft --data_path synthetic --output_dir out/sft

With no --model_name_or_path the embedded tiny model is used (built offline on first use).
"""

import sys

from marlhf.cli._run import data_section, entry_point, start
from marlhf.config import SFTArgs, parse_args
from marlhf.errors import run_cli


@entry_point
def main(argv=None):
    args, _ = parse_args(SFTArgs, argv)
    # the library (torch, DeepSpeed) after the flags: --help and a bad flag answer at once
    from marlhf.cli._memory import check_memory, plan_only
    from marlhf.data.pipeline import build_phase_data
    from marlhf.embedded import default_model
    from marlhf.models.export import export_hf
    from marlhf.models.loading import load_causal_lm, load_options
    from marlhf.models.lora import apply_lora
    from marlhf.sections import LoopSection, SupervisedSection
    from marlhf.supervised import sft_objective, train
    from marlhf.utils.ds_engine import with_learning_rate
    from marlhf.utils.run import record_run_context

    if args.plan_only:  # the memory plan from the model's config alone
        return plan_only("sft", args, default_model(args.model_name_or_path))
    # 1. the run, its tokenizer and format (the flags, else the model folder's own; recorded on export) and the
    #    SFT share of the data (tokenized once, cached under --data_output_path)
    run = start(args, "model_name_or_path")
    tokenizer, fmt = run.tokenizer, run.fmt
    check_memory("sft", args, run.model)  # before any weight loads: refuses a plan the GPU cannot hold
    data = build_phase_data(data_section(args, fmt), tokenizer, phase=1)
    # 2. the policy, optionally with LoRA adapters
    model = load_causal_lm(run.model, tokenizer, args.dropout, end_of_conversation_token=fmt.end_of_conversation_token,
                           **load_options(args.dtype, args.zero_stage, args.offload, args.attn_implementation))
    if args.lora_dim > 0:
        model = apply_lora(model, args.lora_dim, args.lora_module_name, args.only_optimize_lora)
    # 3. train under DeepSpeed (evaluates perplexity, checkpoints, resumes)
    engine = with_learning_rate(args.engine(), model)
    record_run_context(args.output_dir, learning_rate=engine.learning_rate)
    model = train(model, data.train, data.eval, sft_objective(tokenizer.pad_token_id, args.prompt_loss),
                  SupervisedSection.build(args), engine, LoopSection.build(args))
    # 4. export a plain Hugging Face model (ZeRO-3 weights gathered, LoRA merged)
    export_hf(model, tokenizer, args.output_dir, conversation=fmt)


if __name__ == "__main__":
    sys.exit(run_cli(main))
