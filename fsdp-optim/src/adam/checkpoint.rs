//! The optimizer's checkpoint state: its moments, masters and scales as [`StateShard`]s (the
//! [`ShardedState`] face of [`ShardedAdam`]), written and read by fsdp-shard's checkpoint protocol.

use super::*;

fn le_bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|x| f(*x)).collect()
}

fn from_le<T, const N: usize>(
    bytes: &[u8],
    len: usize,
    what: &str,
    f: impl Fn([u8; N]) -> T,
) -> Result<Vec<T>, ShardError> {
    if bytes.len() != len * N {
        return Err(ShardError::Checkpoint(format!(
            "{what}: {} bytes for {len} elements of {N} bytes",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        })
        .collect())
}

fn f32s(v: &[f32]) -> Vec<u8> {
    le_bytes(v, f32::to_le_bytes)
}

fn state_shard(
    name: &str,
    unit: usize,
    group: ParamGroup,
    qtype: QType,
    bytes: Vec<u8>,
    slot_scales: Vec<f32>,
) -> StateShard {
    StateShard {
        name: name.into(),
        unit,
        group,
        qtype,
        bytes,
        slot_scales,
    }
}

fn encode_f32_list(v: impl Iterator<Item = f32>) -> String {
    v.map(|x| format!("{:08x}", x.to_bits()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn decode_f32_list(s: &str) -> Result<Vec<f32>, ShardError> {
    s.split_whitespace()
        .map(|w| {
            u32::from_str_radix(w, 16)
                .map(f32::from_bits)
                .map_err(|e| ShardError::Checkpoint(format!("optimizer amaxes: {e}")))
        })
        .collect()
}

impl ShardedState for ShardedAdam {
    fn export_state(&self) -> Result<Vec<StateShard>, ShardError> {
        if self.in_backward.is_some() {
            // Some units hold this step's update, the counters do not yet: not a state to save.
            return Err(ShardError::State(
                "the optimizer is in the middle of a step taken in the backward: save after it \
                 finishes"
                    .into(),
            ));
        }
        let mut out = Vec::new();
        let all_scales = Self::host_triples(&self.scales)?;
        for (u, st) in self.units.iter().enumerate() {
            if !st.params.is_empty() {
                let scales = &all_scales[st.slot_base..st.slot_base + st.params.len()];
                let col = |k: usize| scales.iter().map(|s| s[k]).collect::<Vec<f32>>();
                let g = ParamGroup::Fp8;
                match &st.fp8 {
                    Fp8States::F32 { master, m, v } => {
                        for (name, b) in [("master", master), ("exp_avg", m), ("exp_avg_sq", v)] {
                            out.push(state_shard(
                                name,
                                u,
                                g,
                                QType::F32,
                                f32s(&b.to_vec()?),
                                vec![],
                            ));
                        }
                    }
                    Fp8States::Low { master, m, v, .. } => {
                        out.push(state_shard(
                            "master",
                            u,
                            g,
                            QType::F16,
                            le_bytes(&master.to_vec()?, f16::to_le_bytes),
                            col(0),
                        ));
                        out.push(state_shard(
                            "exp_avg",
                            u,
                            g,
                            QType::E4M3,
                            m.to_vec()?,
                            col(1),
                        ));
                        out.push(state_shard(
                            "exp_avg_sq",
                            u,
                            g,
                            QType::F16,
                            le_bytes(&v.to_vec()?, f16::to_le_bytes),
                            col(2),
                        ));
                    }
                }
            }
            if st.plain_len > 0 {
                for (name, b) in [("exp_avg", &st.plain_m), ("exp_avg_sq", &st.plain_v)] {
                    out.push(state_shard(
                        name,
                        u,
                        ParamGroup::Plain,
                        QType::F32,
                        f32s(&b.to_vec()?),
                        vec![],
                    ));
                }
            }
        }
        Ok(out)
    }

    fn import_state(&mut self, shards: Vec<StateShard>) -> Result<(), ShardError> {
        let expected = self.export_state()?;
        if expected.len() != shards.len() {
            return Err(ShardError::Checkpoint(format!(
                "optimizer: {} state shards given, {} expected",
                shards.len(),
                expected.len()
            )));
        }
        let mut new_scales = Self::host_triples(&self.scales)?;
        for sh in shards {
            let key = |s: &StateShard| (s.name.clone(), s.unit, s.group);
            let want = expected
                .iter()
                .find(|e| key(e) == key(&sh))
                .ok_or_else(|| {
                    ShardError::Checkpoint(format!(
                        "optimizer: unexpected state {} of unit {} ({:?})",
                        sh.name, sh.unit, sh.group
                    ))
                })?;
            if want.qtype != sh.qtype || want.slot_scales.len() != sh.slot_scales.len() {
                return Err(ShardError::Checkpoint(format!(
                    "optimizer: state {} of unit {} is {:?} with {} scales, this optimizer keeps {:?} with {}",
                    sh.name,
                    sh.unit,
                    sh.qtype,
                    sh.slot_scales.len(),
                    want.qtype,
                    want.slot_scales.len()
                )));
            }
            if sh.slot_scales.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
                return Err(ShardError::Checkpoint(format!(
                    "optimizer: state {} of unit {} has a non-positive scale",
                    sh.name, sh.unit
                )));
            }
            let st = &mut self.units[sh.unit];
            let what = "optimizer state";
            let f32v = |b: &[u8], n: usize| from_le(b, n, what, f32::from_le_bytes);
            let f16v = |b: &[u8], n: usize| from_le(b, n, what, f16::from_le_bytes);
            match (sh.group, &mut st.fp8, sh.name.as_str()) {
                (ParamGroup::Plain, _, "exp_avg") => {
                    st.plain_m.copy_from_host(&f32v(&sh.bytes, st.plain_len)?)?
                }
                (ParamGroup::Plain, _, "exp_avg_sq") => {
                    st.plain_v.copy_from_host(&f32v(&sh.bytes, st.plain_len)?)?
                }
                (ParamGroup::Fp8, Fp8States::F32 { master, m, v }, name) => {
                    let dst = match name {
                        "master" => master,
                        "exp_avg" => m,
                        _ => v,
                    };
                    dst.copy_from_host(&f32v(&sh.bytes, st.fp8_len)?)?;
                }
                (ParamGroup::Fp8, Fp8States::Low { master, m, v, .. }, name) => {
                    let k = match name {
                        "master" => {
                            master.copy_from_host(&f16v(&sh.bytes, st.fp8_len)?)?;
                            0
                        }
                        "exp_avg" => {
                            if sh.bytes.len() != st.fp8_len {
                                return Err(ShardError::Checkpoint(format!(
                                    "optimizer: exp_avg of unit {} has {} bytes, expected {}",
                                    sh.unit,
                                    sh.bytes.len(),
                                    st.fp8_len
                                )));
                            }
                            m.copy_from_host(&sh.bytes)?;
                            1
                        }
                        _ => {
                            v.copy_from_host(&f16v(&sh.bytes, st.fp8_len)?)?;
                            2
                        }
                    };
                    for (i, s) in sh.slot_scales.iter().enumerate() {
                        new_scales[st.slot_base + i][k] = *s;
                    }
                }
                _ => {
                    return Err(ShardError::Checkpoint(format!(
                        "optimizer: unexpected state {}",
                        sh.name
                    )))
                }
            }
        }
        self.scales
            .copy_from_host(&new_scales.into_iter().flatten().collect::<Vec<f32>>())?;
        Ok(())
    }

    fn state_bytes(&self) -> usize {
        self.units
            .iter()
            .map(|st| {
                let fp8 = match &st.fp8 {
                    Fp8States::F32 { master, m, v } => {
                        master.num_bytes() + m.num_bytes() + v.num_bytes()
                    }
                    Fp8States::Low { master, m, v } => {
                        master.num_bytes() + m.num_bytes() + v.num_bytes()
                    }
                };
                fp8 + st.plain_m.num_bytes() + st.plain_v.num_bytes()
            })
            .sum::<usize>()
            + [
                &self.control,
                &self.coef,
                &self.stats_acc,
                &self.amaxes,
                &self.scales,
                &self.write,
                &self.kernel_scales,
            ]
            .iter()
            .map(|b| b.num_bytes())
            .sum::<usize>()
    }

    fn scalar_state(&self) -> Vec<(String, String)> {
        // Reads the device; a failed read leaves the values out, so loading such a checkpoint fails with
        // a clear "no step" / "amaxes" error instead of resuming from wrong counters.
        let control = self.control.to_vec().unwrap_or_default();
        let counter = |k: usize| control.get(k).map(|c| c.to_bits().to_string());
        let amaxes = self.amaxes.to_vec().unwrap_or_default();
        let mut v: Vec<(String, String)> = [
            ("step", counter(ctl::STEP)),
            ("skipped", counter(ctl::SKIP_COUNT)),
        ]
        .into_iter()
        .filter_map(|(k, c)| c.map(|c| (k.to_string(), c)))
        .collect();
        v.extend([
            ("base_lr".to_string(), format!("{:e}", self.options.lr)),
            (
                "schedule_position".to_string(),
                self.schedule_position.to_string(),
            ),
            (
                "schedule".to_string(),
                self.schedule
                    .as_ref()
                    .map_or("none".into(), |s| s.describe()),
            ),
            (
                "state_precision".to_string(),
                self.options.state_precision.name().to_string(),
            ),
            (
                "amaxes".to_string(),
                encode_f32_list(amaxes.iter().copied()),
            ),
        ]);
        v.sort();
        v
    }

    fn load_scalar_state(&mut self, values: &[(String, String)]) -> Result<(), ShardError> {
        let get = |k: &str| {
            values
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
                .ok_or_else(|| ShardError::Checkpoint(format!("optimizer: no {k} in checkpoint")))
        };
        let parse_u64 = |k: &str| -> Result<u64, ShardError> {
            get(k)?
                .parse()
                .map_err(|e| ShardError::Checkpoint(format!("optimizer {k}: {e}")))
        };
        let precision = get("state_precision")?;
        if precision != self.options.state_precision.name() {
            return Err(ShardError::Checkpoint(format!(
                "optimizer states were saved as {precision}, this optimizer keeps {}",
                self.options.state_precision.name()
            )));
        }
        let schedule = get("schedule")?;
        let mine = self
            .schedule
            .as_ref()
            .map_or("none".into(), |s| s.describe());
        if schedule != mine {
            return Err(ShardError::Checkpoint(format!(
                "the checkpoint's learning-rate schedule is {schedule}, this optimizer's {mine}"
            )));
        }
        let amaxes = decode_f32_list(get("amaxes")?)?;
        if amaxes.len() != 3 * self.total_slots {
            return Err(ShardError::Checkpoint(format!(
                "optimizer: {} amaxes for {} FP8 weights",
                amaxes.len(),
                self.total_slots
            )));
        }
        let lr: f64 = get("base_lr")?
            .parse()
            .map_err(|e| ShardError::Checkpoint(format!("optimizer base_lr: {e}")))?;
        self.set_lr(lr).map_err(ShardError::from)?;
        let as_u32 = |k: &str| -> Result<u32, ShardError> {
            u32::try_from(parse_u64(k)?)
                .map_err(|e| ShardError::Checkpoint(format!("optimizer {k}: {e}")))
        };
        let mut control = vec![0f32; ctl::LEN];
        control[ctl::STEP] = f32::from_bits(as_u32("step")?);
        control[ctl::SKIP_COUNT] = f32::from_bits(as_u32("skipped")?);
        self.control.copy_from_host(&control)?;
        self.schedule_position = parse_u64("schedule_position")?;
        self.amaxes.copy_from_host(&amaxes)?;
        // The stored states belong to the imported scales: the next step's control kernel reads them
        // (they arrive through import_state).
        Ok(())
    }
}
