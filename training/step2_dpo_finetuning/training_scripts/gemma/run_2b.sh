#!/usr/bin/env bash
# DPO (the alternative to reward model + MA-PPO) of the Gemma 2B SFT model, with the paper's
# App. C.3 settings: policy and frozen reference both start from the SFT model; the pairs are the reward
# model's 40% share.
#
#   bash run_2b.sh [OUTPUT] [ZERO_STAGE]        e.g.  TASK=hh bash run_2b.sh ./output/dpo 2
#
# Environment overrides:
#   TASK              tldr | hh (default tldr): the dataset and β (C.3 gives DPO values for these two only)
#   MODEL_PATH        the SFT model, policy init and reference (default: step 1's default output
#                     ./output/gemma-2b/$TASK/step1)
#   DPO_LOSS          sigmoid (DPO, default) | ipo
#   PER_DEVICE_BATCH  pairs per GPU per micro-batch (default 4); accumulation keeps the global batch
#   and those of every script (DATA_PATH, NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

text_task "Gemma 2B DPO"
OUTPUT=${1:-./output/gemma-2b/$TASK/step2_dpo}
ZERO_STAGE=${2:-2}
MODEL_PATH=${MODEL_PATH:-./output/gemma-2b/$TASK/step1}
EOS_TOKEN="<eos>"

# App. C.3: lr 2e-7, beta 0.1 on TL;DR and 0.01 on HH-RLHF (no WebGPT value: that task stops here);
# the paper trains DPO at this size.
# The batch is the reward model's Table 5 batch for this size (the same pairs); 1 epoch, cosine, warmup 0.1.
BETA=$(by_task tldr=0.1 hh=0.01)
GLOBAL_BATCH=$(by_task tldr=64 hh=64)
EPOCHS=1
LR=2e-7

PER_DEVICE=${PER_DEVICE_BATCH:-4}

# 2B: ZeRO-2 for the policy; the frozen reference is whole on every GPU.
run_step dpo
