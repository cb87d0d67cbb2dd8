#!/usr/bin/env bash
# bench/run.sh gpt gpt2: the commands in the order they ran (from the repository root)
.bench/bin/lm_fsdp --speed --device cuda --preset gpt2 --batch-size 16 --seq-len 1024 --grad-shards bf16
env COMPILE=1 python3 .bench/peers/peer_gpt.py speed bf16 gpt2 16 1024
env COMPILE=1 python3 .bench/external/peer_gpt.py speed bf16 gpt2 16 1024
env COMPILE=1 python3 .bench/peers/peer_gpt.py speed fp8 gpt2 16 1024
env COMPILE=1 python3 .bench/external/peer_gpt.py speed fp8 gpt2 16 1024
