#!/usr/bin/env python3
"""Evaluate a Hugging Face Llama directory (ours exported, or any `LlamaForCausalLM` checkpoint) on an
llm.c token file in PyTorch, with the windows our validation uses.

Usage: python3 scripts/llama_torch_eval.py MODEL_DIR TOKENS [--seq-len 1024] [--batch-size 8]
           [--max-batches N] [--device auto|cpu|cuda] [--dtype f32|bf16] [--attn sdpa|eager]

MODEL_DIR holds config.json and model.safetensors (or shards and model.safetensors.index.json); it is
loaded with `LlamaForCausalLM.from_pretrained(MODEL_DIR)` in float32 (a bf16 export is widened). TOKENS
is a token file or a directory holding val.bin: llm.c's format, a header of 256 little-endian int32
(magic 20240520 and version 1 for uint16 tokens, magic 20240801 and version 7 for uint32 tokens, then
the token count, zeros), then the tokens. Every id must be below the config's vocab_size.

The windows are ValidationWindows' (fsdp-examples/src/data/tokens/windows.rs): W = (n - 1) // T
non-overlapping windows, window i the inputs tokens[i*T : i*T + T] and the targets one token later, in
batches of B consecutive windows (the last batch holds W mod B when that is not 0); --max-batches K uses
the first K batches only, as lm_fsdp --max-val-batches does. The loss is the mean cross-entropy of
float32 logits over each batch's tokens, combined over batches weighted by their window counts, which
is the mean over all windows used.

Prints one JSON line: {"val_loss": ..., "windows": ..., "batches": ..., "tokens": ..., ...}.
"""
import argparse
import json
import os
import struct
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaForCausalLM

HEADER_BYTES = 1024
# magic -> (version, token bytes, dtype of the payload read as signed, mask to undo the sign)
FORMATS = {
    20240520: (1, 2, torch.int16, 0xFFFF),
    20240801: (7, 4, torch.int32, None),
}


def dtype_kwargs(dtype):
    """`dtype=` from transformers 4.56 on (where `torch_dtype=` is deprecated), `torch_dtype=` before."""
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def load_tokens(path):
    """The tokens of an llm.c token file as int64, with its format name."""
    if os.path.isdir(path):
        path = os.path.join(path, "val.bin")
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < HEADER_BYTES:
        sys.exit(f"{path}: {len(raw)} bytes, shorter than the 1024-byte header of an llm.c token file")
    magic, version, n = struct.unpack_from("<3i", raw, 0)
    if magic not in FORMATS:
        sys.exit(f"{path}: magic {magic}, expected 20240520 (u16 tokens) or 20240801 (u32 tokens)")
    want_version, width, dtype, mask = FORMATS[magic]
    if version != want_version:
        sys.exit(f"{path}: version {version}, expected {want_version} for magic {magic}")
    if n < 0 or len(raw) != HEADER_BYTES + width * n:
        sys.exit(f"{path}: {len(raw)} bytes, the header says {n} tokens of {width} bytes "
                 f"({HEADER_BYTES + width * n} bytes)")
    tokens = torch.frombuffer(bytearray(raw[HEADER_BYTES:]), dtype=dtype).to(torch.int64)
    if mask is not None:
        tokens &= mask
    elif n and int(tokens.min()) < 0:
        sys.exit(f"{path}: a u32 id above 2^31 - 1")
    return tokens, ("u16" if width == 2 else "u32"), path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("tokens", help="a token file, or a directory holding val.bin")
    ap.add_argument("--seq-len", type=int, default=1024, help="window length T")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per batch B")
    ap.add_argument("--max-batches", type=int, default=None, help="use the first K batches only")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                    help="activations: f32, or bf16 autocast (weights stay float32)")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    a = ap.parse_args()
    if a.seq_len < 1 or a.batch_size < 1:
        sys.exit("--seq-len and --batch-size must be at least 1")
    if a.max_batches is not None and a.max_batches < 1:
        sys.exit("--max-batches must be at least 1")
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")

    tokens, fmt, tokens_path = load_tokens(a.tokens)
    n = len(tokens)
    windows_all = (n - 1) // a.seq_len if n > 0 else 0
    if windows_all == 0:
        sys.exit(f"{tokens_path}: {n} tokens hold no window of {a.seq_len} inputs and its next target")
    batches = -(-windows_all // a.batch_size)
    if a.max_batches is not None:
        batches = min(batches, a.max_batches)

    model = LlamaForCausalLM.from_pretrained(a.model_dir, attn_implementation=a.attn,
                                             **dtype_kwargs(torch.float32))
    model = model.float().to(device).eval()
    vocab = model.config.vocab_size
    if n and int(tokens.max()) >= vocab:
        sys.exit(f"{tokens_path}: id {int(tokens.max())} is not below the model's vocab_size {vocab}")
    if a.seq_len > model.config.max_position_embeddings:
        print(f"warning: --seq-len {a.seq_len} is above max_position_embeddings "
              f"{model.config.max_position_embeddings}", file=sys.stderr)

    total, used = 0.0, 0
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        for b in range(batches):
            first = b * a.batch_size
            count = min(a.batch_size, windows_all - first)
            rows = torch.stack([tokens[i * a.seq_len:i * a.seq_len + a.seq_len + 1]
                                for i in range(first, first + count)]).to(device)
            logits = model(input_ids=rows[:, :-1]).logits
            mean = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   rows[:, 1:].reshape(-1))
            total += float(mean) * count
            used += count
    print(json.dumps({
        "val_loss": total / used,
        "windows": used,
        "batches": batches,
        "windows_in_file": windows_all,
        "tokens": n,
        "format": fmt,
        "seq_len": a.seq_len,
        "batch_size": a.batch_size,
        "dtype": a.dtype,
        "device": device,
    }))


if __name__ == "__main__":
    main()
