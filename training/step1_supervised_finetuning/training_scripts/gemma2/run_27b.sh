#!/usr/bin/env bash
# Step 1 (SFT) of google/gemma-2-27b with the paper's Table 5 settings (MA-RLHF, Appendix B.2).
#
#   bash run_27b.sh [OUTPUT] [ZERO_STAGE]       e.g.  TASK=hh bash run_27b.sh ./output/sft 3
#
# Environment overrides:
#   TASK              tldr | hh | webgpt (default tldr): the dataset (Table 5 has one 27B value per row)
#   MODEL_PATH        base model (default google/gemma-2-27b)
#   PER_DEVICE_BATCH  micro-batch per GPU (default 2); gradient accumulation keeps the global batch
#   and those of every script (DATA_PATH, NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

text_task "Gemma-2 27B SFT"
OUTPUT=${1:-./output/gemma2-27b/$TASK/step1}
ZERO_STAGE=${2:-3}
MODEL_PATH=${MODEL_PATH:-google/gemma-2-27b}
EOS_TOKEN="<eos>"

# Table 5, Gemma-2 27B, SFT: batch 128, 3 epochs, lr 5e-6, cosine schedule, warmup ratio 0.1.
# Prompts <= 512 and answers <= 512 tokens: sequences up to 1024.
GLOBAL_BATCH=128
EPOCHS=3
LR=5e-6

# Global batch = per-device batch x gradient accumulation x GPUs.  On one node of 8 GPUs:
# 128 = 2 x 8 x 8; on two nodes (16 GPUs) 128 = 2 x 4 x 16.
PER_DEVICE=${PER_DEVICE_BATCH:-2}

# 27B: ZeRO-3 with the optimizer state (and parameters) offloaded to CPU, plus gradient checkpointing.
GRADIENT_CHECKPOINTING=1
OFFLOAD=1
run_step 1
