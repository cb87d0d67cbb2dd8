#!/usr/bin/env python3
"""Per-kernel GPU time of one training step, from an Nsight Compute CSV (GPU machine).

    bash scripts/kernel-times.sh [--layers-note TEXT] BINARY ARGS...   runs ncu and this script
    python3 scripts/kernel_times.py NCU.csv [--step-marker NAME]       the table from a CSV already written

ncu (`--metrics gpu__time_duration.sum --csv --page raw`) times every kernel alone, one after another, so
the sum is the step's kernel time without overlap between streams or gaps for the host: it says where the
GPU's work goes, not the step's wall time. The last step is the launches from the last launch whose name
starts with the step marker (the embedding forward, the first kernel of a language-model step) to the end.
The table groups them by kernel name (template arguments and launch shapes dropped) and by category.
"""

import argparse
import csv
import re
import sys
from collections import OrderedDict

CATEGORIES = [
    ("attention", re.compile(r"attn|flash|fmha", re.I)),
    ("GEMM (cuBLASLt)", re.compile(r"gemm|xmma|cutlass|sm90_|nvjet|splitK|matmul", re.I)),
    ("norm (+cast)", re.compile(r"layer_norm|rms|norm", re.I)),
    ("SwiGLU / GELU (+cast)", re.compile(r"swiglu|gelu", re.I)),
    ("RoPE", re.compile(r"rope", re.I)),
    ("cross-entropy / LM head", re.compile(r"cross_entropy|softmax|ce_|logits", re.I)),
    ("optimizer", re.compile(r"adam|optim|master", re.I)),
    ("FP8 casts / amax / scales", re.compile(r"cast|amax|scale|quant|transpose", re.I)),
    ("embedding", re.compile(r"embed|gather", re.I)),
    ("reductions / collectives", re.compile(r"nccl|reduce|sum", re.I)),
]

UNIT_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6}


def category(name):
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def short_name(name):
    # "void foo<bar>(int, ...)" -> "foo"; keep cuBLASLt's long names readable but bounded.
    name = re.sub(r"^void\s+", "", name)
    name = name.split("(")[0]
    name = re.sub(r"<.*>", "", name)
    return name[:90]


def read_launches(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        sys.exit(f"{path}: no CSV rows (did ncu profile any kernel?)")
    header = rows[0]
    try:
        name_col = header.index("Kernel Name")
        time_col = header.index("gpu__time_duration.sum")
    except ValueError:
        sys.exit(f"{path}: no 'Kernel Name' / 'gpu__time_duration.sum' columns: {header[:12]}")
    body = rows[1:]
    scale = 1e-3
    if body and not re.match(r"^[0-9.,]+$", body[0][time_col]):
        # ncu's raw page: the row after the header holds the units.
        scale = UNIT_TO_US.get(body[0][time_col], 1e-3)
        body = body[1:]
    launches = []
    for row in body:
        if len(row) <= max(name_col, time_col):
            continue
        value = row[time_col].replace(",", "")
        try:
            launches.append((row[name_col], float(value) * scale))
        except ValueError:
            continue
    return launches


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--step-marker", default="embedding_fwd")
    args = parser.parse_args()
    launches = read_launches(args.csv)
    starts = [i for i, (name, _) in enumerate(launches) if short_name(name).startswith(args.step_marker)]
    if not starts:
        sys.exit(f"no launch named {args.step_marker}*: cannot find the last step")
    steps = len(starts)
    step = launches[starts[-1]:]
    total = sum(t for _, t in step)
    by_name = OrderedDict()
    by_cat = OrderedDict()
    for name, t in step:
        key = short_name(name)
        n, s = by_name.get(key, (0, 0.0))
        by_name[key] = (n + 1, s + t)
        c = category(name)
        n, s = by_cat.get(c, (0, 0.0))
        by_cat[c] = (n + 1, s + t)
    print(f"{len(launches)} launches profiled, {steps} steps; the last step: {len(step)} launches, "
          f"{total / 1e3:.3f} ms of kernel time (each kernel timed alone)\n")
    print("| category | launches | ms | share |")
    print("| --- | --- | --- | --- |")
    for c, (n, s) in sorted(by_cat.items(), key=lambda kv: -kv[1][1]):
        print(f"| {c} | {n} | {s / 1e3:.3f} | {100 * s / total:.1f} % |")
    print("\n| kernel | launches | ms | share |")
    print("| --- | --- | --- | --- |")
    for k, (n, s) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{k}` | {n} | {s / 1e3:.3f} | {100 * s / total:.1f} % |")


if __name__ == "__main__":
    main()
