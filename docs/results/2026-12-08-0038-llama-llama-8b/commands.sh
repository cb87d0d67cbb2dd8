#!/usr/bin/env bash
# bench/run.sh llama llama-8b: the commands in the order they ran (from the repository root)
.bench/bin/lm_fsdp --speed --device cuda --preset llama-8b --batch-size 1 --seq-len 8192 --grad-shards bf16 --optimizer-in-backward --fp8-head
env COMPILE=1 AC=full python3 .bench/peers/peer_llama.py speed bf16 llama-8b 1 8192
env COMPILE=1 AC=full python3 .bench/peers/peer_llama.py speed fp8 llama-8b 1 8192
