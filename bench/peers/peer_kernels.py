# PyTorch peer of `kernel_bench` and `gemm_bench`: single kernels on one GPU, each call timed alone with CUDA
# events (gpu_timing.event_seconds: the median of 50 calls after 10 warm-up ones; 20 calls for the casts).
#   copy_TBps            a BF16 device-to-device copy of 2^29 elements (1 GiB), read + write bytes
#   gemm_MxKxN           A [M, K] @ B^T ([N, K]) in BF16 (TF32 off) against torch._scaled_mm of the E4M3 casts
#                        with unit scales and a BF16 output (cuBLASLt's per-tensor FP8 path): TFLOP/s = 2 M K N /
#                        time, and the FP8 speed-up
#   cast_*_GBps          current scaling of 2^28 BF16 values to E4M3: amax, scale = 448 / amax, saturating cast;
#                        eager and torch.compile'd; bytes counted 2 read + 1 written per element
#   dequant_eager_GBps   E4M3 -> BF16 times a constant, eager, counted the same
# Usage: python3 peer_kernels.py   (prints one JSON object; device and torch name the run)
import json

import torch

from gpu_timing import event_seconds

GEMM_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 28672), (2048, 2048, 2048), (64, 9216, 128)]
E4M3_MAX = 448.0


def copy_tbps():
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = event_seconds(lambda: dst.copy_(src), iters=50, warmup=10)
    return 2 * src.numel() * src.element_size() / seconds / 1e12


def gemm_figures(m, k, n):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bf16_s = event_seconds(lambda: a @ b.t(), iters=50, warmup=10)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="cuda")
    fp8_s = event_seconds(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                          iters=50, warmup=10)
    flops = 2 * m * k * n
    return {"bf16_TFLOPs": flops / bf16_s / 1e12, "fp8_TFLOPs": flops / fp8_s / 1e12, "fp8_speedup": bf16_s / fp8_s}


def cast_figures():
    x = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)

    def cast_current_scaling():
        amax = x.abs().amax().float()
        scale = E4M3_MAX / amax.clamp(min=1e-12)
        return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), amax

    counted_bytes = x.numel() * 3
    out = {"cast_eager_GBps": counted_bytes / event_seconds(cast_current_scaling, iters=20, warmup=10) / 1e9}
    try:
        compiled = torch.compile(cast_current_scaling)
        out["cast_compiled_GBps"] = counted_bytes / event_seconds(compiled, iters=20, warmup=10) / 1e9
    except Exception as exc:  # noqa: BLE001 - a failed compile is reported, the rest still measured
        out["cast_compiled_error"] = str(exc)[:200]
    x8 = x.to(torch.float8_e4m3fn)
    out["dequant_eager_GBps"] = counted_bytes / event_seconds(lambda: x8.to(torch.bfloat16) * 0.5,
                                                              iters=20, warmup=10) / 1e9
    return out


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"copy_TBps": copy_tbps()}
    for m, k, n in GEMM_SHAPES:
        result[f"gemm_{m}x{k}x{n}"] = gemm_figures(m, k, n)
    result.update(cast_figures())
    result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
