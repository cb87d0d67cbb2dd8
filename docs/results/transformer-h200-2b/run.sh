#!/usr/bin/env bash
# GPU call I: cross-entropy register kernels and the LayerNorm launch defaults checked against the CPU;
# layer kernels (with the CE sweep) beside peer_layers.py in the same call; gpt_cuda; our gpt-3b speed row.
set -u
B=/tmp/b; mkdir -p $B && tar -C $B -xJf .gpuA/i.tar.xz
source $B/cuda-env.sh
L=/tmp/logs; mkdir -p $L
r() { local name=$1; shift; local t0=$(date +%s); timeout "$@" > $L/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $L/summary.txt; }
r cross_entropy_cuda 180 $B/cross_entropy_cuda --nocapture --test-threads 1
r layer_norm_cuda 240 $B/layer_norm_cuda --nocapture --test-threads 1
r gpt_cuda 120 $B/gpt_cuda --nocapture
r layer_kernel_bench 150 $B/layer_kernel_bench --sweep
r peer_layers 300 python3 $B/peer_layers.py
r ours-3b 150 $B/gpt_fsdp --device cuda --speed --preset gpt-3b --batch-size 4 --seq-len 2048 --precision fp8 --fp8-layers all --grad-shards bf16
tar -C $L -czf $OUT/logs.tgz .
grep -E "MISMATCH|NONDET|test result" $L/cross_entropy_cuda.log | tail -5
grep -E "MISMATCH|NONDET|test result" $L/layer_norm_cuda.log | tail -5
grep -E "test result" $L/gpt_cuda.log
grep -E "LayerNorm|LM head|sweep" $L/layer_kernel_bench.log | cut -c1-230
grep -E "layernorm|lmhead" $L/peer_layers.log | cut -c1-200
tail -2 $L/ours-3b.log | cut -c1-400
cat $L/summary.txt
