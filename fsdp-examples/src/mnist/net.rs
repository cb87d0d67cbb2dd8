//! The reference MNIST network over a sharded model: one FSDP forward/backward step.

use super::MnistError;
use crate::data::{MNIST_CLASSES, MNIST_COLS, MNIST_ROWS};
use crate::nn::{
    Conv2d, Dropout, Flatten, Linear, LinearPrecision, LogSoftmaxNll, MaxPool2d, NnError, Relu,
};
use fp8_core::{QType, ScalingMeta};
use fp8_kernels::rng::SplitMix64;
use fp8_kernels::{Buffer, CpuParallelism, Device};
use fsdp_comm::{Communicator, ReduceOp};
use fsdp_shard::{ModelLayout, ParamSpec, ShardedModel, WrapPolicy};
use std::collections::BTreeMap;

/// Parameters a module needs to get its own FSDP unit (PyTorch's `size_based_auto_wrap_policy` with
/// `min_num_params=20000`, as in the reference): `fc1` gets one, the rest share the root unit.
pub const MIN_UNIT_PARAMS: usize = 20_000;

/// How the network is built.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetConfig {
    /// Arithmetic of the two linear layers.
    pub precision: LinearPrecision,
    /// Seed of the initial parameters and of the dropout generators.
    pub seed: u64,
    /// This rank (dropout masks differ per rank, as they do in PyTorch's data parallelism).
    pub rank: usize,
    /// Threading of CPU GEMMs.
    pub parallelism: CpuParallelism,
}

/// The reference net: Conv2d(1, 32, 3) - ReLU - Conv2d(32, 64, 3) - ReLU - MaxPool(2) - Dropout(0.25) -
/// Flatten - Linear(9216, 128) - ReLU - Dropout(0.5) - Linear(128, 10) - log-softmax + NLL.
#[derive(Debug)]
pub struct MnistNet {
    conv1: Conv2d,
    relu1: Relu,
    conv2: Conv2d,
    relu2: Relu,
    pool: MaxPool2d,
    drop1: Dropout,
    flatten: Flatten,
    fc1: Linear,
    relu3: Relu,
    drop2: Dropout,
    fc2: Linear,
    loss: LogSoftmaxNll,
    seed: u64,
    /// Units of conv1, conv2, fc1, fc2 (set by [`MnistNet::bind`]).
    units: Option<[usize; 4]>,
    amaxes: Option<Buffer<f32>>,
}

/// Mixes a seed with a stream number (SplitMix64 finaliser), so every parameter and dropout layer has
/// its own generator.
fn stream_seed(seed: u64, stream: u64) -> u64 {
    SplitMix64::mix(seed ^ stream.wrapping_mul(SplitMix64::GAMMA))
}

impl MnistNet {
    /// The layers on `device` (their parameters live in a [`ShardedModel`] built from
    /// [`MnistNet::layout`]).
    pub fn new(device: &Device, config: NetConfig) -> Result<Self, MnistError> {
        let par = config.parallelism;
        let drop_seed =
            |layer: u64| stream_seed(config.seed, 1000 + layer * 64 + config.rank as u64);
        Ok(MnistNet {
            conv1: Conv2d::new("conv1", 1, 32, 3, par)?,
            relu1: Relu::new(),
            conv2: Conv2d::new("conv2", 32, 64, 3, par)?,
            relu2: Relu::new(),
            pool: MaxPool2d::new(2, 2)?,
            drop1: Dropout::new(0.25, drop_seed(1))?,
            flatten: Flatten,
            fc1: Linear::new("fc1", 9216, 128, config.precision, device, par)?,
            relu3: Relu::new(),
            drop2: Dropout::new(0.5, drop_seed(2))?,
            fc2: Linear::new("fc2", 128, MNIST_CLASSES, config.precision, device, par)?,
            loss: LogSoftmaxNll::new(MNIST_CLASSES)?,
            seed: config.seed,
            units: None,
            amaxes: None,
        })
    }

    /// Every parameter, in module order.
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        let mut v = self.conv1.param_specs();
        v.extend(self.conv2.param_specs());
        v.extend(self.fc1.param_specs());
        v.extend(self.fc2.param_specs());
        v
    }

    /// The FSDP layout: units by at least [`MIN_UNIT_PARAMS`] parameters.
    pub fn layout(&self) -> Result<ModelLayout, MnistError> {
        Ok(ModelLayout::new(
            self.param_specs(),
            &WrapPolicy::MinParams(MIN_UNIT_PARAMS),
        )?)
    }

    /// The initial values of every parameter in [`MnistNet::param_specs`] order (PyTorch's default
    /// initialisation, seeded by the net's seed): the `init` of [`ShardedModel::new`].
    pub fn initial_values(&self) -> Vec<Vec<f32>> {
        let s = |i: u64| stream_seed(self.seed, i);
        let (w1, b1) = self.conv1.init_values(s(1));
        let (w2, b2) = self.conv2.init_values(s(2));
        let (w3, b3) = self.fc1.init_values(s(3));
        let (w4, b4) = self.fc2.init_values(s(4));
        vec![w1, b1, w2, b2, w3, b3, w4, b4]
    }

    /// Looks up the unit of every layer in `model`'s layout; call once after building the model.
    pub fn bind(&mut self, model: &ShardedModel) -> Result<(), MnistError> {
        let layout = model.layout();
        let unit_of = |name: &str| -> Result<usize, MnistError> {
            let p = model.index(name)?;
            layout
                .locate(p)
                .map(|(u, _, _)| u)
                .ok_or_else(|| MnistError::Config(format!("{name} is in no unit")))
        };
        self.units = Some([
            unit_of(self.conv1.weight_name())?,
            unit_of(self.conv2.weight_name())?,
            unit_of(self.fc1.weight_name())?,
            unit_of(self.fc2.weight_name())?,
        ]);
        Ok(())
    }

    fn units(&self) -> Result<[usize; 4], MnistError> {
        self.units
            .ok_or_else(|| MnistError::Config("MnistNet::bind was not called".into()))
    }

    /// Forward pass of a batch of NCHW `images [B, 1, 28, 28]` with `labels [B]`: gathers the units it
    /// needs, and in training frees every unit but the root (the one holding the last layer, which the
    /// backward pass needs first) afterwards. Returns the loss statistics on the device
    /// (`fp8_kernels::ops::nll_stat`).
    pub fn forward(
        &mut self,
        model: &mut ShardedModel,
        images: &Buffer<f32>,
        labels: &Buffer<i32>,
        training: bool,
    ) -> Result<&Buffer<f32>, MnistError> {
        let units = self.units()?;
        let b = labels.len();
        if images.len() != b * MNIST_ROWS * MNIST_COLS {
            return Err(MnistError::Config(format!(
                "{} pixels for {b} images of 28x28",
                images.len()
            )));
        }
        for &u in &units {
            model.gather(u)?;
        }
        let (h, s) = self
            .conv1
            .forward(model, images, [b, 1, MNIST_ROWS, MNIST_COLS])?;
        let h = self.relu1.forward(h)?;
        let (h, s) = self.conv2.forward(model, h, s)?;
        let h = self.relu2.forward(h)?;
        let (h, s) = self.pool.forward(h, s)?;
        let h = self.drop1.forward(h, training)?;
        let [_, features] = self.flatten.output_shape(s)?;
        if features != self.fc1.in_features() {
            return Err(NnError::usage("fc1", format!("{features} input features")).into());
        }
        let h = self.fc1.forward(model, h)?;
        let h = self.relu3.forward(h)?;
        let h = self.drop2.forward(h, training)?;
        let logits = self.fc2.forward(model, h)?;
        if training {
            let root = units[3];
            for &u in &units {
                if u != root {
                    model.release_after_forward(u)?;
                }
            }
        }
        Ok(self.loss.forward(logits, labels)?)
    }

    /// Backward pass after a training forward: the loss gradient is scaled by `grad_scale` (pass
    /// `1 / (world_size * micro_batches)` for the mean over the global batch). Each unit's gradients are
    /// reduce-scattered (or kept, in no-sync accumulation) and the unit freed as soon as its last layer
    /// is done.
    pub fn backward(
        &mut self,
        model: &mut ShardedModel,
        labels: &Buffer<i32>,
        grad_scale: f32,
    ) -> Result<(), MnistError> {
        let [u_conv1, u_conv2, u_fc1, u_fc2] = self.units()?;
        // Units in backward order; a unit is reduced after its last layer.
        let order = [u_fc2, u_fc1, u_conv2, u_conv1];
        let finish = |model: &mut ShardedModel, i: usize| -> Result<(), MnistError> {
            if !order[i + 1..].contains(&order[i]) {
                model.reduce_grads(order[i])?;
                model.release(order[i])?;
            }
            Ok(())
        };
        let d = self.loss.backward(labels, grad_scale)?;
        model.gather(u_fc2)?;
        let d = self.fc2.backward(model, d, true)?.ok_or_else(missing_dx)?;
        finish(model, 0)?;
        let d = self.drop2.backward(d)?;
        let d = self.relu3.backward(d)?;
        model.gather(u_fc1)?;
        let d = self.fc1.backward(model, d, true)?.ok_or_else(missing_dx)?;
        finish(model, 1)?;
        // Flatten is the identity on the buffer.
        let d = self.drop1.backward(d)?;
        let d = self.pool.backward(d)?;
        let d = self.relu2.backward(d)?;
        model.gather(u_conv2)?;
        let d = self
            .conv2
            .backward(model, d, true)?
            .ok_or_else(missing_dx)?;
        finish(model, 2)?;
        let d = self.relu1.backward(d)?;
        model.gather(u_conv1)?;
        self.conv1.backward(model, d, false)?;
        finish(model, 3)?;
        Ok(())
    }

    /// Frees every gathered unit (after an evaluation pass).
    pub fn release_all(&mut self, model: &mut ShardedModel) -> Result<(), MnistError> {
        for u in 0..model.num_units() {
            model.release(u)?;
        }
        self.fc1.clear_pending_amaxes()?;
        self.fc2.clear_pending_amaxes()?;
        Ok(())
    }

    /// FP8 only (a no-op otherwise): the step-end update of the activation and output-gradient scales.
    /// The four pending amaxes (input and output gradient of fc1 and fc2) go through ONE all-reduce MAX,
    /// so every rank updates its delayed metas identically.
    pub fn update_fp8_scales(&mut self, comm: &dyn Communicator) -> Result<(), MnistError> {
        let (Some(a1), Some(a2)) = (self.fc1.pending_amaxes(), self.fc2.pending_amaxes()) else {
            return Ok(());
        };
        let dev = a1[0].device();
        if self.amaxes.is_none() {
            self.amaxes = Some(dev.zeros::<f32>(4)?);
        }
        let amaxes = self
            .amaxes
            .as_mut()
            .ok_or_else(|| MnistError::Config("amax buffer".into()))?;
        for (i, src) in a1.iter().chain(a2.iter()).enumerate() {
            amaxes.copy_range_from(i, src, 0, 1)?;
        }
        if comm.world_size() > 1 {
            comm.all_reduce_in_place(amaxes.into(), ReduceOp::Max)?;
        }
        let amaxes = self
            .amaxes
            .as_ref()
            .ok_or_else(|| MnistError::Config("amax buffer".into()))?;
        self.fc1.update_scales_from(amaxes, 0)?;
        self.fc2.update_scales_from(amaxes, 2)?;
        Ok(())
    }

    /// The net's own state for checkpoints (dropout generator positions, FP8 scaling metas), as
    /// key/value strings with exact (bit-pattern) float encodings.
    pub fn export_state(&self) -> Result<BTreeMap<String, String>, MnistError> {
        let mut m = BTreeMap::new();
        m.insert("net.drop1.offset".into(), self.drop1.offset().to_string());
        m.insert("net.drop2.offset".into(), self.drop2.offset().to_string());
        for (name, layer) in [("fc1", &self.fc1), ("fc2", &self.fc2)] {
            if let Some([input, grad]) = layer.scaling_metas()? {
                m.insert(format!("net.{name}.input_meta"), encode_meta(&input));
                m.insert(format!("net.{name}.grad_output_meta"), encode_meta(&grad));
            }
        }
        Ok(m)
    }

    /// Restores what [`MnistNet::export_state`] saved.
    pub fn import_state(&mut self, values: &BTreeMap<String, String>) -> Result<(), MnistError> {
        let get = |k: &str| {
            values
                .get(k)
                .ok_or_else(|| MnistError::Checkpoint(format!("checkpoint lacks {k}")))
        };
        let offset = |k: &str| -> Result<u64, MnistError> {
            get(k)?
                .parse()
                .map_err(|e| MnistError::Checkpoint(format!("{k}: {e}")))
        };
        self.drop1.set_offset(offset("net.drop1.offset")?);
        self.drop2.set_offset(offset("net.drop2.offset")?);
        for (name, layer) in [("fc1", &mut self.fc1), ("fc2", &mut self.fc2)] {
            if let Some([input, grad]) = layer.scaling_metas()? {
                let metas = [
                    decode_meta(get(&format!("net.{name}.input_meta"))?, &input)?,
                    decode_meta(get(&format!("net.{name}.grad_output_meta"))?, &grad)?,
                ];
                layer.set_scaling_metas(&metas)?;
            }
        }
        Ok(())
    }
}

fn missing_dx() -> MnistError {
    MnistError::Config("a layer returned no input gradient".into())
}

/// `scale;recorded;h0,h1,...` with floats as hexadecimal bit patterns (exact), history oldest first.
fn encode_meta(m: &ScalingMeta) -> String {
    let hist: Vec<String> = m
        .history()
        .iter()
        .map(|h| format!("{:08x}", h.to_bits()))
        .collect();
    format!(
        "{:08x};{};{}",
        m.scale().to_bits(),
        m.recorded(),
        hist.join(",")
    )
}

/// Parses [`encode_meta`]'s form; type and recipe come from `like` (the layer's current meta).
fn decode_meta(s: &str, like: &ScalingMeta) -> Result<ScalingMeta, MnistError> {
    let bad = |why: &str| MnistError::Checkpoint(format!("scaling meta {s:?}: {why}"));
    let bits = |h: &str| u32::from_str_radix(h, 16).map(f32::from_bits);
    let mut parts = s.split(';');
    let (Some(scale), Some(rec), Some(hist), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad("expected scale;recorded;history"));
    };
    let scale = bits(scale).map_err(|_| bad("scale"))?;
    let recorded: u64 = rec.parse().map_err(|_| bad("count"))?;
    let history = if hist.is_empty() {
        Vec::new()
    } else {
        hist.split(',')
            .map(bits)
            .collect::<Result<Vec<f32>, _>>()
            .map_err(|_| bad("history"))?
    };
    let qtype: QType = like.qtype();
    Ok(ScalingMeta::from_parts(
        qtype,
        *like.recipe(),
        scale,
        &history,
        recorded,
    )?)
}
