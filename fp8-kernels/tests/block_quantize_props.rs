//! Property tests of the CPU block-scaled casts against a scalar reference written here (loops over the
//! blocks of each layout, fp8-core's slow reference encoder, a scale found by doubling and halving), the
//! transposed layout against the 1x128 cast of the transposed input, bf16 inputs against f32, and the
//! round trip within half an FP8 step of each element at its block's scale; the packed 1x128 records
//! against the same reference and the dequantized sum of their rows against a scalar loop. Also the NVRTC
//! build of the CUDA module (ignored, with the reason, where the build found no NVRTC).

mod common;

use common::{assert_kernels, nvrtc_test, sm90_ptx};
use fp8_core::reference::ReferenceEncoder;
use fp8_core::{Fp8Format, ScaleRounding};
use fp8_kernels::block_quantize::{BLOCK_ACTIVATION_MODULE, BLOCK_QUANTIZE_MODULE};
use fp8_kernels::{
    block_dequantize, block_dequantize_sum, block_quantize, block_quantize_both,
    block_quantize_packed, block_quantize_tiles, BlockCastInput, BlockQuantLayout,
    BlockQuantOutput, BlockQuantSpec, Buffer, Device, FloatElement, PackedRows1x128, ScaleOrder,
};
use half::{bf16, f16};
use proptest::prelude::*;

const LAYOUTS: [BlockQuantLayout; 3] = [
    BlockQuantLayout::Rows1x128,
    BlockQuantLayout::Columns128x1Transposed,
    BlockQuantLayout::Blocks128x128,
];

/// Codes, scales and inverse scales of one cast.
#[derive(Debug, Clone, PartialEq)]
struct Quantized {
    codes: Vec<u8>,
    scale: Vec<u32>,
    scale_inv: Vec<u32>,
}

/// The scale of a block with amax `amax`, from its definition: 1 for a zero or non-finite amax; else the
/// largest power of two `p` with `amax * p <= fmax` (found by doubling and halving in f64), kept within
/// 2^-125..2^125; for exact rounding within that range, `fmax / amax` rounded to f32 and stepped down
/// while `amax * s` exceeds `fmax` in f32.
fn reference_scale(amax: f32, fmax: f32, rounding: ScaleRounding) -> f32 {
    if amax == 0.0 || !amax.is_finite() {
        return 1.0;
    }
    let (a, f) = (amax as f64, fmax as f64);
    let mut e = 0i32;
    while a * 2f64.powi(e) > f {
        e -= 1;
    }
    while a * 2f64.powi(e + 1) <= f {
        e += 1;
    }
    if !(-125..=125).contains(&e) || rounding == ScaleRounding::PowerOfTwo {
        return 2f32.powi(e.clamp(-125, 125));
    }
    let mut s = (f / a) as f32;
    while amax * s > fmax {
        s = f32::from_bits(s.to_bits() - 1);
    }
    s
}

/// The block cast of `x [rows, cols]` by loops over the blocks of `layout`.
fn reference(x: &[f32], rows: usize, cols: usize, spec: BlockQuantSpec) -> Quantized {
    let enc = ReferenceEncoder::new(spec.format);
    let (br, bc, transposed) = match spec.layout {
        BlockQuantLayout::Rows1x128 => (1, 128, false),
        BlockQuantLayout::Columns128x1Transposed => (128, 1, true),
        BlockQuantLayout::Blocks128x128 => (128, 128, false),
    };
    let (gr, gc) = (rows.div_ceil(br), cols.div_ceil(bc));
    let mut out = Quantized {
        codes: vec![0; rows * cols],
        scale: vec![0; gr * gc],
        scale_inv: vec![0; gr * gc],
    };
    for bi in 0..gr {
        for bj in 0..gc {
            let elems: Vec<(usize, usize)> = (bi * br..((bi + 1) * br).min(rows))
                .flat_map(|r| (bj * bc..((bj + 1) * bc).min(cols)).map(move |c| (r, c)))
                .collect();
            let amax = elems
                .iter()
                .map(|&(r, c)| x[r * cols + c])
                .filter(|v| !v.is_nan())
                .fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
            let s = reference_scale(amax, spec.format.max(), spec.rounding);
            let b = if transposed {
                bj * gr + bi
            } else {
                bi * gc + bj
            };
            out.scale[b] = s.to_bits();
            out.scale_inv[b] = (1.0 / s).to_bits();
            for (r, c) in elems {
                let i = if transposed {
                    c * rows + r
                } else {
                    r * cols + c
                };
                out.codes[i] = enc.encode(x[r * cols + c] * s);
            }
        }
    }
    out
}

fn run<T: FloatElement>(
    dev: &Device,
    x: &[f32],
    rows: usize,
    cols: usize,
    spec: BlockQuantSpec,
) -> Quantized {
    let xt: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let xb = dev.upload(&xt).unwrap();
    let layout = spec.layout.output_layout(rows, cols).unwrap();
    let blocks = spec.scale_order.strides(&layout).unwrap().len;
    let mut q: Buffer<u8> = dev.zeros(rows * cols).unwrap();
    let mut s: Buffer<f32> = dev.zeros(blocks).unwrap();
    let mut si: Buffer<f32> = dev.zeros(blocks).unwrap();
    block_quantize(&xb, [rows, cols], spec, &mut q, &mut s, &mut si).unwrap();
    let bits = |b: &Buffer<f32>| b.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
    Quantized {
        codes: q.to_vec().unwrap(),
        scale: bits(&s),
        scale_inv: bits(&si),
    }
}

/// `block_quantize_both` of `x [rows, cols]`: the `Rows1x128` and the `Columns128x1Transposed` outputs.
fn run_both<T: FloatElement>(
    dev: &Device,
    x: &[f32],
    [rows, cols]: [usize; 2],
    format: Fp8Format,
    rounding: ScaleRounding,
    order: ScaleOrder,
) -> [Quantized; 2] {
    let xt: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let xb = dev.upload(&xt).unwrap();
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
    block_quantize_both(
        &xb,
        [rows, cols],
        format,
        rounding,
        order,
        BlockQuantOutput {
            codes: &mut q,
            scale: &mut s,
            scale_inv: &mut si,
        },
        BlockQuantOutput {
            codes: &mut qt,
            scale: &mut st,
            scale_inv: &mut sit,
        },
    )
    .unwrap();
    let bits = |b: &Buffer<f32>| b.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
    [
        Quantized {
            codes: q.to_vec().unwrap(),
            scale: bits(&s),
            scale_inv: bits(&si),
        },
        Quantized {
            codes: qt.to_vec().unwrap(),
            scale: bits(&st),
            scale_inv: bits(&sit),
        },
    ]
}

/// Dequantizes `q` (the output of `spec` for `[rows, cols]`) to f32.
fn dequantize(
    dev: &Device,
    q: &Quantized,
    rows: usize,
    cols: usize,
    spec: BlockQuantSpec,
) -> Vec<f32> {
    let layout = spec.layout.output_layout(rows, cols).unwrap();
    let codes = dev.upload(&q.codes).unwrap();
    let si: Vec<f32> = q.scale_inv.iter().map(|&b| f32::from_bits(b)).collect();
    let si = dev.upload(&si).unwrap();
    let mut out: Buffer<f32> = dev.zeros(rows * cols).unwrap();
    block_dequantize(
        &codes,
        &layout,
        spec.scale_order,
        spec.format,
        &si,
        &mut out,
    )
    .unwrap();
    out.to_vec().unwrap()
}

fn format() -> impl Strategy<Value = Fp8Format> {
    prop_oneof![Just(Fp8Format::E4M3), Just(Fp8Format::E5M2)]
}

fn rounding() -> impl Strategy<Value = ScaleRounding> {
    prop_oneof![Just(ScaleRounding::PowerOfTwo), Just(ScaleRounding::Exact)]
}

/// Sides below, around and across 128, and 0.
fn side() -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(0usize), 3 => 1usize..6, 3 => 120usize..140, 2 => 250usize..300]
}

/// A `[rows, cols]` input: moderate values, any f32 (NaN, infinities, subnormals), tiny ones, zeros,
/// times a power of two of the case (so scales cover a wide range), with a rectangle of zeros (whole
/// zero blocks now and then).
fn input() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
    (side(), side(), -60i32..60, any::<[u16; 4]>()).prop_flat_map(|(rows, cols, e, rect)| {
        let value = prop_oneof![
            6 => -600.0f32..600.0,
            1 => proptest::num::f32::ANY,
            1 => -1e-3f32..1e-3,
            1 => Just(0.0f32),
        ];
        proptest::collection::vec(value, rows * cols).prop_map(move |mut x| {
            let k = 2f32.powi(e);
            for v in x.iter_mut() {
                *v *= k;
            }
            let pick = |a: u16, n: usize| if n == 0 { 0 } else { a as usize % n };
            let (r0, c0) = (pick(rect[0], rows), pick(rect[1], cols));
            let (r1, c1) = (r0 + pick(rect[2], rows + 1), c0 + pick(rect[3], cols + 1));
            for r in r0..r1.min(rows) {
                for c in c0..c1.min(cols) {
                    x[r * cols + c] = 0.0;
                }
            }
            (rows, cols, x)
        })
    })
}

/// Half the FP8 spacing at `|v|` (a scaled, finite value within the format's range).
fn half_step(format: Fp8Format, v: f32) -> f64 {
    let a = v.abs() as f64;
    let step = if a < format.min_normal() as f64 {
        format.min_subnormal() as f64
    } else {
        2f64.powi(a.log2().floor() as i32 - format.mantissa_bits() as i32)
    };
    step / 2.0
}

/// The packed 1x128 records of `x [rows, cols]` (CPU), from a zeroed buffer.
fn run_packed<T: FloatElement>(
    x: &[f32],
    rows: usize,
    cols: usize,
    format: Fp8Format,
    rounding: ScaleRounding,
) -> Vec<u8> {
    let dev = Device::cpu();
    let xt: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let xb = dev.upload(&xt).unwrap();
    let packing = PackedRows1x128::new(rows, cols).unwrap();
    let mut p: Buffer<u8> = dev.zeros(packing.num_bytes()).unwrap();
    block_quantize_packed(&xb, packing, format, rounding, &mut p).unwrap();
    p.to_vec().unwrap()
}

/// The record layout from its definition: codes, zeros to 16 bytes, the inverse scales little-endian,
/// zeros to 16 bytes; one record per row.
fn pack_reference(q: &Quantized, rows: usize, cols: usize) -> Vec<u8> {
    let gc = cols.div_ceil(128);
    let mut out = Vec::new();
    for r in 0..rows {
        out.extend_from_slice(&q.codes[r * cols..(r + 1) * cols]);
        out.resize(out.len().next_multiple_of(16), 0);
        for &b in &q.scale_inv[r * gc..(r + 1) * gc] {
            out.extend_from_slice(&b.to_le_bytes());
        }
        out.resize(out.len().next_multiple_of(16), 0);
    }
    out
}

/// `D(out + alpha * sum_r decode(code_r) * scale_inv_r)` element by element, the sum in row order from
/// row 0, reading records by the layout's definition and decoding with fp8-core's `decode`.
fn dequantize_sum_reference<D: FloatElement>(
    packed: &[u8],
    rows: usize,
    cols: usize,
    format: Fp8Format,
    alpha: f32,
    out: &[D],
) -> Vec<D> {
    let row_bytes = cols.next_multiple_of(16) + (4 * cols.div_ceil(128)).next_multiple_of(16);
    (0..cols)
        .map(|i| {
            let mut sum = None;
            for r in 0..rows {
                let rec = &packed[r * row_bytes..];
                let at = cols.next_multiple_of(16) + 4 * (i / 128);
                let si = f32::from_le_bytes(rec[at..at + 4].try_into().unwrap());
                let d = format.decode(rec[i]) * si;
                sum = Some(match sum {
                    None => d,
                    Some(s) => s + d,
                });
            }
            D::from_f32(out[i].to_f32() + alpha * sum.unwrap())
        })
        .collect()
}

/// A dequantized sum on the CPU: `out` (initial values) plus the records of `packed`.
fn run_dequantize_sum<D: FloatElement>(
    packed: &[u8],
    rows: usize,
    cols: usize,
    format: Fp8Format,
    alpha: f32,
    out: &[D],
) -> Vec<D> {
    let dev = Device::cpu();
    let p = dev.upload(packed).unwrap();
    let mut o = dev.upload(out).unwrap();
    let packing = PackedRows1x128::new(rows, cols).unwrap();
    block_dequantize_sum(&p, packing, format, alpha, &mut o).unwrap();
    o.to_vec().unwrap()
}

/// Bits of floats with NaN canonical (NaN payloads are not compared).
fn canon_bits<D: FloatElement>(v: &[D]) -> Vec<u32> {
    v.iter()
        .map(|x| {
            let f = x.to_f32();
            if f.is_nan() {
                0x7FC0_0000
            } else {
                f.to_bits()
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn packed_records_match_the_scalar_reference(
        (rows, cols, x) in input(),
        format in format(),
        rounding in rounding(),
    ) {
        let spec = BlockQuantSpec { layout: BlockQuantLayout::Rows1x128, format, rounding, scale_order: ScaleOrder::RowMajor };
        let want = pack_reference(&reference(&x, rows, cols, spec), rows, cols);
        prop_assert!(run_packed::<f32>(&x, rows, cols, format, rounding) == want, "f32 {}x{}", rows, cols);
        let xb: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let want = pack_reference(&reference(&xb, rows, cols, spec), rows, cols);
        prop_assert!(run_packed::<bf16>(&x, rows, cols, format, rounding) == want, "bf16 {}x{}", rows, cols);
        let packing = PackedRows1x128::new(rows, cols).unwrap();
        prop_assert_eq!(packing.num_bytes(), pack_reference(&reference(&x, rows, cols, spec), rows, cols).len());
    }

    #[test]
    fn dequantized_sum_matches_a_scalar_loop(
        (rows, cols, x) in input(),
        format in format(),
        rounding in rounding(),
        alpha in prop_oneof![Just(1.0f32), Just(0.25f32), 0.01f32..3.0],
        init in proptest::collection::vec(-100.0f32..100.0, 300),
    ) {
        prop_assume!(rows > 0);
        let packed = run_packed::<f32>(&x, rows, cols, format, rounding);
        let start: Vec<f32> = (0..cols).map(|i| init[i % init.len()] * (i % 3) as f32).collect();
        let got = run_dequantize_sum(&packed, rows, cols, format, alpha, &start);
        let want = dequantize_sum_reference(&packed, rows, cols, format, alpha, &start);
        prop_assert_eq!(canon_bits(&got), canon_bits(&want));
        let start: Vec<bf16> = start.iter().map(|&v| bf16::from_f32(v)).collect();
        let got = run_dequantize_sum(&packed, rows, cols, format, alpha, &start);
        let want = dequantize_sum_reference(&packed, rows, cols, format, alpha, &start);
        prop_assert_eq!(canon_bits(&got), canon_bits(&want));
        let start: Vec<f16> = start.iter().map(|&v| f16::from_f32(v.to_f32())).collect();
        let got = run_dequantize_sum(&packed, rows, cols, format, alpha, &start);
        let want = dequantize_sum_reference(&packed, rows, cols, format, alpha, &start);
        prop_assert_eq!(canon_bits(&got), canon_bits(&want));
    }

    #[test]
    fn cpu_matches_scalar_reference(
        (rows, cols, x) in input(),
        format in format(),
        rounding in rounding(),
    ) {
        let dev = Device::cpu();
        for layout in LAYOUTS {
            let spec = BlockQuantSpec { layout, format, rounding, scale_order: ScaleOrder::RowMajor };
            let got = run::<f32>(&dev, &x, rows, cols, spec);
            let want = reference(&x, rows, cols, spec);
            prop_assert!(got == want, "{:?} {}x{}: {}", spec, rows, cols, first_diff(&got, &want));
            // bf16 input: the cast of its f32 widening.
            let xb: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            let got_bf16 = run::<bf16>(&dev, &x, rows, cols, spec);
            prop_assert!(got_bf16 == reference(&xb, rows, cols, spec), "bf16 {:?} {}x{}", spec, rows, cols);
        }
        // The transposed 128x1 tiles are the 1x128 tiles of the transposed input.
        let xt: Vec<f32> = (0..rows * cols).map(|i| x[(i % rows) * cols + i / rows]).collect();
        let spec = |layout| BlockQuantSpec { layout, format, rounding, scale_order: ScaleOrder::RowMajor };
        prop_assert_eq!(
            run::<f32>(&dev, &x, rows, cols, spec(BlockQuantLayout::Columns128x1Transposed)),
            run::<f32>(&dev, &xt, cols, rows, spec(BlockQuantLayout::Rows1x128))
        );
    }

    #[test]
    fn both_layouts_at_once_equal_the_two_casts(
        (rows, cols, x) in input(),
        format in format(),
        rounding in rounding(),
        gemm_order in any::<bool>(),
    ) {
        let dev = Device::cpu();
        let order = if gemm_order { ScaleOrder::Gemm } else { ScaleOrder::RowMajor };
        let spec = |layout| BlockQuantSpec { layout, format, rounding, scale_order: order };
        let [q, qt] = run_both::<bf16>(&dev, &x, [rows, cols], format, rounding, order);
        prop_assert_eq!(q, run::<bf16>(&dev, &x, rows, cols, spec(BlockQuantLayout::Rows1x128)));
        prop_assert_eq!(
            qt,
            run::<bf16>(&dev, &x, rows, cols, spec(BlockQuantLayout::Columns128x1Transposed))
        );
    }

    #[test]
    fn activation_tiles_equal_the_activation_then_the_cast(
        rows in 1usize..140,
        half in 1usize..80,
        seed in any::<u64>(),
        kind in 0usize..6,
        gemm_order in any::<bool>(),
    ) {
        use fp8_kernels::elementwise::{gelu_grad_scalar, gelu_scalar, GeluApprox};
        use fp8_kernels::layer_norm::{norm_forward, norm_forward_stats, NormSpec, NormStats};
        use fp8_kernels::swiglu_cast::{swiglu_grad_scalars, swiglu_scalar};
        let dev = Device::cpu();
        let cols = 2 * half;
        let r16 = |v: f32| bf16::from_f32(v);
        let mut rng = fp8_kernels::rng::SplitMix64::new(seed);
        let mut draw = |n: usize| -> Vec<bf16> { (0..n).map(|_| r16(rng.uniform_f32() * 6.0)).collect() };
        let approx = GeluApprox::Erf;
        // The inputs, and the activation's values from the scalar definitions rounded to bf16.
        let (a, b, want): (Vec<bf16>, Vec<bf16>, Vec<f32>) = match kind {
            0 => {
                let u = draw(rows * cols);
                let w = u.iter().map(|v| r16(gelu_scalar(v.to_f32(), approx)).to_f32()).collect();
                (u, Vec::new(), w)
            }
            1 => {
                let (u, dy) = (draw(rows * cols), draw(rows * cols));
                let w = u.iter().zip(&dy)
                    .map(|(u, d)| r16(gelu_grad_scalar(u.to_f32(), approx) * d.to_f32()).to_f32())
                    .collect();
                (u, dy, w)
            }
            2 => {
                let gu = draw(rows * 2 * cols);
                let w = (0..rows * cols)
                    .map(|i| {
                        let (r, c) = (i / cols, i % cols);
                        let (g, u) = (gu[r * 2 * cols + c].to_f32(), gu[r * 2 * cols + cols + c].to_f32());
                        r16(swiglu_scalar(g, u)).to_f32()
                    })
                    .collect();
                (gu, Vec::new(), w)
            }
            // LayerNorm (with a bias) and RMSNorm: the forward's own output.
            4 | 5 => {
                let x = draw(rows * cols);
                let wb = draw(2 * cols);
                let spec = if kind == 4 { NormSpec::layer_norm(rows, cols) } else { NormSpec::rms_norm(rows, cols) };
                let (xb, w) = (dev.upload(&x).unwrap(), dev.upload(&wb[..cols]).unwrap());
                let b = (kind == 4).then(|| dev.upload(&wb[cols..]).unwrap());
                let mut st = NormStats::new(&dev, rows).unwrap();
                let mut y = dev.zeros::<bf16>(rows * cols).unwrap();
                norm_forward(&spec, &xb, &w, b.as_ref(), &mut st, &mut y).unwrap();
                (x, wb, y.to_vec().unwrap().iter().map(|v| v.to_f32()).collect())
            }
            _ => {
                let (gu, dh) = (draw(rows * cols), draw(rows * half));
                let w = (0..rows * cols)
                    .map(|i| {
                        let (r, c) = (i / cols, i % cols);
                        let k = c % half;
                        let (g, u) = (gu[r * cols + k].to_f32(), gu[r * cols + half + k].to_f32());
                        let (dg, du) = swiglu_grad_scalars(g, u, dh[r * half + k].to_f32());
                        r16(if c < half { dg } else { du }).to_f32()
                    })
                    .collect();
                (gu, dh, w)
            }
        };
        let (ab, bb) = (dev.upload(&a).unwrap(), dev.upload(&b).unwrap());
        // The norm's parameters and the statistics alone (the fused cast applies them itself).
        let norm_spec = if kind == 4 { NormSpec::layer_norm(rows, cols) } else { NormSpec::rms_norm(rows, cols) };
        let (nw, nb) = if kind >= 4 {
            (dev.upload(&b[..cols]).unwrap(), (kind == 4).then(|| dev.upload(&b[cols..]).unwrap()))
        } else {
            (dev.zeros::<bf16>(cols).unwrap(), None)
        };
        let mut stats = NormStats::new(&dev, rows).unwrap();
        if kind >= 4 {
            norm_forward_stats(&norm_spec, &ab, &nw, nb.as_ref(), &mut stats).unwrap();
        }
        let input = match kind {
            0 => BlockCastInput::Gelu { u: &ab, approx },
            1 => BlockCastInput::GeluGrad { u: &ab, dy: &bb, approx },
            2 => BlockCastInput::SwiGlu { gu: &ab },
            4 | 5 => BlockCastInput::Norm { x: &ab, weight: &nw, bias: nb.as_ref(), stats: &stats, spec: norm_spec },
            _ => BlockCastInput::SwiGluGrad { gu: &ab, dh: &bb },
        };
        let order = if gemm_order { ScaleOrder::Gemm } else { ScaleOrder::RowMajor };
        let format = Fp8Format::E4M3;
        let spec = |layout| BlockQuantSpec { layout, format, rounding: ScaleRounding::PowerOfTwo, scale_order: order };
        let bufs = |layout: BlockQuantLayout| {
            let n = order.strides(&layout.output_layout(rows, cols).unwrap()).unwrap().len;
            (dev.zeros::<u8>(rows * cols).unwrap(), dev.zeros::<f32>(n).unwrap(), dev.zeros::<f32>(n).unwrap())
        };
        let (mut q, mut s, mut si) = bufs(BlockQuantLayout::Rows1x128);
        let (mut qt, mut st, mut sit) = bufs(BlockQuantLayout::Columns128x1Transposed);
        block_quantize_tiles(
            input,
            [rows, cols],
            format,
            ScaleRounding::PowerOfTwo,
            order,
            Some(BlockQuantOutput { codes: &mut q, scale: &mut s, scale_inv: &mut si }),
            Some(BlockQuantOutput { codes: &mut qt, scale: &mut st, scale_inv: &mut sit }),
        )
        .unwrap();
        let bits = |b: &Buffer<f32>| b.to_vec().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        let got = [
            Quantized { codes: q.to_vec().unwrap(), scale: bits(&s), scale_inv: bits(&si) },
            Quantized { codes: qt.to_vec().unwrap(), scale: bits(&st), scale_inv: bits(&sit) },
        ];
        prop_assert_eq!(&got[0], &run::<bf16>(&dev, &want, rows, cols, spec(BlockQuantLayout::Rows1x128)));
        prop_assert_eq!(
            &got[1],
            &run::<bf16>(&dev, &want, rows, cols, spec(BlockQuantLayout::Columns128x1Transposed))
        );
    }

    #[test]
    fn round_trip_within_half_a_step_of_the_block_scale(
        (rows, cols, x) in input(),
        format in format(),
        rounding in rounding(),
    ) {
        let dev = Device::cpu();
        for layout in LAYOUTS {
            let spec = BlockQuantSpec { layout, format, rounding, scale_order: ScaleOrder::RowMajor };
            let q = run::<f32>(&dev, &x, rows, cols, spec);
            let y = dequantize(&dev, &q, rows, cols, spec);
            let out = layout.output_layout(rows, cols).unwrap();
            // The dequantization of each element by its block's inverse scale.
            let table = format.decode_table();
            for (i, (&c, &v)) in q.codes.iter().zip(&y).enumerate() {
                let b = out.block_of(i / out.cols(), i % out.cols()).unwrap();
                let want = table[c as usize] * f32::from_bits(q.scale_inv[b]);
                prop_assert_eq!(v.to_bits(), want.to_bits(), "element {}", i);
            }
            for b in 0..out.num_blocks() {
                let e = out.block_extent(b).unwrap();
                let s = f32::from_bits(q.scale[b]);
                let vals: Vec<(usize, f32)> = (e.row0..e.row0 + e.rows)
                    .flat_map(|r| (e.col0..e.col0 + e.cols).map(move |c| r * out.cols() + c))
                    .map(|i| {
                        // The input element of output element i (the transposed layout reads x^T).
                        let (r, c) = (i / out.cols(), i % out.cols());
                        let xi = match layout {
                            BlockQuantLayout::Columns128x1Transposed => c * cols + r,
                            _ => i,
                        };
                        (i, x[xi])
                    })
                    .collect();
                // Blocks holding an infinity keep scale 1 and saturate: no bound there.
                if vals.iter().any(|(_, v)| v.is_infinite()) {
                    prop_assert_eq!(s, 1.0);
                    continue;
                }
                let si = f32::from_bits(q.scale_inv[b]) as f64;
                for (i, v) in vals {
                    if v.is_nan() {
                        prop_assert!(y[i].is_nan());
                        continue;
                    }
                    // The dequantized value before its rounding to f32 (which may overflow near f32::MAX;
                    // that rounding was checked above).
                    let y64 = table[q.codes[i] as usize] as f64 * si;
                    let err = (y64 - v as f64).abs();
                    // Half a step at the scaled value, back at the input's scale; with exact scales the
                    // scaled value and the inverse scale are rounded to f32 too.
                    let mut bound = half_step(format, v * s) / s as f64;
                    if rounding == ScaleRounding::Exact {
                        bound += y64.abs() * 2f64.powi(-22);
                    }
                    prop_assert!(err <= bound, "{:?} element {}: {} -> {} (scale {}, bound {})", layout, i, v, y64, s, bound);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// The GEMM's scale order holds the row-major scales at its own indices (padding left zero), with the
    /// same codes, and dequantizes to the same values.
    #[test]
    fn gemm_scale_order_is_a_permutation_of_row_major(
        (rows, cols, x) in input(),
        format in format(),
        rounding in rounding(),
    ) {
        let dev = Device::cpu();
        for layout in LAYOUTS {
            let spec = BlockQuantSpec { layout, format, rounding, scale_order: ScaleOrder::RowMajor };
            let gemm = spec.with_scale_order(ScaleOrder::Gemm);
            let row = run::<f32>(&dev, &x, rows, cols, spec);
            let got = run::<f32>(&dev, &x, rows, cols, gemm);
            prop_assert_eq!(&got.codes, &row.codes);
            let out = layout.output_layout(rows, cols).unwrap();
            let st = ScaleOrder::Gemm.strides(&out).unwrap();
            let [gr, gc] = out.grid();
            let mut want = vec![0u32; st.len];
            let mut want_inv = vec![0u32; st.len];
            for i in 0..gr {
                for j in 0..gc {
                    // 1x128 tiles: column-major with rows padded to 4; else row-major, columns padded.
                    let at = if out.block_shape()[0] == 1 {
                        j * gr.next_multiple_of(4) + i
                    } else {
                        i * gc.next_multiple_of(4) + j
                    };
                    want[at] = row.scale[i * gc + j];
                    want_inv[at] = row.scale_inv[i * gc + j];
                }
            }
            prop_assert_eq!(&got.scale, &want, "{:?} {}x{}", layout, rows, cols);
            prop_assert_eq!(&got.scale_inv, &want_inv);
            let a = dequantize(&dev, &row, rows, cols, spec);
            let b = dequantize(&dev, &got, rows, cols, gemm);
            prop_assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
        }
    }
}

fn first_diff(a: &Quantized, b: &Quantized) -> String {
    let pos = |x: &[u32], y: &[u32]| x.iter().zip(y).position(|(p, q)| p != q);
    if let Some(i) = a.codes.iter().zip(&b.codes).position(|(p, q)| p != q) {
        return format!("code {i}: {:#04x} vs {:#04x}", a.codes[i], b.codes[i]);
    }
    if let Some(i) = pos(&a.scale, &b.scale) {
        return format!(
            "scale {i}: {} vs {}",
            f32::from_bits(a.scale[i]),
            f32::from_bits(b.scale[i])
        );
    }
    if let Some(i) = pos(&a.scale_inv, &b.scale_inv) {
        return format!("scale_inv {i}");
    }
    "lengths differ".into()
}

#[test]
fn partial_and_zero_blocks() {
    // 2 x 130: tile (0, 1) holds 2 elements, tile (1, *) is zero. The partial tile's scale comes from its
    // two real elements only.
    let (rows, cols) = (2, 130);
    let mut x = vec![0.0f32; rows * cols];
    x[0] = 448.0; // tile (0, 0): amax 448 -> scale 1
    x[128] = 0.5; // tile (0, 1): amax 0.75 -> 448 / 0.75 = 597 -> 512
    x[129] = -0.75;
    let spec = BlockQuantSpec::new(BlockQuantLayout::Rows1x128, Fp8Format::E4M3);
    let q = run::<f32>(&Device::cpu(), &x, rows, cols, spec);
    let scales: Vec<f32> = q.scale.iter().map(|&b| f32::from_bits(b)).collect();
    assert_eq!(scales, vec![1.0, 512.0, 1.0, 1.0]);
    assert_eq!(q.codes[128], Fp8Format::E4M3.encode(256.0));
    assert_eq!(q.codes[129], Fp8Format::E4M3.encode(-384.0));
    assert!(q.codes[130..].iter().all(|&c| c == 0));
    // The same data in one 128x128 block of 2 x 130 columns... two blocks across: the second again holds
    // only columns 128 and 129.
    let spec = BlockQuantSpec::new(BlockQuantLayout::Blocks128x128, Fp8Format::E4M3);
    let q = run::<f32>(&Device::cpu(), &x, rows, cols, spec);
    let scales: Vec<f32> = q.scale.iter().map(|&b| f32::from_bits(b)).collect();
    assert_eq!(scales, vec![1.0, 512.0]);
}

nvrtc_test! {
    fn block_quantize_module_compiles_for_sm90() {
        let ptx = sm90_ptx(&BLOCK_QUANTIZE_MODULE);
        let mut kernels = Vec::new();
        for t in ["f32", "bf16", "f16"] {
            for f in ["e4m3", "e5m2"] {
                for l in ["1x128", "128x1t", "128x128", "both"] {
                    kernels.push(format!("bq_{l}_{t}_{f}"));
                }
                kernels.push(format!("bdq_{f}_{t}"));
                kernels.push(format!("bqp_1x128_{t}_{f}"));
                kernels.push(format!("bdqs_{f}_{t}"));
            }
        }
        let names: Vec<&str> = kernels.iter().map(String::as_str).collect();
        assert_kernels(&ptx, &names);
        for insn in ["cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.satfinite.e5m2x2.f32", "cvt.rn.f16x2.e4m3x2"] {
            assert!(ptx.contains(insn), "block_quantize module lacks {insn}");
        }
    }
}

nvrtc_test! {
    fn block_activation_module_compiles_for_sm90() {
        let ptx = sm90_ptx(&BLOCK_ACTIVATION_MODULE);
        let mut kernels = Vec::new();
        for a in ["gelu", "gelu_grad", "swiglu", "swiglu_grad"] {
            for f in ["e4m3", "e5m2"] {
                kernels.push(format!("bq_{a}_bf16_{f}"));
            }
        }
        let names: Vec<&str> = kernels.iter().map(String::as_str).collect();
        assert_kernels(&ptx, &names);
    }
}

#[test]
fn dequantized_sum_of_one_row_is_the_dequantization() {
    // One piece, alpha 1, added to zeros: block_dequantize's values (as 0 + d).
    let (rows, cols) = (1, 300);
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
        .collect();
    let spec = BlockQuantSpec::new(BlockQuantLayout::Rows1x128, Fp8Format::E4M3);
    let q = run::<f32>(&Device::cpu(), &x, rows, cols, spec);
    let want: Vec<f32> = dequantize(&Device::cpu(), &q, rows, cols, spec)
        .iter()
        .map(|v| 0.0 + v)
        .collect();
    let packed = run_packed::<f32>(&x, rows, cols, spec.format, spec.rounding);
    let got = run_dequantize_sum(&packed, rows, cols, spec.format, 1.0, &vec![0.0f32; cols]);
    assert_eq!(got, want);
}

#[test]
fn packed_argument_errors() {
    let dev = Device::cpu();
    let packing = PackedRows1x128::new(3, 130).unwrap();
    // 130 codes -> 144 bytes, 2 scales -> 16 bytes: 160 per record.
    assert_eq!(
        (
            packing.scales_offset(),
            packing.row_bytes(),
            packing.num_bytes()
        ),
        (144, 160, 480)
    );
    assert!(PackedRows1x128::new(1, usize::MAX / 2).is_err());
    let x: Buffer<f32> = dev.zeros(3 * 130).unwrap();
    let mut p: Buffer<u8> = dev.zeros(479).unwrap();
    let f = Fp8Format::E4M3;
    let r = ScaleRounding::PowerOfTwo;
    assert!(block_quantize_packed(&x, packing, f, r, &mut p).is_err());
    let mut p: Buffer<u8> = dev.zeros(480).unwrap();
    block_quantize_packed(&x, packing, f, r, &mut p).unwrap();
    let mut out: Buffer<f32> = dev.zeros(129).unwrap();
    assert!(block_dequantize_sum(&p, packing, f, 1.0, &mut out).is_err());
    let none = PackedRows1x128::new(0, 130).unwrap();
    let mut out: Buffer<f32> = dev.zeros(130).unwrap();
    let empty: Buffer<u8> = dev.zeros(0).unwrap();
    assert!(block_dequantize_sum(&empty, none, f, 1.0, &mut out).is_err());
}
