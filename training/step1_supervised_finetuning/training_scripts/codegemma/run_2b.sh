#!/usr/bin/env bash
# Step 1 (SFT) of google/codegemma-2b on APPS with the paper's Table 5 settings (MA-RLHF, Appendix B.2).
#
#   bash run_2b.sh [OUTPUT] [ZERO_STAGE]
#
# B.2: the code task has no preference pairs, so there is no step 2; the data is split 20% SFT / 80% PPO
# (--data_split 2,0,8, the same split in step 3 so the two shares stay disjoint).
#
# Environment overrides:
#   TASK              apps (the only task of this family)
#   MODEL_PATH        base model (default google/codegemma-2b)
#   DATA_PATH         --data_path value(s), space-separated (default codeparrot/apps; a local copy is
#                     codeparrot/apps:/data/APPS with train/ and test/ problem folders)
#   DATA_OUTPUT_PATH  tokenized-data cache (default /tmp/data_files)
#   NUM_GPUS          GPUs per node (default 8)     NUM_NODES  nodes (default 1, or the hosts in HOSTFILE)
#   HOSTFILE          DeepSpeed hostfile of a multi-node run     MASTER_PORT  (default 29500)
#   PER_DEVICE_BATCH  micro-batch per GPU (default 2); gradient accumulation keeps the global batch
#   BAD_ROWS          skip (default: over-long prompts are dropped and counted in the log) | error
#   LAUNCHER_ARGS     extra `deepspeed` launcher options, e.g. "--no_ssh --node_rank 1 --master_addr A"
#   EXTRA_ARGS        appended verbatim to main.py's flags (later flags win), e.g. "--max_steps 10"
#   LOG_FILE          where the output is also written (default $OUTPUT/training.log)
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }

TASK=${TASK:-apps}
[[ "$TASK" == apps ]] || die "TASK must be apps for CodeGemma (got '$TASK')"
OUTPUT=${1:-./output/codegemma-2b/apps/step1}
ZERO_STAGE=${2:-2}
MODEL_PATH=${MODEL_PATH:-google/codegemma-2b}

# Table 5, CodeGemma 2B, SFT: batch 16, 1 epoch, lr 5e-6, cosine schedule, no warmup.
# Prompts <= 600 and answers <= 512 tokens: sequences up to 1112.
GLOBAL_BATCH=16
EPOCHS=1
LR=5e-6
read -r -a DATA_PATH <<< "${DATA_PATH:-codeparrot/apps}"

# Global batch = per-device batch x gradient accumulation x GPUs.  On one node of 8 GPUs: 16 = 2 x 1 x 8.
NUM_GPUS=${NUM_GPUS:-8}
HOSTFILE=${HOSTFILE:-}
if [[ -n "$HOSTFILE" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE '$HOSTFILE' not found"
    NUM_NODES=${NUM_NODES:-$(grep -cE '^[[:space:]]*[^#[:space:]]' "$HOSTFILE" || true)}
fi
NUM_NODES=${NUM_NODES:-1}
PER_DEVICE=${PER_DEVICE_BATCH:-2}
WORLD=$((NUM_GPUS * NUM_NODES))
(( WORLD > 0 && GLOBAL_BATCH % (PER_DEVICE * WORLD) == 0 )) \
    || die "global batch $GLOBAL_BATCH is not a multiple of PER_DEVICE_BATCH $PER_DEVICE x $WORLD GPUs"
GRAD_ACCUM=$((GLOBAL_BATCH / (PER_DEVICE * WORLD)))

LAUNCH=(deepspeed --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}")
if [[ -n "$HOSTFILE" ]]; then LAUNCH+=(--hostfile "$HOSTFILE" --num_nodes "$NUM_NODES"); fi
read -r -a LAUNCHER_EXTRA <<< "${LAUNCHER_ARGS:-}"
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
MAIN="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/main.py"

# 2B: ZeRO-2 (optimizer state and gradients partitioned) is enough.
LOG_FILE=${LOG_FILE:-$OUTPUT/training.log}
mkdir -p "$OUTPUT" "$(dirname "$LOG_FILE")"
"${LAUNCH[@]}" "${LAUNCHER_EXTRA[@]}" "$MAIN" \
    --model_name_or_path "$MODEL_PATH" \
    --data_path "${DATA_PATH[@]}" \
    --data_split 2,0,8 \
    --data_output_path "${DATA_OUTPUT_PATH:-/tmp/data_files}" \
    --bad_rows "${BAD_ROWS:-skip}" \
    --end_of_conversation_token "<eos>" \
    --num_padding_at_beginning 0 \
    --max_seq_len 1112 \
    --per_device_train_batch_size "$PER_DEVICE" \
    --per_device_eval_batch_size "$PER_DEVICE" \
    --gradient_accumulation_steps "$GRAD_ACCUM" \
    --learning_rate "$LR" \
    --weight_decay 0.0 \
    --num_train_epochs "$EPOCHS" \
    --lr_scheduler_type cosine \
    --warmup_ratio 0.0 \
    --zero_stage "$ZERO_STAGE" \
    --dtype bf16 \
    --deepspeed \
    --output_dir "$OUTPUT" \
    "${EXTRA[@]}" \
    2>&1 | tee "$LOG_FILE"
