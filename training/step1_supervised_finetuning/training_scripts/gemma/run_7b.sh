#!/usr/bin/env bash
# Step 1 (SFT) of google/gemma-7b with the paper's Table 5 settings (MA-RLHF, Appendix B.2).
#
#   bash run_7b.sh [OUTPUT] [ZERO_STAGE]        e.g.  TASK=hh bash run_7b.sh ./output/sft 3
#
# Environment overrides:
#   TASK              tldr | hh | webgpt (default tldr): the dataset and the task-dependent Table 5 values
#   MODEL_PATH        base model (default google/gemma-7b)
#   PER_DEVICE_BATCH  micro-batch per GPU (default 4); gradient accumulation keeps the global batch
#   and those of every script (DATA_PATH, NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

text_task "Gemma 7B SFT"
OUTPUT=${1:-./output/gemma-7b/$TASK/step1}
ZERO_STAGE=${2:-3}
MODEL_PATH=${MODEL_PATH:-google/gemma-7b}
EOS_TOKEN="<eos>"

# Table 5, Gemma 7B, SFT: batch 128; 5 epochs for WebGPT, 1 for the others; lr 2e-5; cosine schedule,
# warmup ratio 0.1.  Prompts <= 512 and answers <= 512 tokens: sequences up to 1024.
GLOBAL_BATCH=128
EPOCHS=$(by_task tldr=1 hh=1 webgpt=5)
LR=2e-5

# Global batch = per-device batch x gradient accumulation x GPUs.  On one node of 8 GPUs:
# 128 = 4 x 4 x 8; on two nodes (16 GPUs) 128 = 4 x 2 x 16.
PER_DEVICE=${PER_DEVICE_BATCH:-4}

# 7B: ZeRO-3 partitions parameters, gradients and optimizer state; gradient checkpointing saves activations.
GRADIENT_CHECKPOINTING=1
run_step 1
