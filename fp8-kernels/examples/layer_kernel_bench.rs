//! GPU bench of the transformer layer kernels beside the PyTorch peer (`peer_layers.py`, compiled, GPU
//! time), timed with CUDA events (5 warm-up runs, then the median of `--iters`, default 20):
//!
//! - LayerNorm (weight, no bias, eps 1e-5) at [16384, 768] and [8192, 2560], RMSNorm (weight, eps 1e-5) at
//!   the Llama widths [16384, 2048], [8192, 3072], [8192, 4096], bf16 input: the forward fused with the E4M3
//!   cast (scale 64) and the amax (we also write the transposed codes the weight-gradient GEMM needs; the
//!   peer does not), the forward with a bf16 output, and the backward (dx bf16, dweight f32) from a bf16
//!   dy; the previous forward kernels (`NormLaunch::legacy_forward`) beside the current ones;
//! - LM head + cross-entropy forward and backward, chunked over tokens: per chunk `logits = x W^T` (BF16
//!   GEMM, bf16 logits), the cross-entropy kernel (loss, gradient in place), `dx = dlogits W`,
//!   `dW += dlogits^T x` (bf16 dW accumulated by the GEMM's beta = 1), at 8192 x 2560 x 50304 and
//!   16384 x 768 x 50304, for several chunk sizes. The extra peak is the CUDA pool's high-water mark
//!   minus what was allocated before the step (x, W, targets, dx, dW: the peer's baseline).
//!
//! The peer's figures come from `--peer FILE`, the JSON lines `peer_layers.py` printed (other lines are
//! skipped); without it only ours are printed. A table of every row with notes comes first, a short table
//! (ours, peer, ratio, target, met) last. Without a GPU it prints why and exits 0.
//!
//! `--export DIR` instead writes inputs and our outputs of LayerNorm, RMSNorm and cross-entropy as raw
//! little-endian files plus `manifest.json` into DIR (on the GPU when there is one, else on the CPU), for
//! `scripts/check_layers_vs_torch.py DIR`, which compares them with PyTorch.
//!
//! Usage: `layer_kernel_bench [--peer FILE] [--iters N] [--chunks 1024,2048,4096,8192] [--sweep]` (chunk
//! sizes in tokens; each must divide the token count; `--sweep` also times the `NormLaunch` choices of the
//! norm rows and every `CrossEntropyLaunch` choice of the CE kernel per chunk)
//! or `layer_kernel_bench --export DIR`.

mod common;

use common::{bench_exit, time_ms};
use fp8_core::Fp8Format;
use fp8_kernels::cross_entropy::{
    cross_entropy, cross_entropy_with_launch, CrossEntropyLaunch, CrossEntropyOutputs,
    CrossEntropySpec,
};
use fp8_kernels::gemm::{gemm_bf16, GemmSpec, Transpose};
use fp8_kernels::layer_norm::{
    norm_backward, norm_forward, norm_forward_fp8, Fp8NormOutput, GradMode, NormGrads, NormKind,
    NormLaunch, NormSpec, NormStats,
};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{AmaxSlot, Buffer, CudaDevice, Device, Element, KernelError};
use half::bf16;
use std::path::Path;
use std::process::ExitCode;

fn random_bf16(n: usize, scale: f32, seed: u64) -> Vec<bf16> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| bf16::from_f32(rng.uniform_f32() * scale))
        .collect()
}

/// The peer's measurements: the JSON objects `peer_layers.py` printed, one a line (flat objects of
/// strings and numbers; other lines, such as warnings, are skipped).
#[derive(Default)]
struct PeerFigures {
    /// Per record: its fields as (key, raw value: a string's text or a number's digits).
    records: Vec<Vec<(String, String)>>,
    /// Where they came from.
    source: Option<String>,
}

impl PeerFigures {
    fn read(path: &Path) -> Result<Self, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("--peer {}: {e}", path.display()))?;
        let records = text
            .lines()
            .filter_map(|l| parse_flat_json(l.trim()))
            .collect::<Vec<_>>();
        Ok(PeerFigures {
            records,
            source: Some(path.display().to_string()),
        })
    }

    /// Field `want` of the record of `op` whose other named fields are `keys` (integers), if measured.
    fn figure(&self, op: &str, keys: &[(&str, usize)], want: &str) -> Option<f64> {
        let field = |r: &[(String, String)], k: &str| {
            r.iter().find(|(name, _)| name == k).map(|(_, v)| v.clone())
        };
        self.records
            .iter()
            .find(|r| {
                field(r, "op").as_deref() == Some(op)
                    && keys
                        .iter()
                        .all(|(k, v)| field(r, k).and_then(|s| s.parse::<usize>().ok()) == Some(*v))
            })
            .and_then(|r| field(r, want))
            .and_then(|v| v.parse::<f64>().ok())
    }

    /// Seconds of `op` at `keys`, in microseconds (NaN when the peer did not measure it).
    fn micros(&self, op: &str, keys: &[(&str, usize)]) -> f64 {
        self.figure(op, keys, "s").map_or(f64::NAN, |s| s * 1e6)
    }
}

/// The fields of one flat JSON object (`{"op": "x", "rows": 1, "s": 2.5e-05}`), values as raw text; None
/// for anything else. Nested values are not needed: the peer prints none in the records read here.
fn parse_flat_json(line: &str) -> Option<Vec<(String, String)>> {
    let body = line.strip_prefix('{')?.strip_suffix('}')?;
    let mut fields = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let after_key = rest.strip_prefix('"')?;
        let end = after_key.find('"')?;
        let key = &after_key[..end];
        rest = after_key[end + 1..]
            .trim_start()
            .strip_prefix(':')?
            .trim_start();
        let value;
        if let Some(text) = rest.strip_prefix('"') {
            // Strings here hold no escaped quotes (op names, backends, error text is not read).
            let close = text.find('"')?;
            value = text[..close].to_string();
            rest = &text[close + 1..];
        } else {
            let close = rest.find(',').unwrap_or(rest.len());
            value = rest[..close].trim().to_string();
            rest = &rest[close..];
        }
        fields.push((key.to_string(), value));
        rest = rest.trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    Some(fields)
}

/// One row of the printed tables.
struct Row {
    what: String,
    ours: f64,
    unit: &'static str,
    /// NaN when there is no peer figure.
    peer: f64,
    /// Target of ours / peer (NaN: none).
    target: f64,
    note: String,
}

/// One norm shape's device tensors, and its timed calls (so the table rows and the launch sweep time the
/// same work).
struct NormBench {
    x: Buffer<bf16>,
    w: Buffer<bf16>,
    dy: Buffer<bf16>,
    scale: Buffer<f32>,
    stats: NormStats,
    q: Buffer<u8>,
    qt: Buffer<u8>,
    amax: Buffer<f32>,
    y: Buffer<bf16>,
    dx: Buffer<bf16>,
    dw: Buffer<f32>,
}

impl NormBench {
    fn new(gpu: &Device, rows: usize, d: usize) -> Result<Self, KernelError> {
        let n = rows * d;
        Ok(NormBench {
            x: gpu.upload(&random_bf16(n, 2.0, 1))?,
            w: gpu.upload(&random_bf16(d, 1.0, 2))?,
            dy: gpu.upload(&random_bf16(n, 1.0, 3))?,
            scale: gpu.upload(&[64.0f32])?,
            stats: NormStats::new(gpu, rows)?,
            q: gpu.zeros(n)?,
            qt: gpu.zeros(n)?,
            amax: gpu.zeros(1)?,
            y: gpu.zeros(n)?,
            dx: gpu.zeros(n)?,
            dw: gpu.zeros(d)?,
        })
    }

    /// The norm fused with the E4M3 cast, both code layouts and the amax.
    fn forward_fp8(&mut self, spec: &NormSpec) -> Result<(), KernelError> {
        self.forward_fp8_layouts(spec, true, true)
    }

    /// The norm fused with the E4M3 cast, the chosen code layouts, and the amax when the row-major
    /// codes are written (the forward's; the backward's recast of `x^T` records none).
    fn forward_fp8_layouts(
        &mut self,
        spec: &NormSpec,
        row_major: bool,
        transposed: bool,
    ) -> Result<(), KernelError> {
        norm_forward_fp8(
            spec,
            &self.x,
            &self.w,
            None,
            &mut self.stats,
            Fp8NormOutput {
                format: Fp8Format::E4M3,
                scale: &self.scale,
                codes: row_major.then_some(&mut self.q),
                codes_t: transposed.then_some(&mut self.qt),
                amax: row_major.then(|| AmaxSlot::first(&mut self.amax)),
            },
        )
    }

    /// The norm with a bf16 output.
    fn forward(&mut self, spec: &NormSpec) -> Result<(), KernelError> {
        norm_forward(spec, &self.x, &self.w, None, &mut self.stats, &mut self.y)
    }

    /// The backward: dx and dweight.
    fn backward(&mut self, spec: &NormSpec) -> Result<(), KernelError> {
        norm_backward(
            spec,
            &self.x,
            &self.w,
            &self.stats,
            &self.dy,
            NormGrads {
                dx: &mut self.dx,
                dx_mode: GradMode::Overwrite,
                dweight: &mut self.dw,
                dbias: None,
                param_mode: GradMode::Overwrite,
            },
        )
    }
}

/// The norm shapes: the peer's (LayerNorm at the GPT widths, RMSNorm at the Llama widths).
const NORM_SHAPES: [(NormKind, usize, usize); 5] = [
    (NormKind::LayerNorm, 16384, 768),
    (NormKind::LayerNorm, 8192, 2560),
    (NormKind::RmsNorm, 16384, 2048),
    (NormKind::RmsNorm, 8192, 3072),
    (NormKind::RmsNorm, 8192, 4096),
];

/// Target of ours / peer for the norm rows.
const NORM_TARGET: f64 = 0.8;

fn norm_rows(
    gpu: &Device,
    dev: &CudaDevice,
    iters: usize,
    copy_tbs: f64,
    peer: &PeerFigures,
    sweep: bool,
    out: &mut Vec<Row>,
) -> Result<(), KernelError> {
    for (kind, rows, d) in NORM_SHAPES {
        let n = (rows * d) as f64;
        let (name, op) = match kind {
            NormKind::LayerNorm => ("LayerNorm", "layernorm"),
            NormKind::RmsNorm => ("RMSNorm", "rmsnorm"),
        };
        let spec = match kind {
            NormKind::LayerNorm => NormSpec::layer_norm(rows, d),
            NormKind::RmsNorm => NormSpec::rms_norm(rows, d),
        };
        let legacy = spec.with_launch(NormLaunch {
            legacy_forward: true,
            ..NormLaunch::default()
        });
        let keys = [("rows", rows), ("d", d)];
        let mut b = NormBench::new(gpu, rows, d)?;
        let ceiling_us = |bytes: f64| bytes / (copy_tbs * 1e12) * 1e6;
        let tbs = |bytes: f64, ms: f64| bytes / (ms * 1e-3) / 1e12;

        let ms = time_ms(dev, iters, || b.forward_fp8(&spec))?;
        let old = time_ms(dev, iters, || b.forward_fp8(&legacy))?;
        out.push(Row {
            what: format!("{name} + E4M3 + amax fwd [{rows}, {d}]"),
            ours: ms * 1e3,
            unit: "µs",
            peer: peer.micros(&format!("{op}_e4m3_fwd"), &keys),
            target: NORM_TARGET,
            note: format!(
                "{:.2} TB/s of 2+1+1 B/elem (copy ceiling {:.1} µs; the peer writes no transposed codes); \
                 previous kernel {:.2} µs",
                tbs(4.0 * n, ms),
                ceiling_us(4.0 * n),
                old * 1e3
            ),
        });
        // What a forward writes when its linear recasts its input in the backward (the block's
        // default): the peer's outputs, codes and amax.
        let ms = time_ms(dev, iters, || b.forward_fp8_layouts(&spec, true, false))?;
        out.push(Row {
            what: format!("{name} + E4M3 + amax fwd, row-major codes only [{rows}, {d}]"),
            ours: ms * 1e3,
            unit: "µs",
            peer: peer.micros(&format!("{op}_e4m3_fwd"), &keys),
            target: NORM_TARGET,
            note: format!(
                "{:.2} TB/s of 2+1 B/elem (copy ceiling {:.1} µs); the forward of a recast block",
                tbs(3.0 * n, ms),
                ceiling_us(3.0 * n),
            ),
        });
        let ms = time_ms(dev, iters, || b.forward_fp8_layouts(&spec, false, true))?;
        out.push(Row {
            what: format!("{name} + E4M3 recast of x^T only [{rows}, {d}]"),
            ours: ms * 1e3,
            unit: "µs",
            peer: f64::NAN,
            target: f64::NAN,
            note: format!(
                "{:.2} TB/s of 2+1 B/elem (copy ceiling {:.1} µs); the backward's recast",
                tbs(3.0 * n, ms),
                ceiling_us(3.0 * n),
            ),
        });
        let ms = time_ms(dev, iters, || b.forward(&spec))?;
        let old = time_ms(dev, iters, || b.forward(&legacy))?;
        out.push(Row {
            what: format!("{name} fwd, bf16 out [{rows}, {d}]"),
            ours: ms * 1e3,
            unit: "µs",
            peer: f64::NAN,
            target: f64::NAN,
            note: format!(
                "{:.2} TB/s of 2+2 B/elem (copy ceiling {:.1} µs); previous kernel {:.2} µs",
                tbs(4.0 * n, ms),
                ceiling_us(4.0 * n),
                old * 1e3
            ),
        });
        let ms = time_ms(dev, iters, || b.backward(&spec))?;
        out.push(Row {
            what: format!("{name} bwd (dx, dw) [{rows}, {d}]"),
            ours: ms * 1e3,
            unit: "µs",
            peer: peer.micros(&format!("{op}_bwd"), &keys),
            target: NORM_TARGET,
            note: format!(
                "{:.2} TB/s of 6 B/elem (copy ceiling {:.1} µs)",
                tbs(6.0 * n, ms),
                ceiling_us(6.0 * n)
            ),
        });
        if sweep {
            norm_sweep(dev, iters, &spec, &mut b)?;
        }
    }
    Ok(())
}

/// Times the `NormLaunch` choices of one shape (results are the same bits: layer_norm_cuda): the FP8
/// forward of each code layout (both, row-major only as a recast block's forward, `x^T` only as its
/// backward's recast) over rows per warp and tile height at the default register bound; the backward over
/// register bound and the row prefetch.
fn norm_sweep(
    dev: &CudaDevice,
    iters: usize,
    spec: &NormSpec,
    b: &mut NormBench,
) -> Result<(), KernelError> {
    let (rows, d) = (spec.rows, spec.d);
    let auto = NormLaunch::default();
    for (layout, row_major, transposed) in [
        ("both", true, true),
        ("row-major", true, false),
        ("x^T", false, true),
    ] {
        let mut line = format!("sweep {:?} fwd fp8 {layout} [{rows}, {d}] µs:", spec.kind);
        for rpw in [1u32, 2, 4] {
            for tile in [8usize, 16, 32, 64] {
                let sp = spec.with_launch(NormLaunch {
                    rows_per_warp: Some(rpw),
                    tile_rows: Some(tile),
                    ..auto
                });
                let label = format!("r{rpw}/t{tile}");
                match time_ms(dev, iters, || {
                    b.forward_fp8_layouts(&sp, row_major, transposed)
                }) {
                    Ok(ms) => line += &format!(" {label} {:.1}", ms * 1e3),
                    Err(e) => line += &format!(" {label} ({e})"),
                }
            }
        }
        println!("{line}");
    }
    let mut line = format!("sweep {:?} bwd [{rows}, {d}] µs:", spec.kind);
    for nv in [None, Some(0u32)] {
        for prefetch in [false, true] {
            let sp = spec.with_launch(NormLaunch {
                vectors_per_lane: nv,
                prefetch: Some(prefetch),
                ..auto
            });
            let ms = time_ms(dev, iters, || b.backward(&sp))?;
            line += &format!(
                " {}/pf{} {:.1}",
                nv.map_or("auto".to_string(), |v| format!("nv{v}")),
                prefetch as u32,
                ms * 1e3
            );
        }
    }
    println!("{line}");
    Ok(())
}

/// The LM head's tensors: the peer's baseline (inputs and the two gradients).
struct LmHead {
    x: Buffer<bf16>,
    w: Buffer<bf16>,
    targets: Buffer<i32>,
    dx: Buffer<bf16>,
    dw: Buffer<bf16>,
    tokens: usize,
    d: usize,
    vocab: usize,
}

/// What one step allocates beyond the baseline: one chunk's x copy, logits and dx, and the per-row outputs.
struct Workspace {
    xc: Buffer<bf16>,
    logits: Buffer<bf16>,
    dxc: Buffer<bf16>,
    lse: Buffer<f32>,
    loss: Buffer<f32>,
    sum: Buffer<f32>,
    invalid: Buffer<u32>,
    chunk: usize,
}

impl LmHead {
    fn workspace(&self, gpu: &Device, chunk: usize) -> Result<Workspace, KernelError> {
        let (n, d, v) = (self.tokens, self.d, self.vocab);
        Ok(Workspace {
            xc: gpu.zeros(chunk * d)?,
            logits: gpu.zeros(chunk * v)?,
            dxc: gpu.zeros(chunk * d)?,
            lse: gpu.zeros(n)?,
            loss: gpu.zeros(n)?,
            sum: gpu.zeros(1)?,
            invalid: gpu.zeros(1)?,
            chunk,
        })
    }

    /// Forward and backward over all tokens, chunk by chunk; the loss sum accumulates in `ws.sum`.
    fn step(&mut self, ws: &mut Workspace) -> Result<(), KernelError> {
        let (n, d, v, chunk) = (self.tokens, self.d, self.vocab, ws.chunk);
        for (k, a) in (0..n).step_by(chunk).enumerate() {
            ws.xc.copy_range_from(0, &self.x, a * d, chunk * d)?;
            let fwd = GemmSpec::new(chunk, v, d).transposes(Transpose::No, Transpose::Yes);
            gemm_bf16(&fwd, &ws.xc, &self.w, &mut ws.logits)?;
            let ce = CrossEntropySpec {
                row_offset: a,
                ..CrossEntropySpec::new(chunk, v, 1.0 / n as f32)
            };
            cross_entropy(
                &ce,
                &mut ws.logits,
                &self.targets,
                CrossEntropyOutputs {
                    lse: &mut ws.lse,
                    loss: &mut ws.loss,
                    loss_sum: &mut ws.sum,
                    invalid_targets: &mut ws.invalid,
                },
            )?;
            gemm_bf16(
                &GemmSpec::new(chunk, d, v),
                &ws.logits,
                &self.w,
                &mut ws.dxc,
            )?;
            self.dx.copy_range_from(a * d, &ws.dxc, 0, chunk * d)?;
            let beta = if k == 0 { 0.0 } else { 1.0 };
            let dw = GemmSpec::new(v, d, chunk)
                .transposes(Transpose::Yes, Transpose::No)
                .scalars(1.0, beta);
            gemm_bf16(&dw, &ws.logits, &ws.xc, &mut self.dw)?;
        }
        Ok(())
    }
}

fn lm_head_rows(
    gpu: &Device,
    dev: &CudaDevice,
    iters: usize,
    chunks: &[usize],
    peer: &PeerFigures,
    sweep: bool,
    out: &mut Vec<Row>,
) -> Result<(), KernelError> {
    for (tokens, d, vocab) in [(8192, 2560, 50304), (16384, 768, 50304)] {
        let keys = [("tokens", tokens), ("d", d), ("vocab", vocab)];
        let peer_ms = peer.micros("lmhead_ce_fwd_bwd", &keys) / 1e3;
        let peer_gib = peer
            .figure("lmhead_ce_fwd_bwd", &keys, "extra_peak_GiB")
            .unwrap_or(f64::NAN);
        let mut rng = SplitMix64::new(7);
        let tg: Vec<i32> = (0..tokens).map(|_| rng.below(50257) as i32).collect();
        // Uniform values with the peer's standard deviations (0.5 for x, 0.02 for W).
        let mut head = LmHead {
            x: gpu.upload(&random_bf16(tokens * d, 0.5 * 3f32.sqrt(), 4))?,
            w: gpu.upload(&random_bf16(vocab * d, 0.02 * 3f32.sqrt(), 5))?,
            targets: gpu.upload(&tg)?,
            dx: gpu.zeros(tokens * d)?,
            dw: gpu.zeros(vocab * d)?,
            tokens,
            d,
            vocab,
        };
        // Compile the kernels and create the cuBLASLt state (its workspace stays allocated) first.
        {
            let mut ws = head.workspace(
                gpu,
                chunks
                    .iter()
                    .copied()
                    .find(|c| *c > 0 && tokens % c == 0)
                    .unwrap_or(tokens),
            )?;
            head.step(&mut ws)?;
        }
        for &chunk in chunks {
            if chunk == 0 || tokens % chunk != 0 {
                continue;
            }
            gpu.synchronize()?;
            let (before, _) = dev.pool_memory()?;
            dev.reset_pool_high_water()?;
            let mut ws = head.workspace(gpu, chunk)?;
            head.step(&mut ws)?;
            gpu.synchronize()?;
            let (_, high) = dev.pool_memory()?;
            let extra = high.saturating_sub(before) as f64 / (1u64 << 30) as f64;
            let mean = ws.sum.to_vec()?[0] / tokens as f32;
            let ms = time_ms(dev, iters, || head.step(&mut ws))?;
            // The cross-entropy kernel alone on one chunk (rerun on its own output: timing only).
            let ce = CrossEntropySpec::new(chunk, vocab, 1.0 / tokens as f32);
            let ce_ms = time_ms(dev, iters, || {
                cross_entropy(
                    &ce,
                    &mut ws.logits,
                    &head.targets,
                    CrossEntropyOutputs {
                        lse: &mut ws.lse,
                        loss: &mut ws.loss,
                        loss_sum: &mut ws.sum,
                        invalid_targets: &mut ws.invalid,
                    },
                )
            })?;
            let ce_bytes = 4.0 * (chunk * vocab) as f64;
            if sweep {
                // Every launch choice of the CE kernel alone (same bits; cross_entropy_cuda): re-reading the
                // row in the second pass, or holding 8 / 16 vectors per thread in registers.
                let mut line = format!("sweep ce [{chunk}, {vocab}] µs:");
                for (name, nv) in [("reread", 0u32), ("cached8", 8), ("cached16", 16)] {
                    let launch = CrossEntropyLaunch {
                        vectors_per_thread: Some(nv),
                    };
                    let ms = time_ms(dev, iters, || {
                        cross_entropy_with_launch(
                            &ce,
                            launch,
                            &mut ws.logits,
                            &head.targets,
                            CrossEntropyOutputs {
                                lse: &mut ws.lse,
                                loss: &mut ws.loss,
                                loss_sum: &mut ws.sum,
                                invalid_targets: &mut ws.invalid,
                            },
                        )
                    })?;
                    line += &format!(
                        " {name} {:.1} ({:.2} TB/s)",
                        ms * 1e3,
                        ce_bytes / (ms * 1e-3) / 1e12
                    );
                }
                println!("{line}");
            }
            let flops = 6.0 * tokens as f64 * d as f64 * vocab as f64;
            out.push(Row {
                what: format!("LM head + CE fwd+bwd {tokens}x{d}x{vocab}, chunk {chunk}"),
                ours: ms,
                unit: "ms",
                peer: peer_ms,
                target: 1.0,
                note: format!(
                    "{:.0} TFLOP/s; extra peak {extra:.2} GiB (peer {}, target <= 0.5x); \
                     mean loss {mean:.4}; CE kernel {:.3} ms per chunk ({:.2} TB/s of 2+2 B/logit), {:.2} ms in all",
                    flops / (ms * 1e-3) / 1e12,
                    if peer_gib.is_nan() {
                        "-".to_string()
                    } else {
                        format!("{peer_gib:.2}: {:.2}x", extra / peer_gib)
                    },
                    ce_ms,
                    ce_bytes / (ce_ms * 1e-3) / 1e12,
                    ce_ms * (tokens / chunk) as f64
                ),
            });
        }
    }
    Ok(())
}

fn bench(
    iters: usize,
    chunks: &[usize],
    peer: &PeerFigures,
    sweep: bool,
) -> Result<(), KernelError> {
    let gpu = Device::cuda(0)?;
    let dev = gpu.as_cuda("layer_kernel_bench")?.clone();
    dev.require_fp8()?;
    // Keep freed memory in the pool between steps (as PyTorch's caching allocator does).
    dev.set_pool_release_threshold(u64::MAX)?;
    println!(
        "layer_kernel_bench: CUDA {} (cc {:?}), median of {iters} after 5 warm-up runs",
        dev.ordinal(),
        dev.compute_capability()
    );
    match &peer.source {
        Some(src) => println!(
            "peer: {} records of peer_layers.py from {src}",
            peer.records.len()
        ),
        None => {
            println!("peer: none given (--peer FILE, the JSON lines of peer_layers.py): ours only")
        }
    }
    // The copy ceiling: a bf16 device-to-device copy of 2^27 elements (read + write).
    let big = gpu.upload(&random_bf16(1 << 27, 1.0, 9))?;
    let mut big2 = gpu.zeros::<bf16>(1 << 27)?;
    let ms = time_ms(&dev, iters, || big2.copy_from(&big))?;
    let copy_tbs = 4.0 * (1u64 << 27) as f64 / (ms * 1e-3) / 1e12;
    drop((big, big2));
    println!("device copy: {copy_tbs:.2} TB/s (read + write)");
    let mut rows = Vec::new();
    norm_rows(&gpu, &dev, iters, copy_tbs, peer, sweep, &mut rows)?;
    lm_head_rows(&gpu, &dev, iters, chunks, peer, sweep, &mut rows)?;
    let cells = |r: &Row| {
        let ours = format!("{:.2} {}", r.ours, r.unit);
        if r.peer.is_nan() {
            return (ours, "-".to_string(), "-".to_string(), "-".to_string(), "-");
        }
        let ratio = r.ours / r.peer;
        let met = if r.target.is_nan() {
            "-"
        } else if ratio <= r.target {
            "yes"
        } else {
            "no"
        };
        (
            ours,
            format!("{:.2} {}", r.peer, r.unit),
            format!("{ratio:.2}x"),
            if r.target.is_nan() {
                "-".to_string()
            } else {
                format!("<={:.1}x", r.target)
            },
            met,
        )
    };
    println!(
        "\n{:<52} {:>10} {:>10} {:>7} {:>7}  notes",
        "kernel", "ours", "peer", "ratio", "target"
    );
    for r in &rows {
        let (ours, peer, ratio, target, _) = cells(r);
        println!(
            "{:<52} {ours:>10} {peer:>10} {ratio:>7} {target:>7}  {}",
            r.what, r.note
        );
    }
    // The short table: the rows with a target (ours against the peer).
    println!("\nsummary (ratio = ours / peer, GPU time):");
    println!("| kernel | ours | peer | ratio | target | met |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for r in rows.iter().filter(|r| !r.target.is_nan()) {
        let (ours, peer, ratio, target, met) = cells(r);
        println!(
            "| {} | {ours} | {peer} | {ratio} | {target} | {met} |",
            r.what
        );
    }
    Ok(())
}

// ---- export for scripts/check_layers_vs_torch.py ----

fn write_raw<T: Element>(dir: &Path, name: &str, b: &Buffer<T>) -> Result<String, String> {
    let v = b.to_vec().map_err(|e| e.to_string())?;
    let bytes: &[u8] = bytemuck::cast_slice(&v);
    std::fs::write(dir.join(name), bytes).map_err(|e| format!("{name}: {e}"))?;
    Ok(format!("\"{name}\""))
}

fn export(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (gpu, why) = Device::auto();
    match &why {
        None => println!("export: on CUDA device 0"),
        Some(e) => println!("export: on the CPU ({e})"),
    }
    let ke = |e: KernelError| e.to_string();
    let mut manifest = vec![format!(
        "\"device\": \"{}\"",
        if why.is_none() { "cuda" } else { "cpu" }
    )];

    // LayerNorm (weight and bias) and RMSNorm (weight), bf16 activations and gradients.
    let (rows, d) = (4096, 768);
    let n = rows * d;
    let x = gpu.upload(&random_bf16(n, 2.0, 11)).map_err(ke)?;
    let w = gpu.upload(&random_bf16(d, 1.0, 12)).map_err(ke)?;
    let b = gpu.upload(&random_bf16(d, 0.5, 13)).map_err(ke)?;
    let dy = gpu.upload(&random_bf16(n, 1.0, 14)).map_err(ke)?;
    let mut files = vec![
        format!("\"x\": {}", write_raw(dir, "ln_x.bf16", &x)?),
        format!("\"w\": {}", write_raw(dir, "ln_w.bf16", &w)?),
        format!("\"b\": {}", write_raw(dir, "ln_b.bf16", &b)?),
        format!("\"dy\": {}", write_raw(dir, "ln_dy.bf16", &dy)?),
    ];
    let scale = 64.0f32;
    for (tag, spec, bias) in [
        ("ln", NormSpec::layer_norm(rows, d), Some(&b)),
        ("rms", NormSpec::rms_norm(rows, d), None),
    ] {
        let mut stats = NormStats::new(&gpu, rows).map_err(ke)?;
        let mut y = gpu.zeros::<bf16>(n).map_err(ke)?;
        norm_forward(&spec, &x, &w, bias, &mut stats, &mut y).map_err(ke)?;
        let sc = gpu.upload(&[scale]).map_err(ke)?;
        let (mut q, mut qt) = (
            gpu.zeros::<u8>(n).map_err(ke)?,
            gpu.zeros::<u8>(n).map_err(ke)?,
        );
        let mut st2 = NormStats::new(&gpu, rows).map_err(ke)?;
        norm_forward_fp8(
            &spec,
            &x,
            &w,
            bias,
            &mut st2,
            Fp8NormOutput {
                format: Fp8Format::E4M3,
                scale: &sc,
                codes: Some(&mut q),
                codes_t: Some(&mut qt),
                amax: None,
            },
        )
        .map_err(ke)?;
        let mut dx = gpu.zeros::<bf16>(n).map_err(ke)?;
        let mut dw = gpu.zeros::<f32>(d).map_err(ke)?;
        let mut db = gpu.zeros::<f32>(d).map_err(ke)?;
        norm_backward(
            &spec,
            &x,
            &w,
            &stats,
            &dy,
            NormGrads {
                dx: &mut dx,
                dx_mode: GradMode::Overwrite,
                dweight: &mut dw,
                dbias: bias.is_some().then_some(&mut db),
                param_mode: GradMode::Overwrite,
            },
        )
        .map_err(ke)?;
        files.push(format!(
            "\"{tag}_y\": {}",
            write_raw(dir, &format!("{tag}_y.bf16"), &y)?
        ));
        files.push(format!(
            "\"{tag}_codes\": {}",
            write_raw(dir, &format!("{tag}_codes.u8"), &q)?
        ));
        files.push(format!(
            "\"{tag}_mean\": {}",
            write_raw(dir, &format!("{tag}_mean.f32"), &stats.mean)?
        ));
        files.push(format!(
            "\"{tag}_rstd\": {}",
            write_raw(dir, &format!("{tag}_rstd.f32"), &stats.rstd)?
        ));
        files.push(format!(
            "\"{tag}_dx\": {}",
            write_raw(dir, &format!("{tag}_dx.bf16"), &dx)?
        ));
        files.push(format!(
            "\"{tag}_dw\": {}",
            write_raw(dir, &format!("{tag}_dw.f32"), &dw)?
        ));
        if bias.is_some() {
            files.push(format!(
                "\"{tag}_db\": {}",
                write_raw(dir, &format!("{tag}_db.f32"), &db)?
            ));
        }
    }
    manifest.push(format!(
        "\"norm\": {{\"rows\": {rows}, \"d\": {d}, \"eps\": {:e}, \"scale\": {scale}, \"files\": {{{}}}}}",
        fp8_kernels::layer_norm::DEFAULT_EPS,
        files.join(", ")
    ));

    // Cross-entropy of bf16 logits, gradient scaled by 1 / rows (the mean loss), in place.
    let (rows, vocab) = (256, 50304);
    let host = random_bf16(rows * vocab, 6.0, 15);
    let mut logits = gpu.upload(&host).map_err(ke)?;
    let input = write_raw(dir, "ce_logits.bf16", &logits)?;
    let mut rng = SplitMix64::new(16);
    let tg: Vec<i32> = (0..rows).map(|_| rng.below(vocab as u64) as i32).collect();
    let targets = gpu.upload(&tg).map_err(ke)?;
    let mut lse = gpu.zeros::<f32>(rows).map_err(ke)?;
    let mut loss = gpu.zeros::<f32>(rows).map_err(ke)?;
    let mut sum = gpu.zeros::<f32>(1).map_err(ke)?;
    let mut invalid = gpu.zeros::<u32>(1).map_err(ke)?;
    cross_entropy(
        &CrossEntropySpec::new(rows, vocab, 1.0 / rows as f32),
        &mut logits,
        &targets,
        CrossEntropyOutputs {
            lse: &mut lse,
            loss: &mut loss,
            loss_sum: &mut sum,
            invalid_targets: &mut invalid,
        },
    )
    .map_err(ke)?;
    let files = [
        format!("\"logits\": {input}"),
        format!(
            "\"targets\": {}",
            write_raw(dir, "ce_targets.i32", &targets)?
        ),
        format!("\"lse\": {}", write_raw(dir, "ce_lse.f32", &lse)?),
        format!("\"loss\": {}", write_raw(dir, "ce_loss.f32", &loss)?),
        format!("\"loss_sum\": {}", write_raw(dir, "ce_loss_sum.f32", &sum)?),
        format!("\"grad\": {}", write_raw(dir, "ce_grad.bf16", &logits)?),
    ];
    manifest.push(format!(
        "\"cross_entropy\": {{\"rows\": {rows}, \"vocab\": {vocab}, \"files\": {{{}}}}}",
        files.join(", ")
    ));
    let text = format!("{{\n  {}\n}}\n", manifest.join(",\n  "));
    std::fs::write(dir.join("manifest.json"), text).map_err(|e| e.to_string())?;
    println!("export: wrote {}", dir.join("manifest.json").display());
    Ok(())
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: layer_kernel_bench [--peer FILE] [--iters N] [--chunks N,N,...] [--sweep] | --export DIR"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut iters = 20usize;
    let mut chunks = vec![1024usize, 2048, 4096, 8192];
    let mut export_dir = None;
    let mut peer_file = None;
    let mut sweep = false;
    let mut i = 0;
    while i < args.len() {
        if args[i] == "--sweep" {
            sweep = true;
            i += 1;
            continue;
        }
        let value = args.get(i + 1);
        match (args[i].as_str(), value) {
            ("--iters", Some(v)) => match v.parse::<usize>() {
                Ok(n) if n > 0 => iters = n,
                _ => return usage(),
            },
            ("--chunks", Some(v)) => match v.split(',').map(|s| s.parse::<usize>()).collect() {
                Ok(c) => chunks = c,
                Err(_) => return usage(),
            },
            ("--export", Some(v)) => export_dir = Some(v.clone()),
            ("--peer", Some(v)) => peer_file = Some(v.clone()),
            _ => return usage(),
        }
        i += 2;
    }
    if let Some(dir) = export_dir {
        return match export(Path::new(&dir)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("export failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let peer = match peer_file {
        Some(f) => match PeerFigures::read(Path::new(&f)) {
            Ok(p) => p,
            Err(e) => {
                println!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => PeerFigures::default(),
    };
    bench_exit(bench(iters, &chunks, &peer, sweep))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_lines_are_read_and_others_skipped() {
        let dir = std::env::temp_dir().join(format!("lkb-peer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("peer.log");
        std::fs::write(
            &path,
            "W1203 some torch warning {not json}\n\
             {\"op\": \"layernorm_e4m3_fwd\", \"rows\": 16384, \"d\": 768, \"s\": 2.4e-05, \"GBps\": 1572.8}\n\
             {\"op\": \"rmsnorm_bwd\", \"rows\": 8192, \"d\": 4096, \"s\": 0.000215, \"GBps\": 936.2}\n\
             {\"op\": \"attention_fwd_bwd\", \"backend\": \"cudnn\", \"B\": 16, \"error\": \"no kernel, sorry\"}\n\
             {\"op\": \"lmhead_ce_fwd_bwd\", \"tokens\": 8192, \"d\": 2560, \"vocab\": 50304, \"s\": 0.01006, \"TFLOPs\": 1.0, \"extra_peak_GiB\": 1.26}\n",
        )
        .unwrap();
        let p = PeerFigures::read(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(p.records.len(), 4);
        let us = p.micros("layernorm_e4m3_fwd", &[("rows", 16384), ("d", 768)]);
        assert!((us - 24.0).abs() < 1e-9, "{us}");
        let us = p.micros("rmsnorm_bwd", &[("rows", 8192), ("d", 4096)]);
        assert!((us - 215.0).abs() < 1e-9, "{us}");
        // Another shape, or an op the peer did not measure: no figure.
        assert!(p
            .micros("layernorm_e4m3_fwd", &[("rows", 8192), ("d", 768)])
            .is_nan());
        assert!(p.micros("attention_fwd_bwd", &[("B", 16)]).is_nan());
        let keys = [("tokens", 8192), ("d", 2560), ("vocab", 50304)];
        assert_eq!(
            p.figure("lmhead_ce_fwd_bwd", &keys, "extra_peak_GiB"),
            Some(1.26)
        );
        assert!(PeerFigures::read(&dir.join("missing")).is_err());
    }
}
