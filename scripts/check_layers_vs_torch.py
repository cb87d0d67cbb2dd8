#!/usr/bin/env python3
"""Compare fp8-kernels' LayerNorm, RMSNorm and cross-entropy with PyTorch, in units of BF16 rounding.

Usage (on the GPU machine, in the same call as the export):
    layer_kernel_bench --export /tmp/layers && python3 scripts/check_layers_vs_torch.py /tmp/layers

The export (examples/layer_kernel_bench.rs, `--export DIR`) writes the inputs and our outputs as raw
little-endian files and a manifest.json. This script recomputes the same operations with PyTorch
(F.layer_norm, F.rms_norm, F.cross_entropy and autograd, on CUDA when available) and in float64, and
prints for every output:
  - ours vs torch: the largest and mean difference in units of BF16 rounding (for bf16 outputs: the number
    of bf16 steps between the two values; for f32 outputs: |ours - torch| / ulp_bf16(torch)), and the
    share of identical values;
  - ours vs float64 and torch vs float64, in the same units, to show which side is closer.
A line ends in PASS when ours is within 2 units of torch everywhere, else CHECK. The FP8 codes are
compared with torch's own E4M3 cast (saturating, round to nearest even) of our output and of its own.
Only torch is needed (no numpy).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

DTYPES = {".bf16": torch.bfloat16, ".f32": torch.float32, ".i32": torch.int32, ".u8": torch.uint8}


def load(folder, name, shape):
    dtype = DTYPES[os.path.splitext(name)[1]]
    with open(os.path.join(folder, name), "rb") as f:
        data = bytearray(f.read())
    t = torch.frombuffer(data, dtype=dtype)
    return t.reshape(shape).clone()


def bf16_ulp(ref):
    """The spacing of bf16 values at |ref| (float64 tensor), at least the smallest normal's."""
    a = ref.abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def bf16_steps(a, b):
    """Number of bf16 values between two bf16 tensors (0 when equal), via their ordered bit patterns."""
    def ordered(t):
        i = t.contiguous().view(torch.int16).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (ordered(a) - ordered(b)).abs().to(torch.float64)


def units(ours, ref):
    """|ours - ref| in units of bf16 rounding at ref (float64)."""
    o, r = ours.to(torch.float64), ref.to(torch.float64)
    return (o - r).abs() / bf16_ulp(r)


RESULTS = []


def report(name, ours, torch_val, ref64):
    ours, torch_val = ours.cpu(), torch_val.cpu()
    ref64 = ref64.cpu()
    if ours.dtype == torch.bfloat16 and torch_val.dtype == torch.bfloat16:
        vs_torch = bf16_steps(ours, torch_val)
    else:
        vs_torch = units(ours, torch_val)
    same = (ours.to(torch.float64) == torch_val.to(torch.float64)).double().mean().item()
    ours64, torch64 = units(ours, ref64), units(torch_val, ref64)
    worst = vs_torch.max().item()
    verdict = "PASS" if worst <= 2.0 else "CHECK"
    RESULTS.append(verdict)
    print(f"{name:<26} vs torch: max {worst:7.2f} mean {vs_torch.mean().item():.4f} identical {100 * same:6.2f}%"
          f" | vs f64: ours max {ours64.max().item():6.2f} mean {ours64.mean().item():.3f},"
          f" torch max {torch64.max().item():6.2f} mean {torch64.mean().item():.3f}  {verdict}")


def e4m3_codes(v, scale):
    """torch's E4M3 cast of v * scale (saturating at 448, round to nearest even), as bytes."""
    return (v.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def check_codes(name, codes, ours_y, torch_y, scale):
    codes = codes.cpu()
    from_ours = e4m3_codes(ours_y.cpu(), scale)
    from_torch = e4m3_codes(torch_y.cpu(), scale)
    bad_encode = (codes != from_ours).sum().item()
    same_y = ours_y.cpu().view(torch.int16) == torch_y.cpu().view(torch.int16)
    differ = (codes != from_torch)
    verdict = "PASS" if bad_encode == 0 and (differ & same_y).sum().item() == 0 else "CHECK"
    RESULTS.append(verdict)
    print(f"{name:<26} torch's cast of our output differs from our codes at {bad_encode} of {codes.numel()};"
          f" codes differ from torch's pipeline at {differ.sum().item()} (all where the bf16 outputs differ:"
          f" {(differ & same_y).sum().item() == 0})  {verdict}")


def rms_norm(x, w, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def norms(folder, m, dev):
    rows, d, eps, scale = m["rows"], m["d"], m["eps"], m["scale"]
    f = m["files"]
    x = load(folder, f["x"], (rows, d))
    w = load(folder, f["w"], (d,))
    b = load(folder, f["b"], (d,))
    dy = load(folder, f["dy"], (rows, d))
    for tag in ("ln", "rms"):
        xt = x.to(dev).requires_grad_(True)
        wt = w.to(dev).requires_grad_(True)
        bt = b.to(dev).requires_grad_(True) if tag == "ln" else None
        if tag == "ln":
            y = F.layer_norm(xt, (d,), wt, bt, eps)
        else:
            y = rms_norm(xt, wt, eps)
        y.backward(dy.to(dev))
        # float64 reference from the same bf16 inputs.
        x64 = x.double().requires_grad_(True)
        w64 = w.double().requires_grad_(True)
        b64 = b.double().requires_grad_(True) if tag == "ln" else None
        if tag == "ln":
            mean64 = x64.mean(-1, keepdim=True)
            var64 = (x64 - mean64).pow(2).mean(-1, keepdim=True)
        else:
            mean64 = torch.zeros_like(x64[:, :1])
            var64 = x64.pow(2).mean(-1, keepdim=True)
        rstd64 = 1.0 / torch.sqrt(var64 + eps)
        y64 = (x64 - mean64) * rstd64 * w64 + (b64 if b64 is not None else 0.0)
        y64.backward(dy.double())
        label = "LayerNorm" if tag == "ln" else "RMSNorm"
        ours_y = load(folder, f[f"{tag}_y"], (rows, d))
        report(f"{label} y (bf16)", ours_y, y.detach(), y64.detach())
        if tag == "ln":
            # torch's own statistics (f32) from the kernel F.layer_norm runs.
            _, tmean, trstd = torch.native_layer_norm(x.to(dev), (d,), w.to(dev), b.to(dev), eps)
            tmean, trstd = tmean.reshape(rows), trstd.reshape(rows)
        else:
            # No public RMSNorm statistics in torch: the float64 values rounded to f32 stand in.
            tmean = mean64.detach().reshape(rows).float()
            trstd = rstd64.detach().reshape(rows).float()
        report(f"{label} mean (f32)", load(folder, f[f"{tag}_mean"], (rows,)), tmean,
               mean64.detach().reshape(rows))
        report(f"{label} rstd (f32)", load(folder, f[f"{tag}_rstd"], (rows,)), trstd,
               rstd64.detach().reshape(rows))
        report(f"{label} dx (bf16)", load(folder, f[f"{tag}_dx"], (rows, d)), xt.grad, x64.grad)
        report(f"{label} dweight (f32)", load(folder, f[f"{tag}_dw"], (d,)), wt.grad, w64.grad)
        if tag == "ln":
            report(f"{label} dbias (f32)", load(folder, f[f"{tag}_db"], (d,)), bt.grad, b64.grad)
        check_codes(f"{label} E4M3 codes", load(folder, f[f"{tag}_codes"], (rows, d)), ours_y,
                    y.detach(), scale)


def cross_entropy(folder, m, dev):
    rows, vocab = m["rows"], m["vocab"]
    f = m["files"]
    logits = load(folder, f["logits"], (rows, vocab))
    targets = load(folder, f["targets"], (rows,)).long()
    # As a language-model head does: bf16 logits, the loss in f32, the gradient back to bf16.
    lt = logits.to(dev).float().requires_grad_(True)
    loss_rows = F.cross_entropy(lt, targets.to(dev), reduction="none")
    loss_rows.mean().backward()
    l64 = logits.double().requires_grad_(True)
    lse64 = torch.logsumexp(l64, -1)
    loss64 = lse64 - l64.gather(1, targets[:, None]).squeeze(1)
    loss64.mean().backward()
    report("cross-entropy lse (f32)", load(folder, f["lse"], (rows,)),
           torch.logsumexp(lt.detach(), -1), lse64.detach())
    report("cross-entropy loss (f32)", load(folder, f["loss"], (rows,)), loss_rows.detach(), loss64.detach())
    ours_mean = load(folder, f["loss_sum"], (1,)) / rows
    report("cross-entropy mean (f32)", ours_mean, loss_rows.detach().mean().reshape(1),
           loss64.detach().mean().reshape(1))
    report("cross-entropy grad (bf16)", load(folder, f["grad"], (rows, vocab)), lt.grad.to(torch.bfloat16),
           l64.grad)


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    folder = sys.argv[1]
    with open(os.path.join(folder, "manifest.json")) as fh:
        manifest = json.load(fh)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"check_layers_vs_torch: torch {torch.__version__} on {dev}; our outputs computed on "
          f"{manifest['device']}; units: BF16 rounding steps at the reference value")
    norms(folder, manifest["norm"], dev)
    cross_entropy(folder, manifest["cross_entropy"], dev)
    print(f"{RESULTS.count('PASS')} passed, {RESULTS.count('CHECK')} to check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
