#!/usr/bin/env bash
# Step 3 (MA-PPO) of Gemma 7B with the paper's Table 5 settings (MA-RLHF, section 3.2 and Appendix B.2):
# the SFT model initialises the actor (and the frozen reference), the reward model the critic (and the
# frozen reward model); PPO runs over fixed 5-token macro actions by default (NGRAM=1 is vanilla PPO).
#
#   bash run_7b.sh [OUTPUT] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE]     (one stage given: both use it)
#
# Environment overrides:
#   TASK               tldr | hh | webgpt (default tldr): the dataset and the task-dependent Table 5 values
#   ACTOR_MODEL_PATH   SFT model (default: step 1's default output ./output/gemma-7b/$TASK/step1)
#   CRITIC_MODEL_PATH  reward model (default: step 2's default output ./output/gemma-7b/$TASK/step2)
#   TERMINATION        macro-action rule: fixed (default) | randomized | ppl | parsing | word
#   NGRAM              n of the fixed rule (default 5; 1 = vanilla PPO, inf = one action per answer)
#   KL_CTL             KL coefficient (default: Table 5; B.2 used 0.01 for MA-PPO on TL;DR, see below)
#   PER_DEVICE_TRAIN_BATCH  experiences per GPU per PPO micro-batch (default 4)
#   GENERATION_BATCHES      prompt batches generated per PPO step (default 1); the PPO batch stays 256
#   and those of every script (DATA_PATH, NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

text_task "Gemma 7B PPO"
OUTPUT=${1:-./output/gemma-7b/$TASK/step3}
ACTOR_ZERO_STAGE=${2:-3}
CRITIC_ZERO_STAGE=${3:-${2:-3}}
ACTOR_MODEL_PATH=${ACTOR_MODEL_PATH:-./output/gemma-7b/$TASK/step1}
CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH:-./output/gemma-7b/$TASK/step2}
EOS_TOKEN="<eos>"

# Table 5, Gemma 7B, PPO: batch 256; actor and critic lr 1e-6; 4 epochs for WebGPT, 1 for the others;
# 1 PPO epoch per rollout; clip 0.2; GAE lambda 0.95, gamma 1; KL 0.1 for WebGPT, 0.05 for the others;
# prompts <= 512, answers <= 512 tokens; 200 warmup steps (cosine after them); temperature 0.8, top-p 1.0,
# top-k 50.  B.2: MA-PPO on TL;DR at 7B was unstable with KL 0.05 and stable with 0.01 -- run it with
# KL_CTL=0.01 to reproduce that setting (Table 5's 0.05 stays the default).
# One optimizer step per 256 experiences makes a TL;DR epoch ~145 steps, fewer than the 200 warmup steps;
# EXTRA_ARGS="--num_warmup_steps 0 --warmup_ratio 0.1" switches to a ratio instead.
PPO_BATCH=256
EPOCHS=$(by_task tldr=1 hh=1 webgpt=4)
ACTOR_LR=1e-6
CRITIC_LR=1e-6
KL_CTL=${KL_CTL:-$(by_task tldr=0.05 hh=0.05 webgpt=0.1)}
WARMUP_STEPS=200

# PPO batch = prompts per GPU x generation batches x GPUs = 32 x 1 x 8 on one node of 8 GPUs, and every
# GPU trains on its 32 experiences in micro-batches of 4 with 8 accumulation steps: 4 x 8 x 8 = 256, so
# actor and critic take one optimizer step per PPO batch.
TRAIN_PER_DEVICE=${PER_DEVICE_TRAIN_BATCH:-4}

# 7B: ZeRO-3 for all four models, gradient checkpointing in actor and critic.
GRADIENT_CHECKPOINTING=1
run_step 3
