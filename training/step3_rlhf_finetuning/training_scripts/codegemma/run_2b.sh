#!/usr/bin/env bash
# Step 3 (MA-PPO) of CodeGemma 2B (google/codegemma-2b) on APPS, Table 5 settings (MA-RLHF,
# Appendix B.2): the SFT model initialises the actor, the reference and the critic; the reward is the
# program's pass rate on the problem's tests (pass@1, a compiler signal), as the code task has no reward
# model.  Macro actions are fixed 10-token n-grams (the released APPS checkpoints are "Fixed10").
#
# That reward does not exist yet: it arrives with the evaluation / code-task work (sandboxed execution of
# generated programs).  Until then this script stops with exit status 3 unless REWARD_SOURCE names another
# reward: REWARD_SOURCE=reward_model with REWARD_MODEL_PATH=<a code reward model> runs it today.
#
#   bash run_2b.sh [OUTPUT] [ACTOR_ZERO_STAGE] [CRITIC_ZERO_STAGE]     (one stage given: both use it)
#
# Environment overrides:
#   TASK               apps (the only task of this family)
#   ACTOR_MODEL_PATH   SFT model (default: step 1's default output ./output/codegemma-2b/apps/step1)
#   CRITIC_MODEL_PATH  critic initialisation (default: the SFT model, as in B.2)
#   REWARD_SOURCE      program_tests (default; not available yet) | reward_model
#   REWARD_MODEL_PATH  the reward model when REWARD_SOURCE=reward_model
#   TERMINATION        macro-action rule: fixed (default) | randomized | ppl | parsing | word
#   NGRAM              n of the fixed rule (default 10; 1 = vanilla PPO, inf = one action per answer)
#   KL_CTL             KL coefficient (default: Table 5)
#   DATA_PATH          --data_path value(s), space-separated (default codeparrot/apps; a local copy is
#                      codeparrot/apps:/data/APPS with train/ and test/ problem folders)
#   DATA_OUTPUT_PATH   tokenized-data cache (default /tmp/data_files)
#   NUM_GPUS           GPUs per node (default 8)     NUM_NODES  nodes (default 1, or the hosts in HOSTFILE)
#   HOSTFILE           DeepSpeed hostfile of a multi-node run     MASTER_PORT  (default 29500)
#   PER_DEVICE_TRAIN_BATCH  experiences per GPU per PPO micro-batch (default 2)
#   GENERATION_BATCHES      prompt batches generated per PPO step (default 1); the PPO batch stays 16
#   BAD_ROWS           skip (default: over-long prompts are dropped and counted in the log) | error
#   LAUNCHER_ARGS      extra `deepspeed` launcher options, e.g. "--no_ssh --node_rank 1 --master_addr A"
#   EXTRA_ARGS         appended verbatim to main.py's flags (later flags win), e.g. "--max_steps 10";
#                      on GPUs "--enable_hybrid_engine" speeds up generation
#   LOG_FILE           where the output is also written (default $OUTPUT/training.log)
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }

TASK=${TASK:-apps}
[[ "$TASK" == apps ]] || die "TASK must be apps for CodeGemma (got '$TASK')"
REWARD_SOURCE=${REWARD_SOURCE:-program_tests}
case "$REWARD_SOURCE" in
    program_tests)
        echo "error: the APPS compiler-signal reward (pass@1 of the generated program on the problem's" >&2
        echo "  tests, paper B.2) is not implemented yet: it arrives with the evaluation/code-task work." >&2
        echo "  To run this configuration now: REWARD_SOURCE=reward_model REWARD_MODEL_PATH=<code RM>." >&2
        exit 3 ;;
    reward_model)
        REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-}
        [[ -n "$REWARD_MODEL_PATH" ]] || die "REWARD_SOURCE=reward_model needs REWARD_MODEL_PATH"
        REWARD_ARGS=(--reward_source reward_model --reward_model_name_or_path "$REWARD_MODEL_PATH") ;;
    *) die "REWARD_SOURCE must be program_tests or reward_model (got '$REWARD_SOURCE')" ;;
esac
OUTPUT=${1:-./output/codegemma-2b/apps/step3}
ACTOR_ZERO_STAGE=${2:-2}
CRITIC_ZERO_STAGE=${3:-${2:-3}}
ACTOR_MODEL_PATH=${ACTOR_MODEL_PATH:-./output/codegemma-2b/apps/step1}
CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH:-$ACTOR_MODEL_PATH}
TERMINATION=${TERMINATION:-fixed}
NGRAM=${NGRAM:-10}

# Table 5, CodeGemma 2B, PPO: batch 16; actor lr 5e-7, critic lr 5e-5; 1 epoch; 1 PPO epoch per
# rollout; clip 0.2; GAE lambda 0.95, gamma 1; KL 0.05; prompts <= 600, answers <= 512 tokens; 20 warmup
# steps (cosine after them); temperature 1.0, top-p 1.0, top-k 5.  B.2: PPO uses 80% of APPS (2,0,8).
EPOCHS=1
PPO_BATCH=16
ACTOR_LR=5e-7
CRITIC_LR=5e-5
KL_CTL=${KL_CTL:-0.05}
WARMUP_STEPS=20
read -r -a DATA_PATH <<< "${DATA_PATH:-codeparrot/apps}"

# PPO batch = prompts per GPU x generation batches x GPUs = 2 x 1 x 8 on one node of 8 GPUs, and every
# GPU trains on its 2 experiences in one micro-batch: 2 x 1 x 8 = 16, so actor and critic take one
# optimizer step per PPO batch.
NUM_GPUS=${NUM_GPUS:-8}
HOSTFILE=${HOSTFILE:-}
if [[ -n "$HOSTFILE" ]]; then
    [[ -f "$HOSTFILE" ]] || die "HOSTFILE '$HOSTFILE' not found"
    NUM_NODES=${NUM_NODES:-$(grep -cE '^[[:space:]]*[^#[:space:]]' "$HOSTFILE" || true)}
fi
NUM_NODES=${NUM_NODES:-1}
WORLD=$((NUM_GPUS * NUM_NODES))
GEN_BATCHES=${GENERATION_BATCHES:-1}
TRAIN_PER_DEVICE=${PER_DEVICE_TRAIN_BATCH:-2}
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

# 2B: actor (and reference) under ZeRO-2; critic under ZeRO-3.
LOG_FILE=${LOG_FILE:-$OUTPUT/training.log}
mkdir -p "$OUTPUT" "$(dirname "$LOG_FILE")"
"${LAUNCH[@]}" "${LAUNCHER_EXTRA[@]}" "$MAIN" \
    --actor_model_name_or_path "$ACTOR_MODEL_PATH" \
    --critic_model_name_or_path "$CRITIC_MODEL_PATH" \
    --data_path "${DATA_PATH[@]}" \
    --data_split 2,0,8 \
    --data_output_path "${DATA_OUTPUT_PATH:-/tmp/data_files}" \
    --bad_rows "${BAD_ROWS:-skip}" \
    --end_of_conversation_token "<eos>" \
    --num_padding_at_beginning 0 \
    --max_prompt_seq_len 600 \
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
    --temperature 1.0 \
    --top_k 5 \
    --top_p 1.0 \
    --termination_condition "$TERMINATION" \
    --ngram "$NGRAM" \
    --value_function equal \
    --response_kind code \
    "${REWARD_ARGS[@]}" \
    --actor_zero_stage "$ACTOR_ZERO_STAGE" \
    --critic_zero_stage "$CRITIC_ZERO_STAGE" \
    --actor_dropout 0.0 \
    --critic_dropout 0.0 \
    --dtype bf16 \
    --print_answers \
    --print_answers_interval 20 \
    --deepspeed \
    --output_dir "$OUTPUT" \
    "${EXTRA[@]}" \
    2>&1 | tee "$LOG_FILE"
