#!/usr/bin/env python3
"""CPU tests of bench/summarize.py on made-up results folders (the log formats of our binaries and the peers).

Run: python3 bench/test_summarize.py   (or python3 -m unittest discover -s bench)
"""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import summarize  # noqa: E402


class Folder:
    """A results folder being written: runs.tsv and the logs."""

    def __init__(self, table):
        self.tmp = tempfile.TemporaryDirectory()
        self.path = self.tmp.name
        self.table = table
        with open(os.path.join(self.path, "runs.tsv"), "w") as f:
            f.write("table\trow\tlabel\tcolumn\tlog\trc\tseconds\tcommand\n")

    def add(self, row, label, column, text, rc="0", log=True):
        name = f"{row}.{column.replace(':', '-')}.log" if log else ""
        if log:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(text)
        with open(os.path.join(self.path, "runs.tsv"), "a") as f:
            f.write(f"{self.table}\t{row}\t{label}\t{column}\t{name}\t{rc}\t12\tcmd {column}\n")
        return name

    def add_runs(self, label, runs):
        """One row named as the table, `label`, with a run per column: {column: log text}."""
        for column, text in runs.items():
            self.add(self.table, label, column, text)

    def write(self, name, text):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(text)

    def summary(self):
        return summarize.summarize(self.path)


def line(**fields):
    return json.dumps(fields) + "\n"


def row_of(md, first_cell):
    """The cells of the Markdown table row whose first cell is `first_cell`."""
    for text in md.splitlines():
        cells = [c.strip() for c in text.strip().strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{md}")


class JsonObjects(unittest.TestCase):
    def test_single_line_indented_and_noise(self):
        text = ("warning: something {not json}\n" + line(a=1) + "| table | row |\n"
                + json.dumps({"b": {"c": 2}}, indent=1) + "\n  {\"indented\": true}\n" + line(d=[1, 2]))
        self.assertEqual(summarize.json_objects(text), [{"a": 1}, {"b": {"c": 2}}, {"d": [1, 2]}])


class LanguageModelTable(unittest.TestCase):
    def setUp(self):
        f = Folder("gpt")
        ours_text = "gpt_fsdp --speed: gpt2 ...\n| quantity | value |\n" + line(
            impl="fp8-fsdp", step_s=0.0366, tokens_per_s=447100.0, model_TFLOPs=300.0, peak_GiB=5.39)
        f.add("gpt2", "gpt2, 16 x 1024", "ours", ours_text)
        f.add("gpt2", "gpt2, 16 x 1024", "peer:bf16", "compile noise\n" + line(
            peer="pytorch-fsdp2", mode="bf16", step_s=0.0514, tokens_per_s=318700.0, peak_GiB=15.30))
        f.add("gpt2", "gpt2, 16 x 1024", "ext:bf16", line(mode="bf16", tokens_per_s=310000.0, peak_GiB=15.31))
        f.add("gpt2", "gpt2, 16 x 1024", "peer:fp8", line(mode="fp8", tokens_per_s=176900.0, peak_GiB=13.67))
        f.add("gpt2", "gpt2, 16 x 1024", "ext:fp8", line(mode="fp8", tokens_per_s=160000.0, peak_GiB=13.67))
        f.add("gpt2-xl", "gpt2-xl, 8 x 1024", "ours", "killed\n", rc="124")
        f.add("gpt2-xl", "gpt2-xl, 8 x 1024", "peer:bf16", "", rc="skip", log=False)
        f.add("gpt-6.7b", "gpt-6.7b, 1 x 8192", "ours", line(tokens_per_s=11600.0, peak_GiB=77.9))
        f.add("gpt-6.7b", "gpt-6.7b, 1 x 8192", "peer:bf16",
              line(mode="bf16", error="OOM", detail="CUDA out of memory", peak_GiB=130.0), rc="3")
        self.md = f.summary()

    def test_ratios_against_the_faster_peer_and_bf16_memory(self):
        cells = row_of(self.md, "gpt2, 16 x 1024")
        self.assertEqual(cells[1], "447.1k tok/s, 5.39 GiB")
        self.assertEqual(cells[2], "318.7k tok/s, 15.30 GiB")
        self.assertEqual(cells[3], "176.9k tok/s, 13.67 GiB")
        self.assertEqual(cells[4], "1.40x (PyTorch BF16)")   # 447.1 / 318.7
        self.assertEqual(cells[5], "0.35x")                  # 5.39 / 15.30

    def test_failures_are_named_not_counted(self):
        xl = row_of(self.md, "gpt2-xl, 8 x 1024")
        self.assertEqual(xl[1], "timed out")
        self.assertEqual(xl[2], "skipped (time budget)")
        self.assertEqual(xl[4], "-")
        big = row_of(self.md, "gpt-6.7b, 1 x 8192")
        self.assertEqual(big[1], "11.6k tok/s, 77.90 GiB")
        self.assertEqual(big[2], "out of memory")
        self.assertEqual(big[4], "-")

    def test_agreement_with_the_external_peer(self):
        self.assertIn("## Our peer scripts beside the external ones", self.md)
        bf16 = [l for l in self.md.splitlines() if "| bf16 | tokens_per_s |" in l][0]
        self.assertIn("1.028", bf16)        # 318700 / 310000
        self.assertTrue(bf16.rstrip(" |").endswith("yes"))
        fp8 = [l for l in self.md.splitlines() if "| fp8 | tokens_per_s |" in l][0]
        self.assertIn("1.106", fp8)         # 176900 / 160000: outside 3 %
        self.assertIn("**no**", fp8)

    def test_runs_section_lists_every_run(self):
        runs = self.md.split("## Runs")[1]
        self.assertEqual(sum(1 for l in runs.splitlines() if l.startswith("| gpt")), 9)


class MlpTable(unittest.TestCase):
    def test_step_ratio_is_against_the_faster_peer(self):
        f = Folder("mlp")
        label = "d=4096, 8 blocks, 16384 tokens"
        f.add("d4096", label, "ours", "| final loss | 0.6 |\n" + json.dumps(
            {"bench": "mlp_bench", "step_s": 0.1179, "peak_GiB": 17.22, "TFLOPs": 900.0}, separators=(",", ":")))
        f.add("d4096", label, "peer:bf16", line(mode="bf16", step_s=0.1787, peak_GiB=22.31))
        f.add("d4096", label, "peer:fp8", "SyntaxWarning\n" + line(mode="fp8", step_s=0.1341, peak_GiB=19.38))
        cells = row_of(f.summary(), label)
        self.assertEqual(cells[1], "0.1179 s, 17.22 GiB")
        self.assertEqual(cells[4], "0.88x (torchao FP8)")   # 0.1179 / 0.1341
        self.assertEqual(cells[5], "0.77x")                 # 17.22 / 22.31


class MnistTable(unittest.TestCase):
    def test_accuracy_difference_and_epoch_time_ratio(self):
        f = Folder("mnist")
        label = "MNIST, 3 epochs"
        f.add("mnist", label, "ours", "Train Epoch: 1 \tLoss: 0.2\n")
        f.write("mnist.ours.jsonl", "".join(json.dumps({"epoch": e, "test_accuracy": a, "train_seconds": s}) + "\n"
                                            for e, a, s in ((1, 98.47, 1.80), (2, 98.82, 1.29), (3, 99.00, 1.31))))
        f.add("mnist", label, "peer:fp32", "".join(line(epoch=e, acc=a, epoch_s=s) for e, a, s in
                                                  ((1, 0.9853, 2.83), (2, 0.9889, 2.06), (3, 0.9895, 2.12)))
              + line(opt="adam", final_acc=0.9895))
        f.add("mnist", label, "ext:fp32", "".join(line(epoch=e, acc=a, epoch_s=s) for e, a, s in
                                                 ((1, 0.9853, 2.90), (2, 0.9889, 2.08), (3, 0.9895, 2.12))))
        md = f.summary()
        final = row_of(md, "MNIST, 3 epochs: final accuracy (%)")
        self.assertEqual(final[1:4], ["99.00", "98.95", "+0.05 points"])
        per_epoch = row_of(md, "MNIST, 3 epochs: training s/epoch, median of epochs 2+")
        self.assertEqual(per_epoch[1:4], ["1.30", "2.09", "0.62x"])   # medians 1.30 and 2.09
        self.assertIn("| fp32 | training s/epoch, median of epochs 2+ | 2.09 | 2.1 | 0.995 | yes |", md)


LAYER_KERNEL_BENCH = """layer_kernel_bench: CUDA 0 (cc (9, 0)), median of 20 after 5 warm-up runs
device copy: 4.04 TB/s (read + write)

kernel                                                     ours       peer   ratio  target  notes
LayerNorm + E4M3 + amax fwd [16384, 768]               38.78 µs   95.00 µs   0.41x  <=0.5x  1.30 TB/s
LayerNorm fwd, bf16 out [16384, 768]                   25.12 µs          -       -       -  copy ceiling
LayerNorm bwd (dx, dw) [16384, 768]                    52.32 µs  309.00 µs   0.17x  <=0.5x  1.44 TB/s
RMSNorm + E4M3 + amax fwd [16384, 2048]                50.10 µs          -       -       -  2.68 TB/s
RMSNorm bwd (dx, dw) [16384, 2048]                     54.00 µs          -       -       -  3.73 TB/s
LM head + CE fwd+bwd 8192x2560x50304, chunk 4096        9.89 ms   10.06 ms   0.98x  <=1.0x  640 TFLOP/s; extra peak 0.42 GiB (peer 1.26: 0.34x, target <= 0.5x); mean loss 10.9499
"""
ATTENTION_BENCH = """causal attention fwd+bwd, BF16, median of 20 after 5 warm-up (CUDA events)
shape                mode           fwd ms  bwd ms total ms TFLOP/s | default flash cuDNN | /flash /default
B16 H12 T1024 hd64   deterministic   0.118   0.422    0.540   167.2 |     179   134   193 |  1.25x    0.93x
B16 H12 T1024 hd64   fused det.      0.120   0.618    0.738   122.3 |     179   134   193 |  0.91x    0.68x
"""


class LayersTable(unittest.TestCase):
    def test_kernels_match_the_peer_records_by_shape(self):
        f = Folder("layers")
        peer = (line(op="attention_fwd_bwd", backend="default", B=16, H=12, KV=12, T=1024, hd=64, s=6.0e-4,
                     TFLOPs=149.4)
                + line(op="attention_fwd_bwd", backend="flash", B=16, H=12, KV=12, T=1024, hd=64, s=7.0e-4,
                       TFLOPs=118.7)
                + line(op="attention_fwd_bwd", backend="cudnn", B=16, H=12, KV=12, T=1024, hd=64,
                       error="No available kernel")
                + line(op="layernorm_e4m3_fwd", rows=16384, d=768, s=112.0e-6, GBps=337.0)
                + line(op="layernorm_bwd", rows=16384, d=768, s=419.8e-6, GBps=179.8)
                + line(op="rmsnorm_bwd", rows=8192, d=4096, s=215.0e-6, GBps=900.0)
                + line(op="rmsnorm_bwd", rows=16384, d=2048, s=69.5e-6, GBps=2896.0)
                + line(op="lmhead_ce_fwd_bwd", tokens=8192, d=2560, vocab=50304, s=9.95e-3, TFLOPs=636.0,
                       extra_peak_GiB=1.26))
        f.add_runs("transformer layer kernels", {
            "ours:layer_kernel_bench": LAYER_KERNEL_BENCH,
            "ours:attention_bench": ATTENTION_BENCH,
            "peer:layers": peer,
            "ext:layers": peer.replace("112.0e-6", "1.2e-4").replace("0.000112", "0.00012"),
        })
        md = f.summary()
        attn = row_of(md, "B16 H12 T1024 hd64")
        self.assertEqual(attn[1:4], ["167.2", "149.4", "118.7"])
        self.assertTrue(attn[4].startswith("No available kernel"))
        self.assertEqual(attn[5:7], ["1.12x", "1.41x"])
        self.assertEqual(row_of(md, "LayerNorm + E4M3 + amax fwd [16384, 768]")[1:4], ["38.8 µs", "112.0 µs", "0.35x"])
        self.assertEqual(row_of(md, "LayerNorm bwd [16384, 768]")[3], "0.12x")
        head = row_of(md, "LM head + CE fwd+bwd 8192x2560x50304, chunk 4096")
        self.assertEqual(head[1:4], ["9.89 ms", "9.95 ms", "0.99x"])
        self.assertEqual(head[4], "extra peak 0.42 GiB vs 1.26 (0.33x)")
        self.assertEqual(row_of(md, "RMSNorm bwd [8192, 4096]")[1:3], ["-", "215.0 µs"])
        self.assertEqual(row_of(md, "RMSNorm bwd [16384, 2048]")[1:4], ["54.0 µs", "69.5 µs", "0.78x"])
        self.assertEqual(row_of(md, "RMSNorm + E4M3 + amax fwd [16384, 2048]")[1:3], ["50.1 µs", "-"])
        self.assertEqual(len([l for l in md.splitlines() if l.startswith("| RMSNorm bwd [16384, 2048] |")]), 1)
        lines = [l for l in md.splitlines() if l.startswith("| layernorm_e4m3_fwd |")]
        self.assertEqual(len(lines), 1)
        self.assertIn("0.933", lines[0])    # 112 / 120
        self.assertIn("**no**", lines[0])


KERNEL_BENCH = """kernel_bench: CUDA 0 (cc (9, 0)), 268435456 elements, median of 20
kernel                                       ms     TB/s  of copy  target
device copy bf16 (ceiling)               0.2613    4.110   100.0%  4.09 TB/s measured earlier
cast bf16->e4m3 + amax (delayed)         0.2290    3.517    85.6%  >= 3.0 TB/s
cast bf16->e4m3 current scaling          0.3294    2.445    59.5%  >= 2.3 TB/s
dequantize e4m3->bf16                    0.3088    2.608    63.5%  -
"""
GEMM_BENCH = """gemm_bench on CUDA device 0
| shape m x k x n | FP8 TFLOP/s | FP8 fast-accum TFLOP/s | BF16 TFLOP/s | FP8 / BF16 |
| --- | --- | --- | --- | --- |
| 8192 x 8192 x 8192 | 1424.2 | 1485.4 | 797.9 | 1.79 |
| 2048 x 2048 x 2048 | 1077.0 | 1134.0 | 705.0 | 1.53 |
| 8192 x 8192 x 8192 | 1421.4 | 1359.8 | 797.2 | 1.78 |
"""


class KernelsTable(unittest.TestCase):
    def test_casts_and_gemms_beside_pytorch(self):
        f = Folder("kernels")
        peer = {"copy_TBps": 4.118, "gemm_8192x8192x8192": {"bf16_TFLOPs": 755.0, "fp8_TFLOPs": 1310.0,
                                                             "fp8_speedup": 1.73},
                "cast_eager_GBps": 293.0, "cast_compiled_GBps": 2006.0, "dequant_eager_GBps": 767.0,
                "device": "H200", "torch": "2.11"}
        f.add_runs("single kernels", {
            "ours:kernel_bench": KERNEL_BENCH,
            "ours:gemm_bench": GEMM_BENCH,
            "peer:kernels": json.dumps(peer) + "\n",
            "ext:kernels": json.dumps(peer, indent=1) + "\n",   # the indented form
            "peer:blockwise": line(M=8192, K=8192, N=8192, bf16=799.0, fp8_tensor=1473.0, fp8_rowwise=1434.0,
                                   fp8_block_1x128_128x128=1349.0, fp8_block_1x128_1x128="not supported"),
        })
        md = f.summary()
        self.assertEqual(row_of(md, "cast BF16 -> E4M3, current scaling (vs torch.compile)")[1:4],
                         ["2.445 TB/s", "2.006 TB/s", "1.22x"])
        self.assertEqual(row_of(md, "FP8 GEMM 8192 x 8192 x 8192 (vs torch._scaled_mm)")[1:4],
                         ["1424.200 TFLOP/s", "1310.000 TFLOP/s", "1.09x"])   # the first 8192^3 row
        self.assertEqual(row_of(md, "8192 x 8192 x 8192")[1:], ["1424", "799", "1473", "1434", "1349", "error"])
        agree = [l for l in md.splitlines() if l.startswith("| kernels |")]
        self.assertTrue(agree and all(l.rstrip(" |").endswith("yes") for l in agree))


if __name__ == "__main__":
    unittest.main()
