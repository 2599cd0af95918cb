#!/usr/bin/env bash
# Step 3 (MA-PPO) of CodeGemma 2B (google/codegemma-2b) on APPS, Table 5 settings (MA-RLHF,
# Appendix B.2): the SFT model initialises the actor, the reference and the critic; the reward is the
# program's pass rate on the problem's tests (pass@1, a compiler signal), as the code task has no reward
# model.  Macro actions are fixed 10-token n-grams (the released APPS checkpoints are "Fixed10").
#
# The reward is --reward_source program_tests: each answer's program runs against the problem's unit
# tests in a sandbox (marlhf/code), reward of B.5: -0.3 + 1.3 x passed/total if it compiles, -0.6 on a
# runtime error, -1.0 on a compile error.  REWARD_SOURCE=reward_model with REWARD_MODEL_PATH=<a code reward
# model> scores with a reward model instead.
#
#   bash run_2b.sh [OUTPUT] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE]     (one stage given: both use it)
#
# Environment overrides:
#   TASK               apps (the only task of this family)
#   ACTOR_MODEL_PATH   SFT model (default: step 1's default output ./output/codegemma-2b/apps/step1)
#   CRITIC_MODEL_PATH  critic initialisation (default: the SFT model, as in B.2)
#   REWARD_SOURCE      program_tests (default) | reward_model
#   REWARD_WORKERS     program_tests: parallel test processes per GPU rank (default 1)
#   REWARD_MODEL_PATH  the reward model when REWARD_SOURCE=reward_model
#   TERMINATION        macro-action rule: fixed (default) | randomized | ppl | parsing | word
#   NGRAM              n of the fixed rule (default 10; 1 = vanilla PPO, inf = one action per answer)
#   KL_CTL             KL coefficient (default: Table 5)
#   DATA_PATH          --data_path value(s), space-separated (default codeparrot/apps; a local copy is
#                      codeparrot/apps:/data/APPS with train/ and test/ problem folders)
#   PER_DEVICE_TRAIN_BATCH  experiences per GPU per PPO micro-batch (default 2)
#   GENERATION_BATCHES      prompt batches generated per PPO step (default 1); the PPO batch stays 16
#   and those of every script (NUM_GPUS, HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

code_task
code_reward
OUTPUT=${1:-./output/codegemma-2b/apps/step3}
ACTOR_ZERO_STAGE=${2:-2}
CRITIC_ZERO_STAGE=${3:-${2:-3}}
ACTOR_MODEL_PATH=${ACTOR_MODEL_PATH:-./output/codegemma-2b/apps/step1}
CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH:-$ACTOR_MODEL_PATH}
NGRAM=${NGRAM:-10}
EOS_TOKEN="<eos>"

# Table 5, CodeGemma 2B, PPO: batch 16; actor lr 5e-7, critic lr 5e-5; 1 epoch; 1 PPO epoch per
# rollout; clip 0.2; GAE lambda 0.95, gamma 1; KL 0.05; prompts <= 600, answers <= 512 tokens; 20 warmup
# steps (cosine after them); temperature 1.0, top-p 1.0, top-k 5.  B.2: PPO uses 80% of APPS (2,0,8).
PPO_BATCH=16
EPOCHS=1
ACTOR_LR=5e-7
CRITIC_LR=5e-5
KL_CTL=${KL_CTL:-0.05}
WARMUP_STEPS=20
TEMPERATURE=1.0
TOP_K=5
PRINT_INTERVAL=20

# PPO batch = prompts per GPU x generation batches x GPUs = 2 x 1 x 8 on one node of 8 GPUs, and every
# GPU trains on its 2 experiences in one micro-batch: 2 x 1 x 8 = 16, so actor and critic take one
# optimizer step per PPO batch.
TRAIN_PER_DEVICE=${PER_DEVICE_TRAIN_BATCH:-2}

# 2B: actor (and reference) under ZeRO-2; critic under ZeRO-3.
run_step 3
