#!/usr/bin/env bash
# Per-kernel GPU time of a training step, on the GPU machine (Nsight Compute, clocks and caches left as
# they are):
#   bash scripts/kernel-times.sh OUT_PREFIX BINARY ARGS...
# e.g. bash scripts/kernel-times.sh $OUT/llama-1b-2l .bench/bin/lm_fsdp --speed --speed-steps 1 \
#        --device cuda --preset llama-1b --layers 2 --batch-size 4 --seq-len 4096 --grad-shards bf16
# Writes OUT_PREFIX.csv (every launch), OUT_PREFIX.app.log (the program's output) and OUT_PREFIX.md (the last step's kernels by category and name,
# scripts/kernel_times.py). Profile few steps: ncu serialises every launch.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
prefix=$1
shift
command -v ncu > /dev/null || { echo "kernel-times.sh: ncu is not on the PATH" >&2; exit 2; }
mkdir -p "$(dirname "$prefix")"
ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw \
  --log-file "$prefix.csv" "$@" > "$prefix.app.log" 2>&1
python3 "$(dirname "${BASH_SOURCE[0]}")/kernel_times.py" "$prefix.csv" | tee "$prefix.md"
