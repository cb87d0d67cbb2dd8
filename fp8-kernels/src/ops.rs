//! Layer operations of the example networks (MNIST CNN, MLP stack), each on the CPU (rayon) and CUDA:
//! bias add and its gradient, ReLU and GELU forward/backward, log-softmax + NLL forward/backward,
//! im2col/col2im, batched transpose, max-pool forward/backward, dropout with a counter-based generator,
//! sums over rows/columns, scale, axpy and add.
//!
//! Every function writes into a caller-provided output (buffers are reused across steps) and runs where
//! its buffers live; on CUDA nothing goes through the host. Elementwise functions compute in f32 with one
//! rounding per arithmetic operation on both devices, so CPU and CUDA agree bit for bit except where a
//! transcendental (`exp`, `log`, `tanh`) is involved. Reductions use summation orders that the CPU
//! reproduces exactly (see each function).

use crate::cast::{cuda_of, same_device, FloatElement};
use crate::device::{cuda_slice as cs, cuda_slice_mut as cs_mut};
use crate::kernel_source::{function, grid_1d, sm_count, OPS_MODULE};
use crate::rng::SplitMix64;
use crate::{check_len, Buffer, CudaDevice, KernelError};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use rayon::prelude::*;

/// Elements per rayon task of the CPU paths.
const CPU_CHUNK: usize = 1 << 14;
/// Below this many elements the CPU paths stay on the calling thread.
const CPU_PAR_THRESHOLD: usize = 1 << 15;
/// Blocks per SM of the grid-stride kernels.
const BLOCKS_PER_SM: u32 = 8;

fn cfg_for(dev: &CudaDevice, threads: u64) -> Result<LaunchConfig, KernelError> {
    Ok(grid_1d(sm_count(dev)?, threads, BLOCKS_PER_SM))
}

fn mul_checked(what: &'static str, a: usize, b: usize) -> Result<usize, KernelError> {
    a.checked_mul(b).ok_or(KernelError::InvalidArgument {
        what,
        detail: format!("{a} x {b} elements overflow"),
    })
}

/// Applies `f` to aligned chunks of two slices, in parallel when they are large.
fn zip_chunks<A: Sync, B: Send>(a: &[A], b: &mut [B], f: impl Fn(&[A], &mut [B]) + Sync + Send) {
    if a.len() < CPU_PAR_THRESHOLD {
        f(a, b);
    } else {
        a.par_chunks(CPU_CHUNK)
            .zip(b.par_chunks_mut(CPU_CHUNK))
            .for_each(|(x, y)| f(x, y));
    }
}

/// Elementwise `out[i] = f(a[i], b[i])` in f32, stored as `T`.
fn cpu_map2<T: FloatElement>(
    a: &[T],
    b: &[T],
    out: &mut [T],
    f: impl Fn(f32, f32) -> f32 + Sync + Send,
) {
    let run = |(i0, o): (usize, &mut [T])| {
        for (k, y) in o.iter_mut().enumerate() {
            *y = T::from_f32(f(a[i0 + k].to_f32(), b[i0 + k].to_f32()));
        }
    };
    if out.len() < CPU_PAR_THRESHOLD {
        run((0, out));
    } else {
        out.par_chunks_mut(CPU_CHUNK)
            .enumerate()
            .for_each(|(c, o)| run((c * CPU_CHUNK, o)));
    }
}

/// `x[r, c] += bias[c]` for a row-major `[rows, cols]` tensor.
pub fn bias_add<T: FloatElement>(
    x: &mut Buffer<T>,
    bias: &Buffer<T>,
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    const WHAT: &str = "bias_add";
    check_len(WHAT, mul_checked(WHAT, rows, cols)?, x.len())?;
    check_len(WHAT, cols, bias.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, bias)?;
    match dev {
        None => {
            let b = bias.host(WHAT)?;
            let xs = x.host_mut(WHAT)?;
            if cols == 0 {
                return Ok(());
            }
            let run = |chunk: &mut [T]| {
                for row in chunk.chunks_exact_mut(cols) {
                    for (v, &bb) in row.iter_mut().zip(b) {
                        *v = T::from_f32(v.to_f32() + bb.to_f32());
                    }
                }
            };
            let rows_per_task = (CPU_CHUNK / cols).max(1);
            if xs.len() < CPU_PAR_THRESHOLD {
                run(xs);
            } else {
                xs.par_chunks_mut(rows_per_task * cols).for_each(run);
            }
            Ok(())
        }
        Some(dev) => {
            let f = function(&dev, &OPS_MODULE, &format!("bias_add_{}", T::NAME))?;
            let cfg = cfg_for(&dev, (rows * cols) as u64)?;
            let (r, c) = (rows as u64, cols as u64);
            let bs = cs(bias, WHAT)?;
            let xs = cs_mut(x, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(bs).arg(&r).arg(&c);
            // SAFETY: `bias_add_<T>(T*, const T*, u64, u64)`; x holds rows*cols elements, bias cols.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// Rows per chunk of [`sum_over_rows`]: at least 64, about `sqrt(rows)` for tall inputs, so both levels
/// of the sum are short.
pub fn sum_rows_chunk(rows: usize) -> usize {
    let mut r = (rows as f64).sqrt() as usize;
    while r * r < rows {
        r += 1;
    }
    r.max(64)
}

/// Column sums of a row-major `[rows, cols]` tensor: `out[c] = sum_r x[r, c]`, identical on both devices.
/// This is the bias gradient. The order is fixed in two levels: rows are cut into chunks of
/// [`sum_rows_chunk`]`(rows)` rows, each chunk summed in row order from zero, then the chunk sums are
/// added in chunk order starting from the first (one chunk, i.e. up to 64 rows: plain row order).
pub fn sum_over_rows<T: FloatElement>(
    x: &Buffer<T>,
    rows: usize,
    cols: usize,
    out: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "sum_over_rows";
    check_len(WHAT, mul_checked(WHAT, rows, cols)?, x.len())?;
    check_len(WHAT, cols, out.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, out)?;
    let chunk = sum_rows_chunk(rows);
    let chunks = rows.div_ceil(chunk).max(1);
    match dev {
        None => {
            let xs = x.host(WHAT)?;
            let o = out.host_mut(WHAT)?;
            // Tasks own column bands; within a band, contiguous row reads in the device's order.
            let band = 256usize;
            let run = |(bi, ob): (usize, &mut [f32])| {
                let c0 = bi * band;
                let mut part = vec![0.0f32; ob.len()];
                for k in 0..chunks {
                    part.fill(0.0);
                    for r in k * chunk..((k + 1) * chunk).min(rows) {
                        let row = &xs[r * cols + c0..r * cols + c0 + ob.len()];
                        for (s, &v) in part.iter_mut().zip(row) {
                            *s += v.to_f32();
                        }
                    }
                    if k == 0 {
                        ob.copy_from_slice(&part);
                    } else {
                        for (s, p) in ob.iter_mut().zip(&part) {
                            *s += *p;
                        }
                    }
                }
            };
            if xs.len() < CPU_PAR_THRESHOLD {
                o.chunks_mut(band).enumerate().for_each(run);
            } else {
                o.par_chunks_mut(band).enumerate().for_each(run);
            }
            Ok(())
        }
        Some(dev) => {
            let f = function(&dev, &OPS_MODULE, &format!("sum_rows_{}", T::NAME))?;
            let cfg = cfg_for(&dev, (chunks * cols) as u64)?;
            let (r, c, ch) = (rows as u64, cols as u64, chunk as u64);
            let xs = cs(x, WHAT)?;
            if chunks == 1 {
                let os = cs_mut(out, WHAT)?;
                let mut b = dev.stream().launch_builder(&f);
                b.arg(xs).arg(os).arg(&r).arg(&c).arg(&ch);
                // SAFETY: `sum_rows_<T>(const T*, float*, u64, u64, u64)`; x holds rows*cols elements and
                // out cols, the one chunk's sums.
                unsafe { b.launch(cfg) }?;
                return Ok(());
            }
            // SAFETY: every element is written by `sum_rows_<T>` below before `sum_partials_f32` reads it.
            let mut partial = unsafe { dev.stream().alloc::<f32>(chunks * cols) }?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(&mut partial).arg(&r).arg(&c).arg(&ch);
            // SAFETY: as above; partial holds chunks*cols elements.
            unsafe { b.launch(cfg) }?;
            let g = function(&dev, &OPS_MODULE, "sum_partials_f32")?;
            let cfg = cfg_for(&dev, cols as u64)?;
            let k = chunks as u64;
            let os = cs_mut(out, WHAT)?;
            let mut b = dev.stream().launch_builder(&g);
            b.arg(&partial).arg(os).arg(&k).arg(&c);
            // SAFETY: `sum_partials_f32(const float*, float*, u64, u64)`; partial holds chunks*cols
            // elements, out cols.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// The bias gradient of [`bias_add`]: `db[c] = sum_r dy[r, c]` (same as [`sum_over_rows`]).
pub fn bias_grad<T: FloatElement>(
    dy: &Buffer<T>,
    rows: usize,
    cols: usize,
    db: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    sum_over_rows(dy, rows, cols, db)
}

/// The summation order of a warp reduction: 32 lane-strided partial sums, then a butterfly (xor 16, 8,
/// 4, 2, 1). The CPU uses it so row sums match the GPU bit for bit.
pub fn warp_order_sum(values: impl Iterator<Item = f32>) -> f32 {
    let mut p = [0.0f32; 32];
    for (i, v) in values.enumerate() {
        p[i & 31] += v;
    }
    let mut off = 16;
    while off > 0 {
        let prev = p;
        for (l, v) in p.iter_mut().enumerate() {
            *v = prev[l] + prev[l ^ off];
        }
        off >>= 1;
    }
    p[0]
}

/// Row sums of a row-major `[rows, cols]` tensor: `out[r] = sum_c x[r, c]`, in the warp order of
/// [`warp_order_sum`] (identical on both devices).
pub fn sum_over_cols<T: FloatElement>(
    x: &Buffer<T>,
    rows: usize,
    cols: usize,
    out: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "sum_over_cols";
    check_len(WHAT, mul_checked(WHAT, rows, cols)?, x.len())?;
    check_len(WHAT, rows, out.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, out)?;
    match dev {
        None => {
            let xs = x.host(WHAT)?;
            let o = out.host_mut(WHAT)?;
            let run = |(r, s): (usize, &mut f32)| {
                *s = warp_order_sum(xs[r * cols..(r + 1) * cols].iter().map(|v| v.to_f32()));
            };
            if xs.len() < CPU_PAR_THRESHOLD {
                o.iter_mut().enumerate().for_each(run);
            } else {
                o.par_iter_mut().enumerate().for_each(run);
            }
            Ok(())
        }
        Some(dev) => {
            let f = function(&dev, &OPS_MODULE, &format!("sum_cols_{}", T::NAME))?;
            let cfg = cfg_for(&dev, rows as u64 * 32)?;
            let (r, c) = (rows as u64, cols as u64);
            let xs = cs(x, WHAT)?;
            let os = cs_mut(out, WHAT)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(os).arg(&r).arg(&c);
            // SAFETY: `sum_cols_<T>(const T*, float*, u64, u64)`; x holds rows*cols, out rows elements.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// Launches a typed elementwise kernel `name_<T>` over `n` elements with the arguments pushed by `push`.
macro_rules! launch_elementwise {
    ($dev:expr, $name:expr, $n:expr, |$b:ident| $push:block) => {{
        let f = function($dev, &OPS_MODULE, AsRef::<str>::as_ref(&$name))?;
        let cfg = cfg_for($dev, $n as u64)?;
        let mut $b = $dev.stream().launch_builder(&f);
        $push
        // SAFETY: each caller pushes exactly the arguments of the kernel it names (documented at the
        // kernel in ops.cu), with buffers of the checked lengths.
        unsafe { $b.launch(cfg) }?;
        Ok(())
    }};
}

/// ReLU: `y = max(x, 0)` (NaN propagates, like PyTorch).
pub fn relu_forward<T: FloatElement>(x: &Buffer<T>, y: &mut Buffer<T>) -> Result<(), KernelError> {
    const WHAT: &str = "relu_forward";
    check_len(WHAT, x.len(), y.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, y)?;
    match dev {
        None => {
            zip_chunks(x.host(WHAT)?, y.host_mut(WHAT)?, |a, o| {
                for (d, &s) in o.iter_mut().zip(a) {
                    let v = s.to_f32();
                    *d = T::from_f32(if v > 0.0 || v.is_nan() { v } else { 0.0 });
                }
            });
            Ok(())
        }
        Some(dev) => {
            let n = x.len() as u64;
            let (xs, ys) = (cs(x, WHAT)?, cs_mut(y, WHAT)?);
            launch_elementwise!(&dev, format!("relu_fwd_{}", T::NAME), n, |b| {
                b.arg(xs).arg(ys).arg(&n);
            })
        }
    }
}

/// ReLU backward: `dx = dy` where `x > 0`, else 0 (`x` is the forward input, or its output).
pub fn relu_backward<T: FloatElement>(
    x: &Buffer<T>,
    dy: &Buffer<T>,
    dx: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "relu_backward";
    check_len(WHAT, x.len(), dy.len())?;
    check_len(WHAT, x.len(), dx.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, dy)?;
    same_device(WHAT, &dev, dx)?;
    match dev {
        None => {
            cpu_map2(x.host(WHAT)?, dy.host(WHAT)?, dx.host_mut(WHAT)?, |v, g| {
                if v > 0.0 {
                    g
                } else {
                    0.0
                }
            });
            Ok(())
        }
        Some(dev) => {
            let n = x.len() as u64;
            let (xs, gs, ds) = (cs(x, WHAT)?, cs(dy, WHAT)?, cs_mut(dx, WHAT)?);
            launch_elementwise!(&dev, format!("relu_bwd_{}", T::NAME), n, |b| {
                b.arg(xs).arg(gs).arg(ds).arg(&n);
            })
        }
    }
}

/// Which GELU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GeluApprox {
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, PyTorch's `approximate='tanh'`.
    #[default]
    Tanh,
    /// `0.5 x (1 + erf(x / sqrt 2))` with erf from a Chebyshev fit of relative error below 1.2e-7
    /// (PyTorch's default GELU to f32 accuracy).
    Erf,
}

// The same literals as ops.cu, so both round to the same f32 constants (hence the long digits).
#[allow(clippy::excessive_precision)]
const GELU_K0: f32 = 0.7978845608028654; // sqrt(2/pi)
const GELU_K1: f32 = 0.044715;
#[allow(clippy::excessive_precision)]
const INV_SQRT2: f32 = std::f32::consts::FRAC_1_SQRT_2; // rounds to the same f32 as ops.cu's literal
#[allow(clippy::excessive_precision)]
const INV_SQRT_2PI: f32 = 0.3989422804014327;

/// erf from the Chebyshev erfc fit of Numerical Recipes (fractional error below 1.2e-7), written exactly
/// as the CUDA kernels compute it.
#[allow(clippy::excessive_precision)] // literals kept identical to ops.cu
pub fn erf_approx(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut p = 0.17087277f32;
    for c in [
        -0.82215223f32,
        1.48851587,
        -1.13520398,
        0.27886807,
        -0.18628806,
        0.09678418,
        0.37409196,
        1.00002368,
        -1.26551223,
    ] {
        p = t * p + c;
    }
    let ans = t * (-(z * z) + p).exp();
    if x >= 0.0 {
        1.0 - ans
    } else {
        ans - 1.0
    }
}

/// GELU of one value (the CPU reference of the kernels).
pub fn gelu_scalar(v: f32, approx: GeluApprox) -> f32 {
    match approx {
        GeluApprox::Erf => 0.5 * v * (1.0 + erf_approx(v * INV_SQRT2)),
        GeluApprox::Tanh => {
            let u = GELU_K0 * (v + GELU_K1 * (v * v * v));
            0.5 * v * (1.0 + u.tanh())
        }
    }
}

/// d GELU / dx at one value.
pub fn gelu_grad_scalar(v: f32, approx: GeluApprox) -> f32 {
    match approx {
        GeluApprox::Erf => {
            let cdf = 0.5 * (1.0 + erf_approx(v * INV_SQRT2));
            let pdf = INV_SQRT_2PI * (-0.5 * (v * v)).exp();
            cdf + v * pdf
        }
        GeluApprox::Tanh => {
            let v2 = v * v;
            let u = GELU_K0 * (v + GELU_K1 * (v2 * v));
            let t = u.tanh();
            let du = GELU_K0 * (1.0 + (3.0 * GELU_K1) * v2);
            0.5 * (1.0 + t) + (0.5 * v * (1.0 - t * t)) * du
        }
    }
}

/// GELU forward: `y = gelu(x)`.
pub fn gelu_forward<T: FloatElement>(
    x: &Buffer<T>,
    y: &mut Buffer<T>,
    approx: GeluApprox,
) -> Result<(), KernelError> {
    const WHAT: &str = "gelu_forward";
    check_len(WHAT, x.len(), y.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, y)?;
    match dev {
        None => {
            zip_chunks(x.host(WHAT)?, y.host_mut(WHAT)?, |a, o| {
                for (d, &s) in o.iter_mut().zip(a) {
                    *d = T::from_f32(gelu_scalar(s.to_f32(), approx));
                }
            });
            Ok(())
        }
        Some(dev) => {
            let n = x.len() as u64;
            let exact = (approx == GeluApprox::Erf) as i32;
            let (xs, ys) = (cs(x, WHAT)?, cs_mut(y, WHAT)?);
            launch_elementwise!(&dev, format!("gelu_fwd_{}", T::NAME), n, |b| {
                b.arg(xs).arg(ys).arg(&n).arg(&exact);
            })
        }
    }
}

/// GELU backward: `dx = gelu'(x) * dy`.
pub fn gelu_backward<T: FloatElement>(
    x: &Buffer<T>,
    dy: &Buffer<T>,
    dx: &mut Buffer<T>,
    approx: GeluApprox,
) -> Result<(), KernelError> {
    const WHAT: &str = "gelu_backward";
    check_len(WHAT, x.len(), dy.len())?;
    check_len(WHAT, x.len(), dx.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, dy)?;
    same_device(WHAT, &dev, dx)?;
    match dev {
        None => {
            cpu_map2(x.host(WHAT)?, dy.host(WHAT)?, dx.host_mut(WHAT)?, |v, g| {
                gelu_grad_scalar(v, approx) * g
            });
            Ok(())
        }
        Some(dev) => {
            let n = x.len() as u64;
            let exact = (approx == GeluApprox::Erf) as i32;
            let (xs, gs, ds) = (cs(x, WHAT)?, cs(dy, WHAT)?, cs_mut(dx, WHAT)?);
            launch_elementwise!(&dev, format!("gelu_bwd_{}", T::NAME), n, |b| {
                b.arg(xs).arg(gs).arg(ds).arg(&n).arg(&exact);
            })
        }
    }
}

/// Dropout settings: drop probability and the generator's seed and counter offset. The mask of element
/// `i` depends only on `(seed, offset + i)`, so CPU and CUDA draw identical masks, and a caller advances
/// `offset` by the element count after each use to get fresh masks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    /// Probability of zeroing an element, in `[0, 1)`.
    pub p: f32,
    /// Generator seed.
    pub seed: u64,
    /// Counter of the first element.
    pub offset: u64,
}

impl Dropout {
    fn validate(&self) -> Result<(), KernelError> {
        if (0.0..1.0).contains(&self.p) {
            Ok(())
        } else {
            Err(KernelError::InvalidArgument {
                what: "dropout",
                detail: format!("drop probability {} is outside [0, 1)", self.p),
            })
        }
    }

    /// Elements whose 32 random bits are below this are dropped.
    pub fn threshold(&self) -> u32 {
        ((self.p as f64) * 4294967296.0)
            .round()
            .min(u32::MAX as f64) as u32
    }

    /// The factor applied to kept elements, `1 / (1 - p)`, rounded to f32 once.
    pub fn keep_scale(&self) -> f32 {
        (1.0 / (1.0 - self.p as f64)) as f32
    }
}

/// The 32 random bits of counter `counter`: splitmix64 of `seed + counter * 0x9E3779B97F4A7C15`, upper half.
pub fn dropout_bits(seed: u64, counter: u64) -> u32 {
    let z = SplitMix64::mix(seed.wrapping_add(counter.wrapping_mul(SplitMix64::GAMMA)));
    (z >> 32) as u32
}

/// Dropout forward: `mask[i] = 1` if element `i` is kept (else 0), `y = x * keep_scale` where kept, 0 else.
pub fn dropout_forward<T: FloatElement>(
    x: &Buffer<T>,
    params: Dropout,
    y: &mut Buffer<T>,
    mask: &mut Buffer<u8>,
) -> Result<(), KernelError> {
    const WHAT: &str = "dropout_forward";
    params.validate()?;
    check_len(WHAT, x.len(), y.len())?;
    check_len(WHAT, x.len(), mask.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, y)?;
    same_device(WHAT, &dev, mask)?;
    let (thr, scale) = (params.threshold(), params.keep_scale());
    match dev {
        None => {
            let xs = x.host(WHAT)?;
            let ys = y.host_mut(WHAT)?;
            let ms = mask.host_mut(WHAT)?;
            let run = |(c, (yo, mo)): (usize, (&mut [T], &mut [u8]))| {
                let i0 = c * CPU_CHUNK;
                for (k, (yv, mv)) in yo.iter_mut().zip(mo.iter_mut()).enumerate() {
                    let i = i0 + k;
                    let keep =
                        dropout_bits(params.seed, params.offset.wrapping_add(i as u64)) >= thr;
                    *mv = keep as u8;
                    *yv = T::from_f32(if keep { xs[i].to_f32() * scale } else { 0.0 });
                }
            };
            ys.par_chunks_mut(CPU_CHUNK)
                .zip(ms.par_chunks_mut(CPU_CHUNK))
                .enumerate()
                .for_each(run);
            Ok(())
        }
        Some(dev) => {
            let n = x.len() as u64;
            let (seed, offset) = (params.seed, params.offset);
            let xs = cs(x, WHAT)?;
            let ys = cs_mut(y, WHAT)?;
            let ms = cs_mut(mask, WHAT)?;
            launch_elementwise!(&dev, format!("dropout_fwd_{}", T::NAME), n, |b| {
                b.arg(xs)
                    .arg(ys)
                    .arg(ms)
                    .arg(&n)
                    .arg(&seed)
                    .arg(&offset)
                    .arg(&thr)
                    .arg(&scale);
            })
        }
    }
}

/// Dropout backward: `dx = dy * keep_scale` where `mask` is 1, else 0 (`p` as in the forward call).
pub fn dropout_backward<T: FloatElement>(
    dy: &Buffer<T>,
    mask: &Buffer<u8>,
    params: Dropout,
    dx: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "dropout_backward";
    params.validate()?;
    check_len(WHAT, dy.len(), mask.len())?;
    check_len(WHAT, dy.len(), dx.len())?;
    let dev = cuda_of(dy);
    same_device(WHAT, &dev, mask)?;
    same_device(WHAT, &dev, dx)?;
    let scale = params.keep_scale();
    match dev {
        None => {
            let (gs, ms) = (dy.host(WHAT)?, mask.host(WHAT)?);
            let ds = dx.host_mut(WHAT)?;
            ds.par_chunks_mut(CPU_CHUNK).enumerate().for_each(|(c, o)| {
                let i0 = c * CPU_CHUNK;
                for (k, d) in o.iter_mut().enumerate() {
                    let i = i0 + k;
                    *d = T::from_f32(if ms[i] != 0 {
                        gs[i].to_f32() * scale
                    } else {
                        0.0
                    });
                }
            });
            Ok(())
        }
        Some(dev) => {
            let n = dy.len() as u64;
            let (gs, ms, ds) = (cs(dy, WHAT)?, cs(mask, WHAT)?, cs_mut(dx, WHAT)?);
            launch_elementwise!(&dev, format!("dropout_bwd_{}", T::NAME), n, |b| {
                b.arg(gs).arg(ms).arg(ds).arg(&n).arg(&scale);
            })
        }
    }
}

/// `x *= a`.
pub fn scale<T: FloatElement>(x: &mut Buffer<T>, a: f32) -> Result<(), KernelError> {
    const WHAT: &str = "scale";
    match cuda_of(x) {
        None => {
            let xs = x.host_mut(WHAT)?;
            let run = |o: &mut [T]| {
                for v in o {
                    *v = T::from_f32(v.to_f32() * a);
                }
            };
            if xs.len() < CPU_PAR_THRESHOLD {
                run(xs);
            } else {
                xs.par_chunks_mut(CPU_CHUNK).for_each(run);
            }
            Ok(())
        }
        Some(dev) => {
            let n = x.len() as u64;
            let xs = cs_mut(x, WHAT)?;
            launch_elementwise!(&dev, format!("scale_{}", T::NAME), n, |b| {
                b.arg(xs).arg(&n).arg(&a);
            })
        }
    }
}

/// `y += a * x` (two roundings: the product, then the sum).
pub fn axpy<T: FloatElement>(a: f32, x: &Buffer<T>, y: &mut Buffer<T>) -> Result<(), KernelError> {
    const WHAT: &str = "axpy";
    check_len(WHAT, x.len(), y.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, y)?;
    match dev {
        None => {
            zip_chunks(x.host(WHAT)?, y.host_mut(WHAT)?, |s, o| {
                for (d, &v) in o.iter_mut().zip(s) {
                    *d = T::from_f32(d.to_f32() + a * v.to_f32());
                }
            });
            Ok(())
        }
        Some(dev) => {
            let n = x.len() as u64;
            let (xs, ys) = (cs(x, WHAT)?, cs_mut(y, WHAT)?);
            launch_elementwise!(&dev, format!("axpy_{}", T::NAME), n, |b| {
                b.arg(xs).arg(ys).arg(&n).arg(&a);
            })
        }
    }
}

/// `out = a + b` (e.g. a residual connection).
pub fn add<T: FloatElement>(
    a: &Buffer<T>,
    b: &Buffer<T>,
    out: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "add";
    check_len(WHAT, a.len(), b.len())?;
    check_len(WHAT, a.len(), out.len())?;
    let dev = cuda_of(a);
    same_device(WHAT, &dev, b)?;
    same_device(WHAT, &dev, out)?;
    match dev {
        None => {
            cpu_map2(a.host(WHAT)?, b.host(WHAT)?, out.host_mut(WHAT)?, |u, v| {
                u + v
            });
            Ok(())
        }
        Some(dev) => {
            let n = a.len() as u64;
            let (as_, bs, os) = (cs(a, WHAT)?, cs(b, WHAT)?, cs_mut(out, WHAT)?);
            launch_elementwise!(&dev, format!("add_{}", T::NAME), n, |l| {
                l.arg(as_).arg(bs).arg(os).arg(&n);
            })
        }
    }
}

/// Log-softmax over the rows of `[rows, classes]` logits: `lp = x - max - log(sum exp(x - max))`.
pub fn log_softmax_forward(
    logits: &Buffer<f32>,
    rows: usize,
    classes: usize,
    log_probs: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "log_softmax_forward";
    check_len(WHAT, mul_checked(WHAT, rows, classes)?, logits.len())?;
    check_len(WHAT, logits.len(), log_probs.len())?;
    let dev = cuda_of(logits);
    same_device(WHAT, &dev, log_probs)?;
    match dev {
        None => {
            if classes == 0 {
                return Ok(());
            }
            let xs = logits.host(WHAT)?;
            let run = |(r, o): (usize, &mut [f32])| {
                let row = &xs[r * classes..(r + 1) * classes];
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let s = warp_order_sum(row.iter().map(|&v| (v - m).exp()));
                let lse = m + s.ln();
                for (d, &v) in o.iter_mut().zip(row) {
                    *d = v - lse;
                }
            };
            let o = log_probs.host_mut(WHAT)?;
            if o.len() < CPU_PAR_THRESHOLD {
                o.chunks_mut(classes).enumerate().for_each(run);
            } else {
                o.par_chunks_mut(classes).enumerate().for_each(run);
            }
            Ok(())
        }
        Some(dev) => {
            let f = function(&dev, &OPS_MODULE, "log_softmax_fwd")?;
            let cfg = cfg_for(&dev, rows as u64 * 32)?;
            let (r, c) = (rows as u64, classes as u64);
            let (xs, os) = (cs(logits, WHAT)?, cs_mut(log_probs, WHAT)?);
            let mut b = dev.stream().launch_builder(&f);
            b.arg(xs).arg(os).arg(&r).arg(&c);
            // SAFETY: `log_softmax_fwd(const float*, float*, u64, u64)`; both hold rows*classes elements.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// Indexes into the stats buffer of [`nll_loss_stats`].
pub mod nll_stat {
    /// Mean negative log-likelihood over the rows with a valid label, divided by all rows.
    pub const MEAN_LOSS: usize = 0;
    /// Rows whose argmax (first maximum) equals the label.
    pub const CORRECT: usize = 1;
    /// Rows whose label is outside `0..classes` (they add nothing to the loss).
    pub const INVALID_LABELS: usize = 2;
    /// Length of the stats buffer.
    pub const LEN: usize = 3;
}

/// NLL statistics of log-probabilities: `stats = [mean loss, correct predictions, invalid labels]` (see
/// [`nll_stat`]), left on the device so the host reads them only when it wants to. On the CPU an invalid
/// label is an error; on CUDA it is counted in `stats[INVALID_LABELS]` (checking would need the host).
pub fn nll_loss_stats(
    log_probs: &Buffer<f32>,
    labels: &Buffer<i32>,
    rows: usize,
    classes: usize,
    stats: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "nll_loss_stats";
    check_len(WHAT, mul_checked(WHAT, rows, classes)?, log_probs.len())?;
    check_len(WHAT, rows, labels.len())?;
    check_len(WHAT, nll_stat::LEN, stats.len())?;
    let dev = cuda_of(log_probs);
    same_device(WHAT, &dev, labels)?;
    same_device(WHAT, &dev, stats)?;
    match dev {
        None => {
            let (lp, ls) = (log_probs.host(WHAT)?, labels.host(WHAT)?);
            let mut loss = 0.0f64;
            let mut correct = 0u64;
            for (r, &label) in ls.iter().enumerate() {
                if label < 0 || label as usize >= classes {
                    return Err(KernelError::InvalidArgument {
                        what: WHAT,
                        detail: format!("label {label} of row {r} is outside 0..{classes}"),
                    });
                }
                let row = &lp[r * classes..(r + 1) * classes];
                loss -= row[label as usize] as f64;
                let mut best = 0;
                for c in 1..classes {
                    if row[c] > row[best] {
                        best = c;
                    }
                }
                correct += (best == label as usize) as u64;
            }
            let s = stats.host_mut(WHAT)?;
            s[nll_stat::MEAN_LOSS] = if rows > 0 {
                (loss / rows as f64) as f32
            } else {
                0.0
            };
            s[nll_stat::CORRECT] = correct as f32;
            s[nll_stat::INVALID_LABELS] = 0.0;
            Ok(())
        }
        Some(dev) => {
            let f = function(&dev, &OPS_MODULE, "nll_stats")?;
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let (r, c) = (rows as u64, classes as u64);
            let (lp, ls, ss) = (
                cs(log_probs, WHAT)?,
                cs(labels, WHAT)?,
                cs_mut(stats, WHAT)?,
            );
            let mut b = dev.stream().launch_builder(&f);
            b.arg(lp).arg(ls).arg(ss).arg(&r).arg(&c);
            // SAFETY: `nll_stats(const float*, const int*, float*, u64, u64)` with one block of 256
            // threads (its shared arrays are sized for that); lengths checked above.
            unsafe { b.launch(cfg) }?;
            Ok(())
        }
    }
}

/// Log-softmax then NLL statistics: the forward pass of a classification loss.
pub fn log_softmax_nll_forward(
    logits: &Buffer<f32>,
    labels: &Buffer<i32>,
    rows: usize,
    classes: usize,
    log_probs: &mut Buffer<f32>,
    stats: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    log_softmax_forward(logits, rows, classes, log_probs)?;
    nll_loss_stats(log_probs, labels, rows, classes, stats)
}

/// Gradient of the mean NLL of log-softmax with respect to the logits:
/// `dlogits = (exp(lp) - onehot(label)) / rows`.
pub fn log_softmax_nll_backward(
    log_probs: &Buffer<f32>,
    labels: &Buffer<i32>,
    rows: usize,
    classes: usize,
    dlogits: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "log_softmax_nll_backward";
    check_len(WHAT, mul_checked(WHAT, rows, classes)?, log_probs.len())?;
    check_len(WHAT, rows, labels.len())?;
    check_len(WHAT, log_probs.len(), dlogits.len())?;
    let dev = cuda_of(log_probs);
    same_device(WHAT, &dev, labels)?;
    same_device(WHAT, &dev, dlogits)?;
    let g = if rows > 0 { 1.0 / rows as f32 } else { 0.0 };
    match dev {
        None => {
            if classes == 0 {
                return Ok(());
            }
            let (lp, ls) = (log_probs.host(WHAT)?, labels.host(WHAT)?);
            let run = |(r, o): (usize, &mut [f32])| {
                let label = ls[r];
                for (c, d) in o.iter_mut().enumerate() {
                    let p = lp[r * classes + c].exp();
                    let v = if label >= 0 && label as usize == c {
                        p - 1.0
                    } else {
                        p
                    };
                    *d = v * g;
                }
            };
            dlogits
                .host_mut(WHAT)?
                .par_chunks_mut(classes)
                .enumerate()
                .for_each(run);
            Ok(())
        }
        Some(dev) => {
            let n = log_probs.len() as u64;
            let (r, c) = (rows as u64, classes as u64);
            let (lp, ls, ds) = (
                cs(log_probs, WHAT)?,
                cs(labels, WHAT)?,
                cs_mut(dlogits, WHAT)?,
            );
            launch_elementwise!(&dev, "log_softmax_nll_bwd", n, |b| {
                b.arg(lp).arg(ls).arg(ds).arg(&r).arg(&c).arg(&g);
            })
        }
    }
}

/// Shape of a 2-D convolution's input and window, for [`im2col`] and [`col2im`] (NCHW).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Conv2dGeometry {
    /// Images in the batch.
    pub batch: usize,
    /// Input channels.
    pub channels: usize,
    /// Input height.
    pub height: usize,
    /// Input width.
    pub width: usize,
    /// Window height.
    pub kernel_h: usize,
    /// Window width.
    pub kernel_w: usize,
    /// Step between windows (both directions).
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
}

/// The kernel-side copy of [`Conv2dGeometry`] (`ConvGeom` in ops.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ConvGeomRepr {
    n: i32,
    c: i32,
    h: i32,
    w: i32,
    kh: i32,
    kw: i32,
    stride: i32,
    pad: i32,
    oh: i32,
    ow: i32,
}

// SAFETY: a #[repr(C)] struct of ten i32, laid out exactly like `struct ConvGeom` in ops.cu.
unsafe impl DeviceRepr for ConvGeomRepr {}

impl Conv2dGeometry {
    /// Output height.
    pub fn out_h(&self) -> usize {
        (self.height + 2 * self.padding - self.kernel_h) / self.stride + 1
    }

    /// Output width.
    pub fn out_w(&self) -> usize {
        (self.width + 2 * self.padding - self.kernel_w) / self.stride + 1
    }

    /// Elements of the input `[batch, channels, height, width]`.
    pub fn input_len(&self) -> usize {
        self.batch * self.channels * self.height * self.width
    }

    /// Rows of the column matrix: one per output pixel, `batch * out_h * out_w`.
    pub fn patches(&self) -> usize {
        self.batch * self.out_h() * self.out_w()
    }

    /// Columns of the column matrix: `channels * kernel_h * kernel_w`.
    pub fn patch_len(&self) -> usize {
        self.channels * self.kernel_h * self.kernel_w
    }

    fn validate(&self, what: &'static str) -> Result<(), KernelError> {
        let bad = |detail: String| Err(KernelError::InvalidArgument { what, detail });
        if self.stride == 0 || self.kernel_h == 0 || self.kernel_w == 0 {
            return bad(format!("kernel and stride must be positive: {self:?}"));
        }
        if self.kernel_h > self.height + 2 * self.padding
            || self.kernel_w > self.width + 2 * self.padding
        {
            return bad(format!("window larger than the padded input: {self:?}"));
        }
        let big = [
            self.batch,
            self.channels,
            self.height,
            self.width,
            self.padding,
            self.patches(),
            self.patch_len(),
        ]
        .iter()
        .any(|&v| v > i32::MAX as usize);
        let total = self
            .patches()
            .checked_mul(self.patch_len())
            .and_then(|t| t.checked_mul(4));
        if big || total.is_none() {
            return bad(format!("geometry too large: {self:?}"));
        }
        Ok(())
    }

    fn repr(&self) -> ConvGeomRepr {
        ConvGeomRepr {
            n: self.batch as i32,
            c: self.channels as i32,
            h: self.height as i32,
            w: self.width as i32,
            kh: self.kernel_h as i32,
            kw: self.kernel_w as i32,
            stride: self.stride as i32,
            pad: self.padding as i32,
            oh: self.out_h() as i32,
            ow: self.out_w() as i32,
        }
    }
}

/// im2col: `cols` is row-major `[patches, patch_len]`, one row per output pixel `(n, oy, ox)` and one
/// column per `(c, ky, kx)`, zero where the window overlaps the padding. A convolution is then
/// `cols x W^T` with `W` of shape `[out_channels, patch_len]` (the layout of a linear layer).
pub fn im2col(
    x: &Buffer<f32>,
    geom: &Conv2dGeometry,
    cols: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "im2col";
    geom.validate(WHAT)?;
    check_len(WHAT, geom.input_len(), x.len())?;
    check_len(WHAT, geom.patches() * geom.patch_len(), cols.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, cols)?;
    match dev {
        None => {
            let xs = x.host(WHAT)?;
            let out = cols.host_mut(WHAT)?;
            if geom.padding == 0 {
                im2col_cpu_unpadded(xs, geom, out);
            } else {
                im2col_cpu_generic(xs, geom, out);
            }
            Ok(())
        }
        Some(dev) => {
            let total = (geom.patches() * geom.patch_len()) as u64;
            let repr = geom.repr();
            let (xs, os) = (cs(x, WHAT)?, cs_mut(cols, WHAT)?);
            launch_elementwise!(&dev, "im2col_f32", total, |b| {
                b.arg(xs).arg(os).arg(&repr);
            })
        }
    }
}

/// col2im, the adjoint of [`im2col`]: `dx[n, c, y, x]` = the sum of every `cols` entry that im2col read
/// from that pixel, summed with `ky` then `kx` ascending (identical on both devices). `dx` is overwritten.
pub fn col2im(
    cols: &Buffer<f32>,
    geom: &Conv2dGeometry,
    dx: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "col2im";
    geom.validate(WHAT)?;
    check_len(WHAT, geom.patches() * geom.patch_len(), cols.len())?;
    check_len(WHAT, geom.input_len(), dx.len())?;
    let dev = cuda_of(cols);
    same_device(WHAT, &dev, dx)?;
    match dev {
        None => {
            let cs_ = cols.host(WHAT)?;
            let out = dx.host_mut(WHAT)?;
            if geom.padding == 0 && geom.stride == 1 {
                col2im_cpu_stride1_unpadded(cs_, geom, out);
            } else {
                col2im_cpu_generic(cs_, geom, out);
            }
            Ok(())
        }
        Some(dev) => {
            let total = geom.input_len() as u64;
            let repr = geom.repr();
            let (cs_, ds) = (cs(cols, WHAT)?, cs_mut(dx, WHAT)?);
            launch_elementwise!(&dev, "col2im_f32", total, |b| {
                b.arg(cs_).arg(ds).arg(&repr);
            })
        }
    }
}

/// im2col on the CPU for any geometry: one task per column row, bounds-checked per element (the
/// reference the fast paths are tested against).
fn im2col_cpu_generic(xs: &[f32], g: &Conv2dGeometry, cols: &mut [f32]) {
    let (oh, ow, pl) = (g.out_h(), g.out_w(), g.patch_len());
    if pl == 0 {
        return;
    }
    cols.par_chunks_mut(pl).enumerate().for_each(|(row, out)| {
        let (ox, oy, n) = (row % ow, (row / ow) % oh, row / (ow * oh));
        let mut k = 0;
        for c in 0..g.channels {
            let plane = &xs[(n * g.channels + c) * g.height * g.width..][..g.height * g.width];
            for ky in 0..g.kernel_h {
                let yy = (oy * g.stride + ky) as isize - g.padding as isize;
                for kx in 0..g.kernel_w {
                    let xx = (ox * g.stride + kx) as isize - g.padding as isize;
                    out[k] = if yy >= 0
                        && (yy as usize) < g.height
                        && xx >= 0
                        && (xx as usize) < g.width
                    {
                        plane[yy as usize * g.width + xx as usize]
                    } else {
                        0.0
                    };
                    k += 1;
                }
            }
        }
    });
}

/// im2col on the CPU without padding: every window lies inside the image, so each `(c, ky)` part of a
/// column row is a contiguous copy of `kernel_w` input pixels. One task per image.
fn im2col_cpu_unpadded(xs: &[f32], g: &Conv2dGeometry, cols: &mut [f32]) {
    let (oh, ow, pl) = (g.out_h(), g.out_w(), g.patch_len());
    let (kh, kw, s, w) = (g.kernel_h, g.kernel_w, g.stride, g.width);
    let image_in = g.channels * g.height * g.width;
    let image_cols = oh * ow * pl;
    if image_cols == 0 || image_in == 0 {
        return;
    }
    cols.par_chunks_mut(image_cols)
        .zip(xs.par_chunks(image_in))
        .for_each(|(out, img)| {
            for (p, row) in out.chunks_exact_mut(pl).enumerate() {
                let (oy, ox) = (p / ow, p % ow);
                let mut dst = row.chunks_exact_mut(kw);
                for plane in img.chunks_exact(g.height * w) {
                    for ky in 0..kh {
                        let src = &plane[(oy * s + ky) * w + ox * s..][..kw];
                        if let Some(d) = dst.next() {
                            d.copy_from_slice(src);
                        }
                    }
                }
            }
        });
}

/// col2im on the CPU for any geometry: one task per input plane, each pixel summing its contributions
/// with `ky` then `kx` ascending (the order of the CUDA kernel).
fn col2im_cpu_generic(cols: &[f32], g: &Conv2dGeometry, dx: &mut [f32]) {
    let (oh, ow, pl) = (g.out_h(), g.out_w(), g.patch_len());
    let plane_len = g.height * g.width;
    if plane_len == 0 {
        return;
    }
    dx.par_chunks_mut(plane_len)
        .enumerate()
        .for_each(|(plane, out)| {
            let (c, n) = (plane % g.channels, plane / g.channels);
            for (i, d) in out.iter_mut().enumerate() {
                let (xx, yy) = (i % g.width, i / g.width);
                let mut s = 0.0f32;
                for ky in 0..g.kernel_h {
                    let ty = yy + g.padding;
                    if ty < ky || (ty - ky) % g.stride != 0 {
                        continue;
                    }
                    let oy = (ty - ky) / g.stride;
                    if oy >= oh {
                        continue;
                    }
                    for kx in 0..g.kernel_w {
                        let tx = xx + g.padding;
                        if tx < kx || (tx - kx) % g.stride != 0 {
                            continue;
                        }
                        let ox = (tx - kx) / g.stride;
                        if ox >= ow {
                            continue;
                        }
                        let row = (n * oh + oy) * ow + ox;
                        let col = (c * g.kernel_h + ky) * g.kernel_w + kx;
                        s += cols[row * pl + col];
                    }
                }
                *d = s;
            }
        });
}

/// col2im on the CPU for stride 1 without padding, one task per image. Pixel `(y, x)` receives
/// `(ky, kx)` from output pixel `(y - ky, x - kx)`, so walking output rows `oy` downwards and, within
/// one, `kx` upwards adds every pixel's contributions in exactly the generic order (`ky` then `kx`
/// ascending) and gives bit-identical sums. Each output row's block of `cols` is first transposed to
/// `[patch_len, out_w]` so that every `(c, ky, kx)` becomes one contiguous, vectorisable span add.
fn col2im_cpu_stride1_unpadded(cols: &[f32], g: &Conv2dGeometry, dx: &mut [f32]) {
    let (oh, ow, pl) = (g.out_h(), g.out_w(), g.patch_len());
    let (kh, kw, w) = (g.kernel_h, g.kernel_w, g.width);
    let plane_len = g.height * w;
    let image_in = g.channels * plane_len;
    let image_cols = oh * ow * pl;
    if image_cols == 0 || image_in == 0 {
        dx.fill(0.0);
        return;
    }
    dx.par_chunks_mut(image_in)
        .zip(cols.par_chunks(image_cols))
        .for_each_init(
            || vec![0.0f32; pl * ow],
            |block_t, (out, img_cols)| {
                out.fill(0.0);
                for oy in (0..oh).rev() {
                    let block = &img_cols[oy * ow * pl..][..ow * pl];
                    transpose_2d(block, ow, pl, block_t);
                    let mut spans = block_t.chunks_exact(ow);
                    for plane in out.chunks_exact_mut(plane_len) {
                        for ky in 0..kh {
                            let line = &mut plane[(oy + ky) * w..][..w];
                            for kx in 0..kw {
                                if let Some(span) = spans.next() {
                                    for (d, &v) in line[kx..kx + ow].iter_mut().zip(span) {
                                        *d += v;
                                    }
                                }
                            }
                        }
                    }
                }
            },
        );
}

/// `y = x^T` for a row-major `[rows, cols]` matrix `x`, in 8x8 tiles held in registers: each tile is
/// read as eight contiguous row pieces and written as eight contiguous column pieces.
fn transpose_2d<T: Copy>(x: &[T], rows: usize, cols: usize, y: &mut [T]) {
    const B: usize = 8;
    let (rb, cb) = (rows / B * B, cols / B * B);
    if rows == 0 || cols == 0 {
        return;
    }
    for r0 in (0..rb).step_by(B) {
        for c0 in (0..cb).step_by(B) {
            let mut tile = [[x[0]; B]; B];
            for (i, t) in tile.iter_mut().enumerate() {
                t.copy_from_slice(&x[(r0 + i) * cols + c0..][..B]);
            }
            for j in 0..B {
                let dst = &mut y[(c0 + j) * rows + r0..][..B];
                for (d, t) in dst.iter_mut().zip(&tile) {
                    *d = t[j];
                }
            }
        }
        for c in cb..cols {
            for i in 0..B {
                y[c * rows + r0 + i] = x[(r0 + i) * cols + c];
            }
        }
    }
    for r in rb..rows {
        for c in 0..cols {
            y[c * rows + r] = x[r * cols + c];
        }
    }
}

/// Batched transpose on the CPU: one task per batch entry.
fn transpose_batched_cpu<T: Copy + Send + Sync>(
    xs: &[T],
    [_, rows, cols]: [usize; 3],
    ys: &mut [T],
) {
    let mat = rows * cols;
    if mat == 0 {
        return;
    }
    if xs.len() < CPU_PAR_THRESHOLD {
        xs.chunks_exact(mat)
            .zip(ys.chunks_exact_mut(mat))
            .for_each(|(x, y)| transpose_2d(x, rows, cols, y));
    } else {
        xs.par_chunks_exact(mat)
            .zip(ys.par_chunks_exact_mut(mat))
            .for_each(|(x, y)| transpose_2d(x, rows, cols, y));
    }
}

/// Batched transpose: `y[b, c, r] = x[b, r, c]` for `shape = [batch, rows, cols]` (e.g. a convolution's
/// `[N, pixels, channels]` GEMM output to NCHW, and back for the gradient).
pub fn transpose_batched<T: FloatElement>(
    x: &Buffer<T>,
    shape: [usize; 3],
    y: &mut Buffer<T>,
) -> Result<(), KernelError> {
    const WHAT: &str = "transpose_batched";
    let [batch, rows, cols] = shape;
    let total = mul_checked(WHAT, mul_checked(WHAT, batch, rows)?, cols)?;
    check_len(WHAT, total, x.len())?;
    check_len(WHAT, total, y.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, y)?;
    match dev {
        None => {
            if rows == 0 || cols == 0 {
                return Ok(());
            }
            transpose_batched_cpu(x.host(WHAT)?, [batch, rows, cols], y.host_mut(WHAT)?);
            Ok(())
        }
        Some(dev) => {
            let (b_, r, c) = (batch as u64, rows as u64, cols as u64);
            let (xs, ys) = (cs(x, WHAT)?, cs_mut(y, WHAT)?);
            launch_elementwise!(&dev, format!("transpose_batched_{}", T::NAME), total, |b| {
                b.arg(xs).arg(ys).arg(&b_).arg(&r).arg(&c);
            })
        }
    }
}

/// Shape of a max-pooling (NCHW, square window, no padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pool2dGeometry {
    /// Images in the batch.
    pub batch: usize,
    /// Channels.
    pub channels: usize,
    /// Input height.
    pub height: usize,
    /// Input width.
    pub width: usize,
    /// Window side (2 for the usual 2x2 pooling).
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
}

/// The kernel-side copy of [`Pool2dGeometry`] (`PoolGeom` in ops.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PoolGeomRepr {
    n: i32,
    c: i32,
    h: i32,
    w: i32,
    k: i32,
    stride: i32,
    oh: i32,
    ow: i32,
}

// SAFETY: a #[repr(C)] struct of eight i32, laid out exactly like `struct PoolGeom` in ops.cu.
unsafe impl DeviceRepr for PoolGeomRepr {}

impl Pool2dGeometry {
    /// 2x2 windows with stride 2.
    pub fn two_by_two(batch: usize, channels: usize, height: usize, width: usize) -> Self {
        Pool2dGeometry {
            batch,
            channels,
            height,
            width,
            kernel: 2,
            stride: 2,
        }
    }

    /// Output height.
    pub fn out_h(&self) -> usize {
        (self.height - self.kernel) / self.stride + 1
    }

    /// Output width.
    pub fn out_w(&self) -> usize {
        (self.width - self.kernel) / self.stride + 1
    }

    /// Elements of the input.
    pub fn input_len(&self) -> usize {
        self.batch * self.channels * self.height * self.width
    }

    /// Elements of the output.
    pub fn output_len(&self) -> usize {
        self.batch * self.channels * self.out_h() * self.out_w()
    }

    fn validate(&self, what: &'static str) -> Result<(), KernelError> {
        let bad = |detail: String| Err(KernelError::InvalidArgument { what, detail });
        if self.kernel == 0 || self.stride == 0 {
            return bad(format!("kernel and stride must be positive: {self:?}"));
        }
        if self.kernel > self.height || self.kernel > self.width {
            return bad(format!("window larger than the input: {self:?}"));
        }
        let len = self
            .batch
            .checked_mul(self.channels)
            .and_then(|v| v.checked_mul(self.height))
            .and_then(|v| v.checked_mul(self.width));
        match len {
            Some(l) if l <= u32::MAX as usize && self.height <= i32::MAX as usize => Ok(()),
            _ => bad(format!("input too large for 32-bit indices: {self:?}")),
        }
    }

    fn repr(&self) -> PoolGeomRepr {
        PoolGeomRepr {
            n: self.batch as i32,
            c: self.channels as i32,
            h: self.height as i32,
            w: self.width as i32,
            k: self.kernel as i32,
            stride: self.stride as i32,
            oh: self.out_h() as i32,
            ow: self.out_w() as i32,
        }
    }
}

/// Max-pool forward: `y` is the window maxima, `indices` the flat index into `x` of each (the first
/// maximum in row-major window order; a NaN wins, as in PyTorch).
pub fn max_pool2d_forward(
    x: &Buffer<f32>,
    geom: &Pool2dGeometry,
    y: &mut Buffer<f32>,
    indices: &mut Buffer<u32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "max_pool2d_forward";
    geom.validate(WHAT)?;
    check_len(WHAT, geom.input_len(), x.len())?;
    check_len(WHAT, geom.output_len(), y.len())?;
    check_len(WHAT, geom.output_len(), indices.len())?;
    let dev = cuda_of(x);
    same_device(WHAT, &dev, y)?;
    same_device(WHAT, &dev, indices)?;
    match dev {
        None => {
            let xs = x.host(WHAT)?;
            let g = *geom;
            let (oh, ow) = (g.out_h(), g.out_w());
            let plane_out = oh * ow;
            if plane_out == 0 {
                return Ok(());
            }
            y.host_mut(WHAT)?
                .par_chunks_mut(plane_out)
                .zip(indices.host_mut(WHAT)?.par_chunks_mut(plane_out))
                .enumerate()
                .for_each(|(plane, (yo, io))| {
                    let base = plane * g.height * g.width;
                    for oy in 0..oh {
                        for ox in 0..ow {
                            let mut bi = base + oy * g.stride * g.width + ox * g.stride;
                            let mut best = xs[bi];
                            for ky in 0..g.kernel {
                                let row = base + (oy * g.stride + ky) * g.width + ox * g.stride;
                                for kx in 0..g.kernel {
                                    let v = xs[row + kx];
                                    if v > best || (v.is_nan() && !best.is_nan()) {
                                        best = v;
                                        bi = row + kx;
                                    }
                                }
                            }
                            yo[oy * ow + ox] = best;
                            io[oy * ow + ox] = bi as u32;
                        }
                    }
                });
            Ok(())
        }
        Some(dev) => {
            let total = geom.output_len() as u64;
            let repr = geom.repr();
            let xs = cs(x, WHAT)?;
            let ys = cs_mut(y, WHAT)?;
            let is = cs_mut(indices, WHAT)?;
            launch_elementwise!(&dev, "maxpool_fwd_f32", total, |b| {
                b.arg(xs).arg(ys).arg(is).arg(&repr);
            })
        }
    }
}

/// Max-pool backward: `dx` is overwritten with zeros, then `dx[indices[i]] += dy[i]`. With windows that do
/// not overlap (stride >= kernel) every input receives at most one value, so the result is exact on both
/// devices. Indices must come from [`max_pool2d_forward`] with an input of `dx.len()` elements.
pub fn max_pool2d_backward(
    dy: &Buffer<f32>,
    indices: &Buffer<u32>,
    dx: &mut Buffer<f32>,
) -> Result<(), KernelError> {
    const WHAT: &str = "max_pool2d_backward";
    check_len(WHAT, dy.len(), indices.len())?;
    let dev = cuda_of(dy);
    same_device(WHAT, &dev, indices)?;
    same_device(WHAT, &dev, dx)?;
    match dev {
        None => {
            let (gs, is) = (dy.host(WHAT)?, indices.host(WHAT)?);
            let ds = dx.host_mut(WHAT)?;
            ds.fill(0.0);
            // Validate all indices first so the hot loop neither branches on errors nor builds messages.
            let len = ds.len();
            if let Some(&i) = is.iter().find(|&&i| i as usize >= len) {
                return Err(KernelError::InvalidArgument {
                    what: WHAT,
                    detail: format!("index {i} outside an input of {len} elements"),
                });
            }
            for (&g, &i) in gs.iter().zip(is) {
                ds[i as usize] += g;
            }
            Ok(())
        }
        Some(dev) => {
            dx.fill_zero()?;
            let n = dy.len() as u64;
            let (gs, is, ds) = (cs(dy, WHAT)?, cs(indices, WHAT)?, cs_mut(dx, WHAT)?);
            launch_elementwise!(&dev, "maxpool_bwd_f32", n, |b| {
                b.arg(gs).arg(is).arg(ds).arg(&n);
            })
        }
    }
}

#[cfg(test)]
mod cpu_fast_path_tests {
    //! The CPU fast paths against the generic CPU loops (which mirror the CUDA kernels), bit for bit.
    use super::*;
    use proptest::prelude::*;

    fn values(len: usize, seed: u64) -> Vec<f32> {
        // Mixed signs and magnitudes so that summation order shows in the low bits.
        (0..len as u64)
            .map(|i| {
                let b = dropout_bits(seed, i);
                (b as f32 / u32::MAX as f32 - 0.5) * (1 << (b % 13)) as f32
            })
            .collect()
    }

    fn geometry(n: usize, c: usize, h: usize, w: usize, k: usize, stride: usize) -> Conv2dGeometry {
        Conv2dGeometry {
            batch: n,
            channels: c,
            height: h,
            width: w,
            kernel_h: k,
            kernel_w: (k % 3) + 1,
            stride,
            padding: 0,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn im2col_unpadded_matches_generic(n in 1usize..4, c in 1usize..4, h in 3usize..12, w in 3usize..12,
                                           k in 1usize..4, stride in 1usize..3, seed in any::<u64>()) {
            let g = geometry(n, c, h, w, k, stride);
            let x = values(g.input_len(), seed);
            let mut fast = vec![f32::NAN; g.patches() * g.patch_len()];
            let mut reference = fast.clone();
            im2col_cpu_unpadded(&x, &g, &mut fast);
            im2col_cpu_generic(&x, &g, &mut reference);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&fast), bits(&reference));
        }

        #[test]
        fn col2im_stride1_matches_generic_bitwise(n in 1usize..4, c in 1usize..4, h in 3usize..12,
                                                  w in 3usize..12, k in 1usize..4, seed in any::<u64>()) {
            let g = geometry(n, c, h, w, k, 1);
            let d = values(g.patches() * g.patch_len(), seed);
            let mut fast = vec![f32::NAN; g.input_len()];
            let mut reference = fast.clone();
            col2im_cpu_stride1_unpadded(&d, &g, &mut fast);
            col2im_cpu_generic(&d, &g, &mut reference);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&fast), bits(&reference));
        }

        #[test]
        fn blocked_transpose_matches_definition(b in 1usize..4, r in 1usize..80, c in 1usize..80,
                                                seed in any::<u64>()) {
            let x = values(b * r * c, seed);
            let mut y = vec![f32::NAN; x.len()];
            transpose_batched_cpu(&x, [b, r, c], &mut y);
            for bi in 0..b {
                for ri in 0..r {
                    for ci in 0..c {
                        prop_assert_eq!(y[(bi * c + ci) * r + ri].to_bits(), x[(bi * r + ri) * c + ci].to_bits());
                    }
                }
            }
        }
    }
}
