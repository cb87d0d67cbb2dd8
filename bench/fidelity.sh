#!/usr/bin/env bash
# Fidelity of our FP8 training against our BF16 training on the same seeds: one GPU, every run in
# parallel (small models leave the GPU mostly idle one at a time). For each seed, one run of lm_fsdp per
# mode of FIDELITY_MODES (default "fp8 fp8comm bf16"):
#   fp8        --precision fp8 --fp8-layers all --grad-shards bf16
#   fp8comm    the same with --fp8-grad-comm (the FP8 gradient reduce-scatter)
#   fp8head    the fp8 flags with --fp8-head (the LM head's GEMMs in FP8 too)
#   block      the fp8 flags with --recipe block (1x128 / 128x128 block scales)
#   blockcomm  the block flags with --fp8-grad-comm block (the block-scaled FP8 gradient exchange)
#   bf16       --precision bf16 (always included: the pairs' reference)
# each with the peer's optimizer, schedule and validation (lm_fsdp's defaults), then a table of final
# validation losses, the paired differences (each mode minus BF16) and their means. The runs of the first seed
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
# The runs of each seed (FIDELITY_MODES, default "fp8 fp8comm bf16"): every mode's flags.
mode_flags() {
  case $1 in
    fp8) echo "--precision fp8 --fp8-layers all --grad-shards bf16" ;;
    fp8comm) echo "--precision fp8 --fp8-layers all --grad-shards bf16 --fp8-grad-comm" ;;
    fp8head) echo "--precision fp8 --fp8-layers all --grad-shards bf16 --fp8-head" ;;
    block) echo "--precision fp8 --fp8-layers all --grad-shards bf16 --recipe block" ;;
    blockcomm) echo "--precision fp8 --fp8-layers all --grad-shards bf16 --recipe block --fp8-grad-comm block" ;;
    bf16) echo "--precision bf16" ;;
    *) echo "fidelity: unknown mode $1 (fp8, fp8comm, fp8head, block, blockcomm, bf16)" >&2; return 1 ;;
  esac
}
MODES=${FIDELITY_MODES:-fp8 fp8comm bf16}
for m in $MODES; do mode_flags "$m" >/dev/null || exit 2; done
case " $MODES " in *" bf16 "*) ;; *) echo "fidelity: FIDELITY_MODES must include bf16 (the pairs' reference)" >&2; exit 2 ;; esac
for s in $SEEDS; do
  for m in $MODES; do
    # shellcheck disable=SC2046
    run "$m-s$s" "$s" $(mode_flags "$m") &
  done
done
wait
echo "fidelity: all runs done in $(($(date +%s) - t0)) s" | tee -a "$DEST/status.txt"
python3 - "$DEST" "$SEEDS" "$MODES" <<'PY' | tee "$DEST/table.md"
import re, sys, statistics
dest, seeds, modes = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
def final(name):
    try:
        text = open(f"{dest}/{name}.log").read()
    except OSError:
        return None
    m = re.findall(r"final: train loss [0-9.]+, eval loss ([0-9.]+)", text)
    return float(m[-1]) if m else None
rows = {k: [final(f"{k}-s{s}") for s in seeds] for k in modes}
others = [k for k in modes if k != "bf16"]
print("| seed | " + " | ".join(modes) + " | " + " | ".join(f"{k} - bf16" for k in others) + " |")
print("| --- " * (1 + len(modes) + len(others)) + "|")
fmt = lambda v: "failed" if v is None else f"{v:.4f}"
diff = lambda a, b: "" if a is None or b is None else f"{a - b:+.4f}"
for i, s in enumerate(seeds):
    vals = [fmt(rows[k][i]) for k in modes]
    diffs = [diff(rows[k][i], rows["bf16"][i]) for k in others]
    print(f"| {s} | " + " | ".join(vals + diffs) + " |")
complete = all(v is not None for k in modes for v in rows[k])
if complete:
    means = [f"{statistics.mean(rows[k]):.4f}" for k in modes]
    dmeans = [f"{statistics.mean(a - b for a, b in zip(rows[k], rows['bf16'])):+.4f}" for k in others]
    print("| mean | " + " | ".join(means + dmeans) + " |")
PY
