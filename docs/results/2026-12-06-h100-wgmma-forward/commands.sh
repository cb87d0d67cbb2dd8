#!/bin/bash
# Device call C: the wgmma attention forward: probes, the forward against CPU and mma.sync, then the bench.
set +e
source bench/cuda-libs.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
T=.gpu/tests/fp8-kernels.attention_cuda
cd fp8-kernels
timeout 120 ../$T --ignored --nocapture --test-threads=1 --exact wgmma_probes_match_cpu > $OUT/probes.log 2>&1; echo "probes rc=$?"
grep -E "test result|FAIL|mismatch|wrong|panicked" $OUT/probes.log | head -15
timeout 240 ../$T --ignored --nocapture --test-threads=1 --exact wgmma_forward_matches_cpu_and_mma > $OUT/forward.log 2>&1; echo "forward rc=$?"
grep -E "test result|panicked" -A3 $OUT/forward.log | head -15
cd ..
timeout 200 .gpu/bin/attention_bench --wgmma > $OUT/bench.log 2>&1; echo "bench rc=$?"
tail -40 $OUT/bench.log
