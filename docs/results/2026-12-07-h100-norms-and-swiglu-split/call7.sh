#!/usr/bin/env bash
# Call 7: the re-applied activation-cast change (bitwise GPU tests, cast bench before/after in one call), the
# CUDA poison test, then the norm kernels against the peer's norm rows (the recast default's row-major-only
# FP8 forward, never timed).
set +e
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
source .gpu/cuda-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
(cd bench/peers && timeout 200 python3 -c "
import torch, peer_layers as p
torch.manual_seed(0)
p.norm_rows('layernorm', p.layer_norm, p.layer_norm_e4m3, p.LAYERNORM_SHAPES)
p.norm_rows('rmsnorm', p.rms_norm, p.rms_norm_e4m3, p.RMSNORM_SHAPES)
") > $OUT/peer_norms.jsonl 2> $OUT/peer_norms.err; echo "peer rc=$? $(wc -l < $OUT/peer_norms.jsonl) lines $(( $(date +%s) - T0 )) s"
timeout 40 .gpu/bin/block_cast_bench-prev --iters 20 > $OUT/block_cast_bench-prev.log 2>&1; echo "bench prev rc=$?"
timeout 40 .gpu/bin/block_cast_bench --iters 20 > $OUT/block_cast_bench-new.log 2>&1; echo "bench new rc=$?"
timeout 150 .gpu/bin/layer_kernel_bench --peer $OUT/peer_norms.jsonl > $OUT/layer_kernel_bench.log 2>&1; echo "layer rc=$? $(( $(date +%s) - T0 )) s"
GPU_TEST_TIMEOUT=$(( $(left) - 10 < 200 ? $(left) - 10 : 200 )) OUT=$OUT/gt bash scripts/gpu-tests.sh run "block_quantize_cuda|fp8_kernels" > $OUT/gpu-tests.out 2>&1
tail -9 $OUT/gpu-tests.out
for v in prev new; do grep -E "^\| (gpt|llama)" $OUT/block_cast_bench-$v.log | sed "s/^/$v /"; done | sort -k2 | cut -c1-150
grep -E "^\| (LayerNorm|RMSNorm)" $OUT/layer_kernel_bench.log | head -24
echo "elapsed $(( $(date +%s) - T0 )) s"
