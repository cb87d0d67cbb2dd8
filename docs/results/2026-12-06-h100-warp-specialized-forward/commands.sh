#!/bin/bash
# Device call F: the warp-specialised (TMA, mbarrier) wgmma forward: the wgmma forward GPU test (every
# variant against the CPU and the mma.sync forward), then the forward-alone table at three shapes.
set +e
source .gpu/cuda-env.sh
T0=$(date +%s)
cd fp8-kernels
timeout 120 ../.gpu/tests/fp8-kernels.attention_cuda --ignored --nocapture --test-threads=1 --exact wgmma_forward_matches_cpu_and_mma > $OUT/wgfwd.log 2>&1
echo "wgmma forward test rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "test result|^FAIL|panicked" $OUT/wgfwd.log | head -8
cd ..
for SH in 2 4 6; do timeout 60 .gpu/bin/attention_bench --wgmma --shape $SH --iters 10 > $OUT/bench$SH.log 2>&1; echo "bench $SH rc=$?"; sed -n '/^forward alone/,/^$/p' $OUT/bench$SH.log | grep -E "mma |wgmma" ; done
echo "total $(( $(date +%s) - T0 )) s"
