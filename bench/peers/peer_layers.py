# PyTorch peer of `layer_kernel_bench` and `attention_bench`: the transformer layer kernels on one GPU, GPU
# time only (gpu_timing.queued_seconds: 20 calls queued behind a sleep kernel, the median of 5 such runs,
# after 5 warm-up calls; host overhead not counted).
#   attention  causal scaled_dot_product_attention forward + backward in BF16 (gradients of q, k, v cleared
#              before each call), per backend: the default choice, flash, cuDNN, and for grouped-query shapes
#              also cuDNN on K and V repeated to H heads ("cudnn_expanded"); the GPT shapes (KV = H) and the
#              Llama presets' (query head h reads KV head h // (H / KV)). TFLOP/s = 3.5 * (4 B H T^2 hd) / 2 /
#              time (backward 2.5x the forward, causal half).
#   layernorm  LayerNorm (weight, no bias, eps 1e-5) with the E4M3 cast of its output at a given scale
#              (saturating to +-448) and the amax of the output, torch.compile'd; LayerNorm's backward (dx and
#              dweight from a BF16 dy) of a compiled forward. GB/s counts the bytes one pass must move:
#              forward 2 read + 1 written per element, backward 2 + 2 read + 2 written.
#   rmsnorm    the same for RMSNorm (eps 1e-5, normalised in F32 as peer_llama.py) at the Llama widths.
#   lmhead     logits = x W^T in BF16, F.cross_entropy of the F32 logits, forward and backward to dx and dW,
#              compiled; time, and the extra peak memory (the peak minus what the inputs and the two
#              gradients hold).
# Usage: python3 peer_layers.py   (one JSON line per measurement)
import json

import torch
import torch.nn.functional as F
import torch._functorch.config as functorch_config
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_timing import queued_seconds

# The norm backward is replayed from one graph (retain_graph), which compiled graphs refuse when they donate
# their saved buffers.
functorch_config.donated_buffer = False

E4M3_MAX = 448.0
ATTENTION_SHAPES = [  # (B, H, KV, T, hd)
    (16, 12, 12, 1024, 64), (4, 20, 20, 2048, 128), (8, 4, 4, 1024, 32),    # gpt2, gpt-3b, tiny-ish
    (4, 32, 8, 4096, 64), (2, 24, 8, 4096, 128), (1, 32, 8, 8192, 128),     # llama-1b, llama-3b, llama-8b
]
LAYERNORM_SHAPES = [(16384, 768), (8192, 2560)]
RMSNORM_SHAPES = [(16384, 2048), (8192, 3072), (8192, 4096)]
LMHEAD_SHAPES = [(8192, 2560, 50304), (16384, 768, 50304)]


def emit(record):
    print(json.dumps(record), flush=True)


def attention_rows():
    for (B, H, KV, T, hd) in ATTENTION_SHAPES:
        def bf16_input(heads, grad=True):
            return torch.randn(B, heads, T, hd, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        q, k, v = bf16_input(H), bf16_input(KV), bf16_input(KV)
        dout = bf16_input(H, grad=False)
        flops = 3.5 * 4 * B * H * T * T * hd / 2
        backends = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
        if KV != H:
            backends.append(("cudnn_expanded", SDPBackend.CUDNN_ATTENTION))

        for name, backend in backends:
            def fwd_bwd(expanded=(name == "cudnn_expanded")):
                q.grad = k.grad = v.grad = None
                if expanded:
                    r = H // KV
                    out = F.scaled_dot_product_attention(q, k.repeat_interleave(r, dim=1),
                                                         v.repeat_interleave(r, dim=1), is_causal=True)
                else:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
                out.backward(dout)

            record = {"op": "attention_fwd_bwd", "backend": name, "B": B, "H": H, "KV": KV, "T": T, "hd": hd}
            try:
                if backend is None:
                    seconds = queued_seconds(fwd_bwd)
                else:
                    with sdpa_kernel([backend]):
                        seconds = queued_seconds(fwd_bwd)
                record.update(s=seconds, TFLOPs=flops / seconds / 1e12)
            except Exception as exc:  # noqa: BLE001 - a backend missing for a shape is a result
                record.update(error=str(exc)[:120])
            emit(record)


def layer_norm(x, w):
    return F.layer_norm(x, (x.shape[-1],), w, None, 1e-5)


def rms_norm(x, w):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


# Two functions, not one closure over the norm: Dynamo keys its cache and its automatic-dynamic shape marks on
# the code object, so a shared closure would compile the RMSNorm shapes as dynamic from the first call.
def layer_norm_e4m3(x, w, scale):
    y = layer_norm(x, w)
    return (y.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), y.abs().amax().float()


def rms_norm_e4m3(x, w, scale):
    y = rms_norm(x, w)
    return (y.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), y.abs().amax().float()


def norm_rows(name, norm, norm_e4m3, shapes):
    cast_compiled = torch.compile(norm_e4m3)
    forward_compiled = torch.compile(norm)
    for rows, d in shapes:
        x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor(64.0, device="cuda")
        seconds = queued_seconds(lambda: cast_compiled(x, w, scale))
        emit({"op": f"{name}_e4m3_fwd", "rows": rows, "d": d, "s": seconds, "GBps": rows * d * 3 / seconds / 1e9})

        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        dy = torch.randn_like(x)
        y = forward_compiled(xg, wg)

        def backward():
            xg.grad = wg.grad = None
            torch.autograd.backward(y, dy, retain_graph=True)
        seconds = queued_seconds(backward)
        emit({"op": f"{name}_bwd", "rows": rows, "d": d, "s": seconds, "GBps": rows * d * 6 / seconds / 1e9})


@torch.compile
def head_loss(x, w, targets):
    return F.cross_entropy((x @ w.t()).float(), targets)


def lm_head_rows():
    for tokens, d, vocab in LMHEAD_SHAPES:
        x = (torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_(True)
        w = (torch.randn(vocab, d, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
        targets = torch.randint(0, 50257, (tokens,), device="cuda")

        def fwd_bwd():
            x.grad = w.grad = None
            head_loss(x, w, targets).backward()
        seconds = queued_seconds(fwd_bwd)
        fwd_bwd()
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()  # inputs and both gradients
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - baseline
        emit({"op": "lmhead_ce_fwd_bwd", "tokens": tokens, "d": d, "vocab": vocab, "s": seconds,
              "TFLOPs": 6 * tokens * d * vocab / seconds / 1e12, "extra_peak_GiB": extra / 2**30})


def main():
    torch.manual_seed(0)
    attention_rows()
    norm_rows("layernorm", layer_norm, layer_norm_e4m3, LAYERNORM_SHAPES)
    norm_rows("rmsnorm", rms_norm, rms_norm_e4m3, RMSNORM_SHAPES)
    lm_head_rows()


if __name__ == "__main__":
    main()
