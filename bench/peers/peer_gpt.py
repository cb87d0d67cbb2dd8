# PyTorch peer of the GPT-2 family runs: nanoGPT's decoder without biases, trained with FSDP2 (`fully_shard`,
# one process per GPU), in BF16 mixed precision (`bf16`: BF16 compute, F32 reductions and master weights),
# plain F32 (`fp32`), or torchao float8 (`fp8`: tensorwise current scaling with FP8 all-gather; the LM head
# stays in BF16).
#
# Model (parameter names are nanoGPT's, the names `gpt_fsdp --export` writes):
#   wte: Embedding(50304, d); wpe: Embedding(T, d); blocks h.N:
#     x = x + attn_proj(causal_SDPA(split_heads(c_attn(ln_1(x)))))
#     x = x + mlp_proj(GELU_erf(c_fc(ln_2(x))))
#   ln_f, then logits = ln_f(x) @ wte.weight^T (the head is tied to the token embedding);
#   LayerNorms have a weight and no bias, eps 1e-5; every linear is bias-free.
#   Init: N(0, 0.02) for every 2-D parameter, N(0, 0.02 / sqrt(2 L)) for attn_proj and mlp_proj, norm weights 1;
#   the weights are drawn on the GPU before conversion and sharding (torch.manual_seed(SEED)).
#   Loss: the mean cross-entropy over all B*T positions of the F32 logits (the 47 padding columns of the
#   vocabulary are not masked).
# Optimiser, schedule, validation, training batches, speed measurement: lm_common.py.
# Model FLOPs per token (nanoGPT's estimate): 6 * (parameters without wpe, the tied matrix once)
#   + 6 * L * T * d (causal attention: half of 12 * L * T * d).
#
# Usage:
#   peer_gpt.py speed bf16|fp8|fp32 PRESET BATCH SEQ                 random tokens in [0, 50257), JSON summary
#   peer_gpt.py train bf16|fp8|fp32 PRESET BATCH SEQ STEPS DATA_DIR  DATA_DIR holds train.bin and val.bin;
#                                                                    one JSON line per validation (every STEPS//10)
# Presets: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt-3b, gpt-6.7b (d 4096, 32 layers, 32 heads).
# Env: COMPILE=1 compiles each block and the final LayerNorm + head + loss; AC=full checkpoints each block's
#   activations; SEED (default 1); LR (default 6e-4); MASTER_PORT (default 29513; distinct ones for runs at
#   once). A run out of GPU memory prints the summary with "error": "OOM" and exits 3.
# The last JSON line is the summary: peer, mode, compile, ac, preset, vocab, params, batch, seq, world, then
#   step_s, tokens_per_s, model_TFLOPs, peak_GiB (speed) or steps, seed, final_val_loss, elapsed_s, peak_GiB.
# `build_model(preset, seq)` can be imported without a GPU or NCCL.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import lm_common

VOCAB = 50304          # GPT-2's 50257 tokens padded to a multiple of 64
TOKEN_IDS = 50257      # random speed tokens are real GPT-2 ids
USAGE = ("usage: peer_gpt.py speed bf16|fp8|fp32 PRESET BATCH SEQ\n"
         "       peer_gpt.py train bf16|fp8|fp32 PRESET BATCH SEQ STEPS DATA_DIR\n"
         "presets: tiny gpt2 gpt2-medium gpt2-large gpt2-xl gpt-3b gpt-6.7b")
PRESETS = {            # name: (d_model, layers, heads)
    "tiny": (128, 2, 4),
    "gpt2": (768, 12, 12),
    "gpt2-medium": (1024, 24, 16),
    "gpt2-large": (1280, 36, 20),
    "gpt2-xl": (1600, 48, 25),
    "gpt-3b": (2560, 32, 20),
    "gpt-6.7b": (4096, 32, 32),
}


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

    def attention(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, d, layers, heads, seq):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5, bias=False)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.head_loss(x, targets)

    def head_loss(self, x, targets):
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def build_model(preset, seq):
    """The model with PyTorch's default initialisation (call lm_common.init_weights for the peer's)."""
    d, layers, heads = PRESETS[preset]
    return GPT(d, layers, heads, seq)


def main(argv):
    run = lm_common.LmRun(argv, USAGE, ("bf16", "fp8", "fp32"), PRESETS)
    d, layers, _heads = PRESETS[run.preset]
    seq = run.seq
    rank, world = lm_common.setup_distributed(29513)
    summary = run.summary(VOCAB)

    def body(summary):
        # Built and initialised on the device before conversion and sharding, as torchao's float8 guide
        # does: on one GPU the whole model fits, and the FP8 all-gather wrappers are made from real weights.
        with torch.device(lm_common.DEVICE):
            model = build_model(run.preset, seq)
        lm_common.init_weights(model, run.seed, ("attn_proj.weight", "mlp_proj.weight"), layers)
        params = sum(p.numel() for p in model.parameters())  # the tied matrix once
        flops_per_token = 6 * (params - seq * d) + 6 * layers * seq * d
        precompute = lm_common.convert_fp8(model, run.mode)
        lm_common.shard(model, model.h, run.mode, run.compile_blocks, run.checkpoint_blocks)
        summary.update(params=params, world=world)
        run.train_or_measure(summary, model, precompute, TOKEN_IDS, flops_per_token, rank, world)

    lm_common.run_peer(summary, body)


if __name__ == "__main__":
    main(sys.argv)
