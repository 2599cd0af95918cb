#!/usr/bin/env bash
# Step 1 (SFT) of meta-llama/Llama-3.2-3B (MA-RLHF, Appendix C.4).
#
#   bash run_3b.sh [OUTPUT] [ZERO_STAGE]        e.g.  TASK=webgpt bash run_3b.sh ./output/sft 2
#
# Environment overrides:
#   TASK              tldr | hh | webgpt (default tldr): the dataset and the task-dependent Table 5 values
#   MODEL_PATH        base model (default meta-llama/Llama-3.2-3B)
#   DATA_PATH         --data_path value(s), space-separated (default: the task's hub dataset; a local copy
#                     is NAME:PATH, e.g. openai/summarize_from_feedback:/data/summarize)
#   DATA_OUTPUT_PATH  tokenized-data cache (default /tmp/data_files)
#   NUM_GPUS          GPUs per node (default 8)     NUM_NODES  nodes (default 1, or the hosts in HOSTFILE)
#   HOSTFILE          DeepSpeed hostfile of a multi-node run     MASTER_PORT  (default 29500)
#   PER_DEVICE_BATCH  micro-batch per GPU (default 8); gradient accumulation keeps the global batch
#   BAD_ROWS          skip (default: over-long prompts are dropped and counted in the log) | error
#   LAUNCHER_ARGS     extra `deepspeed` launcher options, e.g. "--no_ssh --node_rank 1 --master_addr A"
#   EXTRA_ARGS        appended verbatim to main.py's flags (later flags win), e.g. "--max_steps 10"
#   LOG_FILE          where the output is also written (default $OUTPUT/training.log)
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }

TASK=${TASK:-tldr}
OUTPUT=${1:-./output/llama3.2-3b/$TASK/step1}
ZERO_STAGE=${2:-2}
MODEL_PATH=${MODEL_PATH:-meta-llama/Llama-3.2-3B}

# C.4 runs Llama-3.2-3B on TL;DR "following the same data split as Gemma-2B" and names only step-3
# values, so steps 1 and 2 reuse Table 5's Gemma 2B column: batch 64 and lr 1e-4 for WebGPT, 512 and 5e-5
# for the others; 3 epochs; cosine schedule, warmup ratio 0.1.  Prompts <= 512 and answers <= 512
# tokens: sequences up to 1024.  Meta's base model ends its text with <|end_of_text|>.
case "$TASK" in
    tldr)   DATASET=openai/summarize_from_feedback; GLOBAL_BATCH=512; LR=5e-5 ;;
    hh)     DATASET=Dahoas/full-hh-rlhf;            GLOBAL_BATCH=512; LR=5e-5 ;;
    webgpt) DATASET=openai/webgpt_comparisons;      GLOBAL_BATCH=64;  LR=1e-4 ;;
    *) die "TASK must be tldr, hh or webgpt for Llama-3.2 3B SFT (got '$TASK')" ;;
esac
EPOCHS=3
read -r -a DATA_PATH <<< "${DATA_PATH:-$DATASET}"

# Global batch = per-device batch x gradient accumulation x GPUs.  On one node of 8 GPUs:
# 512 = 8 x 8 x 8 and 64 = 8 x 1 x 8.  Other GPU counts change the accumulation, not the batch.
NUM_GPUS=${NUM_GPUS:-8}
HOSTFILE=${HOSTFILE:-}
if [[ -n "$HOSTFILE" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE '$HOSTFILE' not found"
    NUM_NODES=${NUM_NODES:-$(grep -cE '^[[:space:]]*[^#[:space:]]' "$HOSTFILE" || true)}
fi
NUM_NODES=${NUM_NODES:-1}
PER_DEVICE=${PER_DEVICE_BATCH:-8}
WORLD=$((NUM_GPUS * NUM_NODES))
(( WORLD > 0 && GLOBAL_BATCH % (PER_DEVICE * WORLD) == 0 )) \
    || die "global batch $GLOBAL_BATCH is not a multiple of PER_DEVICE_BATCH $PER_DEVICE x $WORLD GPUs"
GRAD_ACCUM=$((GLOBAL_BATCH / (PER_DEVICE * WORLD)))

LAUNCH=(deepspeed --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}")
if [[ -n "$HOSTFILE" ]]; then LAUNCH+=(--hostfile "$HOSTFILE" --num_nodes "$NUM_NODES"); fi
read -r -a LAUNCHER_EXTRA <<< "${LAUNCHER_ARGS:-}"
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
MAIN="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/main.py"

# 3B: ZeRO-2 (optimizer state and gradients partitioned) is enough.
LOG_FILE=${LOG_FILE:-$OUTPUT/training.log}
mkdir -p "$OUTPUT" "$(dirname "$LOG_FILE")"
"${LAUNCH[@]}" "${LAUNCHER_EXTRA[@]}" "$MAIN" \
    --model_name_or_path "$MODEL_PATH" \
    --data_path "${DATA_PATH[@]}" \
    --data_split 2,4,4 \
    --data_output_path "${DATA_OUTPUT_PATH:-/tmp/data_files}" \
    --bad_rows "${BAD_ROWS:-skip}" \
    --end_of_conversation_token "<|end_of_text|>" \
    --num_padding_at_beginning 0 \
    --max_seq_len 1024 \
    --per_device_train_batch_size "$PER_DEVICE" \
    --per_device_eval_batch_size "$PER_DEVICE" \
    --gradient_accumulation_steps "$GRAD_ACCUM" \
    --learning_rate "$LR" \
    --weight_decay 0.0 \
    --num_train_epochs "$EPOCHS" \
    --lr_scheduler_type cosine \
    --warmup_ratio 0.1 \
    --zero_stage "$ZERO_STAGE" \
    --dtype bf16 \
    --deepspeed \
    --output_dir "$OUTPUT" \
    "${EXTRA[@]}" \
    2>&1 | tee "$LOG_FILE"
