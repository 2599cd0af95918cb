#!/usr/bin/env bash
# Step 1 (SFT) of Gemma 7B over two nodes of 8 GPUs: the Table 5 configuration of
# training/step1_supervised_finetuning/training_scripts/gemma/run_7b.sh (MA-RLHF, Appendix B.2), launched
# over a DeepSpeed hostfile.  The global batch stays 128 = 4 per GPU x 2 accumulation steps x 16 GPUs
# (run_7b.sh derives the accumulation from the number of hosts in the hostfile and NUM_GPUS per host).
#
#   bash run_gemma_7b_2nodes.sh [OUTPUT] [ZERO_STAGE]
#
# With ssh (default): run it once, on the first host; DeepSpeed's pdsh launcher starts the ranks of every
# host in HOSTFILE over passwordless ssh.
#
# Without ssh: one launcher per node, each given its node rank and the first node's address --
#   node 0:  NO_SSH=1 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29600 bash run_gemma_7b_2nodes.sh OUT
#   node 1:  NO_SSH=1 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29600 bash run_gemma_7b_2nodes.sh OUT
# which runs `deepspeed --hostfile H --no_ssh --node_rank 0|1 --master_addr A --master_port P main.py ...`.
# Each node then logs to OUT/training.node<rank>.log, so nodes sharing a file system keep separate logs.
#
# Simulating the two nodes on one machine (no GPU needed: every "GPU" is a CPU rank over gloo) with a
# two-host hostfile of one slot each, the embedded tiny model, and a few steps:
#   printf 'node0 slots=1\nnode1 slots=1\n' > /tmp/hostfile2
#   export HOSTFILE=/tmp/hostfile2 NUM_GPUS=1 NO_SSH=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29600
#   python -m marlhf.embedded --json > /tmp/embedded.json      # builds the tiny model once; prints paths
#   export MODEL_PATH=$(python -c 'import json; print(json.load(open("/tmp/embedded.json"))["model_dir"])')
#   export EXTRA_ARGS="--data_path synthetic --dtype fp32 --end_of_conversation_token <|endoftext|>
#       --max_seq_len 256 --per_device_train_batch_size 4 --gradient_accumulation_steps 1 --max_steps 3"
#   NODE_RANK=1 bash run_gemma_7b_2nodes.sh /tmp/sim2 &
#   NODE_RANK=0 bash run_gemma_7b_2nodes.sh /tmp/sim2; wait
#
# Environment overrides: HOSTFILE (default training/multi_node/hostfile, see hostfile.example), NO_SSH,
# NODE_RANK, MASTER_ADDR, MASTER_PORT (default 29500), and everything run_7b.sh takes (TASK, MODEL_PATH,
# DATA_PATH, NUM_GPUS, PER_DEVICE_BATCH, LAUNCHER_ARGS, EXTRA_ARGS, ...).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=SCRIPTDIR/../launch_common.sh
source "$HERE/../launch_common.sh"  # die, hostfile_hosts
STEP1_7B="$HERE/../step1_supervised_finetuning/training_scripts/gemma/run_7b.sh"

HOSTFILE=${HOSTFILE:-$HERE/hostfile}
[[ -f "$HOSTFILE" ]] || die "no hostfile $HOSTFILE: copy hostfile.example there (your nodes) or set HOSTFILE"
NUM_NODES=${NUM_NODES:-$(hostfile_hosts "$HOSTFILE")}
(( NUM_NODES >= 2 )) || die "$HOSTFILE lists $NUM_NODES host(s); a multi-node run needs at least 2"
export HOSTFILE NUM_NODES

# Launcher options of this mode, put before any LAUNCHER_ARGS the caller passes.
MODE_ARGS=()
if [[ "${NO_SSH:-0}" == 1 || -n "${NODE_RANK:-}" ]]; then
    [[ -n "${NODE_RANK:-}" ]] || die "NO_SSH=1 needs NODE_RANK (0 .. $((NUM_NODES - 1))) on each node"
    [[ -n "${MASTER_ADDR:-}" ]] || die "NO_SSH=1 needs MASTER_ADDR: node 0's address (127.0.0.1 to simulate)"
    MODE_ARGS=(--no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR")
    OUTPUT=${1:-./output/gemma-7b/${TASK:-tldr}/step1}
    export LOG_FILE=${LOG_FILE:-$OUTPUT/training.node$NODE_RANK.log}
elif [[ -n "${MASTER_ADDR:-}" ]]; then
    MODE_ARGS=(--master_addr "$MASTER_ADDR")
fi
export LAUNCHER_ARGS="${MODE_ARGS[*]} ${LAUNCHER_ARGS:-}"

exec bash "$STEP1_7B" "$@"
