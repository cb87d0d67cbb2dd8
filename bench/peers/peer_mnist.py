# PyTorch peer of `mnist_fsdp`: the reference MNIST net (PyTorch's examples/mnist, the FSDP tutorial's model)
# trained on one GPU without FSDP, in F32 (default) or under BF16 autocast.
#
# Net: conv1 Conv2d(1, 32, 3) - ReLU - conv2 Conv2d(32, 64, 3) - ReLU - max-pool 2 - dropout 0.25 - flatten
#   - fc1 Linear(9216, 128) - ReLU - dropout 0.5 - fc2 Linear(128, 10) - log-softmax; NLL loss; PyTorch's
#   default initialisation after torch.manual_seed(SEED) (built on the CPU, then moved).
# Data: pixels / 255, normalised with mean 0.1307 and std 0.3081, held on the GPU (mnist_data.py reads CSV or
#   IDX); each epoch a fresh permutation on the GPU, batches of 64 (the last one shorter), the test set in
#   batches of 1000.
# Optimiser: Adam (`adam`), AdamW (`adamw`, weight decay 0.01) or Adadelta (`adadelta`) at LR, StepLR with
#   step 1 and gamma 0.7 after each epoch. Each training step reads its loss (one host synchronisation per
#   step, as the reference's logging does).
# Prints one JSON line per epoch (epoch, train_loss, test_loss, acc as a fraction, epoch_s: the training
#   pass, device synchronised) and a summary (opt, lr, amp, seed, best_acc, final_acc, load_s).
#
# Usage: peer_mnist.py DATA_DIR OPT LR EPOCHS [fp32|bf16] [SEED]
#   e.g. peer_mnist.py data/mnist adam 1e-3 14
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import mnist_data

USAGE = "usage: peer_mnist.py DATA_DIR adam|adamw|adadelta LR EPOCHS [fp32|bf16] [SEED]"


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
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def to_device(images, labels):
    x = torch.from_numpy(images).float().div_(255.0).sub_(0.1307).div_(0.3081).unsqueeze(1)
    return x.cuda(), torch.from_numpy(labels).long().cuda()


def make_optimizer(name, params, lr):
    if name == "adadelta":
        return torch.optim.Adadelta(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return torch.optim.Adam(params, lr=lr)


def main(argv):
    if len(argv) < 5 or argv[2] not in ("adam", "adamw", "adadelta") \
            or (len(argv) > 5 and argv[5] not in ("fp32", "bf16")):
        sys.exit(USAGE)
    data_dir, opt_name, lr, epochs = argv[1], argv[2], float(argv[3]), int(argv[4])
    amp = len(argv) > 5 and argv[5] == "bf16"
    seed = int(argv[6]) if len(argv) > 6 else 1

    started = time.time()
    x_train, y_train = to_device(*mnist_data.load_split(data_dir, "train"))
    x_test, y_test = to_device(*mnist_data.load_split(data_dir, "test"))
    load_s = time.time() - started

    torch.manual_seed(seed)
    net = Net().cuda()
    opt = make_optimizer(opt_name, net.parameters(), lr)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    accuracies = []
    for epoch in range(1, epochs + 1):
        net.train()
        order = torch.randperm(len(y_train), device="cuda")
        started = time.time()
        loss_sum, batches = 0.0, 0
        for first in range(0, len(y_train), 64):
            idx = order[first:first + 64]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = F.nll_loss(net(x_train[idx]), y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            batches += 1
        torch.cuda.synchronize()
        epoch_s = time.time() - started

        net.eval()
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for first in range(0, len(y_test), 1000):
                out = net(x_test[first:first + 1000])
                target = y_test[first:first + 1000]
                test_loss += F.nll_loss(out, target, reduction="sum").item()
                correct += (out.argmax(dim=1) == target).sum().item()
        schedule.step()
        accuracies.append(correct / len(y_test))
        print(json.dumps({"epoch": epoch, "train_loss": loss_sum / batches, "test_loss": test_loss / len(y_test),
                          "acc": accuracies[-1], "epoch_s": epoch_s}), flush=True)
    print(json.dumps({"opt": opt_name, "lr": lr, "amp": amp, "seed": seed, "best_acc": max(accuracies),
                      "final_acc": accuracies[-1], "load_s": load_s}))


if __name__ == "__main__":
    main(sys.argv)
