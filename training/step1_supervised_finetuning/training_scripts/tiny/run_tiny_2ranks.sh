#!/usr/bin/env bash
# Step 1 (SFT) of the embedded tiny model on the embedded synthetic task on two CPU ranks
# (ZeRO-2 by default: gradients and optimizer state partitioned across the ranks).
#
#   bash run_tiny_2ranks.sh [OUTPUT] [ZERO_STAGE]      (defaults ./output/tiny_2ranks/step1 and 2)
#
# The run of run_tiny.sh -- same model, data and hyper-parameters -- on two ranks: the global batch stays
# 16 = 8 per rank x 1 accumulation step x 2 ranks (run_tiny.sh: 8 x 2 x 1).  `deepspeed --num_gpus N` on
# a machine without GPUs starts N CPU ranks over gloo.
#
# Environment overrides: as run_tiny.sh, but NUM_GPUS (ranks per node) defaults to 2.
set -euo pipefail
export NUM_GPUS=${NUM_GPUS:-2}
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_tiny.sh" "${1:-./output/tiny_2ranks/step1}" "${2:-2}"
