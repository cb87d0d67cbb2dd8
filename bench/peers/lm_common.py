# What the two language-model peers (peer_gpt.py, peer_llama.py) share: the token files, the training
# schedule, the validation pass, FSDP2 wrapping with the optional torchao FP8 conversion, the optimiser,
# and the two measurements (`speed` and `train`). Each peer supplies only its model.
#
# Conventions both peers specify:
#   token files: llm.c's .bin format, a header of 256 little-endian int32 (magic 20240520, version 1, token
#     count n) then n little-endian uint16 tokens;
#   optimiser: AdamW, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on every parameter of 2 or more dimensions
#     (embeddings included) and 0 on the rest (norm weights), no gradient clipping, fused on the GPU;
#   schedule: peak lr (6e-4, env LR) reached by a linear warm-up over w = max(1, steps // 20) steps
#     (lr * (it + 1) / w), then a cosine from lr down to lr / 10 at the last step;
#   validation: the mean cross-entropy over every non-overlapping window of val.bin (window i is
#     tokens[i*T : i*T + T], its targets the next tokens, i = 0 .. (n - 1) // T - 1), in batches of B,
#     weighted by windows, so that any implementation computes the same number;
#   training batches: B windows per step at offsets drawn from a CPU torch.Generator seeded with seed + rank;
#   speed: one batch of random tokens, 5 untimed steps, then 20 steps each timed from a synchronised device to
#     the device synchronised after the optimiser step; the median (the 11th of the 20 sorted) is reported,
#     and the peak of torch.cuda.max_memory_allocated over the timed steps.
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn

# PEER_DEVICE=cpu runs a peer on the CPU over gloo: a smoke test of the code (bench/test_peers.py), no figure.
DEVICE = os.environ.get("PEER_DEVICE", "cuda")
LLMC_MAGIC = 20240520
WARMUP_STEPS = 5
TIMED_STEPS = 20


class PeerOutOfMemory(Exception):
    """Raised by `run_peer`'s body when the GPU ran out of memory, however PyTorch wrapped it."""


def env_flag(name):
    return os.environ.get(name) == "1"


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def load_tokens(path):
    """The tokens of an llm.c .bin file as an int32 tensor (the values are uint16)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 1024:
        raise ValueError(f"{path}: {len(blob)} bytes, shorter than the 1024-byte llm.c header")
    header = torch.frombuffer(bytearray(blob[:1024]), dtype=torch.int32)
    if header[0].item() != LLMC_MAGIC:
        raise ValueError(f"{path}: magic {header[0].item()}, not an llm.c token file ({LLMC_MAGIC})")
    n = header[2].item()
    if len(blob) != 1024 + 2 * n:
        raise ValueError(f"{path}: the header says {n} tokens but the file holds {(len(blob) - 1024) / 2}")
    raw = torch.frombuffer(bytearray(blob[1024:]), dtype=torch.int16)
    return raw.to(torch.int32) & 0xFFFF


def lr_at(it, steps, lr_max):
    warm = max(1, steps // 20)
    if it < warm:
        return lr_max * (it + 1) / warm
    lr_min = lr_max / 10
    progress = (it - warm) / max(1, steps - warm)
    return lr_min + 0.5 * (lr_max - lr_min) * (1.0 + math.cos(math.pi * progress))


def validation_loss(model, tokens, batch, seq, device):
    windows = (len(tokens) - 1) // seq
    if windows < 1:
        raise ValueError(f"the validation tokens ({len(tokens)}) hold no window of {seq + 1}")
    total = 0.0
    with torch.no_grad():
        for first in range(0, windows, batch):
            rows = [tokens[i * seq:i * seq + seq + 1] for i in range(first, min(windows, first + batch))]
            w = torch.stack(rows).long().to(device)
            total += model(w[:, :-1].contiguous(), w[:, 1:].contiguous()).item() * len(rows)
    return total / windows


def setup_distributed(default_port):
    """One process per GPU; a single process needs no launcher (the variables get their one-rank values)."""
    import torch.distributed as dist
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(default_port)),
                       ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def teardown_distributed():
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def convert_fp8(model, mode):
    """torchao float8 training on every Linear but the LM head: `fp8` tensorwise current scaling with FP8
    all-gather, `fp8row` the rowwise recipe. Returns whether the FP8 scales need the per-step precompute."""
    if mode not in ("fp8", "fp8row"):
        return False
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    if mode == "fp8":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name("rowwise")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn != "lm_head")
    return mode == "fp8"


def shard(model, blocks, mode, compile_blocks, checkpoint_blocks):
    """FSDP2 as torchtitan applies it: each block its own unit (after the optional activation-checkpoint
    wrapper and torch.compile), then the root. `blocks` is the ModuleList holding them; the head + loss
    (`model.head_loss`) is compiled too when the blocks are."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if mode == "fp32":
        policy = MixedPrecisionPolicy()
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in range(len(blocks)):
        block = blocks[i]
        if checkpoint_blocks:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            block = checkpoint_wrapper(block)
            blocks[i] = block
        if compile_blocks:
            block.compile()
        fully_shard(block, mp_policy=policy)
    if compile_blocks:
        model.head_loss = torch.compile(model.head_loss)
    fully_shard(model, mp_policy=policy)


def adamw(model, lr):
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=DEVICE == "cuda")


def make_step(model, opt, precompute_scales):
    if precompute_scales:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if precompute_scales:
            precompute_float8_dynamic_scale_for_fsdp(model)
        return loss
    return step


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0


def measure_speed(step, batch, seq, world, token_high, seed, flops_per_token):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randint(0, token_high, (batch, seq), device=DEVICE, generator=gen)
    y = torch.randint(0, token_high, (batch, seq), device=DEVICE, generator=gen)
    for _ in range(WARMUP_STEPS):
        step(x, y)
    synchronize()
    reset_peak()
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        step(x, y)
        synchronize()
        times.append(time.perf_counter() - start)
    step_s = sorted(times)[TIMED_STEPS // 2]
    tokens = batch * seq * world
    return {"step_s": step_s, "tokens_per_s": tokens / step_s,
            "model_TFLOPs": flops_per_token * tokens / step_s / 1e12, "peak_GiB": peak_gib()}


def measure_training(model, step, opt, batch, seq, steps, data_dir, seed, rank, lr_max):
    train_tokens = load_tokens(os.path.join(data_dir, "train.bin"))
    val_tokens = load_tokens(os.path.join(data_dir, "val.bin"))
    if len(train_tokens) < seq + 2:
        raise ValueError(f"train.bin holds {len(train_tokens)} tokens, too few for windows of {seq + 1}")
    gen = torch.Generator().manual_seed(seed + rank)
    every = max(1, steps // 10)
    started = time.time()
    last = None
    for it in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(it, steps, lr_max)
        offsets = torch.randint(0, len(train_tokens) - seq - 1, (batch,), generator=gen).tolist()
        w = torch.stack([train_tokens[o:o + seq + 1] for o in offsets]).long().to(DEVICE)
        loss = step(w[:, :-1].contiguous(), w[:, 1:].contiguous())
        if (it + 1) % every == 0 or it == steps - 1:
            last = {"step": it + 1, "train_loss": loss.item(),
                    "val_loss": validation_loss(model, val_tokens, batch, seq, DEVICE),
                    "elapsed_s": time.time() - started}
            print(json.dumps(last), flush=True)
    return {"steps": steps, "seed": seed, "final_val_loss": last["val_loss"],
            "elapsed_s": time.time() - started, "peak_GiB": peak_gib()}


class LmRun:
    """The command line and environment of an LM peer: `PEER speed|train MODE PRESET BATCH SEQ [STEPS DATA_DIR]`
    (exits with `usage` when they do not parse), SEED (default 1), LR (default 6e-4), COMPILE, AC."""

    def __init__(self, argv, usage, modes, presets):
        if len(argv) < 6 or argv[1] not in ("speed", "train") or argv[2] not in modes \
                or argv[3] not in presets or (argv[1] == "train" and len(argv) < 8):
            sys.exit(usage)
        self.cmd, self.mode, self.preset = argv[1], argv[2], argv[3]
        self.batch, self.seq = int(argv[4]), int(argv[5])
        self.steps, self.data_dir = (int(argv[6]), argv[7]) if self.cmd == "train" else (None, None)
        self.seed = int(os.environ.get("SEED", "1"))
        self.lr_max = float(os.environ.get("LR", "6e-4"))
        self.compile_blocks = env_flag("COMPILE")
        self.checkpoint_blocks = os.environ.get("AC") == "full"

    def summary(self, vocab):
        """The summary's leading keys (the measurements follow)."""
        return {"peer": "pytorch-fsdp2", "mode": self.mode, "compile": self.compile_blocks,
                "ac": os.environ.get("AC", "none"), "preset": self.preset, "vocab": vocab, "batch": self.batch,
                "seq": self.seq}

    def train_or_measure(self, summary, model, precompute, token_high, flops_per_token, rank, world):
        """The run after the model is built, converted, sharded and initialised: AdamW and the step, then the
        speed measurement (random tokens below `token_high`) or the training run, into `summary`."""
        opt = adamw(model, self.lr_max)
        step = make_step(model, opt, precompute)
        if self.cmd == "speed":
            summary.update(measure_speed(step, self.batch, self.seq, world, token_high, self.seed,
                                         flops_per_token))
        else:
            summary.update(measure_training(model, step, opt, self.batch, self.seq, self.steps, self.data_dir,
                                            self.seed, rank, self.lr_max))


def is_out_of_memory(exc):
    """torch.compile and autograd re-raise a CUDA OOM wrapped in their own exception types."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def run_peer(summary, body):
    """Runs `body(summary)` (which fills `summary`), prints the summary as the last JSON line; an
    out-of-memory run prints it with "error": "OOM" and exits 3."""
    try:
        body(summary)
    except Exception as exc:  # noqa: BLE001 - only OOM is turned into a result, the rest re-raised
        if not is_out_of_memory(exc):
            raise
        summary.update(error="OOM", detail=str(exc)[:200], peak_GiB=peak_gib())
        print(json.dumps(summary), flush=True)
        teardown_distributed()
        sys.exit(3)
    print(json.dumps(summary), flush=True)
    teardown_distributed()


def init_weights(model, seed, scaled_suffixes, layers):
    """nanoGPT's initialisation, drawn on the device after sharding: N(0, 0.02) for every 2-D parameter,
    N(0, 0.02 / sqrt(2 * layers)) for the residual output projections (names ending in `scaled_suffixes`),
    norm weights 1. `named_parameters` yields a tied matrix once."""
    torch.manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, residual_std if name.endswith(scaled_suffixes) else 0.02)
            else:
                nn.init.ones_(p)
