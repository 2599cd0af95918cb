#!/usr/bin/env bash
# Step 3 (MA-PPO) of Gemma 2B with the paper's Table 5 settings (MA-RLHF, section 3.2 and Appendix B.2):
# the SFT model initialises the actor (and the frozen reference), the reward model the critic (and the
# frozen reward model); PPO runs over fixed 5-token macro actions by default (NGRAM=1 is vanilla PPO).
#
#   bash run_2b.sh [OUTPUT] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE]     (one stage given: both use it)
#
# Environment overrides:
#   TASK               tldr | hh | webgpt (default tldr): the dataset and the task-dependent Table 5 values
#   ACTOR_MODEL_PATH   SFT model (default: step 1's default output ./output/gemma-2b/$TASK/step1)
#   CRITIC_MODEL_PATH  reward model (default: step 2's default output ./output/gemma-2b/$TASK/step2)
#   TERMINATION        macro-action rule: fixed (default) | randomized | ppl | parsing | word
#   NGRAM              n of the fixed rule (default 5; 1 = vanilla PPO, inf = one action per answer)
#   KL_CTL             KL coefficient (default: Table 5)
#   DATA_PATH          --data_path value(s), space-separated (default: the task's hub dataset; a local copy
#                      is NAME:PATH, e.g. openai/summarize_from_feedback:/data/summarize)
#   DATA_OUTPUT_PATH   tokenized-data cache (default /tmp/data_files)
#   NUM_GPUS           GPUs per node (default 8)     NUM_NODES  nodes (default 1, or the hosts in HOSTFILE)
#   HOSTFILE           DeepSpeed hostfile of a multi-node run     MASTER_PORT  (default 29500)
#   PER_DEVICE_TRAIN_BATCH  experiences per GPU per PPO micro-batch (default 8)
#   GENERATION_BATCHES      prompt batches generated per PPO step (default 1); the PPO batch stays 256
#   BAD_ROWS           skip (default: over-long prompts are dropped and counted in the log) | error
#   LAUNCHER_ARGS      extra `deepspeed` launcher options, e.g. "--no_ssh --node_rank 1 --master_addr A"
#   EXTRA_ARGS         appended verbatim to main.py's flags (later flags win), e.g. "--max_steps 10";
#                      on GPUs "--enable_hybrid_engine" speeds up generation
#   LOG_FILE           where the output is also written (default $OUTPUT/training.log)
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }

TASK=${TASK:-tldr}
OUTPUT=${1:-./output/gemma-2b/$TASK/step3}
ACTOR_ZERO_STAGE=${2:-2}
CRITIC_ZERO_STAGE=${3:-${2:-3}}
ACTOR_MODEL_PATH=${ACTOR_MODEL_PATH:-./output/gemma-2b/$TASK/step1}
CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH:-./output/gemma-2b/$TASK/step2}
TERMINATION=${TERMINATION:-fixed}
NGRAM=${NGRAM:-5}

# Table 5, Gemma 2B, PPO: batch 256; actor and critic lr 1.5e-5; 4 epochs for WebGPT, 1 for the others;
# 1 PPO epoch per rollout; clip 0.2; GAE lambda 0.95, gamma 1; KL 0.05; prompts <= 512, answers <= 512
# tokens; 200 warmup steps (cosine after them); temperature 0.8, top-p 1.0, top-k 50.
# One optimizer step per 256 experiences makes a TL;DR epoch ~145 steps, fewer than the 200 warmup steps;
# EXTRA_ARGS="--num_warmup_steps 0 --warmup_ratio 0.1" switches to a ratio instead.
case "$TASK" in
    tldr)   DATASET=openai/summarize_from_feedback; EPOCHS=1 ;;
    hh)     DATASET=Dahoas/full-hh-rlhf;            EPOCHS=1 ;;
    webgpt) DATASET=openai/webgpt_comparisons;      EPOCHS=4 ;;
    *) die "TASK must be tldr, hh or webgpt for Gemma 2B PPO (got '$TASK')" ;;
esac
PPO_BATCH=256
ACTOR_LR=1.5e-5
CRITIC_LR=1.5e-5
KL_CTL=${KL_CTL:-0.05}
WARMUP_STEPS=200
read -r -a DATA_PATH <<< "${DATA_PATH:-$DATASET}"

# PPO batch = prompts per GPU x generation batches x GPUs = 32 x 1 x 8 on one node of 8 GPUs, and every
# GPU trains on its 32 experiences in micro-batches of 8 with 4 accumulation steps: 8 x 4 x 8 = 256, so
# actor and critic take one optimizer step per PPO batch.
NUM_GPUS=${NUM_GPUS:-8}
HOSTFILE=${HOSTFILE:-}
if [[ -n "$HOSTFILE" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE '$HOSTFILE' not found"
    NUM_NODES=${NUM_NODES:-$(grep -cE '^[[:space:]]*[^#[:space:]]' "$HOSTFILE" || true)}
fi
NUM_NODES=${NUM_NODES:-1}
WORLD=$((NUM_GPUS * NUM_NODES))
GEN_BATCHES=${GENERATION_BATCHES:-1}
TRAIN_PER_DEVICE=${PER_DEVICE_TRAIN_BATCH:-8}
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

# 2B: actor (and reference) under ZeRO-2; critic and reward model (two copies of the RM) under ZeRO-3.
LOG_FILE=${LOG_FILE:-$OUTPUT/training.log}
mkdir -p "$OUTPUT" "$(dirname "$LOG_FILE")"
"${LAUNCH[@]}" "${LAUNCHER_EXTRA[@]}" "$MAIN" \
    --actor_model_name_or_path "$ACTOR_MODEL_PATH" \
    --critic_model_name_or_path "$CRITIC_MODEL_PATH" \
    --data_path "${DATA_PATH[@]}" \
    --data_split 2,4,4 \
    --data_output_path "${DATA_OUTPUT_PATH:-/tmp/data_files}" \
    --bad_rows "${BAD_ROWS:-skip}" \
    --end_of_conversation_token "<eos>" \
    --num_padding_at_beginning 0 \
    --max_prompt_seq_len 512 \
    --max_answer_seq_len 512 \
    --per_device_generation_batch_size "$GEN_PER_DEVICE" \
    --generation_batches "$GEN_BATCHES" \
    --per_device_training_batch_size "$TRAIN_PER_DEVICE" \
    --gradient_accumulation_steps "$GRAD_ACCUM" \
    --ppo_epochs 1 \
    --num_train_epochs "$EPOCHS" \
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
    --dtype bf16 \
    --print_answers \
    --print_answers_interval 50 \
    --deepspeed \
    --output_dir "$OUTPUT" \
    "${EXTRA[@]}" \
    2>&1 | tee "$LOG_FILE"
