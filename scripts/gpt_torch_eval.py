#!/usr/bin/env python3
"""Evaluate an exported fp8-fsdp GPT model in PyTorch.

Usage: python3 scripts/gpt_torch_eval.py WEIGHTS.safetensors VAL.bin [--device cpu|cuda]
           [--batch-size 8] [--max-windows N] [--dtype f32|bf16]

WEIGHTS is the file `gpt_fsdp --export` writes: the master weights named as the PyTorch peer's
`named_parameters()` (`wte.weight` once: the head is tied to it; `wpe.weight` has seq-len rows, which
fixes the window length). VAL.bin is an llm.c token file (256 little-endian int32 header: 20240520, 1,
token count; then uint16 tokens), e.g. data/shakespeare/val.bin. The model is defined here, model only
(no fp8-fsdp code): nanoGPT's GPT-2 without biases, as the peer specifies it (LayerNorm eps 1e-5 weight
only, GELU erf, causal attention, tied head, vocabulary 50304). The shape (d, layers, heads) is read from
the file; the heads from the preset table (d -> heads) unless --heads is given.

Prints the mean cross-entropy (F32 logits) over every non-overlapping window of VAL.bin, window i at
i*T for i = 0 .. (n-1)//T - 1, in batches, weighted by windows: the peer's val_loss, which gpt_fsdp
prints as "val loss".
"""
import argparse, math, struct, sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_model

V = 50304
HEADS = {128: 4, 768: 12, 1024: 16, 1280: 20, 1600: 25, 2560: 20}


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d, eps=1e-5, bias=False)
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.attn_proj = nn.Linear(d, d, bias=False)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5, bias=False)
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.mlp_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d, eps=1e-5, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def tie(self):
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def load_tokens(path):
    with open(path, "rb") as f:
        raw = f.read()
    magic, version, n = struct.unpack_from("<3i", raw, 0)
    if magic != 20240520 or version != 1:
        sys.exit(f"{path}: not an llm.c token file (magic {magic}, version {version})")
    if len(raw) != 1024 + 2 * n:
        sys.exit(f"{path}: {len(raw)} bytes, the header says {n} tokens ({1024 + 2 * n} bytes)")
    return torch.frombuffer(bytearray(raw[1024:]), dtype=torch.int16).to(torch.int32) & 0xFFFF


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("weights")
    ap.add_argument("val")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                    help="activations: f32, or bf16 autocast as the peer's BF16 mixed precision")
    a = ap.parse_args()
    with safe_open(a.weights, "pt") as f:
        names = set(f.keys())
        vocab, d = f.get_slice("wte.weight").get_shape()
        seq = f.get_slice("wpe.weight").get_shape()[0]
    layers = len({n.split(".")[1] for n in names if n.startswith("h.")})
    heads = a.heads or HEADS.get(d)
    if heads is None:
        sys.exit(f"width {d} is no preset's: give --heads")
    model = GPT(vocab, d, layers, heads, seq)
    missing, unexpected = load_model(model, a.weights, strict=False)
    if set(missing) != {"lm_head.weight"} or unexpected:
        sys.exit(f"{a.weights}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.tie()
    model = model.to(a.device).eval()
    va = load_tokens(a.val)
    windows = (len(va) - 1) // seq
    if a.max_windows is not None:
        windows = min(windows, a.max_windows)
    total = 0.0
    with torch.no_grad(), torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        for s0 in range(0, windows, a.batch_size):
            idx = range(s0, min(windows, s0 + a.batch_size))
            w = torch.stack([va[i * seq:i * seq + seq + 1] for i in idx]).long().to(a.device)
            total += model(w[:, :-1].contiguous(), w[:, 1:].contiguous()).item() * len(idx)
    print(f"val loss {total / windows:.4f} over {windows} windows of {seq} tokens "
          f"(d {d}, {layers} layers, {heads} heads, vocabulary {vocab}, {a.dtype}, {a.device})")


if __name__ == "__main__":
    main()
