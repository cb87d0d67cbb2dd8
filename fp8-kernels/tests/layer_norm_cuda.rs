//! LayerNorm / RMSNorm on CUDA against the CPU reference, bit for bit, on random inputs of shapes that take
//! every kernel path (register-held rows of 3 to 16 vectors per lane, re-read rows for d not a multiple of
//! 8 and for wide rows, several rows per warp, FP8 tiles of 8 and 16 rows with partial last tiles,
//! transposed pieces of 16 and 8 rows and byte-wise transposed stores, one tile and many tiles of
//! parameter chunks with short last chunks, tiles and runs, the backward with and without the next row
//! loaded ahead, its running sums in shared and in global memory), both element types, both norms, with and
//! without bias, overwrite and accumulate; CUDA run twice gives the same bits; and every launch choice
//! (`NormLaunch`, the previous forward kernels included) gives the same bits. GPU tests: ignored unless run with `--ignored`
//! (`scripts/gpu-tests.sh`), and failing where no GPU can be opened.

mod common;

use common::{
    assert_each_layout_alone, bits, cuda_device, first_difference, join_differences,
    matches_cpu_and_deterministic, norm_grads,
};
use fp8_core::Fp8Format;
use fp8_kernels::layer_norm::{
    norm_backward, norm_forward, norm_forward_fp8, Fp8NormOutput, GradMode, NormKind, NormLaunch,
    NormSpec, NormStats, MAX_FP8_ROW,
};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{AmaxSlot, Buffer, Device, FloatElement};
use half::bf16;

/// Everything one device produced for a case.
#[derive(PartialEq, Debug)]
struct Outputs {
    mean: Vec<u32>,
    rstd: Vec<u32>,
    y: Vec<u32>,
    codes: Vec<u8>,
    codes_t: Vec<u8>,
    amax: Vec<u32>,
    dx: Vec<u32>,
    dx_acc: Vec<u32>,
    dw: Vec<u32>,
    db: Vec<u32>,
}

#[derive(Clone)]
struct Inputs {
    spec: NormSpec,
    x: Vec<f32>,
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    dy: Vec<f32>,
    old_dx: Vec<f32>,
    old_p: Vec<f32>,
    scale: f32,
}

/// Random inputs; the first row shifted by 40 (cancellation in the mean); with `nan`, one NaN in row 1 (it
/// makes that row's outputs and every dweight NaN, so only one case carries one).
fn inputs(spec: NormSpec, bias: bool, nan: bool, seed: u64) -> Inputs {
    let mut rng = SplitMix64::new(seed);
    let n = spec.rows * spec.d;
    let mut x: Vec<f32> = (0..n).map(|_| rng.uniform_f32() * 3.0).collect();
    for v in x.iter_mut().take(spec.d) {
        *v += 40.0;
    }
    if nan && spec.rows > 1 {
        x[spec.d + spec.d / 2] = f32::NAN;
    }
    Inputs {
        spec,
        w: (0..spec.d).map(|_| rng.uniform_f32() + 1.0).collect(),
        b: bias.then(|| (0..spec.d).map(|_| rng.uniform_f32()).collect()),
        dy: (0..n).map(|_| rng.uniform_f32()).collect(),
        old_dx: (0..n).map(|_| rng.uniform_f32()).collect(),
        old_p: (0..spec.d).map(|_| rng.uniform_f32()).collect(),
        x,
        scale: 16.0,
    }
}

fn run<T: FloatElement, G: FloatElement>(dev: &Device, c: &Inputs) -> Outputs {
    let s = &c.spec;
    let n = s.rows * s.d;
    let up = |v: &[f32]| -> Buffer<T> {
        dev.upload(&v.iter().map(|&a| T::from_f32(a)).collect::<Vec<_>>())
            .unwrap()
    };
    let upg = |v: &[f32]| -> Buffer<G> {
        dev.upload(&v.iter().map(|&a| G::from_f32(a)).collect::<Vec<_>>())
            .unwrap()
    };
    let (x, w) = (up(&c.x), up(&c.w));
    let b = c.b.as_ref().map(|b| up(b));
    let mut stats = NormStats::new(dev, s.rows).unwrap();
    let mut y: Buffer<T> = dev.zeros(n).unwrap();
    norm_forward(s, &x, &w, b.as_ref(), &mut stats, &mut y).unwrap();
    let (mean, rstd) = (bits(&stats.mean), bits(&stats.rstd));

    let (mut codes, mut codes_t) = (dev.zeros::<u8>(n).unwrap(), dev.zeros::<u8>(n).unwrap());
    let mut amax = dev.upload(&[0.0f32, 0.0, 0.0]).unwrap();
    let sc = dev.upload(&[c.scale]).unwrap();
    if s.d <= MAX_FP8_ROW {
        let mut st2 = NormStats::new(dev, s.rows).unwrap();
        norm_forward_fp8(
            s,
            &x,
            &w,
            b.as_ref(),
            &mut st2,
            Fp8NormOutput {
                format: Fp8Format::E4M3,
                scale: &sc,
                codes: Some(&mut codes),
                codes_t: Some(&mut codes_t),
                amax: Some(AmaxSlot::new(&mut amax, 2)),
            },
        )
        .unwrap();
        assert_eq!(bits(&st2.mean), mean, "fused forward statistics");
        assert_eq!(bits(&st2.rstd), rstd, "fused forward statistics");
        // Either layout alone (the kernel without its shared-memory tile, or without the row-major
        // stores): the same codes, the other buffer untouched.
        let (full, full_t) = (codes.to_vec().unwrap(), codes_t.to_vec().unwrap());
        assert_each_layout_alone(
            dev,
            &full,
            &full_t,
            &(),
            &format!("{s:?}"),
            |codes, codes_t| {
                let mut st3 = NormStats::new(dev, s.rows).unwrap();
                norm_forward_fp8(
                    s,
                    &x,
                    &w,
                    b.as_ref(),
                    &mut st3,
                    Fp8NormOutput {
                        format: Fp8Format::E4M3,
                        scale: &sc,
                        codes,
                        codes_t,
                        amax: None,
                    },
                )
                .unwrap();
            },
        );
    }

    let dy = upg(&c.dy);
    let mut dx: Buffer<G> = dev.zeros(n).unwrap();
    let mut dw = dev.zeros::<f32>(s.d).unwrap();
    let mut db = dev.zeros::<f32>(s.d).unwrap();
    let backward =
        |mode, dx: &mut Buffer<G>, dw: &mut Buffer<f32>, db: Option<&mut Buffer<f32>>| {
            norm_backward(s, &x, &w, &stats, &dy, norm_grads(mode, dx, dw, db)).unwrap()
        };
    backward(GradMode::Overwrite, &mut dx, &mut dw, Some(&mut db));
    let mut dx_acc = upg(&c.old_dx);
    let mut dw_acc = dev.upload(&c.old_p).unwrap();
    backward(GradMode::Accumulate, &mut dx_acc, &mut dw_acc, None);
    let mut dw_all = bits(&dw);
    dw_all.extend(bits(&dw_acc));
    Outputs {
        mean,
        rstd,
        y: bits(&y),
        codes: codes.to_vec().unwrap(),
        codes_t: codes_t.to_vec().unwrap(),
        amax: bits(&amax),
        dx: bits(&dx),
        dx_acc: bits(&dx_acc),
        dw: dw_all,
        db: bits(&db),
    }
}

/// Names the first differing element of every field that differs.
fn differences(a: &Outputs, b: &Outputs) -> String {
    join_differences([
        first_difference("mean", &a.mean, &b.mean),
        first_difference("rstd", &a.rstd, &b.rstd),
        first_difference("y", &a.y, &b.y),
        first_difference("codes", &a.codes, &b.codes),
        first_difference("codes_t", &a.codes_t, &b.codes_t),
        first_difference("amax", &a.amax, &b.amax),
        first_difference("dx", &a.dx, &b.dx),
        first_difference("dx_acc", &a.dx_acc, &b.dx_acc),
        first_difference("dw", &a.dw, &b.dw),
        first_difference("db", &a.db, &b.db),
    ])
}

fn compare<T: FloatElement, G: FloatElement>(gpu: &Device, c: &Inputs, what: &str) -> bool {
    let cpu = run::<T, G>(&Device::cpu(), c);
    let g1 = run::<T, G>(gpu, c);
    let g2 = run::<T, G>(gpu, c);
    matches_cpu_and_deterministic(what, &cpu, &g1, &g2, differences)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_cpu_bitwise_and_is_deterministic() {
    let gpu = cuda_device();
    // (rows, d, with a NaN)
    let shapes = [
        (16384, 768, false), // 3 vectors per lane, 2 rows per warp, tiles of 16 rows; 256 parameter tiles
        (8192, 2560, false), // 10 vectors per lane, 16-row tiles of 16 warps; backward re-reads
        (8192, 2048, false), // 8 vectors per lane, 16 warps per block; backward holds 8 vectors
        (4096, 3072, false), // 12 vectors per lane
        (2049, 768, false),  // chunks of 2 rows, the last of one (odd rows for the row prefetch)
        (64, 1024, false),   // exactly 4 vectors per lane
        (48, 4096, false), // exactly 16 vectors per lane; LayerNorm's sums (with bias) in global memory
        (40, 1000, false), // a partial last FP8 tile; 8-row transposed pieces
        (48, 4104, false), // d > 4096: rows re-read from memory
        (37, 100, false),  // d not a multiple of 8: element loads, byte-wise stores
        (37, 96, true),    // a NaN input
        (33, 2560, false), // rows not a multiple of 8: byte-wise transposed stores
        (3, 70_000, false), // wider than the FP8 output allows: plain forward and backward only
        (1000, 8, false),  // many parameter chunks of short rows
        (20000, 64, false), // chunks of 10 rows, 32 runs of 8 tiles
    ];
    let mut ok = true;
    let mut seed = 1;
    for (rows, d, nan) in shapes {
        for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
            let bias = kind == NormKind::LayerNorm;
            let spec = NormSpec {
                kind,
                rows,
                d,
                eps: 1e-5,
                launch: NormLaunch::default(),
            };
            let c = inputs(spec, bias, nan, seed);
            seed += 1;
            let what = format!("{kind:?} [{rows}, {d}]");
            ok &= compare::<bf16, bf16>(&gpu, &c, &format!("{what} bf16/bf16"));
            ok &= compare::<f32, f32>(&gpu, &c, &format!("{what} f32/f32"));
            if d <= 2560 {
                ok &= compare::<bf16, f32>(&gpu, &c, &format!("{what} bf16/f32"));
                ok &= compare::<f32, bf16>(&gpu, &c, &format!("{what} f32/bf16"));
            }
        }
    }
    assert!(ok, "CUDA differs from the CPU or between runs (see above)");
}

/// The launch choices the test runs: each field varied alone, a few combinations, and the previous forward
/// kernels.
fn launch_choices() -> Vec<NormLaunch> {
    let auto = NormLaunch::default();
    let mut v = Vec::new();
    for nv in [0, 2, 3, 4, 6, 8, 10, 12, 16] {
        v.push(NormLaunch {
            vectors_per_lane: Some(nv),
            ..auto
        });
    }
    for tile in [1, 8, 16, 32, 64] {
        v.push(NormLaunch {
            tile_rows: Some(tile),
            ..auto
        });
    }
    for rpw in [1, 2, 4] {
        v.push(NormLaunch {
            rows_per_warp: Some(rpw),
            ..auto
        });
        v.push(NormLaunch {
            rows_per_warp: Some(rpw),
            tile_rows: Some(32),
            vectors_per_lane: Some(4),
            ..auto
        });
    }
    for prefetch in [false, true] {
        v.push(NormLaunch {
            prefetch: Some(prefetch),
            ..auto
        });
    }
    for tile in [None, Some(8), Some(32)] {
        v.push(NormLaunch {
            legacy_forward: true,
            tile_rows: tile,
            ..auto
        });
    }
    v
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_launch_choice_gives_the_same_bits() {
    let gpu = cuda_device();
    let mut ok = true;
    let mut seed = 100;
    for (rows, d) in [(8192, 2560), (2048, 768), (40, 1000)] {
        for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
            let c = inputs(
                NormSpec::layer_norm(rows, d),
                kind == NormKind::LayerNorm,
                false,
                seed,
            );
            let c = Inputs {
                spec: NormSpec { kind, ..c.spec },
                ..c
            };
            seed += 1;
            let cpu = run::<bf16, bf16>(&Device::cpu(), &c);
            for launch in launch_choices() {
                let ci = Inputs {
                    spec: c.spec.with_launch(launch),
                    ..c.clone()
                };
                let g = run::<bf16, bf16>(&gpu, &ci);
                if g != cpu {
                    println!(
                        "MISMATCH {kind:?} [{rows}, {d}] {launch:?}: {}",
                        differences(&g, &cpu)
                    );
                    ok = false;
                }
            }
            println!("ok {kind:?} [{rows}, {d}]: every launch choice");
        }
    }
    assert!(ok, "a launch choice changed the results (see above)");
}
