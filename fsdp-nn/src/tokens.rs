//! [`TokenBatch`]: one batch of token ids and their targets for a language model, checked and grouped on
//! the host once, when the batch is made, so nothing in the step reads back from the device or can index
//! a table out of range.

use crate::NnError;
use fp8_kernels::cross_entropy::check_targets;
use fp8_kernels::embedding::RowGroups;
use fp8_kernels::{Buffer, Device};

/// `batch` sequences of `seq` token ids (row-major `[batch, seq]`) with the next-token targets, on a
/// device: the input ids grouped for the embedding kernels ([`RowGroups`], which also hold them on the
/// device), and the targets as a device buffer for the cross-entropy kernel.
#[derive(Debug)]
pub struct TokenBatch {
    batch: usize,
    seq: usize,
    vocab: usize,
    groups: RowGroups,
    targets: Buffer<i32>,
}

impl TokenBatch {
    /// Checks and uploads a batch: `inputs` and `targets` hold `batch * seq` ids each, every one in
    /// `0..vocab` (an error names the first bad id and its position). The input ids are grouped for the
    /// embedding backward here (a host sort), and both are copied to `device`.
    pub fn new(
        device: &Device,
        inputs: &[i32],
        targets: &[i32],
        batch: usize,
        seq: usize,
        vocab: usize,
    ) -> Result<Self, NnError> {
        let n = batch.checked_mul(seq).filter(|&n| n > 0).ok_or_else(|| {
            NnError::usage("TokenBatch", format!("batch {batch} x seq {seq} tokens"))
        })?;
        if inputs.len() != n || targets.len() != n {
            return Err(NnError::usage(
                "TokenBatch",
                format!(
                    "{batch} x {seq} = {n} tokens need {n} inputs and targets, got {} and {}",
                    inputs.len(),
                    targets.len()
                ),
            ));
        }
        check_targets(targets, vocab, None)?;
        let groups = RowGroups::from_ids(device, inputs, vocab)?;
        Ok(TokenBatch {
            batch,
            seq,
            vocab,
            groups,
            targets: device.upload(targets)?,
        })
    }

    /// Sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per sequence.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// `batch * seq`.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// The vocabulary the ids were checked against.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The input ids grouped for the embedding kernels.
    pub fn groups(&self) -> &RowGroups {
        &self.groups
    }

    /// The input ids in position order (host).
    pub fn input_ids(&self) -> &[i32] {
        self.groups.ids()
    }

    /// The targets on the device.
    pub fn targets(&self) -> &Buffer<i32> {
        &self.targets
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.targets.device()
    }
}
