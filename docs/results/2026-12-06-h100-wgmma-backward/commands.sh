#!/bin/bash
# Device call B: the deterministic wgmma backward (dK/dV and dQ kernels): all attention GPU tests, then the
# bench beside PyTorch's attention (same call).
set +e
source bench/cuda-libs.sh 2>/dev/null || source .gpu/cuda-env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
T=.gpu/tests/fp8-kernels.attention_cuda
cd fp8-kernels
timeout 300 ../$T --ignored --nocapture --test-threads=1 > $OUT/attention_cuda.log 2>&1; echo "attention_cuda rc=$?"
grep -E "^test |test result|panicked" $OUT/attention_cuda.log | head -20
grep -E "^FAIL" $OUT/attention_cuda.log | head -10
cd ..
timeout 150 python3 .gpu/peer_attention.py > $OUT/peer.log 2>&1; echo "peer rc=$?"
timeout 200 .gpu/bin/attention_bench --wgmma --peer $OUT/peer.log > $OUT/bench.log 2>&1; echo "bench rc=$?"
grep -E "default|mma det" $OUT/bench.log | head -14
sed -n '/^backward alone/,$p' $OUT/bench.log
