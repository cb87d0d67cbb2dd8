//! GPU bench of the block-scaled FP8 GEMM (`gemm_fp8_block`, cuBLASLt's `VEC128_32F` / `BLK128x128_32F`
//! scale modes) against our per-tensor FP8 GEMM (`gemm_fp8`), on the linear layer's three products at
//! the shapes of the blockwise issue, `(M, K, N)` = tokens x inputs x outputs:
//!
//! | product | GEMM `m x n x k` | block operands | per-tensor operands |
//! | --- | --- | --- | --- |
//! | forward `y = x W^T` | `M x N x K` | x 1x128, W 128x128 | x, W |
//! | data gradient `dx = dy W`, W as stored | `M x K x N` | dy 1x128, W 128x128 read transposed (copied per call) | dy, W re-laid out per call |
//! | data gradient, `W^T` held | `M x K x N` | dy 1x128, `W^T` 128x128 (`transpose_block_fp8`, once) | dy, `W^T` |
//! | weight gradient `dW = dy^T x` | `N x K x M` | `dy^T`, `x^T`, 1x128 along the tokens | `dy^T`, `x^T` |
//! | forward 1x128 x 1x128 | `M x N x K` | x 1x128, W 1x128 | (the forward's) |
//!
//! Every operand E4M3 (DeepSeek-V3's recipe, `Fp8Recipe::block_scaled`; the peer's format too), cast from
//! random bf16 values by `block_quantize` on the GPU with scales in the GEMM's order (the per-tensor GEMM
//! reuses the codes with scale 1: its speed does not depend on the values), bf16 output, alpha 1, beta 0.
//! Time: CUDA events around each call on the compute stream, 5 warm-up calls, the median of `--iters`
//! (default 20). TFLOP/s = `2 m n k / time`.
//!
//! `--peer FILE` reads the JSON lines `bench/peers/peer_blockwise_gemm.py` prints on the same machine
//! (`bench/run.sh kernels` runs it first and passes its log; `torch._scaled_mm`:
//! `fp8_tensor`, `fp8_block_1x128_128x128`, `fp8_block_1x128_1x128` at each `(M, K, N)`) and prints the
//! peer's figure of the same GEMM (same `m, k, n` and block pairing) beside ours. The short table last
//! gives the block / per-tensor ratios against the targets: forward and data gradient >= 0.9,
//! weight gradient >= 0.7.
//!
//! Usage: `block_gemm_bench [--iters N] [--peer FILE]`. Without a GPU it prints why and exits 0.

mod common;

use common::{bench_exit, random_bf16, time_ms};
use fp8_core::Fp8Format;
use fp8_kernels::gemm::{gemm_fp8, gemm_fp8_block, transpose_block_fp8};
use fp8_kernels::{
    block_quantize, BlockFp8Matrix, BlockQuantLayout, BlockQuantSpec, Buffer, CudaDevice, Device,
    DeviceScalar, Fp8Matrix, GemmSpec, KernelError, ScaleOrder, Transpose,
};
use half::bf16;
use std::collections::HashMap;
use std::process::ExitCode;

/// The shapes, `(M, K, N)`.
const SHAPES: [(usize, usize, usize); 5] = [
    (8192, 4096, 14336),
    (8192, 14336, 4096),
    (8192, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 2560, 10240),
];

/// A block-scaled E4M3 cast held on the GPU.
struct Cast {
    codes: Buffer<u8>,
    scale_inv: Buffer<f32>,
    layout: fp8_core::BlockLayout,
}

impl Cast {
    fn new(
        gpu: &Device,
        x: &Buffer<bf16>,
        shape: [usize; 2],
        layout: BlockQuantLayout,
    ) -> Result<Cast, KernelError> {
        let out = layout.output_layout(shape[0], shape[1])?;
        let n = ScaleOrder::Gemm.strides(&out)?.len;
        let mut codes = gpu.zeros::<u8>(out.numel())?;
        let mut scale = gpu.zeros::<f32>(n)?;
        let mut scale_inv = gpu.zeros::<f32>(n)?;
        let spec = BlockQuantSpec::new(layout, Fp8Format::E4M3).with_scale_order(ScaleOrder::Gemm);
        block_quantize(x, shape, spec, &mut codes, &mut scale, &mut scale_inv)?;
        Ok(Cast {
            codes,
            scale_inv,
            layout: out,
        })
    }

    fn block(&self) -> BlockFp8Matrix<'_> {
        BlockFp8Matrix {
            data: &self.codes,
            format: Fp8Format::E4M3,
            layout: self.layout,
            scale_inv: &self.scale_inv,
            scale_order: ScaleOrder::Gemm,
        }
    }

    /// The same codes as a per-tensor operand with inverse scale `one`.
    fn tensor<'a>(&'a self, one: &'a Buffer<f32>) -> Fp8Matrix<'a> {
        Fp8Matrix {
            data: &self.codes,
            format: Fp8Format::E4M3,
            scale_inv: DeviceScalar {
                buffer: one,
                index: 0,
            },
        }
    }
}

/// The peer's columns, by GEMM `(m, k, n)`.
type Peer = HashMap<(usize, usize, usize), HashMap<String, f64>>;

/// Reads `peer_blockwise_gemm.py`'s JSON lines (fields that are error strings are left out).
fn read_peer(path: &str) -> Result<Peer, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut peer = Peer::new();
    for line in text.lines().filter(|l| l.trim_start().starts_with('{')) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("{path}: {e}: {line}"))?;
        let dim = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
        let (Some(m), Some(k), Some(n)) = (dim("M"), dim("K"), dim("N")) else {
            return Err(format!("{path}: no M, K, N in {line}"));
        };
        let cols = v
            .as_object()
            .map(|o| {
                o.iter()
                    .filter_map(|(key, x)| x.as_f64().map(|f| (key.clone(), f)))
                    .collect()
            })
            .unwrap_or_default();
        peer.insert((m, k, n), cols);
    }
    Ok(peer)
}

/// One measured product.
struct Row {
    shape: (usize, usize, usize),
    product: &'static str,
    /// GEMM `(m, k, n)`.
    gemm: (usize, usize, usize),
    tensor: f64,
    block: f64,
    /// The peer's block column for this pairing.
    peer_block_key: &'static str,
    target: Option<f64>,
}

fn tflops(m: usize, n: usize, k: usize, ms: f64) -> f64 {
    2.0 * m as f64 * n as f64 * k as f64 / (ms * 1e-3) / 1e12
}

fn bench_shape(
    dev: &CudaDevice,
    gpu: &Device,
    (mm, kk, nn): (usize, usize, usize),
    iters: usize,
) -> Result<Vec<Row>, KernelError> {
    let x16 = gpu.upload(&random_bf16(mm * kk, 1))?;
    let w16 = gpu.upload(&random_bf16(nn * kk, 2))?;
    let dy16 = gpu.upload(&random_bf16(mm * nn, 3))?;
    let x = Cast::new(gpu, &x16, [mm, kk], BlockQuantLayout::Rows1x128)?;
    let xt = Cast::new(
        gpu,
        &x16,
        [mm, kk],
        BlockQuantLayout::Columns128x1Transposed,
    )?;
    let w = Cast::new(gpu, &w16, [nn, kk], BlockQuantLayout::Blocks128x128)?;
    let w_tiles = Cast::new(gpu, &w16, [nn, kk], BlockQuantLayout::Rows1x128)?;
    let dy = Cast::new(gpu, &dy16, [mm, nn], BlockQuantLayout::Rows1x128)?;
    let dyt = Cast::new(
        gpu,
        &dy16,
        [mm, nn],
        BlockQuantLayout::Columns128x1Transposed,
    )?;
    drop((x16, w16, dy16));
    // W^T: its 128x128 blocks are W's, transposed once.
    let wt_layout = w.layout.transposed();
    let mut wt = Cast {
        codes: gpu.zeros::<u8>(wt_layout.numel())?,
        scale_inv: gpu.zeros::<f32>(ScaleOrder::Gemm.strides(&wt_layout)?.len)?,
        layout: wt_layout,
    };
    transpose_block_fp8(
        w.block(),
        &mut wt.codes,
        &mut wt.scale_inv,
        ScaleOrder::Gemm,
    )?;
    let one = gpu.upload(&[1.0f32])?;
    let tn = |m, n, k| GemmSpec::new(m, n, k).transposes(Transpose::No, Transpose::Yes);
    let nn_spec = |m, n, k| GemmSpec::new(m, n, k);
    let mut rows = Vec::new();

    // Forward: y [M, N] = x [M, K] W [N, K]^T.
    let mut y = gpu.zeros::<bf16>(mm * nn)?;
    let s = tn(mm, nn, kk);
    let t = time_ms(dev, iters, || {
        gemm_fp8(&s, x.tensor(&one), w.tensor(&one), &mut y)
    })?;
    let b = time_ms(dev, iters, || {
        gemm_fp8_block(&s, x.block(), w.block(), &mut y)
    })?;
    let fwd_tensor = tflops(mm, nn, kk, t);
    rows.push(Row {
        shape: (mm, kk, nn),
        product: "forward",
        gemm: (mm, kk, nn),
        tensor: fwd_tensor,
        block: tflops(mm, nn, kk, b),
        peer_block_key: "fp8_block_1x128_128x128",
        target: Some(0.9),
    });
    // Forward with both operands in 1x128 tiles (the peer's third column).
    let b = time_ms(dev, iters, || {
        gemm_fp8_block(&s, x.block(), w_tiles.block(), &mut y)
    })?;
    rows.push(Row {
        shape: (mm, kk, nn),
        product: "forward 1x128 x 1x128",
        gemm: (mm, kk, nn),
        tensor: fwd_tensor,
        block: tflops(mm, nn, kk, b),
        peer_block_key: "fp8_block_1x128_1x128",
        target: None,
    });
    drop(y);

    // Data gradient: dx [M, K] = dy [M, N] W [N, K].
    let mut dx = gpu.zeros::<bf16>(mm * kk)?;
    let s = nn_spec(mm, kk, nn);
    let t = time_ms(dev, iters, || {
        gemm_fp8(&s, dy.tensor(&one), w.tensor(&one), &mut dx)
    })?;
    let b = time_ms(dev, iters, || {
        gemm_fp8_block(&s, dy.block(), w.block(), &mut dx)
    })?;
    rows.push(Row {
        shape: (mm, kk, nn),
        product: "data gradient, W as stored",
        gemm: (mm, nn, kk),
        tensor: tflops(mm, kk, nn, t),
        block: tflops(mm, kk, nn, b),
        peer_block_key: "fp8_block_1x128_128x128",
        target: Some(0.9),
    });
    let s = tn(mm, kk, nn);
    let t = time_ms(dev, iters, || {
        gemm_fp8(&s, dy.tensor(&one), wt.tensor(&one), &mut dx)
    })?;
    let b = time_ms(dev, iters, || {
        gemm_fp8_block(&s, dy.block(), wt.block(), &mut dx)
    })?;
    rows.push(Row {
        shape: (mm, kk, nn),
        product: "data gradient, W^T held",
        gemm: (mm, nn, kk),
        tensor: tflops(mm, kk, nn, t),
        block: tflops(mm, kk, nn, b),
        peer_block_key: "fp8_block_1x128_128x128",
        target: Some(0.9),
    });
    drop(dx);

    // Weight gradient: dW [N, K] = dy^T [N, M] (x^T [K, M])^T.
    let mut dw = gpu.zeros::<bf16>(nn * kk)?;
    let s = tn(nn, kk, mm);
    let t = time_ms(dev, iters, || {
        gemm_fp8(&s, dyt.tensor(&one), xt.tensor(&one), &mut dw)
    })?;
    let b = time_ms(dev, iters, || {
        gemm_fp8_block(&s, dyt.block(), xt.block(), &mut dw)
    })?;
    rows.push(Row {
        shape: (mm, kk, nn),
        product: "weight gradient",
        gemm: (nn, mm, kk),
        tensor: tflops(nn, kk, mm, t),
        block: tflops(nn, kk, mm, b),
        peer_block_key: "fp8_block_1x128_1x128",
        target: Some(0.7),
    });
    Ok(rows)
}

fn bench(iters: usize, peer: Option<Peer>) -> Result<(), KernelError> {
    let gpu = Device::cuda(0)?;
    let dev = gpu.as_cuda("block_gemm_bench")?.clone();
    println!(
        "block_gemm_bench: E4M3 operands, bf16 output; median of {iters} after 5 warm-up (CUDA events); \
         TFLOP/s; shape = M x K x N (tokens x in x out), GEMM = m x k x n"
    );
    let mut rows = Vec::new();
    for shape in SHAPES {
        match bench_shape(&dev, &gpu, shape, iters) {
            Ok(r) => rows.extend(r),
            Err(e) => println!("{} x {} x {}: error: {e}", shape.0, shape.1, shape.2),
        }
    }
    let fmt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.0}"));
    println!(
        "| shape | product | GEMM | per-tensor | block | block / per-tensor | target | peer per-tensor | \
         peer block | block / peer block |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        let p = peer.as_ref().and_then(|p| p.get(&r.gemm));
        let pt = p.and_then(|c| c.get("fp8_tensor").copied());
        let pb = p.and_then(|c| c.get(r.peer_block_key).copied());
        println!(
            "| {} x {} x {} | {} | {} x {} x {} | {:.0} | {:.0} | {:.2} | {} | {} | {} | {} |",
            r.shape.0,
            r.shape.1,
            r.shape.2,
            r.product,
            r.gemm.0,
            r.gemm.1,
            r.gemm.2,
            r.tensor,
            r.block,
            r.block / r.tensor,
            r.target.map_or("-".into(), |t| format!(">= {t}")),
            fmt(pt),
            fmt(pb),
            pb.map_or("-".into(), |v| format!("{:.2}", r.block / v)),
        );
    }
    // The short table: block / per-tensor per shape against the targets.
    println!();
    println!("| shape | forward | data gradient (W^T held / as stored) | weight gradient | targets met |");
    println!("| --- | --- | --- | --- | --- |");
    for shape in SHAPES {
        let ratio = |p: &str| {
            rows.iter()
                .find(|r| r.shape == shape && r.product == p)
                .map(|r| r.block / r.tensor)
        };
        let (f, dh, ds, wg) = (
            ratio("forward"),
            ratio("data gradient, W^T held"),
            ratio("data gradient, W as stored"),
            ratio("weight gradient"),
        );
        let r2 = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
        let met = match (f, dh, wg) {
            (Some(f), Some(d), Some(w)) => {
                if f >= 0.9 && d >= 0.9 && w >= 0.7 {
                    "yes"
                } else {
                    "no"
                }
            }
            _ => "-",
        };
        println!(
            "| {} x {} x {} | {} | {} / {} | {} | {met} |",
            shape.0,
            shape.1,
            shape.2,
            r2(f),
            r2(dh),
            r2(ds),
            r2(wg)
        );
    }
    Ok(())
}

fn usage() -> ExitCode {
    eprintln!("usage: block_gemm_bench [--iters N] [--peer FILE]");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut iters = 20usize;
    let mut peer = None;
    let mut i = 0;
    while i < args.len() {
        match (args[i].as_str(), args.get(i + 1)) {
            ("--iters", Some(v)) => match v.parse::<usize>() {
                Ok(n) if n > 0 => iters = n,
                _ => return usage(),
            },
            ("--peer", Some(v)) => match read_peer(v) {
                Ok(p) => peer = Some(p),
                Err(e) => {
                    eprintln!("block_gemm_bench: {e}");
                    return ExitCode::from(2);
                }
            },
            _ => return usage(),
        }
        i += 2;
    }
    bench_exit(bench(iters, peer))
}
