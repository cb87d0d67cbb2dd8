//! Peak memory of the MLP bench's `fp8` step on the CPU, from the live-bytes accounting of host buffers
//! (`fp8_kernels::device::host_buffer_bytes`), against a bound derived from the sizes. One test per
//! process state: the counter is process-wide, so this file holds a single test.

use fp8_kernels::device::{host_buffer_bytes, reset_host_buffer_peak};
use fsdp_comm::{run_ranks, Communicator};
use fsdp_examples::mlp::{MlpBench, MlpConfig, MlpError};
use std::sync::Arc;

/// Upper bound of the live bytes during an `fp8`-mode step (world size 1, FsdpAdamW with low-precision
/// states, BF16 gradient shards, no block recompute), from the sizes alone (`H = 4d`):
/// - model state: E4M3 weight 1 + BF16 gradient 2 + F16 master 2 + E4M3 m 1 + F16 v 2 = 8 B/param;
/// - the bench's input and the step's output, `[T, d]` BF16 each;
/// - the FP8 `x^T` codes the linears keep (and reuse) across steps: `[T, d]` per block, and `[T, H]`
///   per block when the GELU output is kept (with `recompute_gelu`, one block's at a time, recast in its
///   backward);
/// - per block, the BF16 pre-activation `[T, H]` the backward needs (`u` fused, the GELU's input
///   unfused);
/// - the backward's working set: the residual gradient `[T, d]` BF16 (unfused, a second copy of it for the
///   down linear) and the down linear's input
///   gradient `[T, H]` BF16, with either (at the GELU backward) another `[T, H]` BF16's worth (fused: the
///   E5M2 codes and transpose of the up linear's output gradient; unfused: the GELU's input gradient) less
///   the down linear's `[T, H]` E4M3 input codes it freed after its backward, or
///   (at the down linear's weight gradient) the E5M2 output-gradient codes and transpose `2 x [T, d]`,
///   whichever is larger (the weight gradient itself accumulates in the unit's F32 full gradient, counted
///   below: no buffer of its own);
/// - one unit's transients: its gathered E4M3 weights (`8 d^2`), the next unit's gathered flat buffer, in
///   flight (`8 d^2`), and its weights' F32 full gradients, which on one rank are a buffer per weight
///   made at its first gradient (`4 x 4 d^2` each): the down linear's beside the working set above; both
///   at the up linear's weight gradient, where the block has freed its kept pre-activation and the down
///   linear's input codes (`3 T H` bytes) and holds the residual gradient, the up linear's output-gradient
///   codes and transpose and its input gradient (`2 T d (+ the unfused copy) + 2 T H + 2 T d`);
/// - `small`: scales, metas, segment tables and step scalars (a few KiB).
///
/// The bound is tight (see the test): reintroducing a full-model-size F32 temporary (`4 P` bytes) or
/// keeping every block input (`blocks - 2` more `[T, d]` buffers) pushes the peak over it.
fn fp8_peak_bound(
    d: usize,
    blocks: usize,
    t: usize,
    fused: bool,
    recompute_gelu: bool,
    small: usize,
) -> usize {
    let h = 4 * d;
    let params = blocks * 8 * d * d;
    let model_state = 8 * params;
    let io = 2 * (2 * t * d);
    let codes = blocks * t * d
        + if recompute_gelu {
            t * h
        } else {
            blocks * t * h
        };
    let kept = blocks * 2 * t * h;
    // Unfused, the down linear's backward takes its own copy of the residual gradient.
    let dy_copy = if fused { 0 } else { 2 * t * d };
    // At the GELU backward the down linear has already freed its saved `[T, H]` E4M3 input codes, so that
    // branch adds `2 T H - T H` beyond the codes counted above.
    let working = 2 * t * d + dy_copy + 2 * t * h + (t * h).max(2 * t * d);
    let unit = 8 * d * d;
    let weight_grad = 4 * 4 * d * d;
    let at_gelu = working + weight_grad;
    let at_up =
        (2 * t * d + dy_copy + 2 * t * h + 2 * t * d + 2 * weight_grad).saturating_sub(3 * t * h);
    let transients = at_gelu.max(at_up) + unit + unit;
    model_state + io + codes + kept + transients + small
}

fn config(d: usize, blocks: usize, t: usize, fused: bool, recompute_gelu: bool) -> MlpConfig {
    MlpConfig {
        fused,
        recompute_gelu,
        lr: 1e-3,
        seed: 5,
        ..MlpConfig::fp8(d, blocks, t)
    }
}

/// The live-bytes counters are process-wide: the tests of this file measure one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Peak live host bytes over `steps` steps after one warm-up step, the live bytes before them, and the
/// bench's model state.
fn measure(cfg: MlpConfig, steps: usize) -> (usize, usize, usize) {
    run_ranks(1, |comm| {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut b = MlpBench::new(cfg.clone(), comm)?;
        b.step()?;
        reset_host_buffer_peak();
        let before = host_buffer_bytes().live;
        for _ in 0..steps {
            b.step()?;
        }
        let peak = host_buffer_bytes().peak;
        let state = b.memory()?.model_state();
        Ok::<_, MlpError>((peak, before, state))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn fp8_step_peak_is_within_the_size_bound() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (d, blocks, t, fused, recompute_gelu) in [
        (64, 4, 256, false, false),
        (64, 4, 256, true, false),
        (64, 4, 256, true, true),
        (128, 3, 128, true, false),
        (32, 6, 512, true, true),
    ] {
        let (peak, before, state) = measure(config(d, blocks, t, fused, recompute_gelu), 2);
        let params = blocks * 8 * d * d;
        let small = 8 * 1024;
        let bound = fp8_peak_bound(d, blocks, t, fused, recompute_gelu, small);
        println!(
            "d={d} blocks={blocks} T={t} fused={fused} recompute_gelu={recompute_gelu}: peak {peak} B, \
             live before step {before} B, model state {state} B ({:.2} B/param), bound {bound} B",
            state as f64 / params as f64
        );
        assert!(state <= 8 * params + small, "model state {state} B");
        assert!(peak <= bound, "peak {peak} B over the bound {bound} B");
        // The bound leaves less room than a model-size F32 temporary or the blocks' inputs kept: either
        // would push the peak over it.
        let room = bound - peak;
        assert!(
            room < 4 * params && room < (blocks - 2) * 2 * t * d,
            "the bound leaves {room} B of room: too loose to catch a model-size F32 temporary \
             ({} B) or kept block inputs ({} B)",
            4 * params,
            (blocks - 2) * 2 * t * d
        );
    }
}

#[test]
fn recomputing_the_gelu_input_saves_its_codes_per_block() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Each block's E4M3 `gelu(u)^T` (T * 4d bytes) is recast in its block's backward instead of kept
    // across the step: the whole step's peak drops by about (blocks - 1) * T * 4d bytes.
    let (d, blocks, t) = (64, 4, 256);
    let (kept, ..) = measure(config(d, blocks, t, true, false), 1);
    let (recast, ..) = measure(config(d, blocks, t, true, true), 1);
    // Less the shared buffer's one scale (a few bytes of scalars).
    let saved = (blocks - 1) * t * 4 * d - 64;
    println!("peak {kept} B kept, {recast} B recast; expected saving >= {saved} B");
    assert!(
        recast + saved <= kept,
        "peak {kept} B -> {recast} B, expected at least {saved} B less"
    );
}
