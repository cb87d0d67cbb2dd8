//! The optimizer interface of the training loop, and an F32 Adam over the shards.

use super::MnistError;
use fp8_core::QType;
use fp8_kernels::adam::adam_step_f32;
use fp8_kernels::{AdamConfig, Buffer, WeightDecay};
use fsdp_optim::FsdpAdam;
use fsdp_shard::{ParamGroup, ShardError, ShardedModel, ShardedState, StateShard};

/// What the training loop needs from an optimizer over a [`ShardedModel`]: a step on this rank's shards
/// (followed by the FP8 weight re-quantization and zeroed gradients), a settable learning rate for the
/// schedule, and its state for checkpoints and memory reports ([`ShardedState`]).
pub trait ShardOptimizer: ShardedState + Send {
    /// One update from the reduced gradient shards; leaves the gradients zeroed.
    fn step(&mut self, model: &mut ShardedModel) -> Result<(), MnistError>;
    /// Sets the learning rate of the next steps.
    fn set_lr(&mut self, lr: f64);
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Moves the StepLR schedule (step one epoch) to epoch `epoch` (1-based): the learning rate becomes
    /// `base_lr * gamma^(epoch - 1)`.
    fn start_epoch(&mut self, epoch: u32) -> Result<(), MnistError>;
    /// The optimizer as its checkpointable state.
    fn as_state(&self) -> &dyn ShardedState;
    /// The optimizer as its checkpointable state, mutable.
    fn as_state_mut(&mut self) -> &mut dyn ShardedState;
    /// A short description for logs.
    fn describe(&self) -> String;
}

/// Adam (PyTorch's `torch.optim.Adam` update: betas, eps, bias corrections, optional L2 weight decay) with
/// every state in F32, on this rank's shards: the F32 master copy of the FP8 weights (which the
/// [`ShardedModel`] does not keep), and first and second moments of both parameter groups. After the
/// update the FP8 weight shards are re-cast from the masters with one all-reduce(MAX) of their amaxes
/// ([`ShardedModel::update_fp8_weights`]). Runs on the CPU and on CUDA through `fp8_kernels::adam`.
#[derive(Debug)]
pub struct ShardAdamF32 {
    config: AdamConfig,
    base_lr: f64,
    gamma: f64,
    step: u64,
    masters: Vec<Buffer<f32>>,
    exp_avg: Vec<[Buffer<f32>; 2]>,
    exp_avg_sq: Vec<[Buffer<f32>; 2]>,
}

impl ShardAdamF32 {
    /// Adam with base learning rate `lr` (betas 0.9/0.999, eps 1e-8, no weight decay) and StepLR factor
    /// `gamma` per epoch over `model`, whose FP8 master shards are `masters` (as returned by
    /// [`ShardedModel::new`]).
    pub fn new(
        model: &ShardedModel,
        masters: Vec<Vec<f32>>,
        lr: f64,
        gamma: f64,
    ) -> Result<Self, MnistError> {
        let config = AdamConfig {
            lr,
            weight_decay: 0.0,
            decay_mode: WeightDecay::L2,
            ..AdamConfig::default()
        };
        config.validate()?;
        if masters.len() != model.num_units() {
            return Err(MnistError::Config(format!(
                "{} master shards for {} units",
                masters.len(),
                model.num_units()
            )));
        }
        let dev = model.device().clone();
        let mut exp_avg = Vec::new();
        let mut exp_avg_sq = Vec::new();
        let mut master_bufs = Vec::new();
        for (u, m) in masters.into_iter().enumerate() {
            let s = model.unit(u)?;
            let lens = [s.fp8.len(), s.plain.len()];
            if m.len() != lens[0] {
                return Err(MnistError::Config(format!(
                    "unit {u}: master shard of {} for an FP8 shard of {}",
                    m.len(),
                    lens[0]
                )));
            }
            master_bufs.push(dev.from_vec(m)?);
            exp_avg.push([dev.zeros(lens[0])?, dev.zeros(lens[1])?]);
            exp_avg_sq.push([dev.zeros(lens[0])?, dev.zeros(lens[1])?]);
        }
        Ok(ShardAdamF32 {
            config,
            base_lr: lr,
            gamma,
            step: 0,
            masters: master_bufs,
            exp_avg,
            exp_avg_sq,
        })
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }
}

fn f32_bytes(b: &Buffer<f32>) -> Result<Vec<u8>, ShardError> {
    Ok(b.to_vec()?.iter().flat_map(|x| x.to_le_bytes()).collect())
}

fn bytes_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl ShardOptimizer for ShardAdamF32 {
    fn step(&mut self, model: &mut ShardedModel) -> Result<(), MnistError> {
        self.step += 1;
        let coef = self.config.coefficients(self.step, 1.0)?;
        let mut any_fp8 = false;
        for u in 0..model.num_units() {
            let s = model.unit_mut(u)?;
            let n8 = s.fp8.len();
            if n8 > 0 {
                any_fp8 = true;
                let [m, _] = &mut self.exp_avg[u];
                let [v, _] = &mut self.exp_avg_sq[u];
                adam_step_f32(&coef, 0..n8, &mut self.masters[u], m, v, &s.grads[0], None)?;
            }
            let np = s.plain.len();
            if np > 0 {
                let [_, m] = &mut self.exp_avg[u];
                let [_, v] = &mut self.exp_avg_sq[u];
                adam_step_f32(&coef, 0..np, &mut s.plain, m, v, &s.grads[1], None)?;
            }
        }
        if any_fp8 {
            let refs: Vec<&Buffer<f32>> = self.masters.iter().collect();
            model.update_fp8_weights(&refs)?;
        }
        model.zero_grads()?;
        Ok(())
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn start_epoch(&mut self, epoch: u32) -> Result<(), MnistError> {
        self.config.lr = self.base_lr * self.gamma.powi(epoch.saturating_sub(1) as i32);
        Ok(())
    }

    fn as_state(&self) -> &dyn ShardedState {
        self
    }

    fn as_state_mut(&mut self) -> &mut dyn ShardedState {
        self
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn describe(&self) -> String {
        format!(
            "Adam (F32 states) lr {} betas ({}, {}) eps {}",
            self.config.lr, self.config.beta1, self.config.beta2, self.config.eps
        )
    }
}

impl ShardedState for ShardAdamF32 {
    fn export_state(&self) -> Result<Vec<StateShard>, ShardError> {
        let mut out = Vec::new();
        let shard = |name: &str, unit: usize, group: ParamGroup, b: &Buffer<f32>| {
            Ok::<_, ShardError>(StateShard {
                name: name.into(),
                unit,
                group,
                qtype: QType::F32,
                bytes: f32_bytes(b)?,
                slot_scales: Vec::new(),
            })
        };
        for u in 0..self.masters.len() {
            out.push(shard("master", u, ParamGroup::Fp8, &self.masters[u])?);
            for g in ParamGroup::ALL {
                out.push(shard("exp_avg", u, g, &self.exp_avg[u][g as usize])?);
                out.push(shard("exp_avg_sq", u, g, &self.exp_avg_sq[u][g as usize])?);
            }
        }
        Ok(out)
    }

    fn import_state(&mut self, shards: Vec<StateShard>) -> Result<(), ShardError> {
        for s in shards {
            let g = s.group as usize;
            let slot = match (s.name.as_str(), self.masters.get_mut(s.unit)) {
                ("master", Some(m)) if s.group == ParamGroup::Fp8 => m,
                ("exp_avg", Some(_)) => &mut self.exp_avg[s.unit][g],
                ("exp_avg_sq", Some(_)) => &mut self.exp_avg_sq[s.unit][g],
                _ => {
                    return Err(ShardError::Checkpoint(format!(
                        "unexpected optimizer state {} of unit {}",
                        s.name, s.unit
                    )))
                }
            };
            if s.qtype != QType::F32 {
                return Err(ShardError::Checkpoint(format!(
                    "optimizer state {} stored as {}, expected F32",
                    s.name, s.qtype
                )));
            }
            slot.copy_from_host(&bytes_f32(&s.bytes))?;
        }
        Ok(())
    }

    fn state_bytes(&self) -> usize {
        let pairs = |v: &Vec<[Buffer<f32>; 2]>| {
            v.iter()
                .flat_map(|p| p.iter())
                .map(Buffer::num_bytes)
                .sum::<usize>()
        };
        self.masters.iter().map(Buffer::num_bytes).sum::<usize>()
            + pairs(&self.exp_avg)
            + pairs(&self.exp_avg_sq)
    }

    fn scalar_state(&self) -> Vec<(String, String)> {
        vec![
            ("step".into(), self.step.to_string()),
            ("lr".into(), format!("{:016x}", self.config.lr.to_bits())),
        ]
    }

    fn load_scalar_state(&mut self, values: &[(String, String)]) -> Result<(), ShardError> {
        for (k, v) in values {
            match k.as_str() {
                "step" => {
                    self.step = v
                        .parse()
                        .map_err(|e| ShardError::Checkpoint(format!("optimizer step {v:?}: {e}")))?
                }
                "lr" => {
                    let bits = u64::from_str_radix(v, 16)
                        .map_err(|e| ShardError::Checkpoint(format!("optimizer lr {v:?}: {e}")))?;
                    self.config.lr = f64::from_bits(bits);
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// `fsdp_optim::FsdpAdam` (the project's optimizer: low-precision or F32 states, one amax all-reduce per
/// step, non-finite steps skipped on every rank) with its StepLR schedule advanced once per epoch.
impl ShardOptimizer for FsdpAdam {
    fn step(&mut self, model: &mut ShardedModel) -> Result<(), MnistError> {
        fsdp_optim::ShardedAdam::step(self, model)?;
        Ok(())
    }

    fn set_lr(&mut self, lr: f64) {
        // A negative or non-finite rate is refused by the optimizer and then left unchanged.
        let _ = fsdp_optim::ShardedAdam::set_lr(self, lr);
    }

    fn lr(&self) -> f64 {
        self.current_lr()
    }

    fn start_epoch(&mut self, epoch: u32) -> Result<(), MnistError> {
        let want = u64::from(epoch.saturating_sub(1));
        if self.schedule_position() > want {
            return Err(MnistError::Config(format!(
                "the schedule is at epoch {}, past epoch {epoch}",
                self.schedule_position() + 1
            )));
        }
        while self.schedule_position() < want {
            self.advance_schedule();
        }
        Ok(())
    }

    fn as_state(&self) -> &dyn ShardedState {
        self
    }

    fn as_state_mut(&mut self) -> &mut dyn ShardedState {
        self
    }

    fn describe(&self) -> String {
        let o = self.options();
        format!(
            "fsdp-optim Adam ({} states) lr {} betas {:?} eps {}, StepLR",
            o.state_precision.name(),
            o.lr,
            o.betas,
            o.eps
        )
    }
}
