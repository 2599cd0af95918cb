#!/usr/bin/env bash
# Step 3 (MA-PPO) of Gemma-2 27B with the paper's Table 5 settings (MA-RLHF, section 3.2 and Appendix B.2):
# the SFT model initialises the actor (and the frozen reference), the reward model the critic (and the
# frozen reward model); PPO runs over fixed 5-token macro actions by default (NGRAM=1 is vanilla PPO).
#
#   bash run_27b.sh [OUTPUT] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE]     (one stage given: both use it)
#
# Environment overrides:
#   TASK               tldr | hh | webgpt (default tldr): the dataset (Table 5 has one 27B value per row)
#   ACTOR_MODEL_PATH   SFT model (default: step 1's default output ./output/gemma2-27b/$TASK/step1)
#   CRITIC_MODEL_PATH  reward model (default: step 2's default output ./output/gemma2-27b/$TASK/step2)
#   TERMINATION        macro-action rule: fixed (default) | randomized | ppl | parsing | word
#   NGRAM              n of the fixed rule (default 5; 1 = vanilla PPO, inf = one action per answer)
#   KL_CTL             KL coefficient (default: Table 5)
#   PER_DEVICE_TRAIN_BATCH  experiences per GPU per PPO micro-batch (default 2)
#   GENERATION_BATCHES      prompt batches generated per PPO step (default 1); the PPO batch stays 256
#   and those of every script (DATA_PATH, NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

text_task "Gemma-2 27B PPO"
OUTPUT=${1:-./output/gemma2-27b/$TASK/step3}
ACTOR_ZERO_STAGE=${2:-3}
CRITIC_ZERO_STAGE=${3:-${2:-3}}
ACTOR_MODEL_PATH=${ACTOR_MODEL_PATH:-./output/gemma2-27b/$TASK/step1}
CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH:-./output/gemma2-27b/$TASK/step2}
EOS_TOKEN="<eos>"

# Table 5, Gemma-2 27B, PPO: batch 256; actor lr 7e-7, critic lr 1e-6; 1 epoch; 1 PPO epoch per rollout;
# clip 0.2; GAE lambda 0.95, gamma 1; KL 0.1; prompts <= 512, answers <= 512 tokens; no warmup (cosine
# from the start); temperature 0.8, top-p 1.0, top-k 50.
PPO_BATCH=256
EPOCHS=1
ACTOR_LR=7e-7
CRITIC_LR=1e-6
KL_CTL=${KL_CTL:-0.1}
WARMUP_STEPS=0

# PPO batch = prompts per GPU x generation batches x GPUs = 32 x 1 x 8 on one node of 8 GPUs, and every
# GPU trains on its 32 experiences in micro-batches of 2 with 16 accumulation steps: 2 x 16 x 8 = 256, so
# actor and critic take one optimizer step per PPO batch.
TRAIN_PER_DEVICE=${PER_DEVICE_TRAIN_BATCH:-2}

# 27B: ZeRO-3 for all four models, optimizer state offloaded to CPU (and the frozen reference and
# reward model too), gradient checkpointing in actor and critic.
GRADIENT_CHECKPOINTING=1
OFFLOAD=1
run_step 3
