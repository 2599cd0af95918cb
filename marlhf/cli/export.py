"""Export a training step's output folder as a clean Hugging Face model folder with a model card.

    marlhf export --input out/sft --output_dir release/sft
    marlhf export --input out/ppo --model actor --output_dir release/ma-ppo   # step 3
    marlhf export --input out/sft/lora_adapter --output_dir release/sft-merged  # merge LoRA
    marlhf export --input out/ppo --from_checkpoint --output_dir release/ppo-ckpt  # a stopped run

The result holds safetensors weights, a config with ``use_cache: true``, the tokenizer, a generation config
that stops at the end-of-conversation token the model was trained with, ``conversation_format.json``, and a
README.md naming the base model, data, step, flags (the run's args.json) and final metrics (metrics.jsonl).
Logs, TensorBoard events and DeepSpeed checkpoints stay behind.

``--from_checkpoint`` exports the weights of a DeepSpeed checkpoint instead (a run stopped before its export):
``--input`` is the step's --output_dir (its latest checkpoint), its ``checkpoints/`` folder or one
``checkpoints/stepNNNNNNNN`` folder.  ZeRO-1/2/3 partitions of any number of ranks are merged with DeepSpeed's
zero_to_fp32 (the fp32 master weights); the model is rebuilt from the run's args.json (base model, end token,
added tokens, LoRA rank and modules) and LoRA is merged.
"""

from __future__ import annotations

import argparse
import logging
import sys

from marlhf.errors import run_cli
from marlhf.models.card import STEP3_MODELS, export_step_output


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="A step's --output_dir (or a model / LoRA adapter folder in it)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default="actor", choices=STEP3_MODELS, help="Which of step 3's models to export")
    p.add_argument("--base_model", default="", help="Base model of a LoRA adapter (default: the recorded one)")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "fp16", "bf16"),
                   help="Weights' dtype (auto: as stored)")
    p.add_argument("--overwrite", action="store_true", help="Replace a non-empty --output_dir")
    p.add_argument("--from_checkpoint", action="store_true",
                   help="Export the (latest) DeepSpeed checkpoint's weights instead of the exported model")
    p.add_argument("--debug", action="store_true", help="Show tracebacks for user errors")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    from marlhf.embedded import default_model

    out = export_step_output(args.input, args.output_dir, args.model, args.base_model, args.dtype, args.overwrite,
                             args.from_checkpoint, default_base=lambda: default_model(""))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
