#!/usr/bin/env bash
# Step 2 (reward model) on top of the Gemma 2B SFT model, with the paper's Table 5 settings
# (MA-RLHF, Appendix B.2: the reward model is initialised from the SFT model, trained on the 40% share).
#
#   bash run_2b.sh [OUTPUT] [ZERO_STAGE]        e.g.  TASK=webgpt bash run_2b.sh ./output/rm 2
#
# Environment overrides:
#   TASK              tldr | hh | webgpt (default tldr): the dataset and the task-dependent Table 5 values
#   MODEL_PATH        initial model (default: step 1's default output ./output/gemma-2b/$TASK/step1;
#                     google/gemma-2b starts from the base model instead)
#   PER_DEVICE_BATCH  pairs per GPU per micro-batch (default 4); accumulation keeps the global batch
#   and those of every script (DATA_PATH, NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

text_task "the Gemma 2B reward model"
OUTPUT=${1:-./output/gemma-2b/$TASK/step2}
ZERO_STAGE=${2:-2}
MODEL_PATH=${MODEL_PATH:-./output/gemma-2b/$TASK/step1}
EOS_TOKEN="<eos>"

# Table 5, Gemma 2B, RM: batch 32 and lr 2e-5 for WebGPT, 64 and 1e-5 for the others; 1 epoch; cosine
# schedule, warmup ratio 0.1.  Prompts <= 512 and answers <= 512 tokens: sequences up to 1024.
GLOBAL_BATCH=$(by_task tldr=64 hh=64 webgpt=32)
EPOCHS=1
LR=$(by_task tldr=1e-5 hh=1e-5 webgpt=2e-5)

# Global batch (pairs) = per-device batch x gradient accumulation x GPUs.  On one node of 8 GPUs:
# 64 = 4 x 2 x 8 and 32 = 4 x 1 x 8.  Other GPU counts change the accumulation, not the batch.
PER_DEVICE=${PER_DEVICE_BATCH:-4}

# 2B: ZeRO-2 (optimizer state and gradients partitioned) is enough.
run_step 2
