#!/usr/bin/env bash
# Step 1 (SFT) of google/codegemma-7b-it on APPS with the paper's Table 5 settings (MA-RLHF, Appendix B.2).
#
#   bash run_7b.sh [OUTPUT] [ZERO_STAGE]
#
# B.2: the code task has no preference pairs, so there is no step 2; the data is split 20% SFT / 80% PPO
# (--data_split 2,0,8, the same split in step 3 so the two shares stay disjoint).
#
# Environment overrides:
#   TASK              apps (the only task of this family)
#   MODEL_PATH        base model (default google/codegemma-7b-it)
#   DATA_PATH         --data_path value(s), space-separated (default codeparrot/apps; a local copy is
#                     codeparrot/apps:/data/APPS with train/ and test/ problem folders)
#   PER_DEVICE_BATCH  micro-batch per GPU (default 2); gradient accumulation keeps the global batch
#   and those of every script (NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

code_task
OUTPUT=${1:-./output/codegemma-7b/apps/step1}
ZERO_STAGE=${2:-3}
MODEL_PATH=${MODEL_PATH:-google/codegemma-7b-it}
EOS_TOKEN="<eos>"

# Table 5, CodeGemma 7B, SFT: batch 32, 1 epoch, lr 2e-6, cosine schedule, no warmup.
# Prompts <= 600 and answers <= 512 tokens: sequences up to 1112.
GLOBAL_BATCH=32
EPOCHS=1
LR=2e-6
WARMUP_RATIO=0.0

# Global batch = per-device batch x gradient accumulation x GPUs.  On one node of 8 GPUs: 32 = 2 x 2 x 8.
PER_DEVICE=${PER_DEVICE_BATCH:-2}

# 7B: ZeRO-3 partitions parameters too; gradient checkpointing saves activations.
GRADIENT_CHECKPOINTING=1
run_step 1
