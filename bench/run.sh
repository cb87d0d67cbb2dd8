#!/usr/bin/env bash
# The benchmark tables: our binaries and their PyTorch peers (bench/peers/) measured in the same run.
#
#   bench/run.sh pack NAME [--external DIR]   here: build what table NAME (or all) needs (cargo --release),
#                                             copy it stripped with the peer scripts into .bench/ (replacing what
#                                             an earlier pack put there), fetch the torchao wheel into .whl/ and
#                                             the MNIST files into .bench/mnist/ if missing
#   bash bench/run.sh NAME [ROW[,ROW...]]     on the GPU machine: run the table (or the rows named), write every
#                                             log, the commands, the machine's facts and summary.md into a results
#                                             folder, and tar it as $OUT/<date>-<label>.tar.gz
#   bench/run.sh unpack FILE                  here: extract that tarball into docs/results/<date>-<label>/
#
# Tables and rows (estimated seconds on one H200, ours + the two peers, compile included; about 1.6x that
# with the external peers beside ours). Where one command may run at most 600 s (a lent GPU machine), run
# the tables marked "by row" one ROW per call:
#   gpt      by row   gpt2 (16 x 1024, ~200 s), gpt2-xl (8 x 1024, ~250 s), gpt-3b (4 x 2048, ~250 s),
#                     gpt-6.7b (d 4096, 32 layers, 32 heads, 1 x 8192: ours and the BF16 peer only, ~300 s)
#   llama    by row   llama-1b (4 x 4096), llama-3b (2 x 4096), llama-8b (1 x 8192, peers with AC=full),
#                     ~250 s each; ours needs the lm_fsdp binary (the row says "not run" without it)
#   mlp      whole    d4096 (8 blocks, 16384 tokens), d8192 (4 blocks, 8192 tokens): ~300 s together,
#                     by row (~150 s each) with the external peers
#   mnist    whole    14 epochs each (MNIST_EPOCHS): ~100 s, ~200 s with the external peer (it reads CSV, which
#                     is written from the IDX files first)
#   layers   whole    peer_layers.py, then layer_kernel_bench, attention_bench and lm_head_bench (--peer: its
#                     figures beside ours; lm_head_bench: the LM head float and --fp8-head): ~200 s
#   kernels  whole    kernel_bench, gemm_bench, peer_kernels.py, peer_blockwise_gemm.py, block_gemm_bench (reads
#                     the blockwise peer's log for its side-by-side columns): ~130 s
#
# Environment (GPU side):
#   LM_BIN             the language-model binary in .bench/bin (default lm_fsdp; gpt_fsdp when only it is there)
#   BENCH_EXTERNAL     a folder of external peer scripts to run beside ours (default .bench/external when
#                      `pack --external DIR` filled it; "none" to skip them)
#   BENCH_BUDGET_S     seconds the whole run may take; each run's timeout is cut to what is left, a run that
#                      no longer fits is recorded as skipped, and the tarball is rewritten after every run, so a
#                      call killed at its limit still returns what finished (default 570 when $OUT is set, as
#                      on a lent GPU machine; otherwise no limit)
#   BENCH_OURS_FLAGS   extra flags appended to our binary's command (e.g. a recompute option)
#   MNIST_EPOCHS       epochs of the mnist table (default 14)
#   OUT                where the tarball goes (default .bench/out)
#   BENCH_WORK         scratch folder for the results folder, the torchao install and MNIST CSV (default /tmp)
set -uo pipefail

LM_BIN=${LM_BIN:-lm_fsdp}
LM_FALLBACK=gpt_fsdp
TORCHAO_VERSION=0.18.0

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PACK=.bench
WHEELS=.whl
TABLES="gpt llama mlp mnist layers kernels"
CARRY_LIMIT_BYTES=$((64 * 1024 * 1024))

usage() {
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$ROOT/bench/run.sh"
}

die() {
  echo "bench/run.sh: $*" >&2
  exit 2
}

rows_of() {
  case $1 in
    gpt) echo "gpt2 gpt2-xl gpt-3b gpt-6.7b" ;;
    llama) echo "llama-1b llama-3b llama-8b" ;;
    mlp) echo "d4096 d8192" ;;
    mnist) echo "mnist" ;;
    layers) echo "layers" ;;
    kernels) echo "kernels" ;;
  esac
}

# Our binaries each table runs ("example:" ones are examples of a workspace crate).
binaries_of() {
  case $1 in
    gpt | llama) echo "LM" ;;
    mlp) echo "mlp_bench" ;;
    mnist) echo "mnist_fsdp" ;;
    layers) echo "example:layer_kernel_bench example:attention_bench example:lm_head_bench" ;;
    kernels) echo "example:kernel_bench example:gemm_bench example:block_gemm_bench" ;;
  esac
}

# Peer scripts of each table (with their helper modules).
peers_of() {
  case $1 in
    gpt) echo "peer_gpt.py" ;;
    llama) echo "peer_llama.py" ;;
    mlp) echo "peer_fsdp.py" ;;
    mnist) echo "peer_mnist.py" ;;
    layers) echo "peer_layers.py" ;;
    kernels) echo "peer_kernels.py peer_blockwise_gemm.py" ;;
  esac
}

needs_torchao() {
  case $1 in gpt | llama | mlp) return 0 ;; *) return 1 ;; esac
}

# ---------------------------------------------------------------- pack (development machine)

workspace_bins() {
  cargo metadata --no-deps --format-version 1 --manifest-path "$ROOT/Cargo.toml" |
    python3 -c 'import json, sys
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if "bin" in t["kind"]:
            print(t["name"])'
}

strip_copy() {
  local src=$1 dst=$2
  [ -f "$src" ] || die "$src was not built"
  strip --strip-all -o "$dst" "$src" 2>/dev/null || cp "$src" "$dst"
  chmod +x "$dst"
}

record_packed() {
  local file=$1 commit=$2
  local list=$PACK/PACKED.tsv
  touch "$list"
  grep -v -F "$file"$'\t' "$list" > "$list.new" || true
  printf '%s\t%s\t%s\n' "$file" "$commit" "$(date -u +%Y-%m-%dT%H:%MZ)" >> "$list.new"
  mv "$list.new" "$list"
}

pack_mnist() {
  local dest=$PACK/mnist name have=1
  for name in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    [ -f "$dest/$name.gz" ] || have=0
  done
  [ "$have" = 1 ] && { echo "pack: MNIST already in $dest"; return 0; }
  mkdir -p "$dest"
  if [ -d data/mnist ]; then
    for name in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
      if [ -f "data/mnist/$name.gz" ]; then
        cp "data/mnist/$name.gz" "$dest/"
      elif [ -f "data/mnist/$name" ]; then
        gzip -c "data/mnist/$name" > "$dest/$name.gz"
      fi
    done
  fi
  for name in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    if [ ! -f "$dest/$name.gz" ]; then
      echo "pack: fetching MNIST (scripts/fetch-mnist.sh --gzip)"
      rm -f "$dest"/*
      bash scripts/fetch-mnist.sh --gzip "$dest" || die "could not fetch MNIST into $dest"
      break
    fi
  done
}

pack_torchao() {
  if compgen -G "$WHEELS/torchao-$TORCHAO_VERSION-*.whl" > /dev/null; then
    echo "pack: torchao $TORCHAO_VERSION wheel already in $WHEELS/"
    return 0
  fi
  echo "pack: downloading the torchao $TORCHAO_VERSION wheel into $WHEELS/"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" "torchao==$TORCHAO_VERSION" || die "pip could not download torchao"
}

cmd_pack() {
  local name=${1:-} external=""
  [ -n "$name" ] || die "pack needs a table name: $TABLES all"
  shift
  while [ $# -gt 0 ]; do
    case $1 in
      --external)
        [ $# -ge 2 ] || die "--external needs a folder"
        external=$2
        shift 2
        ;;
      *) die "unknown pack option $1" ;;
    esac
  done
  local tables=$name
  [ "$name" = all ] && tables=$TABLES
  local t
  for t in $tables; do
    [ -n "$(rows_of "$t")" ] || die "unknown table $t (tables: $TABLES all)"
  done
  [ -z "$external" ] || [ -d "$external" ] || die "external folder $external does not exist"
  cd "$ROOT" || die "no repository root"
  local commit
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && commit="$commit+changes"

  # Which binaries: the language-model one by name, with its fallback.
  local bins="" examples="" b have_bins
  have_bins=$(workspace_bins) || die "cargo metadata failed"
  local wanted
  wanted=$(for t in $tables; do binaries_of "$t"; done | tr ' ' '\n' | awk 'NF && !seen[$0]++')
  for b in $wanted; do
    case $b in
      LM)
        if grep -qx "$LM_BIN" <<< "$have_bins"; then
          bins="$bins $LM_BIN"
        elif grep -qx "$LM_FALLBACK" <<< "$have_bins"; then
          echo "pack: no $LM_BIN binary in the workspace; packing $LM_FALLBACK"
          bins="$bins $LM_FALLBACK"
        else
          die "neither $LM_BIN nor $LM_FALLBACK is a binary of the workspace"
        fi
        ;;
      example:*) examples="$examples ${b#example:}" ;;
      *) bins="$bins $b" ;;
    esac
  done
  # What is packed is what the next run runs: binaries, peers and external peers of earlier packs go.
  rm -rf "${PACK:?}/bin" "${PACK:?}/peers" "${PACK:?}/external" "${PACK:?}/PACKED.tsv"
  mkdir -p "$PACK/bin" "$PACK/peers"
  local args=()
  for b in $bins; do args+=(--bin "$b"); done
  if [ ${#args[@]} -gt 0 ]; then
    echo "pack: cargo build --release ${args[*]}"
    cargo build --release "${args[@]}" || die "cargo build failed"
    for b in $bins; do
      strip_copy "target/release/$b" "$PACK/bin/$b"
      record_packed "bin/$b" "$commit"
    done
  fi
  args=()
  for b in $examples; do args+=(--example "$b"); done
  if [ ${#args[@]} -gt 0 ]; then
    echo "pack: cargo build --release ${args[*]}"
    cargo build --release "${args[@]}" || die "cargo build failed"
    for b in $examples; do
      strip_copy "target/release/examples/$b" "$PACK/bin/$b"
      record_packed "bin/$b" "$commit"
    done
  fi

  cp bench/peers/*.py "$PACK/peers/"
  record_packed "peers" "$commit"
  if [ -n "$external" ]; then
    mkdir -p "$PACK/external"
    cp "$external"/peer_*.py "$PACK/external/" || die "no peer_*.py in $external"
    record_packed "external" "from $(basename "$external")"
  fi
  for t in $tables; do
    needs_torchao "$t" && pack_torchao
    [ "$t" = mnist ] && pack_mnist
  done

  local bytes
  bytes=$(du -sb "$PACK" "$WHEELS" 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
  echo "pack: .bench/ and .whl/ hold $((bytes / 1024 / 1024)) MiB (the device tool carries at most 64 MiB)"
  [ "$bytes" -le "$CARRY_LIMIT_BYTES" ] || echo "pack: WARNING: over the carry limit; remove what this call does not need from .bench/bin or .whl" >&2
  du -sh "$PACK"/bin/* "$PACK/mnist" "$WHEELS" 2>/dev/null
  echo "pack: on the GPU machine: bash bench/run.sh ${name/all/NAME} [ROW]   (carry .bench and .whl)"
}

# ---------------------------------------------------------------- unpack (development machine)

cmd_unpack() {
  local file=${1:-} force=${2:-}
  [ -f "$file" ] || die "unpack needs the tarball a run wrote (got '${file}')"
  local base
  base=$(basename "$file")
  base=${base%.tar.gz}
  local dest=$ROOT/docs/results
  # Every member must lie inside the one folder the run wrote.
  local bad
  bad=$(tar -tzf "$file" | grep -v -E "^$base(/|$)" | head -n 3)
  [ -z "$bad" ] || die "$file holds paths outside $base/: $bad"
  if [ -e "$dest/$base" ] && [ "$force" != --force ]; then
    die "$dest/$base exists (add --force to overwrite)"
  fi
  mkdir -p "$dest"
  tar -xzf "$file" -C "$dest" --no-same-owner || die "tar could not extract $file"
  echo "unpack: docs/results/$base"
  [ -f "$dest/$base/summary.md" ] && cat "$dest/$base/summary.md"
}

# ---------------------------------------------------------------- a table (GPU machine)

quote_cmd() {
  local out="" a
  for a in "$@"; do out="$out $(printf '%q' "$a")"; done
  echo "${out# }"
}

# record ROW LABEL COLUMN LOG RC SECONDS COMMAND: one line of runs.tsv
record() {
  local cmd=${7//$'\t'/ }
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$TABLE" "$1" "$2" "$3" "$4" "$5" "$6" "${cmd//$'\n'/ }" >> "$RES/runs.tsv"
}

# Rewrites summary.md and the tarball (after every run, so a call stopped at its limit returns what finished).
pack_results() {
  python3 bench/summarize.py "$RES" > "$RES/summary.md" 2> "$RES/summarize.err" || true
  [ -s "$RES/summarize.err" ] || rm -f "$RES/summarize.err"
  mkdir -p "$OUTDIR"
  tar -czf "$TARBALL.part" -C "$(dirname "$RES")" "$(basename "$RES")" && mv "$TARBALL.part" "$TARBALL"
}

# run_case ROW LABEL COLUMN LIMIT_S CMD...: runs CMD (env assignments through `env`) under a timeout, output
# into RES/ROW.COLUMN.log, and records it.
run_case() {
  local row=$1 label=$2 column=$3 limit=$4
  shift 4
  local log="$row.${column//:/-}.log"
  if [ "$BUDGET" -gt 0 ]; then
    local left=$((BUDGET - ($(date +%s) - START) - 15))
    if [ "$left" -lt 20 ]; then
      record "$row" "$label" "$column" "" skip 0 "$(quote_cmd "$@")"
      echo "$label $column: skipped (time budget)"
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  quote_cmd "$@" >> "$RES/commands.sh"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$RES/$log" 2>&1
  rc=$?
  record "$row" "$label" "$column" "$log" "$rc" "$(($(date +%s) - t0))" "$(quote_cmd "$@")"
  echo "$label $column: rc $rc, $(($(date +%s) - t0)) s (limit $limit s)"
  pack_results
}

not_run() {
  record "$1" "$2" "$3" "" n/a 0 "$4"
  echo "$2 $3: not run ($4)"
}

# The external copy of a peer script, if there is one.
external_peer() {
  [ -n "$EXT" ] && [ -f "$EXT/$1" ] && echo "$EXT/$1"
}

# peer_pair ROW LABEL VARIANT LIMIT SCRIPT ENV_AND_ARGS...: ours-written peer, then the external one.
peer_pair() {
  local row=$1 label=$2 variant=$3 limit=$4 script=$5
  shift 5
  local envs=() args=()
  while [ $# -gt 0 ] && [[ $1 == *=* ]]; do envs+=("$1"); shift; done
  args=("$@")
  run_case "$row" "$label" "peer:$variant" "$limit" env "${envs[@]}" python3 "$PEERS/$script" "${args[@]}"
  local ext
  if ext=$(external_peer "$script"); then
    run_case "$row" "$label" "ext:$variant" "$limit" env "${envs[@]}" python3 "$ext" "${args[@]}"
  fi
}

table_gpt() {
  local row=$1 p b s
  case $row in
    gpt2) p=gpt2 b=16 s=1024 ;;
    gpt2-xl) p=gpt2-xl b=8 s=1024 ;;
    gpt-3b) p=gpt-3b b=4 s=2048 ;;
    gpt-6.7b) p=gpt-6.7b b=1 s=8192 ;;
  esac
  local label="$p, $b x $s"
  if [ "$row" = gpt-6.7b ]; then
    # Ours only, and PyTorch BF16 under a timeout (the external peer has no such preset).
    run_case "$row" "$label" ours 240 "$LM" --speed --device cuda --d-model 4096 --layers 32 --heads 32 \
      --batch-size "$b" --seq-len "$s" --grad-shards bf16 "${OURS_FLAGS[@]}"
    run_case "$row" "$label" peer:bf16 240 env COMPILE=1 python3 "$PEERS/peer_gpt.py" speed bf16 "$p" "$b" "$s"
    return
  fi
  run_case "$row" "$label" ours 240 "$LM" --speed --device cuda --preset "$p" --batch-size "$b" --seq-len "$s" \
    --grad-shards bf16 "${OURS_FLAGS[@]}"
  local mode
  for mode in bf16 fp8; do
    peer_pair "$row" "$label" "$mode" 240 peer_gpt.py COMPILE=1 speed "$mode" "$p" "$b" "$s"
  done
}

table_llama() {
  local row=$1 b s ac=()
  case $row in
    llama-1b) b=4 s=4096 ;;
    llama-3b) b=2 s=4096 ;;
    llama-8b) b=1 s=8192 ac=(AC=full) ;;
  esac
  local label="$row, $b x $s"
  if [ "$(basename "$LM")" = "$LM_BIN" ] && [ "$LM_BIN" != "$LM_FALLBACK" ]; then
    run_case "$row" "$label" ours 240 "$LM" --speed --device cuda --preset "$row" --batch-size "$b" --seq-len "$s" \
      --grad-shards bf16 "${OURS_FLAGS[@]}"
  else
    not_run "$row" "$label" ours "$(basename "$LM") has no Llama presets"
  fi
  local mode
  for mode in bf16 fp8; do
    peer_pair "$row" "$label" "$mode" 240 peer_llama.py COMPILE=1 "${ac[@]}" speed "$mode" "$row" "$b" "$s"
  done
}

table_mlp() {
  local row=$1 d l t
  case $row in
    d4096) d=4096 l=8 t=16384 ;;
    d8192) d=8192 l=4 t=8192 ;;
  esac
  local label="d=$d, $l blocks, $t tokens"
  run_case "$row" "$label" ours 180 "$PACK/bin/mlp_bench" --device cuda --mode fp8 --d "$d" --blocks "$l" \
    --tokens "$t" "${OURS_FLAGS[@]}"
  local mode
  for mode in bf16 fp8; do
    peer_pair "$row" "$label" "$mode" 180 peer_fsdp.py COMPILE=1 "$mode" "$d" "$l" "$t"
  done
}

table_mnist() {
  local row=$1 epochs=${MNIST_EPOCHS:-14}
  local label="MNIST, $epochs epochs"
  run_case "$row" "$label" ours 200 "$PACK/bin/mnist_fsdp" --device cuda --data-dir "$PACK/mnist" \
    --epochs "$epochs" --no-progress --metrics "$RES/$row.ours.jsonl" "${OURS_FLAGS[@]}"
  run_case "$row" "$label" peer:fp32 200 python3 "$PEERS/peer_mnist.py" "$PACK/mnist" adam 1e-3 "$epochs" fp32 1
  local ext
  if ext=$(external_peer peer_mnist.py); then
    # The external script reads only CSV: write it from the IDX files (outside the results folder).
    local csv=$WORK/bench-mnist-csv
    run_case "$row" "$label" prep:csv 120 python3 "$PEERS/mnist_data.py" to-csv "$PACK/mnist" "$csv"
    run_case "$row" "$label" ext:fp32 240 python3 "$ext" "$csv" adam 1e-3 "$epochs" fp32 1
  fi
}

table_layers() {
  local row=$1 label="transformer layer kernels"
  # The peer first: our benches print its figures of this call beside ours (--peer: its JSON lines).
  peer_pair "$row" "$label" layers 300 peer_layers.py
  local peer_log="$RES/$row.peer-layers.log" peer_args=()
  [ -s "$peer_log" ] && peer_args=(--peer "$peer_log")
  run_case "$row" "$label" ours:layer_kernel_bench 150 "$PACK/bin/layer_kernel_bench" "${peer_args[@]}"
  run_case "$row" "$label" ours:attention_bench 240 "$PACK/bin/attention_bench" "${peer_args[@]}"
  run_case "$row" "$label" ours:lm_head_bench 150 "$PACK/bin/lm_head_bench" "${peer_args[@]}"
}

table_kernels() {
  local row=$1 label="single kernels"
  run_case "$row" "$label" ours:kernel_bench 120 "$PACK/bin/kernel_bench"
  run_case "$row" "$label" ours:gemm_bench 180 "$PACK/bin/gemm_bench"
  peer_pair "$row" "$label" kernels 180 peer_kernels.py
  peer_pair "$row" "$label" blockwise 180 peer_blockwise_gemm.py
  # After the blockwise peer: its JSON lines give the peer's figure beside each of our block GEMMs.
  run_case "$row" "$label" ours:block_gemm_bench 180 "$PACK/bin/block_gemm_bench" \
    --peer "$RES/$row.peer-blockwise.log"
}

write_env_facts() {
  {
    echo "date (UTC): $(date -u '+%Y-%m-%d %H:%M:%S')"
    echo "command: bash bench/run.sh $TABLE ${ROWS_ARG}"
    echo "host: $(uname -srm), $(nproc) CPUs, $(free -g | awk '/^Mem:/ { print $2 }') GiB memory"
    echo
    echo "== nvidia-smi"
    nvidia-smi 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv 2>&1
    echo
    echo "== python"
    python3 - << 'PY' 2>&1
import sys
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
    print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
except Exception as e:
    print("torch: not importable:", e)
try:
    import torchao
    print("torchao", torchao.__version__)
except Exception as e:
    print("torchao: not importable:", type(e).__name__)
PY
    echo
    echo "== packed (file, commit, time)"
    cat "$PACK/PACKED.tsv" 2>/dev/null
    echo
    echo "== sha256"
    sha256sum "$LM" "$PACK"/bin/* "$PEERS"/*.py ${EXT:+"$EXT"/*.py} 2>/dev/null | sort -u -k2
    echo
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "PYTHONPATH=${PYTHONPATH:-}"
    echo "BENCH_OURS_FLAGS=${BENCH_OURS_FLAGS:-}"
  } > "$RES/env.txt"
}

cmd_table() {
  TABLE=$1
  ROWS_ARG=${2:-}
  local all rows r
  all=$(rows_of "$TABLE")
  rows=$all
  if [ -n "$ROWS_ARG" ]; then
    rows=${ROWS_ARG//,/ }
    for r in $rows; do
      grep -qw -- "$r" <<< "$all" || die "table $TABLE has no row $r (rows: $all)"
    done
  fi
  cd "$ROOT" || die "no repository root"
  [ -d "$PACK/bin" ] || die "no $PACK/bin: run 'bench/run.sh pack $TABLE' on the development machine and carry .bench"
  PEERS=$PACK/peers
  [ -d "$PEERS" ] || PEERS=bench/peers
  EXT=${BENCH_EXTERNAL:-$PACK/external}
  { [ "$EXT" = none ] || [ ! -d "$EXT" ]; } && EXT=""
  LM=$PACK/bin/$LM_BIN
  if [ ! -x "$LM" ] && [ -x "$PACK/bin/$LM_FALLBACK" ]; then
    LM=$PACK/bin/$LM_FALLBACK
  fi
  local b
  for b in $(binaries_of "$TABLE"); do
    case $b in
      LM) [ -x "$LM" ] || die "neither $PACK/bin/$LM_BIN nor $PACK/bin/$LM_FALLBACK: run 'bench/run.sh pack $TABLE'" ;;
      *) [ -x "$PACK/bin/${b#example:}" ] || die "no $PACK/bin/${b#example:}: run 'bench/run.sh pack $TABLE'" ;;
    esac
  done
  read -r -a OURS_FLAGS <<< "${BENCH_OURS_FLAGS:-}"

  START=$(date +%s)
  if [ -n "${BENCH_BUDGET_S:-}" ]; then
    BUDGET=$BENCH_BUDGET_S
  elif [ -n "${OUT:-}" ]; then
    BUDGET=570
  else
    BUDGET=0
  fi
  local label=$TABLE
  [ -n "$ROWS_ARG" ] && label="$TABLE-${ROWS_ARG//,/-}"
  local stamp
  stamp=$(date -u +%Y-%m-%d-%H%M)
  WORK=${BENCH_WORK:-/tmp}
  RES=$WORK/bench-results/$stamp-$label
  OUTDIR=${OUT:-$ROOT/$PACK/out}
  TARBALL=$OUTDIR/$stamp-$label.tar.gz
  rm -rf "$RES"
  mkdir -p "$RES"
  printf 'table\trow\tlabel\tcolumn\tlog\trc\tseconds\tcommand\n' > "$RES/runs.tsv"
  printf '#!/usr/bin/env bash\n# bench/run.sh %s %s: the commands in the order they ran (from the repository root)\n' \
    "$TABLE" "$ROWS_ARG" > "$RES/commands.sh"

  # shellcheck source=bench/cuda-libs.sh
  source bench/cuda-libs.sh
  export PYTHONUNBUFFERED=1
  if needs_torchao "$TABLE" && ! python3 -c 'import torchao' 2> /dev/null; then
    local wheel
    wheel=$(compgen -G "$WHEELS/torchao-$TORCHAO_VERSION-*.whl" | head -n 1)
    if [ -n "$wheel" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/bench-site" "$wheel" > /dev/null 2>&1 ||
        echo "bench/run.sh: torchao did not install; the fp8 peers will fail" >&2
      export PYTHONPATH=$WORK/bench-site${PYTHONPATH:+:$PYTHONPATH}
    else
      echo "bench/run.sh: no torchao wheel in $WHEELS (pack it); the fp8 peers will fail" >&2
    fi
  fi
  write_env_facts
  echo "bench/run.sh $TABLE: rows $rows; results in $RES; budget ${BUDGET}s; external peers: ${EXT:-none}"

  for r in $rows; do
    "table_$TABLE" "$r"
  done
  pack_results
  echo
  cat "$RES/summary.md"
  echo
  echo "tarball: $TARBALL"
}

case ${1:-help} in
  pack)
    shift
    cmd_pack "$@"
    ;;
  unpack)
    shift
    cmd_unpack "$@"
    ;;
  help | -h | --help) usage ;;
  *)
    [ -n "$(rows_of "$1")" ] || { usage; die "unknown command or table '$1'"; }
    [ $# -le 2 ] || die "too many arguments (NAME [ROW[,ROW...]])"
    cmd_table "$@"
    ;;
esac
