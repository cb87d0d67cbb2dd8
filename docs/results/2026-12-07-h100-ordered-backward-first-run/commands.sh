#!/bin/bash
# Call 10: the fused ordered wgmma backward: the wgmma backward GPU test (every pair and the ordered
# kernel: against the CPU and mma.sync, bits repeated), then the backward-alone tables at three shapes.
set +e
source .gpu/cuda-env.sh >/dev/null 2>&1
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
cd fp8-kernels
FP8_KERNELS_POISON_UNINIT=1 timeout 200 ../.gpu/tests/fp8-kernels.attention_cuda --ignored --nocapture --test-threads=1 --exact wgmma_backward_matches_cpu_and_mma > $OUT/wgbwd.log 2>&1
echo "wgmma backward test rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "test result|^FAIL|panicked" $OUT/wgbwd.log | head -8; grep -E "ordered" $OUT/wgbwd.log | grep -v "^ok" | head -5
cd ..
for SH in 6 2 1; do timeout 80 .gpu/bin/attention_bench --wgmma --shape $SH --iters 10 > $OUT/bench$SH.log 2>&1; echo "bench $SH rc=$? ($(( $(date +%s) - T0 )) s)"; sed -n '/^backward alone/,/^$/p' $OUT/bench$SH.log | grep -E "mma |ordered|g2n64w |g1n64 " ; done
echo "total $(( $(date +%s) - T0 )) s"
