//! [`Embedding`]: a table of `[rows, dim]` vectors looked up by id (a token embedding `wte`) or by
//! position (a position embedding `wpe`), through `fp8_kernels::embedding`.
//!
//! The table is a plain F32 parameter (`<path>.weight`, gathered as F32) and the output is in the
//! activation type (`bf16` or `f32`), each element `T(table[id] + pos[p % seq])` with one rounding. The
//! backward is deterministic: the ids were grouped on the host when the batch was made
//! ([`crate::TokenBatch`]), and every table row's gradient is summed in position order by one thread
//! (see `docs/kernels-transformer.md`). A tied use of the table (a language-model head) is a second
//! module holding the table's [`ParamId`]; both gradients go into the same parameter of the root unit.
//!
//! A token table and its position table are read together (one kernel), so they must be in one FSDP unit
//! (`WrapPolicy::ChildrenOf("h")` puts both in the root unit, as a tied head needs anyway).

use crate::init::normal;
use crate::layer::Activation;
use crate::plain_param::{plain_in, plain_param};
use crate::{NnError, Shape, Tensor, TokenBatch};
use fp8_kernels::embedding::{
    embedding_backward_at, embedding_forward, PositionGrad, PositionTable, RowGroups,
};
use fp8_kernels::{convert, elementwise as ops, Buffer, FloatElement};
use fsdp_shard::{Ctx, Module, ParamDecl, ParamId, ParamKind, PlainParam, ShardError, Visitor};
use half::bf16;

/// A `[rows, dim]` table, initialised `N(0, std^2)` (GPT-2: 0.02) from its seed.
#[derive(Debug)]
pub struct Embedding {
    name: String,
    rows: usize,
    dim: usize,
    std: f64,
    /// An explicit seed; `None`: the weight's own seed.
    seed: Option<u64>,
    weight: ParamId,
    /// Nothing else reads the table in a step (no tied head): a training forward takes it out of its
    /// gathered unit ([`Embedding::with_sole_reader`]).
    sole_reader: bool,
}

impl Embedding {
    /// A table of `rows` vectors of `dim`, `N(0, 0.02^2)` drawn from the weight's seed.
    pub fn new(rows: usize, dim: usize) -> Result<Self, NnError> {
        if rows == 0 || dim == 0 {
            return Err(NnError::usage(
                "Embedding",
                format!("a table of {rows} x {dim}"),
            ));
        }
        Ok(Embedding {
            name: "Embedding".into(),
            rows,
            dim,
            std: 0.02,
            seed: None,
            weight: ParamId::UNSET,
            sole_reader: false,
        })
    }

    /// Declares that nothing else reads the table in a training step (`true`: an untied embedding, no
    /// head tied to it). A training forward without a position table then takes the gathered table out
    /// of its unit for the lookup and drops it (`Ctx::take_param`), since the backward needs only the
    /// gradient: the table's gathered copy goes at once instead of after the backward (llama-8b's
    /// 128256 x 4096 table: 2.1 GB in F32, held through the whole step otherwise, as the root unit
    /// stays gathered). A tied head reading a dropped table would gather the unit again: leave this
    /// off (the default) for tied tables.
    pub fn with_sole_reader(mut self, on: bool) -> Self {
        self.sole_reader = on;
        self
    }

    /// With initial values drawn from `seed` instead of the weight's own seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// With another initial standard deviation.
    pub fn with_std(mut self, std: f64) -> Self {
        self.std = std;
        self
    }

    /// Rows (vocabulary or positions).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Vector length.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The table's id (what a tied head uses).
    pub fn weight_id(&self) -> ParamId {
        self.weight
    }

    fn check_batch(
        &self,
        batch: &TokenBatch,
        positions: Option<&Embedding>,
    ) -> Result<(), NnError> {
        if batch.vocab() != self.rows {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "a batch checked against a vocabulary of {}, the table has {} rows",
                    batch.vocab(),
                    self.rows
                ),
            ));
        }
        if let Some(p) = positions {
            if p.dim != self.dim || p.rows < batch.seq() {
                return Err(NnError::usage(
                    &self.name,
                    format!(
                        "a position table of {} x {} for sequences of {} and vectors of {}",
                        p.rows,
                        p.dim,
                        batch.seq(),
                        self.dim
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `out[b, t] = table[ids[b, t]] (+ positions[t])`, shape `[batch, seq, dim]`.
    pub fn forward<T: Activation>(
        &self,
        ctx: &mut Ctx<'_>,
        batch: &TokenBatch,
        positions: Option<&Embedding>,
    ) -> Result<Tensor<T>, NnError> {
        self.check_batch(batch, positions)?;
        let shape = Shape::new(&[batch.batch(), batch.seq(), self.dim])?;
        let mut out = Tensor::<T>::uninit(ctx.device(), shape)?;
        let (d, seq) = (self.dim, batch.seq());
        match positions {
            Some(p) => {
                let [t, pt] = ctx.params([self.weight, p.weight])?;
                let (t, pt) = (plain_param(t, &self.name)?, plain_param(pt, &p.name)?);
                match (t, pt) {
                    (PlainParam::F32(t), PlainParam::F32(pt)) => {
                        lookup(t, d, Some((pt, seq)), batch, out.data_mut())?
                    }
                    (PlainParam::Bf16(t), PlainParam::Bf16(pt)) => {
                        lookup(t, d, Some((pt, seq)), batch, out.data_mut())?
                    }
                    // Gathered in different types (one unit gathered exactly): both as F32.
                    (t, pt) => {
                        let (mut ts, mut ps) = (None, None);
                        let t = plain_in::<f32>(t, &mut ts)?;
                        let pt = plain_in::<f32>(pt, &mut ps)?;
                        lookup(t, d, Some((pt, seq)), batch, out.data_mut())?
                    }
                }
            }
            None if self.sole_reader && ctx.is_training() => {
                let t = ctx.take_param(self.weight)?;
                match plain_param(&t, &self.name)? {
                    PlainParam::F32(t) => lookup(t, d, None, batch, out.data_mut())?,
                    PlainParam::Bf16(t) => lookup(t, d, None, batch, out.data_mut())?,
                }
            }
            None => match ctx.plain_param(self.weight)? {
                PlainParam::F32(t) => lookup(t, d, None, batch, out.data_mut())?,
                PlainParam::Bf16(t) => lookup(t, d, None, batch, out.data_mut())?,
            },
        }
        Ok(out)
    }

    /// One token (incremental decoding): `table[id] + positions[position]` as a `[1, 1, dim]` tensor (the
    /// f32 sum rounded once, as [`Embedding::forward`] computes it). The id is checked here.
    pub fn forward_at<T: Activation>(
        &self,
        ctx: &mut Ctx<'_>,
        id: i32,
        position: usize,
        positions: &Embedding,
    ) -> Result<Tensor<T>, NnError> {
        if position >= positions.rows || positions.dim != self.dim {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "position {position} of a {} x {} position table",
                    positions.rows, positions.dim
                ),
            ));
        }
        let dev = ctx.device().clone();
        let d = self.dim;
        let groups = RowGroups::from_ids(&dev, &[id], self.rows)?;
        let [t, pt] = ctx.params([self.weight, positions.weight])?;
        let (t, pt) = (
            plain_param(t, &self.name)?,
            plain_param(pt, &positions.name)?,
        );
        let mut row = dev.uninit::<f32>(d)?;
        match t {
            PlainParam::F32(t) => embedding_forward(t, d, None, &groups, &mut row)?,
            PlainParam::Bf16(t) => embedding_forward(t, d, None, &groups, &mut row)?,
        }
        let mut pos = dev.uninit::<f32>(d)?;
        match pt {
            PlainParam::F32(pt) => pos.copy_range_from(0, pt, position * d, d)?,
            PlainParam::Bf16(pt) => {
                let mut p16 = dev.uninit::<bf16>(d)?;
                p16.copy_range_from(0, pt, position * d, d)?;
                convert(&p16, &mut pos)?;
            }
        }
        let mut sum = dev.uninit::<f32>(d)?;
        ops::add(&row, &pos, &mut sum)?;
        let shape = Shape::new(&[1, 1, d])?;
        if T::DTYPE == fp8_kernels::DType::F32 {
            return Tensor::new(
                crate::retype::buffer_into::<f32, T>(sum, &self.name)?,
                shape,
            );
        }
        let mut out = dev.uninit::<T>(d)?;
        convert(&sum, &mut out)?;
        Tensor::new(out, shape)
    }

    /// Adds the gradients of the table (and of the position table) from `dy` (`[batch, seq, dim]`), the
    /// gradient of [`Embedding::forward`]'s output.
    pub fn backward<T: Activation>(
        &self,
        ctx: &mut Ctx<'_>,
        dy: &Tensor<T>,
        batch: &TokenBatch,
        positions: Option<&Embedding>,
    ) -> Result<(), NnError> {
        self.check_batch(batch, positions)?;
        if dy.shape().numel() != batch.tokens() * self.dim {
            return Err(NnError::usage(
                &self.name,
                format!(
                    "a gradient of shape {:?} for {} tokens",
                    dy.shape(),
                    batch.tokens()
                ),
            ));
        }
        let dev = ctx.device().clone();
        // The position table's gradient is small: made and added. The token table's (vocab x dim, 2.1
        // GB in F32 at llama-8b) is added in place into the model's gradient, where a tied head's
        // gradient may already be, without a table-sized temporary.
        let mut d_pos = match positions {
            Some(p) => Some(dev.zeros::<f32>(p.rows * p.dim)?),
            None => None,
        };
        let pos_grad = d_pos.as_mut().map(|grad| PositionGrad {
            grad,
            seq: batch.seq(),
        });
        let slot = ctx.grad_slot(self.weight)?;
        embedding_backward_at(dy.data(), self.dim, batch.groups(), slot, pos_grad)?;
        if let (Some(p), Some(g)) = (positions, d_pos) {
            ctx.add_grad(p.weight, &g)?;
        }
        Ok(())
    }
}

/// `out = table[ids] (+ positions)` for a table (and position table) of element type `S`.
fn lookup<S: FloatElement, O: FloatElement>(
    table: &Buffer<S>,
    d: usize,
    positions: Option<(&Buffer<S>, usize)>,
    batch: &TokenBatch,
    out: &mut Buffer<O>,
) -> Result<(), NnError> {
    let pos = positions.map(|(table, seq)| PositionTable { table, seq });
    embedding_forward(table, d, pos, batch.groups(), out)?;
    Ok(())
}

impl Module for Embedding {
    fn visit(&mut self, v: &mut dyn Visitor) -> Result<(), ShardError> {
        self.name = v.path().module();
        let (n, std, seed) = (self.rows * self.dim, self.std, self.seed);
        let init = move |own: u64| normal(n, std, seed.unwrap_or(own));
        v.param(
            "weight",
            &ParamDecl::seeded(&[self.rows, self.dim], ParamKind::Plain, &init),
            &mut self.weight,
        )
    }
}
