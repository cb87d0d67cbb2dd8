#!/usr/bin/env bash
# Fidelity of our FP8 training against our BF16 training on the same seeds: one GPU, every run in
# parallel (small models leave the GPU mostly idle one at a time). For each seed, three runs of lm_fsdp:
#   fp8      --precision fp8 --fp8-layers all --grad-shards bf16
#   fp8comm  the same with --fp8-grad-comm (the FP8 gradient reduce-scatter)
#   bf16     --precision bf16
# each with the peer's optimizer, schedule and validation (lm_fsdp's defaults), then a table of final
# validation losses, the paired differences (FP8 minus BF16) and their means. The runs of the first seed
# also export their weights (--export), so scripts/llama_torch_eval.py can evaluate them independently.
#
#   bash bench/fidelity.sh PRESET BATCH SEQ STEPS "SEEDS" DATA_DIR [OUT_DIR]
#   e.g. bash bench/fidelity.sh llama-small 8 512 600 "1 2 3 4" .bench/shakespeare
#
# On the GPU machine, from the repository root with .bench/ packed (bench/run.sh pack llama): the binary
# is .bench/bin/lm_fsdp. OUT_DIR (default $OUT/fidelity-PRESET or .bench/out/fidelity-PRESET) receives
# every log, metrics file and table.md; the exports go to FIDELITY_EXPORTS (default OUT_DIR). FIDELITY_TIMEOUT
# bounds each run (default 500 s).
set -uo pipefail
[ $# -ge 6 ] || { sed -n 2,16p "$0"; exit 2; }
PRESET=$1 B=$2 T=$3 STEPS=$4 SEEDS=$5 DATA=$6
DEST=${7:-${OUT:-.bench/out}/fidelity-$PRESET}
LM=${LM:-.bench/bin/lm_fsdp}
[ -x "$LM" ] || { echo "fidelity: $LM is missing (bench/run.sh pack llama)" >&2; exit 1; }
[ -f "$DATA/train.bin" ] || { echo "fidelity: no $DATA/train.bin" >&2; exit 1; }
# shellcheck source=bench/cuda-libs.sh
source bench/cuda-libs.sh
mkdir -p "$DEST"
run() {
  local name=$1 seed=$2
  shift 2
  local export=()
  [ "$seed" = "${SEEDS%% *}" ] && export=(--export "${FIDELITY_EXPORTS:-$DEST}/$name-export")
  local cmd=("$LM" --device cuda --preset "$PRESET" --batch-size "$B" --seq-len "$T" --steps "$STEPS"
    --data "$DATA" --seed "$seed" --no-progress --metrics "$DEST/$name.jsonl" "${export[@]}" "$@")
  printf '%q ' "${cmd[@]}" >> "$DEST/commands.sh"
  echo >> "$DEST/commands.sh"
  timeout "${FIDELITY_TIMEOUT:-500}" "${cmd[@]}" > "$DEST/$name.log" 2>&1
  echo "$name rc=$?" >> "$DEST/status.txt"
}
t0=$(date +%s)
for s in $SEEDS; do
  run "fp8-s$s" "$s" --precision fp8 --fp8-layers all --grad-shards bf16 &
  run "fp8comm-s$s" "$s" --precision fp8 --fp8-layers all --grad-shards bf16 --fp8-grad-comm &
  run "bf16-s$s" "$s" --precision bf16 &
done
wait
echo "fidelity: all runs done in $(($(date +%s) - t0)) s" | tee -a "$DEST/status.txt"
python3 - "$DEST" "$SEEDS" <<'PY' | tee "$DEST/table.md"
import re, sys, statistics
dest, seeds = sys.argv[1], sys.argv[2].split()
def final(name):
    try:
        text = open(f"{dest}/{name}.log").read()
    except OSError:
        return None
    m = re.findall(r"final: train loss [0-9.]+, eval loss ([0-9.]+)", text)
    return float(m[-1]) if m else None
rows = {k: [final(f"{k}-s{s}") for s in seeds] for k in ("fp8", "fp8comm", "bf16")}
print("| seed | FP8 | FP8 + FP8 grad comm | BF16 | FP8 - BF16 | FP8 comm - BF16 |")
print("| --- | --- | --- | --- | --- | --- |")
fmt = lambda v: "failed" if v is None else f"{v:.4f}"
diff = lambda a, b: "" if a is None or b is None else f"{a - b:+.4f}"
for i, s in enumerate(seeds):
    a, c, b = rows["fp8"][i], rows["fp8comm"][i], rows["bf16"][i]
    print(f"| {s} | {fmt(a)} | {fmt(c)} | {fmt(b)} | {diff(a, b)} | {diff(c, b)} |")
ok = lambda k: [v for v in rows[k] if v is not None]
if all(len(ok(k)) == len(seeds) for k in rows):
    mean = {k: statistics.mean(rows[k]) for k in rows}
    d1 = statistics.mean(a - b for a, b in zip(rows["fp8"], rows["bf16"]))
    d2 = statistics.mean(a - b for a, b in zip(rows["fp8comm"], rows["bf16"]))
    print(f"| mean | {mean['fp8']:.4f} | {mean['fp8comm']:.4f} | {mean['bf16']:.4f} | {d1:+.4f} | {d2:+.4f} |")
PY
