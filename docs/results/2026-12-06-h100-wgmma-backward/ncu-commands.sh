#!/bin/bash
# Device call C: Nsight Compute on the wgmma backward kernels (dK/dV and dQ) at the llama-1b (hd 64) and
# llama-8b (hd 128) shapes: duration, throughput, occupancy, warp stall reasons.
set +e
source .gpu/cuda-env.sh
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
for SH in 4 6; do
  timeout 200 $NCU --clock-control none --kernel-name regex:"attn_bwd_wgmma_(kv|q)_g1|attn_fwd_wgmma" --launch-skip 0 --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
    .gpu/bin/attention_bench --shape $SH --iters 1 > $OUT/ncu_shape$SH.txt 2>&1
  echo "shape $SH rc=$?"
  grep -E "attn_|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|Theoretical Occupancy|Block Limit" $OUT/ncu_shape$SH.txt | head -80
done
