#!/usr/bin/env bash
# gpt-3b 4 x 2048: per-tensor and block-scaled steps in one call (NVRTC compiles every module per process).
set +e
source .gpu/cuda-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for r in tensor block; do
  /usr/bin/time -v timeout ${T:-200} .bench/bin/lm_fsdp --device cuda --preset gpt-3b --batch-size 4 --seq-len 2048 --grad-shards bf16 --speed --recipe $r > $OUT/gpt-3b-$r.log 2> $OUT/gpt-3b-$r.err
  echo "$r rc=$? $(grep -c . $OUT/gpt-3b-$r.log) lines"
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for f in ["gpt-3b-tensor", "gpt-3b-block"]:
    try:
        j = [json.loads(l) for l in open(f"{out}/{f}.log") if l.startswith("{")][-1]
        print(f, "step_s", round(j["step_s"], 4), "peak_GiB", round(j["peak_GiB"], 2), "held_GiB", round(j["held_activation_bytes"] / 2**30, 2))
    except Exception as e:
        print(f, "no json", e)
PY
