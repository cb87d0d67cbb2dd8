//! Adam / AdamW as kernels: the fused update over a range of buffers (one pass reads the gradient and the
//! states, writes the new states, and reports the amaxes of the new values), and the device-side step
//! control of [`control`] (the coefficients of the next step, or a skip, from reduced gradient
//! statistics; the write scales of low-precision states; the values FP8 weights are cast from).
//!
//! What the optimizer decides (when to skip, how to clip, how much headroom state scales get) is the
//! caller's policy, passed in as parameters; `fsdp-optim` holds it.
//!
//! # The update (all f32, each operation rounded once, in this order)
//! ```text
//! g = grad * grad_scale;            if maximize { g = -g }
//! if L2 (Adam):  g = g + weight_decay * w
//! m = m * beta1 + g * (1 - beta1)
//! v = v * beta2 + (g * g) * (1 - beta2)
//! if decoupled (AdamW):  w = w * (1 - lr * weight_decay)
//! denom = sqrt(v) / sqrt(1 - beta2^step) + eps
//! w = w - (lr / (1 - beta1^step)) * (m / denom)
//! ```
//! This is PyTorch's `Adam`/`AdamW` formula (bias corrections folded in the same places). The constants
//! (`1 - beta1`, `lr / (1 - beta1^step)`, `sqrt(1 - beta2^step)`, `1 - lr * wd`) are computed once per step
//! in f64 and rounded to f32 ([`AdamConfig::coefficients`] on the host, or the control kernel on the
//! device, with the same operations), and both devices use those f32 values ([`Coefficients`]).
//!
//! # State precisions
//! - [`adam_step_f32`]: master, m, v in f32; gradient f32 or bf16.
//! - [`adam_step_low_precision`] (MS-AMP's default): master f16, m FP8 E4M3, v f16, each with its own
//!   scale. A stored value `q` means `decode(q) * scale_inv`; a new value `x` is stored as
//!   `encode(x * scale)`. Reads use the `*_SCALE_INV` slots and writes the `*_SCALE` slots of a scale
//!   buffer (see [`lp_slot`]), so after the call the stored data belongs to the write scales. f16 stores
//!   round to nearest even and saturate at +-65504 (NaN stays NaN); E4M3 stores are `Fp8Format::encode`
//!   (saturating).
//!
//! The amax outputs are the largest `|x|` of the new f32 values before rounding to storage (NaN ignored),
//! and are *combined by max* into the given slots, so several ranges can fold into one slot; zero the slots
//! first for a fresh amax. The new FP8 weight is not written here: weights use current scaling (amax of
//! the new master, then scale, then cast), which needs this pass's amax first ([`control`]'s
//! `cast_weight_source`, or the cast family; block-scaled weights take each block's scale from its own
//! new values, `cast_weight_blocks`).
//!
//! # CPU / CUDA agreement
//! The CUDA kernels (`adam.cu`, `control.cu`) perform the same operations in the same order with explicit
//! round-to-nearest PTX instructions (`mul.rn`, `add.rn`, `div.rn`, `sqrt.rn`: no FMA contraction, no
//! flush-to-zero) and the same conversions (`cvt.rn.f16.f32`, `cvt.rn.satfinite.e4m3x2.f32`), so the new
//! states and the amaxes are bit-identical to the CPU's (`cpu.rs`) on every input, subnormals included.

pub mod control;
mod cpu;
mod cuda;

pub use control::{COEF_LEN, COEF_SKIP};

use crate::{Buffer, DType, Device, Element, KernelError};
use half::{bf16, f16};
use std::ops::Range;

/// Largest finite F16 (where F16 state stores saturate).
pub const F16_MAX: f32 = 65504.0;

/// Where weight decay enters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WeightDecay {
    /// Adam's L2 penalty: `weight_decay * w` is added to the gradient.
    L2,
    /// AdamW's decoupled decay: `w *= 1 - lr * weight_decay` before the Adam update.
    #[default]
    Decoupled,
}

/// Hyperparameters of Adam / AdamW.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay (0 for none).
    pub weight_decay: f64,
    /// L2 (Adam) or decoupled (AdamW).
    pub decay_mode: WeightDecay,
    /// Ascend instead of descend.
    pub maximize: bool,
}

impl Default for AdamConfig {
    /// PyTorch's AdamW defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decay_mode: WeightDecay::Decoupled,
            maximize: false,
        }
    }
}

/// The per-step f32 constants of the update (see the module docs); identical on CPU and CUDA.
/// The layout mirrors the kernel's `AdamCoef` (and the first words of a coefficient buffer).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamCoefficients {
    /// `beta1`.
    pub beta1: f32,
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// `weight_decay` (used by L2).
    pub weight_decay: f32,
    /// `1 - lr * weight_decay` (used by decoupled decay).
    pub decay: f32,
    /// Multiplies the gradient first (e.g. `1 / world_size` or a clipping coefficient).
    pub grad_scale: f32,
    /// Nonzero: ascend.
    pub maximize: i32,
    /// Nonzero: L2 weight decay.
    pub l2: i32,
    /// Nonzero: decoupled weight decay.
    pub decoupled: i32,
    /// Padding (keeps the size a multiple of 8 bytes).
    pub pad: i32,
}

// SAFETY: `AdamCoefficients` is `#[repr(C)]` plain data (f32/i32 fields) with the layout of the kernel's
// `AdamCoef` struct, so passing its bytes as a kernel parameter is sound.
unsafe impl cudarc::driver::DeviceRepr for AdamCoefficients {}

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

impl AdamConfig {
    /// Checks the hyperparameters (finite, `0 <= beta < 1`, `eps > 0`, `lr >= 0`, `weight_decay >= 0`).
    pub fn validate(&self) -> Result<(), KernelError> {
        let finite = [self.lr, self.beta1, self.beta2, self.eps, self.weight_decay]
            .iter()
            .all(|x| x.is_finite());
        if !finite {
            return Err(bad(
                "adam",
                format!("non-finite hyperparameter in {self:?}"),
            ));
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return Err(bad(
                "adam",
                format!("betas ({}, {}) must be in [0, 1)", self.beta1, self.beta2),
            ));
        }
        if self.eps <= 0.0 || self.lr < 0.0 || self.weight_decay < 0.0 {
            return Err(bad(
                "adam",
                format!(
                    "need eps > 0, lr >= 0, weight_decay >= 0 (got {}, {}, {})",
                    self.eps, self.lr, self.weight_decay
                ),
            ));
        }
        Ok(())
    }

    /// The f32 constants of step `step` (1-based, as in PyTorch) with gradient factor `grad_scale`: the
    /// arithmetic of the device-side control kernel (f64, powers by squaring), so coefficients computed
    /// here and there are the same bits.
    pub fn coefficients(
        &self,
        step: u64,
        grad_scale: f32,
    ) -> Result<AdamCoefficients, KernelError> {
        self.validate()?;
        if step == 0 {
            return Err(bad("adam", "step counts from 1".into()));
        }
        if !grad_scale.is_finite() {
            return Err(bad(
                "adam",
                format!("grad_scale {grad_scale} is not finite"),
            ));
        }
        let t = i32::try_from(step).unwrap_or(i32::MAX);
        Ok(cpu::coefficients(self, t, grad_scale))
    }
}

/// Where an Adam update takes its per-step constants.
#[derive(Debug, Clone, Copy)]
pub enum Coefficients<'a> {
    /// Computed on the host ([`AdamConfig::coefficients`]), passed to the kernel by value.
    Host(&'a AdamCoefficients),
    /// A coefficient buffer ([`COEF_LEN`] words on the states' device) written by
    /// [`control::adam_coefficients_from_stats`]: read on the device, so a GPU step never waits for the
    /// host. When its skip flag is set the update does nothing: weights, states and amaxes stay as they
    /// are (a zero learning rate would not do: the moments would still move).
    Device(&'a Buffer<f32>),
}

impl<'a> From<&'a AdamCoefficients> for Coefficients<'a> {
    fn from(c: &'a AdamCoefficients) -> Self {
        Coefficients::Host(c)
    }
}

/// One element of the update: returns the new `(w, m, v)` (the reference both devices implement).
#[inline]
pub fn adam_element(c: &AdamCoefficients, grad: f32, w: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let mut g = grad * c.grad_scale;
    if c.maximize != 0 {
        g = -g;
    }
    if c.l2 != 0 {
        g += c.weight_decay * w;
    }
    let m = m * c.beta1 + g * c.one_minus_beta1;
    let v = v * c.beta2 + (g * g) * c.one_minus_beta2;
    let mut w = w;
    if c.decoupled != 0 {
        w *= c.decay;
    }
    let denom = v.sqrt() / c.bc2_sqrt + c.eps;
    let w = w - c.step_size * (m / denom);
    (w, m, v)
}

/// Slots of the six scales of [`adam_step_low_precision`] in its scale buffer (from a base index).
pub mod lp_slot {
    /// Inverse scale the stored master weights are read with.
    pub const MASTER_SCALE_INV: usize = 0;
    /// Scale the new master weights are stored with.
    pub const MASTER_SCALE: usize = 1;
    /// Inverse scale the stored first moment is read with.
    pub const M_SCALE_INV: usize = 2;
    /// Scale the new first moment is stored with.
    pub const M_SCALE: usize = 3;
    /// Inverse scale the stored second moment is read with.
    pub const V_SCALE_INV: usize = 4;
    /// Scale the new second moment is stored with.
    pub const V_SCALE: usize = 5;
    /// Number of scale slots.
    pub const SCALES: usize = 6;
    /// Amax slot of the new master weights (from the amax base index).
    pub const AMAX_MASTER: usize = 0;
    /// Amax slot of the new first moment.
    pub const AMAX_M: usize = 1;
    /// Amax slot of the new second moment.
    pub const AMAX_V: usize = 2;
    /// Number of amax slots.
    pub const AMAXES: usize = 3;
}

/// Gradient element types the Adam kernels read: f32 or bf16.
pub trait AdamGrad: Element + Copy {
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
}
impl AdamGrad for f32 {
    fn to_f32(self) -> f32 {
        self
    }
}
impl AdamGrad for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Low-precision Adam states: f16 master, FP8 E4M3 first moment, f16 second moment.
#[derive(Debug)]
pub struct LowPrecisionAdamState<'a> {
    /// Master weights (`decode * master scale_inv`).
    pub master: &'a mut Buffer<f16>,
    /// First moment, E4M3 codes.
    pub m: &'a mut Buffer<u8>,
    /// Second moment.
    pub v: &'a mut Buffer<f16>,
}

/// A mutable run of f32 slots on a device (where amaxes are folded in by max).
#[derive(Debug)]
pub struct AmaxSlots<'a> {
    /// The buffer.
    pub buffer: &'a mut Buffer<f32>,
    /// Index of the first slot.
    pub base: usize,
}

/// Rounds to f16 with saturation at +-65504 (NaN stays NaN), as the kernel's `f32_to_f16_sat`.
#[inline]
pub fn f16_saturating(x: f32) -> f16 {
    let x = if x.abs() > F16_MAX {
        F16_MAX.copysign(x)
    } else {
        x
    };
    f16::from_f32(x)
}

fn check_range(
    what: &'static str,
    range: &Range<usize>,
    lens: &[usize],
) -> Result<(), KernelError> {
    if range.start > range.end {
        return Err(bad(what, format!("range {range:?} is reversed")));
    }
    for &len in lens {
        if range.end > len {
            return Err(bad(
                what,
                format!("range {range:?} exceeds a buffer of {len} elements"),
            ));
        }
    }
    Ok(())
}

fn check_slots(
    what: &'static str,
    len: usize,
    base: usize,
    count: usize,
) -> Result<(), KernelError> {
    if base.checked_add(count).is_none_or(|end| end > len) {
        return Err(bad(
            what,
            format!("slots {base}..{base}+{count} exceed a buffer of {len}"),
        ));
    }
    Ok(())
}

/// The host coefficients of a step, or `None` when a coefficient buffer says "skip" (CPU paths).
fn host_coefficients(
    what: &'static str,
    coef: Coefficients<'_>,
) -> Result<Option<AdamCoefficients>, KernelError> {
    match coef {
        Coefficients::Host(c) => Ok(Some(*c)),
        Coefficients::Device(b) => {
            check_slots(what, b.len(), 0, COEF_LEN)?;
            let (c, skip) = control::coefficient_words(b.host(what)?);
            Ok((!skip).then_some(c))
        }
    }
}

/// An error unless a device coefficient buffer has [`COEF_LEN`] words on the states' device.
fn check_coefficients(
    what: &'static str,
    coef: &Coefficients<'_>,
    device: &Device,
) -> Result<(), KernelError> {
    if let Coefficients::Device(b) = coef {
        check_slots(what, b.len(), 0, COEF_LEN)?;
        if b.device() != *device {
            return Err(KernelError::WrongDevice(what));
        }
    }
    Ok(())
}

/// Adam/AdamW on f32 states over `range` of the buffers (grad is indexed like the states). With `amax`,
/// the slot `amax.base` is raised to the amax of the new master values.
pub fn adam_step_f32<'c, G: AdamGrad>(
    coef: impl Into<Coefficients<'c>>,
    range: Range<usize>,
    master: &mut Buffer<f32>,
    m: &mut Buffer<f32>,
    v: &mut Buffer<f32>,
    grad: &Buffer<G>,
    amax: Option<AmaxSlots<'_>>,
) -> Result<(), KernelError> {
    let what = "adam_step_f32";
    let coef = coef.into();
    check_range(what, &range, &[master.len(), m.len(), v.len(), grad.len()])?;
    if let Some(a) = &amax {
        check_slots(what, a.buffer.len(), a.base, 1)?;
    }
    check_coefficients(what, &coef, &master.device())?;
    match master.device() {
        Device::Cpu => {
            let Some(c) = host_coefficients(what, coef)? else {
                return Ok(());
            };
            let g = &grad.host(what)?[range.clone()];
            let w = &mut master.host_mut(what)?[range.clone()];
            let mm = &mut m.host_mut(what)?[range.clone()];
            let vv = &mut v.host_mut(what)?[range.clone()];
            let new_amax = cpu::adam_f32(&c, w, mm, vv, g);
            if let Some(a) = amax {
                let slot = &mut a.buffer.host_mut(what)?[a.base];
                *slot = slot.max(new_amax);
            }
            Ok(())
        }
        Device::Cuda(dev) => cuda::adam_f32(&dev, coef, range, master, m, v, grad, amax),
    }
}

/// Adam/AdamW on low-precision states (f16 master, E4M3 m, f16 v) over `range`.
///
/// `scales[scale_base + lp_slot::*]` hold the six read/write scales; `amax.buffer[amax.base + 0..3]` are
/// raised to the amaxes of the new master, m and v. See the module docs for the exact semantics.
pub fn adam_step_low_precision<'c, G: AdamGrad>(
    coef: impl Into<Coefficients<'c>>,
    range: Range<usize>,
    state: LowPrecisionAdamState<'_>,
    grad: &Buffer<G>,
    scales: &Buffer<f32>,
    scale_base: usize,
    amax: AmaxSlots<'_>,
) -> Result<(), KernelError> {
    let what = "adam_step_low_precision";
    let coef = coef.into();
    let LowPrecisionAdamState { master, m, v } = state;
    check_range(what, &range, &[master.len(), m.len(), v.len(), grad.len()])?;
    check_slots(what, scales.len(), scale_base, lp_slot::SCALES)?;
    check_slots(what, amax.buffer.len(), amax.base, lp_slot::AMAXES)?;
    check_coefficients(what, &coef, &master.device())?;
    match master.device() {
        Device::Cpu => {
            let Some(c) = host_coefficients(what, coef)? else {
                return Ok(());
            };
            let s = scales.host(what)?;
            let sc: [f32; lp_slot::SCALES] = std::array::from_fn(|i| s[scale_base + i]);
            let g = &grad.host(what)?[range.clone()];
            let w = &mut master.host_mut(what)?[range.clone()];
            let mm = &mut m.host_mut(what)?[range.clone()];
            let vv = &mut v.host_mut(what)?[range.clone()];
            let new_amax = cpu::adam_low_precision(&c, &sc, w, mm, vv, g);
            let out = &mut amax.buffer.host_mut(what)?[amax.base..amax.base + lp_slot::AMAXES];
            for (o, n) in out.iter_mut().zip(new_amax) {
                *o = o.max(n);
            }
            Ok(())
        }
        Device::Cuda(dev) => cuda::adam_low_precision(
            &dev,
            coef,
            range,
            LowPrecisionAdamState { master, m, v },
            grad,
            scales,
            scale_base,
            amax,
        ),
    }
}

/// Bytes an Adam step must move per element (read grad + states, write states), for bandwidth figures.
pub fn bytes_per_element(low_precision: bool, grad: DType) -> usize {
    let g = grad.size_bytes();
    if low_precision {
        // read: grad, master f16, m u8, v f16; write: master, m, v.
        g + 2 * (2 + 1 + 2)
    } else {
        g + 2 * (4 + 4 + 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coefficients_follow_the_formula() {
        let cfg = AdamConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..AdamConfig::default()
        };
        let c = cfg.coefficients(3, 0.5).unwrap();
        assert_eq!(c.step_size, (0.01 / (1.0 - 0.9f64.powi(3))) as f32);
        assert_eq!(c.bc2_sqrt, (1.0 - 0.999f64.powi(3)).sqrt() as f32);
        assert_eq!(c.decay, (1.0 - 0.01 * 0.1) as f32);
        assert_eq!((c.l2, c.decoupled), (0, 1));
        let l2 = AdamConfig {
            decay_mode: WeightDecay::L2,
            ..cfg
        };
        let c = l2.coefficients(1, 1.0).unwrap();
        assert_eq!((c.l2, c.decoupled), (1, 0));
        assert!(cfg.coefficients(0, 1.0).is_err());
        assert!(cfg.coefficients(1, f32::NAN).is_err());
        assert!(AdamConfig { beta1: 1.0, ..cfg }.validate().is_err());
        assert!(AdamConfig { eps: 0.0, ..cfg }.validate().is_err());
    }

    #[test]
    fn f16_saturation() {
        assert_eq!(f16_saturating(1e6).to_f32(), 65504.0);
        assert_eq!(f16_saturating(-70000.0).to_f32(), -65504.0);
        assert_eq!(f16_saturating(1.0).to_f32(), 1.0);
        assert!(f16_saturating(f32::NAN).is_nan());
        assert_eq!(f16_saturating(f32::INFINITY).to_f32(), 65504.0);
    }
}
