#!/bin/bash
# Device call G: the warp-specialised dQ kernel and the new forward default: the wgmma forward and backward
# GPU tests (every variant and pair), the backward-alone table at three shapes, and the F64 check against
# PyTorch's flash backend at B4 H20 T2048 hd128 (default path: warp-specialised forward).
set +e
source .gpu/cuda-env.sh
T0=$(date +%s)
cd fp8-kernels
for t in wgmma_forward_matches_cpu_and_mma wgmma_backward_matches_cpu_and_mma; do
  timeout 150 ../.gpu/tests/fp8-kernels.attention_cuda --ignored --nocapture --test-threads=1 --exact $t > $OUT/$t.log 2>&1
  echo "$t rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "test result|^FAIL|panicked" $OUT/$t.log | head -6
done
cd ..
for SH in 2 4 6; do timeout 60 .gpu/bin/attention_bench --wgmma --shape $SH --iters 10 > $OUT/bench$SH.log 2>&1; echo "bench $SH rc=$?"; sed -n '/^backward alone/,/^$/p' $OUT/bench$SH.log | grep -E "mma sep|g1n64 |w  " ; done
timeout 40 .gpu/bin/attention_bench --shape 2 --iters 1 --dump /tmp/dump > /dev/null 2>&1
timeout 40 python3 scripts/check_attention_vs_torch.py /tmp/dump > $OUT/check.log 2>&1; echo "check rc=$?"; tail -9 $OUT/check.log
echo "total $(( $(date +%s) - T0 )) s"
