#!/bin/bash
# Device call D: with the wgmma forward now the default on Hopper: the attention GPU tests and the GPT
# and Llama CUDA-against-CPU training-step tests.
set +e
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
GPU_TEST_TIMEOUT=150 timeout 420 scripts/gpu-tests.sh run > $OUT/gpu-tests-table.txt 2>&1
tail -16 $OUT/gpu-tests-table.txt
