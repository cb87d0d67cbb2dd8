#!/bin/bash
# Device call I: every attention GPU test and the GPT and Llama CUDA-vs-CPU training-step tests with the
# warp-specialised defaults; then the forward- and backward-alone tables of two builds that differ only in
# the warp-specialised kernels' stage count (2, the committed one; 3), at three shapes.
set +e
source .gpu/cuda-env.sh
T0=$(date +%s)
GPU_TEST_TIMEOUT=200 bash scripts/gpu-tests.sh run "attention_cuda|llama_cuda|gpt_cuda" > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$? ($(( $(date +%s) - T0 )) s)"; tail -16 $OUT/gpu-tests.log
for B in attention_bench attention_bench_st3; do
  for SH in 2 4 6; do timeout 60 .gpu/bin/$B --wgmma --shape $SH --iters 10 > $OUT/$B-$SH.log 2>&1
    echo "$B shape $SH rc=$?"; grep -E "g2n128w|g2n64  |kv g2w q g1n64 |kv g2w q g2n64w" $OUT/$B-$SH.log | grep -v "^B.* default\|atomic\|det\.\|fwd+mma"
  done
done
echo "total $(( $(date +%s) - T0 )) s"
