//! GPU benchmark of causal flash attention (forward + backward) at the PyTorch peer's shapes, and the
//! input/output dump for `scripts/check_attention_vs_torch.py`.
//!
//! ```text
//! attention_bench [--sweep] [--dump DIR] [--iters N]
//! ```
//!
//! - Table: for each peer shape (B16 H12 T1024 hd64, B4 H20 T2048 hd128, B8 H4 T1024 hd32) and each dQ
//!   mode (deterministic, atomic), the median over N (default 20) timed iterations after 5 warm-up ones of
//!   the forward, the backward and their sum, timed with CUDA events on the compute stream, and TFLOP/s by
//!   the peer's formula `3.5 * 4 * B * H * T^2 * hd / 2 / time`, beside PyTorch's figures measured on the
//!   H200 (default, flash and cuDNN backends of `scaled_dot_product_attention`).
//! - `--sweep`: the same for every tile choice (forward 64/128 query rows, backward 32/64, deterministic
//!   and atomic) and for deterministic split counts 1 to 16, forward and backward separately, to choose
//!   the defaults.
//! - `--dump DIR`: writes, per shape, `DIR/<shape>/{qkv,dout,out,lse,dqkv}.bin` (raw little-endian:
//!   bf16 for qkv, dout, out, dqkv; f32 for lse) and `meta.txt` (B H T hd scale), from the
//!   deterministic default path, for the PyTorch comparison script.
//!
//! Without a GPU it prints why and exits 0.

use fp8_kernels::attention::{
    attention_backward, attention_forward, backward_splits, AttentionConfig, AttentionShape,
    AttentionTiles, AttentionWorkspace, DqAccumulation,
};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{Buffer, Device, KernelError};
use half::bf16;
use std::path::{Path, PathBuf};

/// A peer shape and PyTorch's TFLOP/s there (H200; DESIGN.md and issue 14): default, flash, cuDNN.
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

/// Median forward and backward milliseconds over `iters` timed iterations after 5 warm-up ones.
fn time(
    dev: &Device,
    s: &AttentionShape,
    cfg: &AttentionConfig,
    b: &mut Bufs,
    iters: usize,
) -> Result<(f64, f64), KernelError> {
    let cuda = dev.as_cuda("attention_bench")?;
    let step = |b: &mut Bufs| -> Result<(), KernelError> {
        attention_forward(s, cfg, &b.qkv, &mut b.out, &mut b.lse)?;
        attention_backward(
            s,
            cfg,
            &b.qkv,
            &b.out,
            &b.d_out,
            &b.lse,
            &mut b.d_qkv,
            &mut b.ws,
        )
    };
    for _ in 0..5 {
        step(b)?;
    }
    dev.synchronize()?;
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    for _ in 0..iters {
        let e0 = cuda.record_compute_timed()?;
        attention_forward(s, cfg, &b.qkv, &mut b.out, &mut b.lse)?;
        let e1 = cuda.record_compute_timed()?;
        attention_backward(
            s,
            cfg,
            &b.qkv,
            &b.out,
            &b.d_out,
            &b.lse,
            &mut b.d_qkv,
            &mut b.ws,
        )?;
        let e2 = cuda.record_compute_timed()?;
        fwd.push(e0.elapsed_ms(&e1)? as f64);
        bwd.push(e1.elapsed_ms(&e2)? as f64);
    }
    Ok((median(fwd), median(bwd)))
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

fn run(dev: &Device, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let modes = [
        ("deterministic", DqAccumulation::Deterministic),
        ("atomic", DqAccumulation::Atomic),
    ];
    println!(
        "causal attention fwd+bwd, BF16, median of {} after 5 warm-up (CUDA events); TFLOP/s = 3.5 * \
         4*B*H*T^2*hd / 2 / time; PyTorch peer figures measured on the H200",
        args.iters
    );
    println!(
        "{:<22} {:<14} {:>8} {:>8} {:>9} {:>8} | {:>7} {:>6} {:>6} | {:>8} {:>10} | {:>6} {:>8}",
        "shape",
        "dQ mode",
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
        for (name, mode) in modes {
            let cfg = AttentionConfig {
                dq_accumulation: mode,
                ..Default::default()
            };
            let (f, bw) = time(dev, &s, &cfg, &mut b, args.iters)?;
            let tf = tflops(&s, f + bw);
            let (splits, _) = backward_splits(dev, &s, &cfg)?;
            println!(
                "{:<22} {:<14} {:>8.3} {:>8.3} {:>9.3} {:>8.1} | {:>7.0} {:>6.0} {:>6.0} | {:>7.2}x {:>9.2}x | {:>6} {:>8.1}",
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
            dump(dir, dev, &p, &mut b)?;
        }
    }
    if args.sweep {
        println!("\ntile sweep (forward / backward separately; TFLOP/s of fwd+bwd with that pair)");
        println!(
            "{:<22} {:>8} {:>8} {:<14} {:>8} {:>8} {:>8}",
            "shape", "fwd rows", "bwd rows", "dQ mode", "fwd ms", "bwd ms", "TFLOP/s"
        );
        for p in peers() {
            let s = p.shape;
            let mut b = buffers(dev, &s)?;
            for fr in [64, 128] {
                for br in [32, 64] {
                    for (name, mode) in modes {
                        let cfg = AttentionConfig {
                            dq_accumulation: mode,
                            tiles: AttentionTiles {
                                forward_rows: Some(fr),
                                backward_rows: Some(br),
                                backward_splits: None,
                            },
                            ..Default::default()
                        };
                        match time(dev, &s, &cfg, &mut b, args.iters) {
                            Ok((f, bw)) => println!(
                                "{:<22} {:>8} {:>8} {:<14} {:>8.3} {:>8.3} {:>8.1}",
                                label(&s),
                                fr,
                                br,
                                name,
                                f,
                                bw,
                                tflops(&s, f + bw)
                            ),
                            Err(e) => {
                                println!("{:<22} {fr:>8} {br:>8} {name:<14} error: {e}", label(&s))
                            }
                        }
                    }
                }
            }
            for splits in [1, 2, 3, 4, 6, 8, 16] {
                let cfg = AttentionConfig {
                    tiles: AttentionTiles {
                        backward_splits: Some(splits),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let (f, bw) = time(dev, &s, &cfg, &mut b, args.iters)?;
                println!(
                    "{:<22} {:>8} {:>8} {:<14} {:>8.3} {:>8.3} {:>8.1}",
                    label(&s),
                    "default",
                    "default",
                    format!("det splits {}", backward_splits(dev, &s, &cfg)?.0),
                    f,
                    bw,
                    tflops(&s, f + bw)
                );
            }
        }
    }
    Ok(())
}
