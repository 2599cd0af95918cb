#!/usr/bin/env bash
# Step 3 (MA-PPO) of Llama-3.2 3B with the settings of MA-RLHF Appendix C.4 (Table 5's Gemma 2B column
# for everything C.4 leaves unsaid):
# the SFT model initialises the actor (and the frozen reference), the reward model the critic (and the
# frozen reward model); PPO runs over fixed 5-token macro actions by default (NGRAM=1 is vanilla PPO).
#
#   bash run_3b.sh [OUTPUT] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE]     (one stage given: both use it)
#
# Environment overrides:
#   TASK               tldr | hh | webgpt (default tldr): the dataset and the task-dependent Table 5 values
#   ACTOR_MODEL_PATH   SFT model (default: step 1's default output ./output/llama3.2-3b/$TASK/step1)
#   CRITIC_MODEL_PATH  reward model (default: step 2's default output ./output/llama3.2-3b/$TASK/step2)
#   TERMINATION        macro-action rule: fixed (default) | randomized | ppl | parsing | word
#   NGRAM              n of the fixed rule (default 5; 1 = vanilla PPO, inf = one action per answer)
#   KL_CTL             KL coefficient (default: Table 5)
#   PER_DEVICE_TRAIN_BATCH  experiences per GPU per PPO micro-batch (default 8)
#   GENERATION_BATCHES      prompt batches generated per PPO step (default 1); the PPO batch stays 256
#   and those of every script (DATA_PATH, NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

text_task "Llama-3.2 3B PPO"
OUTPUT=${1:-./output/llama3.2-3b/$TASK/step3}
ACTOR_ZERO_STAGE=${2:-2}
CRITIC_ZERO_STAGE=${3:-${2:-3}}
ACTOR_MODEL_PATH=${ACTOR_MODEL_PATH:-./output/llama3.2-3b/$TASK/step1}
CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH:-./output/llama3.2-3b/$TASK/step2}
EOS_TOKEN="<|end_of_text|>"

# C.4: actor lr 5e-6, critic lr 1e-5, KL 0.1, TL;DR with Gemma 2B's data split.  The rest follows Table 5's
# Gemma 2B column: batch 256; 4 epochs for WebGPT, 1 for the others; 1 PPO epoch per rollout; clip 0.2;
# GAE lambda 0.95, gamma 1; prompts <= 512, answers <= 512 tokens; 200 warmup steps (cosine after them);
# temperature 0.8, top-p 1.0, top-k 50.
# One optimizer step per 256 experiences makes a TL;DR epoch ~145 steps, fewer than the 200 warmup steps;
# EXTRA_ARGS="--num_warmup_steps 0 --warmup_ratio 0.1" switches to a ratio instead.
PPO_BATCH=256
EPOCHS=$(by_task tldr=1 hh=1 webgpt=4)
ACTOR_LR=5e-6
CRITIC_LR=1e-5
KL_CTL=${KL_CTL:-0.1}
WARMUP_STEPS=200

# PPO batch = prompts per GPU x generation batches x GPUs = 32 x 1 x 8 on one node of 8 GPUs, and every
# GPU trains on its 32 experiences in micro-batches of 8 with 4 accumulation steps: 8 x 4 x 8 = 256, so
# actor and critic take one optimizer step per PPO batch.
TRAIN_PER_DEVICE=${PER_DEVICE_TRAIN_BATCH:-8}

# 3B: actor (and reference) under ZeRO-2; critic and reward model (two copies of the RM) under ZeRO-3.
run_step 3
