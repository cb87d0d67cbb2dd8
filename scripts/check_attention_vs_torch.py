#!/usr/bin/env python3
"""Compares fp8-kernels' causal attention with PyTorch's flash backend on the same inputs.

Reads what `attention_bench --dump DIR` wrote, one folder per shape:
  qkv.bin  [B, T, 3, H, hd] bf16   (input)        dout.bin [B, T, H, hd] bf16 (input)
  out.bin  [B, T, H, hd]    bf16   (ours)         lse.bin  [B, H, T]     f32  (ours, natural log)
  dqkv.bin [B, T, 3, H, hd] bf16   (ours)         meta.txt "B H T hd scale"
and computes, on the GPU:
  - a float64 reference (plain causal attention, autograd for the gradients) from the same BF16 inputs;
  - PyTorch's flash backend (scaled_dot_product_attention under SDPBackend.FLASH_ATTENTION) in BF16.
For out, dq, dk, dv it prints the max and mean absolute error against the reference, ours and flash's,
and PASS when ours is at most twice flash's in both (the issue's criterion). lse is checked against the
reference alone. Exit status 1 if any comparison fails.

  python3 scripts/check_attention_vs_torch.py DIR [--bench]

--bench also times PyTorch's default, flash and cuDNN backends (forward + backward, median of 20 after 5
warm-up, CUDA events) at the same shapes and prints TFLOP/s = 3.5 * 4*B*H*T^2*hd / 2 / time, the same
formula as attention_bench, for a side-by-side in one session.
"""

import contextlib
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def load_bf16(path, shape, device):
    raw = np.fromfile(path, dtype="<u2")
    assert raw.size == int(np.prod(shape)), f"{path}: {raw.size} values, expected {shape}"
    t = torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16)
    return t.reshape(shape).to(device)


def load_f32(path, shape, device):
    raw = np.fromfile(path, dtype="<f4")
    assert raw.size == int(np.prod(shape)), f"{path}: {raw.size} values, expected {shape}"
    return torch.from_numpy(raw).reshape(shape).to(device)


def split_heads(qkv):
    """[B, T, 3, H, hd] -> three [B, H, T, hd] (views)."""
    return [qkv[:, :, i].transpose(1, 2) for i in range(3)]


def reference(q, k, v, dout, scale):
    """float64 causal attention, its lse and the gradients of sum(out * dout)."""
    q, k, v = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    t = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.softmax(s, dim=-1) @ v
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def flash(q, k, v, dout, scale):
    q, k, v = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def errors(x, ref):
    e = (x.double() - ref).abs()
    return e.max().item(), e.mean().item()


def bench(q, k, v, dout, scale, backend):
    q, k, v = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]

    def step():
        # backend None: PyTorch's own choice, as a user gets it without a context manager.
        with contextlib.nullcontext() if backend is None else sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        print(__doc__)
        sys.exit(2)
    root = args[0]
    do_bench = "--bench" in sys.argv
    dev = torch.device("cuda")
    ok = True
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        meta = os.path.join(d, "meta.txt")
        if not os.path.isfile(meta):
            continue
        b, h, t, hd, scale = open(meta).read().split()
        b, h, t, hd, scale = int(b), int(h), int(t), int(hd), float(scale)
        qkv = load_bf16(os.path.join(d, "qkv.bin"), (b, t, 3, h, hd), dev)
        dout = load_bf16(os.path.join(d, "dout.bin"), (b, t, h, hd), dev).transpose(1, 2)
        ours_out = load_bf16(os.path.join(d, "out.bin"), (b, t, h, hd), dev).transpose(1, 2)
        ours_lse = load_f32(os.path.join(d, "lse.bin"), (b, h, t), dev)
        ours_d = split_heads(load_bf16(os.path.join(d, "dqkv.bin"), (b, t, 3, h, hd), dev))
        q, k, v = split_heads(qkv)

        r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, dout, scale)
        f_out, f_dq, f_dk, f_dv = flash(q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), scale)

        print(f"\n{name}: B{b} H{h} T{t} hd{hd} scale {scale:.4g} (errors against a float64 reference)")
        print(f"  {'tensor':<6} {'ours max':>10} {'flash max':>10} {'ours mean':>10} {'flash mean':>10}  verdict")
        for label, ours, fl, ref in [
            ("out", ours_out, f_out, r_out),
            ("dq", ours_d[0], f_dq, r_dq),
            ("dk", ours_d[1], f_dk, r_dk),
            ("dv", ours_d[2], f_dv, r_dv),
        ]:
            om, oa = errors(ours, ref)
            fm, fa = errors(fl, ref)
            good = om <= 2 * fm and oa <= 2 * fa and bool(torch.isfinite(ours).all())
            ok &= good
            print(f"  {label:<6} {om:>10.3e} {fm:>10.3e} {oa:>10.3e} {fa:>10.3e}  "
                  f"{'PASS' if good else 'FAIL'} (max {om / max(fm, 1e-30):.2f}x, mean {oa / max(fa, 1e-30):.2f}x flash)")
        lm, la = errors(ours_lse, r_lse)
        lse_ok = lm <= 1e-3 * max(1.0, r_lse.abs().max().item())
        ok &= lse_ok
        print(f"  {'lse':<6} {lm:>10.3e} {'-':>10} {la:>10.3e} {'-':>10}  {'PASS' if lse_ok else 'FAIL'}")

        if do_bench:
            flops = 3.5 * 4 * b * h * t * t * hd / 2
            qc, kc, vc, dc = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
            for bname, backend in [
                ("default", None),
                ("flash", SDPBackend.FLASH_ATTENTION),
                ("cuDNN", SDPBackend.CUDNN_ATTENTION),
            ]:
                try:
                    ms = bench(qc, kc, vc, dc, scale, backend)
                    print(f"  torch {bname:<8} fwd+bwd {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
                except RuntimeError as e:
                    print(f"  torch {bname:<8} unavailable: {str(e).splitlines()[0]}")
        del r_out, r_dq, r_dk, r_dv, f_out, f_dq, f_dk, f_dv
        torch.cuda.empty_cache()
    print("\nall comparisons PASS" if ok else "\nsome comparisons FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
