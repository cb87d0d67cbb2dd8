//! The block-scaled FP8 gradient exchange (`GradReduction::Fp8Block`) on thread ranks at world sizes 1, 2
//! and 4:
//! - every rank's shard equals, bit for bit, a reference computed on one thread from the definition (each
//!   rank's gradient cast in 1x128 tiles of `[world_size, shard_len]` by `block_quantize`, dequantized by
//!   `block_dequantize`, the pieces of each shard summed in F32 in rank order, divided, added to the
//!   shard), for both formats, F32 and BF16 shards, several lengths and divisors;
//! - the shard is within a derived bound of the exact sum of the gradients (below);
//! - with one channel of a weight gradient 1000x louder, the quiet channels keep the per-element bound of
//!   their own tiles, which a per-tensor FP8 quantization (one scale for the whole gradient, the same F32
//!   sum) and the per-tensor FP8 reduce-scatter (`GradReduction::Fp8`) break;
//! - E4M3 against E5M2 (the default's justification), and the non-finite count.
//!
//! The bound. Tile `t` of rank `r` has a power-of-two scale `s` with `fmax / (2 amax) < s <= fmax / amax`,
//! so `x * s` is exact and within the format's range, and its FP8 rounding is off by at most half a step:
//! `u * |x * s|` for a normal value (`u = 2^-(mantissa bits + 1)`), half the smallest subnormal `h` below.
//! Back at the gradient's scale (exactly: `scale_inv` is a power of two), each piece `d_r` satisfies
//! `|d_r - x_r| <= u |x_r| + 2 h amax_rt / fmax <= u amax_rt` (the second form is the bound per tile amax;
//! the first, per element, is what the loud-channel test holds the quiet channels to). The F32 sum of
//! `ws` pieces in rank order adds at most `gamma * sum |d_r|` with `gamma = (ws - 1) eps / (1 - (ws - 1)
//! eps)`, `eps = 2^-24`, and the multiply by `1 / divisor` one more `eps` of the result.

use fp8_core::Fp8Format;
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{
    block_dequantize, block_quantize, BlockQuantLayout, BlockQuantSpec, Buffer, Device,
    FloatElement, PackedRows1x128,
};
use fsdp_comm::{run_ranks, Communicator, ThreadComm};
use fsdp_shard::{GradReducer, GradReduction, ShardError};
use half::bf16;

const WORLD_SIZES: [usize; 3] = [1, 2, 4];
const EPS: f64 = 1.0 / (1u64 << 24) as f64;

/// Half the FP8 spacing at 1 relative to the value (`2^-(m+1)`).
fn unit_roundoff(format: Fp8Format) -> f64 {
    2f64.powi(-(format.mantissa_bits() as i32 + 1))
}

/// Rank `rank`'s full gradient of `len` elements: uniform values in [-1, 1) times `2^e`, `e` in -12..8
/// drawn per stretch of 100 elements (stretches straddle tiles, so tiles hold mixed magnitudes), with
/// every seventh stretch zero.
fn gradient(rank: usize, len: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed ^ ((rank as u64) << 32));
    (0..len)
        .map(|i| {
            let stretch = (i / 100) as u64;
            if stretch % 7 == 3 {
                return 0.0;
            }
            let mix = SplitMix64::mix(seed ^ ((rank as u64) << 40) ^ stretch);
            let e = (mix % 20) as i32 - 12;
            rng.uniform_f32() * 2f32.powi(e)
        })
        .collect()
}

/// Runs the reduction `mode` on `grads.len()` thread ranks: rank `r` reduces `grads[r]` into a shard that
/// starts as `start` (in `D`), divided by `divisor`. Returns every rank's shard widened to f32, and its
/// non-finite count.
fn exchange<D: FloatElement>(
    grads: &[Vec<f32>],
    mode: GradReduction,
    divisor: f32,
    start: &[f32],
) -> Vec<(Vec<f32>, u64)> {
    run_ranks(grads.len(), |comm: ThreadComm| {
        let dev = Device::cpu();
        let mut full = dev.upload(&grads[comm.rank()])?;
        let s: Vec<D> = start.iter().map(|&v| D::from_f32(v)).collect();
        let mut shard = dev.upload(&s)?;
        let mut reducer = GradReducer::new(mode, &dev);
        reducer.reduce_scatter_add(&comm, mode, &mut full, &mut shard, divisor)?;
        let out = shard.to_vec()?.iter().map(|v| v.to_f32()).collect();
        Ok::<_, ShardError>((out, reducer.try_take_nonfinite()?))
    })
    .unwrap()
}

/// Each rank's gradient cast and dequantized by the 1x128 kernels (`[ws, n]`, row `d` = rank `d`'s
/// region), on one thread.
fn dequantized_pieces(grads: &[Vec<f32>], n: usize, format: Fp8Format) -> Vec<Vec<f32>> {
    let dev = Device::cpu();
    let ws = grads.len();
    let spec = BlockQuantSpec::new(BlockQuantLayout::Rows1x128, format);
    let layout = spec.layout.output_layout(ws, n).unwrap();
    grads
        .iter()
        .map(|g| {
            let x = dev.upload(g).unwrap();
            let mut q: Buffer<u8> = dev.zeros(ws * n).unwrap();
            let mut s: Buffer<f32> = dev.zeros(layout.num_blocks()).unwrap();
            let mut si: Buffer<f32> = dev.zeros(layout.num_blocks()).unwrap();
            block_quantize(&x, [ws, n], spec, &mut q, &mut s, &mut si).unwrap();
            let mut y: Buffer<f32> = dev.zeros(ws * n).unwrap();
            block_dequantize(&q, &layout, spec.scale_order, format, &si, &mut y).unwrap();
            y.to_vec().unwrap()
        })
        .collect()
}

/// Every rank's shard from the definition: the dequantized pieces of its region summed in F32 in rank
/// order (from rank 0's piece), times `1 / divisor`, added to `start` in `D`.
fn reference_shards<D: FloatElement>(
    pieces: &[Vec<f32>],
    n: usize,
    divisor: f32,
    start: &[f32],
) -> Vec<Vec<f32>> {
    let alpha = 1.0 / divisor;
    (0..pieces.len())
        .map(|d| {
            (0..n)
                .map(|i| {
                    let mut sum = pieces[0][d * n + i];
                    for p in &pieces[1..] {
                        sum += p[d * n + i];
                    }
                    let s0 = D::from_f32(start[i]).to_f32();
                    D::from_f32(s0 + alpha * sum).to_f32()
                })
                .collect()
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check_bitwise<D: FloatElement>(ws: usize, n: usize, format: Fp8Format, divisor: f32) {
    let grads: Vec<Vec<f32>> = (0..ws)
        .map(|r| gradient(r, ws * n, n as u64 * 31 + ws as u64))
        .collect();
    let pieces = dequantized_pieces(&grads, n, format);
    let mut rng = SplitMix64::new(n as u64);
    for start in [vec![0.0f32; n], rng.uniform_vec(n)] {
        let got = exchange::<D>(&grads, GradReduction::Fp8Block(format), divisor, &start);
        let want = reference_shards::<D>(&pieces, n, divisor, &start);
        for (d, ((g, nonfinite), w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(*nonfinite, 0);
            assert!(
                bits(g) == bits(w),
                "ws {ws} n {n} {format} {} divisor {divisor}: rank {d}'s shard differs from the reference",
                D::NAME
            );
        }
    }
}

#[test]
fn exchanged_shards_equal_the_one_thread_reference_bitwise() {
    // Shard lengths as fsdp-shard makes them (multiples of 16), multiples of 128 and not.
    for ws in WORLD_SIZES {
        for n in [16, 128, 144, 1008, 4112] {
            for format in Fp8Format::ALL {
                for divisor in [1.0, 8.0, 3.0] {
                    check_bitwise::<f32>(ws, n, format, divisor);
                    check_bitwise::<bf16>(ws, n, format, divisor);
                }
            }
        }
    }
}

/// The amax of the tile of element `i` of row `d` (`[ws, n]` in 1x128 tiles) of `g`.
fn tile_amax(g: &[f32], n: usize, d: usize, i: usize) -> f64 {
    let t0 = i / 128 * 128;
    g[d * n + t0..d * n + (t0 + 128).min(n)]
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs() as f64))
}

/// Per element of every shard: the error against the exact sum (f64) divided by `1 / divisor`, and the
/// bound of the module docs, per tile amax (`per_element` false) or per element.
fn errors_and_bounds(
    grads: &[Vec<f32>],
    shards: &[Vec<f32>],
    n: usize,
    format: Fp8Format,
    divisor: f32,
    per_element: bool,
) -> Vec<Vec<(f64, f64)>> {
    let ws = grads.len();
    let (u, alpha) = (unit_roundoff(format), 1.0 / divisor as f64);
    let floor = format.min_subnormal() as f64 / format.max() as f64; // 2h / fmax
    let k = (ws - 1) as f64 * EPS;
    let gamma = k / (1.0 - k);
    (0..ws)
        .map(|d| {
            (0..n)
                .map(|i| {
                    let (mut exact, mut q, mut mag) = (0.0f64, 0.0f64, 0.0f64);
                    for g in grads {
                        let (x, a) = (g[d * n + i] as f64, tile_amax(g, n, d, i));
                        exact += x;
                        let e = if per_element {
                            u * x.abs() + floor * a
                        } else {
                            u * a
                        };
                        q += e;
                        mag += x.abs() + e;
                    }
                    let got = shards[d][i] as f64;
                    let bound = alpha * (q + gamma * mag) + EPS * got.abs();
                    ((got - alpha * exact).abs(), bound)
                })
                .collect()
        })
        .collect()
}

#[test]
fn exchanged_shards_are_within_the_derived_bound_of_the_exact_sum() {
    for ws in WORLD_SIZES {
        for n in [144, 4096] {
            for format in Fp8Format::ALL {
                for divisor in [1.0f32, 3.0] {
                    let grads: Vec<Vec<f32>> =
                        (0..ws).map(|r| gradient(r, ws * n, 7 + n as u64)).collect();
                    let got = exchange::<f32>(
                        &grads,
                        GradReduction::Fp8Block(format),
                        divisor,
                        &vec![0.0; n],
                    );
                    let shards: Vec<Vec<f32>> = got.into_iter().map(|(s, _)| s).collect();
                    let (mut worst, mut inexact) = (0.0f64, false);
                    for per_element in [false, true] {
                        let eb =
                            errors_and_bounds(&grads, &shards, n, format, divisor, per_element);
                        for (d, row) in eb.iter().enumerate() {
                            for (i, &(err, bound)) in row.iter().enumerate() {
                                assert!(
                                    err <= bound,
                                    "ws {ws} n {n} {format} divisor {divisor} per element \
                                     {per_element}: rank {d} element {i}: error {err:e} > bound {bound:e}"
                                );
                                inexact |= err > 0.0;
                                if !per_element && bound > 0.0 {
                                    worst = worst.max(err / bound);
                                }
                            }
                        }
                    }
                    // FP8 is not exact here, and the bound per tile amax is not loose by orders of
                    // magnitude (it is reached only by elements near their tile's amax).
                    assert!(inexact, "ws {ws} n {n} {format}: no rounding at all?");
                    assert!(
                        worst > 0.1,
                        "ws {ws} n {n} {format}: largest error/bound {worst:.3}"
                    );
                }
            }
        }
    }
}

/// A weight gradient `[8, 256]` on rank `rank`: channel (row) 3 is 1000x louder; every element is a
/// random sign times `2^(-24 U)`, `U` uniform in [0, 1) (gradients span many binades), the same on every
/// rank (data-parallel ranks see correlated gradients; equal signs also keep the sum from hiding a
/// piece's error by cancellation), times a per-rank factor in [0.5, 1) and a per-element jitter of 10 %.
fn loud_channel_gradient(rank: usize) -> Vec<f32> {
    let mut shared = SplitMix64::new(0x10AD);
    let mut own = SplitMix64::new(0x10AD + 1 + rank as u64);
    let k = 0.5 + 0.5 * own.unit_f32();
    (0..8 * 256)
        .map(|i| {
            let sign = if shared.next_u64() & 1 == 0 {
                1.0
            } else {
                -1.0
            };
            let v = sign * 2f32.powf(-24.0 * shared.unit_f32()) * k * (1.0 + 0.1 * own.unit_f32());
            if i / 256 == 3 {
                v * 1000.0
            } else {
                v
            }
        })
        .collect()
}

/// Per-tensor FP8 with the same exchange: one power-of-two scale for every rank's whole gradient (from
/// the amax over all ranks, as the per-tensor path agrees on it), each element cast and decoded, the pieces
/// summed in F32 in rank order.
fn per_tensor_shards(grads: &[Vec<f32>], n: usize, format: Fp8Format) -> Vec<Vec<f32>> {
    let amax = grads.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = fp8_core::block_scale(amax, format.max(), fp8_core::ScaleRounding::PowerOfTwo);
    let pieces: Vec<Vec<f32>> = grads
        .iter()
        .map(|g| {
            g.iter()
                .map(|&x| format.decode(format.encode(x * s)) * (1.0 / s))
                .collect()
        })
        .collect();
    reference_shards::<f32>(&pieces, n, 1.0, &vec![0.0; n])
}

/// Elements of the quiet channels (not row 3) whose error exceeds their per-element block bound, and
/// the quiet elements counted.
fn quiet_violations(
    grads: &[Vec<f32>],
    shards: &[Vec<f32>],
    n: usize,
    format: Fp8Format,
) -> (usize, usize) {
    let eb = errors_and_bounds(grads, shards, n, format, 1.0, true);
    let (mut bad, mut quiet) = (0, 0);
    for (d, row) in eb.iter().enumerate() {
        for (i, &(err, bound)) in row.iter().enumerate() {
            if (d * n + i) / 256 != 3 {
                quiet += 1;
                bad += usize::from(err > bound);
            }
        }
    }
    (bad, quiet)
}

#[test]
fn one_loud_channel_leaves_the_quiet_blocks_accurate() {
    for ws in WORLD_SIZES {
        let n = 8 * 256 / ws; // a multiple of 256: tiles are 128 elements of one channel
        let grads: Vec<Vec<f32>> = (0..ws).map(loud_channel_gradient).collect();
        for format in Fp8Format::ALL {
            let block =
                exchange::<f32>(&grads, GradReduction::Fp8Block(format), 1.0, &vec![0.0; n]);
            let block: Vec<Vec<f32>> = block.into_iter().map(|(s, _)| s).collect();
            let (bad_block, quiet) = quiet_violations(&grads, &block, n, format);
            let tensor = per_tensor_shards(&grads, n, format);
            let (bad_tensor, _) = quiet_violations(&grads, &tensor, n, format);
            let rs = exchange::<f32>(&grads, GradReduction::Fp8(format), 1.0, &vec![0.0; n]);
            let rs: Vec<Vec<f32>> = rs.into_iter().map(|(s, _)| s).collect();
            let (bad_rs, _) = quiet_violations(&grads, &rs, n, format);
            println!(
                "ws {ws} {format}: quiet elements outside their block bound: block exchange {bad_block}, \
                 per-tensor FP8 {bad_tensor}, per-tensor FP8 reduce-scatter {bad_rs}, of {quiet}"
            );
            // Every quiet element keeps the bound of its own tile ...
            assert_eq!(bad_block, 0, "ws {ws} {format}");
            // ... which per-tensor scaling, its scale set by the loud channel, breaks: quiet values fall
            // into the format's subnormals or to zero. E4M3 (17.8 binades with subnormals, 10 of them
            // taken by the loud channel) loses a large share; E5M2 (31.8 binades) only the values below
            // about 2^-19 of their channel's amax.
            let share = match format {
                Fp8Format::E4M3 => 4,
                Fp8Format::E5M2 => 20,
            };
            assert!(
                bad_tensor * share > quiet,
                "ws {ws} {format}: per-tensor broke only {bad_tensor} of {quiet}"
            );
            assert!(
                bad_rs * share > quiet,
                "ws {ws} {format}: the FP8 reduce-scatter broke only {bad_rs} of {quiet}"
            );
        }
    }
}

/// Gradient-like values: per 32-element stretch a magnitude `2^e` (e in -6..6) times the sum of four
/// uniforms (a bell shape), and every 50th element 30x larger (outliers).
fn bell_gradient(rank: usize, len: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(0xBE11 ^ ((rank as u64) << 20));
    (0..len)
        .map(|i| {
            let e = (SplitMix64::mix((rank * 1_000_003 + i / 32) as u64) % 12) as i32 - 6;
            let v: f32 = (0..4).map(|_| rng.uniform_f32()).sum::<f32>() * 2f32.powi(e);
            if i % 50 == 7 {
                v * 30.0
            } else {
                v
            }
        })
        .collect()
}

/// `||shards - exact|| / ||exact||` over every rank's shard.
fn relative_l2(grads: &[Vec<f32>], shards: &[Vec<f32>], n: usize) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (d, s) in shards.iter().enumerate() {
        for (i, &v) in s.iter().enumerate() {
            let exact: f64 = grads.iter().map(|g| g[d * n + i] as f64).sum();
            num += (v as f64 - exact).powi(2);
            den += exact.powi(2);
        }
    }
    (num / den).sqrt()
}

#[test]
fn e4m3_is_the_more_accurate_block_format() {
    let (ws, n) = (4, 8192);
    let profiles: [(&str, Vec<Vec<f32>>); 2] = [
        (
            "bell with outliers",
            (0..ws).map(|r| bell_gradient(r, ws * n)).collect(),
        ),
        (
            "log-uniform over 2^-24..1, one channel in 8 1000x",
            (0..ws)
                .map(|r| {
                    let mut g = Vec::new();
                    while g.len() < ws * n {
                        g.extend(loud_channel_gradient(r));
                    }
                    g.truncate(ws * n);
                    g
                })
                .collect(),
        ),
    ];
    for (name, grads) in &profiles {
        let err = |mode| {
            let got = exchange::<f32>(grads, mode, 1.0, &vec![0.0; n]);
            let shards: Vec<Vec<f32>> = got.into_iter().map(|(s, _)| s).collect();
            relative_l2(grads, &shards, n)
        };
        let e4 = err(GradReduction::Fp8Block(Fp8Format::E4M3));
        let e5 = err(GradReduction::Fp8Block(Fp8Format::E5M2));
        let t4 = err(GradReduction::Fp8(Fp8Format::E4M3));
        let t5 = err(GradReduction::Fp8(Fp8Format::E5M2));
        let b16 = err(GradReduction::Bf16);
        println!(
            "{name}, ws {ws}: relative L2 error: block E4M3 {e4:.2e}, block E5M2 {e5:.2e}, \
             per-tensor reduce-scatter E4M3 {t4:.2e}, E5M2 {t5:.2e}, BF16 {b16:.2e}"
        );
        assert!(e4 < 0.75 * e5, "{name}: E4M3 {e4:e} vs E5M2 {e5:e}");
    }
    assert_eq!(
        GradReduction::FP8_BLOCK,
        GradReduction::Fp8Block(Fp8Format::E4M3)
    );
}

#[test]
fn non_finite_values_are_counted_before_the_cast() {
    let (ws, n) = (2, 256);
    let mut grads: Vec<Vec<f32>> = (0..ws).map(|r| gradient(r, ws * n, 5)).collect();
    grads[1][300] = f32::NAN;
    grads[1][10] = f32::INFINITY;
    let got = exchange::<f32>(&grads, GradReduction::FP8_BLOCK, 1.0, &vec![0.0; n]);
    assert_eq!(got[0].1, 0);
    assert_eq!(got[1].1, 2);
    // The NaN reaches rank 1's shard (element 300 - 256), the saturated infinity rank 0's as a finite
    // value: the count, not the shard, is what makes a trainer skip the step.
    assert!(got[1].0[44].is_nan());
    assert!(got[0].0[10].is_finite());
}

#[test]
fn wire_bytes_per_element() {
    // One record per destination rank: 1 byte per code and one F32 inverse scale per 128 elements.
    let p = PackedRows1x128::new(4, 1 << 20).unwrap();
    let per_element = p.num_bytes() as f64 / (4 << 20) as f64;
    assert_eq!(per_element, 1.0 + 4.0 / 128.0);
    // A shard of 144 elements: 144 code bytes + one 16-byte line for its two scales.
    assert_eq!(PackedRows1x128::new(1, 144).unwrap().row_bytes(), 160);
}
