#!/usr/bin/env bash
# The GPU tests of the fused block casts, block vs per-tensor steps (gpt-3b, llama-3b), a block profile.
set +e
T0=$(date +%s)
left() { echo $(( ${BUDGET:-430} - ($(date +%s) - T0) )); }
source .gpu/cuda-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
GPU_TEST_TIMEOUT=150 OUT=$OUT/gt bash scripts/gpu-tests.sh run > $OUT/gpu-tests.out 2>&1
tail -16 $OUT/gpu-tests.out
LM=.bench/bin/lm_fsdp
for row in "gpt-3b 4 2048" "llama-3b 2 4096"; do
  set -- $row
  for r in tensor block; do
    [ "$(left)" -gt 50 ] || { echo "skip $1 $r"; continue; }
    timeout 100 $LM --device cuda --preset $1 --batch-size $2 --seq-len $3 --grad-shards bf16 --speed --recipe $r > $OUT/$1-$r.log 2>&1
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
if [ "$(left)" -gt 50 ]; then
  timeout 45 bash scripts/kernel-times.sh $OUT/kt-gpt-3b-2l-block $LM --speed --speed-steps 1 --device cuda --preset gpt-3b --layers 2 --batch-size 4 --seq-len 2048 --grad-shards bf16 --recipe block > /dev/null 2>&1
  echo "kernel-times block rc=$?"; head -24 $OUT/kt-gpt-3b-2l-block.md
fi
echo "elapsed $(( $(date +%s) - T0 )) s"
