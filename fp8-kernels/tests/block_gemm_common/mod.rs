//! Shared by the block-scaled GEMM tests: random operands (codes without NaN or infinity, block scales
//! over 2^-12 .. 2^12, padding entries of the scale order set to a chosen value), the f64 reference of
//! the dequantized operands and the error scale of a call.
#![allow(dead_code)] // each test binary uses a different part

use fp8_core::{BlockLayout, Fp8Format, ScalingGranularity};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{BlockFp8Matrix, Buffer, Device, GemmSpec, ScaleOrder, Transpose};

/// The blocks of an operand seen K-major.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// 1x128 tiles along K.
    Tiles,
    /// 128x128 blocks.
    Blocks,
}

/// A block-scaled operand on the host, as stored.
#[derive(Debug, Clone)]
pub struct HostOperand {
    pub codes: Vec<u8>,
    pub format: Fp8Format,
    /// The stored layout (`[k, outer]` for an operand read transposed).
    pub layout: BlockLayout,
    pub order: ScaleOrder,
    /// Inverse scales at the order's indices, padding included.
    pub scale_inv: Vec<f32>,
    /// Stored `[k, outer]`.
    pub transposed: bool,
}

impl HostOperand {
    /// `decode(code) * scale_inv` of stored element `(r, c)`, in f64.
    pub fn value(&self, r: usize, c: usize) -> f64 {
        let st = self.order.strides(&self.layout).unwrap();
        let [br, bc] = self.layout.block_shape();
        let code = self.codes[r * self.layout.cols() + c];
        self.format.decode_table()[code as usize] as f64
            * self.scale_inv[st.index(r / br, c / bc)] as f64
    }

    /// The values K-major, `[outer, k]` row-major.
    pub fn k_major_values(&self) -> Vec<f64> {
        let (rows, cols) = (self.layout.rows(), self.layout.cols());
        let st = self.order.strides(&self.layout).unwrap();
        let [br, bc] = self.layout.block_shape();
        let table = self.format.decode_table();
        let stored = |r: usize, c: usize| {
            table[self.codes[r * cols + c] as usize] as f64
                * self.scale_inv[st.index(r / br, c / bc)] as f64
        };
        let (outer, k) = if self.transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        let mut v = Vec::with_capacity(outer * k);
        for i in 0..outer {
            for p in 0..k {
                v.push(if self.transposed {
                    stored(p, i)
                } else {
                    stored(i, p)
                });
            }
        }
        v
    }

    /// Codes and inverse scales on `dev`.
    pub fn upload(&self, dev: &Device) -> (Buffer<u8>, Buffer<f32>) {
        (
            dev.upload(&self.codes).unwrap(),
            dev.upload(&self.scale_inv).unwrap(),
        )
    }

    /// The GEMM operand of uploaded buffers.
    pub fn matrix<'a>(&self, (d, s): &'a (Buffer<u8>, Buffer<f32>)) -> BlockFp8Matrix<'a> {
        BlockFp8Matrix {
            data: d,
            format: self.format,
            layout: self.layout,
            scale_inv: s,
            scale_order: self.order,
        }
    }
}

/// A random code of `format` that is neither NaN nor infinite.
fn finite_code(r: &mut SplitMix64, format: Fp8Format) -> u8 {
    loop {
        let c = r.next_u64() as u8;
        if !format.is_nan(c) && !format.is_infinite(c) {
            return c;
        }
    }
}

/// Parameters of one random operand.
#[derive(Debug, Clone, Copy)]
pub struct OperandSpec {
    pub kind: Kind,
    pub transposed: bool,
    pub format: Fp8Format,
    pub order: ScaleOrder,
    /// Power-of-two scales (else 2^e times a factor in [1, 2)).
    pub pow2: bool,
    /// Value of the padding entries of the scale buffer (NaN: proves they are never read).
    pub pad: f32,
}

/// A random `outer x k` operand (seen K-major) as `spec` says.
pub fn operand(outer: usize, k: usize, spec: OperandSpec, seed: u64) -> HostOperand {
    let mut r = SplitMix64::new(seed);
    let g = match spec.kind {
        Kind::Tiles => ScalingGranularity::Block1x128,
        Kind::Blocks => ScalingGranularity::Block128x128,
    };
    let k_major = BlockLayout::new(outer, k, g).unwrap();
    let layout = if spec.transposed {
        k_major.transposed()
    } else {
        k_major
    };
    let codes = (0..layout.numel())
        .map(|_| finite_code(&mut r, spec.format))
        .collect();
    let st = spec.order.strides(&layout).unwrap();
    let mut scale_inv = vec![spec.pad; st.len];
    let [gr, gc] = layout.grid();
    for i in 0..gr {
        for j in 0..gc {
            let e = r.below(25) as i32 - 12;
            let f = if spec.pow2 { 1.0 } else { 1.0 + r.unit_f32() };
            scale_inv[st.index(i, j)] = 2f32.powi(e) * f;
        }
    }
    HostOperand {
        codes,
        format: spec.format,
        layout,
        order: spec.order,
        scale_inv,
        transposed: spec.transposed,
    }
}

/// The spec of `C [m, n] = alpha A B^T + beta C` for these operands (their transposes from how they are
/// stored).
pub fn gemm_spec(m: usize, n: usize, k: usize, a: &HostOperand, b: &HostOperand) -> GemmSpec {
    let ta = if a.transposed {
        Transpose::Yes
    } else {
        Transpose::No
    };
    let tb = if b.transposed {
        Transpose::No
    } else {
        Transpose::Yes
    };
    GemmSpec::new(m, n, k).transposes(ta, tb)
}

/// The f64 reference `alpha * sum_p A[i, p] B[j, p] + beta * c` of the dequantized operands, and the
/// error scale `|alpha| sum_p |A B| + |beta c|`.
pub fn reference(
    spec: &GemmSpec,
    a: &HostOperand,
    b: &HostOperand,
    c: &[f32],
) -> (Vec<f64>, Vec<f64>) {
    let (m, n, k) = (spec.m, spec.n, spec.k);
    let (av, bv) = (a.k_major_values(), b.k_major_values());
    let (alpha, beta) = (spec.alpha as f64, spec.beta as f64);
    let mut want = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (ar, br) = (&av[i * k..(i + 1) * k], &bv[j * k..(j + 1) * k]);
            let (mut s, mut s_abs) = (0.0f64, 0.0f64);
            for (x, y) in ar.iter().zip(br) {
                s += x * y;
                s_abs += (x * y).abs();
            }
            let old = if beta != 0.0 {
                beta * c[i * n + j] as f64
            } else {
                0.0
            };
            want[i * n + j] = alpha * s + old;
            mag[i * n + j] = alpha.abs() * s_abs + old.abs();
        }
    }
    (want, mag)
}
