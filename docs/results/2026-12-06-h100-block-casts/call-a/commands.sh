#!/usr/bin/env bash
# One call: the GPU tests of the in-place weight gradients and the block casts, block vs per-tensor steps,
# the LM head with its peer, then per-kernel profiles while time remains.
set +e
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
source .gpu/cuda-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
GPU_TEST_TIMEOUT=200 OUT=$OUT/gt bash scripts/gpu-tests.sh run > $OUT/gpu-tests.out 2>&1
tail -22 $OUT/gpu-tests.out
LM=.bench/bin/lm_fsdp
for row in "gpt-3b 4 2048" "llama-3b 2 4096"; do
  set -- $row
  for r in tensor block; do
    [ "$(left)" -gt 60 ] || { echo "skip $1 $r"; continue; }
    timeout 120 $LM --device cuda --preset $1 --batch-size $2 --seq-len $3 --grad-shards bf16 --speed --recipe $r > $OUT/$1-$r.log 2>&1
    echo "$1 $r rc=$?"
  done
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for f in ["gpt-3b-tensor", "gpt-3b-block", "llama-3b-tensor", "llama-3b-block"]:
    try:
        j = [json.loads(l) for l in open(f"{out}/{f}.log") if l.startswith("{")][-1]
        print(f, "step_s", round(j.get("step_s", 0), 4), "peak_GiB", round(j.get("peak_GiB", 0), 2))
    except Exception as e:
        print(f, "no json", e)
PY
if [ "$(left)" -gt 90 ]; then
  python3 -c "import sys; sys.path.insert(0, '.bench/peers'); import peer_layers as p; p.lm_head_rows()" > $OUT/peer-lmhead-1.log 2>&1
  timeout 100 .bench/bin/lm_head_bench --peer $OUT/peer-lmhead-1.log --shapes 8192x2560x50304,16384x768x50304 > $OUT/lm_head_bench-1.log 2>&1
  grep -E "^\|" $OUT/lm_head_bench-1.log
fi
for r in block tensor; do
  [ "$(left)" -gt 70 ] || { echo "skip kernel-times $r"; continue; }
  timeout 60 bash scripts/kernel-times.sh $OUT/kt-gpt-3b-2l-$r $LM --speed --speed-steps 1 --device cuda --preset gpt-3b --layers 2 --batch-size 4 --seq-len 2048 --grad-shards bf16 --recipe $r > /dev/null 2>&1
  echo "kernel-times $r rc=$?"; head -25 $OUT/kt-gpt-3b-2l-$r.md
done
echo "elapsed $(( $(date +%s) - T0 )) s"
