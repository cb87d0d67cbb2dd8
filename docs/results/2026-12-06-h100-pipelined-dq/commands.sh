#!/bin/bash
# Device call E (short): the pipelined wgmma dQ kernel: the wgmma backward GPU test (every pair), the
# backward-alone table at the llama-1b and llama-8b shapes, and the F64 check against PyTorch's flash
# backend (scripts/check_attention_vs_torch.py) of the default path at B4 H20 T2048 hd128.
set +e
source .gpu/cuda-env.sh
T0=$(date +%s)
cd fp8-kernels
timeout 60 ../.gpu/tests/fp8-kernels.attention_cuda --ignored --nocapture --test-threads=1 --exact wgmma_backward_matches_cpu_and_mma > $OUT/wgbwd.log 2>&1
echo "wgmma backward test rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "test result|^FAIL" $OUT/wgbwd.log | head -5
cd ..
for SH in 4 6; do timeout 40 .gpu/bin/attention_bench --wgmma --shape $SH --iters 10 > $OUT/bench$SH.log 2>&1; sed -n '/^backward alone/,/^$/p' $OUT/bench$SH.log | grep -E "mma |wgmma" ; done
echo "($(( $(date +%s) - T0 )) s)"
timeout 40 .gpu/bin/attention_bench --shape 2 --iters 1 --dump /tmp/dump > /dev/null 2>&1
timeout 40 python3 scripts/check_attention_vs_torch.py /tmp/dump > $OUT/check.log 2>&1; echo "check rc=$?"; tail -12 $OUT/check.log
echo "total $(( $(date +%s) - T0 )) s"
