#!/usr/bin/env bash
# Step 2 (reward model) on top of the tiny SFT model, on the embedded synthetic task on two CPU ranks
# (ZeRO-2 by default: gradients and optimizer state partitioned across the ranks).
#
#   bash run_tiny_2ranks.sh [OUTPUT] [ZERO_STAGE]      (defaults ./output/tiny_2ranks/step2 and 2)
#
# As in the paper (B.2) the reward model starts from the SFT model: run step 1's run_tiny_2ranks.sh first,
# or set MODEL_PATH= (empty) to start from the embedded tiny model.  --data_path synthetic is the
# project's miniature TL;DR task, its pairs labelled by the task's gold scorer with Bradley-Terry noise.
# `deepspeed --num_gpus N` on a machine without GPUs starts N CPU ranks over gloo.
#
# Environment overrides:
#   MODEL_PATH        initial model (default ./output/tiny_2ranks/step1; empty = the embedded tiny model)
#   DATA_PATH         --data_path value(s), space-separated (default synthetic, e.g. synthetic:seed=7)
#   TASK              synthetic (the only task of the tiny scripts; point DATA_PATH elsewhere instead)
#   DATA_OUTPUT_PATH  tokenized-data cache (default /tmp/data_files)
#   NUM_GPUS          ranks per node (default 2)    NUM_NODES  nodes (default 1, or the hosts in HOSTFILE)
#   HOSTFILE          DeepSpeed hostfile of a multi-node run     MASTER_PORT  (default 29500)
#   PER_DEVICE_BATCH  pairs per rank per micro-batch (default 8); accumulation keeps the global batch 16
#   LAUNCHER_ARGS     extra `deepspeed` launcher options, e.g. "--no_ssh --node_rank 1 --master_addr A"
#   EXTRA_ARGS        appended verbatim to main.py's flags (later flags win), e.g. "--max_steps 10"
#   LOG_FILE          where the output is also written (default $OUTPUT/training.log)
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }

TASK=${TASK:-synthetic}
[[ "$TASK" == synthetic ]] || die "tiny scripts run the synthetic task, not TASK=$TASK; set DATA_PATH instead"
OUTPUT=${1:-./output/tiny_2ranks/step2}
ZERO_STAGE=${2:-2}
MODEL_PATH=${MODEL_PATH-./output/tiny_2ranks/step1}  # set but empty: the embedded model
read -r -a DATA_PATH <<< "${DATA_PATH:-synthetic}"

# Small enough for 2 CPU cores: sequences of 256 tokens (prompt <= 192, answer <= 64), one epoch over
# the reward-model share (4 of 2,4,4) of the synthetic pairs.
GLOBAL_BATCH=16
EPOCHS=1
LR=5e-4

# Global batch = per-device batch x gradient accumulation x ranks: 16 = 8 x 1 x 2 (run_tiny.sh: 8 x 2 x 1).
NUM_GPUS=${NUM_GPUS:-2}
HOSTFILE=${HOSTFILE:-}
if [[ -n "$HOSTFILE" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE '$HOSTFILE' not found"
    NUM_NODES=${NUM_NODES:-$(grep -cE '^[[:space:]]*[^#[:space:]]' "$HOSTFILE" || true)}
fi
NUM_NODES=${NUM_NODES:-1}
PER_DEVICE=${PER_DEVICE_BATCH:-8}
WORLD=$((NUM_GPUS * NUM_NODES))
(( WORLD > 0 && GLOBAL_BATCH % (PER_DEVICE * WORLD) == 0 )) \
    || die "global batch $GLOBAL_BATCH is not a multiple of PER_DEVICE_BATCH $PER_DEVICE x $WORLD ranks"
GRAD_ACCUM=$((GLOBAL_BATCH / (PER_DEVICE * WORLD)))

LAUNCH=(deepspeed --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}")
if [[ -n "$HOSTFILE" ]]; then LAUNCH+=(--hostfile "$HOSTFILE" --num_nodes "$NUM_NODES"); fi
read -r -a LAUNCHER_EXTRA <<< "${LAUNCHER_ARGS:-}"
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
MAIN="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/main.py"
MODEL_ARGS=()
if [[ -n "$MODEL_PATH" ]]; then MODEL_ARGS=(--model_name_or_path "$MODEL_PATH"); fi

LOG_FILE=${LOG_FILE:-$OUTPUT/training.log}
mkdir -p "$OUTPUT" "$(dirname "$LOG_FILE")"
"${LAUNCH[@]}" "${LAUNCHER_EXTRA[@]}" "$MAIN" \
    "${MODEL_ARGS[@]}" \
    --data_path "${DATA_PATH[@]}" \
    --data_split 2,4,4 \
    --data_output_path "${DATA_OUTPUT_PATH:-/tmp/data_files}" \
    --num_padding_at_beginning 0 \
    --max_seq_len 256 \
    --max_eval_samples 128 \
    --per_device_train_batch_size "$PER_DEVICE" \
    --per_device_eval_batch_size "$PER_DEVICE" \
    --gradient_accumulation_steps "$GRAD_ACCUM" \
    --learning_rate "$LR" \
    --weight_decay 0.0 \
    --num_train_epochs "$EPOCHS" \
    --lr_scheduler_type cosine \
    --warmup_ratio 0.1 \
    --zero_stage "$ZERO_STAGE" \
    --dtype fp32 \
    --deepspeed \
    --output_dir "$OUTPUT" \
    "${EXTRA[@]}" \
    2>&1 | tee "$LOG_FILE"
