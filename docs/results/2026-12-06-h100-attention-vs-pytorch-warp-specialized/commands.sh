#!/bin/bash
# Device call J: attention fwd+bwd against PyTorch's backends (peer_layers.py's attention rows and
# attention_bench's default table, same call), then the llama-1b row (ours and both compiled peers).
set +e
source .gpu/cuda-env.sh
T0=$(date +%s)
(cd bench/peers && timeout 150 python3 -c "import torch; torch.manual_seed(0); import peer_layers; peer_layers.attention_rows()") > $OUT/peer.log 2>&1
echo "peer rc=$? ($(( $(date +%s) - T0 )) s)"
timeout 100 .gpu/bin/attention_bench --peer $OUT/peer.log --iters 10 > $OUT/bench.log 2>&1; echo "bench rc=$? ($(( $(date +%s) - T0 )) s)"
sed -n '/ours against PyTorch/,$p' $OUT/bench.log
BENCH_BUDGET_S=$(( 560 - ($(date +%s) - T0) )) bash bench/run.sh llama llama-1b > $OUT/llama.log 2>&1; echo "llama rc=$? ($(( $(date +%s) - T0 )) s)"
tail -12 $OUT/llama.log
