#!/usr/bin/env bash
# DPO of the tiny SFT model on the embedded synthetic task on two CPU ranks (ZeRO-2 by default: gradients
# and optimizer state partitioned across the ranks).
#
#   bash run_tiny_2ranks.sh [OUTPUT] [ZERO_STAGE]      (defaults ./output/tiny_2ranks/step2_dpo and 2)
#
# Otherwise the run of run_tiny.sh -- same data and hyper-parameters -- on two ranks: the global batch stays
# 16 = 8 pairs per rank x 1 accumulation step x 2 ranks (run_tiny.sh: 8 x 2 x 1).
#
# Environment overrides: as run_tiny.sh, but MODEL_PATH defaults to ./output/tiny_2ranks/step1 and
# NUM_GPUS (ranks per node) to 2.
set -euo pipefail
export NUM_GPUS=${NUM_GPUS:-2}
export MODEL_PATH=${MODEL_PATH-./output/tiny_2ranks/step1}  # set but empty: the embedded model
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_tiny.sh" "${1:-./output/tiny_2ranks/step2_dpo}" "${2:-2}"
