#!/usr/bin/env bash
# Call 9: the prefetching norm forward (bitwise GPU test, with the poison fill on), then the norms against
# the peer's norm rows with this build's tile defaults and the prefetching row.
set +e
T0=$(date +%s)
source .gpu/cuda-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
(cd bench/peers && timeout 100 python3 -c "
import torch, peer_layers as p
torch.manual_seed(0)
p.norm_rows('layernorm', p.layer_norm, p.layer_norm_e4m3, p.LAYERNORM_SHAPES)
p.norm_rows('rmsnorm', p.rms_norm, p.rms_norm_e4m3, p.RMSNORM_SHAPES)
") > $OUT/peer_norms.jsonl 2> $OUT/peer_norms.err
echo "peer rc=$? $(wc -l < $OUT/peer_norms.jsonl) lines $(( $(date +%s) - T0 )) s"
FP8_KERNELS_POISON_UNINIT=1 GPU_TEST_TIMEOUT=150 OUT=$OUT/gt bash scripts/gpu-tests.sh run "prefetching" > $OUT/gpu-tests.out 2>&1
tail -3 $OUT/gpu-tests.out
timeout 150 .gpu/bin/layer_kernel_bench --peer $OUT/peer_norms.jsonl --chunks 4096 > $OUT/layer_kernel_bench.log 2>&1; echo "layer rc=$? $(( $(date +%s) - T0 )) s"
grep -E "^\| (LayerNorm|RMSNorm)" $OUT/layer_kernel_bench.log | grep -v "bf16 out" | cut -c1-110
echo "elapsed $(( $(date +%s) - T0 )) s"
