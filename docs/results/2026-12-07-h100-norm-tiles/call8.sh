#!/usr/bin/env bash
# Call 8: the norm forward's 32-row transposed pieces (bitwise tests over every launch choice), the sweep
# of the FP8 forward's launch per code layout, then the activation-cast register caps (test and bench).
set +e
T0=$(date +%s)
left() { echo $(( ${BUDGET:-380} - ($(date +%s) - T0) )); }
source .gpu/cuda-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
GPU_TEST_TIMEOUT=200 OUT=$OUT/gt1 bash scripts/gpu-tests.sh run "layer_norm_cuda" > $OUT/gpu-tests-norm.out 2>&1
tail -4 $OUT/gpu-tests-norm.out
timeout 170 .gpu/bin/layer_kernel_bench --sweep --chunks 4096 > $OUT/layer_kernel_bench.log 2>&1; echo "layer rc=$? $(( $(date +%s) - T0 )) s"
if [ "$(left)" -gt 110 ]; then
  GPU_TEST_TIMEOUT=$(( $(left) - 5 )) OUT=$OUT/gt2 bash scripts/gpu-tests.sh run "block_quantize_cuda cuda_activation" > $OUT/gpu-tests-act.out 2>&1
  tail -3 $OUT/gpu-tests-act.out
fi
[ "$(left)" -gt 45 ] && { timeout $(( $(left) - 3 )) .gpu/bin/block_cast_bench --iters 20 > $OUT/block_cast_bench.log 2>&1; echo "cast rc=$?"; }
grep -E "^sweep .* fwd fp8" $OUT/layer_kernel_bench.log | cut -c1-400
grep -E "SwiGLU, both|GELU gradient" $OUT/block_cast_bench.log | head -12
echo "elapsed $(( $(date +%s) - T0 )) s"
