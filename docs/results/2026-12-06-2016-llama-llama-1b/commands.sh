#!/usr/bin/env bash
# bench/run.sh llama llama-1b: the commands in the order they ran (from the repository root)
.bench/bin/lm_fsdp --speed --device cuda --preset llama-1b --batch-size 4 --seq-len 4096 --grad-shards bf16 --optimizer-in-backward --fp8-head
env COMPILE=1 python3 .bench/peers/peer_llama.py speed bf16 llama-1b 4 4096
env COMPILE=1 python3 .bench/peers/peer_llama.py speed fp8 llama-1b 4 4096
