//! CUDA attention against the CPU F32 reference on random inputs. GPU tests: ignored unless run with
//! `--ignored` (`scripts/gpu-tests.sh`), and failing where no GPU can be opened.
//!
//! Built so that one GPU run says what is wrong, not only that something is:
//! 1. `layout_probes_match_cpu` runs each building block of the tensor-core kernels (ldmatrix + mma
//!    fragment mappings) alone on one 64 x 64 tile and names the one that is wrong, with a guess at how
//!    (transposed, swapped halves, ...).
//! 2. `cuda_matches_cpu` runs the simple kernels (no tensor cores), the defaults and every compiled
//!    tensor-core variant (forward tiles, separate dK/dV and dQ kernels, the fused backward) on every
//!    head dim and `T` in {1, 17, 64, 65, 200, 1024}, prints one line per (case, tensor) with the
//!    error metrics, the worst element's `(b, t, h, d)` and the range of query rows `t` out of tolerance,
//!    and fails at the end listing every failure. Simple right and mma wrong: the fast path; both wrong:
//!    the host code, layouts or the shared `D` kernel.
//! 3. `long_sequences_match_simple_kernels`: T = 2048 and 4096 against the simple kernels on the GPU.
//! 4. `backward_is_deterministic`: forward and backward three times (the default, whose backward is
//!    the separate kernels, and the fused backward with split buffers), the same bits.
//! 5. The forward on Hopper's warpgroup MMA (`AttentionKernel::Wgmma`, compute capability 9.0 only):
//!    `wgmma_probes_match_cpu` runs its building blocks alone (ONE `wgmma.m64n64k16` first, then the
//!    `Q K^T` and `P V` steps at both head dims) and names the wrong one; `wgmma_forward_matches_cpu_and_mma`
//!    runs every compiled wgmma variant against the CPU reference and against the mma.sync forward, with
//!    the mma backward run on each forward's `out` and `lse`.
//!
//! Tolerances, for BF16 inputs and outputs with F32 accumulation (P and dS are rounded to BF16 before
//! their matrix products, as in FlashAttention): against the F32 reference computed from the same BF16
//! inputs, per tensor,
//! - out, dq, dk, dv: max |err| <= 2e-2 * max |ref| + 1e-4 and ||err||_2 <= 1e-2 * ||ref||_2 (out) or
//!   2e-2 * ||ref||_2 (gradients);
//! - lse: max |err| <= 1e-3 * max(1, max |ref|).
//!
//! Rounding the outputs to BF16 alone gives about 4e-3 of the largest value and 1.5e-3 in L2.

use fp8_kernels::attention::{
    attention_backward, attention_forward, run_layout_probe, run_wgmma_probe,
    wgmma_backward_variants, wgmma_forward_variants, AttentionConfig, AttentionKernel,
    AttentionShape, AttentionTiles, AttentionWorkspace, BackwardKernels, DqAccumulation,
    WgmmaProbe, HEAD_DIMS,
};
use fp8_kernels::{Device, KernelError};
use half::bf16;
use std::sync::OnceLock;

mod attention_common;
use attention_common::{
    assert_no_failures, check_all, cycled_variants, inputs, matrix_probe_ok, probe_name, probe_ok,
    reference, wgmma_probe_name, wgmma_probes, wgmma_shapes, Inputs, Outputs, ProbeCase,
    WgmmaProbeCase, PROBES,
};

/// One device for the whole binary, so the module is compiled once.
/// The mma.sync kernels with their defaults (the default config, `Auto`, runs the wgmma kernels on
/// Hopper).
fn mma() -> AttentionConfig {
    AttentionConfig {
        kernel: AttentionKernel::Mma,
        ..Default::default()
    }
}

fn gpu() -> Device {
    static DEV: OnceLock<Result<Device, String>> = OnceLock::new();
    match DEV.get_or_init(|| Device::cuda(0).map_err(|e| e.to_string())) {
        Ok(d) => d.clone(),
        Err(e) => panic!("no usable CUDA device: {e}"),
    }
}

/// Forward and backward on `dev`; also returns the raw bits of out and d_qkv.
fn run(
    dev: &Device,
    inp: &Inputs,
    cfg: &AttentionConfig,
    ws: &mut AttentionWorkspace,
) -> Result<(Outputs, Vec<u16>, Vec<u16>), KernelError> {
    let s = &inp.shape;
    let qkv = dev.upload(&inp.x)?;
    let d_out = dev.upload(&inp.dy)?;
    let mut out = dev.zeros::<bf16>(s.out_len())?;
    let mut lse = dev.zeros::<f32>(s.lse_len())?;
    let mut dqkv = dev.zeros::<bf16>(s.qkv_len())?;
    attention_forward(s, cfg, &qkv, &mut out, &mut lse)?;
    attention_backward(s, cfg, &qkv, &out, &d_out, &lse, &mut dqkv, ws)?;
    let o = out.to_vec()?;
    let g = dqkv.to_vec()?;
    Ok((
        Outputs {
            out: o.iter().map(|v| v.to_f32()).collect(),
            lse: lse.to_vec()?,
            dqkv: g.iter().map(|v| v.to_f32()).collect(),
        },
        o.iter().map(|v| v.to_bits()).collect(),
        g.iter().map(|v| v.to_bits()).collect(),
    ))
}

/// The configurations checked at head dim `hd` and length `t`: the simple kernels; the mma defaults; the
/// defaults of `Auto` (the wgmma kernels on Hopper at head dims 64 and 128); every
/// compiled forward, dK/dV and dQ variant (the i-th of each list together); the fused backward
/// (deterministic with the default splits and 64-row tiles, with three splits and 32-row tiles when
/// `t > 128`, atomic).
fn variants(hd: usize, t: usize) -> Vec<(String, AttentionConfig)> {
    let base = mma();
    let with = |tiles: AttentionTiles| AttentionConfig { tiles, ..base };
    let mut v = vec![
        (
            "simple".to_string(),
            AttentionConfig {
                kernel: AttentionKernel::Simple,
                ..base
            },
        ),
        ("mma default".to_string(), base),
        ("auto default".to_string(), AttentionConfig::default()),
    ];
    for (forward, backward) in cycled_variants(hd) {
        v.push((
            format!("mma {forward} {backward}"),
            with(AttentionTiles {
                forward: Some(forward),
                backward: Some(backward),
                ..Default::default()
            }),
        ));
    }
    v.push((
        "mma fused q64".to_string(),
        with(AttentionTiles {
            backward: Some(BackwardKernels::Fused { query_rows: 64 }),
            ..Default::default()
        }),
    ));
    if t > 128 {
        v.push((
            "mma fused q32 splits 3".to_string(),
            with(AttentionTiles {
                backward: Some(BackwardKernels::Fused { query_rows: 32 }),
                backward_splits: Some(3),
                ..Default::default()
            }),
        ));
    }
    v.push((
        "mma fused atomic".to_string(),
        AttentionConfig {
            dq_accumulation: DqAccumulation::Atomic,
            ..base
        },
    ));
    v
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn layout_probes_match_cpu() {
    let dev = gpu();
    let case = ProbeCase::new(11);
    let mut ok = true;
    for probe in PROBES {
        let got = run_layout_probe(&dev, probe, &case.a, &case.b16).unwrap();
        ok &= probe_ok(probe_name(probe), &got, &case.want(probe));
    }
    assert!(ok, "a layout probe failed (see the lines above)");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_cpu() {
    let dev = gpu();
    let mut fails = Vec::new();
    let mut cases: Vec<(AttentionShape, Option<f32>)> = Vec::new();
    for hd in HEAD_DIMS {
        for (b, h, t) in [
            (1, 1, 1),
            (1, 2, 17),
            (2, 1, 64),
            (1, 1, 65),
            (2, 3, 200),
            (1, 2, 1024),
        ] {
            cases.push((AttentionShape::new(b, h, t, hd), None));
        }
    }
    // Many (batch, head) pairs in one grid, and a non-default scale.
    cases.push((AttentionShape::new(4, 24, 130, 32), None));
    cases.push((AttentionShape::new(2, 2, 100, 64), Some(0.3)));
    cases.push((AttentionShape::new(1, 3, 333, 128), Some(0.05)));

    for (i, (shape, scale)) in cases.iter().enumerate() {
        let inp = inputs(*shape, 100 + i as u64);
        let cfg0 = AttentionConfig {
            softmax_scale: *scale,
            ..Default::default()
        };
        let want = reference(&inp, cfg0.scale_for(shape.head_dim));
        for (name, cfg) in variants(shape.head_dim, shape.seq_len) {
            let cfg = AttentionConfig {
                softmax_scale: *scale,
                ..cfg
            };
            let label = format!(
                "B{} H{} T{} hd{} scale {:.3} [{name}]",
                shape.batch,
                shape.heads,
                shape.seq_len,
                shape.head_dim,
                cfg.scale_for(shape.head_dim)
            );
            let mut ws = AttentionWorkspace::new();
            match run(&dev, &inp, &cfg, &mut ws) {
                Ok((got, _, _)) => fails.extend(check_all(&label, shape, &got, &want)),
                Err(e) => {
                    let line = format!("FAIL {label}: error {e}");
                    println!("{line}");
                    fails.push(line);
                }
            }
        }
    }
    assert_no_failures(&fails);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn long_sequences_match_simple_kernels() {
    let dev = gpu();
    let mut fails = Vec::new();
    for (shape, seed) in [
        (AttentionShape::new(1, 2, 4096, 64), 1u64),
        (AttentionShape::new(1, 1, 2048, 128), 2),
        (AttentionShape::new(2, 2, 2500, 32), 3),
    ] {
        let inp = inputs(shape, seed);
        let simple = AttentionConfig {
            kernel: AttentionKernel::Simple,
            ..Default::default()
        };
        let mut ws = AttentionWorkspace::new();
        let (want, _, _) = run(&dev, &inp, &simple, &mut ws).unwrap();
        for (name, cfg) in variants(shape.head_dim, shape.seq_len).into_iter().skip(1) {
            let label = format!(
                "B{} H{} T{} hd{} [{name} vs simple]",
                shape.batch, shape.heads, shape.seq_len, shape.head_dim
            );
            let (got, _, _) = run(&dev, &inp, &cfg, &mut ws).unwrap();
            fails.extend(check_all(&label, &shape, &got, &want));
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn backward_is_deterministic() {
    let dev = gpu();
    for hd in HEAD_DIMS {
        let shape = AttentionShape::new(2, 3, 333, hd);
        let inp = inputs(shape, 77);
        for (name, cfg) in [
            ("mma default", mma()),
            ("auto default (wgmma on Hopper)", AttentionConfig::default()),
            (
                "mma fused q32 splits 2",
                AttentionConfig {
                    tiles: AttentionTiles {
                        backward: Some(BackwardKernels::Fused { query_rows: 32 }),
                        backward_splits: Some(2),
                        ..Default::default()
                    },
                    ..mma()
                },
            ),
            (
                "simple",
                AttentionConfig {
                    kernel: AttentionKernel::Simple,
                    ..Default::default()
                },
            ),
        ] {
            let mut ws = AttentionWorkspace::new();
            let (_, o1, g1) = run(&dev, &inp, &cfg, &mut ws).unwrap();
            // Once with the grown workspace (stale contents), once with a fresh one.
            let (_, o2, g2) = run(&dev, &inp, &cfg, &mut ws).unwrap();
            let (_, o3, g3) = run(&dev, &inp, &cfg, &mut AttentionWorkspace::new()).unwrap();
            let diff = |a: &[u16], b: &[u16]| a.iter().zip(b).filter(|(x, y)| x != y).count();
            println!(
                "hd{hd} [{name}]: out differs in {} / {}, d_qkv in {} / {} elements",
                diff(&o1, &o2) + diff(&o1, &o3),
                o1.len(),
                diff(&g1, &g2) + diff(&g1, &g3),
                g1.len()
            );
            assert!(
                o1 == o2 && o1 == o3,
                "hd{hd} [{name}]: forward not deterministic"
            );
            assert!(
                g1 == g2 && g1 == g3,
                "hd{hd} [{name}]: backward not deterministic"
            );
        }
        // The atomic mode may differ between runs; report how much.
        let atomic = AttentionConfig {
            dq_accumulation: DqAccumulation::Atomic,
            ..mma()
        };
        let mut ws = AttentionWorkspace::new();
        let (_, _, g1) = run(&dev, &inp, &atomic, &mut ws).unwrap();
        let (_, _, g2) = run(&dev, &inp, &atomic, &mut ws).unwrap();
        let n = g1.iter().zip(&g2).filter(|(x, y)| x != y).count();
        println!("hd{hd} [mma atomic]: d_qkv differs between two runs in {n} elements (allowed)");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rejects_bad_calls() {
    let dev = gpu();
    let s = AttentionShape::new(1, 2, 8, 64);
    let qkv = dev.zeros::<bf16>(s.qkv_len()).unwrap();
    let mut out = dev.zeros::<bf16>(s.out_len()).unwrap();
    let mut lse_cpu = Device::cpu().zeros::<f32>(s.lse_len()).unwrap();
    assert!(matches!(
        attention_forward(
            &s,
            &AttentionConfig::default(),
            &qkv,
            &mut out,
            &mut lse_cpu
        ),
        Err(KernelError::WrongDevice(_))
    ));
}

/// Grouped-query shapes: groups of 2, 4 and 8 and one key/value head, `T` across and off the 64-row
/// tiles, every head dim.
fn gqa_shapes() -> Vec<AttentionShape> {
    let mut v = Vec::new();
    for hd in HEAD_DIMS {
        v.push(AttentionShape::gqa(1, 4, 2, 17, hd));
        v.push(AttentionShape::gqa(2, 4, 1, 65, hd));
        v.push(AttentionShape::gqa(2, 6, 3, 200, hd));
        v.push(AttentionShape::gqa(1, 8, 1, 1024, hd));
    }
    v.push(AttentionShape::gqa(4, 24, 8, 130, 32));
    v
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gqa_cuda_matches_cpu() {
    // Every family (simple, tensor cores), the deterministic backward (default separate kernels and the
    // fused kernel with split buffers) and the atomic one, against the CPU reference.
    let dev = gpu();
    let mut fails = Vec::new();
    for (i, shape) in gqa_shapes().iter().enumerate() {
        let inp = inputs(*shape, 300 + i as u64);
        let want = reference(&inp, AttentionConfig::default().scale_for(shape.head_dim));
        for (name, cfg) in variants(shape.head_dim, shape.seq_len) {
            let label = format!(
                "B{} H{} KV{} T{} hd{} [{name}]",
                shape.batch, shape.heads, shape.kv_heads, shape.seq_len, shape.head_dim
            );
            match run(&dev, &inp, &cfg, &mut AttentionWorkspace::new()) {
                Ok((got, _, _)) => fails.extend(check_all(&label, shape, &got, &want)),
                Err(e) => {
                    let line = format!("FAIL {label}: error {e}");
                    println!("{line}");
                    fails.push(line);
                }
            }
        }
    }
    assert_no_failures(&fails);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gqa_backward_is_deterministic() {
    // The dK/dV group sum runs inside the kernels in a fixed order: the same bits on every run.
    let dev = gpu();
    for hd in HEAD_DIMS {
        let shape = AttentionShape::gqa(2, 8, 2, 333, hd);
        let inp = inputs(shape, 78);
        for (name, cfg) in [
            ("mma default", mma()),
            ("auto default (wgmma on Hopper)", AttentionConfig::default()),
            (
                "mma fused q32 splits 2",
                AttentionConfig {
                    tiles: AttentionTiles {
                        backward: Some(BackwardKernels::Fused { query_rows: 32 }),
                        backward_splits: Some(2),
                        ..Default::default()
                    },
                    ..mma()
                },
            ),
            (
                "simple",
                AttentionConfig {
                    kernel: AttentionKernel::Simple,
                    ..Default::default()
                },
            ),
        ] {
            let mut ws = AttentionWorkspace::new();
            let (_, o1, g1) = run(&dev, &inp, &cfg, &mut ws).unwrap();
            let (_, o2, g2) = run(&dev, &inp, &cfg, &mut ws).unwrap();
            let (_, o3, g3) = run(&dev, &inp, &cfg, &mut AttentionWorkspace::new()).unwrap();
            assert!(
                o1 == o2 && o1 == o3,
                "hd{hd} GQA [{name}]: forward not deterministic"
            );
            assert!(
                g1 == g2 && g1 == g3,
                "hd{hd} GQA [{name}]: backward not deterministic"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn wgmma_probes_match_cpu() {
    // Each building block of the wgmma forward alone, the single instruction first: a wrong descriptor
    // field, swizzle or fragment map shows up here as a wrong small product, with the wrong rows and
    // columns and where the misplaced values belong. Needs compute capability 9.0.
    let dev = gpu();
    let mut ok = true;
    for (probe, hd) in wgmma_probes() {
        let case = WgmmaProbeCase::new(probe, hd, 21);
        let name = wgmma_probe_name(probe, hd);
        let passed = match run_wgmma_probe(&dev, probe, hd, &case.a, &case.b16) {
            Ok(got) => matrix_probe_ok(&name, &got, &case.want(), case.out_cols()),
            Err(e) => {
                println!("FAIL probe {name}: error {e}");
                false
            }
        };
        ok &= passed;
        if !passed && probe == WgmmaProbe::Pv {
            // Which encoding of V's descriptor the GPU reads, if it is the other reading of the PTX ISA
            // (LBO and SBO exchanged): then att_wg_pv's strides are to be swapped.
            let swapped = WgmmaProbe::PvStrides {
                lbo: 1024,
                sbo: 64 * 128,
            };
            let name = wgmma_probe_name(swapped, hd);
            match run_wgmma_probe(&dev, swapped, hd, &case.a, &case.b16) {
                Ok(got) => {
                    let right = matrix_probe_ok(&name, &got, &case.want(), case.out_cols());
                    println!(
                        "     diagnosis: V's descriptor with LBO and SBO exchanged {}",
                        if right {
                            "is RIGHT: swap the strides in att_wg_pv (attention_wgmma.cu)"
                        } else {
                            "is wrong too"
                        }
                    );
                }
                Err(e) => println!("     diagnosis probe {name}: error {e}"),
            }
        }
    }
    assert!(ok, "a wgmma probe failed (see the lines above)");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn wgmma_forward_matches_cpu_and_mma() {
    // Every compiled wgmma forward variant at head dims 64 and 128, T in {1, 63, 64, 100, 128, 257,
    // 1024}, grouped-query ratios 1 to 8, batches 1 and 2, two non-default scales: out and lse against the
    // CPU reference and against the mma.sync forward (the default), within the forward's documented
    // bounds; the backward (mma kernels, the default) run on each forward's out and lse: its gradients
    // against the CPU's and against those from the mma forward's outputs. The forward must repeat its
    // bits. Needs compute capability 9.0.
    let dev = gpu();
    let mut fails = Vec::new();
    let mut cases: Vec<(AttentionShape, Option<f32>)> =
        wgmma_shapes().into_iter().map(|s| (s, None)).collect();
    cases.push((AttentionShape::new(2, 2, 100, 64), Some(0.3)));
    cases.push((AttentionShape::gqa(1, 6, 3, 333, 128), Some(0.05)));
    for (i, (shape, scale)) in cases.iter().enumerate() {
        let inp = inputs(*shape, 900 + i as u64);
        let base = AttentionConfig {
            softmax_scale: *scale,
            ..mma()
        };
        let want = reference(&inp, base.scale_for(shape.head_dim));
        let (_, mma_backward) = base.kernels_for(shape.head_dim).unwrap();
        let label = |name: &str| {
            format!(
                "B{} H{} KV{} T{} hd{} scale {:.3} [{name}]",
                shape.batch,
                shape.heads,
                shape.kv_heads,
                shape.seq_len,
                shape.head_dim,
                base.scale_for(shape.head_dim)
            )
        };
        let mma = match run(&dev, &inp, &base, &mut AttentionWorkspace::new()) {
            Ok((got, _, _)) => {
                fails.extend(check_all(&label("mma default vs cpu"), shape, &got, &want));
                Some(got)
            }
            Err(e) => {
                fails.push(format!("FAIL {}: error {e}", label("mma default")));
                None
            }
        };
        for &tiles in wgmma_forward_variants(shape.head_dim) {
            let cfg = AttentionConfig {
                kernel: AttentionKernel::Wgmma,
                tiles: AttentionTiles {
                    wgmma_forward: Some(tiles),
                    backward: Some(mma_backward),
                    ..Default::default()
                },
                ..base
            };
            let name = format!("wgmma {tiles}");
            let mut ws = AttentionWorkspace::new();
            match run(&dev, &inp, &cfg, &mut ws) {
                Ok((got, out_bits, _)) => {
                    fails.extend(check_all(
                        &label(&format!("{name} vs cpu")),
                        shape,
                        &got,
                        &want,
                    ));
                    if let Some(m) = &mma {
                        fails.extend(check_all(&label(&format!("{name} vs mma")), shape, &got, m));
                    }
                    match run(&dev, &inp, &cfg, &mut ws) {
                        Ok((again, bits, _)) if bits == out_bits && again.lse == got.lse => {}
                        Ok(_) => fails.push(format!(
                            "FAIL {}: the forward differs between two runs",
                            label(&name)
                        )),
                        Err(e) => fails.push(format!("FAIL {}: error {e}", label(&name))),
                    }
                }
                Err(e) => {
                    let line = format!("FAIL {}: error {e}", label(&name));
                    println!("{line}");
                    fails.push(line);
                }
            }
        }
    }
    assert_no_failures(&fails);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn wgmma_backward_matches_cpu_and_mma() {
    // The wgmma backward (after the default wgmma forward) at head dims 64 and 128 on the wgmma shapes
    // (T in {1, 63, 64, 100, 128, 257, 1024}, grouped-query ratios 1 to 8) and two non-default scales with
    // groups of 2 and 3: the deterministic dK/dV and dQ kernels (default and every compiled pair) and the
    // atomic fused kernel; the gradients
    // against the CPU reference and against the mma.sync kernels' (forward and backward) within the
    // documented bounds. The deterministic modes must repeat their bits, with a grown (stale) workspace
    // and a fresh one. Needs compute capability 9.0.
    let dev = gpu();
    let mut fails = Vec::new();
    let mut cases: Vec<(AttentionShape, Option<f32>)> =
        wgmma_shapes().into_iter().map(|s| (s, None)).collect();
    cases.push((AttentionShape::gqa(2, 6, 2, 333, 64), Some(0.3)));
    cases.push((AttentionShape::gqa(1, 6, 3, 700, 128), Some(0.05)));
    for (i, (shape, scale)) in cases.iter().enumerate() {
        let inp = inputs(*shape, 1900 + i as u64);
        let base = AttentionConfig {
            softmax_scale: *scale,
            kernel: AttentionKernel::Wgmma,
            ..Default::default()
        };
        let want = reference(&inp, base.scale_for(shape.head_dim));
        let label = |name: &str| {
            format!(
                "B{} H{} KV{} T{} hd{} scale {:.3} [{name}]",
                shape.batch,
                shape.heads,
                shape.kv_heads,
                shape.seq_len,
                shape.head_dim,
                base.scale_for(shape.head_dim)
            )
        };
        let mma_cfg = AttentionConfig {
            kernel: AttentionKernel::Mma,
            ..base
        };
        let mma = run(&dev, &inp, &mma_cfg, &mut AttentionWorkspace::new())
            .map_err(|e| fails.push(format!("FAIL {}: error {e}", label("mma"))))
            .ok();
        // The deterministic default, every compiled pair of dK/dV and dQ kernels, the atomic (fused)
        // kernel.
        let mut configs = vec![("wgmma deterministic".to_string(), base, true)];
        for t in wgmma_backward_variants(shape.head_dim) {
            configs.push((
                format!("wgmma {t}"),
                AttentionConfig {
                    tiles: AttentionTiles {
                        wgmma_backward: Some(t),
                        ..Default::default()
                    },
                    ..base
                },
                true,
            ));
        }
        configs.push((
            "wgmma atomic".to_string(),
            AttentionConfig {
                dq_accumulation: DqAccumulation::Atomic,
                ..base
            },
            false,
        ));
        for (name, cfg, deterministic) in configs {
            let mut ws = AttentionWorkspace::new();
            match run(&dev, &inp, &cfg, &mut ws) {
                Ok((got, _, g1)) => {
                    fails.extend(check_all(
                        &label(&format!("{name} vs cpu")),
                        shape,
                        &got,
                        &want,
                    ));
                    if let Some((m, _, _)) = &mma {
                        fails.extend(check_all(&label(&format!("{name} vs mma")), shape, &got, m));
                    }
                    if deterministic {
                        let again = run(&dev, &inp, &cfg, &mut ws).and_then(|a| {
                            Ok((a, run(&dev, &inp, &cfg, &mut AttentionWorkspace::new())?))
                        });
                        match again {
                            Ok(((_, _, g2), (_, _, g3))) if g1 == g2 && g1 == g3 => {}
                            Ok(_) => fails.push(format!(
                                "FAIL {}: the backward differs between runs",
                                label(&name)
                            )),
                            Err(e) => fails.push(format!("FAIL {}: error {e}", label(&name))),
                        }
                    }
                }
                Err(e) => {
                    let line = format!("FAIL {}: error {e}", label(&name));
                    println!("{line}");
                    fails.push(line);
                }
            }
        }
    }
    assert_no_failures(&fails);
}
