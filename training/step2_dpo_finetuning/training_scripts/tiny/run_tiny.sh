#!/usr/bin/env bash
# DPO of the tiny SFT model on the embedded synthetic task's preference pairs (the reward model's share):
# one CPU rank.
#
#   bash run_tiny.sh [OUTPUT] [ZERO_STAGE]      (defaults ./output/tiny/step2_dpo and 0)
#
# As in the paper (C.3) policy and frozen reference both start from the SFT model: run step 1's run_tiny.sh
# first, or set MODEL_PATH= (empty) to start from the embedded tiny model.
# `deepspeed --num_gpus N` on a machine without GPUs starts N CPU ranks over gloo.
#
# Environment overrides:
#   MODEL_PATH        the SFT model (default ./output/tiny/step1; empty = the embedded tiny model)
#   DATA_PATH         --data_path value(s), space-separated (default synthetic, e.g. synthetic:seed=7)
#   TASK              synthetic (the only task of the tiny scripts; point DATA_PATH elsewhere instead)
#   DPO_LOSS          sigmoid (DPO, default) | ipo
#   NUM_GPUS          ranks per node (default 1)
#   PER_DEVICE_BATCH  pairs per rank per micro-batch (default 8); accumulation keeps the global batch 16
#   and those of every script (HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

tiny_task
OUTPUT=${1:-./output/tiny/step2_dpo}
ZERO_STAGE=${2:-0}
MODEL_PATH=${MODEL_PATH-./output/tiny/step1}  # set but empty: the embedded model

# Sized for 2 CPU cores: sequences of 256 tokens, one epoch over the reward-model share (3 of 4,3,3) of the
# synthetic pairs at the reward model's global batch 16, β 0.1 (the paper's TL;DR value: the synthetic task
# is a miniature TL;DR), the tiny model's DPO learning rate; evaluation on 256 held-out pairs.
BETA=0.1
GLOBAL_BATCH=16
EPOCHS=1
LR=1e-4
MAX_EVAL_SAMPLES=256

# Global batch = per-device batch x gradient accumulation x ranks: 16 = 8 x 2 x 1.
NUM_GPUS=${NUM_GPUS:-1}
PER_DEVICE=${PER_DEVICE_BATCH:-8}
run_step dpo
