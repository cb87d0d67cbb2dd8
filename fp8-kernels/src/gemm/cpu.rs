//! The CPU GEMMs: the `gemm` crate's f32 kernel (its own threading, see [`CpuParallelism`]) on f32 data;
//! bf16 inputs are widened exactly first, bf16 outputs rounded once at the end.

use super::{CpuParallelism, GemmOutput, GemmSpec, Transpose};
use crate::DType;
use crate::KernelError;
use rayon::prelude::*;

impl CpuParallelism {
    fn to_gemm(self) -> gemm::Parallelism {
        match self {
            CpuParallelism::Single => gemm::Parallelism::None,
            CpuParallelism::Rayon(n) => gemm::Parallelism::Rayon(n),
        }
    }
}

/// Below this many elements a conversion runs on the calling thread.
const PAR_MIN: usize = 1 << 16;

/// The CPU F32 GEMM on host slices: `c = alpha * op(a) * op(b) + beta * c` (row-major, see module docs).
pub fn gemm_f32_host(
    spec: &GemmSpec,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) -> Result<(), KernelError> {
    spec.check(a.len(), b.len(), c.len())?;
    let (m, n, k) = (spec.m, spec.n, spec.k);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        // Empty sum: only the beta term remains.
        if spec.beta == 0.0 {
            c.fill(0.0);
        } else {
            c.iter_mut().for_each(|x| *x *= spec.beta);
        }
        return Ok(());
    }
    // Strides in elements: (row stride, column stride) of op(A) [m, k] and op(B) [k, n].
    let (a_rs, a_cs) = match spec.trans_a {
        Transpose::No => (k as isize, 1),
        Transpose::Yes => (1, m as isize),
    };
    let (b_rs, b_cs) = match spec.trans_b {
        Transpose::No => (n as isize, 1),
        Transpose::Yes => (1, k as isize),
    };
    let read_dst = spec.beta != 0.0;
    // SAFETY: the lengths were checked above, so every index the strides reach lies inside `a`, `b` and
    // `c`; `c` is borrowed mutably and does not alias `a` or `b`. The crate's convention is
    // `dst = alpha' * dst + beta' * lhs * rhs`, hence our beta goes first.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            read_dst,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            spec.beta,
            spec.alpha,
            false,
            false,
            false,
            spec.parallelism.to_gemm(),
        );
    }
    Ok(())
}

/// Runs the f32 GEMM into an output of type `O` (f32 directly; bf16 through an f32 temporary rounded once).
pub(super) fn gemm_into_host<O: GemmOutput>(
    spec: &GemmSpec,
    a: &[f32],
    b: &[f32],
    c: &mut [O],
) -> Result<(), KernelError> {
    if O::DTYPE == DType::F32 {
        let c32: &mut [f32] = bytemuck::cast_slice_mut(c);
        return gemm_f32_host(spec, a, b, c32);
    }
    let mut tmp = if spec.beta != 0.0 {
        widen(c)
    } else {
        vec![0.0f32; c.len()]
    };
    gemm_f32_host(spec, a, b, &mut tmp)?;
    let round = |(o, &x): (&mut O, &f32)| *o = O::from_f32(x);
    if c.len() >= PAR_MIN {
        c.par_iter_mut().zip(tmp.par_iter()).for_each(round);
    } else {
        c.iter_mut().zip(tmp.iter()).for_each(round);
    }
    Ok(())
}

pub(super) fn widen<O: GemmOutput>(x: &[O]) -> Vec<f32> {
    if x.len() >= PAR_MIN {
        x.par_iter().map(|v| v.to_f32()).collect()
    } else {
        x.iter().map(|v| v.to_f32()).collect()
    }
}
