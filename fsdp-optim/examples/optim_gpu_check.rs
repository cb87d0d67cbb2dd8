//! GPU check of `ShardedAdam`'s device-side step: the same random problem stepped on the CPU (one
//! thread rank) and on CUDA (one rank, NCCL), comparing masters, optimizer states, FP8 weights, weight
//! scales and state metas after every step. Without clipping every value must be bit-identical (the
//! kernels and the control arithmetic are); with clipping the sum of squares is summed in another order
//! on the GPU, so the clipping factor may differ in its last bits and the masters are compared by
//! relative norm (bound 1e-4). Prints PASS/FAIL and exits non-zero on failure, and also without a GPU,
//! NCCL or CUDA (saying why: nothing was checked).
//!
//! Run with `fsdp-run --nproc 1 -- optim_gpu_check` (or directly: it falls back to a single rank).

use fp8_kernels::Device;
use fsdp_comm::nccl::{nccl_library_status, NcclComm, NcclConfig};
use fsdp_comm::{run_ranks, Communicator, DistEnv, ThreadComm};
use fsdp_optim::{AdamOptions, FsdpAdamW, OptimError, StatePrecision};
use fsdp_shard::{
    FsdpConfig, GradDtype, ModelLayout, ParamKind, ParamSpec, ShardedModel, ShardedState,
    WrapPolicy,
};
use std::process::ExitCode;
use std::sync::Arc;

const STEPS: usize = 12;
const NAN_STEP: usize = 4;

fn values(seed: u64, n: usize, mag: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * mag
        })
        .collect()
}

/// Everything compared after a step.
#[derive(Debug, Clone, PartialEq)]
struct Snapshot {
    masters: Vec<Vec<f32>>,
    states: Vec<Vec<u8>>,
    fp8: Vec<Vec<u8>>,
    plain: Vec<Vec<f32>>,
    weight_scales: Vec<(usize, f32, f32)>,
    metas: Vec<fsdp_optim::StateMeta>,
    skipped: bool,
}

fn layout() -> Result<Arc<ModelLayout>, OptimError> {
    let specs = vec![
        ParamSpec::new("a", "weight", &[32, 48], ParamKind::Fp8Weight),
        ParamSpec::new("a", "bias", &[32], ParamKind::Plain),
        ParamSpec::new("b", "weight", &[16, 32], ParamKind::Fp8Weight),
        ParamSpec::new("c", "weight", &[64, 16], ParamKind::Fp8Weight),
        ParamSpec::new("c", "bias", &[64], ParamKind::Plain),
    ];
    Ok(Arc::new(ModelLayout::new(specs, &WrapPolicy::Single)?))
}

fn run(
    comm: Arc<dyn Communicator>,
    opts: AdamOptions,
    grad_dtype: GradDtype,
) -> Result<Vec<Snapshot>, OptimError> {
    let layout = layout()?;
    let init = |p: usize| {
        let n = layout.params[p].numel();
        values(p as u64 + 1, n, 0.5)
    };
    let cfg = FsdpConfig {
        grad_dtype,
        ..FsdpConfig::default()
    };
    let (mut model, masters) = ShardedModel::new(layout.clone(), comm, cfg, &init)?;
    let mut opt = FsdpAdamW::new(&model, masters, opts)?;
    let mut out = Vec::new();
    for t in 0..STEPS {
        for u in 0..model.num_units() {
            let s = model.unit_mut(u)?;
            for k in 0..2 {
                let n = s.grads[k].len().max(s.grads_bf16[k].len());
                let mut g = values(
                    1000 + (t * 7 + u * 3 + k) as u64,
                    n,
                    10f32.powi(t as i32 % 4 - 2),
                );
                if t == NAN_STEP && k == 0 && n > 3 {
                    g[3] = f32::NAN;
                }
                if grad_dtype == GradDtype::Bf16 {
                    let h: Vec<half::bf16> = g.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    s.grads_bf16[k].copy_from_host(&h)?;
                } else {
                    s.grads[k].copy_from_host(&g)?;
                }
            }
        }
        let rep = opt.step_with_report(&mut model)?;
        let mut snap = Snapshot {
            masters: vec![],
            states: opt.export_state()?.into_iter().map(|s| s.bytes).collect(),
            fp8: vec![],
            plain: vec![],
            weight_scales: model.weight_scales()?,
            metas: opt.state_metas()?,
            skipped: rep.skipped,
        };
        for u in 0..model.num_units() {
            snap.masters.push(opt.fp8_master_shard(u)?);
            snap.fp8.push(model.unit(u)?.fp8.to_vec()?);
            snap.plain.push(model.unit(u)?.plain.to_vec()?);
        }
        out.push(snap);
    }
    Ok(out)
}

fn rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        d += (*x as f64 - *y as f64).powi(2);
        n += (*y as f64).powi(2);
    }
    (d / n.max(1e-300)).sqrt()
}

fn main() -> ExitCode {
    if let Err(e) = nccl_library_status() {
        println!("FAIL optim_gpu_check: nothing checked: {e}");
        return ExitCode::FAILURE;
    }
    let env = if DistEnv::is_launched() {
        match DistEnv::from_env() {
            Ok(e) => e,
            Err(e) => {
                println!("FAIL environment: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        DistEnv::single()
    };
    if env.world_size != 1 {
        println!(
            "FAIL optim_gpu_check compares one CUDA rank with one CPU rank: run it with --nproc 1"
        );
        return ExitCode::FAILURE;
    }
    if let Err(e) = Device::cuda(env.local_rank) {
        println!("FAIL optim_gpu_check: nothing checked: no usable GPU: {e}");
        return ExitCode::FAILURE;
    }
    let comm: Arc<dyn Communicator> = match NcclComm::from_dist_env(&env, &NcclConfig::default()) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            println!("FAIL NCCL init: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    for (name, precision, clip, dtype) in [
        ("f32 states", StatePrecision::F32, None, GradDtype::F32),
        (
            "low-precision states",
            StatePrecision::LowPrecision,
            None,
            GradDtype::F32,
        ),
        (
            "low-precision states, clipping",
            StatePrecision::LowPrecision,
            Some(0.05),
            GradDtype::F32,
        ),
        (
            "low-precision states, bf16 gradient shards",
            StatePrecision::LowPrecision,
            None,
            GradDtype::Bf16,
        ),
        (
            "f32 states, bf16 gradient shards",
            StatePrecision::F32,
            None,
            GradDtype::Bf16,
        ),
    ] {
        let opts = AdamOptions {
            state_precision: precision,
            max_grad_norm: clip,
            ..AdamOptions::adamw()
        };
        let cpu = run_ranks(1, |c: ThreadComm| run(Arc::new(c), opts, dtype));
        let gpu = run(comm.clone(), opts, dtype);
        let (cpu, gpu) = match (cpu, gpu) {
            (Ok(mut c), Ok(g)) => (c.remove(0), g),
            (c, g) => {
                println!("FAIL {name}: cpu {:?} / gpu {:?}", c.err(), g.err());
                failed = true;
                continue;
            }
        };
        let mut bad = Vec::new();
        for (t, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
            if c.skipped != g.skipped || c.skipped != (t == NAN_STEP) {
                bad.push(format!(
                    "step {t}: skipped cpu {} gpu {}",
                    c.skipped, g.skipped
                ));
            }
            if clip.is_none() {
                for (what, same) in [
                    ("masters", c.masters == g.masters),
                    ("states", c.states == g.states),
                    ("fp8 weights", c.fp8 == g.fp8),
                    ("plain", c.plain == g.plain),
                    ("weight scales", c.weight_scales == g.weight_scales),
                    ("state metas", c.metas == g.metas),
                ] {
                    if !same {
                        bad.push(format!("step {t}: {what} differ"));
                    }
                }
            } else {
                let r = rel(&g.masters, &c.masters).max(rel(&g.plain, &c.plain));
                if r.is_nan() || r > 1e-4 {
                    bad.push(format!("step {t}: masters differ by {r:e} (bound 1e-4)"));
                }
            }
        }
        if bad.is_empty() {
            let mode = if clip.is_none() {
                "bitwise"
            } else {
                "within 1e-4"
            };
            println!("PASS {name}: {STEPS} steps (one skipped) CPU == CUDA {mode}");
        } else {
            failed = true;
            println!("FAIL {name}: {}", bad.join("; "));
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        println!("PASS optim_gpu_check");
        ExitCode::SUCCESS
    }
}
