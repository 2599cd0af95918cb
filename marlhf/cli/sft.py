"""Step 1: supervised fine-tuning of a causal LM on prompt + chosen response (loss on the response).

    deepspeed --module marlhf.cli.sft --data_path synthetic --output_dir out/sft

With no --model_name_or_path the embedded tiny model is used (built offline on first use).
"""

import sys

from marlhf.config import SFTArgs, parse_args
from marlhf.data.pipeline import build_phase_data
from marlhf.errors import run_cli
from marlhf.models.export import export_hf
from marlhf.models.loading import load_causal_lm, load_options, run_tokenizer
from marlhf.models.lora import apply_lora
from marlhf.supervised import sft_objective, train
from marlhf.utils.run import setup_run


def main(argv=None):
    args, _ = parse_args(SFTArgs, argv)
    setup_run(args)
    # 1. tokenizer and the SFT share of the data (tokenized once, cached under --data_output_path)
    #    (end-of-answer token and prompt format: the flags, else the model folder's own; recorded on export)
    tokenizer, fmt = run_tokenizer(args, args.model_name_or_path)
    data = build_phase_data(args, tokenizer, phase=1)
    # 2. the policy, optionally with LoRA adapters
    model = load_causal_lm(args.model_name_or_path, tokenizer, args.dropout,
                           end_of_conversation_token=fmt.end_of_conversation_token, **load_options(args))
    if args.lora_dim > 0:
        model = apply_lora(model, args.lora_dim, args.lora_module_name, args.only_optimize_lora)
    # 3. train under DeepSpeed (evaluates perplexity, checkpoints, resumes)
    engine = train(args, model, tokenizer, data.train, data.eval, sft_objective(tokenizer.pad_token_id))
    # 4. export a plain Hugging Face model (ZeRO-3 weights gathered, LoRA merged)
    export_hf(engine, tokenizer, args.output_dir, args.zero_stage, conversation=fmt)


if __name__ == "__main__":
    sys.exit(run_cli(main))
