# PyTorch peer of `mlp_bench`: FSDP2 (`fully_shard`, one process, one GPU) training steps of a stack of MLP
# blocks, in BF16 mixed precision (`bf16`: BF16 compute, F32 master weights and reductions) or torchao float8
# (`fp8`: tensorwise current scaling with FP8 all-gather, every linear converted).
#
# Model: LAYERS blocks x -> x + down(GELU_erf(up(x))), up: Linear(D, 4D), down: Linear(4D, D), no biases,
#   PyTorch's default initialisation (on the GPU, torch.manual_seed(0)); each block its own FSDP unit, then
#   the root. Input: TOKENS x D standard normal values in BF16, the same every step. Loss: mean of the squared
#   output (in F32). Optimiser: AdamW, lr 1e-4, PyTorch's defaults otherwise (weight decay 0.01), fused.
# Measurement: 5 untimed steps, then 20 steps each timed from a synchronised device to the device synchronised
#   after the optimiser step (and, for fp8, torchao's scale precompute); the median (the 11th of the 20
#   sorted); torch.cuda.max_memory_allocated over the timed steps. TFLOPs = 6 * parameters * TOKENS / step.
#
# Usage: peer_fsdp.py bf16|fp8 D LAYERS TOKENS
# Env: COMPILE=1 compiles each block; MASTER_PORT (default 29511). Out of GPU memory: {"error": "OOM", ...},
#   exit status 3.
# Prints one JSON line: mode, compile, d, layers, tokens, params, step_s, TFLOPs, peak_GiB.
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import lm_common

USAGE = "usage: peer_fsdp.py bf16|fp8 D LAYERS TOKENS"


class MlpBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def main(argv):
    if len(argv) != 5 or argv[1] not in ("bf16", "fp8"):
        sys.exit(USAGE)
    mode, d, layers, tokens = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    compile_blocks = lm_common.env_flag("COMPILE")
    lm_common.setup_distributed(29511)
    summary = {"mode": mode, "compile": compile_blocks, "d": d, "layers": layers, "tokens": tokens}

    def body(summary):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        torch.manual_seed(0)
        with torch.device(lm_common.DEVICE):
            model = nn.Sequential(*(MlpBlock(d) for _ in range(layers)))
        params = sum(p.numel() for p in model.parameters())
        precompute = False
        if mode == "fp8":
            from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                        precompute_float8_dynamic_scale_for_fsdp)
            convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
            precompute = True
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model:
            if compile_blocks:
                block.compile()
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=lm_common.DEVICE == "cuda")
        x = torch.randn(tokens, d, device=lm_common.DEVICE, dtype=torch.bfloat16)

        def step():
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if precompute:
                precompute_float8_dynamic_scale_for_fsdp(model)

        for _ in range(lm_common.WARMUP_STEPS):
            step()
        lm_common.synchronize()
        lm_common.reset_peak()
        times = []
        for _ in range(lm_common.TIMED_STEPS):
            start = time.perf_counter()
            step()
            lm_common.synchronize()
            times.append(time.perf_counter() - start)
        step_s = sorted(times)[lm_common.TIMED_STEPS // 2]
        summary.update(params=params, step_s=step_s, TFLOPs=6 * params * tokens / step_s / 1e12,
                       peak_GiB=lm_common.peak_gib())

    lm_common.run_peer(summary, body)


if __name__ == "__main__":
    main(sys.argv)
