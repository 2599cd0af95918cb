#!/usr/bin/env bash
# Step 3 of the tiny code task: the step-1 model of run_tiny_code.sh trained with program-test rewards
# (paper §4.4, B.5: each answer's program runs against its problem's unit tests in the sandbox; 1.0 when all
# pass, -0.3 + 1.3 x passed/total when it runs, -0.6 on a runtime error, -1.0 on a syntax error), on one CPU
# rank, ~3 minutes.  No reward model (B.2: the code task has no step 2).
#
#   bash run_tiny_code.sh [OUTPUT] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE]  (defaults ./output/tiny_code/step3, 0, 0)
#
# Environment overrides:
#   ACTOR_MODEL_PATH   SFT model (default ./output/tiny_code/step1; empty = the embedded tiny model)
#   ESTIMATOR          grpo (default) | rloo | reinforce: K = 4 answers per prompt, no critic;
#                      gae: MA-PPO with a critic initialised from the SFT model, one answer per prompt
#   TERMINATION, NGRAM macro-action rule (default fixed 5-grams; only gae uses a macro action's value)
#   REWARD_WORKERS     parallel sandboxed test processes (default 1)
#   DATA_PATH          --data_path value(s) (default synthetic_code:num_records=2000,operations=2,max_constant=3,flaw_rate=0.5)
#   TASK               synthetic_code (the only task of this script)
#   NUM_GPUS           ranks per node (default 1)
#   PER_DEVICE_TRAIN_BATCH  experiences per rank per micro-batch (default 16)
#   and those of every script (HOSTFILE, EXTRA_ARGS, LOG_FILE, ...): see
#   "Environment variables" in training/step1_supervised_finetuning/training_scripts/README.md.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../../launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"

tiny_code_task
code_reward
OUTPUT=${1:-./output/tiny_code/step3}
ACTOR_ZERO_STAGE=${2:-0}
CRITIC_ZERO_STAGE=${3:-${2:-0}}
ACTOR_MODEL_PATH=${ACTOR_MODEL_PATH-./output/tiny_code/step1}  # set but empty: the embedded model
CRITIC_MODEL_PATH=""  # no reward model: the critic (gae) starts from the actor

# A critic-free group estimator by default: with a sparse pass/fail reward, the mean of the other answers
# to the same prompt is a better baseline than a value head learning from scratch.  16 answers per step
# (4 prompts x 4), 30 steps at a constant lr 1e-4, sampled at temperature 1 from the full distribution and
# no KL penalty: the program tests are the whole signal, and at temperature 0.8 / top-k 50, lr 1e-4 on a
# cosine schedule and KL 0.05 the same SFT model's held-out pass rate did not rise in 25 steps (0.391 ->
# 0.359) — docs/results/code_task.md has the measured numbers of these defaults.
TEMPERATURE=1.0
TOP_K=0
LR_SCHEDULE=constant
ADV_ESTIMATOR=${ESTIMATOR:-grpo}
case "$ADV_ESTIMATOR" in
    grpo|rloo|reinforce) SAMPLES_PER_PROMPT=4 ;;
    gae) SAMPLES_PER_PROMPT=1 ;;
    *) die "ESTIMATOR must be grpo, rloo, reinforce or gae (got '$ADV_ESTIMATOR')" ;;
esac
PPO_BATCH=16
EPOCHS=1
MAX_STEPS=30
ACTOR_LR=1e-4
CRITIC_LR=1e-4
KL_CTL=0.0
WARMUP_STEPS=0
MAX_EVAL_SAMPLES=64
PRINT_INTERVAL=25

# PPO batch = prompts per rank x answers per prompt x ranks = 4 x 4 x 1 answers (gae: 16 prompts x 1); every
# rank trains on its 16 experiences in one micro-batch, so the actor takes one optimizer step per batch.
NUM_GPUS=${NUM_GPUS:-1}
TRAIN_PER_DEVICE=${PER_DEVICE_TRAIN_BATCH:-16}
run_step 3
