#!/usr/bin/env bash
# The GPU tests: every test marked `#[ignore = "needs a CUDA GPU"]` and every `*_check` example, built
# here and run on a GPU machine that has no cargo (docs/testing.md).
#
#   scripts/gpu-tests.sh pack          (here, with cargo) builds the release test binaries and examples,
#                                      copies the ones needed, stripped, into .gpu/tests/ with a manifest
#   scripts/gpu-tests.sh run [REGEX]   (on the GPU machine, from the repository root, with .gpu/ beside it)
#                                      runs each GPU test in its own process and each example, writes the
#                                      full log to $OUT (if set) and prints one table last; exits non-zero
#                                      if anything failed. REGEX limits the run to rows whose
#                                      "binary test" label matches (grep -E).
#
# Settings (environment): GPU_TEST_TIMEOUT (seconds per test or example, default 600), GPUS (GPUs for
# the multi-rank example rows, default: as many as nvidia-smi lists).
set -euo pipefail
cd "$(dirname "$0")/.."

PACK=.gpu/tests
MANIFEST=$PACK/manifest.tsv
# The reason string that marks a GPU test (the only ignored tests this script runs).
GPU_REASON="needs a CUDA GPU"
# Examples that are NCCL ranks: also run with one rank per GPU when the machine has several.
MULTI_RANK_EXAMPLES="nccl_check shard_gpu_check"

die() {
  echo "gpu-tests: $*" >&2
  exit 1
}

pack() {
  command -v jq >/dev/null || die "jq is needed to read cargo's JSON (apt-get install jq)"
  command -v strip >/dev/null || die "strip (binutils) is needed"
  local json
  json=$(mktemp)
  trap 'rm -f "$json"' RETURN
  echo "gpu-tests: building the release test binaries and examples (cargo test --release --workspace --no-run)"
  cargo test --release --workspace --no-run --message-format=json >"$json"
  rm -rf "$PACK"
  mkdir -p "$PACK"
  # Absolute paths of committed test data are compiled in (env!("CARGO_MANIFEST_DIR")): `run` links this
  # root to the repository there when the path does not exist.
  printf 'root\t%s\n' "$PWD" >"$MANIFEST"

  local tests=0 binaries=0 other=0
  # Test binaries: package directory (relative), target name, executable.
  while IFS=$'\t' read -r pkgdir target exe; do
    local names
    names=$("$exe" --list --ignored 2>/dev/null | sed -n 's/: test$//p')
    [ -n "$names" ] || continue
    # Without --ignored, libtest prints each ignored test's reason and runs nothing.
    local reasons gpu name_list
    mapfile -t name_list <<<"$names"
    reasons=$("$exe" --exact "${name_list[@]}" 2>/dev/null | sed -n 's/^test \(.*\) \.\.\. ignored\(, \(.*\)\)\?$/\1\t\3/p')
    gpu=$(awk -F'\t' -v r="$GPU_REASON" '$2 == r { print $1 }' <<<"$reasons")
    while IFS=$'\t' read -r name reason; do
      [ "$reason" = "$GPU_REASON" ] && continue
      echo "gpu-tests: not packed (ignored for another reason): $pkgdir/$target $name: ${reason:-no reason given}"
      other=$((other + 1))
    done <<<"$reasons"
    [ -n "$gpu" ] || continue
    local file="${pkgdir//\//_}.$target"
    strip -o "$PACK/$file" "$exe"
    binaries=$((binaries + 1))
    while IFS= read -r name; do
      printf 'test\t%s\t%s\t%s\t%s\n' "$pkgdir" "$target" "$file" "$name" >>"$MANIFEST"
      tests=$((tests + 1))
    done <<<"$gpu"
  done < <(jq -r --arg root "$PWD/" 'select(.reason == "compiler-artifact" and .executable != null and .profile.test)
      | [(.manifest_path | ltrimstr($root) | rtrimstr("/Cargo.toml")), .target.name, .executable] | @tsv' "$json")

  local examples=0
  while IFS=$'\t' read -r pkgdir target exe; do
    strip -o "$PACK/$target" "$exe"
    printf 'example\t%s\t%s\t%s\t\n' "$pkgdir" "$target" "$target" >>"$MANIFEST"
    examples=$((examples + 1))
  done < <(jq -r --arg root "$PWD/" 'select(.reason == "compiler-artifact" and .executable != null and (.target.kind | index("example")) and (.target.name | endswith("_check")))
      | [(.manifest_path | ltrimstr($root) | rtrimstr("/Cargo.toml")), .target.name, .executable] | @tsv' "$json" | sort -u)

  # The launcher, for the multi-rank rows.
  local launcher
  launcher=$(jq -r 'select(.reason == "compiler-artifact" and .executable != null and .target.name == "fsdp-run" and (.target.kind | index("bin"))) | .executable' "$json" | head -n 1)
  [ -n "$launcher" ] || die "the fsdp-run binary was not built"
  strip -o "$PACK/fsdp-run" "$launcher"
  # Rows in a stable order: tests by package, binary and name, then examples.
  local sorted
  sorted=$({ grep '^root' "$MANIFEST"; grep '^test' "$MANIFEST" | LC_ALL=C sort -t$'\t' -k2,2 -k3,3 -k5,5; grep '^example' "$MANIFEST" | LC_ALL=C sort -t$'\t' -k2,3; } || true)
  printf '%s\n' "$sorted" >"$MANIFEST"

  [ "$tests" -gt 0 ] || die "no test is marked '#[ignore = \"$GPU_REASON\"]': nothing to pack"
  echo "gpu-tests: packed $tests GPU tests from $binaries test binaries, $examples examples and fsdp-run into $PACK ($(du -sh "$PACK" | cut -f1)); $other other ignored tests left out"
  git check-ignore -q .gpu || echo "gpu-tests: note: .gpu/ is not ignored by git here"
}

# Runs one row: label columns, command, working directory. Appends to the table and the log.
ROWS=()
FAILED=0
PASSED=0
TOTAL_SECONDS=0
run_row() {
  local kind=$1 binary=$2 name=$3 dir=$4 check=$5
  shift 5
  local log t0 t1 secs status rc=0
  log=$(mktemp)
  t0=$(date +%s.%N)
  (cd "$dir" && timeout "${GPU_TEST_TIMEOUT:-600}" "$@") >"$log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" -eq 0 ] && { [ -z "$check" ] || grep -q "$check" "$log"; }; then
    status=pass
    PASSED=$((PASSED + 1))
  elif [ "$rc" -eq 124 ]; then
    status="FAIL (timeout)"
    FAILED=$((FAILED + 1))
  elif [ "$rc" -eq 0 ]; then
    status="FAIL (did not run)"
    FAILED=$((FAILED + 1))
  else
    status="FAIL (exit $rc)"
    FAILED=$((FAILED + 1))
  fi
  TOTAL_SECONDS=$(awk -v a="$TOTAL_SECONDS" -v b="$secs" 'BEGIN { printf "%.1f", a + b }')
  ROWS+=("$(printf '%s\t%s\t%s\t%s\t%s' "$kind" "$binary" "$name" "$status" "$secs")")
  {
    echo "===== $kind $binary $name: $status, $secs s"
    echo "\$ (cd $dir && $*)"
    # Long outputs keep their head and tail.
    if [ "$(wc -l <"$log")" -gt 4000 ]; then
      head -n 2000 "$log"
      echo "[... $(($(wc -l <"$log") - 4000)) lines left out ...]"
      tail -n 2000 "$log"
    else
      cat "$log"
    fi
    echo
  } >>"$LOG"
  rm -f "$log"
  echo "gpu-tests: $status  $binary $name ($secs s)"
}

run() {
  local filter=${1:-}
  [ -f "$MANIFEST" ] || die "$MANIFEST is missing: run 'scripts/gpu-tests.sh pack' where cargo is, and bring .gpu/ here"
  # The CUDA libraries onto LD_LIBRARY_PATH (the same finder as the benchmarks'; it is not written for
  # errexit or pipefail).
  set +eu +o pipefail
  # shellcheck source=bench/cuda-libs.sh
  source bench/cuda-libs.sh
  set -eu -o pipefail
  local out=${OUT:-}
  if [ -n "$out" ]; then
    mkdir -p "$out"
    LOG=$out/gpu-tests.log
  else
    LOG=$(mktemp /tmp/gpu-tests.XXXXXX.log)
  fi
  : >"$LOG"
  local here=$PWD
  local root
  root=$(awk -F'\t' '$1 == "root" { print $2 }' "$MANIFEST")
  if [ -n "$root" ] && [ "$root" != "$here" ] && [ ! -e "$root" ]; then
    # Committed test data is found through the build machine's absolute paths.
    if mkdir -p "$(dirname "$root")" 2>/dev/null && ln -s "$here" "$root" 2>/dev/null; then
      echo "gpu-tests: linked $root (the build's repository path) to $here"
    else
      echo "gpu-tests: warning: could not link $root to $here; tests that read committed data will fail"
    fi
  fi
  local gpus=${GPUS:-}
  if [ -z "$gpus" ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "$gpus" -ge 1 ] 2>/dev/null || gpus=1
  fi
  nvidia-smi -L 2>/dev/null | tee -a "$LOG" || echo "gpu-tests: nvidia-smi not found" | tee -a "$LOG"

  local kind pkgdir target file name
  while IFS=$'\t' read -r kind pkgdir target file name; do
    case $kind in
      test)
        [ -z "$filter" ] || grep -Eq -- "$filter" <<<"$pkgdir/$target $name" || continue
        run_row test "$pkgdir/$target" "$name" "$here/$pkgdir" "test result: ok. 1 passed" \
          "$here/$PACK/$file" --ignored --exact "$name" --test-threads=1 --nocapture
        ;;
    esac
  done <"$MANIFEST"
  while IFS=$'\t' read -r kind pkgdir target file name; do
    [ "$kind" = example ] || continue
    [ -z "$filter" ] || grep -Eq -- "$filter" <<<"$pkgdir/example $target" || continue
    run_row example "$pkgdir/example" "$target" "$here/$pkgdir" "" "$here/$PACK/$file"
    if [ "$gpus" -gt 1 ] && [[ " $MULTI_RANK_EXAMPLES " == *" $target "* ]]; then
      run_row example "$pkgdir/example" "$target (fsdp-run --nproc $gpus)" "$here/$pkgdir" "" \
        "$here/$PACK/fsdp-run" --nproc "$gpus" -- "$here/$PACK/$file"
    fi
  done <"$MANIFEST"

  local tests=0 examples=0 row
  for row in "${ROWS[@]}"; do
    case $row in
      test*) tests=$((tests + 1)) ;;
      example*) examples=$((examples + 1)) ;;
    esac
  done
  echo "gpu-tests: full log in $LOG"
  {
    echo
    {
      printf 'kind\tbinary\ttest or example\tresult\tseconds\n'
      printf '%s\n' "${ROWS[@]}"
    } | aligned
    echo "total: $tests tests, $examples examples; $PASSED passed, $FAILED failed; $TOTAL_SECONDS s"
  } | tee -a "$LOG" | tee "${out:-${TMPDIR:-/tmp}}/gpu-tests-table.txt"
  [ "$FAILED" -eq 0 ]
}

# Tab-separated rows as aligned columns (the last, seconds, right-aligned).
aligned() {
  awk -F'\t' '{
      for (i = 1; i <= NF; i++) { cell[NR, i] = $i; if (length($i) > w[i]) w[i] = length($i) }
      if (NF > nf) nf = NF
    }
    END {
      for (r = 1; r <= NR; r++) {
        line = ""
        for (i = 1; i < nf; i++) line = line sprintf("%-" w[i] "s  ", cell[r, i])
        print line sprintf("%" w[nf] "s", cell[r, nf])
      }
    }'
}

case ${1:-} in
  pack) pack ;;
  run) run "${2:-}" ;;
  *)
    echo "usage: scripts/gpu-tests.sh pack | run [REGEX]" >&2
    exit 2
    ;;
esac
