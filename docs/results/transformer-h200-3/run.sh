#!/usr/bin/env bash
# GPU call J: the cross-entropy exp without conversion instructions and the paired bf16 stores, checked
# against the CPU (every kernel family that stores bf16 vectors); layer kernels beside peer_layers.py in the
# same call; gpt_cuda; our gpt-3b speed row.
set -u
B=/tmp/b; mkdir -p $B && tar -C $B -xJf .gpuA/j.tar.xz
source $B/cuda-env.sh
L=/tmp/logs; mkdir -p $L
r() { local name=$1; shift; local t0=$(date +%s); timeout "$@" > $L/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $L/summary.txt; }
r cross_entropy_cuda 180 $B/cross_entropy_cuda --nocapture --test-threads 1
r layer_norm_cuda 120 $B/layer_norm_cuda --nocapture cuda_matches_cpu_bitwise
r embedding_cuda 120 $B/embedding_cuda --nocapture
r gelu_cast_props 120 $B/gelu_cast_props --nocapture cuda_
r adam_control_props 120 $B/adam_control_props --nocapture cuda_
r kernel_check 200 $B/kernel_check --skip-exhaustive
r fused_check 120 $B/fused_check
r gpt_cuda 120 $B/gpt_cuda --nocapture
r layer_kernel_bench 150 $B/layer_kernel_bench --sweep
r peer_layers 300 python3 $B/peer_layers.py
r ours-3b 150 $B/gpt_fsdp --device cuda --speed --preset gpt-3b --batch-size 4 --seq-len 2048 --precision fp8 --fp8-layers all --grad-shards bf16
tar -C $L -czf $OUT/logs.tgz .
for t in cross_entropy_cuda layer_norm_cuda embedding_cuda gelu_cast_props adam_control_props gpt_cuda; do echo "$t: $(grep -cE 'MISMATCH|NONDET|FAIL' $L/$t.log) bad; $(grep -E 'test result' $L/$t.log | tail -1)"; done
tail -3 $L/kernel_check.log; tail -3 $L/fused_check.log
grep -E "LayerNorm|LM head|sweep ce" $L/layer_kernel_bench.log | cut -c1-230
grep -E "layernorm|lmhead" $L/peer_layers.log | cut -c1-200
tail -1 $L/ours-3b.log | cut -c1-300
cat $L/summary.txt
