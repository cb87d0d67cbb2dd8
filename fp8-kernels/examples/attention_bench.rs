//! GPU benchmark of causal flash attention (forward + backward) at the PyTorch peer's shapes, and the
//! input/output dump for `scripts/check_attention_vs_torch.py`.
//!
//! ```text
//! attention_bench [--sweep] [--dump DIR] [--iters N]
//! ```
//!
//! - Table: for each peer shape (B16 H12 T1024 hd64, B4 H20 T2048 hd128, B8 H4 T1024 hd32) and each
//!   mode (the deterministic default, the fused backward with split buffers, the fused backward with
//!   atomics), the median over N (default 20) timed iterations after 5 warm-up ones of the forward, the
//!   backward and their sum, timed with CUDA events on the compute stream, and TFLOP/s by the peer's
//!   formula `3.5 * 4 * B * H * T^2 * hd / 2 / time`, beside PyTorch's figures measured on the H200
//!   (default, flash and cuDNN backends of `scaled_dot_product_attention`).
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
    AttentionConfig, AttentionShape, AttentionTiles, AttentionWorkspace, BackwardKernels,
    DqAccumulation, QueryTiles, FUSED_QUERY_ROWS,
};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{Buffer, Device, KernelError};
use half::bf16;
use std::path::{Path, PathBuf};

/// A peer shape and PyTorch's TFLOP/s there (H200, `peer_layers.py`): default, flash, cuDNN.
struct Peer {
    shape: AttentionShape,
    default: f64,
    flash: f64,
    cudnn: f64,
}

fn peers() -> [Peer; 3] {
    [
        Peer {
            shape: AttentionShape::new(16, 12, 1024, 64),
            default: 179.0,
            flash: 134.0,
            cudnn: 193.0,
        },
        Peer {
            shape: AttentionShape::new(4, 20, 2048, 128),
            default: 348.0,
            flash: 204.0,
            cudnn: 356.0,
        },
        Peer {
            shape: AttentionShape::new(8, 4, 1024, 32),
            default: 25.0,
            flash: 35.0,
            cudnn: 37.0,
        },
    ]
}

struct Args {
    sweep: bool,
    dump: Option<PathBuf>,
    iters: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        sweep: false,
        dump: None,
        iters: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--sweep" => a.sweep = true,
            "--dump" => a.dump = Some(it.next().ok_or("--dump needs a folder")?.into()),
            "--iters" => {
                a.iters = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n| n > 0)
                    .ok_or("--iters needs a positive integer")?
            }
            "-h" | "--help" => {
                println!("attention_bench [--sweep] [--dump DIR] [--iters N]");
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

fn label(s: &AttentionShape) -> String {
    format!("B{} H{} T{} hd{}", s.batch, s.heads, s.seq_len, s.head_dim)
}

fn tflops(s: &AttentionShape, ms: f64) -> f64 {
    s.causal_flops_fwd_bwd() / (ms * 1e-3) / 1e12
}

fn dump(
    dir: &Path,
    dev: &Device,
    p: &Peer,
    b: &mut Bufs,
) -> Result<(), Box<dyn std::error::Error>> {
    let s = &p.shape;
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
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("attention_bench: no GPU, nothing to measure ({e})");
            return;
        }
    };
    if let Err(e) = run(&dev, &args) {
        eprintln!("attention_bench: {e}");
        std::process::exit(1);
    }
}

/// The modes of the main table.
fn modes() -> [(&'static str, AttentionConfig); 3] {
    let fused_det = AttentionConfig {
        tiles: AttentionTiles {
            backward: Some(BackwardKernels::Fused { query_rows: 64 }),
            ..Default::default()
        },
        ..Default::default()
    };
    [
        ("deterministic", AttentionConfig::default()),
        ("fused det.", fused_det),
        (
            "fused atomic",
            AttentionConfig {
                dq_accumulation: DqAccumulation::Atomic,
                ..Default::default()
            },
        ),
    ]
}

fn run(dev: &Device, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "causal attention fwd+bwd, BF16, median of {} after 5 warm-up (CUDA events); TFLOP/s = 3.5 * \
         4*B*H*T^2*hd / 2 / time; PyTorch peer figures measured on the H200",
        args.iters
    );
    println!(
        "{:<20} {:<13} {:>7} {:>7} {:>8} {:>7} | {:>7} {:>5} {:>5} | {:>6} {:>8} | {:>6} {:>7} | kernels",
        "shape",
        "mode",
        "fwd ms",
        "bwd ms",
        "total ms",
        "TFLOP/s",
        "default",
        "flash",
        "cuDNN",
        "/flash",
        "/default",
        "splits",
        "ws MiB"
    );
    for p in peers() {
        let s = p.shape;
        let mut b = buffers(dev, &s)?;
        for (name, cfg) in modes() {
            b.ws = AttentionWorkspace::new(); // each mode's own workspace size
                                              // The forward, then the backward from its outputs.
            let timed = time_pass(dev, &s, &cfg, &mut b, args.iters, Pass::Forward).and_then(|f| {
                Ok((
                    f,
                    time_pass(dev, &s, &cfg, &mut b, args.iters, Pass::Backward)?,
                ))
            });
            let (f, bw) = match timed {
                Ok(t) => t,
                Err(e) => {
                    println!("{:<20} {name:<13} error: {e}", label(&s));
                    continue;
                }
            };
            let tf = tflops(&s, f + bw);
            let (splits, _) = backward_splits(dev, &s, &cfg)?;
            let (fwd_tiles, bwd_kernels) = cfg.kernels_for(s.head_dim)?;
            println!(
                "{:<20} {:<13} {:>7.3} {:>7.3} {:>8.3} {:>7.1} | {:>7.0} {:>5.0} {:>5.0} | {:>5.2}x {:>7.2}x | {:>6} {:>7.1} | fwd {fwd_tiles}, {bwd_kernels}",
                label(&s),
                name,
                f,
                bw,
                f + bw,
                tf,
                p.default,
                p.flash,
                p.cudnn,
                tf / p.flash,
                tf / p.default,
                splits,
                b.ws.bytes() as f64 / (1u64 << 20) as f64
            );
        }
        if let Some(dir) = &args.dump {
            if let Err(e) = dump(dir, dev, &p, &mut b) {
                println!("dump of {} failed: {e}", label(&s));
            }
        }
    }
    if args.sweep {
        sweep(dev, args)?;
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
    for p in peers() {
        let s = p.shape;
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
        "\nfastest per head dim: the lines of DEFAULT_TILES (fp8-kernels/src/attention/tiles.rs)"
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
