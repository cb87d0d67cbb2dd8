//! Property tests of the CPU block-scaled FP8 GEMM (`gemm_fp8_block`):
//!
//! - against a scalar f64 reference of the dequantized operands, on random shapes (multiples of 16 with
//!   partial 128 blocks in every dimension), every accepted pairing of 1x128 tiles and 128x128 blocks,
//!   operands stored transposed, both scale orders (padding entries NaN, so reading one fails the
//!   test), power-of-two and other scales from 2^-12 to 2^13, every format pair, alpha and beta, f32 and
//!   bf16 outputs. Bound: `(k + 8) 2^-24 (|alpha| sum |a b| + |beta c|)` (f32 sums of at most 128
//!   products per K block, two scale multiplies, at most k/128 block additions, alpha and beta), plus
//!   half a bf16 ulp (2^-8 relative) for bf16 outputs;
//! - `gemm_fp8_block_at` into a range of a larger buffer: bit for bit the plain GEMM there, the rest
//!   untouched, a range past the end refused;
//! - a hand-computed case with two K blocks;
//! - the linear layer's three products from `block_quantize` of random inputs against the f64 GEMM of
//!   the unquantized inputs, within the bound stated at `quantized_products_approximate_the_f64_gemm`.

mod block_gemm_common;

use block_gemm_common::{gemm_spec, operand, reference, HostOperand, Kind, OperandSpec};
use fp8_core::{BlockLayout, Fp8Format, ScalingGranularity};
use fp8_kernels::gemm::{gemm_fp8_block, gemm_fp8_block_at, transpose_block_fp8};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{
    block_quantize, BlockFp8Matrix, BlockQuantLayout, BlockQuantSpec, Buffer, Device, GemmSpec,
    ScaleOrder, Transpose,
};
use half::bf16;
use proptest::prelude::*;

fn format() -> impl Strategy<Value = Fp8Format> {
    prop_oneof![Just(Fp8Format::E4M3), Just(Fp8Format::E5M2)]
}

fn order() -> impl Strategy<Value = ScaleOrder> {
    prop_oneof![Just(ScaleOrder::RowMajor), Just(ScaleOrder::Gemm)]
}

fn operand_spec(kind: Kind) -> impl Strategy<Value = OperandSpec> {
    (any::<bool>(), format(), order(), any::<bool>()).prop_map(
        move |(transposed, format, order, pow2)| OperandSpec {
            kind,
            transposed,
            format,
            order,
            pow2,
            pad: f32::NAN,
        },
    )
}

/// The kinds of A and B: every pairing cuBLASLt has.
fn kinds() -> impl Strategy<Value = (Kind, Kind)> {
    prop_oneof![
        Just((Kind::Tiles, Kind::Blocks)),
        Just((Kind::Blocks, Kind::Tiles)),
        Just((Kind::Tiles, Kind::Tiles)),
    ]
}

/// One random call: shape (multiples of 16: 16..160 x 16..160 x 16..400), operands, alpha, beta, seed.
fn case() -> impl Strategy<Value = (GemmSpec, HostOperand, HostOperand, Vec<f32>)> {
    (1usize..=10, 1usize..=10, 1usize..=25, kinds(), any::<u64>()).prop_flat_map(
        |(m, n, k, (ka, kb), seed)| {
            (
                operand_spec(ka),
                operand_spec(kb),
                prop_oneof![Just(1.0f32), Just(-0.5), Just(3.0)],
                prop_oneof![Just(0.0f32), Just(1.0), Just(-2.0)],
            )
                .prop_map(move |(sa, sb, alpha, beta)| {
                    let (m, n, k) = (m * 16, n * 16, k * 16);
                    let a = operand(m, k, sa, seed);
                    let b = operand(n, k, sb, seed ^ 0x5EED);
                    let spec = gemm_spec(m, n, k, &a, &b).scalars(alpha, beta);
                    let c = SplitMix64::new(seed ^ 0xC).uniform_vec(m * n);
                    (spec, a, b, c)
                })
        },
    )
}

/// Runs the CPU GEMM into an output of type `O` starting from `c`.
fn run<O: fp8_kernels::GemmOutput>(
    spec: &GemmSpec,
    a: &HostOperand,
    b: &HostOperand,
    c: &[f32],
) -> Vec<f32> {
    let dev = Device::cpu();
    let (ab, bb) = (a.upload(&dev), b.upload(&dev));
    let c0: Vec<O> = c.iter().map(|&v| O::from_f32(v)).collect();
    let mut out = dev.upload(&c0).unwrap();
    gemm_fp8_block(spec, a.matrix(&ab), b.matrix(&bb), &mut out).unwrap();
    out.to_vec().unwrap().iter().map(|v| v.to_f32()).collect()
}

/// Worst `|got - want| / bound` over the elements (<= 1 passes).
fn worst(got: &[f32], want: &[f64], mag: &[f64], k: usize, bf16_out: bool) -> f64 {
    got.iter()
        .zip(want)
        .zip(mag)
        .map(|((&g, &w), &m)| {
            let mut bound = (k as f64 + 8.0) * 2f64.powi(-24) * m + 1e-38;
            if bf16_out {
                bound += w.abs() * 2f64.powi(-8) * (1.0 + 2f64.powi(-7));
            }
            if g.is_nan() {
                return f64::INFINITY;
            }
            (g as f64 - w).abs() / bound
        })
        .fold(0.0, f64::max)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn gemm_into_a_range_equals_the_plain_gemm(
        (spec, a, b, c) in case(),
        before in 0usize..40,
        after in 0usize..9,
    ) {
        let dev = Device::cpu();
        let mn = spec.m * spec.n;
        let (ab, bb) = (a.upload(&dev), b.upload(&dev));
        let mut big0 = SplitMix64::new(before as u64 ^ 0xB16).uniform_vec(before + mn + after);
        big0[before..before + mn].copy_from_slice(&c);
        let mut plain = dev.upload(&c).unwrap();
        gemm_fp8_block(&spec, a.matrix(&ab), b.matrix(&bb), &mut plain).unwrap();
        let mut want = big0.clone();
        want[before..before + mn].copy_from_slice(&plain.to_vec().unwrap());
        let mut big = dev.upload(&big0).unwrap();
        gemm_fp8_block_at(&spec, a.matrix(&ab), b.matrix(&bb), &mut big, before).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&big.to_vec().unwrap()), bits(&want));
        let mut short = dev.upload(&big0[..before + mn - 1]).unwrap();
        prop_assert!(gemm_fp8_block_at(&spec, a.matrix(&ab), b.matrix(&bb), &mut short, before).is_err());
    }

    #[test]
    fn cpu_matches_f64_reference((spec, a, b, c) in case()) {
        let (want, mag) = reference(&spec, &a, &b, &c);
        let got = run::<f32>(&spec, &a, &b, &c);
        let w = worst(&got, &want, &mag, spec.k, false);
        prop_assert!(w <= 1.0, "f32 output: worst error / bound {w} ({:?}; A {:?} B {:?})",
            spec, (a.layout.block_shape(), a.format, a.order), (b.layout.block_shape(), b.format, b.order));
        // bf16 output: the old C is read as bf16, so the reference starts from the rounded C.
        let c16: Vec<f32> = c.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let (want16, mag16) = reference(&spec, &a, &b, &c16);
        let got16 = run::<bf16>(&spec, &a, &b, &c16);
        let w = worst(&got16, &want16, &mag16, spec.k, true);
        prop_assert!(w <= 1.0, "bf16 output: worst error / bound {w}");
        // The bf16 output is the f32 result rounded once.
        let got32 = run::<f32>(&spec, &a, &b, &c16);
        for (x, y) in got16.iter().zip(&got32) {
            prop_assert_eq!(x.to_bits(), bf16::from_f32(*y).to_f32().to_bits());
        }
    }
}

#[test]
fn two_k_blocks_by_hand() {
    // A [16, 256] in 1x128 tiles, every code 1.0: row i's scales 2 (first K block) and 3 (second).
    // B [16, 256] in 128x128 blocks, every code 1.0: scales 5 and 7. Each output is
    // 128 * 2 * 5 + 128 * 3 * 7 = 3968; with alpha 0.5 and beta 1 over C = 1: 1985.
    let dev = Device::cpu();
    let one = Fp8Format::E4M3.encode(1.0);
    let (m, n, k) = (16, 16, 256);
    let al = BlockLayout::new(m, k, ScalingGranularity::Block1x128).unwrap();
    let bl = BlockLayout::new(n, k, ScalingGranularity::Block128x128).unwrap();
    let a_codes = dev.upload(&vec![one; m * k]).unwrap();
    let b_codes = dev.upload(&vec![one; n * k]).unwrap();
    // Row-major [m, 2] for A; the GEMM's order for B: one block row padded to 4.
    let a_s: Vec<f32> = (0..m).flat_map(|_| [2.0f32, 3.0]).collect();
    let a_s = dev.upload(&a_s).unwrap();
    let b_s = dev.upload(&[5.0f32, 7.0, f32::NAN, f32::NAN]).unwrap();
    let a = BlockFp8Matrix {
        data: &a_codes,
        format: Fp8Format::E4M3,
        layout: al,
        scale_inv: &a_s,
        scale_order: ScaleOrder::RowMajor,
    };
    let b = BlockFp8Matrix {
        data: &b_codes,
        format: Fp8Format::E4M3,
        layout: bl,
        scale_inv: &b_s,
        scale_order: ScaleOrder::Gemm,
    };
    let spec = GemmSpec::new(m, n, k)
        .transposes(Transpose::No, Transpose::Yes)
        .scalars(0.5, 1.0);
    let mut c = dev.upload(&vec![1.0f32; m * n]).unwrap();
    gemm_fp8_block(&spec, a, b, &mut c).unwrap();
    assert!(c.to_vec().unwrap().iter().all(|&v| v == 1985.0));
}

/// Codes and scales of one `block_quantize` cast (scales in the GEMM's order), with the layout of the
/// codes.
struct Cast {
    codes: Buffer<u8>,
    scale: Buffer<f32>,
    scale_inv: Buffer<f32>,
    layout: BlockLayout,
    format: Fp8Format,
}

impl Cast {
    fn new(x: &[f32], shape: [usize; 2], layout: BlockQuantLayout, format: Fp8Format) -> Cast {
        let dev = Device::cpu();
        let spec = BlockQuantSpec::new(layout, format).with_scale_order(ScaleOrder::Gemm);
        let out = layout.output_layout(shape[0], shape[1]).unwrap();
        let n = ScaleOrder::Gemm.strides(&out).unwrap().len;
        let mut c = Cast {
            codes: dev.zeros(out.numel()).unwrap(),
            scale: dev.zeros(n).unwrap(),
            scale_inv: dev.zeros(n).unwrap(),
            layout: out,
            format,
        };
        let xb = dev.upload(x).unwrap();
        block_quantize(
            &xb,
            shape,
            spec,
            &mut c.codes,
            &mut c.scale,
            &mut c.scale_inv,
        )
        .unwrap();
        c
    }

    fn matrix(&self) -> BlockFp8Matrix<'_> {
        BlockFp8Matrix {
            data: &self.codes,
            format: self.format,
            layout: self.layout,
            scale_inv: &self.scale_inv,
            scale_order: ScaleOrder::Gemm,
        }
    }

    /// The bound of the cast's error at stored element `(r, c)` of value `v`: half an FP8 step at the
    /// scaled value, `2^-(mantissa + 1) |v|` in the normal range and half the subnormal spacing below
    /// it, back at the input's scale (power-of-two scales: the scaling itself is exact).
    fn error_bound(&self, r: usize, c: usize, v: f32) -> f64 {
        let st = ScaleOrder::Gemm.strides(&self.layout).unwrap();
        let [br, bc] = self.layout.block_shape();
        let s = self.scale.to_vec().unwrap()[st.index(r / br, c / bc)] as f64;
        let f = self.format;
        2f64.powi(-(f.mantissa_bits() as i32 + 1)) * v.abs() as f64
            + f.min_subnormal() as f64 / 2.0 / s
    }
}

/// `C[i, j] = sum_p A[i, p] B[j, p]` in f64 for row-major `a [m, k]`, `b [n, k]`, and the bound
/// `sum_p (ea |b| + |a| eb + ea eb) + (k + 8) 2^-24 sum_p (|a| + ea)(|b| + eb)` from per-element cast
/// error bounds `ea`, `eb`.
fn product_and_bound(
    a: &[f32],
    ea: &[f64],
    b: &[f32],
    eb: &[f64],
    [m, n, k]: [usize; 3],
) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; m * n];
    let mut bound = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut q, mut mag) = (0.0f64, 0.0f64, 0.0f64);
            for p in 0..k {
                let (x, w) = (a[i * k + p] as f64, b[j * k + p] as f64);
                let (ex, ew) = (ea[i * k + p], eb[j * k + p]);
                s += x * w;
                q += ex * w.abs() + x.abs() * ew + ex * ew;
                mag += (x.abs() + ex) * (w.abs() + ew);
            }
            y[i * n + j] = s;
            bound[i * n + j] = q + (k as f64 + 8.0) * 2f64.powi(-24) * mag;
        }
    }
    (y, bound)
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| x[(i % rows) * cols + i / rows])
        .collect()
}

/// The worst `|got - want| / bound` and the relative Frobenius error of `got`.
fn compare(got: &[f32], want: &[f64], bound: &[f64]) -> (f64, f64) {
    let (mut worst, mut e2, mut w2) = (0.0f64, 0.0f64, 0.0f64);
    for ((&g, &w), &b) in got.iter().zip(want).zip(bound) {
        let d = g as f64 - w;
        worst = worst.max(d.abs() / b);
        e2 += d * d;
        w2 += w * w;
    }
    (worst, (e2 / w2).sqrt())
}

/// The linear layer `y = x W^T` in block-scaled FP8 (x and W in E4M3, dy in E5M2, power-of-two scales):
/// forward, data gradient (W read transposed, and W^T from `transpose_block_fp8`, bit for bit alike) and
/// weight gradient, each within the stated bound of the f64 GEMM of the unquantized inputs: every
/// output's error is at most `sum_p (ea |b| + |a| eb + ea eb)` (each operand's cast error bound, see
/// `Cast::error_bound`) plus the f32 accumulation slack. Shapes with partial blocks everywhere: 144
/// tokens, 272 inputs, 160 outputs. Values uniform with per-row magnitudes over 2^-6 .. 2^6.
#[test]
fn quantized_products_approximate_the_f64_gemm() {
    let (t, inf, outf) = (144, 272, 160);
    let mut r = SplitMix64::new(0xB6E3);
    let mut values = |rows: usize, cols: usize| -> Vec<f32> {
        let mut v = r.uniform_vec(rows * cols);
        for (i, x) in v.iter_mut().enumerate() {
            *x *= 2f32.powi((SplitMix64::mix(i as u64 / cols as u64) % 13) as i32 - 6);
        }
        v
    };
    let (x, w, dy) = (values(t, inf), values(outf, inf), values(t, outf));
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let dev = Device::cpu();
    let errs = |cast: &Cast, vals: &[f32], transposed: bool| -> Vec<f64> {
        // Bounds per element of `vals` (row-major as the GEMM reads it, K-major); the cast's stored
        // element is (r, c) or (c, r).
        let (rows, cols) = (cast.layout.rows(), cast.layout.cols());
        let (outer, k) = if transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        (0..outer * k)
            .map(|i| {
                let (o, p) = (i / k, i % k);
                let (sr, sc) = if transposed { (p, o) } else { (o, p) };
                cast.error_bound(sr, sc, vals[i])
            })
            .collect()
    };

    // Forward: y [t, out] = x [t, in] . W [out, in]^T.
    let xq = Cast::new(&x, [t, inf], BlockQuantLayout::Rows1x128, e4);
    let wq = Cast::new(&w, [outf, inf], BlockQuantLayout::Blocks128x128, e4);
    let spec = GemmSpec::new(t, outf, inf).transposes(Transpose::No, Transpose::Yes);
    let mut y: Buffer<f32> = dev.zeros(t * outf).unwrap();
    gemm_fp8_block(&spec, xq.matrix(), wq.matrix(), &mut y).unwrap();
    let (want, bound) = product_and_bound(
        &x,
        &errs(&xq, &x, false),
        &w,
        &errs(&wq, &w, false),
        [t, outf, inf],
    );
    let (worst, rel) = compare(&y.to_vec().unwrap(), &want, &bound);
    println!("forward: worst error / bound {worst:.3}, relative error {rel:.4}");
    assert!(worst <= 1.0);

    // Data gradient: dx [t, in] = dy [t, out] . W [out, in]; W is read transposed (its 128x128 blocks
    // and scales as cast for the forward).
    let dyq = Cast::new(&dy, [t, outf], BlockQuantLayout::Rows1x128, e5);
    let spec = GemmSpec::new(t, inf, outf);
    let mut dx: Buffer<f32> = dev.zeros(t * inf).unwrap();
    gemm_fp8_block(&spec, dyq.matrix(), wq.matrix(), &mut dx).unwrap();
    let wt = transpose(&w, outf, inf);
    let (want, bound) = product_and_bound(
        &dy,
        &errs(&dyq, &dy, false),
        &wt,
        &errs(&wq, &wt, true),
        [t, inf, outf],
    );
    let dx = dx.to_vec().unwrap();
    let (worst, rel) = compare(&dx, &want, &bound);
    println!("data gradient: worst error / bound {worst:.3}, relative error {rel:.4}");
    assert!(worst <= 1.0);
    // The same with W^T made once by transpose_block_fp8.
    let tl = wq.layout.transposed();
    let mut wt_codes: Buffer<u8> = dev.zeros(tl.numel()).unwrap();
    let mut wt_scales: Buffer<f32> = dev
        .zeros(ScaleOrder::Gemm.strides(&tl).unwrap().len)
        .unwrap();
    transpose_block_fp8(wq.matrix(), &mut wt_codes, &mut wt_scales, ScaleOrder::Gemm).unwrap();
    let wt_m = BlockFp8Matrix {
        data: &wt_codes,
        format: e4,
        layout: tl,
        scale_inv: &wt_scales,
        scale_order: ScaleOrder::Gemm,
    };
    let spec_t = spec.transposes(Transpose::No, Transpose::Yes);
    let mut dx2: Buffer<f32> = dev.zeros(t * inf).unwrap();
    gemm_fp8_block(&spec_t, dyq.matrix(), wt_m, &mut dx2).unwrap();
    let same = dx2
        .to_vec()
        .unwrap()
        .iter()
        .zip(&dx)
        .all(|(p, q)| p.to_bits() == q.to_bits());
    assert!(same, "dx through transpose_block_fp8 differs");

    // Weight gradient: dW [out, in] = dy^T [out, t] . x^T [in, t]^T, both cast in 128x1 tiles along the
    // tokens (the transposed layout).
    let dyt = Cast::new(&dy, [t, outf], BlockQuantLayout::Columns128x1Transposed, e5);
    let xt = Cast::new(&x, [t, inf], BlockQuantLayout::Columns128x1Transposed, e4);
    let spec = GemmSpec::new(outf, inf, t).transposes(Transpose::No, Transpose::Yes);
    let mut dw: Buffer<f32> = dev.zeros(outf * inf).unwrap();
    gemm_fp8_block(&spec, dyt.matrix(), xt.matrix(), &mut dw).unwrap();
    let (dyt_v, xt_v) = (transpose(&dy, t, outf), transpose(&x, t, inf));
    let (want, bound) = product_and_bound(
        &dyt_v,
        &errs(&dyt, &dyt_v, false),
        &xt_v,
        &errs(&xt, &xt_v, false),
        [outf, inf, t],
    );
    let (worst, rel) = compare(&dw.to_vec().unwrap(), &want, &bound);
    println!("weight gradient: worst error / bound {worst:.3}, relative error {rel:.4}");
    assert!(worst <= 1.0);
}
