//! Peak memory of the MLP bench's `fp8` step on the CPU, from the live-bytes accounting of host buffers
//! (`fp8_kernels::device::host_buffer_bytes`), against a bound derived from the sizes. One test per
//! process state: the counter is process-wide, so this file holds a single test.

use fp8_kernels::device::{host_buffer_bytes, reset_host_buffer_peak};
use fsdp_comm::{run_ranks, Communicator};
use fsdp_examples::mlp::{BenchMode, MlpBench, MlpConfig, MlpError, OptimizerChoice};
use fsdp_shard::{GradDtype, GradReduction};
use std::sync::Arc;

/// Upper bound of the live bytes during an `fp8`-mode step (world size 1, FsdpAdamW with low-precision
/// states, BF16 gradient shards, no recompute), from the sizes alone:
/// - model state: E4M3 weight 1 + BF16 gradient 2 + F16 master 2 + E4M3 m 1 + F16 v 2 = 8 B/param;
/// - per block: BF16 pre-activation `u` `[T, 4d]` and the two saved FP8 transposed inputs `[T, d]`,
///   `[T, 4d]`;
/// - residual stream: input and two rotating `[T, d]` BF16 buffers, plus its gradient;
/// - shared step buffers: `a`, `da` `[T, 4d]` BF16 (`a` empty when fused), branch `[T, d]` BF16, one F32
///   weight gradient `4 d^2`, FP8 scratch `[T, d]` x2 and `[T, 4d]` x2;
/// - transients of one unit: the F32 full gradient and the F32 reduce-scatter output (`8 d^2` each), the
///   gathered unit twice (the one computing and the prefetched one, flat buffer and cut copies: `2 x 8 d^2`
///   bytes each), a transposed weight of the `dx` GEMM (`4 d^2` bytes);
/// - `small`: scales, metas, segment tables and step scalars (a few KiB).
///
/// Reintroducing a full-model-size F32 temporary (`4 P` bytes) or keeping every block input (`blocks - 2`
/// more `[T, d]` buffers) pushes the peak over it.
fn fp8_peak_bound(d: usize, blocks: usize, t: usize, fused: bool, small: usize) -> usize {
    let params = blocks * 8 * d * d;
    let model_state = 8 * params;
    let per_block = 2 * t * 4 * d + t * d + t * 4 * d;
    let residual = 3 * 2 * t * d + 2 * t * d;
    let shared = if fused { 0 } else { 2 * t * 4 * d }
        + 2 * t * 4 * d
        + 2 * t * d
        + 4 * 4 * d * d
        + 2 * t * d
        + 2 * t * 4 * d;
    let unit = 8 * d * d;
    let transients = 4 * unit + 4 * unit + 2 * (2 * unit) + 4 * d * d;
    model_state + blocks * per_block + residual + shared + transients + small
}

fn config(d: usize, blocks: usize, t: usize, fused: bool) -> MlpConfig {
    MlpConfig {
        d,
        blocks,
        tokens: t,
        mode: BenchMode::Fp8,
        grad_reduction: GradReduction::F32,
        grad_dtype: GradDtype::Bf16,
        recompute: false,
        fused,
        recompute_gelu: false,
        optimizer: OptimizerChoice::FsdpOptim,
        lr: 1e-3,
        seed: 5,
    }
}

/// The live-bytes counters are process-wide: the tests of this file measure one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Peak live host bytes over `steps` steps after one warm-up step, and the bench's own accounting.
fn measure(cfg: MlpConfig, steps: usize) -> (usize, usize, usize, usize) {
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
        Ok::<_, MlpError>((peak, before, state, b.activation_bytes()))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn fp8_step_peak_is_within_the_size_bound() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (d, blocks, t, fused) in [
        (64, 4, 256, false),
        (64, 4, 256, true),
        (128, 3, 128, false),
    ] {
        let (peak, before, state, act) = measure(config(d, blocks, t, fused), 2);
        let params = blocks * 8 * d * d;
        let small = 64 * 1024;
        let bound = fp8_peak_bound(d, blocks, t, fused, small);
        println!(
            "d={d} blocks={blocks} T={t} fused={fused}: peak {peak} B, live before step {before} B, model state {state} B ({:.2} B/param), activations {act} B, bound {bound} B",
            state as f64 / params as f64
        );
        assert!(state <= 8 * params + small, "model state {state} B");
        assert!(peak <= bound, "peak {peak} B over the bound {bound} B");
        // What the step adds on top of what it keeps is at most one unit's transients: far below a
        // full-model-size F32 temporary.
        assert!(
            peak - before < 4 * params,
            "step transient {} B reaches a model-size F32 buffer ({} B)",
            peak - before,
            4 * params
        );
    }
}

#[test]
fn recomputing_the_gelu_input_saves_its_codes_per_block() {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Each block's E4M3 `gelu(u)^T` (T * 4d bytes) is replaced by one shared buffer: the whole step's
    // peak drops by about (blocks - 1) * T * 4d bytes (those buffers live through the step).
    let (d, blocks, t) = (64, 4, 256);
    let (kept, ..) = measure(config(d, blocks, t, true), 1);
    let mut cfg = config(d, blocks, t, true);
    cfg.recompute_gelu = true;
    let (recast, ..) = measure(cfg, 1);
    // Less the shared buffer's one scale (a few bytes of scalars).
    let saved = (blocks - 1) * t * 4 * d - 64;
    println!("peak {kept} B kept, {recast} B recast; expected saving >= {saved} B");
    assert!(
        recast + saved <= kept,
        "peak {kept} B -> {recast} B, expected at least {saved} B less"
    );
}
