//! FP8 scaling state of a model's activations and output gradients, held by the sharded model on behalf
//! of its modules ([`crate::ScalingId`]), so that every meta of the model is agreed across ranks in the
//! optimizer's single all-reduce(MAX) and saved in checkpoints without code per model.
//!
//! A [`ScalingState`] is one meta on a device (scale, inverse scale, amax history ring, counters); the
//! [`ScalingRegistry`] holds all of a model's metas and ONE buffer of pending amaxes, slot `i` for meta
//! `i`: casts accumulate into their slot during a step (training only), the optimizer all-reduces the
//! whole buffer with its own amaxes, and [`ScalingRegistry::update_from`] records each agreed amax and
//! recomputes the scales (the kernel `fp8_kernels::update_scaling_meta`, bit-exact with
//! [`fp8_core::ScalingMeta::update_from_amax`]).

use crate::module::{ScalingDecl, ScalingId};
use crate::ShardError;
use fp8_core::{Fp8Format, QType, ScalingMeta, ScalingRecipe};
use fp8_kernels::{update_scaling_meta, AmaxInput, AmaxSlot, Buffer, Device, ScalingMetaBuffers};
use std::collections::BTreeMap;

/// One FP8 scaling meta whose state lives in device buffers: `scale[1]`, `scale_inv[1]`,
/// `history[window]` (a ring) and `state[3]` (ring position, 64-bit record count), as
/// [`fp8_kernels::ScalingMetaBuffers`] describes them.
#[derive(Debug)]
pub struct ScalingState {
    qtype: QType,
    recipe: ScalingRecipe,
    scale: Buffer<f32>,
    scale_inv: Buffer<f32>,
    history: Buffer<f32>,
    state: Buffer<u32>,
}

impl ScalingState {
    /// A copy of `meta` on `device`.
    pub fn new(device: &Device, meta: &ScalingMeta) -> Result<Self, ShardError> {
        let rec = meta.recorded();
        Ok(ScalingState {
            qtype: meta.qtype(),
            recipe: *meta.recipe(),
            scale: device.upload(&[meta.scale()])?,
            scale_inv: device.upload(&[meta.scale_inv()])?,
            history: device.upload(&meta.history())?,
            state: device.upload(&[0u32, rec as u32, (rec >> 32) as u32])?,
        })
    }

    /// A fresh meta (scale 1, empty history).
    pub fn fresh(device: &Device, qtype: QType, recipe: ScalingRecipe) -> Result<Self, ShardError> {
        Self::new(device, &ScalingMeta::new(qtype, recipe)?)
    }

    /// The state as a host [`ScalingMeta`] (reads the device).
    pub fn to_meta(&self) -> Result<ScalingMeta, ShardError> {
        let scale = self.scale.to_vec()?;
        let ring = self.history.to_vec()?;
        let state = self.state.to_vec()?;
        let (Some(&s), [pos, lo, hi]) = (scale.first(), state.as_slice()) else {
            return Err(ShardError::State(
                "scaling meta buffers are malformed".into(),
            ));
        };
        let pos = *pos as usize;
        if pos >= ring.len() {
            return Err(ShardError::State(format!(
                "scaling meta ring position {pos} outside a window of {}",
                ring.len()
            )));
        }
        let oldest_first: Vec<f32> = ring[pos..].iter().chain(&ring[..pos]).copied().collect();
        let recorded = ((*hi as u64) << 32) | *lo as u64;
        Ok(ScalingMeta::from_parts(
            self.qtype,
            self.recipe,
            s,
            &oldest_first,
            recorded,
        )?)
    }

    /// Storage type.
    pub fn qtype(&self) -> QType {
        self.qtype
    }

    /// Recipe.
    pub fn recipe(&self) -> &ScalingRecipe {
        &self.recipe
    }

    /// The FP8 format, or an error for 16/32-bit types.
    pub fn format(&self) -> Result<Fp8Format, ShardError> {
        self.qtype
            .fp8_format()
            .ok_or(ShardError::Core(fp8_core::Fp8Error::NotFp8(self.qtype)))
    }

    /// `scale[0]`: multiply by it before encoding.
    pub fn scale(&self) -> &Buffer<f32> {
        &self.scale
    }

    /// `scale_inv[0] = 1 / scale` (a GEMM scale pointer).
    pub fn scale_inv(&self) -> &Buffer<f32> {
        &self.scale_inv
    }

    /// The step-end update from `amax` (see [`fp8_kernels::update_scaling_meta`]).
    pub fn update(&mut self, amax: AmaxInput<'_>) -> Result<(), ShardError> {
        let qtype = self.qtype;
        let recipe = self.recipe;
        update_scaling_meta(
            ScalingMetaBuffers {
                scale: &mut self.scale,
                scale_inv: &mut self.scale_inv,
                history: &mut self.history,
                state: &mut self.state,
            },
            qtype,
            &recipe,
            amax,
        )?;
        Ok(())
    }

    fn num_bytes(&self) -> usize {
        self.scale.num_bytes()
            + self.scale_inv.num_bytes()
            + self.history.num_bytes()
            + self.state.num_bytes()
    }
}

/// What a cast needs from a meta: the state (scale, format) and, in training, the slot to accumulate its
/// amax into (`None` in evaluation, which must not move the training scales).
#[derive(Debug)]
pub struct ScalingUse<'a> {
    /// The meta.
    pub state: &'a ScalingState,
    /// Where the cast records its amax.
    pub amax: Option<AmaxSlot<'a>>,
}

/// Every scaling meta of a model and their pending amaxes.
#[derive(Debug)]
pub struct ScalingRegistry {
    names: Vec<String>,
    metas: Vec<ScalingState>,
    /// Pending amax of meta `i` in slot `i`.
    pending: Buffer<f32>,
}

impl ScalingRegistry {
    /// An empty registry on `device`.
    pub fn new(device: &Device) -> Result<Self, ShardError> {
        Ok(ScalingRegistry {
            names: Vec::new(),
            metas: Vec::new(),
            pending: device.zeros(0)?,
        })
    }

    /// Adds a fresh meta named `name` (a module path and local name) and returns its id.
    pub fn register(
        &mut self,
        device: &Device,
        name: String,
        decl: ScalingDecl,
    ) -> Result<ScalingId, ShardError> {
        if self.names.contains(&name) {
            return Err(ShardError::InvalidModel(format!(
                "scaling meta {name} declared twice"
            )));
        }
        if decl.qtype.fp8_format().is_none() {
            return Err(ShardError::InvalidModel(format!(
                "scaling meta {name}: {:?} is not an FP8 type",
                decl.qtype
            )));
        }
        let id = ScalingId::from_index(self.metas.len())?;
        self.metas
            .push(ScalingState::fresh(device, decl.qtype, decl.recipe)?);
        self.names.push(name);
        self.pending = device.zeros(self.metas.len())?;
        Ok(id)
    }

    /// Number of metas.
    pub fn len(&self) -> usize {
        self.metas.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.metas.is_empty()
    }

    /// The names, by id.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The id of the `i`-th meta (registration order).
    pub fn id(&self, i: usize) -> Result<ScalingId, ShardError> {
        if i >= self.metas.len() {
            return Err(ShardError::InvalidArgument(format!(
                "no scaling meta {i} of {}",
                self.metas.len()
            )));
        }
        ScalingId::from_index(i)
    }

    fn index(&self, id: ScalingId) -> Result<usize, ShardError> {
        id.index()
            .filter(|&i| i < self.metas.len())
            .ok_or_else(|| {
                ShardError::InvalidArgument(format!(
                    "scaling meta id {id:?} is not one of this model's {} metas (module not registered?)",
                    self.metas.len()
                ))
            })
    }

    /// The meta `id`.
    pub fn get(&self, id: ScalingId) -> Result<&ScalingState, ShardError> {
        let i = self.index(id)?;
        Ok(&self.metas[i])
    }

    /// The meta `id` with its amax slot when `record` (training casts).
    pub fn use_meta(&mut self, id: ScalingId, record: bool) -> Result<ScalingUse<'_>, ShardError> {
        let i = self.index(id)?;
        Ok(ScalingUse {
            state: &self.metas[i],
            amax: record.then(|| AmaxSlot::new(&mut self.pending, i)),
        })
    }

    /// The pending amaxes (slot `i` for meta `i`), e.g. to copy into an all-reduce buffer.
    pub fn pending(&self) -> &Buffer<f32> {
        &self.pending
    }

    /// Forgets the amaxes recorded since the last update.
    pub fn clear_pending(&mut self) -> Result<(), ShardError> {
        self.pending.fill_zero()?;
        Ok(())
    }

    /// The step-end update of every meta from `agreed[offset + i]` (the pending amaxes after an
    /// all-reduce MAX across ranks, so every rank computes the same scales); clears the pending amaxes.
    pub fn update_from(&mut self, agreed: &Buffer<f32>, offset: usize) -> Result<(), ShardError> {
        if offset
            .checked_add(self.metas.len())
            .is_none_or(|e| e > agreed.len())
        {
            return Err(ShardError::InvalidArgument(format!(
                "{} scaling metas from slot {offset} of an amax vector of {}",
                self.metas.len(),
                agreed.len()
            )));
        }
        for (i, m) in self.metas.iter_mut().enumerate() {
            m.update(AmaxInput::Read(agreed, offset + i))?;
        }
        self.clear_pending()
    }

    /// The update from this rank's own pending amaxes (no agreement: a single rank, or tests).
    pub fn update_local(&mut self) -> Result<(), ShardError> {
        let pending = std::mem::replace(&mut self.pending, Buffer::from_vec(Vec::new()));
        let r = self.update_from(&pending, 0);
        self.pending = pending;
        r?;
        self.clear_pending()
    }

    /// Device bytes held.
    pub fn num_bytes(&self) -> usize {
        self.metas
            .iter()
            .map(ScalingState::num_bytes)
            .sum::<usize>()
            + self.pending.num_bytes()
    }

    /// Every meta as exact text (`scaling.<name>` -> `scale;recorded;history` with floats as bit
    /// patterns), for checkpoints.
    pub fn export(&self) -> Result<BTreeMap<String, String>, ShardError> {
        let mut out = BTreeMap::new();
        for (name, m) in self.names.iter().zip(&self.metas) {
            out.insert(format!("scaling.{name}"), encode_meta(&m.to_meta()?));
        }
        Ok(out)
    }

    /// Restores what [`ScalingRegistry::export`] wrote (every meta must be present; pending amaxes are
    /// cleared).
    pub fn import(&mut self, values: &BTreeMap<String, String>) -> Result<(), ShardError> {
        let device = self.pending.device();
        for (name, m) in self.names.iter().zip(self.metas.iter_mut()) {
            let key = format!("scaling.{name}");
            let text = values.get(&key).ok_or_else(|| {
                ShardError::Checkpoint(format!(
                    "no {key}: the checkpoint was saved by a model without this FP8 scaling meta \
                     (different precision or model?)"
                ))
            })?;
            let meta = decode_meta(text, &m.to_meta()?, &key)?;
            *m = ScalingState::new(&device, &meta)?;
        }
        self.clear_pending()
    }
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

/// Parses [`encode_meta`]'s form; type and recipe come from `like` (the model's current meta).
fn decode_meta(s: &str, like: &ScalingMeta, key: &str) -> Result<ScalingMeta, ShardError> {
    let bad = |why: &str| ShardError::Checkpoint(format!("{key} = {s:?}: {why}"));
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
    Ok(ScalingMeta::from_parts(
        like.qtype(),
        *like.recipe(),
        scale,
        &history,
        recorded,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fp8_core::{AmaxCompute, ScaleRounding};
    use proptest::prelude::*;

    proptest! {
        /// The device meta follows the host `ScalingMeta` bit for bit through any amax sequence, taken
        /// from its own pending slot or read from a shared vector, and round-trips through the host.
        #[test]
        fn device_state_matches_the_host_meta(
            amaxes in proptest::collection::vec(prop_oneof![4 => 0.0f32..1e4, 1 => proptest::num::f32::ANY], 1..40),
            window in 1usize..6,
            most_recent in any::<bool>(),
            margin in 0i32..3,
            exact in any::<bool>(),
            e5m2 in any::<bool>(),
            current in any::<bool>(),
        ) {
            let rounding = if exact { ScaleRounding::Exact } else { ScaleRounding::PowerOfTwo };
            let recipe = if current {
                ScalingRecipe::Current { margin, rounding }
            } else {
                ScalingRecipe::Delayed {
                    history_len: window,
                    amax_compute: if most_recent { AmaxCompute::MostRecent } else { AmaxCompute::Max },
                    margin,
                    rounding,
                }
            };
            let q = if e5m2 { QType::E5M2 } else { QType::E4M3 };
            let mut host = ScalingMeta::new(q, recipe).unwrap();
            let dev = Device::cpu();
            let mut d = ScalingState::new(&dev, &host).unwrap();
            let shared = dev.upload(&amaxes).unwrap();
            for (i, &a) in amaxes.iter().enumerate() {
                host.update_from_amax(a);
                if i % 2 == 0 {
                    let mut own = dev.upload(&[a]).unwrap();
                    d.update(AmaxInput::Take(&mut own, 0)).unwrap();
                    prop_assert_eq!(own.to_vec().unwrap()[0], 0.0);
                } else {
                    d.update(AmaxInput::Read(&shared, i)).unwrap();
                }
                prop_assert_eq!(d.scale().to_vec().unwrap()[0].to_bits(), host.scale().to_bits());
                prop_assert_eq!(d.scale_inv().to_vec().unwrap()[0].to_bits(), host.scale_inv().to_bits());
            }
            let back = d.to_meta().unwrap();
            let bits = |m: &ScalingMeta| -> Vec<u32> { m.history().iter().map(|v| v.to_bits()).collect() };
            prop_assert_eq!(bits(&back), bits(&host));
            prop_assert_eq!(back.recorded(), host.recorded());
            let again = ScalingState::new(&dev, &back).unwrap().to_meta().unwrap();
            prop_assert_eq!(bits(&again), bits(&back));
            prop_assert_eq!(again.scale().to_bits(), back.scale().to_bits());
            prop_assert_eq!(again.recorded(), back.recorded());
        }
    }

    #[test]
    fn registry_agrees_exports_and_imports() {
        let dev = Device::cpu();
        let mut r = ScalingRegistry::new(&dev).unwrap();
        let decl = |q| ScalingDecl {
            qtype: q,
            recipe: ScalingRecipe::delayed_default(),
        };
        let a = r
            .register(&dev, "fc.input".into(), decl(QType::E4M3))
            .unwrap();
        let b = r
            .register(&dev, "fc.grad_output".into(), decl(QType::E5M2))
            .unwrap();
        assert!(r
            .register(&dev, "fc.input".into(), decl(QType::E4M3))
            .is_err());
        assert!(r.register(&dev, "x".into(), decl(QType::BF16)).is_err());
        // A training cast records into its slot; an evaluation use records nothing.
        {
            let u = r.use_meta(a, true).unwrap();
            let slot = u.amax.unwrap();
            slot.buffer.copy_from_host(&[3.0, 0.0]).unwrap();
        }
        assert!(r.use_meta(b, false).unwrap().amax.is_none());
        // Agreed amaxes (another rank saw 5 for `a`): both scales follow the agreed values.
        let agreed = dev.upload(&[9.0, 5.0, 1000.0]).unwrap();
        r.update_from(&agreed, 1).unwrap();
        assert_eq!(r.pending().to_vec().unwrap(), vec![0.0, 0.0]);
        let sa = r.get(a).unwrap().scale().to_vec().unwrap()[0];
        assert_eq!(sa, 64.0, "448 / 5 -> 2^6");
        let sb = r.get(b).unwrap().scale().to_vec().unwrap()[0];
        assert_eq!(sb, 32.0, "57344 / 1000 -> 2^5");
        let saved = r.export().unwrap();
        let mut fresh = ScalingRegistry::new(&dev).unwrap();
        fresh
            .register(&dev, "fc.input".into(), decl(QType::E4M3))
            .unwrap();
        fresh
            .register(&dev, "fc.grad_output".into(), decl(QType::E5M2))
            .unwrap();
        fresh.import(&saved).unwrap();
        assert_eq!(fresh.export().unwrap(), saved);
        let mut other = ScalingRegistry::new(&dev).unwrap();
        other
            .register(&dev, "fc2.input".into(), decl(QType::E4M3))
            .unwrap();
        let e = other.import(&saved).unwrap_err().to_string();
        assert!(e.contains("scaling.fc2.input"), "{e}");
    }
}
