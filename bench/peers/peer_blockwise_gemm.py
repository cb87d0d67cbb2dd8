# PyTorch peer of the FP8 GEMM recipes: TFLOP/s of A [M, K] @ B^T ([N, K]) through PyTorch's cuBLASLt paths,
# BF16 output, GPU time only (gpu_timing.queued_seconds: 20 calls behind a sleep kernel, median of 5 runs, after
# 3 warm-up calls), for
#   bf16                     BF16 x BF16
#   fp8_tensor               E4M3 with one scale per tensor
#   fp8_rowwise              E4M3 with one scale per row of A and per column of the output
#   fp8_block_1x128_128x128  DeepSeek-V3's blocks: A scaled per 1 x 128 (scales [M, K/128], M-major), B per
#                            128 x 128 (scales [K/128, N/128] of B^T, K/128-major)
#   fp8_block_1x128_1x128    both scaled per 1 x 128 along K (B's scales [K/128, N], N-major)
# A path this PyTorch or GPU lacks is reported as its error text in place of the figure.
# Usage: python3 peer_blockwise_gemm.py   (one JSON line per shape: M, K, N and each path's TFLOP/s)
import json

import torch

from gpu_timing import queued_seconds

SHAPES = [(8192, 4096, 14336), (8192, 14336, 4096), (8192, 4096, 4096), (16384, 2560, 10240), (8192, 8192, 8192)]


def main():
    f8 = torch.float8_e4m3fn
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a8, b8 = a.to(f8), b.to(f8)
        flops = 2 * m * k * n
        record = {"M": m, "K": k, "N": n}
        record["bf16"] = flops / queued_seconds(lambda: a @ b.t(), warmup=3) / 1e12

        def scaled(scale_a, scale_b):
            return lambda: torch._scaled_mm(a8, b8.t(), scale_a, scale_b, out_dtype=torch.bfloat16)

        paths = {
            "fp8_tensor": lambda: (torch.tensor(1.0, device="cuda"), torch.tensor(1.0, device="cuda")),
            "fp8_rowwise": lambda: (torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")),
            "fp8_block_1x128_128x128": lambda: (torch.ones(k // 128, m, device="cuda").t(),
                                                torch.ones(n // 128, k // 128, device="cuda").t()),
            "fp8_block_1x128_1x128": lambda: (torch.ones(k // 128, m, device="cuda").t(),
                                              torch.ones(k // 128, n, device="cuda")),
        }
        for name, make_scales in paths.items():
            try:
                record[name] = flops / queued_seconds(scaled(*make_scales()), warmup=3) / 1e12
            except Exception as exc:  # noqa: BLE001 - an unsupported path is a result
                record[name] = str(exc)[:160]
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
