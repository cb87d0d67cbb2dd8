#!/bin/bash
# Call 16: the ordered wgmma backward with a writer warp per sdQ tile: GPU test and backward-alone tables.
# (every pair and the ordered kernel, bits repeated), then backward-alone tables at llama-8b (6) and GPT hd64 (1).
set +e
source .gpu/cuda-env.sh >/dev/null 2>&1
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
cd fp8-kernels
FP8_KERNELS_POISON_UNINIT=1 timeout 120 ../.gpu/tests/fp8-kernels.attention_cuda --ignored --nocapture --test-threads=1 --exact wgmma_backward_matches_cpu_and_mma > $OUT/wgbwd.log 2>&1
echo "wgmma backward test rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "test result|^FAIL|panicked" $OUT/wgbwd.log | head -6; tail -5 $OUT/wgbwd.log
cd ..
for SH in 6 1 4; do timeout 60 .gpu/bin/attention_bench --wgmma --shape $SH --iters 10 > $OUT/bench$SH.log 2>&1; echo "bench $SH rc=$? ($(( $(date +%s) - T0 )) s)"; sed -n '/^backward alone/,/^$/p' $OUT/bench$SH.log | grep -E "mma |ordered|g2n64w |g1n64 " ; done
echo "total $(( $(date +%s) - T0 )) s"
