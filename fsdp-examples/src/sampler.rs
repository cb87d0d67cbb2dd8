//! A distributed sampler: one seeded shuffle of the dataset per epoch, split across ranks so that every
//! world size sees the same global order.
//!
//! # The global order
//! For each epoch the sampler draws one permutation `perm` of `0..len` ([`epoch_permutation`]): a
//! Fisher-Yates shuffle driven by [`SplitMix64`], seeded from `(seed, epoch)` only. The world size does
//! not enter it.
//!
//! # Remainder
//! Every rank must take the same number of steps (the collectives run in lock-step), so the global order
//! is cut or extended to `total = num_samples * world_size` positions:
//! - [`Remainder::DropLast`]: `num_samples = len / world_size`; the last `len % world_size` positions
//!   of `perm` are dropped this epoch (they differ per epoch, since `perm` does).
//! - [`Remainder::Pad`]: `num_samples = ceil(len / world_size)`; positions `p >= len` repeat
//!   `perm[p % len]` (as PyTorch's `DistributedSampler`). Padding positions are the last ones of each
//!   rank's list; [`DistributedSampler::num_real_samples`] tells where they start, so an evaluation
//!   can skip them and count every digit exactly once.
//!
//! # Assignment: strided
//! Rank `r` of `N` takes global positions `r, r + N, r + 2N, ...`. With per-rank batches of `B`, step `k`
//! of all ranks together covers positions `[k*B*N, (k+1)*B*N)`, so a global batch of `B*N` samples is the
//! same set of samples for every `N` (e.g. 1 rank with batch 128 and 2 ranks with batch 64 see the same
//! global batches). The last batch of an epoch is partial when `num_samples % B != 0`; it has the same
//! size on every rank.

/// SplitMix64 (Steele, Lea and Flood 2014, in Vigna's reference form): a counter stepped by
/// `0x9E3779B97F4A7C15` and a finaliser, easy to reproduce in any language (see `docs/mnist-data.md`).
/// It is the workspace's one generator, re-exported here where the sampler's API has always named it.
pub use fp8_kernels::rng::SplitMix64;

/// The generator for one epoch: `SplitMix64::new(k ^ epoch)` where `k` is the first output of
/// `SplitMix64::new(seed)`, so nearby seeds and epochs give unrelated streams.
pub fn epoch_rng(seed: u64, epoch: u64) -> SplitMix64 {
    let k = SplitMix64::new(seed).next_u64();
    SplitMix64::new(k ^ epoch)
}

/// The epoch's permutation of `0..len`: start from the identity and, for `i` from `len - 1` down to 1,
/// swap positions `i` and `rng.below(i + 1)` (Fisher-Yates) with [`epoch_rng`]`(seed, epoch)`.
pub fn epoch_permutation(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..len).collect();
    let mut rng = epoch_rng(seed, epoch);
    for i in (1..len).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        perm.swap(i, j);
    }
    perm
}

/// What happens to the `len % world_size` samples that do not divide evenly among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Remainder {
    /// Drop the last `len % world_size` positions of the epoch's order.
    DropLast,
    /// Extend the order by wrapping around to its start (PyTorch's `DistributedSampler` default).
    #[default]
    Pad,
}

/// Arguments a sampler cannot work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[allow(missing_docs)] // variant fields are described by the messages
pub enum SamplerError {
    /// A world of no ranks.
    #[error("world size must be at least 1")]
    ZeroWorldSize,
    /// A rank outside `0..world_size`.
    #[error("rank {rank} is outside 0..{world_size}")]
    RankOutOfRange { rank: usize, world_size: usize },
    /// Nothing to sample.
    #[error("the dataset is empty")]
    EmptyDataset,
    /// With [`Remainder::DropLast`], fewer samples than ranks leaves every rank with nothing.
    #[error("{len} samples cannot be split over {world_size} ranks without padding")]
    TooFewSamples { len: usize, world_size: usize },
    /// A batch of no samples.
    #[error("batch size must be at least 1")]
    ZeroBatchSize,
}

/// One rank's view of the epoch orders of a dataset (see the module documentation for the rules).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    world_size: usize,
    rank: usize,
    seed: u64,
    shuffle: bool,
    remainder: Remainder,
}

impl DistributedSampler {
    /// A shuffling sampler for `rank` of `world_size` over a dataset of `len` samples.
    pub fn new(
        len: usize,
        world_size: usize,
        rank: usize,
        seed: u64,
        remainder: Remainder,
    ) -> Result<Self, SamplerError> {
        if world_size == 0 {
            return Err(SamplerError::ZeroWorldSize);
        }
        if rank >= world_size {
            return Err(SamplerError::RankOutOfRange { rank, world_size });
        }
        if len == 0 {
            return Err(SamplerError::EmptyDataset);
        }
        if remainder == Remainder::DropLast && len < world_size {
            return Err(SamplerError::TooFewSamples { len, world_size });
        }
        Ok(DistributedSampler {
            len,
            world_size,
            rank,
            seed,
            shuffle: true,
            remainder,
        })
    }

    /// Turns shuffling off (the epoch order is then `0..len` for every epoch, e.g. for evaluation) or on.
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The same sampler for another rank of the same world.
    pub fn for_rank(&self, rank: usize) -> Result<Self, SamplerError> {
        if rank >= self.world_size {
            return Err(SamplerError::RankOutOfRange {
                rank,
                world_size: self.world_size,
            });
        }
        Ok(DistributedSampler {
            rank,
            ..self.clone()
        })
    }

    /// Dataset length.
    pub fn dataset_len(&self) -> usize {
        self.len
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether epochs are shuffled.
    pub fn shuffle(&self) -> bool {
        self.shuffle
    }

    /// The remainder rule.
    pub fn remainder(&self) -> Remainder {
        self.remainder
    }

    /// Samples per rank per epoch (equal on every rank).
    pub fn num_samples(&self) -> usize {
        match self.remainder {
            Remainder::DropLast => self.len / self.world_size,
            Remainder::Pad => self.len.div_ceil(self.world_size),
        }
    }

    /// Samples per epoch over all ranks: `num_samples() * world_size()`.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.world_size
    }

    /// How many of this rank's samples are not padding: its list's first `num_real_samples()` entries
    /// are distinct dataset positions, the rest (at most one, with [`Remainder::Pad`]) repeat earlier ones.
    pub fn num_real_samples(&self) -> usize {
        match self.remainder {
            Remainder::DropLast => self.num_samples(),
            // Rank r's i-th sample is global position i * N + r; real while that is below len.
            Remainder::Pad => self.len.saturating_sub(self.rank).div_ceil(self.world_size),
        }
    }

    /// Per-rank batches per epoch with batch size `batch_size`, counting a final partial batch.
    pub fn num_batches(&self, batch_size: usize) -> Result<usize, SamplerError> {
        if batch_size == 0 {
            return Err(SamplerError::ZeroBatchSize);
        }
        Ok(self.num_samples().div_ceil(batch_size))
    }

    /// The epoch's order of the whole dataset, independent of the world size.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        if self.shuffle {
            epoch_permutation(self.len, self.seed, epoch)
        } else {
            (0..self.len).collect()
        }
    }

    /// The epoch's order cut or padded to [`total_size`](Self::total_size) positions.
    pub fn global_order(&self, epoch: u64) -> Vec<usize> {
        let order = self.epoch_order(epoch);
        let total = self.total_size();
        (0..total).map(|p| order[p % self.len]).collect()
    }

    /// This rank's dataset indices for `epoch`: global positions `rank, rank + N, ...`.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        self.global_order(epoch)
            .into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }

    /// This rank's batches for `epoch`: [`indices`](Self::indices) in chunks of `batch_size`, the
    /// last one partial when `num_samples` is not a multiple of it.
    pub fn batches(&self, epoch: u64, batch_size: usize) -> Result<Vec<Vec<usize>>, SamplerError> {
        if batch_size == 0 {
            return Err(SamplerError::ZeroBatchSize);
        }
        Ok(self
            .indices(epoch)
            .chunks(batch_size)
            .map(<[usize]>::to_vec)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_stays_in_range() {
        let mut rng = SplitMix64::new(7);
        for bound in [1u64, 2, 3, 10, 1 << 40, u64::MAX] {
            for _ in 0..100 {
                assert!(rng.below(bound) < bound);
            }
        }
        assert_eq!(rng.below(0), 0);
    }
}
