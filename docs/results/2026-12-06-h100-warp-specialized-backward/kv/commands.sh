#!/bin/bash
# Device call H: the warp-specialised dK/dV kernel: the wgmma backward GPU test (every pair), then the
# backward-alone table at three shapes (kv g2w pairs beside the others).
set +e
source .gpu/cuda-env.sh
T0=$(date +%s)
cd fp8-kernels
timeout 200 ../.gpu/tests/fp8-kernels.attention_cuda --ignored --nocapture --test-threads=1 --exact wgmma_backward_matches_cpu_and_mma > $OUT/wgbwd.log 2>&1
echo "wgmma backward test rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "test result|^FAIL|panicked" $OUT/wgbwd.log | head -6
cd ..
for SH in 2 4 6; do timeout 90 .gpu/bin/attention_bench --wgmma --shape $SH --iters 10 > $OUT/bench$SH.log 2>&1; echo "bench $SH rc=$?"; sed -n '/^backward alone/,/^$/p' $OUT/bench$SH.log | grep -E "mma sep|g1n64 |w  " ; done
echo "total $(( $(date +%s) - T0 )) s"
