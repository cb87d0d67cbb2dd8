//! The CPU attention reference against a naive F64 attention (full `T x T` matrices, explicit mask),
//! its backward against finite differences of that F64 forward, causality properties, the public API's
//! validation, and the NVRTC build of the CUDA modules for sm_90 (the wgmma forward's for sm_90a) with
//! ptxas' register report (ignored where the build found no NVRTC). The GPU comparisons are in
//! `attention_cuda.rs`.

mod attention_common;
mod common;

use attention_common::{expand_kv, slot};
use common::{nvrtc_test, require_nvrtc, sm90_ptx};
use fp8_kernels::attention::{
    attention_backward, attention_forward, attention_module, cpu, default_tiles,
    default_wgmma_backward_tiles, dkdv_variants, dq_variants, forward_variants, kernel_module,
    wgmma_backward_variants, wgmma_dq_variants, wgmma_forward_variants, wgmma_kv_variants,
    AttentionConfig, AttentionKernel, AttentionShape, AttentionTiles, AttentionWorkspace,
    BackwardKernels, KernelFamily, KeyTiles, QueryTiles, TensorKernel, WgmmaBackwardTiles,
    WgmmaTiles, ATTENTION_MODULE, ATTENTION_WGMMA_MODULE, HEAD_DIMS, WGMMA_HEAD_DIMS,
};
use fp8_kernels::kernel_source::{compile_ptx, ModuleArch, PRECISE_OPTIONS};
use fp8_kernels::{Device, KernelError};
use half::bf16;
use proptest::prelude::*;

/// Naive F64 causal attention: `(out [B,T,H,hd], lse [B,H,T])`. Query head `h` reads key/value head
/// `h / group` (`w` = 0, 1, 2: q, k, v).
fn naive_forward(s: &AttentionShape, scale: f64, x: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (bn, hn, tn, d) = (s.batch, s.heads, s.seq_len, s.head_dim);
    let (kvn, g, width) = (s.kv_heads, s.group(), s.qkv_width());
    let at = |b: usize, t: usize, w: usize, h: usize| {
        let col = match w {
            0 => h,
            1 => hn + h / g,
            _ => hn + kvn + h / g,
        };
        (b * tn + t) * width + col * d
    };
    let mut out = vec![0.0; s.out_len()];
    let mut lse = vec![0.0; s.lse_len()];
    for b in 0..bn {
        for h in 0..hn {
            for t in 0..tn {
                // Full row of scores, masked with -inf past t.
                let scores: Vec<f64> = (0..tn)
                    .map(|k| {
                        if k > t {
                            f64::NEG_INFINITY
                        } else {
                            (0..d)
                                .map(|i| x[at(b, t, 0, h) + i] * x[at(b, k, 1, h) + i])
                                .sum::<f64>()
                                * scale
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|&v| (v - m).exp()).collect();
                let l: f64 = e.iter().sum();
                lse[(b * hn + h) * tn + t] = m + l.ln();
                for i in 0..d {
                    out[((b * tn + t) * hn + h) * d + i] =
                        (0..tn).map(|k| e[k] / l * x[at(b, k, 2, h) + i]).sum();
                }
            }
        }
    }
    (out, lse)
}

/// `sum(out * dy)` of the naive forward: the scalar whose gradient the backward computes.
fn naive_loss(s: &AttentionShape, scale: f64, x: &[f64], dy: &[f64]) -> f64 {
    naive_forward(s, scale, x)
        .0
        .iter()
        .zip(dy)
        .map(|(a, b)| a * b)
        .sum()
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |a, &b| a.max(b.abs()))
}

/// Shapes small enough for the naive reference, with every head dim.
fn small_shape() -> impl Strategy<Value = AttentionShape> {
    (1usize..3, 1usize..3, 1usize..24, 0usize..3)
        .prop_map(|(b, h, t, i)| AttentionShape::new(b, h, t, HEAD_DIMS[i]))
}

fn values(n: usize, amp: f32) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(-amp..amp, n)
}

fn case() -> impl Strategy<Value = (AttentionShape, f32, Vec<f32>, Vec<f32>)> {
    shape_case(small_shape())
}

/// Grouped-query shapes small enough for the naive reference: 1 or 2 key/value heads, groups of 1, 2 or
/// 4, every head dim.
fn small_gqa_shape() -> impl Strategy<Value = AttentionShape> {
    (1usize..3, 1usize..3, 0usize..3, 1usize..24, 0usize..3)
        .prop_map(|(b, kv, g, t, i)| AttentionShape::gqa(b, kv * [1, 2, 4][g], kv, t, HEAD_DIMS[i]))
}

fn gqa_case() -> impl Strategy<Value = (AttentionShape, f32, Vec<f32>, Vec<f32>)> {
    shape_case(small_gqa_shape())
}

fn shape_case(
    shapes: impl Strategy<Value = AttentionShape>,
) -> impl Strategy<Value = (AttentionShape, f32, Vec<f32>, Vec<f32>)> {
    (shapes, 0.05f32..0.6).prop_flat_map(|(s, scale)| {
        (
            Just(s),
            Just(scale),
            values(s.qkv_len(), 2.0),
            values(s.out_len(), 1.0),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn cpu_forward_matches_naive_f64((s, scale, x, _dy) in case()) {
        let mut out = vec![0.0f32; s.out_len()];
        let mut lse = vec![0.0f32; s.lse_len()];
        cpu::forward(&s, scale, &x, &mut out, &mut lse);
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let (want, want_lse) = naive_forward(&s, scale as f64, &x64);
        for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
            prop_assert!((g as f64 - w).abs() <= 2e-4 * (1.0 + w.abs()), "out[{i}] {g} vs {w}");
        }
        for (i, (&g, &w)) in lse.iter().zip(&want_lse).enumerate() {
            prop_assert!((g as f64 - w).abs() <= 2e-4 * (1.0 + w.abs()), "lse[{i}] {g} vs {w}");
        }
    }

    #[test]
    fn cpu_backward_matches_finite_differences((s, scale, x, dy) in case(), picks in prop::collection::vec(any::<prop::sample::Index>(), 12)) {
        let mut dx = vec![0.0f32; s.qkv_len()];
        cpu::backward(&s, scale, &x, &dy, &mut dx);
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let dy64: Vec<f64> = dy.iter().map(|&v| v as f64).collect();
        let g_max = max_abs(&dx) as f64;
        let eps = 1e-4;
        for p in picks {
            let i = p.index(x.len());
            let mut xp = x64.clone();
            xp[i] += eps;
            let mut xm = x64.clone();
            xm[i] -= eps;
            let fd = (naive_loss(&s, scale as f64, &xp, &dy64) - naive_loss(&s, scale as f64, &xm, &dy64)) / (2.0 * eps);
            prop_assert!(
                (dx[i] as f64 - fd).abs() <= 1e-4 * (1.0 + g_max),
                "d_qkv[{i}] = {} but the finite difference is {fd} (shape {s:?})", dx[i]
            );
        }
    }

    #[test]
    fn output_at_t_does_not_see_keys_after_t((s, scale, x, _dy) in case(), cut in 0usize..24, noise in values(64, 3.0)) {
        // Change k and v of every row after `cut`: rows <= cut of out and lse keep their bits.
        let (cut, hd, h) = (cut % s.seq_len, s.head_dim, s.heads);
        let mut y = x.clone();
        for b in 0..s.batch {
            for t in cut + 1..s.seq_len {
                for w in 1..3 {
                    let base = ((b * s.seq_len + t) * 3 + w) * h * hd;
                    for (j, v) in y[base..base + h * hd].iter_mut().enumerate() {
                        *v += noise[j % noise.len()];
                    }
                }
            }
        }
        let run = |x: &[f32]| {
            let mut out = vec![0.0f32; s.out_len()];
            let mut lse = vec![0.0f32; s.lse_len()];
            cpu::forward(&s, scale, x, &mut out, &mut lse);
            (out, lse)
        };
        let (o1, l1) = run(&x);
        let (o2, l2) = run(&y);
        for b in 0..s.batch {
            for t in 0..=cut {
                for hh in 0..h {
                    let at = ((b * s.seq_len + t) * h + hh) * hd;
                    prop_assert_eq!(&o1[at..at + hd], &o2[at..at + hd]);
                    let li = (b * h + hh) * s.seq_len + t;
                    prop_assert_eq!(l1[li].to_bits(), l2[li].to_bits());
                }
            }
        }
    }

    #[test]
    fn gradient_of_row_t_reaches_only_keys_up_to_t((s, scale, x, dy) in case(), row in 0usize..24, noise in values(32, 1.0)) {
        // Change d_out at one row t0: dq changes only at t0, dk and dv only at keys <= t0.
        let t0 = row % s.seq_len;
        let mut dz = dy.clone();
        let (hd, h) = (s.head_dim, s.heads);
        for b in 0..s.batch {
            let at = (b * s.seq_len + t0) * h * hd;
            for (j, v) in dz[at..at + h * hd].iter_mut().enumerate() {
                *v += noise[j % noise.len()];
            }
        }
        let mut g1 = vec![0.0f32; s.qkv_len()];
        let mut g2 = vec![0.0f32; s.qkv_len()];
        cpu::backward(&s, scale, &x, &dy, &mut g1);
        cpu::backward(&s, scale, &x, &dz, &mut g2);
        for b in 0..s.batch {
            for t in 0..s.seq_len {
                let base = (b * s.seq_len + t) * 3 * h * hd;
                if t != t0 {
                    prop_assert_eq!(&g1[base..base + h * hd], &g2[base..base + h * hd], "dq row {}", t);
                }
                if t > t0 {
                    prop_assert_eq!(&g1[base + h * hd..base + 3 * h * hd], &g2[base + h * hd..base + 3 * h * hd], "dk/dv row {}", t);
                }
            }
        }
    }

    #[test]
    fn constant_values_pass_through((s, scale, mut x, _dy) in case(), c in values(128, 2.0)) {
        // v_k[d] = c[d] for every key: every output row is c, whatever the weights.
        let (hd, h) = (s.head_dim, s.heads);
        for b in 0..s.batch {
            for t in 0..s.seq_len {
                for hh in 0..h {
                    let at = ((b * s.seq_len + t) * 3 + 2) * h * hd + hh * hd;
                    x[at..at + hd].copy_from_slice(&c[..hd]);
                }
            }
        }
        let mut out = vec![0.0f32; s.out_len()];
        let mut lse = vec![0.0f32; s.lse_len()];
        cpu::forward(&s, scale, &x, &mut out, &mut lse);
        for (i, &o) in out.iter().enumerate() {
            let want = c[i % hd];
            prop_assert!((o - want).abs() <= 1e-5 * (1.0 + want.abs()), "out[{}] = {} not {}", i, o, want);
        }
    }
}

#[test]
fn public_api_on_the_cpu_rounds_the_reference_to_bf16() {
    public_api_rounds_the_reference(AttentionShape::new(2, 3, 19, 32));
    public_api_rounds_the_reference(AttentionShape::gqa(2, 4, 2, 19, 32));
    public_api_rounds_the_reference(AttentionShape::gqa(1, 4, 1, 70, 64));
}

fn public_api_rounds_the_reference(s: AttentionShape) {
    let mut rng = fp8_kernels::rng::SplitMix64::new(7);
    let x: Vec<bf16> = (0..s.qkv_len())
        .map(|_| bf16::from_f32(rng.uniform_f32() * 2.0))
        .collect();
    let dy: Vec<bf16> = (0..s.out_len())
        .map(|_| bf16::from_f32(rng.uniform_f32()))
        .collect();
    let cfg = AttentionConfig::default();
    let dev = Device::cpu();
    let qkv = dev.upload(&x).unwrap();
    let mut out = dev.zeros::<bf16>(s.out_len()).unwrap();
    let mut lse = dev.zeros::<f32>(s.lse_len()).unwrap();
    attention_forward(&s, &cfg, &qkv, &mut out, &mut lse).unwrap();
    let d_out = dev.upload(&dy).unwrap();
    let mut dqkv = dev.zeros::<bf16>(s.qkv_len()).unwrap();
    let mut ws = AttentionWorkspace::new();
    attention_backward(&s, &cfg, &qkv, &out, &d_out, &lse, &mut dqkv, &mut ws).unwrap();

    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let dyf: Vec<f32> = dy.iter().map(|v| v.to_f32()).collect();
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    let mut o = vec![0.0f32; s.out_len()];
    let mut l = vec![0.0f32; s.lse_len()];
    cpu::forward(&s, scale, &xf, &mut o, &mut l);
    let mut g = vec![0.0f32; s.qkv_len()];
    cpu::backward(&s, scale, &xf, &dyf, &mut g);
    let bits = |v: &[f32]| {
        v.iter()
            .map(|&f| bf16::from_f32(f).to_bits())
            .collect::<Vec<_>>()
    };
    let got = |v: Vec<bf16>| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
    assert_eq!(got(out.to_vec().unwrap()), bits(&o));
    assert_eq!(lse.to_vec().unwrap(), l);
    assert_eq!(got(dqkv.to_vec().unwrap()), bits(&g));
}

#[test]
fn bad_calls_are_errors() {
    let dev = Device::cpu();
    let s = AttentionShape::new(1, 2, 8, 64);
    let qkv = dev.zeros::<bf16>(s.qkv_len()).unwrap();
    let mut out = dev.zeros::<bf16>(s.out_len()).unwrap();
    let mut lse = dev.zeros::<f32>(s.lse_len()).unwrap();
    let cfg = AttentionConfig::default();
    attention_forward(&s, &cfg, &qkv, &mut out, &mut lse).unwrap();

    let bad_hd = AttentionShape::new(1, 2, 8, 48);
    assert!(matches!(
        attention_forward(&bad_hd, &cfg, &qkv, &mut out, &mut lse),
        Err(KernelError::InvalidArgument { .. })
    ));
    let short = dev.zeros::<bf16>(s.qkv_len() - 1).unwrap();
    assert!(matches!(
        attention_forward(&s, &cfg, &short, &mut out, &mut lse),
        Err(KernelError::LengthMismatch { .. })
    ));
    for scale in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let c = AttentionConfig {
            softmax_scale: Some(scale),
            ..cfg
        };
        assert!(attention_forward(&s, &c, &qkv, &mut out, &mut lse).is_err());
    }
    // Tiles that are not compiled for the head dim.
    for tiles in [
        AttentionTiles {
            forward: Some(QueryTiles::new(4, 1, 96)),
            ..Default::default()
        },
        AttentionTiles {
            forward: Some(QueryTiles::new(4, 2, 32)), // hd128 only
            ..Default::default()
        },
        AttentionTiles {
            backward: Some(BackwardKernels::Fused { query_rows: 48 }),
            ..Default::default()
        },
        AttentionTiles {
            backward: Some(BackwardKernels::Separate {
                dkdv: KeyTiles::new(8, 2, 64),
                dq: QueryTiles::new(4, 1, 64),
            }),
            ..Default::default()
        },
    ] {
        let c = AttentionConfig { tiles, ..cfg };
        assert!(attention_forward(&s, &c, &qkv, &mut out, &mut lse).is_err());
        assert!(c.kernels_for(64).is_err());
    }
    let mut dqkv = dev.zeros::<bf16>(s.qkv_len()).unwrap();
    let short_lse = dev.zeros::<f32>(s.lse_len() - 1).unwrap();
    let mut ws = AttentionWorkspace::new();
    assert!(matches!(
        attention_backward(&s, &cfg, &qkv, &out, &out, &short_lse, &mut dqkv, &mut ws),
        Err(KernelError::LengthMismatch { .. })
    ));
    // An empty batch is a no-op, not an error.
    let empty = AttentionShape::new(0, 2, 8, 64);
    let none = dev.zeros::<bf16>(0).unwrap();
    let mut none_out = dev.zeros::<bf16>(0).unwrap();
    let mut none_lse = dev.zeros::<f32>(0).unwrap();
    attention_forward(&empty, &cfg, &none, &mut none_out, &mut none_lse).unwrap();
}

#[test]
fn wgmma_configs_are_validated() {
    // The wgmma family resolves its tiles (default or given) for head dims 64 and 128 only, on every
    // device; on the CPU it runs the reference like every family.
    let dev = Device::cpu();
    let wgmma = AttentionConfig {
        kernel: AttentionKernel::Wgmma,
        ..Default::default()
    };
    for hd in WGMMA_HEAD_DIMS {
        let s = AttentionShape::gqa(1, 4, 2, 9, hd);
        let qkv = dev.zeros::<bf16>(s.qkv_len()).unwrap();
        let mut out = dev.zeros::<bf16>(s.out_len()).unwrap();
        let mut lse = dev.zeros::<f32>(s.lse_len()).unwrap();
        attention_forward(&s, &wgmma, &qkv, &mut out, &mut lse).unwrap();
        // The measured defaults: the plain schedule with key blocks of 64 at head dim 64, the
        // warp-specialised kernel with key blocks of 128 at head dim 128.
        let want = if hd == 64 {
            WgmmaTiles::new(2, 64)
        } else {
            WgmmaTiles::warp_specialized(2, 128)
        };
        assert_eq!(wgmma.wgmma_tiles_for(hd).unwrap(), want);
        assert_eq!(want.threads(), if hd == 64 { 256 } else { 384 });
        for &t in wgmma_forward_variants(hd) {
            let c = AttentionConfig {
                tiles: AttentionTiles {
                    wgmma_forward: Some(t),
                    ..Default::default()
                },
                ..wgmma
            };
            assert_eq!(c.wgmma_tiles_for(hd).unwrap(), t);
            attention_forward(&s, &c, &qkv, &mut out, &mut lse).unwrap();
        }
        let c = AttentionConfig {
            tiles: AttentionTiles {
                wgmma_forward: Some(WgmmaTiles::new(4, 128)),
                ..Default::default()
            },
            ..wgmma
        };
        assert!(matches!(
            attention_forward(&s, &c, &qkv, &mut out, &mut lse),
            Err(KernelError::InvalidArgument { .. })
        ));
        // The backward's kernels: the measured default pair, every compiled pair, and refusals of pairs
        // not compiled for this head dim.
        let dout = dev.zeros::<bf16>(s.out_len()).unwrap();
        let mut dqkv = dev.zeros::<bf16>(s.qkv_len()).unwrap();
        let mut ws = AttentionWorkspace::new();
        let want = if hd == 64 {
            WgmmaBackwardTiles::specialized_kv(WgmmaTiles::new(1, 64))
        } else {
            WgmmaBackwardTiles::specialized_kv(WgmmaTiles::warp_specialized(2, 64))
        };
        assert_eq!(wgmma.wgmma_backward_tiles_for(hd).unwrap(), want);
        assert_eq!(want.kv_threads(), 384);
        assert_eq!(
            default_wgmma_backward_tiles(hd),
            Some(wgmma.wgmma_backward_tiles_for(hd).unwrap())
        );
        for t in wgmma_backward_variants(hd) {
            let c = AttentionConfig {
                tiles: AttentionTiles {
                    wgmma_backward: Some(t),
                    ..Default::default()
                },
                ..wgmma
            };
            assert_eq!(c.wgmma_backward_tiles_for(hd).unwrap(), t);
            attention_backward(&s, &c, &qkv, &out, &dout, &lse, &mut dqkv, &mut ws).unwrap();
        }
        for bad in [
            WgmmaBackwardTiles::new(3, WgmmaTiles::new(1, 64)),
            WgmmaBackwardTiles::new(1, WgmmaTiles::new(2, 256)),
            WgmmaBackwardTiles::new(1, WgmmaTiles::pipelined(1, 128)),
            // The warp-specialised dK/dV kernel exists with two warpgroups only.
            WgmmaBackwardTiles {
                kv_warpgroups: 1,
                kv_specialized: true,
                dq: WgmmaTiles::new(1, 64),
                ordered: false,
                dq_columns: false,
            },
        ] {
            let c = AttentionConfig {
                tiles: AttentionTiles {
                    wgmma_backward: Some(bad),
                    ..Default::default()
                },
                ..wgmma
            };
            assert!(c.wgmma_backward_tiles_for(hd).is_err(), "{bad}");
            assert!(matches!(
                attention_backward(&s, &c, &qkv, &out, &dout, &lse, &mut dqkv, &mut ws),
                Err(KernelError::InvalidArgument { .. })
            ));
        }
    }
    // The ordered kernel with dQ's columns split exists at head dim 128 only.
    assert!(wgmma_backward_variants(128).contains(&WgmmaBackwardTiles::ORDERED_COLUMNS));
    assert!(!wgmma_backward_variants(64).contains(&WgmmaBackwardTiles::ORDERED_COLUMNS));
    // Key blocks of 128 in the dQ kernel exist at head dim 64 only; the pipelined dQ schedule at both.
    assert!(wgmma_dq_variants(64).contains(&WgmmaTiles::new(1, 128)));
    assert!(!wgmma_dq_variants(128).contains(&WgmmaTiles::new(1, 128)));
    for hd in WGMMA_HEAD_DIMS {
        assert!(wgmma_dq_variants(hd).contains(&WgmmaTiles::pipelined(1, 64)));
    }
    assert!(wgmma.wgmma_backward_tiles_for(32).is_err());
    let s = AttentionShape::new(1, 2, 9, 32);
    let qkv = dev.zeros::<bf16>(s.qkv_len()).unwrap();
    let mut out = dev.zeros::<bf16>(s.out_len()).unwrap();
    let mut lse = dev.zeros::<f32>(s.lse_len()).unwrap();
    assert!(matches!(
        attention_forward(&s, &wgmma, &qkv, &mut out, &mut lse),
        Err(KernelError::InvalidArgument { .. })
    ));
    assert!(wgmma.wgmma_tiles_for(32).is_err());
    // The other families ignore the wgmma tiles.
    let mma = AttentionConfig {
        tiles: AttentionTiles {
            wgmma_forward: Some(WgmmaTiles::new(4, 128)),
            ..Default::default()
        },
        ..Default::default()
    };
    attention_forward(&s, &mma, &qkv, &mut out, &mut lse).unwrap();
}

/// The CPU reference's `(out, lse, d_qkv)`.
fn cpu_reference(
    s: &AttentionShape,
    scale: f32,
    x: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut out = vec![0.0f32; s.out_len()];
    let mut lse = vec![0.0f32; s.lse_len()];
    cpu::forward(s, scale, x, &mut out, &mut lse);
    let mut dx = vec![0.0f32; s.qkv_len()];
    cpu::backward(s, scale, x, dy, &mut dx);
    (out, lse, dx)
}

/// The grouped-query CPU reference against the multi-head one on K and V repeated per group (Hugging
/// Face's `repeat_kv`): out, lse and dq the same bits (each query head computes from the same numbers),
/// dk and dv of a key/value head the sum over its group of the expanded problem's per-head dk and dv,
/// within the rounding of an F32 sum of `group` terms.
fn check_gqa_against_expanded(
    s: &AttentionShape,
    scale: f32,
    x: &[f32],
    dy: &[f32],
) -> Result<(), String> {
    let mha = AttentionShape::new(s.batch, s.heads, s.seq_len, s.head_dim);
    let xe = expand_kv(s, x);
    if xe.len() != mha.qkv_len() {
        return Err(format!("expanded qkv has {} elements", xe.len()));
    }
    let (out, lse, dx) = cpu_reference(s, scale, x, dy);
    let (out_e, lse_e, dx_e) = cpu_reference(&mha, scale, &xe, dy);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    if bits(&out) != bits(&out_e) || bits(&lse) != bits(&lse_e) {
        return Err(format!(
            "{s:?}: out or lse differ from the expanded problem"
        ));
    }
    if bits(&slot(s, &dx, 0)) != bits(&slot(&mha, &dx_e, 0)) {
        return Err(format!("{s:?}: dq differs from the expanded problem"));
    }
    let (hd, g) = (s.head_dim, s.group());
    for w in 1..3 {
        let got = slot(s, &dx, w); // [B, T, KV, hd]
        let per_head = slot(&mha, &dx_e, w); // [B, T, H, hd]
        for (i, &v) in got.iter().enumerate() {
            let (d, j, bt) = (i % hd, (i / hd) % s.kv_heads, i / (hd * s.kv_heads));
            let terms = (j * g..(j + 1) * g).map(|h| per_head[(bt * s.heads + h) * hd + d] as f64);
            let (sum, abs) = terms.fold((0.0, 0.0), |(a, b), t| (a + t, b + t.abs()));
            let tol = g as f64 * f32::EPSILON as f64 * abs;
            if (v as f64 - sum).abs() > tol {
                return Err(format!(
                    "{s:?}: {}[{i}] = {v}, the group sum of the expanded problem is {sum}",
                    ["dq", "dk", "dv"][w]
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn cpu_gqa_forward_matches_naive_f64((s, scale, x, dy) in gqa_case()) {
        let (out, lse, _) = cpu_reference(&s, scale, &x, &dy);
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let (want, want_lse) = naive_forward(&s, scale as f64, &x64);
        for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
            prop_assert!((g as f64 - w).abs() <= 2e-4 * (1.0 + w.abs()), "out[{i}] {g} vs {w} ({s:?})");
        }
        for (i, (&g, &w)) in lse.iter().zip(&want_lse).enumerate() {
            prop_assert!((g as f64 - w).abs() <= 2e-4 * (1.0 + w.abs()), "lse[{i}] {g} vs {w} ({s:?})");
        }
    }

    #[test]
    fn cpu_gqa_backward_matches_finite_differences((s, scale, x, dy) in gqa_case(), picks in prop::collection::vec(any::<prop::sample::Index>(), 12)) {
        // The finite differences of the naive forward, where a key/value head feeds every query head
        // of its group: the group sum of dk and dv follows from the loss, not from the code under test.
        let mut dx = vec![0.0f32; s.qkv_len()];
        cpu::backward(&s, scale, &x, &dy, &mut dx);
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let dy64: Vec<f64> = dy.iter().map(|&v| v as f64).collect();
        let g_max = max_abs(&dx) as f64;
        let eps = 1e-4;
        // Half the picks in the k and v columns, which the group sum concerns.
        let kv_cols = 2 * s.kv_heads * s.head_dim;
        for (n, p) in picks.into_iter().enumerate() {
            let i = if n % 2 == 0 {
                p.index(x.len())
            } else {
                let j = p.index(x.len() / s.qkv_width() * kv_cols);
                (j / kv_cols) * s.qkv_width() + s.heads * s.head_dim + j % kv_cols
            };
            let mut xp = x64.clone();
            xp[i] += eps;
            let mut xm = x64.clone();
            xm[i] -= eps;
            let fd = (naive_loss(&s, scale as f64, &xp, &dy64) - naive_loss(&s, scale as f64, &xm, &dy64)) / (2.0 * eps);
            prop_assert!(
                (dx[i] as f64 - fd).abs() <= 1e-4 * (1.0 + g_max),
                "d_qkv[{i}] = {} but the finite difference is {fd} (shape {s:?})", dx[i]
            );
        }
    }

    #[test]
    fn cpu_gqa_equals_mha_on_repeated_kv((s, scale, x, dy) in gqa_case()) {
        let r = check_gqa_against_expanded(&s, scale, &x, &dy);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn cpu_gqa_equals_mha_on_repeated_kv_across_tiles() {
    // Groups of 1, 2 and 4 and one key/value head; T not a multiple of 64; every head dim.
    let shapes = [
        AttentionShape::gqa(1, 2, 2, 65, 32),
        AttentionShape::gqa(2, 4, 2, 100, 32),
        AttentionShape::gqa(1, 8, 2, 130, 64),
        AttentionShape::gqa(1, 4, 1, 77, 128),
        AttentionShape::gqa(2, 3, 1, 33, 64),
    ];
    for (i, s) in shapes.iter().enumerate() {
        let inp = attention_common::inputs(*s, 40 + i as u64);
        let x: Vec<f32> = inp.x.iter().map(|v| v.to_f32()).collect();
        let dy: Vec<f32> = inp.dy.iter().map(|v| v.to_f32()).collect();
        check_gqa_against_expanded(s, 0.9 / (s.head_dim as f32).sqrt(), &x, &dy).unwrap();
    }
}

#[test]
fn gqa_shapes_and_invalid_kv_heads() {
    let mha = AttentionShape::new(2, 6, 10, 64);
    assert_eq!(mha.kv_heads, 6);
    assert_eq!(mha.group(), 1);
    assert_eq!(mha.qkv_width(), 3 * 6 * 64);
    assert_eq!(mha.qkv_len(), 3 * mha.out_len());
    let s = AttentionShape::gqa(2, 6, 2, 10, 64);
    assert_eq!(s.group(), 3);
    assert_eq!(s.qkv_width(), (6 + 4) * 64);
    assert_eq!(s.qkv_len(), 2 * 10 * 10 * 64);
    assert_eq!((s.out_len(), s.lse_len()), (mha.out_len(), mha.lse_len()));
    // Same FLOP count as the multi-head shape: it counts query heads.
    assert_eq!(s.causal_flops_fwd_bwd(), mha.causal_flops_fwd_bwd());

    let dev = Device::cpu();
    let cfg = AttentionConfig::default();
    for kv in [0, 4, 5, 12] {
        let bad = AttentionShape::gqa(1, 6, kv, 8, 64);
        let qkv = dev.zeros::<bf16>(bad.qkv_len()).unwrap();
        let mut out = dev.zeros::<bf16>(bad.out_len()).unwrap();
        let mut lse = dev.zeros::<f32>(bad.lse_len()).unwrap();
        match attention_forward(&bad, &cfg, &qkv, &mut out, &mut lse) {
            Err(KernelError::InvalidArgument { detail, .. }) => {
                assert!(detail.contains("kv_heads"), "kv_heads {kv}: {detail}")
            }
            other => panic!("kv_heads {kv}: {other:?}"),
        }
        let mut dqkv = dev.zeros::<bf16>(bad.qkv_len()).unwrap();
        let r = attention_backward(
            &bad,
            &cfg,
            &qkv,
            &out,
            &out,
            &lse,
            &mut dqkv,
            &mut AttentionWorkspace::new(),
        );
        assert!(
            matches!(r, Err(KernelError::InvalidArgument { .. })),
            "kv_heads {kv}: {r:?}"
        );
    }
    // A qkv of the multi-head length is the wrong length for a grouped-query shape.
    let qkv = dev.zeros::<bf16>(mha.qkv_len()).unwrap();
    let mut out = dev.zeros::<bf16>(s.out_len()).unwrap();
    let mut lse = dev.zeros::<f32>(s.lse_len()).unwrap();
    assert!(matches!(
        attention_forward(&s, &cfg, &qkv, &mut out, &mut lse),
        Err(KernelError::LengthMismatch { .. })
    ));
}

/// The entry points of `ptx` whose names start with `prefix`.
fn entries(ptx: &str, prefix: &str) -> std::collections::BTreeSet<String> {
    ptx.lines()
        .filter_map(|l| l.split(".entry ").nth(1))
        .map(|e| e.trim_end_matches('(').trim().to_string())
        .filter(|e| e.starts_with(prefix))
        .collect()
}

nvrtc_test! {
    fn attention_module_compiles_for_sm90() {
        let ptx = sm90_ptx(&ATTENTION_MODULE);
        // The kernel files' variant lists and tiles.rs's agree: exactly these entry points.
        let mut want = std::collections::BTreeSet::new();
        for hd in HEAD_DIMS {
            for t in forward_variants(hd) {
                want.insert(format!("attn_fwd_{t}_hd{hd}"));
            }
            for t in dkdv_variants(hd) {
                want.insert(format!("attn_bwd_dkdv_{t}_hd{hd}"));
            }
            for t in dq_variants(hd) {
                want.insert(format!("attn_bwd_dq_{t}_hd{hd}"));
            }
            for k in [
                "attn_bwd_fused_q64",
                "attn_bwd_fused_q32",
                "attn_fwd_simple",
                "attn_bwd_simple_dq",
                "attn_bwd_simple_dkdv",
            ] {
                want.insert(format!("{k}_hd{hd}"));
            }
        }
        for k in [
            "attn_bwd_dot_rows",
            "attn_bwd_dq_convert",
            "attn_bwd_dq_tiles_convert",
            "attn_probe_abt",
            "attn_probe_pb",
            "attn_probe_atb",
        ] {
            want.insert(k.to_string());
        }
        assert_eq!(entries(&ptx, "attn_"), want);
        for insn in [
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
            "cp.async.cg.shared.global",
            "red.global.add.v2.f32",
            "ex2.approx.ftz.f32",
        ] {
            assert!(ptx.contains(insn), "attention PTX lacks {insn}");
        }
    }
}

nvrtc_test! {
    fn each_module_holds_one_head_dim_and_family() {
        require_nvrtc();
        let m = attention_module(64, KernelFamily::SeparateBackward);
        assert_eq!(m.name, "fp8_kernels_attention_hd64_separate_backward");
        let ptx = sm90_ptx(m);
        let mut want: std::collections::BTreeSet<String> = ["attn_bwd_dot_rows", "attn_bwd_dq_convert", "attn_bwd_dq_tiles_convert"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        want.extend(
            dkdv_variants(64)
                .iter()
                .map(|t| format!("attn_bwd_dkdv_{t}_hd64")),
        );
        want.extend(
            dq_variants(64)
                .iter()
                .map(|t| format!("attn_bwd_dq_{t}_hd64")),
        );
        assert_eq!(entries(&ptx, "attn_"), want);
        let names: std::collections::BTreeSet<&str> = HEAD_DIMS
            .iter()
            .flat_map(|&hd| KernelFamily::ALL.map(|f| attention_module(hd, f).name))
            .collect();
        assert_eq!(
            names.len(),
            3 * 4 + 1,
            "one module per head dim and family, one for the probes"
        );
    }
}

nvrtc_test! {
    fn single_kernel_modules_hold_their_kernel() {
        require_nvrtc();
        // The defaults of every head dim (what a model compiles), and each kind of kernel once.
        let mut kernels = Vec::new();
        for hd in HEAD_DIMS {
            let d = default_tiles(hd).unwrap();
            kernels.push((hd, TensorKernel::Forward(d.forward)));
            if let BackwardKernels::Separate { dkdv, dq } = d.deterministic {
                kernels.push((hd, TensorKernel::DkDv(dkdv)));
                kernels.push((hd, TensorKernel::Dq(dq)));
            }
        }
        kernels.push((64, TensorKernel::Fused { query_rows: 32 }));
        kernels.push((64, TensorKernel::DkDv(KeyTiles::pairs(4, 64))));
        kernels.push((32, TensorKernel::DkDv(KeyTiles::new(4, 2, 32))));
        for (hd, kernel) in kernels {
            let m = kernel_module(hd, kernel);
            assert!(std::ptr::eq(m, kernel_module(hd, kernel)), "not cached");
            let ptx = sm90_ptx(m);
            let want: std::collections::BTreeSet<String> = [
                kernel.name(hd),
                "attn_bwd_dot_rows".into(),
                "attn_bwd_dq_convert".into(),
                "attn_bwd_dq_tiles_convert".into(),
            ]
            .into();
            assert_eq!(entries(&ptx, "attn_"), want, "{}", m.name);
        }
    }
}

nvrtc_test! {
    /// ptxas' report for every kernel (compiled to SASS for sm_90 by NVRTC, as the GPU would): printed, and
    /// the default tensor-core kernels must not spill more than a few bytes to local memory.
    fn attention_kernels_do_not_spill() {
        use cudarc::nvrtc::result;
        use std::ffi::CString;
        require_nvrtc();
        let src = CString::new(ATTENTION_MODULE.source).unwrap();
        let mut opts: Vec<String> = PRECISE_OPTIONS.iter().map(|s| s.to_string()).collect();
        opts.push("--gpu-architecture=sm_90".into());
        opts.push("--ptxas-options=-v".into());
        // SAFETY: NVRTC was found above; the program handle is created, compiled, read and destroyed here,
        // and the options outlive the compile call.
        let log = unsafe {
            let prog = result::create_program(&src, None).unwrap();
            let compiled = result::compile_program(prog, &opts);
            let log = result::get_program_log(prog).unwrap();
            result::destroy_program(prog).unwrap();
            let text: Vec<u8> = log.iter().map(|&c| c as u8).collect();
            let text = String::from_utf8_lossy(&text)
                .trim_end_matches('\0')
                .to_string();
            compiled.unwrap_or_else(|e| panic!("compile failed: {e:?}\n{text}"));
            text
        };
        // The default kernels (DEFAULT_TILES, and the fused backward of the atomic mode) and the probes.
        // A few bytes of spill are tolerated: at 255 registers ptxas may park a loop-invariant address of
        // the cp.async prefetch in local memory (reloaded from L1 once per iteration, outside the products);
        // a spill of the accumulators or fragments would be hundreds of bytes.
        const MAX_SPILL: usize = 16;
        let mut defaults: Vec<String> = ["attn_probe_abt", "attn_probe_pb", "attn_probe_atb"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        for hd in HEAD_DIMS {
            let d = default_tiles(hd).unwrap();
            defaults.push(format!("attn_fwd_{}_hd{hd}", d.forward));
            defaults.push(format!("attn_bwd_fused_q{}_hd{hd}", d.atomic_query_rows));
            match d.deterministic {
                BackwardKernels::Fused { query_rows } => {
                    defaults.push(format!("attn_bwd_fused_q{query_rows}_hd{hd}"))
                }
                BackwardKernels::Separate { dkdv, dq } => {
                    defaults.push(format!("attn_bwd_dkdv_{dkdv}_hd{hd}"));
                    defaults.push(format!("attn_bwd_dq_{dq}_hd{hd}"));
                }
            }
        }
        let mut current = String::new();
        let mut spills = Vec::new();
        for line in log.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                current = rest.split('\'').next().unwrap_or("").to_string();
            }
            if line.contains("registers") || line.contains("spill") {
                println!("{current}: {}", line.trim());
            }
            let spilled: usize = line
                .split(" bytes spill stores")
                .next()
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            if defaults.contains(&current) && line.contains("spill stores") && spilled > MAX_SPILL {
                spills.push(format!("{current}: {}", line.trim()));
            }
        }
        assert!(log.contains("Used"), "no ptxas report in the log:\n{log}");
        assert!(spills.is_empty(), "register spills: {spills:#?}");
    }
}

/// Compiles `source` with NVRTC for `arch` with the crate's options and ptxas' report; returns `(PTX, log)`.
fn compile_with_report(source: &str, arch: &str) -> (String, String) {
    use cudarc::nvrtc::result;
    use std::ffi::CString;
    require_nvrtc();
    let src = CString::new(source).unwrap();
    let mut opts: Vec<String> = PRECISE_OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(format!("--gpu-architecture={arch}"));
    opts.push("--ptxas-options=-v".into());
    let text = |chars: Vec<std::ffi::c_char>| {
        let bytes: Vec<u8> = chars
            .iter()
            .map(|&c| c as u8)
            .take_while(|&c| c != 0)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    // SAFETY: NVRTC was found above; the program handle is created, compiled, read and destroyed here,
    // and the options outlive the compile call.
    unsafe {
        let prog = result::create_program(&src, None).unwrap();
        let compiled = result::compile_program(prog, &opts);
        let log = text(result::get_program_log(prog).unwrap());
        let ptx = compiled
            .is_ok()
            .then(|| text(result::get_ptx(prog).unwrap()));
        result::destroy_program(prog).unwrap();
        compiled.unwrap_or_else(|e| panic!("compile for {arch} failed: {e:?}\n{log}"));
        (ptx.unwrap_or_default(), log)
    }
}

nvrtc_test! {
    /// The wgmma forward's module for sm_90a (its only target), compiled to SASS through NVRTC as the GPU
    /// would: exactly the variants of `wgmma_forward_variants` and the probes; the wgmma instructions and
    /// fences in the PTX; no register spill; and no ptxas notice that it had to add warpgroup
    /// synchronisation (C7519: registers touched between wgmma without wgmma.fence) or serialize the wgmma
    /// (C7515-style "serialized" performance notes). Also: the module is not valid for sm_90.
    fn wgmma_module_compiles_for_sm90a() {
        assert_eq!(ATTENTION_WGMMA_MODULE.arch, ModuleArch::Sm90a);
        assert_eq!(ATTENTION_WGMMA_MODULE.target_for((9, 0)).unwrap(), "sm_90a");
        for cc in [(8, 0), (8, 9), (10, 0), (12, 0)] {
            assert!(ATTENTION_WGMMA_MODULE.target_for(cc).is_err(), "{cc:?}");
        }
        let (ptx, log) = compile_with_report(ATTENTION_WGMMA_MODULE.source, "sm_90a");
        assert!(ptx.contains(".target sm_90a"), "PTX target");
        let mut want: std::collections::BTreeSet<String> = [
            "attn_wg_probe_abt16",
            "attn_wg_probe_abt_hd64",
            "attn_wg_probe_abt_hd128",
            "attn_wg_probe_pv_hd64",
            "attn_wg_probe_pv_hd128",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for hd in WGMMA_HEAD_DIMS {
            for kernel in wgmma_kernels(hd) {
                want.insert(kernel.name(hd));
            }
        }
        // The small kernels every backward module holds.
        want.insert("attn_bwd_dot_rows".into());
        want.insert("attn_bwd_dq_convert".into());
        want.insert("attn_bwd_dq_tiles_convert".into());
        assert_eq!(entries(&ptx, "attn_"), want);
        for insn in [
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
            "wgmma.fence.sync.aligned",
            "wgmma.commit_group.sync.aligned",
            "wgmma.wait_group.sync.aligned",
            "fence.proxy.async.shared::cta",
            "cp.async.cg.shared.global",
            "ex2.approx.ftz.f32",
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes",
            "mbarrier.try_wait.parity.shared::cta.b64",
            "mbarrier.arrive.expect_tx.shared::cta.b64",
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32",
            "ld.acquire.gpu.global.u32",
            "red.release.gpu.global.add.u32",
        ] {
            assert!(ptx.contains(insn), "wgmma module PTX lacks {insn}");
        }
        let mut current = String::new();
        for line in log.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                current = rest.split('\'').next().unwrap_or("").to_string();
            }
            if line.contains("registers") || line.contains("spill") {
                println!("{current}: {}", line.trim());
            }
            if line.contains("spill stores") {
                assert!(
                    line.contains(" 0 bytes spill stores, 0 bytes spill loads"),
                    "{current} spills: {line}"
                );
            }
        }
        assert!(log.contains("Used"), "no ptxas report in the log:\n{log}");
        for notice in ["C7519", "C7515", "C7510", "serialized", "warpgroup.arrive"] {
            assert!(!log.contains(notice), "ptxas notice {notice}:\n{log}");
        }
        // The wgmma instructions do not exist for sm_90: the module needs its own target.
        assert!(compile_ptx(&ATTENTION_WGMMA_MODULE, "sm_90").is_err());
    }
}

nvrtc_test! {
    fn wgmma_single_kernel_modules_hold_their_kernel() {
        require_nvrtc();
        for hd in WGMMA_HEAD_DIMS {
            for kernel in wgmma_kernels(hd) {
                let m = kernel_module(hd, kernel);
                assert_eq!(m.arch, ModuleArch::Sm90a, "{}", m.name);
                let ptx = compile_ptx(m, m.target_for((9, 0)).unwrap())
                    .unwrap_or_else(|e| panic!("{}: {e}", m.name))
                    .to_src();
                let want: std::collections::BTreeSet<String> = [
                    kernel.name(hd),
                    "attn_bwd_dot_rows".into(),
                    "attn_bwd_dq_convert".into(),
                    "attn_bwd_dq_tiles_convert".into(),
                ]
                .into();
                assert_eq!(entries(&ptx, "attn_"), want, "{}", m.name);
            }
        }
    }
}

/// Every wgmma kernel compiled for `hd`: the forward variants, the fused backward, the dK/dV and dQ
/// kernels of the deterministic backward, the fused ordered backward.
fn wgmma_kernels(hd: usize) -> Vec<TensorKernel> {
    let mut v: Vec<TensorKernel> = wgmma_forward_variants(hd)
        .iter()
        .map(|&t| TensorKernel::WgmmaForward(t))
        .collect();
    v.push(TensorKernel::WgmmaFused);
    v.extend(
        wgmma_kv_variants(hd)
            .iter()
            .map(|&warpgroups| TensorKernel::WgmmaDkDv {
                warpgroups,
                specialized: false,
            }),
    );
    v.push(TensorKernel::WgmmaDkDv {
        warpgroups: 2,
        specialized: true,
    });
    v.extend(
        wgmma_dq_variants(hd)
            .iter()
            .map(|&t| TensorKernel::WgmmaDq(t)),
    );
    v.push(TensorKernel::WgmmaOrdered { dq_columns: false });
    if hd == 128 {
        v.push(TensorKernel::WgmmaOrdered { dq_columns: true });
    }
    v
}
