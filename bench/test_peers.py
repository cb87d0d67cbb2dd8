#!/usr/bin/env python3
"""CPU tests of the peer scripts in bench/peers: model shapes and parameter names, the math against independent
definitions (scripts/gpt_torch_eval.py's GPT; Hugging Face's LlamaForCausalLM where transformers is installed),
the schedule, the token files, the validation pass, the MNIST readers, and short runs of the GPT, Llama and MLP
peers on the CPU (PEER_DEVICE=cpu: FSDP2 over gloo; the figures of such runs mean nothing).

Needs PyTorch (tests that need it are skipped without it, saying so). Run: python3 bench/test_peers.py
"""
import gzip
import importlib.util
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
import unittest

BENCH = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(BENCH, "peers")
REPO = os.path.dirname(BENCH)
sys.path.insert(0, PEERS)

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_TRANSFORMERS = HAVE_TORCH and importlib.util.find_spec("transformers") is not None
HAVE_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
HAVE_NUMPY = importlib.util.find_spec("numpy") is not None
needs_torch = unittest.skipUnless(HAVE_TORCH, "PyTorch is not installed")
if HAVE_NUMPY:
    import numpy as np

if HAVE_TORCH:
    import torch
    import lm_common
    import peer_gpt
    import peer_llama


def logits_of(model, idx, targets):
    """The LM head's output during model(idx, targets) (the peers return only the loss)."""
    seen = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.no_grad():
        model(idx, targets)
    handle.remove()
    return seen[0]


def sharpen(model):
    """Weights 10x the init's, so that attention is far from uniform and a wrong rotation or mask shows."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)


def write_llmc(path, tokens, magic=20240520):
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", magic, 1, len(tokens), *([0] * 253)))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


@needs_torch
class ModelShapes(unittest.TestCase):
    def count(self, module):
        return sum(p.numel() for p in module.parameters())

    def test_llama_presets_have_the_published_parameter_counts(self):
        # Llama 3.2 1B, 3.2 3B and 3.1 8B as Hugging Face counts them (tied embeddings once).
        for preset, expected in (("llama-1b", 1_235_814_400), ("llama-3b", 3_212_749_824),
                                 ("llama-8b", 8_030_261_248)):
            with torch.device("meta"):
                model = peer_llama.build_model(preset, peer_llama.SPEED_VOCAB)
            self.assertEqual(self.count(model), expected, preset)

    def test_gpt2_counts_the_tied_head_once(self):
        with torch.device("meta"):
            model = peer_gpt.build_model("gpt2", 1024)
        d, vocab = 768, 50304
        expected = vocab * d + 1024 * d + 12 * (2 * d + 12 * d * d) + d
        self.assertEqual(self.count(model), expected)
        self.assertIs(model.lm_head.weight, model.wte.weight)

    def test_init_draws_the_residual_projections_narrower(self):
        torch.manual_seed(0)
        model = peer_gpt.build_model("tiny", 64)
        lm_common.init_weights(model, seed=3, scaled_suffixes=("attn_proj.weight", "mlp_proj.weight"), layers=2)
        std = {n: p.std().item() for n, p in model.named_parameters()}
        self.assertAlmostEqual(std["h.0.c_fc.weight"], 0.02, delta=0.001)
        self.assertAlmostEqual(std["h.1.mlp_proj.weight"], 0.01, delta=0.0007)   # 0.02 / sqrt(2 * 2)
        self.assertEqual(model.h[0].ln_1.weight.min().item(), 1.0)


@needs_torch
@unittest.skipUnless(HAVE_SAFETENSORS, "safetensors (needed by scripts/gpt_torch_eval.py) is not installed")
class GptAgainstTheEvalScript(unittest.TestCase):
    def test_same_names_and_same_loss_as_scripts_gpt_torch_eval(self):
        spec = importlib.util.spec_from_file_location("gpt_torch_eval", os.path.join(REPO, "scripts",
                                                                                     "gpt_torch_eval.py"))
        ref_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref_module)
        torch.manual_seed(0)
        ours = peer_gpt.build_model("tiny", 32)
        lm_common.init_weights(ours, seed=5, scaled_suffixes=("attn_proj.weight", "mlp_proj.weight"), layers=2)
        sharpen(ours)
        ref = ref_module.GPT(50304, 128, 2, 4, 32)
        ref.tie()
        ref.load_state_dict(ours.state_dict(), strict=True)
        idx = torch.randint(0, 50257, (2, 32))
        tgt = torch.randint(0, 50257, (2, 32))
        torch.testing.assert_close(logits_of(ours, idx, tgt), logits_of(ref, idx, tgt), rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            self.assertAlmostEqual(ours(idx, tgt).item(), ref(idx, tgt).item(), places=4)


@needs_torch
@unittest.skipUnless(HAVE_TRANSFORMERS, "Hugging Face transformers is not installed")
class LlamaAgainstHuggingFace(unittest.TestCase):
    def test_state_dict_loads_into_LlamaForCausalLM_and_gives_the_same_loss(self):
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        vocab = 300
        ours = peer_llama.build_model("llama-tiny", vocab)   # d 128, 2 layers, 4 heads, 2 KV heads, ffn 384
        lm_common.init_weights(ours, seed=2, scaled_suffixes=("o_proj.weight", "down_proj.weight"), layers=2)
        with torch.no_grad():
            for layer in ours.model.layers:   # norm weights other than 1, so their use is checked too
                layer.input_layernorm.weight.uniform_(0.5, 1.5)
                layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        sharpen(ours)
        config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
                             max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
                             mlp_bias=False)
        ref = LlamaForCausalLM(config).eval()
        missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
        self.assertEqual(unexpected, [])
        self.assertTrue(all("rotary_emb" in m for m in missing), missing)   # buffers only
        idx = torch.randint(0, vocab, (2, 48))
        tgt = torch.randint(0, vocab, (2, 48))
        with torch.no_grad():
            ref_logits = ref(input_ids=idx).logits
            ref_loss = torch.nn.functional.cross_entropy(ref_logits.float().view(-1, vocab), tgt.view(-1))
            torch.testing.assert_close(logits_of(ours, idx, tgt), ref_logits, rtol=1e-4, atol=1e-4)
            self.assertAlmostEqual(ours(idx, tgt).item(), ref_loss.item(), places=4)


@needs_torch
class Schedule(unittest.TestCase):
    def test_warmup_then_cosine_to_a_tenth(self):
        lr, steps = 6e-4, 105   # warm-up 5 steps, cosine over 100
        self.assertAlmostEqual(lm_common.lr_at(0, steps, lr), lr / 5)
        self.assertAlmostEqual(lm_common.lr_at(4, steps, lr), lr)
        self.assertAlmostEqual(lm_common.lr_at(5, steps, lr), lr)
        self.assertAlmostEqual(lm_common.lr_at(55, steps, lr), 0.55 * lr)   # half-way: lr/10 + 0.45 lr
        self.assertAlmostEqual(lm_common.lr_at(105, steps, lr), lr / 10)
        self.assertAlmostEqual(lm_common.lr_at(0, 10, lr), lr)             # w = max(1, 10 // 20) = 1


@needs_torch
class TokenFiles(unittest.TestCase):
    def test_uint16_tokens_round_trip_and_bad_files_are_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t.bin")
            write_llmc(path, [0, 1, 50256, 40000, 65535])
            self.assertEqual(lm_common.load_tokens(path).tolist(), [0, 1, 50256, 40000, 65535])
            write_llmc(path, [1, 2], magic=7)
            with self.assertRaisesRegex(ValueError, "not an llm.c token file"):
                lm_common.load_tokens(path)
            write_llmc(path, [1, 2, 3])
            with open(path, "ab") as f:
                f.write(b"\0")
            with self.assertRaisesRegex(ValueError, "header says 3 tokens"):
                lm_common.load_tokens(path)

    def test_validation_weights_every_window_once(self):
        class TargetMean(torch.nn.Module):
            def forward(self, x, y):
                return y.float().mean()

        tokens = torch.arange(23, dtype=torch.int32)   # (23 - 1) // 4 = 5 windows, targets 1..20
        # batches of 2, 2 and 1 windows: a mean weighted by windows is the mean of 1..20
        self.assertAlmostEqual(lm_common.validation_loss(TargetMean(), tokens, 2, 4, "cpu"), 10.5)


@needs_torch
class OutOfMemory(unittest.TestCase):
    def test_wrapped_cuda_oom_is_recognised(self):
        try:
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            except torch.OutOfMemoryError as inner:
                raise RuntimeError("backend compiler failed") from inner
        except RuntimeError as outer:
            self.assertTrue(lm_common.is_out_of_memory(outer))
        self.assertFalse(lm_common.is_out_of_memory(ValueError("shape mismatch")))


@unittest.skipUnless(HAVE_NUMPY, "numpy is not installed")
class MnistFiles(unittest.TestCase):
    def test_idx_plain_and_gz_read_and_convert_to_csv(self):
        import mnist_data
        rng = np.random.default_rng(1)
        images = {"train": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
                  "test": rng.integers(0, 256, (2, 28, 28), dtype=np.uint8)}
        labels = {"train": np.array([5, 0, 9], np.uint8), "test": np.array([7, 2], np.uint8)}
        with tempfile.TemporaryDirectory() as tmp:
            idx, csv = os.path.join(tmp, "idx"), os.path.join(tmp, "csv")
            os.makedirs(idx)
            for split, (img_name, lbl_name) in mnist_data.IDX.items():
                with gzip.open(os.path.join(idx, img_name + ".gz"), "wb") as f:
                    f.write(struct.pack(">HBBIII", 0, 8, 3, len(images[split]), 28, 28) + images[split].tobytes())
                with open(os.path.join(idx, lbl_name), "wb") as f:   # plain, beside a gzip file
                    f.write(struct.pack(">HBBI", 0, 8, 1, len(labels[split])) + labels[split].tobytes())
            for split in ("train", "test"):
                got_images, got_labels = mnist_data.load_split(idx, split)
                np.testing.assert_array_equal(got_images, images[split])
                np.testing.assert_array_equal(got_labels, labels[split])
            mnist_data.write_csv(idx, csv, counts={"train": 3, "test": 2})
            with open(os.path.join(csv, "mnist_test.csv")) as f:
                self.assertTrue(f.readline().startswith("label,pixel0,"))
            for split in ("train", "test"):
                got_images, got_labels = mnist_data.load_split(csv, split)
                np.testing.assert_array_equal(got_images, images[split])
                np.testing.assert_array_equal(got_labels, labels[split])
            with self.assertRaisesRegex(ValueError, "expected 60000"):
                mnist_data.write_csv(idx, csv)


@needs_torch
class CpuRuns(unittest.TestCase):
    """Whole peer runs on the CPU: their JSON lines have the keys the summary reads."""

    def run_peer(self, *args, port):
        env = dict(os.environ, PEER_DEVICE="cpu", MASTER_PORT=str(port), PYTHONWARNINGS="ignore")
        r = subprocess.run([sys.executable, *args], cwd=PEERS, env=env, capture_output=True, text=True,
                           timeout=600)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        return [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]

    def test_gpt_speed(self):
        (summary,) = self.run_peer("peer_gpt.py", "speed", "bf16", "tiny", "1", "16", port=29613)
        for key in ("peer", "mode", "compile", "preset", "params", "batch", "seq", "world", "step_s", "tokens_per_s",
                    "model_TFLOPs", "peak_GiB"):
            self.assertIn(key, summary)
        self.assertEqual(summary["tokens_per_s"], 16 / summary["step_s"])

    def test_llama_train_validates_every_tenth_and_ends_with_the_summary(self):
        with tempfile.TemporaryDirectory() as tmp:
            rng = random.Random(0)
            write_llmc(os.path.join(tmp, "train.bin"), [rng.randrange(50257) for _ in range(4000)])
            write_llmc(os.path.join(tmp, "val.bin"), [rng.randrange(50257) for _ in range(200)])
            lines = self.run_peer("peer_llama.py", "train", "bf16", "llama-tiny", "2", "16", "10", tmp, port=29614)
        self.assertEqual([l["step"] for l in lines[:-1]], list(range(1, 11)))
        summary = lines[-1]
        self.assertEqual(summary["final_val_loss"], lines[-2]["val_loss"])
        self.assertTrue(math.log(50304) - 1.5 < summary["final_val_loss"] < math.log(50304) + 1.5)

    def test_mlp_stack(self):
        (summary,) = self.run_peer("peer_fsdp.py", "bf16", "32", "2", "64", port=29615)
        self.assertEqual(summary["params"], 2 * 8 * 32 * 32)
        self.assertAlmostEqual(summary["TFLOPs"], 6 * 2 * 8 * 32 * 32 * 64 / summary["step_s"] / 1e12)


if __name__ == "__main__":
    unittest.main()
