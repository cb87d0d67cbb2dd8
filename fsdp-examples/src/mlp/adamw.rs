//! The bench's own AdamW with F32 states, device-resident (the fused `adam_step_f32` kernel), for devices
//! where `fsdp_optim::FsdpAdamW` cannot run yet. No host round trip: no clipping, no non-finite skip.

use super::MlpError;
use fp8_kernels::adam::adam_step_f32;
use fp8_kernels::{AdamConfig, Buffer};
use fsdp_shard::{GradDtype, ParamGroup, ShardedModel};

/// AdamW (PyTorch defaults but the learning rate) over every unit's shards: the F32 master of the FP8
/// weights (`fp8` mode) or the plain F32 shard, which is its own master (`bf16` mode).
pub(crate) struct LocalAdamW {
    config: AdamConfig,
    /// Per unit: F32 masters of the FP8 group (empty in `bf16` mode).
    masters: Vec<Buffer<f32>>,
    /// Per unit: first and second moments of the optimized group.
    m: Vec<Buffer<f32>>,
    v: Vec<Buffer<f32>>,
    fp8: bool,
    step: u64,
}

impl LocalAdamW {
    pub(crate) fn new(
        model: &ShardedModel,
        masters: Vec<Vec<f32>>,
        lr: f64,
        fp8: bool,
    ) -> Result<Self, MlpError> {
        let dev = model.device();
        let mut out = LocalAdamW {
            config: AdamConfig {
                lr,
                ..AdamConfig::default()
            },
            masters: Vec::new(),
            m: Vec::new(),
            v: Vec::new(),
            fp8,
            step: 0,
        };
        for (u, master) in masters.iter().enumerate() {
            let shards = model.unit(u)?;
            let len = if fp8 {
                out.masters.push(dev.upload(master)?);
                shards.fp8.len()
            } else {
                shards.plain.len()
            };
            out.m.push(dev.zeros(len)?);
            out.v.push(dev.zeros(len)?);
        }
        Ok(out)
    }

    pub(crate) fn state_bytes(&self) -> usize {
        self.masters
            .iter()
            .chain(&self.m)
            .chain(&self.v)
            .map(Buffer::num_bytes)
            .sum()
    }

    pub(crate) fn step(&mut self, model: &mut ShardedModel) -> Result<(), MlpError> {
        self.step += 1;
        let coef = self.config.coefficients(self.step, 1.0)?;
        let bf16_grads = model.config().grad_dtype == GradDtype::Bf16;
        for u in 0..model.num_units() {
            let shards = model.unit_mut(u)?;
            let (m, v) = (&mut self.m[u], &mut self.v[u]);
            if self.fp8 {
                // F32 or BF16 gradient shards (BF16 widened exactly).
                let k = ParamGroup::Fp8 as usize;
                let w = &mut self.masters[u];
                if bf16_grads {
                    let g = &shards.grads_bf16[k];
                    adam_step_f32(&coef, 0..g.len(), w, m, v, g, None)?;
                } else {
                    let g = &shards.grads[k];
                    adam_step_f32(&coef, 0..g.len(), w, m, v, g, None)?;
                }
            } else {
                let g = &shards.grads[ParamGroup::Plain as usize];
                adam_step_f32(&coef, 0..g.len(), &mut shards.plain, m, v, g, None)?;
            }
        }
        if self.fp8 {
            let refs: Vec<&Buffer<f32>> = self.masters.iter().collect();
            model.update_fp8_weights(&refs)?;
        }
        model.zero_grads()?;
        Ok(())
    }
}
