//! GPU benchmark of causal flash attention (forward + backward) at the PyTorch peer's shapes, and the
//! input/output dump for `scripts/check_attention_vs_torch.py`.
//!
//! ```text
//! attention_bench [--sweep] [--wgmma] [--dump DIR] [--iters N] [--peer FILE] [--shape I] [--only LIST]
//! ```
//!
//! `--shape I` runs the I-th shape of the table alone (1-based, in the order below), e.g. under a profiler.
//! `--only LIST` (comma-separated) runs, of the table's modes and the `--wgmma` tables' variants, only
//! those whose name contains one of the strings (e.g. `--only "ordered,g2w q g2n64w"`), besides the
//! default mode and the `mma.sync` rows the others are compared with: device time goes to the rows in
//! question.
//!
//! - Table: for each shape (the GPT shapes B16 H12 T1024 hd64, B4 H20 T2048 hd128, B8 H4 T1024 hd32, and
//!   the Llama presets' grouped-query shapes B4 H32 KV8 T4096 hd64, B2 H24 KV8 T4096 hd128, B1 H32 KV8
//!   T8192 hd128) and each mode (the default, which on Hopper runs the wgmma forward and backward at head
//!   dims 64 and 128; the mma.sync kernels' deterministic default, their fused backward with split
//!   buffers, their fused backward with atomics), the median over N (default 20) timed iterations after
//!   5 warm-up ones of the forward, the backward and their sum, timed with CUDA events on the compute
//!   stream, and TFLOP/s by the peer's formula `3.5 * 4 * B * H * T^2 * hd / 2 / time`. Last, a short
//!   table of ours against PyTorch's backends (default, flash, cuDNN, cuDNN on expanded K/V) read from
//!   `--peer FILE`, the JSON lines `peer_layers.py` printed in the same device call (`bench/run.sh
//!   layers` passes it), with the ratio of our default to the fastest backend.
//! - `--wgmma`: also the modes `wgmma ordered` (the fused deterministic wgmma backward,
//!   `WgmmaBackwardTiles::ORDERED`), `wgmma ordered cols` (the same with dQ's columns split,
//!   `WgmmaBackwardTiles::ORDERED_COLUMNS`; the ordered modes have no row at a head dim their kernel is
//!   not compiled for), `wgmma atomic` (the wgmma backward with atomic dQ sums) and `wgmma
//!   fwd+mma` (the wgmma forward with the mma.sync fused backward; compute capability 9.0 only, head
//!   dims 64 and 128), and after the table, per shape of head dim 64 or 128, the mma.sync forward and
//!   every compiled wgmma forward variant timed alone, with their speed-up and their largest differences
//!   from the mma.sync forward's `out` and `lse` on the same inputs (a quick check beside
//!   `attention_cuda`'s); then the same for the backward alone: the mma.sync deterministic default
//!   against every compiled pair of wgmma dK/dV and dQ kernels, the fused ordered kernel and the wgmma
//!   atomic kernel.
//! - `--sweep`: every compiled variant at each shape, forward and backward timed separately: the
//!   forward tiles; the backward organisations (the fused kernel with 64 and 32 query rows,
//!   deterministic and atomic; every pair of separate dK/dV and dQ tiles); the fused deterministic
//!   backward's split counts. It ends with the fastest choices per head dim written as the lines of
//!   `DEFAULT_TILES` (`fp8-kernels/src/attention/tiles.rs`), to paste there, and the fwd+bwd time and
//!   TFLOP/s they would give.
//! - `--dump DIR`: writes, per shape, `DIR/<shape>/{qkv,dout,out,lse,dqkv}.bin` (raw little-endian:
//!   bf16 for qkv, dout, out, dqkv; f32 for lse) and `meta.txt` (B H T hd scale), from the
//!   deterministic default path, for the PyTorch comparison script.
//!
//! Without a GPU it prints why and exits 0.

mod common;

use common::event_times_ms;
use fp8_kernels::attention::{
    attention_backward, attention_forward, backward_splits, backward_variants, forward_variants,
    wgmma_backward_variants, wgmma_forward_variants, AttentionConfig, AttentionKernel,
    AttentionShape, AttentionTiles, AttentionWorkspace, BackwardKernels, DqAccumulation,
    QueryTiles, WgmmaBackwardTiles, FUSED_QUERY_ROWS, WGMMA_HEAD_DIMS,
};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{Buffer, Device, KernelError};
use half::bf16;
use std::path::{Path, PathBuf};

/// The shapes of the table: the GPT shapes (multi-head) and the Llama presets' grouped-query shapes
/// (llama-1b 4 x 4096, llama-3b 2 x 4096, llama-8b 1 x 8192), as `peer_layers.py` measures them.
fn shapes() -> [AttentionShape; 6] {
    [
        AttentionShape::new(16, 12, 1024, 64),
        AttentionShape::new(4, 20, 2048, 128),
        AttentionShape::new(8, 4, 1024, 32),
        AttentionShape::gqa(4, 32, 8, 4096, 64),
        AttentionShape::gqa(2, 24, 8, 4096, 128),
        AttentionShape::gqa(1, 32, 8, 8192, 128),
    ]
}

/// PyTorch's TFLOP/s at one shape, per backend, from `peer_layers.py`'s JSON lines of the same call.
#[derive(Default, Clone)]
struct PeerRates {
    default: Option<f64>,
    flash: Option<f64>,
    cudnn: Option<f64>,
    /// cuDNN on K/V repeated to `H` heads (grouped-query shapes only).
    cudnn_expanded: Option<f64>,
}

impl PeerRates {
    /// The fastest backend and its rate.
    fn best(&self) -> Option<(&'static str, f64)> {
        [
            ("default", self.default),
            ("flash", self.flash),
            ("cuDNN", self.cudnn),
            ("cuDNN exp.", self.cudnn_expanded),
        ]
        .into_iter()
        .filter_map(|(n, r)| r.map(|r| (n, r)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
    }
}

/// The peer's rates at `s` among `records` (`op` "attention_fwd_bwd"; records with an `error` carry
/// no rate).
fn peer_rates(records: &[serde_json::Value], s: &AttentionShape) -> PeerRates {
    let mut r = PeerRates::default();
    let num = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_u64());
    for rec in records {
        let same = rec.get("op").and_then(|o| o.as_str()) == Some("attention_fwd_bwd")
            && num(rec, "B") == Some(s.batch as u64)
            && num(rec, "H") == Some(s.heads as u64)
            && num(rec, "KV").unwrap_or(s.heads as u64) == s.kv_heads as u64
            && num(rec, "T") == Some(s.seq_len as u64)
            && num(rec, "hd") == Some(s.head_dim as u64);
        let rate = rec.get("TFLOPs").and_then(|x| x.as_f64());
        if !same {
            continue;
        }
        match rec.get("backend").and_then(|b| b.as_str()) {
            Some("default") => r.default = rate,
            Some("flash") => r.flash = rate,
            Some("cudnn") => r.cudnn = rate,
            Some("cudnn_expanded") => r.cudnn_expanded = rate,
            _ => {}
        }
    }
    r
}

fn rate_cell(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

struct Args {
    sweep: bool,
    /// Also time the wgmma forward.
    wgmma: bool,
    dump: Option<PathBuf>,
    iters: usize,
    /// `peer_layers.py`'s output of the same call.
    peer: Option<PathBuf>,
    /// Only this shape of the table (1-based), for a profiler.
    shape: Option<usize>,
    /// Only the modes and variants whose names contain one of these (all when empty).
    only: Vec<String>,
}

impl Args {
    /// Whether `--only` lets the mode or variant `name` run.
    fn wanted(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| name.contains(o.as_str()))
    }
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        sweep: false,
        wgmma: false,
        dump: None,
        iters: 20,
        peer: None,
        shape: None,
        only: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--sweep" => a.sweep = true,
            "--wgmma" => a.wgmma = true,
            "--dump" => a.dump = Some(it.next().ok_or("--dump needs a folder")?.into()),
            "--peer" => a.peer = Some(it.next().ok_or("--peer needs a file")?.into()),
            "--iters" => {
                a.iters = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n| n > 0)
                    .ok_or("--iters needs a positive integer")?
            }
            "--shape" => {
                a.shape = Some(
                    it.next()
                        .and_then(|v| v.parse().ok())
                        .filter(|&n| (1..=shapes().len()).contains(&n))
                        .ok_or_else(|| {
                            format!("--shape needs a number from 1 to {}", shapes().len())
                        })?,
                )
            }
            "--only" => {
                a.only = it
                    .next()
                    .ok_or("--only needs a comma-separated list of names")?
                    .split(',')
                    .map(str::trim)
                    .filter(|o| !o.is_empty())
                    .map(String::from)
                    .collect();
                if a.only.is_empty() {
                    return Err("--only needs at least one name".into());
                }
            }
            "-h" | "--help" => {
                println!(
                    "attention_bench [--sweep] [--wgmma] [--dump DIR] [--iters N] [--peer FILE] \
                     [--shape I] [--only LIST]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// Unit-variance BF16 values from a counter-based generator (independent of any thread split).
fn random_bf16(n: usize, seed: u64, amp: f32) -> Vec<bf16> {
    (0..n)
        .map(|i| {
            let z = SplitMix64::mix(seed.wrapping_add((i as u64).wrapping_mul(SplitMix64::GAMMA)));
            let u = ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            bf16::from_f32(u * amp)
        })
        .collect()
}

/// The buffers of one shape.
struct Bufs {
    qkv: Buffer<bf16>,
    d_out: Buffer<bf16>,
    out: Buffer<bf16>,
    lse: Buffer<f32>,
    d_qkv: Buffer<bf16>,
    ws: AttentionWorkspace,
}

fn buffers(dev: &Device, s: &AttentionShape) -> Result<Bufs, KernelError> {
    Ok(Bufs {
        qkv: dev.upload(&random_bf16(s.qkv_len(), 1, 1.732))?,
        d_out: dev.upload(&random_bf16(s.out_len(), 2, 1.0))?,
        out: dev.zeros(s.out_len())?,
        lse: dev.zeros(s.lse_len())?,
        d_qkv: dev.zeros(s.qkv_len())?,
        ws: AttentionWorkspace::new(),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Median milliseconds of `f` over `iters` timed calls after 5 warm-up ones (CUDA events on the
/// compute stream around each call).
fn median_ms(
    dev: &Device,
    iters: usize,
    f: impl FnMut() -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    let cuda = dev.as_cuda("attention_bench")?;
    Ok(median(event_times_ms(cuda, iters, f)?))
}

/// Which pass [`time_pass`] times.
#[derive(Clone, Copy)]
enum Pass {
    Forward,
    Backward,
}

/// Median milliseconds of `pass` with `cfg`: the forward leaves `out` and `lse` in `b`, the backward
/// starts from those already there.
fn time_pass(
    dev: &Device,
    s: &AttentionShape,
    cfg: &AttentionConfig,
    b: &mut Bufs,
    iters: usize,
    pass: Pass,
) -> Result<f64, KernelError> {
    let Bufs {
        qkv,
        d_out,
        out,
        lse,
        d_qkv,
        ws,
    } = b;
    median_ms(dev, iters, || match pass {
        Pass::Forward => attention_forward(s, cfg, qkv, out, lse),
        Pass::Backward => attention_backward(s, cfg, qkv, out, d_out, lse, d_qkv, ws),
    })
}

/// The table's shapes, or the one `--shape` names.
fn selected_shapes(args: &Args) -> Vec<AttentionShape> {
    let all = shapes();
    match args.shape {
        Some(i) => all.into_iter().skip(i - 1).take(1).collect(),
        None => all.to_vec(),
    }
}

fn label(s: &AttentionShape) -> String {
    if s.kv_heads == s.heads {
        format!("B{} H{} T{} hd{}", s.batch, s.heads, s.seq_len, s.head_dim)
    } else {
        format!(
            "B{} H{} KV{} T{} hd{}",
            s.batch, s.heads, s.kv_heads, s.seq_len, s.head_dim
        )
    }
}

fn tflops(s: &AttentionShape, ms: f64) -> f64 {
    s.causal_flops_fwd_bwd() / (ms * 1e-3) / 1e12
}

fn dump(
    dir: &Path,
    dev: &Device,
    s: &AttentionShape,
    b: &mut Bufs,
) -> Result<(), Box<dyn std::error::Error>> {
    let cfg = AttentionConfig::default();
    attention_forward(s, &cfg, &b.qkv, &mut b.out, &mut b.lse)?;
    attention_backward(
        s,
        &cfg,
        &b.qkv,
        &b.out,
        &b.d_out,
        &b.lse,
        &mut b.d_qkv,
        &mut b.ws,
    )?;
    dev.synchronize()?;
    let d = dir.join(label(s).replace(' ', "_"));
    std::fs::create_dir_all(&d)?;
    let bf =
        |v: Vec<bf16>| -> Vec<u8> { v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect() };
    std::fs::write(d.join("qkv.bin"), bf(b.qkv.to_vec()?))?;
    std::fs::write(d.join("dout.bin"), bf(b.d_out.to_vec()?))?;
    std::fs::write(d.join("out.bin"), bf(b.out.to_vec()?))?;
    std::fs::write(d.join("dqkv.bin"), bf(b.d_qkv.to_vec()?))?;
    let lse: Vec<u8> = b
        .lse
        .to_vec()?
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    std::fs::write(d.join("lse.bin"), lse)?;
    std::fs::write(
        d.join("meta.txt"),
        format!(
            "{} {} {} {} {:e}\n",
            s.batch,
            s.heads,
            s.seq_len,
            s.head_dim,
            cfg.scale_for(s.head_dim)
        ),
    )?;
    println!("dumped {}", d.display());
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("attention_bench: {e}");
            std::process::exit(2);
        }
    };
    // The peer's file is read before any work, so a wrong path is said at once.
    let records = match &args.peer {
        Some(path) => match common::read_json_lines(path) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("attention_bench: --peer {}: {e}", path.display());
                std::process::exit(2);
            }
        },
        None => Vec::new(),
    };
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("attention_bench: no GPU, nothing to measure ({e})");
            return;
        }
    };
    if let Err(e) = run(&dev, &args, &records) {
        eprintln!("attention_bench: {e}");
        std::process::exit(1);
    }
}

/// The wgmma forward with its default tiles and the default backward.
fn wgmma_config() -> AttentionConfig {
    AttentionConfig {
        kernel: AttentionKernel::Wgmma,
        ..Default::default()
    }
}

/// The mma.sync kernels with their defaults.
fn mma_config() -> AttentionConfig {
    AttentionConfig {
        kernel: AttentionKernel::Mma,
        ..Default::default()
    }
}

/// What a config runs at head dim `hd`, for the table's last column.
fn kernels_label(cfg: &AttentionConfig, hd: usize) -> Result<String, KernelError> {
    let (fwd, bwd) = cfg.kernels_for(hd)?;
    let hopper = matches!(cfg.kernel, AttentionKernel::Wgmma | AttentionKernel::Auto);
    // On Hopper the default takes the wgmma kernels where they exist (head dims 64, 128).
    let wg_fwd = cfg.kernel == AttentionKernel::Wgmma
        || (hopper && cfg.tiles.forward.is_none() && cfg.wgmma_tiles_for(hd).is_ok());
    let wg_bwd = hopper && cfg.tiles.backward.is_none() && WGMMA_HEAD_DIMS.contains(&hd);
    let f = if wg_fwd {
        format!("fwd wgmma {}", cfg.wgmma_tiles_for(hd)?)
    } else {
        format!("fwd {fwd}")
    };
    let b = if wg_bwd {
        format!("bwd wgmma {:?}", cfg.dq_accumulation).to_lowercase()
    } else {
        bwd.to_string()
    };
    let on = if cfg.kernel == AttentionKernel::Auto && (wg_fwd || wg_bwd) {
        " (on sm_90; mma elsewhere)"
    } else {
        ""
    };
    Ok(format!("{f}, {b}{on}"))
}

/// The modes of the main table: the default (`Auto`), the mma.sync kernels' deterministic default, fused
/// deterministic and atomic backward; with `wgmma`, the wgmma kernels with the atomic backward and the
/// wgmma forward with the mma.sync backward.
fn modes(wgmma: bool) -> Vec<(&'static str, AttentionConfig)> {
    let mma = mma_config();
    let fused_det = AttentionConfig {
        tiles: AttentionTiles {
            backward: Some(BackwardKernels::Fused { query_rows: 64 }),
            ..Default::default()
        },
        ..mma
    };
    let mut v = vec![
        ("default", AttentionConfig::default()),
        ("mma det.", mma),
        ("mma fused det.", fused_det),
        (
            "mma atomic",
            AttentionConfig {
                dq_accumulation: DqAccumulation::Atomic,
                ..mma
            },
        ),
    ];
    if wgmma {
        v.push((
            "wgmma ordered",
            AttentionConfig {
                tiles: AttentionTiles {
                    wgmma_backward: Some(WgmmaBackwardTiles::ORDERED),
                    ..Default::default()
                },
                ..wgmma_config()
            },
        ));
        v.push((
            "wgmma ordered cols",
            AttentionConfig {
                tiles: AttentionTiles {
                    wgmma_backward: Some(WgmmaBackwardTiles::ORDERED_COLUMNS),
                    ..Default::default()
                },
                ..wgmma_config()
            },
        ));
        v.push((
            "wgmma atomic",
            AttentionConfig {
                dq_accumulation: DqAccumulation::Atomic,
                ..wgmma_config()
            },
        ));
        v.push((
            "wgmma fwd+mma",
            AttentionConfig {
                tiles: AttentionTiles {
                    backward: Some(BackwardKernels::Fused { query_rows: 64 }),
                    ..Default::default()
                },
                ..wgmma_config()
            },
        ));
    }
    v
}

fn run(
    dev: &Device,
    args: &Args,
    records: &[serde_json::Value],
) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "causal attention fwd+bwd, BF16, median of {} after 5 warm-up (CUDA events); TFLOP/s = 3.5 * \
         4*B*H*T^2*hd / 2 / time; PyTorch's figures {}",
        args.iters,
        match &args.peer {
            Some(p) => format!("from {} (peer_layers.py, GPU time)", p.display()),
            None => "not given (--peer FILE: peer_layers.py's output of the same call)".into(),
        }
    );
    println!(
        "{:<24} {:<18} {:>7} {:>7} {:>8} {:>7} | {:>6} {:>7} | kernels",
        "shape", "mode", "fwd ms", "bwd ms", "total ms", "TFLOP/s", "splits", "ws MiB"
    );
    // Per shape: our deterministic default's rate, our best rate and its mode, the peer's rates.
    let mut summary = Vec::new();
    for s in selected_shapes(args) {
        let mut b = buffers(dev, &s)?;
        let (mut default_rate, mut best): (Option<f64>, Option<(&str, f64)>) = (None, None);
        for (name, cfg) in modes(args.wgmma) {
            // The default first, always: it is the row compared with the peer.
            if name != "default" && !args.wanted(name) {
                continue;
            }
            // A mode whose chosen backward kernel is not compiled for this head dim (the column split
            // exists at head dim 128 only) has no row there.
            if cfg
                .tiles
                .wgmma_backward
                .is_some_and(|t| !wgmma_backward_variants(s.head_dim).contains(&t))
            {
                continue;
            }
            // Each mode's own workspace size; the forward, then the backward from its outputs.
            b.ws = AttentionWorkspace::new();
            let timed = time_pass(dev, &s, &cfg, &mut b, args.iters, Pass::Forward).and_then(|f| {
                Ok((
                    f,
                    time_pass(dev, &s, &cfg, &mut b, args.iters, Pass::Backward)?,
                ))
            });
            let (f, bw) = match timed {
                Ok(t) => t,
                Err(e) => {
                    println!("{:<24} {name:<18} error: {e}", label(&s));
                    continue;
                }
            };
            let tf = tflops(&s, f + bw);
            if default_rate.is_none() {
                default_rate = Some(tf);
            }
            if best.is_none_or(|(_, r)| tf > r) {
                best = Some((name, tf));
            }
            let (splits, _) = backward_splits(dev, &s, &cfg)?;
            let kernels = kernels_label(&cfg, s.head_dim)?;
            println!(
                "{:<24} {:<18} {:>7.3} {:>7.3} {:>8.3} {:>7.1} | {:>6} {:>7.1} | {kernels}",
                label(&s),
                name,
                f,
                bw,
                f + bw,
                tf,
                splits,
                b.ws.bytes() as f64 / (1u64 << 20) as f64
            );
        }
        summary.push((s, default_rate, best, peer_rates(records, &s)));
        if let Some(dir) = &args.dump {
            if let Err(e) = dump(dir, dev, &s, &mut b) {
                println!("dump of {} failed: {e}", label(&s));
            }
        }
    }
    if args.wgmma {
        wgmma_forwards(dev, args)?;
        wgmma_backwards(dev, args)?;
    }
    if args.sweep {
        sweep(dev, args)?;
    }
    // The short table last: ours (the deterministic default, and the best mode) against PyTorch's
    // backends measured in the same call.
    println!("\nattention fwd+bwd TFLOP/s, ours against PyTorch (same call)");
    println!(
        "{:<24} {:>8} {:>26} | {:>7} {:>5} {:>5} {:>10} | {:>11} {:>9}",
        "shape",
        "ours det",
        "ours best (mode)",
        "default",
        "flash",
        "cuDNN",
        "cuDNN exp.",
        "det / best",
        "ratio vs"
    );
    for (s, det, best, peer) in summary {
        let peer_best = peer.best();
        let ratio = match (det, peer_best) {
            (Some(d), Some((_, p))) => format!("{:.2}x", d / p),
            _ => "-".into(),
        };
        println!(
            "{:<24} {:>8} {:>26} | {:>7} {:>5} {:>5} {:>10} | {:>11} {:>9}",
            label(&s),
            rate_cell(det),
            best.map_or_else(|| "-".into(), |(n, r)| format!("{r:.0} ({n})")),
            rate_cell(peer.default),
            rate_cell(peer.flash),
            rate_cell(peer.cudnn),
            rate_cell(peer.cudnn_expanded),
            ratio,
            peer_best.map_or("-", |(n, _)| n),
        );
    }
    Ok(())
}

/// The largest absolute difference between two equally long vectors (NaN counts as infinite).
fn max_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).fold(0.0f64, |m, (&x, &y)| {
        let d = (x as f64 - y as f64).abs();
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    })
}

/// The forwards alone at each shape of a wgmma head dim: the default (mma.sync) one, then every compiled
/// wgmma variant, with its speed-up over the default and its largest differences from the default's
/// out and lse on the same inputs.
fn wgmma_forwards(dev: &Device, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\nforward alone, wgmma variants against the mma.sync forward on the same inputs \
         (median ms; TFLOP/s = 4*B*H*T^2*hd/2 / time; max |diff| of out, relative to max |out|, and of lse)"
    );
    println!(
        "{:<24} {:<22} {:>8} {:>8} {:>8} {:>11} {:>10}",
        "shape", "forward", "ms", "TFLOP/s", "speed-up", "out diff", "lse diff"
    );
    for s in selected_shapes(args) {
        if !WGMMA_HEAD_DIMS.contains(&s.head_dim) {
            continue;
        }
        let mut b = buffers(dev, &s)?;
        let fwd_tf = |ms: f64| tflops(&s, ms) / 3.5;
        // The mma.sync forward by name: the default takes the wgmma forward on Hopper.
        let base = AttentionConfig {
            kernel: AttentionKernel::Mma,
            ..Default::default()
        };
        let base_ms = time_pass(dev, &s, &base, &mut b, args.iters, Pass::Forward)?;
        let (fwd_tiles, _) = base.kernels_for(s.head_dim)?;
        let out_ref: Vec<f32> = b.out.to_vec()?.iter().map(|v| v.to_f32()).collect();
        let lse_ref = b.lse.to_vec()?;
        let out_max = out_ref.iter().fold(0.0f64, |m, &v| m.max(v.abs() as f64));
        println!(
            "{:<24} {:<22} {base_ms:>8.3} {:>8.1} {:>8} {:>11} {:>10}",
            label(&s),
            format!("mma {fwd_tiles}"),
            fwd_tf(base_ms),
            "1.00x",
            "-",
            "-"
        );
        for &t in wgmma_forward_variants(s.head_dim) {
            let cfg = AttentionConfig {
                tiles: AttentionTiles {
                    wgmma_forward: Some(t),
                    ..Default::default()
                },
                ..wgmma_config()
            };
            let name = format!("wgmma {t}");
            if !args.wanted(&name) {
                continue;
            }
            // Poisoned outputs first, so a forward that writes nothing shows as a difference.
            b.out = dev.upload(&vec![bf16::NAN; s.out_len()])?;
            b.lse = dev.upload(&vec![f32::NAN; s.lse_len()])?;
            match time_pass(dev, &s, &cfg, &mut b, args.iters, Pass::Forward) {
                Ok(ms) => {
                    let out: Vec<f32> = b.out.to_vec()?.iter().map(|v| v.to_f32()).collect();
                    let lse = b.lse.to_vec()?;
                    println!(
                        "{:<24} {name:<22} {ms:>8.3} {:>8.1} {:>7.2}x {:>11.2e} {:>10.2e}",
                        label(&s),
                        fwd_tf(ms),
                        base_ms / ms,
                        max_diff(&out, &out_ref) / out_max.max(1e-30),
                        max_diff(&lse, &lse_ref)
                    );
                }
                Err(e) => println!("{:<24} {name:<22} error: {e}", label(&s)),
            }
        }
    }
    Ok(())
}

/// The backwards alone at each shape of a wgmma head dim (from the mma.sync forward's outputs): the
/// mma.sync deterministic default, then every compiled pair of wgmma dK/dV and dQ kernels and the wgmma
/// atomic kernel, with their speed-up over the mma.sync default and their largest difference from its
/// d_qkv.
fn wgmma_backwards(dev: &Device, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "\nbackward alone, wgmma kernels against the mma.sync deterministic default on the same inputs \
         (median ms; TFLOP/s = 2.5*4*B*H*T^2*hd/2 / time; max |diff| of d_qkv relative to max |d_qkv|)"
    );
    println!(
        "{:<24} {:<22} {:>8} {:>8} {:>8} {:>11}",
        "shape", "backward", "ms", "TFLOP/s", "speed-up", "dqkv diff"
    );
    for s in selected_shapes(args) {
        if !WGMMA_HEAD_DIMS.contains(&s.head_dim) {
            continue;
        }
        let mut b = buffers(dev, &s)?;
        let bwd_tf = |ms: f64| tflops(&s, ms) / 3.5 * 2.5;
        let base = mma_config();
        attention_forward(&s, &base, &b.qkv, &mut b.out, &mut b.lse)?;
        let base_ms = time_pass(dev, &s, &base, &mut b, args.iters, Pass::Backward)?;
        let (_, bwd) = base.kernels_for(s.head_dim)?;
        let ref_grad: Vec<f32> = b.d_qkv.to_vec()?.iter().map(|v| v.to_f32()).collect();
        let grad_max = ref_grad.iter().fold(0.0f64, |m, &v| m.max(v.abs() as f64));
        println!(
            "{:<24} {:<22} {base_ms:>8.3} {:>8.1} {:>8} {:>11}",
            label(&s),
            format!("mma {bwd}"),
            bwd_tf(base_ms),
            "1.00x",
            "-"
        );
        let mut cfgs: Vec<(String, AttentionConfig)> = wgmma_backward_variants(s.head_dim)
            .into_iter()
            .map(|t| {
                (
                    format!("wgmma {t}"),
                    AttentionConfig {
                        tiles: AttentionTiles {
                            wgmma_backward: Some(t),
                            ..Default::default()
                        },
                        ..wgmma_config()
                    },
                )
            })
            .collect();
        cfgs.push((
            "wgmma atomic".into(),
            AttentionConfig {
                dq_accumulation: DqAccumulation::Atomic,
                ..wgmma_config()
            },
        ));
        for (name, cfg) in cfgs {
            if !args.wanted(&name) {
                continue;
            }
            b.ws = AttentionWorkspace::new();
            b.d_qkv = dev.upload(&vec![bf16::NAN; s.qkv_len()])?;
            match time_pass(dev, &s, &cfg, &mut b, args.iters, Pass::Backward) {
                Ok(ms) => {
                    let g: Vec<f32> = b.d_qkv.to_vec()?.iter().map(|v| v.to_f32()).collect();
                    println!(
                        "{:<24} {name:<22} {ms:>8.3} {:>8.1} {:>7.2}x {:>11.2e}",
                        label(&s),
                        bwd_tf(ms),
                        base_ms / ms,
                        max_diff(&g, &ref_grad) / grad_max.max(1e-30),
                    );
                }
                Err(e) => println!("{:<24} {name:<22} error: {e}", label(&s)),
            }
        }
    }
    Ok(())
}

/// The fastest choices of a sweep at one shape.
struct Best {
    shape: AttentionShape,
    forward: (QueryTiles, f64),
    deterministic: (BackwardKernels, f64),
    atomic: (usize, f64),
}

fn better<T: Copy>(best: &mut Option<(T, f64)>, what: T, ms: f64) {
    if best.is_none_or(|(_, b)| ms < b) {
        *best = Some((what, ms));
    }
}

fn sweep(dev: &Device, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut bests = Vec::new();
    for s in selected_shapes(args) {
        let hd = s.head_dim;
        let mut b = buffers(dev, &s)?;
        println!(
            "\nsweep {} (forward and backward timed separately)",
            label(&s)
        );
        println!("{:<46} {:>8} {:>8}", "variant", "ms", "TFLOP/s");
        // The forward's share of the peer formula: 1 of 3.5.
        let fwd_tf = |ms: f64| tflops(&s, ms) / 3.5;
        let bwd_tf = |ms: f64| tflops(&s, ms) * 2.5 / 3.5;
        let mut best_fwd = None;
        for &t in forward_variants(hd) {
            let cfg = AttentionConfig {
                tiles: AttentionTiles {
                    forward: Some(t),
                    ..Default::default()
                },
                ..Default::default()
            };
            match time_pass(dev, &s, &cfg, &mut b, args.iters, Pass::Forward) {
                Ok(ms) => {
                    println!(
                        "{:<46} {ms:>8.3} {:>8.1}",
                        format!("forward {t}"),
                        fwd_tf(ms)
                    );
                    better(&mut best_fwd, t, ms);
                }
                Err(e) => println!("{:<46} error: {e}", format!("forward {t}")),
            }
        }
        // The backward from the default forward's outputs.
        attention_forward(
            &s,
            &AttentionConfig::default(),
            &b.qkv,
            &mut b.out,
            &mut b.lse,
        )?;
        let (mut best_det, mut best_atomic) = (None, None);
        for bk in backward_variants(hd) {
            let modes: &[DqAccumulation] = match bk {
                BackwardKernels::Fused { .. } => {
                    &[DqAccumulation::Deterministic, DqAccumulation::Atomic]
                }
                BackwardKernels::Separate { .. } => &[DqAccumulation::Deterministic],
            };
            for &mode in modes {
                let cfg = AttentionConfig {
                    dq_accumulation: mode,
                    tiles: AttentionTiles {
                        backward: Some(bk),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let name = match mode {
                    DqAccumulation::Atomic => format!("backward {bk} atomic"),
                    DqAccumulation::Deterministic => format!("backward {bk}"),
                };
                match time_pass(dev, &s, &cfg, &mut b, args.iters, Pass::Backward) {
                    Ok(ms) => {
                        println!("{name:<46} {ms:>8.3} {:>8.1}", bwd_tf(ms));
                        match (mode, bk) {
                            (DqAccumulation::Atomic, BackwardKernels::Fused { query_rows }) => {
                                better(&mut best_atomic, query_rows, ms)
                            }
                            (DqAccumulation::Deterministic, _) => better(&mut best_det, bk, ms),
                            _ => {}
                        }
                    }
                    Err(e) => println!("{name:<46} error: {e}"),
                }
            }
        }
        for &query_rows in &FUSED_QUERY_ROWS {
            for splits in [1, 2, 3, 4, 6, 8, 16] {
                let cfg = AttentionConfig {
                    tiles: AttentionTiles {
                        backward: Some(BackwardKernels::Fused { query_rows }),
                        backward_splits: Some(splits),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let name = format!(
                    "backward fused q{query_rows} splits {}",
                    backward_splits(dev, &s, &cfg)?.0
                );
                match time_pass(dev, &s, &cfg, &mut b, args.iters, Pass::Backward) {
                    Ok(ms) => println!("{name:<46} {ms:>8.3} {:>8.1}", bwd_tf(ms)),
                    Err(e) => println!("{name:<46} error: {e}"),
                }
            }
        }
        if let (Some(forward), Some(deterministic), Some(atomic)) =
            (best_fwd, best_det, best_atomic)
        {
            bests.push(Best {
                shape: s,
                forward,
                deterministic,
                atomic,
            });
        }
    }
    println!(
        "\nfastest per shape, as lines of DEFAULT_TILES (fp8-kernels/src/attention/tiles.rs; it holds one \
         entry per head dim: where two shapes share a head dim, choose between their lines)"
    );
    for bst in &bests {
        let s = &bst.shape;
        let total = bst.forward.1 + bst.deterministic.1;
        println!(
            "    // {}: fwd {:.3} ms + bwd {:.3} ms = {total:.3} ms, {:.1} TFLOP/s deterministic; \
             atomic bwd {:.3} ms",
            label(s),
            bst.forward.1,
            bst.deterministic.1,
            tflops(s, total),
            bst.atomic.1
        );
        println!("    TileDefaults {{");
        println!("        head_dim: {},", s.head_dim);
        println!("        forward: {},", rust_query(&bst.forward.0));
        match bst.deterministic.0 {
            BackwardKernels::Fused { query_rows } => println!(
                "        deterministic: BackwardKernels::Fused {{ query_rows: {query_rows} }},"
            ),
            BackwardKernels::Separate { dkdv, dq } => {
                println!("        deterministic: BackwardKernels::Separate {{");
                if dkdv.paired {
                    println!(
                        "            dkdv: KeyTiles::pairs({}, {}),",
                        dkdv.warps / 2,
                        dkdv.query_rows
                    );
                } else {
                    println!(
                        "            dkdv: k({}, {}, {}),",
                        dkdv.warps, dkdv.key_tiles, dkdv.query_rows
                    );
                }
                println!("            dq: {},", rust_query(&dq));
                println!("        }},");
            }
        }
        println!("        atomic_query_rows: {},", bst.atomic.0);
        println!("    }},");
    }
    Ok(())
}

fn rust_query(t: &QueryTiles) -> String {
    format!("q({}, {}, {})", t.warps, t.row_tiles, t.key_rows)
}
