//! Rotary position embedding (RoPE) in the Hugging Face "rotate-half" convention of
//! `LlamaForCausalLM`, applied to the output of a fused QKV projection.
//!
//! # Layout
//! The projection writes, per token, `[Q: H*hd | K: KV*hd | V: KV*hd]` (row-major, tokens `[B, T]`;
//! grouped-query attention when `KV < H`, `KV` dividing `H`; with `KV == H` this is the
//! `[B, T, 3, H, hd]` layout of [`crate::attention`]). Token `t` of each sequence has position
//! `start_pos + t` (`start_pos` > 0 when sampling with a KV cache).
//!
//! # Definitions (both devices, f32 arithmetic, one rounding per operation, never fused)
//! For every Q and K head and `i < hd/2`, with `c = cos[pos, i]`, `s = sin[pos, i]` from the
//! [`RopeTable`], `x1 = x[i]`, `x2 = x[i + hd/2]`:
//! - forward: `out[i] = x1*c - x2*s`, `out[i + hd/2] = x2*c + x1*s`;
//! - backward (the transposed rotation, on `dQ` and `dK`): `dx[i] = d1*c + d2*s`,
//!   `dx[i + hd/2] = d2*c - d1*s`, computed as the forward with `-s` (negating is exact, so the two are
//!   exact inverses up to the roundings of the products and sums);
//! - V (and dV) is copied unchanged.
//!
//! Each result is rounded once to the element type `T`. The tables are computed once on the host, so the
//! CPU and CUDA kernels perform the same operations on the same numbers and agree bit for bit.
//!
//! Out of place: the rotated copy goes to a second buffer of the same layout (the attention kernels read
//! it; the projection output itself is not needed again, the backward needs only the tables).
//!
//! # Tables
//! `inv_freq[i] = 1 / theta^(2i / hd)` as in transformers' default RoPE, optionally rewritten by the
//! Llama-3 frequency scaling ([`Llama3RopeScaling`], `_compute_llama3_parameters`). Unlike transformers,
//! which evaluates `inv_freq`, `position * inv_freq` and `cos`/`sin` in f32, everything is computed in
//! f64 and rounded to f32 once at the end: the f32 product `position * inv_freq` loses up to
//! `position * 2^-24` radians (about 5e-4 at position 8192), which the f64 table does not. The tables
//! differ from transformers' by at most that error, and are as close to the true values as f32 allows.

mod cpu;
mod cuda;

use crate::device::device_of;
use crate::{check_len, Buffer, Device, FloatElement, KernelError};

/// The Llama-3 rewrite of the RoPE frequencies (`rope_scaling` with `rope_type: "llama3"` in a Hugging
/// Face config): long wavelengths are stretched by `factor`, short ones kept, and the band between
/// interpolated smoothly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// Stretch of the low frequencies (8 for Llama 3.1).
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are divided by `factor`
    /// (1 for Llama 3.1).
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept (4 for Llama 3.1).
    pub high_freq_factor: f64,
    /// The context length of pre-training (8192 for Llama 3.1).
    pub original_max_position_embeddings: usize,
}

impl Llama3RopeScaling {
    /// The values of Llama 3.1's configs: factor 8, low 1, high 4, original context 8192.
    pub fn llama3_1() -> Self {
        Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    }

    fn check(&self, what: &'static str) -> Result<(), KernelError> {
        let finite_pos = |v: f64| v.is_finite() && v > 0.0;
        if !(finite_pos(self.factor)
            && finite_pos(self.low_freq_factor)
            && finite_pos(self.high_freq_factor)
            && self.high_freq_factor > self.low_freq_factor
            && self.original_max_position_embeddings > 0)
        {
            return Err(bad(
                what,
                format!(
                    "llama3 scaling {self:?}: factors must be finite and positive, \
                     high_freq_factor > low_freq_factor, original context > 0"
                ),
            ));
        }
        Ok(())
    }
}

/// What a [`RopeTable`] is built from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    /// Positions the table covers (`start_pos + T` of a call may not exceed it).
    pub max_positions: usize,
    /// Head dimension (even, > 0).
    pub head_dim: usize,
    /// The base of the frequencies (`rope_theta`: 10000 for Llama 2, 500000 for Llama 3).
    pub theta: f64,
    /// The Llama-3 rewrite of the frequencies, if the model uses it.
    pub scaling: Option<Llama3RopeScaling>,
}

fn bad(what: &'static str, detail: String) -> KernelError {
    KernelError::InvalidArgument { what, detail }
}

fn check_head_dim(what: &'static str, head_dim: usize, theta: f64) -> Result<(), KernelError> {
    if head_dim == 0 || head_dim % 2 != 0 || head_dim > i32::MAX as usize {
        return Err(bad(
            what,
            format!("head_dim {head_dim} must be even and positive"),
        ));
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(bad(
            what,
            format!("theta {theta} must be finite and positive"),
        ));
    }
    Ok(())
}

/// The `head_dim / 2` rotation frequencies (radians per position), in f64: `1 / theta^(2i / head_dim)`,
/// rewritten by `scaling` as transformers' `_compute_llama3_parameters` does:
/// with `wavelen = 2 pi / f`, `low = original / low_freq_factor`, `high = original / high_freq_factor`,
/// - `wavelen < high`: `f` (high frequencies unchanged);
/// - `wavelen > low`: `f / factor`;
/// - otherwise, with `smooth = (original / wavelen - low_freq_factor) / (high_freq_factor -
///   low_freq_factor)`: `(1 - smooth) * f / factor + smooth * f`.
pub fn inv_freq(
    head_dim: usize,
    theta: f64,
    scaling: Option<Llama3RopeScaling>,
) -> Result<Vec<f64>, KernelError> {
    const WHAT: &str = "inv_freq";
    check_head_dim(WHAT, head_dim, theta)?;
    if let Some(s) = &scaling {
        s.check(WHAT)?;
    }
    Ok((0..head_dim / 2)
        .map(|i| {
            let f = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            match &scaling {
                None => f,
                Some(s) => llama3_frequency(f, s),
            }
        })
        .collect())
}

/// One frequency through the Llama-3 rewrite (see [`inv_freq`]).
fn llama3_frequency(f: f64, s: &Llama3RopeScaling) -> f64 {
    let original = s.original_max_position_embeddings as f64;
    let low_freq_wavelen = original / s.low_freq_factor;
    let high_freq_wavelen = original / s.high_freq_factor;
    let wavelen = 2.0 * std::f64::consts::PI / f;
    if wavelen < high_freq_wavelen {
        f
    } else if wavelen > low_freq_wavelen {
        f / s.factor
    } else {
        let smooth =
            (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * f / s.factor + smooth * f
    }
}

/// The cosines and sines of every position and frequency, f32 `[max_positions, head_dim / 2]` each,
/// computed in f64 on the host and rounded once, then kept on one device.
#[derive(Debug)]
pub struct RopeTable {
    spec: RopeSpec,
    /// `cos[p * head_dim/2 + i] = f32(cos(p * inv_freq[i]))`.
    pub cos: Buffer<f32>,
    /// `sin[p * head_dim/2 + i] = f32(sin(p * inv_freq[i]))`.
    pub sin: Buffer<f32>,
}

impl RopeTable {
    /// Computes the tables of `spec` and uploads them to `device`.
    pub fn new(device: &Device, spec: RopeSpec) -> Result<Self, KernelError> {
        let (cos, sin) = Self::host_tables(spec)?;
        Ok(RopeTable {
            spec,
            cos: device.upload(&cos)?,
            sin: device.upload(&sin)?,
        })
    }

    /// The host values of the tables ([`RopeTable::cos`], [`RopeTable::sin`]) of `spec`.
    pub fn host_tables(spec: RopeSpec) -> Result<(Vec<f32>, Vec<f32>), KernelError> {
        const WHAT: &str = "RopeTable::host_tables";
        let freq = inv_freq(spec.head_dim, spec.theta, spec.scaling)?;
        if spec.max_positions == 0 || spec.max_positions > i32::MAX as usize {
            return Err(bad(
                WHAT,
                format!("max_positions {} out of range", spec.max_positions),
            ));
        }
        let half = spec.head_dim / 2;
        let n = spec
            .max_positions
            .checked_mul(half)
            .ok_or_else(|| bad(WHAT, "table size overflows".into()))?;
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for p in 0..spec.max_positions {
            for &f in &freq {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        Ok((cos, sin))
    }

    /// What the table was built from.
    pub fn spec(&self) -> RopeSpec {
        self.spec
    }

    /// The device the tables live on.
    pub fn device(&self) -> Device {
        self.cos.device()
    }
}

/// The shape of one RoPE call: `batch * seq` tokens of `heads` query heads and `kv_heads` key and value
/// heads of `head_dim` each (the table's head dim), positions `start_pos .. start_pos + seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads `H`.
    pub heads: usize,
    /// Key/value heads `KV` (divides `H`).
    pub kv_heads: usize,
    /// Position of each sequence's first token.
    pub start_pos: usize,
}

impl RopeShape {
    /// Elements per token: `(H + 2 KV) * head_dim`.
    pub fn token_width(&self, head_dim: usize) -> usize {
        (self.heads + 2 * self.kv_heads) * head_dim
    }

    /// Checks the shape against the table and returns the elements of one buffer.
    fn elements(&self, what: &'static str, spec: &RopeSpec) -> Result<usize, KernelError> {
        let s = self;
        if s.heads == 0 || s.kv_heads == 0 || s.heads % s.kv_heads != 0 {
            return Err(bad(
                what,
                format!(
                    "heads {} and kv_heads {}: both positive, kv_heads dividing heads",
                    s.heads, s.kv_heads
                ),
            ));
        }
        let end = s.start_pos.checked_add(s.seq);
        if end.is_none_or(|e| e > spec.max_positions) {
            return Err(bad(
                what,
                format!(
                    "positions {}..{}+{} exceed the table's {}",
                    s.start_pos, s.start_pos, s.seq, spec.max_positions
                ),
            ));
        }
        s.heads
            .checked_add(2 * s.kv_heads)
            .and_then(|h| h.checked_mul(spec.head_dim))
            .and_then(|w| w.checked_mul(s.seq))
            .and_then(|w| w.checked_mul(s.batch))
            .ok_or_else(|| bad(what, format!("shape {s:?} overflows")))
    }
}

/// Direction of the rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    Forward,
    Backward,
}

fn run<T: FloatElement>(
    what: &'static str,
    table: &RopeTable,
    x: &Buffer<T>,
    out: &mut Buffer<T>,
    shape: RopeShape,
    direction: Direction,
) -> Result<(), KernelError> {
    let n = shape.elements(what, &table.spec)?;
    check_len(what, n, x.len())?;
    check_len(what, n, out.len())?;
    let hd = table.spec.head_dim;
    match device_of(what, &[x, out, &table.cos, &table.sin])? {
        None => {
            cpu::rotate(
                x.host(what)?,
                out.host_mut(what)?,
                table.cos.host(what)?,
                table.sin.host(what)?,
                shape,
                hd,
                direction,
            );
            Ok(())
        }
        Some(dev) => cuda::rotate(&dev, what, table, x, out, shape, direction),
    }
}

/// Forward: `out` = the fused projection output `qkv` with every Q and K head rotated (rotate-half) by
/// its token's position, V copied. `qkv` and `out` are `[batch * seq, (H + 2 KV) * head_dim]`.
pub fn rope_forward<T: FloatElement>(
    table: &RopeTable,
    qkv: &Buffer<T>,
    out: &mut Buffer<T>,
    shape: RopeShape,
) -> Result<(), KernelError> {
    run("rope_forward", table, qkv, out, shape, Direction::Forward)
}

/// Backward: `d_qkv` = the gradient of the fused projection output from the gradient `d_out` of
/// [`rope_forward`]'s output: dQ and dK rotated back (the transposed rotation), dV copied.
pub fn rope_backward<T: FloatElement>(
    table: &RopeTable,
    d_out: &Buffer<T>,
    d_qkv: &mut Buffer<T>,
    shape: RopeShape,
) -> Result<(), KernelError> {
    run(
        "rope_backward",
        table,
        d_out,
        d_qkv,
        shape,
        Direction::Backward,
    )
}
