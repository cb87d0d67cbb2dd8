//! Shared by the attention tests: random inputs, the CPU reference, and the per-tensor comparison with
//! its stated tolerances and diagnostics (worst element, range of query rows out of tolerance). Also home
//! of the host emulator of the kernels (`emulator.cpp`, see `attention_emulated.rs`).
#![allow(dead_code)] // each test binary uses a different part

use fp8_kernels::attention::{
    cpu, dkdv_variants, dq_variants, forward_variants, AttentionShape, BackwardKernels,
    LayoutProbe, QueryTiles, WgmmaProbe, WGMMA_HEAD_DIMS,
};
use fp8_kernels::rng::SplitMix64;
use half::bf16;

pub struct Inputs {
    pub shape: AttentionShape,
    pub x: Vec<bf16>,
    pub dy: Vec<bf16>,
}

/// qkv with unit variance (so scores have about unit variance at the default scale), d_out in [-1, 1].
pub fn inputs(shape: AttentionShape, seed: u64) -> Inputs {
    let mut r = SplitMix64::new(seed);
    let x = (0..shape.qkv_len())
        .map(|_| bf16::from_f32(r.uniform_f32() * 1.732))
        .collect();
    let dy = (0..shape.out_len())
        .map(|_| bf16::from_f32(r.uniform_f32()))
        .collect();
    Inputs { shape, x, dy }
}

/// out, lse and d_qkv as F32.
pub struct Outputs {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    pub dqkv: Vec<f32>,
}

pub fn reference(inp: &Inputs, scale: f32) -> Outputs {
    let s = &inp.shape;
    let x: Vec<f32> = inp.x.iter().map(|v| v.to_f32()).collect();
    let dy: Vec<f32> = inp.dy.iter().map(|v| v.to_f32()).collect();
    let mut out = vec![0.0f32; s.out_len()];
    let mut lse = vec![0.0f32; s.lse_len()];
    cpu::forward(s, scale, &x, &mut out, &mut lse);
    let mut dqkv = vec![0.0f32; s.qkv_len()];
    cpu::backward(s, scale, &x, &dy, &mut dqkv);
    Outputs { out, lse, dqkv }
}

/// Slot `w` (0 = q, 1 = k, 2 = v) of a `qkv`-layout array (`[B, T, (H + 2*KV) * hd]`) as
/// `[B, T, H, hd]` (q) or `[B, T, KV, hd]` (k, v).
pub fn slot(s: &AttentionShape, v: &[f32], w: usize) -> Vec<f32> {
    let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let (start, len) = [(0, q), (q, kv), (q + kv, kv)][w];
    v.chunks(s.qkv_width())
        .flat_map(|row| row[start..start + len].iter().copied())
        .collect()
}

/// The shape whose `[B, T, heads, hd]` layout slot `w` of [`slot`] has (for [`coords`]): `s` for q, `s`
/// with `kv_heads` heads for k and v.
pub fn slot_shape(s: &AttentionShape, w: usize) -> AttentionShape {
    match w {
        0 => *s,
        _ => AttentionShape::new(s.batch, s.kv_heads, s.seq_len, s.head_dim),
    }
}

/// `qkv` of the multi-head problem equivalent to the grouped-query `qkv` of `s` (Hugging Face's
/// `repeat_kv`): every key/value head repeated for each query head of its group, in the layout of
/// `AttentionShape::new(B, H, T, hd)`.
pub fn expand_kv<T: Copy>(s: &AttentionShape, qkv: &[T]) -> Vec<T> {
    let (hd, h, g) = (s.head_dim, s.heads, s.group());
    let mut out = Vec::with_capacity(s.batch * s.seq_len * 3 * h * hd);
    for row in qkv.chunks(s.qkv_width()) {
        out.extend_from_slice(&row[..h * hd]);
        for part in [h * hd, (h + s.kv_heads) * hd] {
            for head in 0..h {
                let at = part + (head / g) * hd;
                out.extend_from_slice(&row[at..at + hd]);
            }
        }
    }
    out
}

/// Which layout a flat index is in, to name `(b, t, h, d)` and the query row `t`.
#[derive(Clone, Copy)]
pub enum Layout {
    /// `[B, T, H, hd]`
    Rows,
    /// `[B, H, T]`
    Lse,
}

pub fn coords(s: &AttentionShape, layout: Layout, i: usize) -> (usize, usize, usize, usize) {
    match layout {
        Layout::Rows => {
            let d = i % s.head_dim;
            let h = (i / s.head_dim) % s.heads;
            let t = (i / s.model_dim()) % s.seq_len;
            (i / (s.model_dim() * s.seq_len), t, h, d)
        }
        Layout::Lse => {
            let t = i % s.seq_len;
            let h = (i / s.seq_len) % s.heads;
            (i / (s.seq_len * s.heads), t, h, 0)
        }
    }
}

pub struct Tol {
    pub max_rel: f64,
    pub abs: f64,
    pub l2: f64,
}

pub const OUT_TOL: Tol = Tol {
    max_rel: 2e-2,
    abs: 1e-4,
    l2: 1e-2,
};
pub const GRAD_TOL: Tol = Tol {
    max_rel: 2e-2,
    abs: 1e-4,
    l2: 2e-2,
};

/// Compares one tensor; prints a line; returns a failure description.
pub fn check(
    label: &str,
    name: &str,
    s: &AttentionShape,
    layout: Layout,
    got: &[f32],
    want: &[f32],
    tol: &Tol,
) -> Option<String> {
    let max_ref = want.iter().fold(0.0f64, |a, &b| a.max(b.abs() as f64));
    let (mut worst, mut worst_i, mut e2, mut r2, mut nonfinite) = (0.0f64, 0usize, 0.0f64, 0.0, 0);
    let limit = match layout {
        Layout::Lse => 1e-3 * max_ref.max(1.0),
        Layout::Rows => tol.max_rel * max_ref + tol.abs,
    };
    let (mut bad_rows, mut first_bad, mut last_bad) = (0usize, usize::MAX, 0usize);
    let mut row_bad = vec![false; s.seq_len];
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !g.is_finite() {
            nonfinite += 1;
        }
        let e = (g as f64 - w as f64).abs();
        let e = if e.is_nan() { f64::INFINITY } else { e };
        if e > worst {
            worst = e;
            worst_i = i;
        }
        e2 += e.min(1e30).powi(2);
        r2 += (w as f64).powi(2);
        if e > limit {
            row_bad[coords(s, layout, i).1] = true;
        }
    }
    for (t, &b) in row_bad.iter().enumerate() {
        if b {
            bad_rows += 1;
            first_bad = first_bad.min(t);
            last_bad = t;
        }
    }
    let rel_l2 = if r2 > 0.0 {
        (e2 / r2).sqrt()
    } else {
        e2.sqrt()
    };
    let (b, t, h, d) = coords(s, layout, worst_i);
    let l2_ok = max_ref <= 1e-3 || layout_is_lse(layout) || rel_l2 <= tol.l2;
    let ok = worst <= limit && l2_ok && nonfinite == 0;
    let rows = if bad_rows > 0 {
        format!(" rows t out of tolerance: {bad_rows} in {first_bad}..={last_bad}")
    } else {
        String::new()
    };
    let line = format!(
        "{} {label} {name:>4}: max|err| {worst:.3e} (limit {limit:.3e}, max|ref| {max_ref:.3e}) rel_l2 \
         {rel_l2:.2e} worst at (b {b}, t {t}, h {h}, d {d}) got {} want {}{}{rows}",
        if ok { "ok  " } else { "FAIL" },
        got.get(worst_i).copied().unwrap_or(f32::NAN),
        want.get(worst_i).copied().unwrap_or(f32::NAN),
        if nonfinite > 0 {
            format!(" NON-FINITE: {nonfinite}")
        } else {
            String::new()
        },
    );
    println!("{line}");
    (!ok).then_some(line)
}

fn layout_is_lse(l: Layout) -> bool {
    matches!(l, Layout::Lse)
}

/// Compares every output of `got` with `want`; returns the failures.
pub fn check_all(label: &str, s: &AttentionShape, got: &Outputs, want: &Outputs) -> Vec<String> {
    let mut fails = Vec::new();
    fails.extend(check(
        label,
        "out",
        s,
        Layout::Rows,
        &got.out,
        &want.out,
        &OUT_TOL,
    ));
    fails.extend(check(
        label,
        "lse",
        s,
        Layout::Lse,
        &got.lse,
        &want.lse,
        &OUT_TOL,
    ));
    for (w, name) in ["dq", "dk", "dv"].iter().enumerate() {
        fails.extend(check(
            label,
            name,
            &slot_shape(s, w),
            Layout::Rows,
            &slot(s, &got.dqkv, w),
            &slot(s, &want.dqkv, w),
            &GRAD_TOL,
        ));
    }
    fails
}

/// Compares out and lse only (a forward run alone); returns the failures.
pub fn check_forward(
    label: &str,
    s: &AttentionShape,
    got: &Outputs,
    want: &Outputs,
) -> Vec<String> {
    let mut fails = Vec::new();
    fails.extend(check(
        label,
        "out",
        s,
        Layout::Rows,
        &got.out,
        &want.out,
        &OUT_TOL,
    ));
    fails.extend(check(
        label,
        "lse",
        s,
        Layout::Lse,
        &got.lse,
        &want.lse,
        &OUT_TOL,
    ));
    fails
}

/// The layout probes, in the order to run them.
pub const PROBES: [LayoutProbe; 3] = [LayoutProbe::ABt, LayoutProbe::PB, LayoutProbe::AtB];

/// What a probe exercises.
pub fn probe_name(p: LayoutProbe) -> &'static str {
    match p {
        LayoutProbe::ABt => "a b^T (Q K^T: ldmatrix A, ldmatrix B non-trans, mma, C layout)",
        LayoutProbe::PB => "p b (P V: C->A registers, ldmatrix.trans B)",
        LayoutProbe::AtB => "a^T b (dS K: C->shared bf16, ldmatrix.trans A, ldmatrix.trans B)",
    }
}

/// Inputs of the probes: small integers over 8, exact in BF16, with exact F32 products and sums.
pub struct ProbeCase {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub b16: Vec<bf16>,
}

impl ProbeCase {
    pub fn new(seed: u64) -> Self {
        let mut r = SplitMix64::new(seed);
        let mut tile = || -> Vec<f32> {
            (0..64 * 64)
                .map(|_| (r.below(17) as f32 - 8.0) / 8.0)
                .collect()
        };
        let a = tile();
        let b = tile();
        let b16 = b.iter().map(|&v| bf16::from_f32(v)).collect();
        ProbeCase { a, b, b16 }
    }

    /// The exact result of `probe` (row-major 64 x 64).
    pub fn want(&self, probe: LayoutProbe) -> Vec<f64> {
        let at = |m: &[f32], r: usize, c: usize| m[r * 64 + c] as f64;
        let (a, b) = (&self.a, &self.b);
        (0..64 * 64)
            .map(|i| {
                let (r, c) = (i / 64, i % 64);
                (0..64)
                    .map(|k| match probe {
                        LayoutProbe::ABt => at(a, r, k) * at(b, c, k),
                        LayoutProbe::PB => at(a, r, k) * at(b, k, c),
                        LayoutProbe::AtB => at(a, k, r) * at(b, k, c),
                    })
                    .sum()
            })
            .collect()
    }
}

/// Prints a 64 x 64 probe result's mismatch pattern and returns whether it is right.
pub fn probe_ok(name: &str, got: &[f32], want: &[f64]) -> bool {
    matrix_probe_ok(name, got, want, 64)
}

/// Prints the mismatch pattern of a probe result of 64 rows and `cols` columns (row-major) and returns
/// whether it is right: wrong rows and columns, whether the result is the transposed one (square only),
/// and for the first wrong elements where their value belongs.
pub fn matrix_probe_ok(name: &str, got: &[f32], want: &[f64], cols: usize) -> bool {
    let n = 64 * cols;
    if got.len() != n || want.len() != n {
        println!(
            "FAIL probe {name}: {} values, {} expected, {n} wanted",
            got.len(),
            want.len()
        );
        return false;
    }
    let scale = want.iter().fold(0.0f64, |a, &b| a.max(b.abs())).max(1e-6);
    let close = |g: f32, w: f64| (g as f64 - w).abs() <= 1e-3 * scale;
    let bad: Vec<usize> = (0..n).filter(|&i| !close(got[i], want[i])).collect();
    if bad.is_empty() {
        println!("ok   probe {name}");
        return true;
    }
    let transposed = cols == 64 && (0..n).all(|i| close(got[i], want[(i % 64) * 64 + i / 64]));
    let rows: std::collections::BTreeSet<usize> = bad.iter().map(|i| i / cols).collect();
    let wrong_cols: std::collections::BTreeSet<usize> = bad.iter().map(|i| i % cols).collect();
    println!(
        "FAIL probe {name}: {} of {n} wrong; transposed result: {transposed}; wrong rows {:?}; wrong \
         cols {:?}",
        bad.len(),
        rows,
        wrong_cols
    );
    for &i in bad.iter().take(6) {
        // Where the value that landed here belongs, if it matches any expected element.
        let from = (0..n).find(|&j| close(got[i], want[j]));
        println!(
            "     [{}, {}] got {} want {:.5} (matches want[{:?}])",
            i / cols,
            i % cols,
            got[i],
            want[i],
            from.map(|j| (j / cols, j % cols))
        );
    }
    false
}

/// The wgmma probes and their head dims, in the order to run them (the smallest first).
pub fn wgmma_probes() -> Vec<(WgmmaProbe, usize)> {
    let mut v = vec![(WgmmaProbe::Abt16, 64)];
    for probe in [WgmmaProbe::Abt, WgmmaProbe::Pv] {
        for hd in WGMMA_HEAD_DIMS {
            v.push((probe, hd));
        }
    }
    v
}

/// What a wgmma probe exercises.
pub fn wgmma_probe_name(p: WgmmaProbe, hd: usize) -> String {
    match p {
        WgmmaProbe::Abt16 => {
            "wgmma a[:, :16] b[:, :16]^T (ONE m64n64k16, K-major SW128 descriptors, C fragments)"
                .into()
        }
        WgmmaProbe::Abt => format!(
            "wgmma a b^T hd{hd} (Q K^T: k-steps in the swizzled rows{})",
            if hd > 64 {
                " and across column blocks"
            } else {
                ""
            }
        ),
        WgmmaProbe::Pv => format!(
            "wgmma p v hd{hd} (P V: C->A registers, V MN-major with the transpose bit{})",
            if hd > 64 {
                ", LBO to the second column block"
            } else {
                ""
            }
        ),
        WgmmaProbe::PvStrides { lbo, sbo } => {
            format!("wgmma p v hd{hd} with V's descriptor LBO {lbo} SBO {sbo} (not the kernel's)")
        }
    }
}

/// Inputs of one wgmma probe (small integers over 8, exact in BF16 with exact F32 sums) and its exact
/// result.
pub struct WgmmaProbeCase {
    pub probe: WgmmaProbe,
    pub head_dim: usize,
    /// 64 x 64 (`Abt16`, `Pv`) or 64 x hd (`Abt`).
    pub a: Vec<f32>,
    /// 64 x hd.
    pub b: Vec<f32>,
    pub b16: Vec<bf16>,
}

impl WgmmaProbeCase {
    pub fn new(probe: WgmmaProbe, head_dim: usize, seed: u64) -> Self {
        let mut r = SplitMix64::new(seed);
        let mut tile =
            |n: usize| -> Vec<f32> { (0..n).map(|_| (r.below(17) as f32 - 8.0) / 8.0).collect() };
        let a_cols = if probe == WgmmaProbe::Abt {
            head_dim
        } else {
            64
        };
        let a = tile(64 * a_cols);
        let b = tile(64 * head_dim);
        let b16 = b.iter().map(|&v| bf16::from_f32(v)).collect();
        WgmmaProbeCase {
            probe,
            head_dim,
            a,
            b,
            b16,
        }
    }

    /// Columns of the result: 64, or hd for `Pv`.
    pub fn out_cols(&self) -> usize {
        match self.probe {
            WgmmaProbe::Pv | WgmmaProbe::PvStrides { .. } => self.head_dim,
            WgmmaProbe::Abt16 | WgmmaProbe::Abt => 64,
        }
    }

    /// The exact result (row-major, 64 x `out_cols`).
    pub fn want(&self) -> Vec<f64> {
        let hd = self.head_dim;
        let cols = self.out_cols();
        let (a, b) = (&self.a, &self.b);
        (0..64 * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                match self.probe {
                    WgmmaProbe::Abt16 => (0..16)
                        .map(|k| a[r * 64 + k] as f64 * b[c * hd + k] as f64)
                        .sum(),
                    WgmmaProbe::Abt => (0..hd)
                        .map(|k| a[r * hd + k] as f64 * b[c * hd + k] as f64)
                        .sum(),
                    WgmmaProbe::Pv | WgmmaProbe::PvStrides { .. } => (0..64)
                        .map(|k| a[r * 64 + k] as f64 * b[k * hd + c] as f64)
                        .sum(),
                }
            })
            .collect()
    }
}

/// Fails the test with every failed comparison in `fails`, if there are any.
pub fn assert_no_failures(fails: &[String]) {
    assert!(
        fails.is_empty(),
        "{} comparisons failed:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

/// Shapes of the wgmma forward's checks: both head dims, `T` in {1, 63, 64, 100, 128, 257, 1024} (below,
/// at and across the 64- and 128-row tiles, partial last tiles), grouped-query ratios 1, 2, 4, 8 in turn,
/// batches of 1 and 2.
pub fn wgmma_shapes() -> Vec<AttentionShape> {
    let mut v = Vec::new();
    for hd in WGMMA_HEAD_DIMS {
        for (i, t) in [1, 63, 64, 100, 128, 257, 1024].into_iter().enumerate() {
            let (b, h, kv) = [(1, 2, 2), (2, 4, 2), (1, 4, 1), (2, 8, 1)][(i + hd / 64) % 4];
            v.push(AttentionShape::gqa(b, h, kv, t, hd));
        }
    }
    v
}

/// The forward variants and the separate backward kernels of head dim `hd`, cycled together: as many
/// pairs as the longest of the three lists has entries, so every variant is in one.
pub fn cycled_variants(hd: usize) -> Vec<(QueryTiles, BackwardKernels)> {
    let (fv, kv, qv) = (forward_variants(hd), dkdv_variants(hd), dq_variants(hd));
    (0..fv.len().max(kv.len()).max(qv.len()))
        .map(|i| {
            let backward = BackwardKernels::Separate {
                dkdv: kv[i % kv.len()],
                dq: qv[i % qv.len()],
            };
            (fv[i % fv.len()], backward)
        })
        .collect()
}
