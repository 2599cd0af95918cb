# shellcheck shell=bash
# What every launch script under training/step*/training_scripts and training/multi_node shares, written
# once: the task -> dataset table, world size and gradient-accumulation arithmetic, the flags each step
# hands to its main.py, and the `deepspeed` launch with EXTRA_ARGS and the log.  Sourced, never run:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/../../../launch_common.sh"
#   text_task "Gemma 7B SFT"              # or code_task / tiny_task: TASK, DATASET, split, lengths
#   OUTPUT=${1:-...}; LR=2e-5; ...        # that size's hyper-parameters (Table 5, MA-RLHF Appendix B.2)
#   run_step 1                            # 1 = SFT, 2 = reward model, 3 = MA-PPO, dpo = DPO (step 2's alternative)
#
# The environment variables a user sets are listed in
# training/step1_supervised_finetuning/training_scripts/README.md ("Environment variables").
# A bad setting stops the script before anything is launched, with status 2; a launch exits with
# deepspeed's status.

TRAINING_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STEP_DIRS=([1]=step1_supervised_finetuning [2]=step2_reward_model_finetuning [3]=step3_rlhf_finetuning)

die() { echo "error: $*" >&2; exit 2; }

# ----------------------------------------------------------------------------- what a size script sets
# Required, set by every size script before run_step:
#   steps 1-2  OUTPUT, ZERO_STAGE, MODEL_PATH, GLOBAL_BATCH, EPOCHS, LR, PER_DEVICE (micro-batch per device)
#   dpo        as steps 1-2, and BETA (DPO's β)
#   step 3     OUTPUT, ACTOR_ZERO_STAGE, CRITIC_ZERO_STAGE, ACTOR_MODEL_PATH, CRITIC_MODEL_PATH, PPO_BATCH,
#              EPOCHS, ACTOR_LR, CRITIC_LR, KL_CTL, WARMUP_STEPS, TRAIN_PER_DEVICE (experiences per device
#              per PPO micro-batch)
# Those that are not user overrides are unset here, so that a script forgetting one fails by name under
# `set -u` instead of silently taking a value from the caller's environment.
unset -v OUTPUT EPOCHS ZERO_STAGE GLOBAL_BATCH LR PER_DEVICE ACTOR_ZERO_STAGE CRITIC_ZERO_STAGE PPO_BATCH \
    ACTOR_LR CRITIC_LR WARMUP_STEPS TRAIN_PER_DEVICE DATASET DATA_SPLIT PROMPT_LEN ANSWER_LEN BETA
# Optional, with the value most scripts use.  Assigned here rather than read from the environment: only the
# documented variables are overrides, so a stray exported DTYPE or OFFLOAD cannot change a run.
EOS_TOKEN=""               # a hub model's end-of-text token; "" (tiny) keeps main.py's token and strict rows
GRADIENT_CHECKPOINTING=0   # 1 from 7B
OFFLOAD=0                  # 1 at 27B: ZeRO-3 CPU offload (step 3: of the frozen reference model too)
DTYPE=bf16
WARMUP_RATIO=0.1           # steps 1-2
WEIGHT_DECAY=0.0           # steps 1-2: --weight_decay (AdamW's decoupled decay)
MAX_EVAL_SAMPLES=""        # "" = main.py's default
MAX_STEPS=""               # step 3; "" = no cap
TEMPERATURE=0.8            # step 3 sampling: Table 5's text tasks (top-p is 1.0 everywhere)
TOP_K=50
LR_SCHEDULE=cosine         # --lr_scheduler_type of every step (Table 5: cosine)
PRINT_INTERVAL=50          # step 3: PPO steps between printed sample answers
PPO_TASK_ARGS=()           # step 3: the task's own flags (code: see code_reward)
LIKELIHOOD_TERM=0          # step 2: 1 = --likelihood_term (the score adds α·Σ log p(answer))
LIKELIHOOD_NORM=sum        # step 2 with the term: sum (α·Σ log p) or mean (α·mean log p, no length bias)
LIKELIHOOD_SCALE=1         # step 2 with the term: α at the start
ADV_ESTIMATOR=""           # step 3: --advantage_estimator; "" = main.py's gae (MA-PPO with a critic)
WHITEN_ADVANTAGES=0        # step 3: 1 = --whiten_advantages
CLIP_REWARD=""             # step 3: --clip_reward_value; "" = main.py's (DeepSpeed-Chat's 5)
SAMPLES_PER_PROMPT=1       # step 3: answers per prompt (K of RLOO / GRPO); PPO_BATCH counts answers
DEVICE=GPU                 # what one rank is called in error messages

# -------------------------------------------------------------------------------------------- the tasks
# task_values NAME: the task registry's view of a task (marlhf/tasks.py, marlhf/applications/<task>/task.json):
# its name, default dataset, data split and lengths, as shell assignments.
task_values() {
    local values
    values=$(python -m marlhf.tasks "$1") || die "no task '$1' in the task registry (marlhf/applications/*/task.json)"
    eval "$values"
}

# text_task LABEL: TASK (default tldr) must be one of the paper's text tasks (by name or alias); LABEL names the
# script in the error.  B.2: the data is split 20% SFT / 40% reward model / 40% PPO; prompts <= 512, answers <= 512
# tokens (the tasks' launch values).
text_task() {
    TASK=${TASK:-tldr}
    case "$TASK" in
        tldr|hh|webgpt) task_values "$TASK" ;;
        *) die "TASK must be tldr, hh or webgpt for $1 (got '$TASK')" ;;
    esac
}

# code_task: APPS, the CodeGemma scripts' only task.  B.2: no preference pairs, hence no step 2 and a
# 20% SFT / 80% PPO split (the same in steps 1 and 3, so the shares stay disjoint); prompts <= 600 tokens.
code_task() {
    TASK=${TASK:-apps}
    [[ "$TASK" == apps ]] || die "TASK must be apps for CodeGemma (got '$TASK')"
    task_values "$TASK"
}

# tiny_task: the embedded synthetic task (a miniature TL;DR) of the tiny scripts, sized for 2 CPU cores:
# prompts <= 192 and answers <= 64 tokens, fp32, every "GPU" a CPU rank over gloo.
tiny_task() {
    TASK=${TASK:-synthetic}
    [[ "$TASK" == synthetic ]] \
        || die "tiny scripts run the synthetic task, not TASK=$TASK; set DATA_PATH instead"
    task_values synthetic
    DTYPE=fp32 DEVICE=rank
}

# tiny_code_task: the generated code task of the tiny code scripts (synthetic_code: one-line arithmetic
# problems with unit tests in APPS layout, the CodeGemma scripts' task in miniature), sized for 2 CPU cores:
# B.2's 20% SFT / 80% PPO split of 2000 problems over the first two formulas with constants <= 3 (so the tiny
# model learns the program shapes and constants in ~1.5 minutes), prompts <= 128 and answers <= 48 tokens,
# fp32.  Half of the demonstrations carry a bug (flaw_rate: the result off by one), as scraped solutions do:
# the SFT policy writes it too, and step 3's program tests are what teach the policy to drop it.
tiny_code_task() {
    TASK=${TASK:-synthetic_code}
    [[ "$TASK" == synthetic_code ]] \
        || die "tiny code scripts run the synthetic_code task, not TASK=$TASK; set DATA_PATH instead"
    task_values synthetic_code
    DTYPE=fp32 DEVICE=rank
}

# by_task tldr=V1 hh=V2 webgpt=V3: the value listed for $TASK, for Table 5 rows that differ by task.
by_task() {
    local pair
    for pair in "$@"; do
        if [[ "${pair%%=*}" == "$TASK" ]]; then echo "${pair#*=}"; return; fi
    done
    die "no value for TASK=$TASK among: $*"
}

# code_reward: the APPS reward of B.2/B.5 is the compiler signal of the generated program run against the
# problem's tests in a sandbox (--reward_source program_tests; REWARD_WORKERS parallel test processes per
# rank, default 1): no reward model, the critic starts from the SFT model.  REWARD_SOURCE=reward_model with
# REWARD_MODEL_PATH scores with a code reward model instead.  Sets PPO_TASK_ARGS.
code_reward() {
    REWARD_SOURCE=${REWARD_SOURCE:-program_tests}
    case "$REWARD_SOURCE" in
        program_tests)
            REWARD_WORKERS=${REWARD_WORKERS:-1}
            [[ "$REWARD_WORKERS" =~ ^[1-9][0-9]*$ ]] \
                || die "REWARD_WORKERS must be a positive integer (got '$REWARD_WORKERS')"
            PPO_TASK_ARGS=(--response_kind code
                           --reward_source program_tests --reward_workers "$REWARD_WORKERS") ;;
        reward_model)
            REWARD_MODEL_PATH=${REWARD_MODEL_PATH:-}
            [[ -n "$REWARD_MODEL_PATH" ]] || die "REWARD_SOURCE=reward_model needs REWARD_MODEL_PATH"
            PPO_TASK_ARGS=(--response_kind code
                           --reward_source reward_model --reward_model_name_or_path "$REWARD_MODEL_PATH") ;;
        *) die "REWARD_SOURCE must be program_tests or reward_model (got '$REWARD_SOURCE')" ;;
    esac
}

# ----------------------------------------------------------------------------- world size and batches
# hostfile_hosts FILE: the hosts of a DeepSpeed hostfile (its lines that are neither blank nor comments).
hostfile_hosts() { grep -cE '^[[:space:]]*[^#[:space:]]' "$1" || true; }

# visible_gpus: the GPUs of this machine (nvidia-smi's list, within CUDA_VISIBLE_DEVICES when set); 0 without
# nvidia-smi.
visible_gpus() {
    local n=0
    if command -v nvidia-smi > /dev/null 2>&1; then n=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true); fi
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        local -a ids
        IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
        if (( ${#ids[@]} < n )); then n=${#ids[@]}; fi
    fi
    echo "$n"
}

# check_gpus NUM_GPUS_GIVEN: more ranks per node than this machine has GPUs stop here, saying so.  Without a GPU,
# DeepSpeed starts CPU ranks over gloo: the tiny scripts (DEVICE=rank) are made for that; a GPU script does it only
# when NUM_GPUS was given (the user asked for that many CPU ranks).  With a HOSTFILE the ranks run on its nodes.
check_gpus() {
    local given=$1 gpus
    [[ -z "$HOSTFILE" ]] || return 0
    gpus=$(visible_gpus)
    if (( gpus == 0 )) && [[ "$DEVICE" == GPU && -z "$given" ]]; then
        die "this machine has no GPU and this script starts NUM_GPUS=$NUM_GPUS GPU ranks (the default): set" \
            "NUM_GPUS=N to start N DeepSpeed CPU ranks over gloo anyway (slow), or run the tiny scripts"
    fi
    if (( gpus > 0 && NUM_GPUS > gpus )); then
        die "NUM_GPUS=$NUM_GPUS ${DEVICE}s asked for and this machine has $gpus GPUs: set NUM_GPUS=$gpus (the" \
            "global batch is kept by gradient accumulation)"
    fi
}

# resolve_world: WORLD = NUM_GPUS (per node, default 8) x nodes (NUM_NODES, else the hosts in HOSTFILE,
# else 1), after check_gpus.
resolve_world() {
    local given=${NUM_GPUS:-}
    NUM_GPUS=${NUM_GPUS:-8}
    HOSTFILE=${HOSTFILE:-}
    if [[ -n "$HOSTFILE" ]]; then
        [[ -f "$HOSTFILE" ]] || die "HOSTFILE '$HOSTFILE' not found"
        NUM_NODES=${NUM_NODES:-$(hostfile_hosts "$HOSTFILE")}
    fi
    NUM_NODES=${NUM_NODES:-1}
    WORLD=$((NUM_GPUS * NUM_NODES))
    check_gpus "$given"
}

# grad_accum GLOBAL PER_DEVICE: sets GRAD_ACCUM so that GLOBAL = PER_DEVICE x GRAD_ACCUM x WORLD.  Table 5's
# batches are global: another GPU count changes the accumulation, never the batch (or stops the script).
grad_accum() {
    local batch=$1 micro=$2
    (( WORLD > 0 && batch % (micro * WORLD) == 0 )) \
        || die "global batch $batch is not a multiple of PER_DEVICE_BATCH $micro x $WORLD ${DEVICE}s"
    GRAD_ACCUM=$((batch / (micro * WORLD)))
}

# ppo_batches PPO_BATCH GEN_BATCHES TRAIN_PER_DEVICE: sets GEN_PER_DEVICE, the prompts each device generates
# per batch, and GRAD_ACCUM, so that actor and critic take one optimizer step per PPO batch of answers, K =
# SAMPLES_PER_PROMPT of each prompt:
#   PPO_BATCH = GEN_PER_DEVICE x K x GEN_BATCHES x WORLD = TRAIN_PER_DEVICE x GRAD_ACCUM x WORLD.
ppo_batches() {
    local batch=$1 chunks=$2 micro=$3 k=$SAMPLES_PER_PROMPT
    (( WORLD > 0 && batch % (WORLD * chunks * k) == 0 )) \
        || die "PPO batch $batch is not a multiple of $WORLD ${DEVICE}s x GENERATION_BATCHES $chunks x $k answers per prompt"
    GEN_PER_DEVICE=$((batch / (WORLD * chunks * k)))
    (( GEN_PER_DEVICE * k % micro == 0 )) \
        || die "$((GEN_PER_DEVICE * k)) answers per $DEVICE: not a multiple of PER_DEVICE_TRAIN_BATCH $micro"
    GRAD_ACCUM=$((GEN_PER_DEVICE * k * chunks / micro))
}

# --------------------------------------------------------------------------------------------- the flags
# They build FLAGS, main.py's flags in the order the scripts always passed them.

# data_flags: the task, its dataset(s) (DATA_PATH, space-separated, default the task's), split and cache; hub models
# also skip over-long rows (BAD_ROWS, default skip: dropped and counted in the log) and end every answer
# with their own end-of-text token.
data_flags() {
    local -a data_path
    read -r -a data_path <<< "${DATA_PATH:-$DATASET}"
    FLAGS+=(--data_path "${data_path[@]}" --task "$TASK_NAME" --data_split "$DATA_SPLIT"
            --data_output_path "${DATA_OUTPUT_PATH:-/tmp/data_files}")
    if [[ -n "$EOS_TOKEN" ]]; then
        FLAGS+=(--bad_rows "${BAD_ROWS:-skip}" --end_of_conversation_token "$EOS_TOKEN")
    fi
    FLAGS+=(--num_padding_at_beginning 0)
}

# supervised_flags: steps 1 and 2 take the same flags (the RM's batch counts pairs); an empty MODEL_PATH
# means main.py's embedded tiny model.
supervised_flags() {
    FLAGS=()
    if [[ -n "$MODEL_PATH" ]]; then FLAGS+=(--model_name_or_path "$MODEL_PATH"); fi
    data_flags
    FLAGS+=(--max_seq_len $((PROMPT_LEN + ANSWER_LEN)))
    if [[ -n "$MAX_EVAL_SAMPLES" ]]; then FLAGS+=(--max_eval_samples "$MAX_EVAL_SAMPLES"); fi
    FLAGS+=(--per_device_train_batch_size "$PER_DEVICE" --per_device_eval_batch_size "$PER_DEVICE"
            --gradient_accumulation_steps "$GRAD_ACCUM" --learning_rate "$LR" --weight_decay "$WEIGHT_DECAY"
            --num_train_epochs "$EPOCHS" --lr_scheduler_type "$LR_SCHEDULE" --warmup_ratio "$WARMUP_RATIO"
            --zero_stage "$ZERO_STAGE" --group_by_length)
    if (( OFFLOAD )); then FLAGS+=(--offload); fi
    if (( GRADIENT_CHECKPOINTING )); then FLAGS+=(--gradient_checkpointing); fi
    FLAGS+=(--dtype "$DTYPE" --deepspeed --output_dir "$OUTPUT")
}

# ppo_flags: step 3.  The values every size shares are Table 5's: 1 PPO epoch per rollout, clip 0.2 (policy
# and value), gamma 1, GAE lambda 0.95, top-p 1.0, cosine schedule, no weight decay or dropout (dropout 0
# keeps the PPO ratios exact).  MA-PPO over fixed 5-grams unless TERMINATION / NGRAM say otherwise
# (section 3.2; NGRAM=1 is vanilla PPO).  An empty model path means the embedded tiny model.
ppo_flags() {
    FLAGS=()
    if [[ -n "$ACTOR_MODEL_PATH" ]]; then FLAGS+=(--actor_model_name_or_path "$ACTOR_MODEL_PATH"); fi
    if [[ -n "$CRITIC_MODEL_PATH" ]]; then FLAGS+=(--critic_model_name_or_path "$CRITIC_MODEL_PATH"); fi
    data_flags
    FLAGS+=(--max_prompt_seq_len "$PROMPT_LEN" --max_answer_seq_len "$ANSWER_LEN")
    if [[ -n "$MAX_EVAL_SAMPLES" ]]; then FLAGS+=(--max_eval_samples "$MAX_EVAL_SAMPLES"); fi
    FLAGS+=(--per_device_generation_batch_size "$GEN_PER_DEVICE" --generation_batches "$GEN_BATCHES"
            --per_device_training_batch_size "$TRAIN_PER_DEVICE" --gradient_accumulation_steps "$GRAD_ACCUM"
            --ppo_epochs 1 --num_train_epochs "$EPOCHS")
    if [[ -n "$MAX_STEPS" ]]; then FLAGS+=(--max_steps "$MAX_STEPS"); fi
    FLAGS+=(--actor_learning_rate "$ACTOR_LR" --critic_learning_rate "$CRITIC_LR"
            --actor_weight_decay 0.0 --critic_weight_decay 0.0
            --lr_scheduler_type "$LR_SCHEDULE" --num_warmup_steps "$WARMUP_STEPS"
            --kl_ctl "$KL_CTL" --cliprange 0.2 --cliprange_value 0.2 --gamma 1.0 --lam 0.95
            --temperature "$TEMPERATURE" --top_k "$TOP_K" --top_p 1.0
            --termination_condition "${TERMINATION:-fixed}" --ngram "${NGRAM:-5}" --value_function equal
            "${PPO_TASK_ARGS[@]}")
    if [[ -n "$ADV_ESTIMATOR" ]]; then FLAGS+=(--advantage_estimator "$ADV_ESTIMATOR"); fi
    if (( WHITEN_ADVANTAGES )); then FLAGS+=(--whiten_advantages); fi
    if [[ -n "$CLIP_REWARD" ]]; then FLAGS+=(--clip_reward_value "$CLIP_REWARD"); fi
    if (( SAMPLES_PER_PROMPT > 1 )); then FLAGS+=(--num_samples_per_prompt "$SAMPLES_PER_PROMPT"); fi
    FLAGS+=(--actor_zero_stage "$ACTOR_ZERO_STAGE" --critic_zero_stage "$CRITIC_ZERO_STAGE")
    # a model that needs parameter offload does not fit whole on one GPU: fetch ZeRO-3 layers per token
    if (( OFFLOAD )); then FLAGS+=(--offload --offload_reference_model --zero3_generation synced); fi
    if (( GRADIENT_CHECKPOINTING )); then
        FLAGS+=(--actor_gradient_checkpointing --critic_gradient_checkpointing)
    fi
    FLAGS+=(--actor_dropout 0.0 --critic_dropout 0.0 --dtype "$DTYPE"
            --print_answers --print_answers_interval "$PRINT_INTERVAL" --deepspeed --output_dir "$OUTPUT")
}

# dpo_flags: DPO on the reward model's pairs takes steps 1-2's flags (the batch counts pairs), then β and the
# loss (DPO_LOSS: sigmoid, the default, or ipo); the frozen reference is main.py's default, the SFT model.
dpo_flags() {
    supervised_flags
    FLAGS+=(--beta "$BETA" --dpo_loss "${DPO_LOSS:-sigmoid}")
}

# ---------------------------------------------------------------------------------------------- launch
# deepspeed_launcher: the `deepspeed` runner installed beside the python these scripts run (an environment's bin/
# need not be on PATH for it), else the first on PATH.
deepspeed_launcher() {
    local python
    python=$(command -v python) || die "no python on PATH: activate the environment marlhf is installed in"
    if [[ -x "$(dirname "$python")/deepspeed" ]]; then
        echo "$(dirname "$python")/deepspeed"
    else
        command -v deepspeed || die "deepspeed: not found beside $python nor on PATH (pip install deepspeed there)"
    fi
}

# run_main MAIN_PY OUTPUT FLAG...: `deepspeed --num_gpus N --master_port P [--hostfile H --num_nodes M]
# LAUNCHER_ARGS MAIN_PY FLAG... EXTRA_ARGS` (EXTRA_ARGS last, so its flags win), after resolve_world.  The
# output goes to the terminal and LOG_FILE (default OUTPUT/training.log); with `set -o pipefail` in the
# script, tee does not hide the launcher's exit status.
# LAUNCHER=auto (the default) starts a run of one local process (WORLD 1, no HOSTFILE, no LAUNCHER_ARGS) as
# `python -u MAIN_PY FLAG... EXTRA_ARGS` instead: for one rank the runner and its launch.py are two more
# Python processes importing torch and DeepSpeed (5 s a step on a 2-core Xeon: 7.1 s to start against
# 2.1 s) and add nothing, as main.py fills in the rank variables itself (marlhf.utils.dist.init_distributed;
# MASTER_PORT is passed on when set).  LAUNCHER=deepspeed always uses the runner.
run_main() {
    local main=$1 out_dir=$2 runner
    shift 2
    runner=$(deepspeed_launcher) || exit 2
    local -a launch=("$runner" --num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}")
    if [[ -n "$HOSTFILE" ]]; then launch+=(--hostfile "$HOSTFILE" --num_nodes "$NUM_NODES"); fi
    local -a launcher_extra extra
    read -r -a launcher_extra <<< "${LAUNCHER_ARGS:-}"
    read -r -a extra <<< "${EXTRA_ARGS:-}"
    case "${LAUNCHER:=auto}" in
        auto) if (( WORLD == 1 )) && [[ -z "$HOSTFILE" && ${#launcher_extra[@]} == 0 ]]; then
                  launch=(python -u)
                  # as the runner does: the working directory first on PYTHONPATH
                  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
                  if [[ -n "${MASTER_PORT:-}" ]]; then export MASTER_PORT; fi
              fi ;;
        deepspeed) ;;
        *) die "LAUNCHER must be auto or deepspeed (got '$LAUNCHER')" ;;
    esac
    LOG_FILE=${LOG_FILE:-$out_dir/training.log}
    mkdir -p "$out_dir" "$(dirname "$LOG_FILE")"
    launch+=("${launcher_extra[@]}" "$main")
    echo "launch: ${launch[*]}" | tee "$LOG_FILE"
    "${launch[@]}" "$@" "${extra[@]}" 2>&1 | tee -a "$LOG_FILE"
}

# run_step 1|2|3|dpo: the batch arithmetic, that step's flags from the size script's variables, and the
# launch of training/step<k>_*/main.py (dpo: training/step2_dpo_finetuning/main.py).  GENERATION_BATCHES
# (step 3, default 1) splits a PPO batch's generation.
run_step() {
    resolve_world
    local dir=step2_dpo_finetuning
    case "$1" in
        1|2) grad_accum "$GLOBAL_BATCH" "$PER_DEVICE"
             dir=${STEP_DIRS[$1]}
             supervised_flags
             if [[ "$1" == 2 ]] && (( LIKELIHOOD_TERM )); then
                 FLAGS+=(--likelihood_term --likelihood_norm "$LIKELIHOOD_NORM" --likelihood_scale "$LIKELIHOOD_SCALE")
             fi ;;
        dpo) grad_accum "$GLOBAL_BATCH" "$PER_DEVICE"
             dpo_flags ;;
        3)   GEN_BATCHES=${GENERATION_BATCHES:-1}
             dir=${STEP_DIRS[3]}
             ppo_batches "$PPO_BATCH" "$GEN_BATCHES" "$TRAIN_PER_DEVICE"
             ppo_flags ;;
        *)   die "run_step: no step '$1'" ;;
    esac
    # a model or dataset that cannot be had (no network, a wrong or gated name, a missing folder) stops here,
    # once, naming it and how to pass a local copy: not in every rank after the launch (marlhf/preflight.py)
    local -a extra
    read -r -a extra <<< "${EXTRA_ARGS:-}"
    python -m marlhf.preflight "${FLAGS[@]}" "${extra[@]}" || exit 2
    run_main "$TRAINING_DIR/$dir/main.py" "$OUTPUT" "${FLAGS[@]}"
}
