//! Fused Adam / AdamW over a range of a shard: one pass reads the gradient and the states, writes the new
//! states, and reports the amaxes of the new values (for the next scales and the next FP8 weights).
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
//! on the host in f64 and rounded to f32 ([`AdamConfig::coefficients`]), and both devices use those f32
//! values.
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
//! the new master, then scale, then cast), which needs this pass's amax first; cast with `crate::cast`.
//!
//! # CPU / CUDA agreement
//! The CUDA kernel (`cuda/adam.cu`) performs the same operations in the same order with explicit
//! round-to-nearest PTX instructions (`mul.rn`, `add.rn`, `div.rn`, `sqrt.rn`: no FMA contraction, no
//! flush-to-zero) and the same conversions (`cvt.rn.f16.f32`, `cvt.rn.satfinite.e4m3x2.f32`), so the new
//! states and the amaxes are bit-identical to the CPU's on every input, subnormals included.

use crate::kernel_source::KernelModule;
use crate::{Buffer, CudaDevice, DType, Device, Element, KernelError};
use cudarc::driver::{DevicePtrMut, LaunchConfig, PushKernelArg};
use fp8_core::Fp8Format;
use half::{bf16, f16};
use rayon::prelude::*;
use std::ops::Range;

/// The Adam kernels (F32 and low-precision states, f32 and bf16 gradients).
pub const ADAM_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_adam",
    files: &["common.cuh", "adam.cu"],
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/adam.cu")
    ),
};

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
/// The layout mirrors the kernel's `AdamCoef`.
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

    /// The f32 constants of step `step` (1-based, as in PyTorch) with gradient factor `grad_scale`.
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
        let t = i32::try_from(step.min(i32::MAX as u64)).unwrap_or(i32::MAX);
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        let wd = self.weight_decay != 0.0;
        Ok(AdamCoefficients {
            beta1: self.beta1 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            step_size: (self.lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: self.eps as f32,
            weight_decay: self.weight_decay as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            grad_scale,
            maximize: i32::from(self.maximize),
            l2: i32::from(wd && self.decay_mode == WeightDecay::L2),
            decoupled: i32::from(wd && self.decay_mode == WeightDecay::Decoupled),
            pad: 0,
        })
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

/// Low-precision optimizer states of one shard: f16 master, FP8 E4M3 first moment, f16 second moment.
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
    let x = if x.abs() > 65504.0 {
        65504.0f32.copysign(x)
    } else {
        x
    };
    f16::from_f32(x)
}

/// Elements per rayon task on the CPU.
const CPU_CHUNK: usize = 1 << 14;

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

fn max_nan_ignored(a: f32, b: f32) -> f32 {
    // f32::max returns the non-NaN operand, like the kernel's NaN-as-zero integer max.
    a.max(b)
}

/// Adam/AdamW on f32 states over `range` of the buffers (grad is indexed like the states). With `amax`,
/// the slot `amax.base` is raised to the amax of the new master values.
pub fn adam_step_f32<G: AdamGrad>(
    coef: &AdamCoefficients,
    range: Range<usize>,
    master: &mut Buffer<f32>,
    m: &mut Buffer<f32>,
    v: &mut Buffer<f32>,
    grad: &Buffer<G>,
    amax: Option<AmaxSlots<'_>>,
) -> Result<(), KernelError> {
    let what = "adam_step_f32";
    check_range(what, &range, &[master.len(), m.len(), v.len(), grad.len()])?;
    if let Some(a) = &amax {
        check_slots(what, a.buffer.len(), a.base, 1)?;
    }
    match master.device() {
        Device::Cpu => {
            let g = &grad.host(what)?[range.clone()];
            let w = &mut master.host_mut(what)?[range.clone()];
            let mm = &mut m.host_mut(what)?[range.clone()];
            let vv = &mut v.host_mut(what)?[range.clone()];
            let amax_new = w
                .par_chunks_mut(CPU_CHUNK)
                .zip(mm.par_chunks_mut(CPU_CHUNK))
                .zip(vv.par_chunks_mut(CPU_CHUNK))
                .zip(g.par_chunks(CPU_CHUNK))
                .map(|(((w, m), v), g)| {
                    let mut a = 0.0f32;
                    for i in 0..w.len() {
                        let (nw, nm, nv) = adam_element(coef, g[i].to_f32(), w[i], m[i], v[i]);
                        w[i] = nw;
                        m[i] = nm;
                        v[i] = nv;
                        a = max_nan_ignored(a, nw.abs());
                    }
                    a
                })
                .reduce(|| 0.0, max_nan_ignored);
            if let Some(a) = amax {
                let slot = &mut a.buffer.host_mut(what)?[a.base];
                *slot = max_nan_ignored(*slot, amax_new);
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
pub fn adam_step_low_precision<G: AdamGrad>(
    coef: &AdamCoefficients,
    range: Range<usize>,
    state: LowPrecisionAdamState<'_>,
    grad: &Buffer<G>,
    scales: &Buffer<f32>,
    scale_base: usize,
    amax: AmaxSlots<'_>,
) -> Result<(), KernelError> {
    let what = "adam_step_low_precision";
    let LowPrecisionAdamState { master, m, v } = state;
    check_range(what, &range, &[master.len(), m.len(), v.len(), grad.len()])?;
    check_slots(what, scales.len(), scale_base, lp_slot::SCALES)?;
    check_slots(what, amax.buffer.len(), amax.base, lp_slot::AMAXES)?;
    match master.device() {
        Device::Cpu => {
            let s = scales.host(what)?;
            let sc: [f32; lp_slot::SCALES] = std::array::from_fn(|i| s[scale_base + i]);
            let g = &grad.host(what)?[range.clone()];
            let w = &mut master.host_mut(what)?[range.clone()];
            let mm = &mut m.host_mut(what)?[range.clone()];
            let vv = &mut v.host_mut(what)?[range.clone()];
            let e4m3 = Fp8Format::E4M3;
            let table = e4m3.decode_table();
            let new_amax = w
                .par_chunks_mut(CPU_CHUNK)
                .zip(mm.par_chunks_mut(CPU_CHUNK))
                .zip(vv.par_chunks_mut(CPU_CHUNK))
                .zip(g.par_chunks(CPU_CHUNK))
                .map(|(((w, m), v), g)| {
                    let mut a = [0.0f32; 3];
                    for i in 0..w.len() {
                        let w0 = w[i].to_f32() * sc[lp_slot::MASTER_SCALE_INV];
                        let m0 = table[m[i] as usize] * sc[lp_slot::M_SCALE_INV];
                        let v0 = v[i].to_f32() * sc[lp_slot::V_SCALE_INV];
                        let (nw, nm, nv) = adam_element(coef, g[i].to_f32(), w0, m0, v0);
                        a[0] = max_nan_ignored(a[0], nw.abs());
                        a[1] = max_nan_ignored(a[1], nm.abs());
                        a[2] = max_nan_ignored(a[2], nv.abs());
                        w[i] = f16_saturating(nw * sc[lp_slot::MASTER_SCALE]);
                        v[i] = f16_saturating(nv * sc[lp_slot::V_SCALE]);
                        m[i] = e4m3.encode(nm * sc[lp_slot::M_SCALE]);
                    }
                    a
                })
                .reduce(
                    || [0.0; 3],
                    |x, y| std::array::from_fn(|i| max_nan_ignored(x[i], y[i])),
                );
            let out = &mut amax.buffer.host_mut(what)?[amax.base..amax.base + 3];
            for (o, n) in out.iter_mut().zip(new_amax) {
                *o = max_nan_ignored(*o, n);
            }
            Ok(())
        }
        Device::Cuda(dev) => cuda::adam_lp(
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

mod cuda {
    use super::*;

    fn same(what: &'static str, dev: &CudaDevice, d: Device) -> Result<(), KernelError> {
        if d == Device::Cuda(dev.clone()) {
            Ok(())
        } else {
            Err(KernelError::WrongDevice(what))
        }
    }

    fn launch_config(dev: &CudaDevice, n: usize) -> Result<LaunchConfig, KernelError> {
        let sms = crate::kernel_source::sm_count(dev)?;
        // Each thread takes 8 elements per iteration.
        Ok(crate::kernel_source::grid_1d(
            sms,
            (n as u64).div_ceil(8),
            8,
        ))
    }

    fn grad_suffix<G: AdamGrad>() -> Result<&'static str, KernelError> {
        match G::DTYPE {
            DType::F32 => Ok("f32"),
            DType::BF16 => Ok("bf16"),
            other => Err(bad("adam", format!("{other} gradients are not supported"))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn adam_f32<G: AdamGrad>(
        dev: &CudaDevice,
        coef: &AdamCoefficients,
        range: Range<usize>,
        master: &mut Buffer<f32>,
        m: &mut Buffer<f32>,
        v: &mut Buffer<f32>,
        grad: &Buffer<G>,
        amax: Option<AmaxSlots<'_>>,
    ) -> Result<(), KernelError> {
        let what = "adam_step_f32";
        same(what, dev, m.device())?;
        same(what, dev, v.device())?;
        same(what, dev, grad.device())?;
        let n = range.len();
        if n == 0 {
            return Ok(());
        }
        let name = format!("adam_f32_g_{}", grad_suffix::<G>()?);
        let f = crate::kernel_source::function(dev, &ADAM_MODULE, &name)?;
        let stream = dev.stream().clone();
        let cfg = launch_config(dev, n)?;
        let (off, len) = (range.start as u64, n as u64);
        let gs = grad.as_cuda().ok_or(KernelError::WrongDevice(what))?.0;
        let ms = m.as_cuda_mut().ok_or(KernelError::WrongDevice(what))?.0;
        let vs = v.as_cuda_mut().ok_or(KernelError::WrongDevice(what))?.0;
        let ws = master
            .as_cuda_mut()
            .ok_or(KernelError::WrongDevice(what))?
            .0;
        let mut amax_buf = amax;
        let (amax_ptr, slot, _guard) = match amax_buf.as_mut() {
            Some(a) => {
                same(what, dev, a.buffer.device())?;
                let s = a
                    .buffer
                    .as_cuda_mut()
                    .ok_or(KernelError::WrongDevice(what))?
                    .0;
                let (p, g) = s.device_ptr_mut(&stream);
                (p, a.base as u64, Some(g))
            }
            None => (0u64, 0u64, None),
        };
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(ws)
            .arg(ms)
            .arg(vs)
            .arg(gs)
            .arg(&off)
            .arg(&len)
            .arg(coef)
            .arg(&amax_ptr)
            .arg(&slot);
        // SAFETY: the kernel touches elements offset..offset+n of master, m, v and grad (checked against
        // their lengths) and one amax slot (checked) or none (null pointer); the argument list matches
        // `adam_f32_g_*` (3 x float*, const G*, 2 x u64, AdamCoef by value, float*, u64).
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn adam_lp<G: AdamGrad>(
        dev: &CudaDevice,
        coef: &AdamCoefficients,
        range: Range<usize>,
        state: LowPrecisionAdamState<'_>,
        grad: &Buffer<G>,
        scales: &Buffer<f32>,
        scale_base: usize,
        amax: AmaxSlots<'_>,
    ) -> Result<(), KernelError> {
        let what = "adam_step_low_precision";
        let LowPrecisionAdamState { master, m, v } = state;
        for d in [
            m.device(),
            v.device(),
            grad.device(),
            scales.device(),
            amax.buffer.device(),
        ] {
            same(what, dev, d)?;
        }
        dev.require_fp8()?;
        let n = range.len();
        if n == 0 {
            return Ok(());
        }
        let name = format!("adam_lp_g_{}", grad_suffix::<G>()?);
        let f = crate::kernel_source::function(dev, &ADAM_MODULE, &name)?;
        let stream = dev.stream().clone();
        let cfg = launch_config(dev, n)?;
        let (off, len) = (range.start as u64, n as u64);
        let (sbase, abase) = (scale_base as u64, amax.base as u64);
        let gs = grad.as_cuda().ok_or(KernelError::WrongDevice(what))?.0;
        let ss = scales.as_cuda().ok_or(KernelError::WrongDevice(what))?.0;
        let ms = m.as_cuda_mut().ok_or(KernelError::WrongDevice(what))?.0;
        let vs = v.as_cuda_mut().ok_or(KernelError::WrongDevice(what))?.0;
        let ws = master
            .as_cuda_mut()
            .ok_or(KernelError::WrongDevice(what))?
            .0;
        let amax_s = amax
            .buffer
            .as_cuda_mut()
            .ok_or(KernelError::WrongDevice(what))?
            .0;
        let (amax_ptr, _guard) = amax_s.device_ptr_mut(&stream);
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(ws)
            .arg(ms)
            .arg(vs)
            .arg(gs)
            .arg(&off)
            .arg(&len)
            .arg(coef)
            .arg(ss)
            .arg(&sbase)
            .arg(&amax_ptr)
            .arg(&abase);
        // SAFETY: the kernel touches elements offset..offset+n of the states and grad (checked), reads six
        // scales from sbase and raises three amax slots from abase (both checked); the argument list
        // matches `adam_lp_g_*` (u16*, u8*, u16*, const G*, 2 x u64, AdamCoef, const float*, u64,
        // float*, u64).
        unsafe { launch.launch(cfg) }?;
        Ok(())
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
