# PyTorch peer of the Llama-3 family runs: a Llama-3 decoder with Hugging Face transformers'
# LlamaForCausalLM parameter names (a state_dict loads there as is), trained with FSDP2 (`fully_shard` on each
# layer, then the root, as torchtitan applies it; one process per GPU), in BF16 mixed precision (`bf16`), plain
# F32 (`fp32`), torchao float8 tensorwise with FP8 all-gather (`fp8`) or torchao's rowwise recipe (`fp8row`);
# the LM head stays in high precision.
#
# Model:
#   model.embed_tokens: Embedding(V, d); layers model.layers.N:
#     h   = x + self_attn.o_proj(causal_SDPA_GQA(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))),
#           n = input_layernorm(x)
#     out = h + mlp.down_proj(silu(mlp.gate_proj(m)) * mlp.up_proj(m)),  m = post_attention_layernorm(h)
#   model.norm, then logits = lm_head(norm(x)); lm_head is tied to embed_tokens where the preset says so.
#   RMSNorm: weight only, eps 1e-5, normalised in F32, cast back to the input type, then times the weight.
#   No biases. Head dim hd = d / H; q_proj d -> H*hd, k_proj and v_proj d -> KV*hd; query head h reads KV head
#   h // (H / KV) (Hugging Face's repeat_kv; SDPA's enable_gqa).
#   RoPE: theta 500000, no frequency scaling, the rotate-half convention (dimension i pairs with i + hd/2):
#   angles pos * theta^(-2i/hd) in F32, x * cos + rotate_half(x) * sin in F32, cast back to the input type.
#   Init: as peer_gpt.py (N(0, 0.02) for 2-D parameters, N(0, 0.02 / sqrt(2 L)) for o_proj and down_proj,
#   norm weights 1), drawn on the GPU after sharding (the model is built on the meta device, so 8B fits).
#   Loss: the mean cross-entropy over all B*T positions of the F32 logits.
# Vocabulary: 128256 (Llama 3) for `speed`; 50304 (GPT-2 ids of the token files) for `train`.
# Optimiser, schedule, validation, training batches, speed measurement: lm_common.py.
# Model FLOPs per token: 6 * (weights of every linear, the head included) + 6 * L * T * d (causal attention).
#
# Usage:
#   peer_llama.py speed bf16|fp8|fp8row|fp32 PRESET BATCH SEQ                 random tokens in [0, V)
#   peer_llama.py train bf16|fp8|fp8row|fp32 PRESET BATCH SEQ STEPS DATA_DIR  token files as peer_gpt.py
# Presets (d, layers, heads, kv heads, ffn, tied): llama-tiny, llama-small, llama-1b and llama-3b (Llama 3.2
#   shapes), llama-8b (Llama 3.1 8B).
# Env: COMPILE=1 compiles each layer and the final norm + head + loss (so the F32 logits are not all kept);
#   AC=full checkpoints each layer's activations (what a user does when the model does not fit); SEED
#   (default 1); LR (default 6e-4); MASTER_PORT (default 29514). Out of GPU memory: the summary with
#   "error": "OOM", exit status 3.
# The last JSON line is the summary (the keys of peer_gpt.py). `build_model(preset, vocab)` can be imported.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import lm_common

THETA = 500000.0
SPEED_VOCAB = 128256
TRAIN_VOCAB = 50304
USAGE = ("usage: peer_llama.py speed bf16|fp8|fp8row|fp32 PRESET BATCH SEQ\n"
         "       peer_llama.py train bf16|fp8|fp8row|fp32 PRESET BATCH SEQ STEPS DATA_DIR\n"
         "presets: llama-tiny llama-small llama-1b llama-3b llama-8b")
PRESETS = {  # name: (d_model, layers, heads, kv_heads, ffn, tied)
    "llama-tiny": (128, 2, 4, 2, 384, True),
    "llama-small": (768, 12, 12, 4, 2048, True),
    "llama-1b": (2048, 16, 32, 8, 8192, True),
    "llama-3b": (3072, 28, 24, 8, 8192, True),
    "llama-8b": (4096, 32, 32, 8, 14336, False),
}


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x, cos, sin):
    """x: [B, heads, T, hd]; cos, sin: [1, 1, T, hd] in F32."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def rope_tables(seq, head_dim, device):
    inv_freq = 1.0 / (THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)[None, None]
    return angles.cos(), angles.sin()


class LlamaAttention(nn.Module):
    def __init__(self, d, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape

        def heads_first(y, n):
            return y.view(b, t, n, self.head_dim).transpose(1, 2)

        q = apply_rope(heads_first(self.q_proj(x), self.heads), cos, sin)
        k = apply_rope(heads_first(self.k_proj(x), self.kv_heads), cos, sin)
        v = heads_first(self.v_proj(x), self.kv_heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d, heads, kv_heads, ffn):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = LlamaAttention(d, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(d)
        self.mlp = LlamaMLP(d, ffn)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, vocab, d, layers, heads, kv_heads, ffn):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaDecoderLayer(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab, d, layers, heads, kv_heads, ffn, tied):
        super().__init__()
        self.vocab, self.head_dim = vocab, d // heads
        self.model = LlamaModel(vocab, d, layers, heads, kv_heads, ffn)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx, targets):
        cos, sin = rope_tables(idx.shape[1], self.head_dim, idx.device)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.head_loss(x, targets)

    def head_loss(self, x, targets):
        logits = self.lm_head(self.model.norm(x))
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.view(-1))


def build_model(preset, vocab):
    d, layers, heads, kv_heads, ffn, tied = PRESETS[preset]
    return LlamaForCausalLM(vocab, d, layers, heads, kv_heads, ffn, tied)


def main(argv):
    run = lm_common.LmRun(argv, USAGE, ("bf16", "fp8", "fp8row", "fp32"), PRESETS)
    d, layers = PRESETS[run.preset][:2]
    seq = run.seq
    vocab = SPEED_VOCAB if run.cmd == "speed" else TRAIN_VOCAB
    rank, world = lm_common.setup_distributed(29514)
    summary = run.summary(vocab)

    def body(summary):
        with torch.device("meta"):
            model = build_model(run.preset, vocab)
        params = sum(p.numel() for p in model.parameters())  # a tied matrix once
        matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        flops_per_token = 6 * matmul_weights + 6 * layers * seq * d
        precompute = lm_common.convert_fp8(model, run.mode)
        lm_common.shard(model, model.model.layers, run.mode, run.compile_blocks, run.checkpoint_blocks)
        model.to_empty(device=lm_common.DEVICE)
        lm_common.init_weights(model, run.seed, ("o_proj.weight", "down_proj.weight"), layers)
        summary.update(params=params, world=world)
        run.train_or_measure(summary, model, precompute, vocab, flops_per_token, rank, world)

    lm_common.run_peer(summary, body)


if __name__ == "__main__":
    main(sys.argv)
