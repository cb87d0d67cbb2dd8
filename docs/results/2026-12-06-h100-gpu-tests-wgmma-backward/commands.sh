#!/bin/bash
# Device call D (last of the session): with the wgmma backward the default on Hopper, (1) the GPT and Llama
# CUDA-against-CPU training-step tests and the wgmma attention checks; (2) llama-small fidelity, FP8
# per-tensor, FP8 block-scaled and BF16, seeds 1-4; (3) the gpt-3b row against the compiled peers.
set +e
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
GPU_TEST_TIMEOUT=150 timeout 200 scripts/gpu-tests.sh run "gpt_cuda|llama_cuda|wgmma_backward_matches|long_sequences" > $OUT/gpu-tests.txt 2>&1
echo "gpu tests rc=$? ($(( $(date +%s) - T0 )) s)"; tail -8 $OUT/gpu-tests.txt
FIDELITY_EXPORTS=/tmp/exports FIDELITY_TIMEOUT=240 FIDELITY_MODES="fp8 block bf16" LM=.bench/bin/lm_fsdp \
  timeout 250 bash bench/fidelity.sh llama-small 8 512 600 "1 2 3 4" data/shakespeare $OUT/fid > $OUT/fidelity.out 2>&1
echo "fidelity rc=$? ($(( $(date +%s) - T0 )) s)"; tail -14 $OUT/fidelity.out
tar czf $OUT/fid.tar.gz -C $OUT fid && rm -rf $OUT/fid
LEFT=$(( 575 - ($(date +%s) - T0) ))
echo "left for gpt-3b: $LEFT s"
BENCH_BUDGET_S=$LEFT bash bench/run.sh gpt gpt-3b 2>&1 | grep -A6 "^## Summary"
echo "total $(( $(date +%s) - T0 )) s"
