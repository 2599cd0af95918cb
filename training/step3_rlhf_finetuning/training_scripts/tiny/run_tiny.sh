#!/usr/bin/env bash
# Step 3 (MA-PPO) of the tiny SFT model against the tiny reward model, on the embedded synthetic task,
# on one CPU rank.  Run run_tiny.sh of steps 1 and 2 first: their default outputs are this script's
# default models.  `deepspeed --num_gpus N` on a machine without GPUs starts N CPU ranks over gloo.
#
#   bash run_tiny.sh [OUTPUT] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE]     (defaults ./output/tiny/step3, 0, 0)
#
# Environment overrides:
#   ACTOR_MODEL_PATH   SFT model (default ./output/tiny/step1; empty = the embedded tiny model)
#   CRITIC_MODEL_PATH  reward model (default ./output/tiny/step2; empty = embedded model + new head)
#   TERMINATION        macro-action rule: fixed (default) | randomized | ppl | parsing | word
#   NGRAM              n of the fixed rule (default 5; 1 = vanilla PPO, inf = one action per answer)
#   KL_CTL             KL coefficient (default 0.05)
#   DATA_PATH          --data_path value(s), space-separated (default synthetic, e.g. synthetic:seed=7)
#   TASK               synthetic (the only task of the tiny scripts; point DATA_PATH elsewhere instead)
#   DATA_OUTPUT_PATH   tokenized-data cache (default /tmp/data_files)
#   NUM_GPUS           ranks per node (default 1)    NUM_NODES  nodes (default 1, or the hosts in HOSTFILE)
#   HOSTFILE           DeepSpeed hostfile of a multi-node run     MASTER_PORT  (default 29500)
#   PER_DEVICE_TRAIN_BATCH  experiences per rank per PPO micro-batch (default 16)
#   GENERATION_BATCHES      prompt batches generated per PPO step (default 1); the PPO batch stays 16
#   LAUNCHER_ARGS      extra `deepspeed` launcher options, e.g. "--no_ssh --node_rank 1 --master_addr A"
#   EXTRA_ARGS         appended verbatim to main.py's flags (later flags win), e.g. "--max_steps 10"
#   LOG_FILE           where the output is also written (default $OUTPUT/training.log)
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }

TASK=${TASK:-synthetic}
[[ "$TASK" == synthetic ]] || die "tiny scripts run the synthetic task, not TASK=$TASK; set DATA_PATH instead"
OUTPUT=${1:-./output/tiny/step3}
ACTOR_ZERO_STAGE=${2:-0}
CRITIC_ZERO_STAGE=${3:-${2:-0}}
ACTOR_MODEL_PATH=${ACTOR_MODEL_PATH-./output/tiny/step1}
CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH-./output/tiny/step2}
TERMINATION=${TERMINATION:-fixed}
NGRAM=${NGRAM:-5}
read -r -a DATA_PATH <<< "${DATA_PATH:-synthetic}"

# Small enough for 2 CPU cores: prompts <= 192 and answers <= 64 tokens, 16 prompts per PPO step, a
# capped number of steps over the PPO share (4 of 2,4,4) of the synthetic prompts, and held-out
# evaluation of the SFT and final policies on 64 prompts.  The PPO values are Table 5's (clip 0.2,
# lambda 0.95, gamma 1, KL 0.05, temperature 0.8, top-k 50); learning rates suit the tiny model.
EPOCHS=1
MAX_STEPS=20
PPO_BATCH=16
ACTOR_LR=1e-4
CRITIC_LR=1e-4
KL_CTL=${KL_CTL:-0.05}
WARMUP_STEPS=3

# PPO batch = prompts per rank x generation batches x ranks = 16 x 1 x 1; every rank trains on its
# 16 experiences in one micro-batch, so actor and critic take one optimizer step per PPO batch.
NUM_GPUS=${NUM_GPUS:-1}
HOSTFILE=${HOSTFILE:-}
if [[ -n "$HOSTFILE" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE '$HOSTFILE' not found"
    NUM_NODES=${NUM_NODES:-$(grep -cE '^[[:space:]]*[^#[:space:]]' "$HOSTFILE" || true)}
fi
NUM_NODES=${NUM_NODES:-1}
WORLD=$((NUM_GPUS * NUM_NODES))
GEN_BATCHES=${GENERATION_BATCHES:-1}
TRAIN_PER_DEVICE=${PER_DEVICE_TRAIN_BATCH:-16}
(( WORLD > 0 && PPO_BATCH % (WORLD * GEN_BATCHES) == 0 )) \
    || die "PPO batch $PPO_BATCH is not a multiple of $WORLD GPUs x GENERATION_BATCHES $GEN_BATCHES"
GEN_PER_DEVICE=$((PPO_BATCH / (WORLD * GEN_BATCHES)))
(( GEN_PER_DEVICE % TRAIN_PER_DEVICE == 0 )) \
    || die "$GEN_PER_DEVICE prompts per GPU: not a multiple of PER_DEVICE_TRAIN_BATCH $TRAIN_PER_DEVICE"
GRAD_ACCUM=$((GEN_PER_DEVICE * GEN_BATCHES / TRAIN_PER_DEVICE))

LAUNCH=(deepspeed --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}")
if [[ -n "$HOSTFILE" ]]; then LAUNCH+=(--hostfile "$HOSTFILE" --num_nodes "$NUM_NODES"); fi
read -r -a LAUNCHER_EXTRA <<< "${LAUNCHER_ARGS:-}"
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
MAIN="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/main.py"

MODEL_ARGS=()
if [[ -n "$ACTOR_MODEL_PATH" ]]; then MODEL_ARGS+=(--actor_model_name_or_path "$ACTOR_MODEL_PATH"); fi
if [[ -n "$CRITIC_MODEL_PATH" ]]; then MODEL_ARGS+=(--critic_model_name_or_path "$CRITIC_MODEL_PATH"); fi

LOG_FILE=${LOG_FILE:-$OUTPUT/training.log}
mkdir -p "$OUTPUT" "$(dirname "$LOG_FILE")"
"${LAUNCH[@]}" "${LAUNCHER_EXTRA[@]}" "$MAIN" \
    "${MODEL_ARGS[@]}" \
    --data_path "${DATA_PATH[@]}" \
    --data_split 2,4,4 \
    --data_output_path "${DATA_OUTPUT_PATH:-/tmp/data_files}" \
    --num_padding_at_beginning 0 \
    --max_prompt_seq_len 192 \
    --max_answer_seq_len 64 \
    --max_eval_samples 64 \
    --per_device_generation_batch_size "$GEN_PER_DEVICE" \
    --generation_batches "$GEN_BATCHES" \
    --per_device_training_batch_size "$TRAIN_PER_DEVICE" \
    --gradient_accumulation_steps "$GRAD_ACCUM" \
    --ppo_epochs 1 \
    --num_train_epochs "$EPOCHS" \
    --max_steps "$MAX_STEPS" \
    --actor_learning_rate "$ACTOR_LR" \
    --critic_learning_rate "$CRITIC_LR" \
    --actor_weight_decay 0.0 \
    --critic_weight_decay 0.0 \
    --lr_scheduler_type cosine \
    --num_warmup_steps "$WARMUP_STEPS" \
    --kl_ctl "$KL_CTL" \
    --cliprange 0.2 \
    --cliprange_value 0.2 \
    --gamma 1.0 \
    --lam 0.95 \
    --temperature 0.8 \
    --top_k 50 \
    --top_p 1.0 \
    --termination_condition "$TERMINATION" \
    --ngram "$NGRAM" \
    --value_function equal \
    --actor_zero_stage "$ACTOR_ZERO_STAGE" \
    --critic_zero_stage "$CRITIC_ZERO_STAGE" \
    --actor_dropout 0.0 \
    --critic_dropout 0.0 \
    --dtype fp32 \
    --print_answers \
    --print_answers_interval 10 \
    --deepspeed \
    --output_dir "$OUTPUT" \
    "${EXTRA[@]}" \
    2>&1 | tee "$LOG_FILE"
