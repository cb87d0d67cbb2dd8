#!/usr/bin/env python3
"""Reference numbers for fsdp-optim's FsdpAdam / FsdpAdamW from torch.optim (plain PyTorch, CPU).

Usage:
    python3 fsdp-optim/scripts/torch_adamw_reference.py > fsdp-optim/tests/data/torch_adamw_reference.json

Inputs (initial weight [4, 16] and bias [4], one gradient per step) are drawn in float32 from a seeded
torch.Generator and written into the JSON, so the Rust test reads them instead of regenerating them. The
optimizers run in float64 on those exact float32 values. Every case restarts from the same inputs.
"""

import json
import sys

import torch

STEPS = 5
SHAPES = {"weight": [4, 16], "bias": [4]}

CASES = [
    # name, optimizer class, keyword arguments, max_grad_norm (torch.nn.utils.clip_grad_norm_) or None
    ("adamw_defaults", "AdamW", dict(), None),
    ("adamw", "AdamW", dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05), None),
    ("adam_weight_decay", "Adam", dict(lr=1e-2, weight_decay=0.1), None),
    ("adamw_maximize_clip", "AdamW", dict(lr=3e-3, weight_decay=0.02, maximize=True), 0.5),
    ("adam_clip", "Adam", dict(lr=5e-3, betas=(0.8, 0.95), weight_decay=0.01), 0.25),
]


def main() -> None:
    gen = torch.Generator().manual_seed(20261202)
    init = {k: (torch.rand(s, generator=gen, dtype=torch.float32) * 2 - 1) * 0.5 for k, s in SHAPES.items()}
    grads = []
    for t in range(STEPS):
        # A gradient scale that changes across steps, so the moments see different magnitudes.
        mag = 0.1 * (1.0 + 0.5 * (t % 3))
        grads.append({k: (torch.rand(s, generator=gen, dtype=torch.float32) * 2 - 1) * mag for k, s in SHAPES.items()})

    cases = []
    for name, cls, kwargs, max_norm in CASES:
        params = {k: v.detach().clone().to(torch.float64).requires_grad_(True) for k, v in init.items()}
        # foreach=False: the single-tensor implementation, PyTorch's reference formula.
        opt = getattr(torch.optim, cls)(list(params.values()), foreach=False, **kwargs)
        for t in range(STEPS):
            for k, p in params.items():
                p.grad = grads[t][k].to(torch.float64).clone()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
            opt.step()
        group = opt.param_groups[0]
        cases.append(
            {
                "name": name,
                "optimizer": cls,
                "lr": group["lr"],
                "betas": list(group["betas"]),
                "eps": group["eps"],
                "weight_decay": group["weight_decay"],
                "maximize": bool(group.get("maximize", False)),
                "max_grad_norm": max_norm,
                "steps": STEPS,
                "result": {k: p.detach().reshape(-1).tolist() for k, p in params.items()},
            }
        )

    out = {
        "generator": "fsdp-optim/scripts/torch_adamw_reference.py",
        "torch_version": torch.__version__,
        "dtype": "float64 optimizer on float32 inputs",
        "shapes": SHAPES,
        "init": {k: v.reshape(-1).tolist() for k, v in init.items()},
        "grads": [{k: v.reshape(-1).tolist() for k, v in g.items()} for g in grads],
        "cases": cases,
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
