#!/usr/bin/env bash
# GPU call K: the shared cast + transpose (cast and fused-GELU families) checked against the CPU; the final
# gpt_fsdp binary's gpt-3b row beside torchao's (the faster peer there) in the same call.
set -u
B=/tmp/b; mkdir -p $B && tar -C $B -xJf .gpuA/k.tar.xz
source $B/cuda-env.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site $B/*.whl && export PYTHONPATH=/tmp/site
L=/tmp/logs; mkdir -p $L
r() { local name=$1; shift; local t0=$(date +%s); timeout "$@" > $L/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $L/summary.txt; }
r kernel_check 200 $B/kernel_check --skip-exhaustive
r fused_check 120 $B/fused_check
r gelu_cast_props 120 $B/gelu_cast_props --nocapture cuda_
r ours-3b 150 $B/gpt_fsdp --device cuda --speed --preset gpt-3b --batch-size 4 --seq-len 2048 --precision fp8 --fp8-layers all --grad-shards bf16
COMPILE=1 r peer-3b-fp8 200 python3 $B/peer_gpt.py speed fp8 gpt-3b 4 2048
tar -C $L -czf $OUT/logs.tgz .
tail -2 $L/kernel_check.log; tail -2 $L/fused_check.log; grep "test result" $L/gelu_cast_props.log
grep -o '"step_s":[0-9.]*\|"tokens_per_s":[0-9.]*\|"peak_GiB":[0-9.]*' $L/ours-3b.log
tail -1 $L/peer-3b-fp8.log | cut -c1-400
cat $L/summary.txt
