#!/usr/bin/env python3
"""The summary table of one `bench/run.sh` results folder.

Usage: python3 bench/summarize.py RESULTS_DIR > RESULTS_DIR/summary.md

RESULTS_DIR/runs.tsv lists what ran, one run a line, tab-separated with a header:
    table  row  label  column  log  rc  seconds  command
`column` is `ours` (or `ours:NAME` where a table runs several of our binaries), `peer:VARIANT` (the PyTorch
peer scripts of bench/peers) or `ext:VARIANT` (the same peer from an external copy, run beside ours to check
that both give the same figures); `log` is the run's output file in RESULTS_DIR; `rc` is its exit status,
`skip` when the time budget left no room for it, or `n/a` when it could not run here (the reason in `command`).
The figures are read from the logs: the last JSON line of the peers and of our LM / MLP binaries, our MNIST
metrics file (`<log without .log>.jsonl`), and the text tables of our kernel benchmarks.

Prints Markdown: the table's summary (row, ours, each peer, ratio), the agreement of our peer scripts with
the external ones where both ran (ratio and whether it is within 3 %), and the list of runs.
"""
import csv
import json
import os
import re
import statistics
import sys

AGREEMENT_TOLERANCE = 0.03
PEER_NAMES = {"bf16": "PyTorch BF16", "fp8": "torchao FP8", "fp8row": "torchao FP8 rowwise",
              "fp32": "PyTorch F32"}


# ---- reading the results folder ----

class Run:
    def __init__(self, fields, folder):
        self.table, self.row, self.label, self.column = (fields["table"], fields["row"], fields["label"],
                                                         fields["column"])
        self.log, self.rc, self.seconds, self.command = (fields["log"], fields["rc"], fields["seconds"],
                                                         fields["command"])
        path = os.path.join(folder, self.log) if self.log else ""
        self.text = ""
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                self.text = f.read()
        self.path = path

    @property
    def kind(self):
        return self.column.split(":", 1)[0]

    @property
    def variant(self):
        return self.column.split(":", 1)[1] if ":" in self.column else ""

    def objects(self):
        return json_objects(self.text)

    def last(self, key):
        """The last JSON object of the log that has `key`."""
        found = [o for o in self.objects() if key in o]
        return found[-1] if found else None

    def last_line(self):
        lines = [l.strip() for l in self.text.splitlines() if l.strip()]
        return lines[-1][:100] if lines else "(empty log)"

    def no_figures(self):
        return f"no figures in the log (last line: {self.last_line()})"

    def status(self):
        """None when the run gave its figures, else what to write in its cell."""
        if self.rc == "skip":
            return "skipped (time budget)"
        if self.rc == "n/a":
            return "not run"
        if self.rc in ("124", "137"):
            return "timed out"
        failed = self.last("error")
        if failed is not None and failed.get("error") == "OOM":
            return "out of memory"
        if self.rc != "0":
            return f"failed (rc {self.rc})"
        return None


def read_runs(folder):
    with open(os.path.join(folder, "runs.tsv"), encoding="utf-8") as f:
        return [Run(fields, folder) for fields in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]


def json_objects(text):
    """Every JSON object that starts a line (single-line or indented over several lines), in order."""
    decoder = json.JSONDecoder()
    found, i = [], 0
    while True:
        i = text.find("{", i)
        if i < 0:
            return found
        if i > 0 and text[i - 1] != "\n":
            i += 1
            continue
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        if isinstance(obj, dict):
            found.append(obj)
        i = end


def rows_in_order(runs):
    order = []
    for r in runs:
        if (r.row, r.label) not in order:
            order.append((r.row, r.label))
    return order


def by_column(runs, row):
    return {r.column: r for r in runs if r.row == row}


# ---- formatting ----

def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def kilo(x):
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def ratio(x):
    return f"{x:.2f}x"


def peer_columns(runs, kind):
    seen = []
    for r in runs:
        if r.kind == kind and r.column not in seen:
            seen.append(r.column)
    return seen


def peer_title(column):
    kind, _, variant = column.partition(":")
    name = PEER_NAMES.get(variant, variant)
    return name if kind == "peer" else f"{name} (external)"


# ---- agreement of our peer scripts with the external ones ----

def agreement_rows(label, variant, what, ours_value, ext_value):
    if ours_value is None or ext_value is None or ext_value == 0:
        return [[label, variant, what, fmt_value(ours_value), fmt_value(ext_value), "-", "-"]]
    r = ours_value / ext_value
    return [[label, variant, what, fmt_value(ours_value), fmt_value(ext_value), f"{r:.3f}",
             "yes" if abs(r - 1) <= AGREEMENT_TOLERANCE else "**no**"]]


def fmt_value(x):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.0f}" if abs(x) >= 1e4 else f"{x:.4g}"


def agreement_section(rows):
    if not rows:
        return ""
    return ("\n## Our peer scripts beside the external ones (same call)\n\n"
            f"Ratio = ours-written / external; agreement means within {AGREEMENT_TOLERANCE:.0%}.\n\n"
            + table(["row", "peer", "figure", "ours-written", "external", "ratio", "agree"], rows) + "\n")


# ---- the speed tables (gpt, llama, mlp) ----

def figure_cell(run, key, text):
    """(cell, record) of a run: `text` of its last record with `key`, or why there is none."""
    if run is None:
        return "-", None
    bad = run.status()
    if bad:
        return bad, None
    rec = run.last(key)
    if rec is None:
        return run.no_figures(), None
    return text(rec), rec


def speed_table(runs, ours_title, key, text, best_of, vs_title):
    """A speed benchmark's table: per row our cell and each peer's (`figure_cell` by `key` and `text`), our `key`
    against the best peer's (`best_of`: max or min), our peak against PyTorch BF16's; then how the peers' runs
    agree with their external runs."""
    peers = peer_columns(runs, "peer")
    header = ["row", ours_title] + [peer_title(c) for c in peers] + [vs_title, "peak vs PyTorch BF16"]
    out, agree = [], []
    for row, label in rows_in_order(runs):
        cols = by_column(runs, row)
        ours_cell, ours = figure_cell(cols.get("ours"), key, text)
        cells, figures = [], {}
        for c in peers:
            cell, rec = figure_cell(cols.get(c), key, text)
            cells.append(cell)
            if rec is not None:
                figures[c] = rec
        versus, memory = "-", "-"
        if ours is not None and figures:
            best = best_of(figures, key=lambda c: figures[c][key])
            versus = f"{ratio(ours[key] / figures[best][key])} ({peer_title(best)})"
        if ours is not None and "peer:bf16" in figures:
            memory = ratio(ours["peak_GiB"] / figures["peer:bf16"]["peak_GiB"])
        out.append([label, ours_cell] + cells + [versus, memory])
        for c in peers:
            ext = cols.get("ext:" + c.split(":", 1)[1])
            if ext is None:
                continue
            _, ext_rec = figure_cell(ext, key, text)
            ours_rec = figures.get(c)
            for k in (key, "peak_GiB"):
                agree += agreement_rows(label, c.split(":", 1)[1], k, ours_rec and ours_rec[k],
                                        ext_rec and ext_rec[k])
    return table(header, out) + "\n" + agreement_section(agree)


def summarize_lm(runs):
    """The gpt and llama tables."""
    return speed_table(runs, "ours", "tokens_per_s",
                       lambda rec: f"{kilo(rec['tokens_per_s'])} tok/s, {rec['peak_GiB']:.2f} GiB",
                       max, "speed vs faster peer")


def summarize_mlp(runs):
    """The MLP table."""
    return speed_table(runs, "ours (fp8)", "step_s",
                       lambda rec: f"{rec['step_s']:.4f} s, {rec['peak_GiB']:.2f} GiB",
                       min, "step vs faster peer")


# ---- MNIST ----

def mnist_epochs(run):
    """[(epoch, accuracy %, training seconds)] of a run, or None."""
    if run is None or run.status():
        return None
    if run.kind == "ours":
        metrics = os.path.splitext(run.path)[0] + ".jsonl"
        recs = []
        if os.path.isfile(metrics):
            with open(metrics, encoding="utf-8") as f:
                recs = json_objects(f.read())
        recs = [r for r in recs if "test_accuracy" in r]
        return [(r["epoch"], r["test_accuracy"], r.get("train_seconds", r.get("seconds"))) for r in recs] or None
    recs = [o for o in run.objects() if "epoch" in o and "acc" in o]
    return [(r["epoch"], 100.0 * r["acc"], r["epoch_s"]) for r in recs] or None


def mnist_figures(epochs):
    if not epochs:
        return None
    later = [s for e, _, s in epochs if e >= 2] or [epochs[0][2]]
    return {"final accuracy (%)": epochs[-1][1], "best accuracy (%)": max(a for _, a, _ in epochs),
            "training s/epoch, median of epochs 2+": statistics.median(later), "first epoch s": epochs[0][2],
            "epochs": epochs[-1][0]}


def summarize_mnist(runs):
    out, agree = [], []
    for row, label in rows_in_order(runs):
        cols = by_column(runs, row)
        peers = [c for c in cols if c.startswith("peer:")]
        figs = {c: mnist_figures(mnist_epochs(cols[c])) for c in cols}
        header = ["figure", "ours"] + [peer_title(c) for c in peers] + ["ours vs " + peer_title(peers[0])
                                                                         if peers else "ratio"]
        names = ["final accuracy (%)", "best accuracy (%)", "training s/epoch, median of epochs 2+", "first epoch s"]
        for name in names:
            cells = []
            for c in ["ours"] + peers:
                f = figs.get(c)
                cells.append(f"{f[name]:.2f}" if f else (cols[c].status() if c in cols else "-") or "-")
            ours, peer = figs.get("ours"), figs.get(peers[0]) if peers else None
            if ours and peer:
                cmp = (f"{ours[name] - peer[name]:+.2f} points" if "accuracy" in name
                       else ratio(ours[name] / peer[name]))
            else:
                cmp = "-"
            out.append([f"{label}: {name}"] + cells + [cmp])
        for c in peers:
            ext = "ext:" + c.split(":", 1)[1]
            if ext in cols:
                for name in ("final accuracy (%)", "training s/epoch, median of epochs 2+"):
                    agree += agreement_rows(label, c.split(":", 1)[1], name, figs[c] and figs[c][name],
                                            figs[ext] and figs[ext][name])
    return table(header, out) + "\n" + agreement_section(agree)


# ---- transformer layer kernels ----

ATTN_OURS = re.compile(r"^B(\d+) H(\d+)(?: KV(\d+))? T(\d+) hd(\d+)\s+deterministic\s+"
                       r"([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", re.M)
LN_FWD = re.compile(r"^LayerNorm \+ E4M3 \+ amax fwd \[(\d+), (\d+)\]\s+([\d.]+) µs", re.M)
LN_BWD = re.compile(r"^LayerNorm bwd \(dx, dw\) \[(\d+), (\d+)\]\s+([\d.]+) µs", re.M)
RMS_FWD = re.compile(r"^RMSNorm \+ E4M3 \+ amax fwd \[(\d+), (\d+)\]\s+([\d.]+) µs", re.M)
RMS_BWD = re.compile(r"^RMSNorm bwd \(dx, dw\) \[(\d+), (\d+)\]\s+([\d.]+) µs", re.M)
LM_HEAD = re.compile(r"^LM head \+ CE fwd\+bwd (\d+)x(\d+)x(\d+), chunk (\d+)\s+([\d.]+) ms.*?extra peak ([\d.]+) GiB",
                     re.M)


def peer_records(run, op, with_errors=False):
    """The records of `op` in a peer's log (those that failed to measure only `with_errors`)."""
    if run is None or run.status():
        return []
    return [o for o in run.objects() if o.get("op") == op and ("s" in o or with_errors)]


def find(records, **keys):
    for r in records:
        if all(r.get(k) == v for k, v in keys.items()):
            return r
    return None


def summarize_layers(runs):
    cols = {r.column: r for r in runs}
    lkb, att = cols.get("ours:layer_kernel_bench"), cols.get("ours:attention_bench")
    peer, ext = cols.get("peer:layers"), cols.get("ext:layers")
    sections, agree = [], []

    # attention: ours (deterministic default) against each backend
    att_rows = []
    peer_att = peer_records(peer, "attention_fwd_bwd", with_errors=True)
    ours_att = {}
    if att is not None and not att.status():
        for m in ATTN_OURS.finditer(att.text):
            b, h, kv, t, hd = (int(m.group(i)) if m.group(i) else None for i in range(1, 6))
            ours_att[(b, h, kv or h, t, hd)] = float(m.group(9))
    shapes = list(ours_att) + [k for k in ((r["B"], r["H"], r.get("KV", r["H"]), r["T"], r["hd"]) for r in peer_att)
                               if k not in ours_att]
    seen = []
    for key in shapes:
        if key in seen:
            continue
        seen.append(key)
        b, h, kv, t, hd = key
        ours_tf = ours_att.get(key)
        cells, figures = [], {}
        for backend in ("default", "flash", "cudnn"):
            r = find(peer_att, B=b, H=h, T=t, hd=hd, backend=backend)
            if r is not None and r.get("KV", h) != kv:
                r = None
            figures[backend] = r and r.get("TFLOPs")
            cells.append(f"{figures[backend]:.1f}" if figures[backend] else (r or {}).get("error", "-")[:40])
        label = f"B{b} H{h}" + (f" KV{kv}" if kv != h else "") + f" T{t} hd{hd}"
        vs = [ratio(ours_tf / figures[k]) if ours_tf and figures[k] else "-" for k in ("default", "flash")]
        att_rows.append([label, f"{ours_tf:.1f}" if ours_tf else (att.status() if att else None) or "-"] + cells + vs)
    sections.append("### Causal attention forward + backward, TFLOP/s (higher is better)\n\n" + table(
        ["shape", "ours", "PyTorch default", "flash", "cuDNN", "ours / default", "ours / flash"], att_rows))

    # norms and the LM head: time (lower is better)
    krows = []
    text = lkb.text if lkb is not None and not lkb.status() else ""
    norm_ops = ((LN_FWD, "layernorm_e4m3_fwd", "LayerNorm + E4M3 + amax fwd"), (LN_BWD, "layernorm_bwd", "LayerNorm bwd"),
                (RMS_FWD, "rmsnorm_e4m3_fwd", "RMSNorm + E4M3 + amax fwd"), (RMS_BWD, "rmsnorm_bwd", "RMSNorm bwd"))
    ours_norms = set()
    for regex, op, what in norm_ops:
        records = peer_records(peer, op)
        for m in regex.finditer(text):
            rows, d, us = int(m.group(1)), int(m.group(2)), float(m.group(3))
            ours_norms.add((op, rows, d))
            p = find(records, rows=rows, d=d)
            krows.append([f"{what} [{rows}, {d}]", f"{us:.1f} µs", f"{p['s'] * 1e6:.1f} µs" if p else "-",
                          ratio(us / (p["s"] * 1e6)) if p else "-", ""])
    heads = peer_records(peer, "lmhead_ce_fwd_bwd")
    for m in LM_HEAD.finditer(text):
        tokens, d, vocab, chunk, ms, extra = (int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)),
                                              float(m.group(5)), float(m.group(6)))
        p = find(heads, tokens=tokens, d=d, vocab=vocab)
        mem = f"extra peak {extra:.2f} GiB" + (f" vs {p['extra_peak_GiB']:.2f} ({ratio(extra / p['extra_peak_GiB'])})"
                                               if p and p.get("extra_peak_GiB") else "")
        krows.append([f"LM head + CE fwd+bwd {tokens}x{d}x{vocab}, chunk {chunk}", f"{ms:.2f} ms",
                      f"{p['s'] * 1e3:.2f} ms" if p else "-", ratio(ms / (p["s"] * 1e3)) if p else "-", mem])
    # Shapes only the peer measured (our log from before the RMSNorm rows, or a failed run).
    for _, op, what in norm_ops:
        for p in peer_records(peer, op):
            if (op, p["rows"], p["d"]) not in ours_norms:
                krows.append([f"{what} [{p['rows']}, {p['d']}]", "-", f"{p['s'] * 1e6:.1f} µs", "-", "PyTorch only"])
    for name, run, found in (("layer_kernel_bench", lkb, LN_FWD.search(text) or LM_HEAD.search(text)),
                             ("attention_bench", att, ours_att)):
        if run is not None and (run.status() or not found):
            sections.append(f"{name}: {run.status() or run.no_figures()}")
    sections.append("### Norms and LM head, time (lower is better; ratio = ours / PyTorch compiled)\n\n" + table(
        ["kernel", "ours", "PyTorch compiled", "ratio", "memory"], krows))
    if peer is not None and peer.status():
        sections.append(f"peer_layers.py: {peer.status()}")

    if ext is not None:
        for p in peer.objects() if peer is not None else []:
            if "s" not in p:
                continue
            keys = {k: v for k, v in p.items() if k in ("op", "backend", "B", "H", "KV", "T", "hd", "rows", "d",
                                                         "tokens", "vocab")}
            e = find(ext.objects(), **keys)
            label = " ".join(f"{k}={v}" for k, v in keys.items() if k != "op")
            agree += agreement_rows(p["op"], label, "s", p["s"], e.get("s") if e else None)
    return "\n\n".join(sections) + "\n" + agreement_section(agree)


# ---- single kernels ----

KB_ROW = re.compile(r"^(device copy bf16 \(ceiling\)|cast bf16->e4m3 current scaling|cast bf16->e4m3 \+ amax "
                    r"\(delayed\)|dequantize e4m3->bf16)\s+([\d.]+)\s+([\d.]+)", re.M)
GEMM_ROW = re.compile(r"^\| (\d+) x (\d+) x (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", re.M)


def summarize_kernels(runs):
    cols = {r.column: r for r in runs}
    kb, gb = cols.get("ours:kernel_bench"), cols.get("ours:gemm_bench")
    pk, pb = cols.get("peer:kernels"), cols.get("peer:blockwise")
    peer = (pk.last("copy_TBps") if pk is not None and not pk.status() else None) or {}
    ours = {m.group(1): float(m.group(3)) for m in KB_ROW.finditer(kb.text)} if kb is not None else {}
    out = []

    def add(what, ours_v, peer_v, unit):
        out.append([what, f"{ours_v:.3f} {unit}" if ours_v else "-", f"{peer_v:.3f} {unit}" if peer_v else "-",
                    ratio(ours_v / peer_v) if ours_v and peer_v else "-"])

    add("device copy, BF16", ours.get("device copy bf16 (ceiling)"), peer.get("copy_TBps"), "TB/s")
    compiled = peer.get("cast_compiled_GBps")
    add("cast BF16 -> E4M3, current scaling (vs torch.compile)", ours.get("cast bf16->e4m3 current scaling"),
        compiled / 1e3 if compiled else None, "TB/s")
    eager = peer.get("cast_eager_GBps")
    add("cast BF16 -> E4M3, current scaling (vs eager)", ours.get("cast bf16->e4m3 current scaling"),
        eager / 1e3 if eager else None, "TB/s")
    add("cast BF16 -> E4M3 + amax, delayed scaling (one pass)", ours.get("cast bf16->e4m3 + amax (delayed)"), None,
        "TB/s")
    dq = peer.get("dequant_eager_GBps")
    add("dequantize E4M3 -> BF16 (vs eager)", ours.get("dequantize e4m3->bf16"), dq / 1e3 if dq else None, "TB/s")
    gemms = {}
    if gb is not None:
        for m in GEMM_ROW.finditer(gb.text):
            gemms.setdefault((int(m.group(1)), int(m.group(2)), int(m.group(3))),
                             (float(m.group(4)), float(m.group(6))))
    for key, value in peer.items():
        m = re.fullmatch(r"gemm_(\d+)x(\d+)x(\d+)", key)
        if not m or not isinstance(value, dict):
            continue
        shape = tuple(int(g) for g in m.groups())
        f8, b16 = gemms.get(shape, (None, None))
        label = " x ".join(str(s) for s in shape)
        add(f"FP8 GEMM {label} (vs torch._scaled_mm)", f8, value.get("fp8_TFLOPs"), "TFLOP/s")
        add(f"BF16 GEMM {label}", b16, value.get("bf16_TFLOPs"), "TFLOP/s")
    blocks = []
    if pb is not None and not pb.status():
        for r in pb.objects():
            if "M" not in r:
                continue
            shape = (r["M"], r["K"], r["N"])
            f8 = gemms.get(shape, (None, None))[0]
            cells = [f"{r[k]:.0f}" if isinstance(r.get(k), (int, float)) else "error" for k in
                     ("bf16", "fp8_tensor", "fp8_rowwise", "fp8_block_1x128_128x128", "fp8_block_1x128_1x128")]
            blocks.append([" x ".join(str(s) for s in shape), f"{f8:.0f}" if f8 else "-"] + cells)
    text = table(["kernel", "ours", "PyTorch", "ours / PyTorch"], out)
    for name, run, found in (("kernel_bench", kb, ours), ("gemm_bench", gb, gemms), ("peer_kernels.py", pk, peer),
                             ("peer_blockwise_gemm.py", pb, blocks)):
        if run is not None and (run.status() or not found):
            text += f"\n\n{name}: {run.status() or run.no_figures()}"
    if blocks:
        text += ("\n\n### FP8 GEMM recipes through PyTorch (TFLOP/s)\n\n" + table(
            ["M x K x N", "ours per-tensor", "BF16", "per-tensor", "rowwise", "1x128 x 128x128", "1x128 x 1x128"],
            blocks))
    agree = []
    for own, other in (("peer:kernels", "ext:kernels"), ("peer:blockwise", "ext:blockwise")):
        if own in cols and other in cols:
            a, b = flat_numbers(cols[own].objects()), flat_numbers(cols[other].objects())
            for key in a:
                if key in b:
                    agree += agreement_rows(own.split(":")[1], key, "", a[key], b[key])
    return text + "\n" + agreement_section(agree)


def flat_numbers(objects):
    """{'path': number} over the objects (a list of records is keyed by its shape fields)."""
    flat = {}
    for o in objects:
        prefix = "x".join(str(o[k]) for k in ("M", "K", "N") if k in o)
        for k, v in o.items():
            if k in ("M", "K", "N"):
                continue
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    if isinstance(v2, (int, float)):
                        flat[f"{prefix}{k}.{k2}"] = v2
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                flat[f"{prefix} {k}".strip()] = v
    return flat


# ---- the whole summary ----

SUMMARIZERS = {"gpt": summarize_lm, "llama": summarize_lm, "mlp": summarize_mlp, "mnist": summarize_mnist,
               "layers": summarize_layers, "kernels": summarize_kernels}
DESCRIPTIONS = {
    "gpt": "GPT-2 family training step (FP8 FSDP, BF16 gradient shards) against PyTorch FSDP2 compiled, BF16 and "
           "torchao FP8; median of 20 steps after 5 warm-up; peak = CUDA pool high-water mark (ours) / "
           "torch.cuda.max_memory_allocated (peers).",
    "llama": "Llama-3 family training step against PyTorch FSDP2 compiled, BF16 and torchao FP8 (vocabulary 128256); "
             "median of 20 steps after 5 warm-up.",
    "mlp": "MLP stack (x + down(GELU(up(x))), AdamW) training step: mlp_bench fp8 against PyTorch FSDP2 compiled, "
           "BF16 and torchao FP8; median of 20 steps after 5 warm-up.",
    "mnist": "The reference MNIST net, batch 64, Adam 1e-3, StepLR 0.7: ours (FP8 linears, FSDP on one GPU) "
             "against PyTorch F32 eager on one GPU.",
    "layers": "Transformer layer kernels: ours (CUDA events) against PyTorch (GPU time of queued calls).",
    "kernels": "Single kernels: casts, copy, GEMMs; ours against PyTorch eager / compiled / cuBLASLt.",
}


def runs_section(runs):
    return "\n## Runs\n\n" + table(["row", "column", "rc", "seconds", "log"],
                                   [[r.label, r.column, r.rc, r.seconds, r.log or "-"] for r in runs]) + "\n"


def summarize(folder):
    runs = read_runs(folder)
    if not runs:
        return f"# {os.path.basename(os.path.normpath(folder))}\n\nNo runs recorded.\n"
    name = runs[0].table
    body = SUMMARIZERS[name](runs)
    return (f"# {os.path.basename(os.path.normpath(folder))}\n\n{DESCRIPTIONS[name]} Commands: `commands.sh`; "
            f"machine: `env.txt`.\n\n## Summary\n\n{body}{runs_section(runs)}")


def main(argv):
    if len(argv) != 2:
        sys.exit(__doc__)
    sys.stdout.write(summarize(argv[1]))


if __name__ == "__main__":
    main(sys.argv)
