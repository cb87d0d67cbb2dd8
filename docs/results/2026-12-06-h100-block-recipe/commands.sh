#!/bin/bash
# Device call A: the new GPU tests, then ours per-tensor vs block at gpt-3b and the MLP stack.
set +e
source bench/cuda-libs.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
GPU_TEST_TIMEOUT=300 scripts/gpu-tests.sh run > $OUT/gpu-tests-table.txt 2>&1
tail -20 $OUT/gpu-tests-table.txt
L=.gpu/bin/lm_fsdp
for r in tensor block; do
  timeout 200 $L --device cuda --preset gpt-3b --batch-size 4 --seq-len 2048 --grad-shards bf16 --speed --recipe $r > $OUT/gpt3b-$r.log 2>&1
  echo "gpt-3b $r rc=$?"; tail -1 $OUT/gpt3b-$r.log | cut -c1-400
done
for r in tensor block; do
  timeout 120 .gpu/bin/mlp_bench --mode fp8 --d 4096 --blocks 8 --tokens 16384 --recipe $r > $OUT/mlp-$r.log 2>&1
  echo "mlp $r rc=$?"; tail -1 $OUT/mlp-$r.log | cut -c1-300
done
python3 - <<'PY'
import json,os
out=os.environ["OUT"]
for f in ["gpt3b-tensor","gpt3b-block","mlp-tensor","mlp-block"]:
    try:
        j=json.loads(open(f"{out}/{f}.log").read().strip().splitlines()[-1])
        print(f, "step_s", round(j.get("step_s",0),4), "peak_GiB", round(j.get("peak_GiB",0),2), "tok/s", j.get("tokens_per_s"))
    except Exception as e: print(f, "no json", e)
PY
