#!/usr/bin/env bash
# bench/run.sh gpt gpt-3b,gpt-6.7b: the commands in the order they ran (from the repository root)
.bench/bin/lm_fsdp --speed --device cuda --preset gpt-3b --batch-size 4 --seq-len 2048 --grad-shards bf16 --optimizer-in-backward --fp8-head
env COMPILE=1 python3 .bench/peers/peer_gpt.py speed bf16 gpt-3b 4 2048
env COMPILE=1 python3 .bench/peers/peer_gpt.py speed fp8 gpt-3b 4 2048
.bench/bin/lm_fsdp --speed --device cuda --d-model 4096 --layers 32 --heads 32 --batch-size 1 --seq-len 8192 --grad-shards bf16 --optimizer-in-backward --fp8-head
