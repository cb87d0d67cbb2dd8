//! Element-wise kernels: bias add, ReLU and GELU forward/backward, dropout with a counter-based
//! generator, scale, axpy, add, and an add at an offset of a larger buffer.
//!
//! Every function writes into a caller-provided output (buffers are reused across steps) and runs where
//! its buffers live: the CPU (`cpu.rs`, rayon) or the buffers' GPU (`cuda.rs`, `elementwise.cu`), where
//! nothing goes through the host. Each element is computed in f32 with one rounding per arithmetic
//! operation on both devices, so CPU and CUDA agree bit for bit except where a transcendental (`exp`,
//! `tanh`) is involved. f32 and bf16 storage (computed in f32).

mod cpu;
mod cuda;

use crate::device::{cuda_of, device_of, dispatch, shape_len};
use crate::rng::SplitMix64;
use crate::{check_len, Buffer, FloatElement, KernelError};

/// `x[r, c] += bias[c]` for a row-major `[rows, cols]` tensor.
pub fn bias_add<T: FloatElement>(
    x: &mut Buffer<T>,
    bias: &Buffer<T>,
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    const WHAT: &str = "bias_add";
    check_len(WHAT, shape_len(WHAT, &[rows, cols])?, x.len())?;
    check_len(WHAT, cols, bias.len())?;
    dispatch!(WHAT, [x, bias],
        cpu: cpu::bias_add(x.host_mut(WHAT)?, bias.host(WHAT)?, cols),
        cuda(dev): cuda::bias_add(&dev, x.cuda_mut(WHAT)?, bias.cuda(WHAT)?, rows, cols))
}

/// ReLU: `y = max(x, 0)` (NaN propagates, like PyTorch).
pub fn relu_forward<T: FloatElement>(x: &Buffer<T>, y: &mut Buffer<T>) -> Result<(), KernelError> {
    const WHAT: &str = "relu_forward";
    check_len(WHAT, x.len(), y.len())?;
    dispatch!(WHAT, [x, y],
        cpu: cpu::relu_forward(x.host(WHAT)?, y.host_mut(WHAT)?),
        cuda(dev): cuda::relu_forward(&dev, x.cuda(WHAT)?, y.cuda_mut(WHAT)?))
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
    dispatch!(WHAT, [x, dy, dx],
        cpu: cpu::relu_backward(x.host(WHAT)?, dy.host(WHAT)?, dx.host_mut(WHAT)?),
        cuda(dev): cuda::relu_backward(&dev, x.cuda(WHAT)?, dy.cuda(WHAT)?, dx.cuda_mut(WHAT)?))
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

// The same literals as gelu.cuh, so both round to the same f32 constants (hence the long digits).
#[allow(clippy::excessive_precision)]
const GELU_K0: f32 = 0.7978845608028654; // sqrt(2/pi)
const GELU_K1: f32 = 0.044715;
#[allow(clippy::excessive_precision)]
const INV_SQRT2: f32 = std::f32::consts::FRAC_1_SQRT_2; // rounds to the same f32 as gelu.cuh's literal
#[allow(clippy::excessive_precision)]
const INV_SQRT_2PI: f32 = 0.3989422804014327;

/// erf from the Chebyshev erfc fit of Numerical Recipes (fractional error below 1.2e-7), written exactly
/// as the CUDA kernels compute it.
#[allow(clippy::excessive_precision)] // literals kept identical to gelu.cuh
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
    dispatch!(WHAT, [x, y],
        cpu: cpu::gelu_forward(x.host(WHAT)?, y.host_mut(WHAT)?, approx),
        cuda(dev): cuda::gelu_forward(&dev, x.cuda(WHAT)?, y.cuda_mut(WHAT)?, approx))
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
    dispatch!(WHAT, [x, dy, dx],
    cpu: cpu::gelu_backward(x.host(WHAT)?, dy.host(WHAT)?, dx.host_mut(WHAT)?, approx),
    cuda(dev): {
        let (xs, gs) = (x.cuda(WHAT)?, dy.cuda(WHAT)?);
        cuda::gelu_backward(&dev, xs, gs, dx.cuda_mut(WHAT)?, approx)
    })
}

/// The parameters of one dropout call: drop probability and the generator's seed and counter offset.
/// The mask of element `i` depends only on `(seed, offset + i)`, so CPU and CUDA draw identical masks,
/// and a caller advances `offset` by the element count after each use to get fresh masks.
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
    dispatch!(WHAT, [x, y, mask],
    cpu: {
        let (ys, ms) = (y.host_mut(WHAT)?, mask.host_mut(WHAT)?);
        cpu::dropout_forward(x.host(WHAT)?, params, ys, ms)
    },
    cuda(dev): {
        let (ys, ms) = (y.cuda_mut(WHAT)?, mask.cuda_mut(WHAT)?);
        cuda::dropout_forward(&dev, x.cuda(WHAT)?, params, ys, ms)
    })
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
    let scale = params.keep_scale();
    dispatch!(WHAT, [dy, mask, dx],
    cpu: cpu::dropout_backward(dy.host(WHAT)?, mask.host(WHAT)?, scale, dx.host_mut(WHAT)?),
    cuda(dev): {
        let (gs, ms) = (dy.cuda(WHAT)?, mask.cuda(WHAT)?);
        cuda::dropout_backward(&dev, gs, ms, scale, dx.cuda_mut(WHAT)?)
    })
}

/// `x *= a`.
pub fn scale<T: FloatElement>(x: &mut Buffer<T>, a: f32) -> Result<(), KernelError> {
    const WHAT: &str = "scale";
    match cuda_of(x) {
        None => {
            cpu::scale(x.host_mut(WHAT)?, a);
            Ok(())
        }
        Some(dev) => cuda::scale(&dev, x.cuda_mut(WHAT)?, a),
    }
}

/// `y += a * x` (two roundings: the product, then the sum).
pub fn axpy<T: FloatElement>(a: f32, x: &Buffer<T>, y: &mut Buffer<T>) -> Result<(), KernelError> {
    const WHAT: &str = "axpy";
    check_len(WHAT, x.len(), y.len())?;
    dispatch!(WHAT, [x, y],
        cpu: cpu::axpy(a, x.host(WHAT)?, y.host_mut(WHAT)?),
        cuda(dev): cuda::axpy(&dev, a, x.cuda(WHAT)?, y.cuda_mut(WHAT)?))
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
    dispatch!(WHAT, [a, b, out],
        cpu: cpu::add(a.host(WHAT)?, b.host(WHAT)?, out.host_mut(WHAT)?),
        cuda(dev): cuda::add(&dev, a.cuda(WHAT)?, b.cuda(WHAT)?, out.cuda_mut(WHAT)?))
}

/// `dst[offset + i] += src[i]` for every `i < src.len()`: both widened to f32, one f32 addition, the sum
/// rounded to the destination type (exact for an f32 destination; round to nearest even for a bf16 one,
/// as `half` does). `dst` is f32 or bf16, `src` f32 or bf16 (e.g. a parameter's gradient added into a
/// flat gradient buffer).
pub fn add_at<D: FloatElement, S: FloatElement>(
    dst: &mut Buffer<D>,
    offset: usize,
    src: &Buffer<S>,
) -> Result<(), KernelError> {
    const WHAT: &str = "add_at";
    let n = src.len();
    if offset.checked_add(n).is_none_or(|e| e > dst.len()) {
        return Err(KernelError::InvalidArgument {
            what: WHAT,
            detail: format!(
                "range {offset}..{offset}+{n} outside a buffer of {}",
                dst.len()
            ),
        });
    }
    let dev = device_of(WHAT, &[dst, src])?;
    if n == 0 {
        return Ok(());
    }
    match dev {
        None => {
            cpu::add_at(
                &mut dst.host_mut(WHAT)?[offset..offset + n],
                src.host(WHAT)?,
            );
            Ok(())
        }
        Some(dev) => cuda::add_at(&dev, dst.cuda_mut(WHAT)?, offset, src.cuda(WHAT)?),
    }
}
