#!/bin/bash
# Device call B: fidelity of the block recipe (gpt2, 8 x 512, 600 steps, seeds 1-4: per-tensor FP8,
# block FP8 and BF16 in parallel), then ours per-tensor vs block at llama-3b and gpt-3b (speed).
set +e
source bench/cuda-libs.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
export LM=.gpu/bin/lm_fsdp
FIDELITY_TIMEOUT=330 FIDELITY_MODES="fp8 block bf16" bash bench/fidelity.sh gpt2 8 512 600 "1 2 3 4" data/shakespeare $OUT/fidelity-gpt2 > $OUT/fidelity.out 2>&1
tail -8 $OUT/fidelity.out
for row in "llama-3b 2 4096" "gpt-3b 4 2048"; do
  set -- $row
  for r in tensor block; do
    timeout 150 $LM --device cuda --preset $1 --batch-size $2 --seq-len $3 --grad-shards bf16 --speed --recipe $r > $OUT/$1-$r.log 2>&1
    echo "$1 $r rc=$?"
  done
done
python3 - <<'PY'
import json,os
out=os.environ["OUT"]
for f in ["llama-3b-tensor","llama-3b-block","gpt-3b-tensor","gpt-3b-block"]:
    try:
        j=json.loads(open(f"{out}/{f}.log").read().strip().splitlines()[-1])
        print(f, "step_s", round(j.get("step_s",0),4), "peak_GiB", round(j.get("peak_GiB",0),2), "tok/s", round(j.get("tokens_per_s",0)))
    except Exception as e: print(f, "no json", e)
PY
