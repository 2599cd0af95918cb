#!/usr/bin/env bash
# Step 1 (SFT) of google/gemma-2b with the paper's Table 5 settings (MA-RLHF, Appendix B.2).
#
#   bash run_2b.sh [OUTPUT] [ZERO_STAGE]        e.g.  TASK=webgpt bash run_2b.sh ./output/sft 2
#
# Environment overrides:
#   TASK              tldr | hh | webgpt (default tldr): the dataset and the task-dependent Table 5 values
#   MODEL_PATH        base model (default google/gemma-2b)
#   PER_DEVICE_BATCH  micro-batch per GPU (default 8); gradient accumulation keeps the global batch
#   and those of every script (DATA_PATH, NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

text_task "Gemma 2B SFT"
OUTPUT=${1:-./output/gemma-2b/$TASK/step1}
ZERO_STAGE=${2:-2}
MODEL_PATH=${MODEL_PATH:-google/gemma-2b}
EOS_TOKEN="<eos>"

# Table 5, Gemma 2B, SFT: batch 64 and lr 1e-4 for WebGPT, 512 and 5e-5 for the others; 3 epochs;
# cosine schedule, warmup ratio 0.1.  Prompts <= 512 and answers <= 512 tokens: sequences up to 1024.
GLOBAL_BATCH=$(by_task tldr=512 hh=512 webgpt=64)
LR=$(by_task tldr=5e-5 hh=5e-5 webgpt=1e-4)
EPOCHS=3

# Global batch = per-device batch x gradient accumulation x GPUs.  On one node of 8 GPUs:
# 512 = 8 x 8 x 8 and 64 = 8 x 1 x 8.  Other GPU counts change the accumulation, not the batch.
PER_DEVICE=${PER_DEVICE_BATCH:-8}

# 2B: ZeRO-2 (optimizer state and gradients partitioned) is enough.
run_step 1
