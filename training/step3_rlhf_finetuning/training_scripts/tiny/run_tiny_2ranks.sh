#!/usr/bin/env bash
# Step 3 (MA-PPO) of the tiny SFT model against the tiny reward model, on the embedded synthetic task,
# on two CPU ranks (ZeRO-2 by default).  Run run_tiny_2ranks.sh of steps 1 and 2 first: their default
# outputs are this script's default models.  `deepspeed --num_gpus N` on a machine without GPUs starts N
# CPU ranks over gloo.
#
#   bash run_tiny_2ranks.sh [OUTPUT] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE]
#   (defaults ./output/tiny_2ranks/step3, 2, 2)
#
# Otherwise the run of run_tiny.sh -- same data and hyper-parameters -- on two ranks: 16 prompts per PPO
# step = 8 per rank x 1 generation batch x 2 ranks, and every rank trains on its 8 experiences in one
# micro-batch, so actor and critic still take one optimizer step per PPO batch.
#
# Environment overrides: as run_tiny.sh, but ACTOR_MODEL_PATH / CRITIC_MODEL_PATH default to
# ./output/tiny_2ranks/step1 and step2, NUM_GPUS (ranks per node) to 2 and PER_DEVICE_TRAIN_BATCH to 8.
set -euo pipefail
export NUM_GPUS=${NUM_GPUS:-2}
export PER_DEVICE_TRAIN_BATCH=${PER_DEVICE_TRAIN_BATCH:-8}
export ACTOR_MODEL_PATH=${ACTOR_MODEL_PATH-./output/tiny_2ranks/step1}  # set but empty: as run_tiny.sh
export CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH-./output/tiny_2ranks/step2}
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_tiny.sh" \
    "${1:-./output/tiny_2ranks/step3}" "${2:-2}" "${3:-${2:-2}}"
