"""Step 2: reward model = base LM + scalar head, trained with the pairwise loss -log σ(r⁺ - r⁻).

    deepspeed --module marlhf.cli.rm --model_name_or_path out/sft --output_dir out/rm

The result loads in plain transformers as AutoModelForSequenceClassification (score at the last real
token) and, in step 3, as both the critic and the reward model.  With --likelihood_term the score adds
α · Σ log p(answer) under a next-token head started from the SFT model's (marlhf.models.heads.LikelihoodTerm);
plain transformers then loads the score head only, load_reward_model both.
"""

import sys

from marlhf.cli._run import data_section, entry_point, start
from marlhf.config import RewardArgs, parse_args
from marlhf.errors import run_cli


@entry_point
def main(argv=None):
    args, _ = parse_args(RewardArgs, argv)
    # the library (torch, DeepSpeed) after the flags: --help and a bad flag answer at once
    from marlhf.cli._memory import check_memory, plan_only
    from marlhf.data.pipeline import build_phase_data
    from marlhf.embedded import default_model
    from marlhf.models.export import export_hf
    from marlhf.models.loading import load_options, load_reward_model
    from marlhf.models.lora import apply_lora
    from marlhf.sections import LoopSection, SupervisedSection
    from marlhf.supervised import reward_objective, train
    from marlhf.utils.ds_engine import with_learning_rate
    from marlhf.utils.run import record_run_context

    if args.plan_only:  # the memory plan from the model's config alone
        return plan_only("rm", args, default_model(args.model_name_or_path))
    # 1. the run, its tokenizer and the reward-model share of the data: (chosen, rejected) pairs
    run = start(args, "model_name_or_path")
    tokenizer, fmt = run.tokenizer, run.fmt
    check_memory("rm", args, run.model)  # before any weight loads: refuses a plan the GPU cannot hold
    data = build_phase_data(data_section(args, fmt), tokenizer, phase=2)
    # 2. base model + fresh scalar head (or a step-2 model to continue), + the likelihood term if asked
    model = load_reward_model(run.model, tokenizer, args.dropout, likelihood_term=args.likelihood_term,
                              likelihood_norm=args.likelihood_norm, likelihood_scale=args.likelihood_scale,
                              **load_options(args.dtype, args.zero_stage, args.offload, args.attn_implementation))
    if args.lora_dim > 0:
        model = apply_lora(model, args.lora_dim, args.lora_module_name, args.only_optimize_lora, task="SEQ_CLS")
    # 3. train under DeepSpeed (evaluates accuracy and mean chosen / rejected scores)
    objective = reward_objective(tokenizer.pad_token_id, args.label_smoothing, args.reward_loss)
    engine = with_learning_rate(args.engine(), model)
    record_run_context(args.output_dir, learning_rate=engine.learning_rate)
    model = train(model, data.train, data.eval, objective, SupervisedSection.build(args), engine,
                  LoopSection.build(args))
    # 4. export as a Hugging Face sequence-classification model
    export_hf(model, tokenizer, args.output_dir, conversation=fmt)


if __name__ == "__main__":
    sys.exit(run_cli(main))
