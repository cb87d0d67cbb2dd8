//! The block-scaled FP8 `Linear` (DeepSeek-V3's recipe, `Fp8Recipe::block_scaled`) on the CPU inside a
//! wrapped model (thread ranks, world sizes 1 and 2):
//!
//! - forward `y`, `dx`, the reduced `dW` and `db` against an f64 reference built from the dequantized
//!   operands (each operand cast here by fp8-core in its own tiles: `x` and `dy` in 1x128 tiles for the
//!   forward and data gradient, in 128x1 tiles for the weight gradient, the weight as gathered), within
//!   the f32 accumulation bound of the block-scaled GEMM;
//! - the same outputs against the unquantized F32 linear, within the bound that E4M3's relative step
//!   (2^-4 per operand, with the subnormal floor of each tile's scale) gives;
//! - the path is really taken (the same seed's per-tensor layer gives other bits; no scaling metas, a
//!   block-scaled weight parameter), and a channel 1000x (and 2^16x) larger than the others costs the
//!   block-scaled layer far less accuracy than the per-tensor one;
//! - `convert_to_fp8` with the block recipe, the shape rules, and the fused producers (norm, GELU and
//!   SwiGLU casts) taking the unfused path for block-scaled linears.

mod common;

use common::{full_grad, grad_shards, on_ranks, rel_diff, values, TestResult};
use fp8_core::{block_scale, Fp8Format, Fp8Recipe, ScaleRounding, ScalingRecipe, BLOCK_SIZE};
use fp8_kernels::layer_norm::NormKind;
use fp8_kernels::CpuParallelism;
use fsdp_nn::{
    convert_to_fp8, Activation, Fp8Filter, Layer, Linear, LinearPrecision, Mlp, MlpActivation,
    NnError, Norm, Relu, Sequential, Shape, Tensor,
};
use fsdp_shard::{
    Ctx, FsdpConfig, FsdpModel, GradDtype, Mode, ModelLayout, Module, ParamKind, ShardError,
    Visitor, WrapPolicy,
};
use half::bf16;
use std::sync::Arc;

/// The unit roundoff of f32.
const U: f64 = 1.0 / 16_777_216.0;

fn recipe() -> Fp8Recipe {
    Fp8Recipe::block_scaled(ScaleRounding::PowerOfTwo)
}

fn block_linear<T: Activation>(inf: usize, outf: usize, seed: u64) -> Result<Linear<T>, NnError> {
    Ok(Linear::<T>::new(inf, outf)?
        .with_precision(LinearPrecision::Fp8)?
        .with_fp8_recipe(&recipe())?
        .with_seed(seed))
}

fn to_t<T: Activation>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn from_t<T: Activation>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// `v` as `T` holds it.
fn rounded<T: Activation>(v: &[f32]) -> Vec<f32> {
    from_t(&to_t::<T>(v))
}

/// Relative rounding of an output stored in `T`.
fn out_rel<T: Activation>() -> f64 {
    if T::DTYPE == fp8_kernels::DType::BF16 {
        2f64.powi(-8)
    } else {
        0.0
    }
}

/// A reference block cast of row-major `x [rows, cols]` in tiles of `tile` (`[1, 128]`, `[128, 1]`),
/// by fp8-core: each tile scaled by `block_scale` of its amax, encoded, decoded and scaled back. Returns
/// the dequantized values and each element's scale.
fn tile_qdq(
    x: &[f32],
    [rows, cols]: [usize; 2],
    [br, bc]: [usize; 2],
    format: Fp8Format,
) -> (Vec<f64>, Vec<f32>) {
    let mut out = vec![0.0; x.len()];
    let mut scales = vec![0.0f32; x.len()];
    for r0 in (0..rows).step_by(br) {
        for c0 in (0..cols).step_by(bc) {
            let (r1, c1) = ((r0 + br).min(rows), (c0 + bc).min(cols));
            let mut amax = 0.0f32;
            for r in r0..r1 {
                for c in c0..c1 {
                    amax = amax.max(x[r * cols + c].abs());
                }
            }
            let s = block_scale(amax, format.max(), ScaleRounding::PowerOfTwo);
            let inv = 1.0 / s;
            for r in r0..r1 {
                for c in c0..c1 {
                    let i = r * cols + c;
                    out[i] = format.decode(format.encode(x[i] * s)) as f64 * inv as f64;
                    scales[i] = s;
                }
            }
        }
    }
    (out, scales)
}

/// `C[i, j] = sum_p a(i, p) b(j, p)` in f64 and `sum_p |a(i, p) b(j, p)|`.
fn product(
    [m, n, k]: [usize; 3],
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let t = a(i, p) * b(j, p);
                c[i * n + j] += t;
                mag[i * n + j] += t.abs();
            }
        }
    }
    (c, mag)
}

/// The relative accumulation bound of the block-scaled GEMM over `k` (relative to `sum |terms|`): within
/// a 128-wide K block the products of decoded FP8 values are exact in f32 and up to 128 of them are
/// added (127 roundings); the power-of-two scales multiply exactly; the `ceil(k / 128)` scaled block sums
/// are added into the f32 accumulator; `more` further additions follow (the bias, the other ranks' sums
/// in the reduction). Each rounding is at most `U` of the running `sum |terms|`, so the error is at most
/// `(min(k, 128) + ceil(k / 128) + more) U sum |terms|` (one spare `U` per chain absorbs second-order
/// terms).
fn gemm_rel(k: usize, more: usize) -> f64 {
    (k.min(BLOCK_SIZE) + k.div_ceil(BLOCK_SIZE) + more) as f64 * U
}

/// `max_i |got_i - want_i| / (bound_i)` with `bound_i = rel mag_i + out |want_i| + abs_i`.
fn worst(got: &[f32], want: &[f64], mag: &[f64], rel: f64, out: f64, abs: &[f64]) -> (f64, usize) {
    assert_eq!(got.len(), want.len());
    let mut w = (0.0f64, 0usize);
    for (i, (&g, &v)) in got.iter().zip(want).enumerate() {
        let bound = rel * mag[i] + out * v.abs() + abs.get(i).copied().unwrap_or(0.0) + 1e-30;
        let r = (g as f64 - v).abs() / bound;
        assert!(r.is_finite(), "element {i}: got {g}, want {v}");
        if r > w.0 {
            w = (r, i);
        }
    }
    w
}

fn check(what: &str, got: &[f32], want: &[f64], mag: &[f64], rel: f64, out: f64, abs: &[f64]) {
    let (r, i) = worst(got, want, mag, rel, out, abs);
    println!("{what}: worst error / bound {r:.3}");
    assert!(
        r <= 1.0,
        "{what}: element {i}: got {}, want {} (error / bound {r:.3})",
        got[i],
        want[i]
    );
}

/// What one rank of a run saw and produced.
struct RankRun {
    x: Vec<f32>,
    dy: Vec<f32>,
    y: Vec<f32>,
    dx: Vec<f32>,
    grads: Vec<[Vec<f32>; 2]>,
    /// The gathered weight decoded, and the bias (F32).
    weight: Vec<f32>,
    bias: Vec<f32>,
    layout: Arc<ModelLayout>,
    metas: usize,
    saved_bytes: usize,
}

/// Inputs and output gradients of one rank, as the layer gets them (`T` applied by the run).
type Data = dyn Fn(u64) -> (Vec<f32>, Vec<f32>) + Sync;

/// One training forward and backward of `make()` on `ranks` thread ranks, input of shape `shape`
/// (`[..., in]`), each rank with its own data.
fn run<T: Activation>(
    ranks: usize,
    make: &(dyn Fn() -> Result<Linear<T>, NnError> + Sync),
    shape: &[usize],
    grad_dtype: GradDtype,
    data: &Data,
) -> Vec<RankRun> {
    run_after(0, ranks, make, shape, grad_dtype, data)
}

/// [`run`] after `warmup` passes over the same data, each followed by a local update of the scaling
/// metas (so a per-tensor layer's scales come from this data's amaxes) and zeroed gradients.
fn run_after<T: Activation>(
    warmup: usize,
    ranks: usize,
    make: &(dyn Fn() -> Result<Linear<T>, NnError> + Sync),
    shape: &[usize],
    grad_dtype: GradDtype,
    data: &Data,
) -> Vec<RankRun> {
    on_ranks(ranks, |comm| {
        let rank = comm.rank() as u64;
        let config = FsdpConfig {
            grad_dtype,
            ..FsdpConfig::default()
        };
        let mut model = FsdpModel::new(make()?, comm, WrapPolicy::Single, config)?;
        model.set_cpu_parallelism(CpuParallelism::Single);
        let dev = model.device().clone();
        let params = model.gathered_params()?;
        let (weight, bias) = (params[0].1.clone(), params[1].1.clone());
        let (x, dy) = data(rank);
        let (x, dy) = (rounded::<T>(&x), rounded::<T>(&dy));
        let in_shape = Shape::new(shape)?;
        let outf = model.module().out_features();
        for _ in 0..warmup {
            let xt = Tensor::new(dev.upload(&to_t::<T>(&x))?, in_shape)?;
            model.forward(Mode::Train, |lin, ctx| lin.forward(ctx, xt))?;
            let dyt = Tensor::new(dev.upload(&to_t::<T>(&dy))?, in_shape.with_last(outf)?)?;
            model.backward(|lin, ctx| lin.backward_step(ctx, dyt, false))?;
            model.parts_mut().1.update_local()?;
            model.sharded_mut().zero_grads()?;
        }
        let xt = Tensor::new(dev.upload(&to_t::<T>(&x))?, in_shape)?;
        let y = model.forward(Mode::Train, |lin, ctx| lin.forward(ctx, xt))?;
        let saved_bytes = model.module().saved_bytes();
        let dyt = Tensor::new(dev.upload(&to_t::<T>(&dy))?, in_shape.with_last(outf)?)?;
        let dx = model
            .backward(|lin, ctx| lin.backward_step(ctx, dyt, true))?
            .ok_or("no dx")?;
        assert_eq!(dx.shape(), in_shape);
        Ok(RankRun {
            x,
            dy,
            y: from_t(&y.data().to_vec()?),
            dx: from_t(&dx.data().to_vec()?),
            grads: grad_shards(model.sharded())?,
            weight,
            bias,
            layout: model.layout().clone(),
            metas: model.scaling().len(),
            saved_bytes,
        })
    })
}

/// Uniform data: `x` in `±2`, `dy` in `±0.01`, different on every rank.
fn uniform_data(
    tokens: usize,
    inf: usize,
    outf: usize,
    seed: u64,
) -> impl Fn(u64) -> (Vec<f32>, Vec<f32>) + Sync {
    move |rank| {
        (
            values(seed ^ (rank << 32) ^ 1, tokens * inf, 2.0),
            values(seed ^ (rank << 32) ^ 2, tokens * outf, 0.01),
        )
    }
}

/// The block-scaled layer's outputs against the f64 reference from the dequantized operands.
fn check_against_dequantized<T: Activation>(
    ranks: usize,
    shape: &[usize],
    outf: usize,
    grad_dtype: GradDtype,
) {
    let inf = *shape.last().unwrap();
    let tokens = shape.iter().product::<usize>() / inf;
    let seed = 17 + tokens as u64;
    let runs = run::<T>(
        ranks,
        &|| block_linear::<T>(inf, outf, seed),
        shape,
        grad_dtype,
        &uniform_data(tokens, inf, outf, seed),
    );
    let name = format!(
        "{} tokens {tokens} {inf} -> {outf}, {ranks} rank(s), {grad_dtype:?} grads",
        std::any::type_name::<T>()
    );
    let e4m3 = Fp8Format::E4M3;
    let w = &runs[0].weight;
    let bias_t = rounded::<T>(&runs[0].bias);
    let mut dw_ref = vec![0.0; outf * inf];
    let mut dw_mag = vec![0.0; outf * inf];
    let mut db_ref = vec![0.0; outf];
    let mut db_mag = vec![0.0; outf];
    for (r, run) in runs.iter().enumerate() {
        assert_eq!(run.weight, *w, "{name}: rank {r} gathered another weight");
        assert_eq!(
            run.metas, 0,
            "{name}: a block-scaled layer declares no meta"
        );
        // Forward: x in 1x128 tiles against the weight as gathered; the bias as T holds it.
        let (xr, _) = tile_qdq(&run.x, [tokens, inf], [1, BLOCK_SIZE], e4m3);
        let (mut y, mut mag) = product(
            [tokens, outf, inf],
            |t, i| xr[t * inf + i],
            |o, i| w[o * inf + i] as f64,
        );
        for t in 0..tokens {
            for o in 0..outf {
                y[t * outf + o] += bias_t[o] as f64;
                mag[t * outf + o] += (bias_t[o] as f64).abs();
            }
        }
        let what = format!("{name}: rank {r} y");
        check(
            &what,
            &run.y,
            &y,
            &mag,
            gemm_rel(inf, 1),
            out_rel::<T>(),
            &[],
        );
        // The bound is tight enough to see the quantization: the unquantized x misses it.
        let (y_exact, _) = product(
            [tokens, outf, inf],
            |t, i| run.x[t * inf + i] as f64,
            |o, i| w[o * inf + i] as f64,
        );
        let y_exact: Vec<f64> = y_exact
            .iter()
            .enumerate()
            .map(|(i, v)| v + bias_t[i % outf] as f64)
            .collect();
        let (r_exact, _) = worst(
            &run.y,
            &y_exact,
            &mag,
            gemm_rel(inf, 1),
            out_rel::<T>(),
            &[],
        );
        assert!(
            r_exact > 1.0,
            "{name}: the bound cannot tell quantized x ({r_exact})"
        );
        // Data gradient: dy in 1x128 tiles (E4M3: the recipe's gradient format) times the weight.
        let (dyr, _) = tile_qdq(&run.dy, [tokens, outf], [1, BLOCK_SIZE], e4m3);
        let (dx, mag) = product(
            [tokens, inf, outf],
            |t, o| dyr[t * outf + o],
            |i, o| w[o * inf + i] as f64,
        );
        let what = format!("{name}: rank {r} dx");
        check(
            &what,
            &run.dx,
            &dx,
            &mag,
            gemm_rel(outf, 0),
            out_rel::<T>(),
            &[],
        );
        // Weight gradient: dy and x in 128x1 tiles (along the tokens).
        let (dyc, _) = tile_qdq(&run.dy, [tokens, outf], [BLOCK_SIZE, 1], e4m3);
        let (xc, _) = tile_qdq(&run.x, [tokens, inf], [BLOCK_SIZE, 1], e4m3);
        let (dw, mag) = product(
            [outf, inf, tokens],
            |o, t| dyc[t * outf + o],
            |i, t| xc[t * inf + i],
        );
        for (i, (v, m)) in dw.iter().zip(&mag).enumerate() {
            dw_ref[i] += v;
            dw_mag[i] += m;
        }
        for t in 0..tokens {
            for o in 0..outf {
                db_ref[o] += run.dy[t * outf + o] as f64;
                db_mag[o] += (run.dy[t * outf + o] as f64).abs();
            }
        }
    }
    let per_rank: Vec<_> = runs.iter().map(|r| r.grads.clone()).collect();
    let layout = &runs[0].layout;
    let dw = full_grad(layout, &per_rank, "weight");
    let db = full_grad(layout, &per_rank, "bias");
    // BF16 gradients: each rank's dW is rounded to BF16 by the GEMM (2^-8 of its magnitude) and the
    // shard rounds the f32 sum once more (2^-8 of the result).
    let (rel16, out16) = match grad_dtype {
        GradDtype::Bf16 => (2f64.powi(-8), 2f64.powi(-8)),
        GradDtype::F32 => (0.0, 0.0),
    };
    check(
        &format!("{name}: dW"),
        &dw,
        &dw_ref,
        &dw_mag,
        gemm_rel(tokens, ranks - 1) + rel16,
        out16,
        &[],
    );
    // db: the column sums of dy in f32 (any order: tokens - 1 additions), then the ranks' sum.
    check(
        &format!("{name}: db"),
        &db,
        &db_ref,
        &db_mag,
        (tokens + ranks) as f64 * U + rel16,
        out16,
        &[],
    );
}

#[test]
fn block_linear_matches_the_dequantized_reference() {
    for ranks in [1, 2] {
        // 40 tokens (padded to 48), a partial input tile (272 = 2 x 128 + 16), a partial weight block
        // row (144 = 128 + 16: on two ranks, 128 rows and 16).
        check_against_dequantized::<f32>(ranks, &[2, 20, 272], 144, GradDtype::F32);
        // BF16 activations; 150 tokens (two token tiles, the second partial, padded to 160); a weight
        // of one block row (on two ranks, the second holds none).
        check_against_dequantized::<bf16>(ranks, &[150, 128], 48, GradDtype::F32);
    }
    // dW written in BF16 for BF16 gradient shards.
    check_against_dequantized::<f32>(2, &[64, 256], 160, GradDtype::Bf16);
}

/// The quantization error bound of one element `v` cast with scale `s` to `format`: half a step,
/// `2^-(m+1) |v|` in the normal range, at most half the smallest subnormal step over `s` below it.
fn cast_error(v: f32, s: f32, format: Fp8Format) -> f64 {
    let rel = 2f64.powi(-(format.mantissa_bits() as i32 + 1));
    (rel * v.abs() as f64).max(format.min_subnormal() as f64 / 2.0 / s as f64)
}

/// Per-element cast error bounds of `x [rows, cols]` in tiles `tile` (scales from the reference cast).
fn cast_errors(x: &[f32], shape: [usize; 2], tile: [usize; 2], format: Fp8Format) -> Vec<f64> {
    let (_, scales) = tile_qdq(x, shape, tile, format);
    x.iter()
        .zip(&scales)
        .map(|(&v, &s)| cast_error(v, s, format))
        .collect()
}

/// The bound of `|sum_p â b̂ - sum_p a b|` from the operands' cast error bounds: `sum_p (ea |b| + |a| eb +
/// ea eb)`.
fn quantization_bound(
    [m, n, k]: [usize; 3],
    a: impl Fn(usize, usize) -> (f64, f64),
    b: impl Fn(usize, usize) -> (f64, f64),
) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let ((av, ae), (bv, be)) = (a(i, p), b(j, p));
                out[i * n + j] += ae * bv.abs() + av.abs() * be + ae * be;
            }
        }
    }
    out
}

#[test]
fn block_linear_is_within_the_e4m3_bound_of_the_f32_linear() {
    let (tokens, inf, outf) = (96, 384, 208);
    let seed = 5;
    let data = uniform_data(tokens, inf, outf, seed);
    let shape = [tokens, inf];
    let block = run::<f32>(
        1,
        &|| block_linear(inf, outf, seed),
        &shape,
        GradDtype::F32,
        &data,
    );
    let f32_layer = || {
        Linear::<f32>::new(inf, outf)?
            .with_precision(LinearPrecision::F32)
            .map(|l| l.with_seed(seed))
    };
    let full = run::<f32>(1, &f32_layer, &shape, GradDtype::F32, &data);
    let (b, f) = (&block[0], &full[0]);
    let w = &f.weight;
    assert_ne!(b.weight, *w, "the block-scaled weight is quantized");
    let e4m3 = Fp8Format::E4M3;
    let rows = [1, BLOCK_SIZE];
    let cols = [BLOCK_SIZE, 1];
    let ew = cast_errors(w, [outf, inf], [BLOCK_SIZE, BLOCK_SIZE], e4m3);
    let (exr, edyr) = (
        cast_errors(&f.x, [tokens, inf], rows, e4m3),
        cast_errors(&f.dy, [tokens, outf], rows, e4m3),
    );
    let (exc, edyc) = (
        cast_errors(&f.x, [tokens, inf], cols, e4m3),
        cast_errors(&f.dy, [tokens, outf], cols, e4m3),
    );
    let (x, dy) = (&f.x, &f.dy);
    let (xf, wf, dyf) = (
        |i: usize| x[i] as f64,
        |i: usize| w[i] as f64,
        |i: usize| dy[i] as f64,
    );
    // |block - F32 layer| <= quantization bound + both layers' f32 accumulation (relative to the sum of
    // |terms|, about the same for both: the quantized terms are within 2^-4 of the exact ones, so
    // 1.2 x covers the larger).
    let accumulate = |k: usize, more: usize| 1.2 * (gemm_rel(k, more) + (k + more) as f64 * U);
    let y_q = quantization_bound(
        [tokens, outf, inf],
        |t, i| (xf(t * inf + i), exr[t * inf + i]),
        |o, i| (wf(o * inf + i), ew[o * inf + i]),
    );
    let (_, y_mag) = product(
        [tokens, outf, inf],
        |t, i| xf(t * inf + i),
        |o, i| wf(o * inf + i),
    );
    let want: Vec<f64> = f.y.iter().map(|&v| v as f64).collect();
    check(
        "y vs F32",
        &b.y,
        &want,
        &y_mag,
        accumulate(inf, 1),
        0.0,
        &y_q,
    );
    let dx_q = quantization_bound(
        [tokens, inf, outf],
        |t, o| (dyf(t * outf + o), edyr[t * outf + o]),
        |i, o| (wf(o * inf + i), ew[o * inf + i]),
    );
    let (_, dx_mag) = product(
        [tokens, inf, outf],
        |t, o| dyf(t * outf + o),
        |i, o| wf(o * inf + i),
    );
    let want: Vec<f64> = f.dx.iter().map(|&v| v as f64).collect();
    check(
        "dx vs F32",
        &b.dx,
        &want,
        &dx_mag,
        accumulate(outf, 0),
        0.0,
        &dx_q,
    );
    let dw_q = quantization_bound(
        [outf, inf, tokens],
        |o, t| (dyf(t * outf + o), edyc[t * outf + o]),
        |i, t| (xf(t * inf + i), exc[t * inf + i]),
    );
    let (_, dw_mag) = product(
        [outf, inf, tokens],
        |o, t| dyf(t * outf + o),
        |i, t| xf(t * inf + i),
    );
    let (gb, gf) = ([b.grads.clone()], [f.grads.clone()]);
    let want: Vec<f64> = full_grad(&f.layout, &gf, "weight")
        .iter()
        .map(|&v| v as f64)
        .collect();
    let dw = full_grad(&b.layout, &gb, "weight");
    check(
        "dW vs F32",
        &dw,
        &want,
        &dw_mag,
        accumulate(tokens, 0),
        0.0,
        &dw_q,
    );
    // The bias gradient is the same float sum in both layers.
    assert_eq!(
        full_grad(&b.layout, &gb, "bias"),
        full_grad(&f.layout, &gf, "bias"),
        "db"
    );
}

#[test]
fn block_path_is_taken_and_differs_from_per_tensor() {
    let (tokens, inf, outf) = (64, 256, 128);
    let data = uniform_data(tokens, inf, outf, 9);
    let shape = [tokens, inf];
    let block = run::<bf16>(
        1,
        &|| block_linear(inf, outf, 3),
        &shape,
        GradDtype::F32,
        &data,
    );
    let per_tensor = || {
        Linear::<bf16>::new(inf, outf)?
            .with_precision(LinearPrecision::Fp8)
            .map(|l| l.with_seed(3))
    };
    let pt = run::<bf16>(1, &per_tensor, &shape, GradDtype::F32, &data);
    let (b, p) = (&block[0], &pt[0]);
    assert_eq!(b.x, p.x);
    assert_ne!(
        b.y, p.y,
        "the same seed's per-tensor layer gives other outputs"
    );
    assert_ne!(b.dx, p.dx);
    assert_eq!((b.metas, p.metas), (0, 2), "scaling metas");
    let kind = |r: &RankRun| r.layout.params[r.layout.param_index("weight").unwrap()].kind;
    assert_eq!(kind(b), ParamKind::Fp8BlockWeight);
    assert_eq!(kind(p), ParamKind::Fp8Weight);
    // Saved for the backward: x^T in E4M3 (one byte per element) and one f32 per 128 x 1 tile (the
    // scale columns padded to 4), not x itself.
    assert_eq!(b.saved_bytes, tokens * inf + 4 * inf.next_multiple_of(4));
}

#[test]
fn a_large_channel_costs_block_scaling_far_less_than_per_tensor() {
    // One input channel `factor` times larger than the others (an activation outlier), exactly
    // representable after any power-of-two scaling, so its own cast is exact in both recipes: what is
    // measured is what it does to the other channels. The errors are those of the outputs without the
    // channel's own term, and of the other channels' weight gradient, against the F32 layer: in F32
    // both are the same with and without the outlier, so each recipe's loss is its error with the
    // outlier over its error without (the channel at +-1). Per tensor with current scaling after a
    // warm-up pass over the same data: its fairest form (the scale is that of this very tensor).
    //
    // Power-of-two scales do not change how a normal value rounds, so the outlier costs only where it
    // pushes the other values below E4M3's normal range (2^-6 of the scaled amax 448 down to 2^-4 of
    // their own). At 1024x the others sit 2^10 below the amax: only values under 2^-4 of their maximum
    // go subnormal, where the absolute step equals the normal step just above; so per tensor loses
    // nothing measurable either (E4M3's range absorbs a 1000x channel). At 65536x the others are all
    // subnormal per tensor (steps of half their maximum); block-scaled, only the 1x128 tiles holding the
    // channel lose them in the forward (1 of 8 tiles per row here: about sqrt(8) less error), and the
    // weight gradient, cast in 128x1 tiles (one channel each), does not see the channel at all.
    let (tokens, inf, outf) = (128, 1024, 128);
    let channel = 77;
    let current = ScalingRecipe::Current {
        margin: 0,
        rounding: ScaleRounding::PowerOfTwo,
    };
    let per_tensor = Fp8Recipe {
        activations: current,
        gradients: current,
        ..Fp8Recipe::default()
    };
    let shape = [tokens, inf];
    let layer = |precision: LinearPrecision, recipe: Fp8Recipe| {
        move || {
            Linear::<f32>::new(inf, outf)?
                .with_precision(precision)?
                .with_fp8_recipe(&recipe)
                .map(|l| l.with_seed(11))
        }
    };
    // Relative errors (y others, dW others) of [block, per tensor].
    let errors = |factor: f32| -> [(f64, f64); 2] {
        let data = move |rank: u64| {
            let mut x = values(31 ^ rank, tokens * inf, 1.0);
            for t in 0..tokens {
                x[t * inf + channel] = if t % 2 == 0 { factor } else { -factor };
            }
            (x, values(32 ^ rank, tokens * outf, 0.01))
        };
        let go = |make: &(dyn Fn() -> Result<Linear<f32>, NnError> + Sync)| {
            run_after::<f32>(1, 1, make, &shape, GradDtype::F32, &data).remove(0)
        };
        let f = go(&layer(LinearPrecision::F32, Fp8Recipe::default()));
        let b = go(&layer(LinearPrecision::Fp8, recipe()));
        let p = go(&layer(LinearPrecision::Fp8, per_tensor));
        let others = |r: &RankRun| -> Vec<f32> {
            (0..tokens * outf)
                .map(|i| {
                    let (t, o) = (i / outf, i % outf);
                    r.y[i] - r.x[t * inf + channel] * r.weight[o * inf + channel]
                })
                .collect()
        };
        let dw_others = |r: &RankRun| -> Vec<f32> {
            full_grad(&r.layout, std::slice::from_ref(&r.grads), "weight")
                .into_iter()
                .enumerate()
                .filter(|(i, _)| i % inf != channel)
                .map(|(_, v)| v)
                .collect()
        };
        let (yf, gf) = (others(&f), dw_others(&f));
        [&b, &p].map(|r| (rel_diff(&others(r), &yf), rel_diff(&dw_others(r), &gf)))
    };
    let base = errors(1.0);
    let report = |factor: f32| {
        let e = errors(factor);
        println!(
            "channel x{factor}: y error block {:.2e} (x{:.2} of without), per tensor {:.2e} (x{:.2}); \
             dW error block {:.2e} (x{:.2}), per tensor {:.2e} (x{:.2})",
            e[0].0,
            e[0].0 / base[0].0,
            e[1].0,
            e[1].0 / base[1].0,
            e[0].1,
            e[0].1 / base[0].1,
            e[1].1,
            e[1].1 / base[1].1
        );
        // The block-scaled weight gradient of the other channels never sees the outlier.
        assert_eq!(e[0].1, base[0].1, "x{factor}: block dW");
        e
    };
    let e = report(1024.0);
    for (what, with, without) in [
        ("block y", e[0].0, base[0].0),
        ("per-tensor y", e[1].0, base[1].0),
        ("per-tensor dW", e[1].1, base[1].1),
    ] {
        assert!(
            with < 1.05 * without,
            "x1024: {what}: {with:.3e} against {without:.3e}"
        );
    }
    let e = report(65536.0);
    assert!(
        e[1].0 > 2.0 * e[0].0,
        "x65536: y: per tensor {:.2e}, block {:.2e}",
        e[1].0,
        e[0].0
    );
    assert!(e[1].0 > 5.0 * base[1].0, "x65536: per tensor y lost little");
    assert!(
        e[1].1 > 3.0 * base[1].1,
        "x65536: per tensor dW lost little: {:.2e}",
        e[1].1
    );
}

#[test]
fn evaluation_keeps_nothing_and_the_weight_gradient_needs_no_dx() {
    let (tokens, inf, outf) = (24, 128, 64);
    let runs = on_ranks(1, |comm| {
        let mut model = FsdpModel::new(
            block_linear::<f32>(inf, outf, 4)?,
            comm,
            WrapPolicy::Single,
            FsdpConfig::default(),
        )?;
        let dev = model.device().clone();
        let x = values(1, tokens * inf, 1.0);
        let dy = values(2, tokens * outf, 1.0);
        let shape = Shape::matrix(tokens, inf)?;
        let input = || -> TestResult<Tensor<f32>> { Ok(Tensor::new(dev.upload(&x)?, shape)?) };
        let xe = input()?;
        let eval = model.forward(Mode::Eval, |lin, ctx| lin.forward(ctx, xe))?;
        assert_eq!(model.module().saved_bytes(), 0, "evaluation keeps nothing");
        let mut grads = Vec::new();
        let mut train = Vec::new();
        for need_dx in [true, false] {
            model.sharded_mut().zero_grads()?;
            let xt = input()?;
            train.push(
                model
                    .forward(Mode::Train, |lin, ctx| lin.forward(ctx, xt))?
                    .data()
                    .to_vec()?,
            );
            let saved = model.module().block_saved().ok_or("nothing saved")?;
            assert_eq!((saved.tokens, saved.padded_tokens), (24, 32));
            assert_eq!(saved.x_t.len(), inf * 32);
            let dyt = Tensor::new(dev.upload(&dy)?, Shape::matrix(tokens, outf)?)?;
            let dx = model.backward(|lin, ctx| lin.backward_step(ctx, dyt, need_dx))?;
            assert_eq!(dx.is_some(), need_dx);
            assert!(
                model.module().block_saved().is_none(),
                "the backward spends what was saved"
            );
            grads.push(grad_shards(model.sharded())?);
        }
        // A second backward has nothing to read.
        let dyt = Tensor::new(dev.upload(&dy)?, Shape::matrix(tokens, outf)?)?;
        let again = model.backward(|lin, ctx| lin.backward_step(ctx, dyt, true));
        assert!(again.is_err(), "a backward without its forward is refused");
        Ok((eval.data().to_vec()?, train, grads))
    });
    let (eval, train, grads) = &runs[0];
    assert_eq!(
        common::bits(eval),
        common::bits(&train[0]),
        "evaluation equals training"
    );
    assert_eq!(common::bits(&train[0]), common::bits(&train[1]));
    assert_eq!(grads[0], grads[1], "dW and db do not depend on need_dx");
}

#[test]
fn convert_to_fp8_makes_block_linears_where_the_gemm_can_take_them() {
    // fc2 has 10 outputs (no multiple of 16): it stays in float precision.
    let net = || -> Result<Sequential, NnError> {
        Ok(Sequential::new()
            .push("fc1", Linear::new(256, 128)?.with_seed(1))
            .push("relu", Relu::new())
            .push("fc2", Linear::new(128, 10)?.with_seed(2)))
    };
    let mut a = net().unwrap();
    assert_eq!(
        convert_to_fp8(&mut a, &Fp8Filter::All, &recipe()).unwrap(),
        ["fc1"]
    );
    let p: Vec<_> = fsdp_nn::linear_precisions(&mut a)
        .unwrap()
        .into_iter()
        .map(|(n, _, _, p)| (n, p))
        .collect();
    assert_eq!(
        p,
        [
            ("fc1".to_string(), LinearPrecision::Fp8),
            ("fc2".to_string(), LinearPrecision::F32)
        ]
    );
    // The Auto filter's rule applies as per tensor: only the large linears are candidates.
    let mut big = Sequential::<bf16>::new()
        .push("up", Linear::new(4096, 16384).unwrap())
        .push("odd", Linear::new(16384, 4100).unwrap())
        .push("small", Linear::new(64, 64).unwrap());
    assert_eq!(
        convert_to_fp8(&mut big, &Fp8Filter::auto(), &recipe()).unwrap(),
        ["up"]
    );
    // A recipe that block-scales only some operands is refused.
    let partial = Fp8Recipe {
        blocks: fp8_core::BlockRecipe {
            weights: fp8_core::ScalingGranularity::Block128x128,
            ..fp8_core::BlockRecipe::per_tensor()
        },
        ..Fp8Recipe::default()
    };
    partial.validate().unwrap();
    let e = convert_to_fp8(&mut net().unwrap(), &Fp8Filter::All, &partial).unwrap_err();
    assert!(e.to_string().contains("block-scaled throughout"), "{e}");
    // A linear already in FP8 that cannot be block-scaled is an error, not silently per tensor.
    let mut fixed = Sequential::<f32>::new().push(
        "head",
        Linear::new(128, 10)
            .unwrap()
            .with_precision(LinearPrecision::Fp8)
            .unwrap(),
    );
    let e = convert_to_fp8(&mut fixed, &Fp8Filter::None, &recipe()).unwrap_err();
    assert!(e.to_string().contains("head"), "{e}");
    // The converted model trains a step on two ranks: a block-scaled weight beside plain parameters,
    // no scaling meta.
    let losses = on_ranks(2, |comm| {
        let mut net = net()?;
        convert_to_fp8(&mut net, &Fp8Filter::All, &recipe())?;
        let mut model = FsdpModel::new(net, comm, WrapPolicy::PerModule, FsdpConfig::default())?;
        assert_eq!(model.scaling().len(), 0);
        let kinds: Vec<ParamKind> = model.layout().params.iter().map(|p| p.kind).collect();
        assert_eq!(
            kinds,
            [
                ParamKind::Fp8BlockWeight,
                ParamKind::Plain,
                ParamKind::Plain,
                ParamKind::Plain
            ]
        );
        let dev = model.device().clone();
        let x = Tensor::new(
            dev.upload(&values(3, 32 * 256, 1.0))?,
            Shape::matrix(32, 256)?,
        )?;
        let y = model.forward(Mode::Train, |n, ctx| n.forward(ctx, x))?;
        let dy = Tensor::new(dev.upload(&values(4, 32 * 10, 1.0))?, y.shape())?;
        model.backward(|n, ctx| n.backward_params(ctx, dy))?;
        Ok(y.data().to_vec()?)
    });
    assert_eq!(losses[0], losses[1]);
}

#[test]
fn block_linear_shape_and_usage_errors() {
    // Sides that are not multiples of 16, made block-scaled by hand: refused when wrapped, naming it.
    let net = Sequential::<f32>::new().push(
        "fc",
        Linear::new(100, 64)
            .and_then(|l| l.with_precision(LinearPrecision::Fp8))
            .and_then(|l| l.with_fp8_recipe(&recipe()))
            .unwrap(),
    );
    let comm: Arc<dyn fsdp_comm::Communicator> = Arc::new(
        fsdp_comm::ThreadGroup::new(1, fsdp_comm::DEFAULT_THREAD_TIMEOUT)
            .unwrap()
            .remove(0),
    );
    let e = FsdpModel::new(net, comm.clone(), WrapPolicy::Single, FsdpConfig::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("fc") && e.contains("multiples of 16"), "{e}");
    let mut model = FsdpModel::new(
        block_linear::<f32>(64, 32, 1).unwrap(),
        comm,
        WrapPolicy::Single,
        FsdpConfig::default(),
    )
    .unwrap();
    let lin = model.module_mut();
    assert!(lin.is_block_scaled() && !lin.takes_fp8_codes());
    assert_eq!(lin.weight_kind(), ParamKind::Fp8BlockWeight);
    // Per-tensor codes are not taken.
    let e = lin.fp8_input(&fp8_kernels::Device::cpu(), 16).unwrap_err();
    assert!(e.to_string().contains("block-scaled"), "{e}");
    // Block or per-tensor scaling is fixed once wrapped.
    assert!(lin.set_fp8_recipe(&Fp8Recipe::default()).is_err());
    lin.set_fp8_recipe(&Fp8Recipe::block_scaled(ScaleRounding::Exact))
        .unwrap();
}

/// A norm feeding a linear through `Norm::forward_linear`, as attention and the MLP use it.
struct NormLinear {
    norm: Norm<bf16>,
    linear: Linear<bf16>,
    x: Option<Tensor<bf16>>,
}

impl Module for NormLinear {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        v.child("norm", &mut self.norm)?;
        v.child("linear", &mut self.linear)
    }
}

impl Layer<bf16> for NormLinear {
    fn forward(&mut self, ctx: &mut Ctx<'_>, x: Tensor<bf16>) -> Result<Tensor<bf16>, NnError> {
        let y = self.norm.forward_linear(ctx, &x, &mut self.linear)?;
        self.x = Some(x);
        Ok(y)
    }

    fn backward_step(
        &mut self,
        ctx: &mut Ctx<'_>,
        dy: Tensor<bf16>,
        need_dx: bool,
    ) -> fsdp_nn::InputGrad<bf16> {
        let dh = self
            .linear
            .backward_ref(ctx, &dy, true)?
            .ok_or_else(|| NnError::usage("NormLinear", "no dh"))?;
        let x = self
            .x
            .take()
            .ok_or_else(|| NnError::usage("NormLinear", "no x"))?;
        let dx = self.norm.backward_ref(ctx, &x, &dh, None)?;
        Ok(dx.filter(|_| need_dx))
    }
}

/// A layer built with its producer fusion on and off, converted with the block recipe (every linear),
/// gives the same bits: training and evaluation outputs, input gradient, parameter gradients (the fused
/// producers hand a block-scaled linear their float output, which is what the unfused path does).
fn fusion_changes_nothing<L: Layer<bf16> + 'static>(
    what: &str,
    make: impl Fn(bool) -> Result<L, NnError> + Sync,
    in_shape: &[usize],
    out_last: usize,
) {
    let results = on_ranks(1, |comm| {
        let mut out = Vec::new();
        for fused in [true, false] {
            let mut layer = make(fused)?;
            let converted = convert_to_fp8(&mut layer, &Fp8Filter::All, &recipe())?;
            assert!(!converted.is_empty(), "{what}: nothing converted");
            let mut model = FsdpModel::new(
                layer,
                comm.clone(),
                WrapPolicy::Single,
                FsdpConfig::default(),
            )?;
            assert_eq!(model.scaling().len(), 0, "{what}: no meta");
            let dev = model.device().clone();
            let n: usize = in_shape.iter().product();
            let shape = Shape::new(in_shape)?;
            let input = || -> TestResult<Tensor<bf16>> {
                Ok(Tensor::new(
                    dev.upload(&to_t::<bf16>(&values(5, n, 2.0)))?,
                    shape,
                )?)
            };
            let xt = input()?;
            let y = model.forward(Mode::Train, |l, ctx| l.forward(ctx, xt))?;
            let m = y.shape().numel();
            assert_eq!(y.shape().last(), out_last);
            let dy = Tensor::new(dev.upload(&to_t::<bf16>(&values(6, m, 1.0)))?, y.shape())?;
            let dx = model.backward(|l, ctx| l.backward(ctx, dy))?;
            let grads = grad_shards(model.sharded())?;
            let xe = input()?;
            let eval = model.forward(Mode::Eval, |l, ctx| l.forward(ctx, xe))?;
            let bits = |t: &Tensor<bf16>| -> TestResult<Vec<u16>> {
                Ok(t.data().to_vec()?.iter().map(|v| v.to_bits()).collect())
            };
            out.push((bits(&y)?, bits(&dx)?, grads, bits(&eval)?));
        }
        Ok(out)
    });
    let (a, b) = (&results[0][0], &results[0][1]);
    assert_eq!(a.0, b.0, "{what}: output");
    assert_eq!(a.1, b.1, "{what}: input gradient");
    assert_eq!(a.2, b.2, "{what}: parameter gradients");
    assert_eq!(a.3, b.3, "{what}: evaluation output");
    assert_eq!(a.0, a.3, "{what}: evaluation equals training");
}

#[test]
fn fused_producers_feed_block_linears_their_float_output() {
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        fusion_changes_nothing(
            &format!("{kind:?} + linear"),
            |fused| {
                Ok(NormLinear {
                    norm: Norm::of_kind(kind, 48)?.fused_fp8(fused),
                    linear: Linear::new(48, 32)?.with_seed(3),
                    x: None,
                })
            },
            &[3, 8, 48],
            32,
        );
    }
    // 40 tokens (padded to 48: the activation is written, then cast) and 32 (the activation and its
    // gradient computed inside the block casts, never written), recompute on and off.
    for activation in [MlpActivation::Gelu, MlpActivation::SwiGlu] {
        for (shape, recompute) in [
            ([2, 20, 32], true),
            ([2, 16, 32], true),
            ([2, 16, 32], false),
        ] {
            fusion_changes_nothing(
                &format!("{activation:?} MLP {shape:?} recompute {recompute}"),
                |fused| {
                    Ok(Mlp::<bf16>::with_activation(32, 64, activation)?
                        .with_seed(7)
                        .recompute_gelu(recompute)
                        .fused(fused))
                },
                &shape,
                32,
            );
        }
    }
    fusion_changes_nothing(
        "GPT-2 block",
        |fused| {
            fsdp_nn::TransformerBlock::<bf16>::new(&fsdp_nn::BlockConfig {
                seed: Some(2),
                fuse_norm_fp8: fused,
                ..fsdp_nn::BlockConfig::gpt2(64, 2, 2)
            })
        },
        &[2, 24, 64],
        64,
    );
}

#[test]
fn block_mlp_recomputes_the_down_input_with_the_same_bits_and_keeps_less() {
    for activation in [MlpActivation::Gelu, MlpActivation::SwiGlu] {
        // `fusion_changes_nothing` compares the two builds; here the flag is the recompute.
        fusion_changes_nothing(
            &format!("{activation:?} MLP, recompute on and off"),
            |recompute| {
                Ok(Mlp::<bf16>::with_activation(32, 160, activation)?
                    .with_seed(7)
                    .recompute_gelu(recompute))
            },
            &[2, 20, 32],
            32,
        );
        // What the down linear keeps between the passes: nothing with the recompute, its 128x1-tile
        // cast of the hidden activation (one byte per element and a scale per tile) without.
        let kept = on_ranks(1, |comm| {
            let mut out = Vec::new();
            for recompute in [true, false] {
                let mut mlp = Mlp::<bf16>::with_activation(32, 160, activation)?
                    .with_seed(7)
                    .recompute_gelu(recompute);
                convert_to_fp8(&mut mlp, &Fp8Filter::All, &recipe())?;
                let mut model =
                    FsdpModel::new(mlp, comm.clone(), WrapPolicy::Single, FsdpConfig::default())?;
                let dev = model.device().clone();
                let x = Tensor::new(
                    dev.upload(&to_t::<bf16>(&values(5, 40 * 32, 2.0)))?,
                    Shape::new(&[2, 20, 32])?,
                )?;
                model.forward(Mode::Train, |l, ctx| l.forward(ctx, x))?;
                out.push(model.module().down().saved_bytes());
            }
            Ok(out)
        });
        assert_eq!(kept[0][0], 0, "{activation:?}: kept with the recompute");
        // The codes of x^T, 160 hidden x 48 rows (40 padded to a multiple of 16), and one f32 scale
        // per 1x128 tile of them: 160 tiles.
        assert_eq!(
            kept[0][1],
            160 * 48 + 160 * 4,
            "{activation:?}: kept without"
        );
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(12))]

    /// Random shapes (tokens any, features multiples of 16 with and without partial 128 blocks), one
    /// or two ranks, f32 or BF16 activations, against the dequantized reference.
    #[test]
    fn block_linear_random_shapes(
        tokens in 1usize..300,
        inf in 1usize..21,
        outf in 1usize..21,
        ranks in 1usize..3,
        bf16_acts in proptest::bool::ANY,
    ) {
        let shape = [tokens, 16 * inf];
        if bf16_acts {
            check_against_dequantized::<bf16>(ranks, &shape, 16 * outf, GradDtype::F32);
        } else {
            check_against_dequantized::<f32>(ranks, &shape, 16 * outf, GradDtype::F32);
        }
    }
}
