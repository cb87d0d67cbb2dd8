#!/usr/bin/env bash
# GPU call H: LayerNorm kernels (fused backward, register variants) checked against the CPU and swept;
# layer kernels and attention beside peer_layers.py in the same call; the per-linear FP8 crossover; gpt_cuda.
set -u
B=/tmp/b; mkdir -p $B && tar -C $B -xJf .gpuA/h.tar.xz
source $B/cuda-env.sh
L=/tmp/logs; mkdir -p $L
r() { local name=$1; shift; local t0=$(date +%s); timeout "$@" > $L/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $L/summary.txt; }
r layer_norm_cuda 240 $B/layer_norm_cuda --nocapture --test-threads 1
r gpt_cuda 120 $B/gpt_cuda --nocapture
r layer_kernel_bench 150 $B/layer_kernel_bench --sweep
r attention_bench 120 $B/attention_bench
r peer_layers 300 python3 $B/peer_layers.py
r linear_crossover 300 $B/linear_crossover --json $L/linear_crossover.json
tar -C $L -czf $OUT/logs.tgz .
grep -E "^(ok|MISMATCH|NONDET)|test result" $L/layer_norm_cuda.log | tail -8
grep -E "test result" $L/gpt_cuda.log
grep -E "LayerNorm|LM head|sweep" $L/layer_kernel_bench.log | cut -c1-200
grep -vE "^\s*$" $L/attention_bench.log | tail -12 | cut -c1-200
cut -c1-220 $L/peer_layers.log
tail -8 $L/linear_crossover.log | cut -c1-200
cat $L/summary.txt
