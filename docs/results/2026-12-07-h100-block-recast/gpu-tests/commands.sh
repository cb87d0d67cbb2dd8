#!/usr/bin/env bash
# One call: the block cast bench (before / after the register bounds), block vs per-tensor steps with the
# activation and norm casts and the recast inputs, the GPU tests of the changed kernels and layers.
set +e
T0=$(date +%s)
left() { echo $(( ${BUDGET:-420} - ($(date +%s) - T0) )); }
source .gpu/cuda-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
for v in base lb; do
  timeout 40 .gpu/bin/block_cast_bench-$v --iters 20 > $OUT/block_cast_bench-$v.log 2>&1; echo "bench $v rc=$?"
done
LM=.bench/bin/lm_fsdp
step() {
  [ "$(left)" -gt "$5" ] || { echo "skip $1 $4"; return; }
  timeout 80 $LM --device cuda --preset $1 --batch-size $2 --seq-len $3 --grad-shards bf16 --speed --recipe $4 > $OUT/$1-$4.log 2>&1
  echo "$1 $4 rc=$?"
}
step gpt-3b 4 2048 tensor 100
step gpt-3b 4 2048 block 90
if [ "$(left)" -gt 60 ]; then
  GPU_TEST_TIMEOUT=$(( $(left) - 10 < 120 ? $(left) - 10 : 120 )) OUT=$OUT/gt bash scripts/gpu-tests.sh run "block_quantize_cuda cuda_activation|optimizer_in_backward|gpu_linear cuda_block|block_gemm_cuda cuda_gemm_into|gemm_check" > $OUT/gpu-tests.out 2>&1
  tail -10 $OUT/gpu-tests.out
fi
step llama-3b 2 4096 tensor 90
step llama-3b 2 4096 block 80
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for f in ["gpt-3b-tensor", "gpt-3b-block", "llama-3b-tensor", "llama-3b-block"]:
    try:
        j = [json.loads(l) for l in open(f"{out}/{f}.log") if l.startswith("{")][-1]
        print(f, "step_s", round(j.get("step_s", 0), 4), "peak_GiB", round(j.get("peak_GiB", 0), 2), "held_GiB", round(j.get("held_activation_bytes", 0) / 2**30, 2))
    except Exception as e:
        print(f, "no json", e)
PY
for v in base lb; do grep -E "^\| (gpt|llama)" $OUT/block_cast_bench-$v.log | sed "s/^/$v /"; done
echo "elapsed $(( $(date +%s) - T0 )) s"
