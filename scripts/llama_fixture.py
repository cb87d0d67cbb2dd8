#!/usr/bin/env python3
"""Write a tiny Hugging Face Llama checkpoint and its logits on a fixed input: the reference that our
Llama import, forward pass and export are tested against.

Usage (on the GPU machine, which has PyTorch and transformers; no network is needed, nothing is
downloaded; runs on the CPU):
    python3 scripts/llama_fixture.py fsdp-examples/testdata/llama-tiny-hf
    python3 scripts/llama_fixture.py DIR --rope-scaling llama3     (a variant with Llama 3.1's RoPE scaling)

Its output goes under fsdp-examples/testdata/llama-tiny-hf/ and is committed there (regenerate it only
on purpose: tests compare against those bytes).

The model: `LlamaForCausalLM` shaped like our `llama-tiny` preset (hidden 128, 2 layers, 4 query heads, 2
key/value heads, head dim 32, intermediate 384, tied embeddings), vocabulary 256, 64 positions,
rms_norm_eps 1e-5, rope_theta 500000, float32. Every parameter is drawn from a seeded CPU generator in
name order (matrices normal * 0.05, norm weights 1 + normal * 0.1, so a misplaced norm weight shows),
not from transformers' own initialisation, which may change between versions.

Written into DIR:
  - config.json, model-0000k-of-0000n.safetensors and model.safetensors.index.json: `save_pretrained`
    with max_shard_size="100KB" (several shards and an index), safe serialization, float32;
  - expected_logits.safetensors: `logits` float32 [1, 24, 256] and `input_ids` int32 [1, 24], where
    input_ids[0, i] = (i * 37 + 11) % 256; computed with eager attention on the CPU, then checked equal
    (bit for bit) to the logits of the model loaded back from DIR;
  - expected_logits.json: the input ids, the shapes, the seed, the versions and summary statistics.
"""
import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 20240801
VOCAB = 256
SEQ = 24


def dtype_kwargs(dtype):
    """`dtype=` from transformers 4.56 on (where `torch_dtype=` is deprecated), `torch_dtype=` before."""
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def build_config(rope_scaling):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.02,
    )
    return config


def seeded_init(model):
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda np: np[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 1:  # RMSNorm weights
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.05 * noise)


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float().contiguous()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory to write (created; files in it are overwritten)")
    ap.add_argument("--rope-scaling", choices=["none", "llama3"], default="none")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    rope_scaling = None
    if a.rope_scaling == "llama3":
        # Llama 3.1's values, with the original context shortened to fit 64 positions.
        rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config = build_config(rope_scaling)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float().eval()
    seeded_init(model)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        sys.exit("the head is not tied to the embedding")

    ids = torch.tensor([[(i * 37 + 11) % VOCAB for i in range(SEQ)]], dtype=torch.long)
    logits = logits_of(model, ids)

    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, max_shard_size="100KB", safe_serialization=True)
    reloaded = LlamaForCausalLM.from_pretrained(a.out, attn_implementation="eager",
                                                **dtype_kwargs(torch.float32)).eval()
    again = logits_of(reloaded, ids)
    if not torch.equal(again, logits):
        sys.exit(f"logits of the reloaded model differ: max |diff| {(again - logits).abs().max()}")

    save_file({"logits": logits, "input_ids": ids.to(torch.int32).contiguous()},
              os.path.join(a.out, "expected_logits.safetensors"), metadata={"format": "pt"})
    shards = sorted(f for f in os.listdir(a.out) if f.startswith("model") and f.endswith(".safetensors"))
    params = {n: list(p.shape) for n, p in model.named_parameters()}
    summary = {
        "input_ids": ids[0].tolist(),
        "logits_shape": list(logits.shape),
        "logits_sum": float(logits.double().sum()),
        "logits_abs_max": float(logits.abs().max()),
        "argmax": logits[0].argmax(-1).tolist(),
        "seed": SEED,
        "rope_scaling": rope_scaling,
        "parameters": params,
        "shards": shards,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    with open(os.path.join(a.out, "expected_logits.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(a.out, s)) for s in shards)
    print(f"{a.out}: {len(shards)} shards ({total} bytes), {len(params)} parameters, "
          f"{sum(p.numel() for p in model.parameters())} weights (tied head)")
    print(f"logits {list(logits.shape)}: sum {summary['logits_sum']:.6f}, "
          f"|max| {summary['logits_abs_max']:.6f}, argmax {summary['argmax'][:8]}...")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
