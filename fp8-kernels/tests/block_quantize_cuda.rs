//! Block-scaled casts on CUDA against the CPU reference, bit for bit (codes, scales, inverse scales, and
//! the dequantization of the codes to f32 and bf16), for the three layouts, f32/bf16/f16 inputs, both
//! formats and both scale roundings, on random inputs with wide magnitude ranges, special values and
//! all-zero blocks, in shapes that are and are not multiples of 128, with the scales stored row-major
//! and in the GEMM's order; the packed 1x128 records and the dequantized sum of their rows likewise (1 to
//! 8 rows, f32/bf16/f16 accumulators, several scales alpha); `block_quantize_both` (both 1x128 layouts
//! from one read) against the CPU's two casts; `block_quantize_tiles` of activations computed inside the
//! cast (GELU, its gradient, SwiGLU, its gradient, LayerNorm's and RMSNorm's output from the statistics
//! alone; one layout or both) against the activation kernel followed by the casts (SwiGLU's and the
//! norms' on the CPU; GELU's on CUDA, whose tanh and exp may differ from the CPU's in the last place);
//! and CUDA run twice gives the same bits. GPU
//! tests: ignored unless run with `--ignored` (`scripts/gpu-tests.sh`), and failing where no
//! GPU can be opened.

mod common;

use common::{first_difference, fp8_gpu, join_differences, matches_cpu_and_deterministic};
use fp8_core::{Fp8Format, ScaleRounding};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{
    block_dequantize, block_dequantize_sum, block_quantize, block_quantize_packed,
    block_quantize_tiles, BlockCastInput, BlockQuantLayout, BlockQuantOutput, BlockQuantSpec,
    Buffer, Device, FloatElement, PackedRows1x128, ScaleOrder,
};
use half::{bf16, f16};

/// `rows * cols` values: uniform in [-1, 1) times 2^e with e in -20..20 varying by row band (so blocks
/// get different scales), a few NaNs and infinities, and the first 128 x 128 corner zero (zero blocks
/// of every layout).
fn input(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    let mut x: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let band = (i / cols / 7 + i % cols / 50) as u64;
            let e = (SplitMix64::mix(seed ^ band) % 40) as i32 - 20;
            rng.uniform_f32() * 2f32.powi(e)
        })
        .collect();
    for r in 0..rows.min(128) {
        for c in 0..cols.min(128) {
            x[r * cols + c] = 0.0;
        }
    }
    if x.len() > 1000 {
        for k in 0..5 {
            let i = rng.below(x.len() as u64) as usize;
            x[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, 3e38][k];
        }
    }
    x
}

/// Codes, scale bits, inverse scale bits, and the f32 and bf16 dequantizations' bits.
type Outputs = [Vec<u32>; 5];

fn run<T: FloatElement>(
    dev: &Device,
    x: &[f32],
    [rows, cols]: [usize; 2],
    spec: BlockQuantSpec,
) -> Outputs {
    let xt: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let xb = dev.upload(&xt).unwrap();
    let layout = spec.layout.output_layout(rows, cols).unwrap();
    let mut q: Buffer<u8> = dev.zeros(rows * cols).unwrap();
    let scales = spec.scale_order.strides(&layout).unwrap().len;
    let mut s: Buffer<f32> = dev.zeros(scales).unwrap();
    let mut si: Buffer<f32> = dev.zeros(scales).unwrap();
    block_quantize(&xb, [rows, cols], spec, &mut q, &mut s, &mut si).unwrap();
    let mut y32: Buffer<f32> = dev.zeros(rows * cols).unwrap();
    let mut y16: Buffer<bf16> = dev.zeros(rows * cols).unwrap();
    block_dequantize(&q, &layout, spec.scale_order, spec.format, &si, &mut y32).unwrap();
    block_dequantize(&q, &layout, spec.scale_order, spec.format, &si, &mut y16).unwrap();
    [
        q.to_vec().unwrap().into_iter().map(u32::from).collect(),
        common::bits(&s),
        common::bits(&si),
        common::bits(&y32),
        common::bits(&y16),
    ]
}

fn compare<T: FloatElement>(
    gpu: &Device,
    x: &[f32],
    shape: [usize; 2],
    spec: BlockQuantSpec,
) -> bool {
    let cpu = run::<T>(&Device::cpu(), x, shape, spec);
    let g1 = run::<T>(gpu, x, shape, spec);
    let g2 = run::<T>(gpu, x, shape, spec);
    let what = format!("{}x{} {} {:?}", shape[0], shape[1], T::NAME, spec);
    matches_cpu_and_deterministic(&what, &cpu, &g1, &g2, |a, b| {
        join_differences(
            [
                "codes",
                "scale",
                "scale_inv",
                "dequantized f32",
                "dequantized bf16",
            ]
            .iter()
            .zip(a.iter().zip(b))
            .map(|(name, (a, b))| first_difference(name, a, b)),
        )
    })
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_cpu_bitwise_and_is_deterministic() {
    let gpu = fp8_gpu();
    let shapes = [
        [1, 1],
        [3, 130],
        [127, 129],
        [128, 128],
        [129, 1],
        [1, 1000],
        [300, 257],
        [256, 4096],
        [2048, 768],
    ];
    let mut ok = true;
    for (k, &shape) in shapes.iter().enumerate() {
        let x = input(shape[0], shape[1], 0xB10C + k as u64);
        for layout in [
            BlockQuantLayout::Rows1x128,
            BlockQuantLayout::Columns128x1Transposed,
            BlockQuantLayout::Blocks128x128,
        ] {
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                for rounding in [ScaleRounding::PowerOfTwo, ScaleRounding::Exact] {
                    let spec = BlockQuantSpec {
                        layout,
                        format,
                        rounding,
                        scale_order: ScaleOrder::RowMajor,
                    };
                    ok &= compare::<bf16>(&gpu, &x, shape, spec);
                    ok &= compare::<f32>(&gpu, &x, shape, spec);
                    ok &= compare::<f16>(&gpu, &x, shape, spec);
                    // The GEMM's scale order (padding entries stay zero on both devices).
                    let gemm = spec.with_scale_order(ScaleOrder::Gemm);
                    ok &= compare::<bf16>(&gpu, &x, shape, gemm);
                }
            }
        }
    }
    assert!(ok, "CUDA differs from the CPU or between runs (see above)");
}

/// Both 1x128 layouts of `x` (`block_quantize_tiles` of its values, what `block_quantize_both` runs): the
/// codes, scales and inverse scales of its two outputs, as bits.
fn run_both<T: FloatElement>(
    dev: &Device,
    x: &[f32],
    shape: [usize; 2],
    format: Fp8Format,
    rounding: ScaleRounding,
    order: ScaleOrder,
) -> [Vec<u32>; 6] {
    run_tiles_with::<T>(
        dev,
        "values",
        x,
        &[],
        shape,
        (format, rounding, order),
        (true, true),
    )
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_both_layouts_match_cpu_bitwise_and_are_deterministic() {
    let gpu = fp8_gpu();
    // Sides that are and are not multiples of 8, 16 and 128 (the kernel's vector and byte paths).
    let shapes = [
        [1, 1],
        [3, 130],
        [127, 129],
        [128, 128],
        [136, 392],
        [300, 257],
        [1040, 768],
        [2048, 2560],
    ];
    let mut ok = true;
    for (k, &shape) in shapes.iter().enumerate() {
        let x = input(shape[0], shape[1], 0xB07 + k as u64);
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for rounding in [ScaleRounding::PowerOfTwo, ScaleRounding::Exact] {
                for order in [ScaleOrder::RowMajor, ScaleOrder::Gemm] {
                    let run = |dev: &Device, f32_in: bool| {
                        if f32_in {
                            run_both::<f32>(dev, &x, shape, format, rounding, order)
                        } else {
                            run_both::<bf16>(dev, &x, shape, format, rounding, order)
                        }
                    };
                    for f32_in in [false, true] {
                        let cpu = run(&Device::cpu(), f32_in);
                        let (g1, g2) = (run(&gpu, f32_in), run(&gpu, f32_in));
                        let what = format!(
                            "both layouts {}x{} f32 input {f32_in} {format:?} {rounding:?} {order:?}",
                            shape[0], shape[1]
                        );
                        ok &= matches_cpu_and_deterministic(&what, &cpu, &g1, &g2, |a, b| {
                            join_differences(
                                [
                                    "1x128 codes",
                                    "1x128 scale",
                                    "1x128 scale_inv",
                                    "128x1 codes",
                                    "128x1 scale",
                                    "128x1 scale_inv",
                                ]
                                .iter()
                                .zip(a.iter().zip(b))
                                .map(|(name, (a, b))| first_difference(name, a, b)),
                            )
                        });
                    }
                }
            }
        }
    }
    assert!(ok, "CUDA differs from the CPU or between runs (see above)");
}

/// `block_quantize_tiles` of the activation `kind` over `[rows, cols]` from the inputs `a` (and `b`), in
/// the layouts asked for: codes, scales and inverse scales of each as bits (empty when not asked).
#[allow(clippy::too_many_arguments)]
fn run_tiles<T: FloatElement>(
    dev: &Device,
    kind: &str,
    a: &[f32],
    b: &[f32],
    shape: [usize; 2],
    format: Fp8Format,
    want: (bool, bool),
) -> [Vec<u32>; 6] {
    let cast = (format, ScaleRounding::PowerOfTwo, ScaleOrder::Gemm);
    run_tiles_with::<T>(dev, kind, a, b, shape, cast, want)
}

/// [`run_tiles`] with the scales' rounding and order given.
fn run_tiles_with<T: FloatElement>(
    dev: &Device,
    kind: &str,
    a: &[f32],
    b: &[f32],
    [rows, cols]: [usize; 2],
    (format, rounding, order): (Fp8Format, ScaleRounding, ScaleOrder),
    (want_rows, want_cols): (bool, bool),
) -> [Vec<u32>; 6] {
    let up = |v: &[f32]| {
        dev.upload(&v.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>())
            .unwrap()
    };
    let (ab, bb) = (up(a), up(b));
    let approx = fp8_kernels::elementwise::GeluApprox::Tanh;
    // The norms: x in a, the weight and (LayerNorm) the bias in b; the statistics alone on this device.
    use fp8_kernels::layer_norm::{norm_forward_stats, NormSpec, NormStats};
    let norm_spec = if kind == "layer_norm" {
        NormSpec::layer_norm(rows, cols)
    } else {
        NormSpec::rms_norm(rows, cols)
    };
    let is_norm = kind.ends_with("_norm");
    let (nw, nb) = if is_norm {
        (
            up(&b[..cols]),
            (kind == "layer_norm").then(|| up(&b[cols..2 * cols])),
        )
    } else {
        (up(&[]), None)
    };
    let mut stats = NormStats::new(dev, rows).unwrap();
    if is_norm {
        norm_forward_stats(&norm_spec, &ab, &nw, nb.as_ref(), &mut stats).unwrap();
    }
    let input = match kind {
        "layer_norm" | "rms_norm" => BlockCastInput::Norm {
            x: &ab,
            weight: &nw,
            bias: nb.as_ref(),
            stats: &stats,
            spec: norm_spec,
        },
        "gelu" => BlockCastInput::Gelu { u: &ab, approx },
        "gelu_grad" => BlockCastInput::GeluGrad {
            u: &ab,
            dy: &bb,
            approx,
        },
        "swiglu" => BlockCastInput::SwiGlu { gu: &ab },
        "swiglu_grad" => BlockCastInput::SwiGluGrad { gu: &ab, dh: &bb },
        _ => BlockCastInput::Values(&ab),
    };
    let bufs = |layout: BlockQuantLayout| {
        let l = layout.output_layout(rows, cols).unwrap();
        let n = order.strides(&l).unwrap().len;
        (
            dev.zeros::<u8>(rows * cols).unwrap(),
            dev.zeros::<f32>(n).unwrap(),
            dev.zeros::<f32>(n).unwrap(),
        )
    };
    let (mut q, mut s, mut si) = bufs(BlockQuantLayout::Rows1x128);
    let (mut qt, mut st, mut sit) = bufs(BlockQuantLayout::Columns128x1Transposed);
    block_quantize_tiles(
        input,
        [rows, cols],
        format,
        rounding,
        order,
        want_rows.then_some(BlockQuantOutput {
            codes: &mut q,
            scale: &mut s,
            scale_inv: &mut si,
        }),
        want_cols.then_some(BlockQuantOutput {
            codes: &mut qt,
            scale: &mut st,
            scale_inv: &mut sit,
        }),
    )
    .unwrap();
    let codes = |b: &Buffer<u8>| b.to_vec().unwrap().into_iter().map(u32::from).collect();
    [
        codes(&q),
        common::bits(&s),
        common::bits(&si),
        codes(&qt),
        common::bits(&st),
        common::bits(&sit),
    ]
}

/// GELU (`kind` "gelu") or its gradient ("gelu_grad") of `a` (and `b`) by CUDA's element-wise kernel, in
/// the element type, widened to f32.
fn gpu_gelu_values(gpu: &Device, kind: &str, a: &[f32], b: &[f32], f32_in: bool) -> Vec<f32> {
    fn go<T: FloatElement>(gpu: &Device, kind: &str, a: &[f32], b: &[f32]) -> Vec<f32> {
        use fp8_kernels::elementwise::{gelu_backward, gelu_forward, GeluApprox};
        let up = |v: &[f32]| {
            gpu.upload(&v.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>())
                .unwrap()
        };
        let (ab, bb) = (up(a), up(b));
        let mut out = gpu.zeros::<T>(a.len()).unwrap();
        if kind == "gelu" {
            gelu_forward(&ab, &mut out, GeluApprox::Tanh).unwrap();
        } else {
            gelu_backward(&ab, &bb, &mut out, GeluApprox::Tanh).unwrap();
        }
        out.to_vec().unwrap().iter().map(|v| v.to_f32()).collect()
    }
    if f32_in {
        go::<f32>(gpu, kind, a, b)
    } else {
        go::<bf16>(gpu, kind, a, b)
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_activation_tiles_match_the_unfused_casts_bitwise_and_are_deterministic() {
    let gpu = fp8_gpu();
    let mut ok = true;
    // Widths that are multiples of 16 (the 16-byte path) and not (element by element).
    for (k, &[rows, cols]) in [[256, 512], [300, 264], [130, 200], [512, 2560]]
        .iter()
        .enumerate()
    {
        let kinds = [
            "values",
            "gelu",
            "gelu_grad",
            "swiglu",
            "swiglu_grad",
            "layer_norm",
            "rms_norm",
        ];
        for kind in kinds {
            // The inputs' sizes: SwiGLU reads gu [rows, 2 cols]; its gradient writes [rows, cols] from
            // gu [rows, cols] and dh [rows, cols / 2]; a norm reads x [rows, cols], its weight and bias.
            let (na, nb) = match kind {
                "swiglu" => (2 * rows * cols, 0),
                "swiglu_grad" => (rows * cols, rows * cols / 2),
                "layer_norm" | "rms_norm" => (rows * cols, 2 * cols),
                _ => (rows * cols, rows * cols),
            };
            let a: Vec<f32> = SplitMix64::new(0xAC7 + k as u64)
                .uniform_vec(na)
                .iter()
                .map(|v| v * 4.0)
                .collect();
            let b: Vec<f32> = SplitMix64::new(0xD7 + k as u64)
                .uniform_vec(nb)
                .iter()
                .map(|v| v * 3.0)
                .collect();
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                for want in [(true, true), (true, false), (false, true)] {
                    let shape = [rows, cols];
                    let run = |dev: &Device, f32_in: bool| {
                        if f32_in {
                            run_tiles::<f32>(dev, kind, &a, &b, shape, format, want)
                        } else {
                            run_tiles::<bf16>(dev, kind, &a, &b, shape, format, want)
                        }
                    };
                    for f32_in in [false, true] {
                        // GELU's tanh and exp may differ between the devices in the last place (the
                        // element-wise family's documented exception): its reference is CUDA's own GELU
                        // kernel written to a buffer, then the cast; SwiGLU's (exp_fixed) and the norms'
                        // (statistics and output bitwise on both devices) are the CPU.
                        let cpu = if kind.starts_with("gelu") {
                            let values = gpu_gelu_values(&gpu, kind, &a, &b, f32_in);
                            if f32_in {
                                run_tiles::<f32>(&gpu, "values", &values, &[], shape, format, want)
                            } else {
                                run_tiles::<bf16>(&gpu, "values", &values, &[], shape, format, want)
                            }
                        } else {
                            run(&Device::cpu(), f32_in)
                        };
                        let (g1, g2) = (run(&gpu, f32_in), run(&gpu, f32_in));
                        let what = format!(
                            "{kind} {rows}x{cols} f32 input {f32_in} {format:?} layouts {want:?}"
                        );
                        ok &= matches_cpu_and_deterministic(&what, &cpu, &g1, &g2, |a, b| {
                            join_differences(
                                [
                                    "1x128 codes",
                                    "1x128 scale",
                                    "1x128 scale_inv",
                                    "128x1 codes",
                                    "128x1 scale",
                                    "128x1 scale_inv",
                                ]
                                .iter()
                                .zip(a.iter().zip(b))
                                .map(|(name, (a, b))| first_difference(name, a, b)),
                            )
                        });
                    }
                }
            }
        }
    }
    assert!(ok, "CUDA differs from the CPU or between runs (see above)");
}

/// The packed records of `x [rows, cols]` and, from the CPU's records, the dequantized sum of the rows
/// added to `start` with `alpha`, as bits (records as bytes widened to u32).
fn run_packed<T: FloatElement, D: FloatElement>(
    dev: &Device,
    x: &[f32],
    [rows, cols]: [usize; 2],
    (format, rounding, alpha): (Fp8Format, ScaleRounding, f32),
    cpu_packed: &[u8],
    start: &[f32],
) -> [Vec<u32>; 2] {
    let xt: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let xb = dev.upload(&xt).unwrap();
    let packing = PackedRows1x128::new(rows, cols).unwrap();
    let mut p: Buffer<u8> = dev.zeros(packing.num_bytes()).unwrap();
    block_quantize_packed(&xb, packing, format, rounding, &mut p).unwrap();
    let records = p.to_vec().unwrap().into_iter().map(u32::from).collect();
    let p = dev.upload(cpu_packed).unwrap();
    let s: Vec<D> = start.iter().map(|&v| D::from_f32(v)).collect();
    let mut out = dev.upload(&s).unwrap();
    block_dequantize_sum(&p, packing, format, alpha, &mut out).unwrap();
    [records, common::bits(&out)]
}

fn compare_packed<T: FloatElement, D: FloatElement>(
    gpu: &Device,
    x: &[f32],
    shape: [usize; 2],
    format: Fp8Format,
    rounding: ScaleRounding,
    alpha: f32,
) -> bool {
    let packing = PackedRows1x128::new(shape[0], shape[1]).unwrap();
    let cpu_dev = Device::cpu();
    let xt: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let mut cp: Buffer<u8> = cpu_dev.zeros(packing.num_bytes()).unwrap();
    block_quantize_packed(
        &cpu_dev.upload(&xt).unwrap(),
        packing,
        format,
        rounding,
        &mut cp,
    )
    .unwrap();
    let cpu_packed = cp.to_vec().unwrap();
    let start: Vec<f32> = (0..shape[1])
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
        .collect();
    let run = |dev: &Device| {
        run_packed::<T, D>(
            dev,
            x,
            shape,
            (format, rounding, alpha),
            &cpu_packed,
            &start,
        )
    };
    let (cpu, g1, g2) = (run(&cpu_dev), run(gpu), run(gpu));
    let what = format!(
        "packed {}x{} {} -> {} {format:?} {rounding:?} alpha {alpha}",
        shape[0],
        shape[1],
        T::NAME,
        D::NAME
    );
    matches_cpu_and_deterministic(&what, &cpu, &g1, &g2, |a, b| {
        join_differences(
            ["records", "dequantized sum"]
                .iter()
                .zip(a.iter().zip(b))
                .map(|(name, (a, b))| first_difference(name, a, b)),
        )
    })
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_packed_records_and_dequantized_sum_match_cpu() {
    let gpu = fp8_gpu();
    let shapes = [
        [1, 1],
        [1, 16],
        [2, 130],
        [3, 1000],
        [4, 4096],
        [4, 4112],
        [8, 65552],
        [2, 1 << 20],
    ];
    let mut ok = true;
    for (k, &shape) in shapes.iter().enumerate() {
        let x = input(shape[0], shape[1], 0xE7C4 + k as u64);
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for rounding in [ScaleRounding::PowerOfTwo, ScaleRounding::Exact] {
                for alpha in [1.0, 0.125, 0.3] {
                    ok &= compare_packed::<f32, f32>(&gpu, &x, shape, format, rounding, alpha);
                    ok &= compare_packed::<bf16, bf16>(&gpu, &x, shape, format, rounding, alpha);
                    ok &= compare_packed::<f16, f16>(&gpu, &x, shape, format, rounding, alpha);
                }
            }
        }
    }
    assert!(ok, "CUDA differs from the CPU or between runs (see above)");
}
