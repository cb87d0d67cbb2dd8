//! GPU bench of the block-scaled casts (`block_quantize_tiles`): each cast's memory rate against the copy
//! ceiling measured in the same run, at the activation shapes of the block-scaled linears (tokens x width
//! of gpt-3b, llama-3b and llama-8b at 8192 tokens).
//!
//! | row | reads (bytes per output element) | writes |
//! | --- | --- | --- |
//! | `1x128`, `128x1^T` (one layout) | 2 (bf16 `x`) | 1 code (+ scales) |
//! | both layouts | 2 | 2 codes |
//! | GELU, both | 2 (`u`) | 2 |
//! | GELU gradient, both | 4 (`u`, `dy`) | 2 |
//! | SwiGLU, both | 4 (`gate`, `up`) | 2 |
//! | SwiGLU gradient, both (`[dgate, dup]`, width `2 w`) | 2 + 1 (`gu`, `dh` per output) | 2 |
//! | LayerNorm statistics only (`norm_forward_stats`) | 2 | 8 bytes a row |
//! | LayerNorm output from them, both | 2 (`x`; weight and statistics are small) | 2 |
//!
//! A cast is a memory-bound pass: its rate is (bytes read + bytes written, scales included) / time,
//! and the ceiling is a device-to-device copy of the input (2 x its bytes / time). Every input is
//! random bf16 in [-1, 1); E4M3 codes, power-of-two scales, scales in the GEMM's order. Time: CUDA events
//! around each call, 5 warm-up calls, the median of `--iters` (default 20).
//!
//! Usage: `block_cast_bench [--iters N]`. Without a GPU it prints why and exits 0.

mod common;

use common::{bench_exit, random_bf16, time_ms};
use fp8_core::{Fp8Format, ScaleRounding};
use fp8_kernels::elementwise::GeluApprox;
use fp8_kernels::layer_norm::{norm_forward_stats, NormSpec, NormStats};
use fp8_kernels::{
    block_quantize_tiles, BlockCastInput, BlockQuantLayout, BlockQuantOutput, Buffer, Device,
    KernelError, ScaleOrder,
};
use half::bf16;
use std::process::ExitCode;

/// `(preset, tokens, width)`: the inputs of the linears (model width) and of the down projections
/// (hidden width).
const SHAPES: [(&str, usize, usize); 6] = [
    ("gpt-3b", 8192, 2560),
    ("gpt-3b", 8192, 10240),
    ("llama-3b", 8192, 3072),
    ("llama-3b", 8192, 8192),
    ("llama-8b", 8192, 4096),
    ("llama-8b", 8192, 14336),
];

/// One layout's output buffers for a `[rows, cols]` cast.
struct Out {
    codes: Buffer<u8>,
    scale: Buffer<f32>,
    scale_inv: Buffer<f32>,
}

impl Out {
    fn new(
        gpu: &Device,
        layout: BlockQuantLayout,
        [rows, cols]: [usize; 2],
    ) -> Result<Out, KernelError> {
        let l = layout.output_layout(rows, cols)?;
        let n = ScaleOrder::Gemm.strides(&l)?.len;
        Ok(Out {
            codes: gpu.zeros::<u8>(l.numel())?,
            scale: gpu.zeros::<f32>(n)?,
            scale_inv: gpu.zeros::<f32>(n)?,
        })
    }

    fn view(&mut self) -> BlockQuantOutput<'_> {
        BlockQuantOutput {
            codes: &mut self.codes,
            scale: &mut self.scale,
            scale_inv: &mut self.scale_inv,
        }
    }

    /// Bytes written: the codes and both scale arrays.
    fn bytes(&self) -> usize {
        self.codes.len() + 8 * self.scale.len()
    }
}

/// Which layouts a row writes.
#[derive(Clone, Copy)]
enum Layouts {
    Rows,
    Cols,
    Both,
}

struct Row {
    preset: &'static str,
    shape: [usize; 2],
    cast: &'static str,
    ms: f64,
    gbs: f64,
    copy_gbs: f64,
}

fn cast_ms(
    dev: &fp8_kernels::CudaDevice,
    iters: usize,
    input: BlockCastInput<'_, bf16>,
    shape: [usize; 2],
    layouts: Layouts,
    r: &mut Out,
    c: &mut Out,
) -> Result<f64, KernelError> {
    time_ms(dev, iters, || {
        let (ro, co) = match layouts {
            Layouts::Rows => (Some(r.view()), None),
            Layouts::Cols => (None, Some(c.view())),
            Layouts::Both => (Some(r.view()), Some(c.view())),
        };
        block_quantize_tiles(
            input,
            shape,
            Fp8Format::E4M3,
            ScaleRounding::PowerOfTwo,
            ScaleOrder::Gemm,
            ro,
            co,
        )
    })
}

fn bench_shape(
    gpu: &Device,
    preset: &'static str,
    [rows, cols]: [usize; 2],
    iters: usize,
) -> Result<Vec<Row>, KernelError> {
    let dev = gpu.as_cuda("block_cast_bench")?.clone();
    let n = rows * cols;
    let x = gpu.upload(&random_bf16(n, 1))?;
    let dy = gpu.upload(&random_bf16(n, 2))?;
    let gu = gpu.upload(&random_bf16(2 * n, 3))?;
    let shape = [rows, cols];
    let mut r = Out::new(gpu, BlockQuantLayout::Rows1x128, shape)?;
    let mut c = Out::new(gpu, BlockQuantLayout::Columns128x1Transposed, shape)?;
    // The copy ceiling: read and write the input's bytes.
    let mut copy = gpu.zeros::<bf16>(n)?;
    let copy_ms = time_ms(&dev, iters, || copy.copy_from(&x))?;
    let copy_gbs = 2.0 * 2.0 * n as f64 / (copy_ms * 1e-3) / 1e9;
    drop(copy);
    let mut rows_out = Vec::new();
    let tanh = GeluApprox::Tanh;
    // LayerNorm's output from its statistics alone (what a norm before a block-scaled linear runs).
    let spec = NormSpec::layer_norm(rows, cols);
    let w = gpu.upload(&random_bf16(cols, 4))?;
    let mut stats = NormStats::new(gpu, rows)?;
    let stats_ms = time_ms(&dev, iters, || {
        norm_forward_stats(&spec, &x, &w, None, &mut stats)
    })?;
    rows_out.push(Row {
        preset,
        shape,
        cast: "LayerNorm statistics only",
        ms: stats_ms,
        gbs: (2 * n + 8 * rows) as f64 / (stats_ms * 1e-3) / 1e9,
        copy_gbs,
    });
    let cases: [(&'static str, BlockCastInput<'_, bf16>, Layouts, usize); 7] = [
        ("1x128", BlockCastInput::Values(&x), Layouts::Rows, 2 * n),
        ("128x1^T", BlockCastInput::Values(&x), Layouts::Cols, 2 * n),
        ("both", BlockCastInput::Values(&x), Layouts::Both, 2 * n),
        (
            "GELU, both",
            BlockCastInput::Gelu {
                u: &x,
                approx: tanh,
            },
            Layouts::Both,
            2 * n,
        ),
        (
            "GELU gradient, both",
            BlockCastInput::GeluGrad {
                u: &x,
                dy: &dy,
                approx: tanh,
            },
            Layouts::Both,
            4 * n,
        ),
        (
            "SwiGLU, both",
            BlockCastInput::SwiGlu { gu: &gu },
            Layouts::Both,
            4 * n,
        ),
        (
            "LayerNorm output, both",
            BlockCastInput::Norm {
                x: &x,
                weight: &w,
                bias: None,
                stats: &stats,
                spec,
            },
            Layouts::Both,
            2 * n,
        ),
    ];
    for (name, input, layouts, read) in cases {
        let ms = cast_ms(&dev, iters, input, shape, layouts, &mut r, &mut c)?;
        let written = match layouts {
            Layouts::Rows => r.bytes(),
            Layouts::Cols => c.bytes(),
            Layouts::Both => r.bytes() + c.bytes(),
        };
        rows_out.push(Row {
            preset,
            shape,
            cast: name,
            ms,
            gbs: (read + written) as f64 / (ms * 1e-3) / 1e9,
            copy_gbs,
        });
    }
    // SwiGLU's gradient: [dgate, dup] of width 2 cols from gu [rows, 2 cols] and dh [rows, cols].
    let wide = [rows, 2 * cols];
    let mut r2 = Out::new(gpu, BlockQuantLayout::Rows1x128, wide)?;
    let mut c2 = Out::new(gpu, BlockQuantLayout::Columns128x1Transposed, wide)?;
    let input = BlockCastInput::SwiGluGrad { gu: &gu, dh: &dy };
    let ms = cast_ms(&dev, iters, input, wide, Layouts::Both, &mut r2, &mut c2)?;
    rows_out.push(Row {
        preset,
        shape: wide,
        cast: "SwiGLU gradient, both",
        ms,
        gbs: (6 * n + r2.bytes() + c2.bytes()) as f64 / (ms * 1e-3) / 1e9,
        copy_gbs,
    });
    Ok(rows_out)
}

fn bench(iters: usize) -> Result<(), KernelError> {
    let gpu = Device::cuda(0)?;
    println!(
        "block_cast_bench: bf16 in, E4M3 1x128 / 128x1 codes out; median of {iters} after 5 warm-up (CUDA \
         events); GB/s = (bytes read + written) / time; copy = device-to-device copy of the input"
    );
    let mut rows = Vec::new();
    for (preset, r, c) in SHAPES {
        match bench_shape(&gpu, preset, [r, c], iters) {
            Ok(v) => rows.extend(v),
            Err(e) => println!("{preset} {r} x {c}: error: {e}"),
        }
    }
    println!("| preset | shape | cast | time (µs) | GB/s | copy GB/s | of copy |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!(
            "| {} | {} x {} | {} | {:.1} | {:.0} | {:.0} | {:.2} |",
            r.preset,
            r.shape[0],
            r.shape[1],
            r.cast,
            r.ms * 1e3,
            r.gbs,
            r.copy_gbs,
            r.gbs / r.copy_gbs
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let mut iters = 20;
    let mut i = 1;
    while i < args.len() {
        match (
            args[i].as_str(),
            args.get(i + 1).and_then(|s| s.parse::<usize>().ok()),
        ) {
            ("--iters", Some(v)) if v > 0 => {
                iters = v;
                i += 2;
            }
            _ => {
                eprintln!("usage: block_cast_bench [--iters N]");
                return ExitCode::FAILURE;
            }
        }
    }
    bench_exit(bench(iters))
}
