#!/usr/bin/env python3
"""Evaluate an exported fp8-fsdp MNIST model in PyTorch.

Usage: python3 scripts/mnist_torch_eval.py WEIGHTS.safetensors MNIST_DIR [--device cuda|cpu]

WEIGHTS is the file `mnist_fsdp --export` writes: the master weights named as PyTorch names the
reference net's parameters. MNIST_DIR holds t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (plain or
.gz), as scripts/fetch-mnist.sh writes them. The model is defined here, model only (no fp8-fsdp code):
the net of PyTorch's FSDP MNIST tutorial. Prints the test loss and accuracy in mnist_fsdp's format.
"""
import argparse, gzip, os, struct, sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        sys.exit(f"{path}: not an unsigned-byte IDX file")
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find(dir_, name):
    for cand in (name, name + ".gz"):
        p = os.path.join(dir_, cand)
        if os.path.isfile(p):
            return p
    sys.exit(f"{name}(.gz) not found in {dir_}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("weights")
    ap.add_argument("mnist_dir")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    model = Net()
    state = load_file(a.weights)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    model.to(a.device).eval()
    images = read_idx(find(a.mnist_dir, "t10k-images-idx3-ubyte"))
    labels = read_idx(find(a.mnist_dir, "t10k-labels-idx1-ubyte")).astype(np.int64)
    x = (torch.from_numpy(images.astype(np.float32) / 255.0) - 0.1307) / 0.3081
    x = x.unsqueeze(1)
    y = torch.from_numpy(labels)
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(y), 1000):
            xb, yb = x[i:i + 1000].to(a.device), y[i:i + 1000].to(a.device)
            out = model(xb)
            loss_sum += F.nll_loss(out, yb, reduction="sum").item()
            correct += (out.argmax(dim=1) == yb).sum().item()
    n = len(y)
    print(f"Test set: Average loss: {loss_sum / n:.4f}, Accuracy: {correct}/{n} ({100.0 * correct / n:.2f}%)")


if __name__ == "__main__":
    main()
