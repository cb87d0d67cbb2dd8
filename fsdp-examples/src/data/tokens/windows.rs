//! Windows of a token stream for language-model training and validation, as the PyTorch peer
//! `bench/peers/peer_gpt.py` defines them, plus unigram statistics to judge a model's loss by.
//!
//! A window of length `T` starting at `s` gives the inputs `tokens[s .. s+T]` and the targets
//! `tokens[s+1 .. s+T+1]` (the next token of each input).
//!
//! - Training ([`TrainWindowSampler`]): each step, each rank draws `B` starts uniformly from
//!   `0 .. n - T - 1` (torch's `randint(0, n - T - 1)`: the upper end excluded, as the peer does), from a
//!   counter-based generator keyed by `(seed, rank)`. Its whole state is one `u64` (the draws taken), which
//!   a checkpoint saves and [`TrainWindowSampler::set_position`] restores.
//! - Validation ([`ValidationWindows`]): every non-overlapping window, window `i` starting at `i*T`, for
//!   `i = 0 .. (n-1)/T - 1`, in batches of `B` (the last batch may be short); the loss is the mean over
//!   all windows, i.e. each batch's mean weighted by its window count
//!   ([`ValidationWindows::combine_batch_means`]).

use std::ops::Range;

use super::error::TokenDataError;
use super::file::TokenId;

/// SplitMix64's increment (the golden ratio in 64-bit fixed point).
const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
/// Tags the rank before it is mixed into the key, so seed `s`, rank `r` and seed `r`, rank `s` differ.
const RANK_STREAM_TAG: u64 = 0xD1B5_4A32_D192_ED03;

/// SplitMix64's output function (Steele, Lea and Flood 2014): a bijective mix of 64 bits.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A token id as the model's `i32` (ids are checked against the vocabulary when a file is opened; one
/// above `i32::MAX` saturates, and the model's own vocabulary check then refuses it).
fn token_i32<T: TokenId>(t: T) -> i32 {
    i32::try_from(t.into()).unwrap_or(i32::MAX)
}

/// Copies windows of `tokens` into model inputs and targets: for the `k`-th start `s`,
/// `inputs[k*T .. (k+1)*T] = tokens[s .. s+T]` and `targets[k*T .. (k+1)*T] = tokens[s+1 .. s+T+1]`.
///
/// Both buffers must hold exactly `starts.len() * seq_len` ids, and every window must lie in `tokens`.
pub fn fill_windows<T: TokenId>(
    tokens: &[T],
    starts: &[usize],
    seq_len: usize,
    inputs: &mut [i32],
    targets: &mut [i32],
) -> Result<(), TokenDataError> {
    let need = starts.len().checked_mul(seq_len).ok_or_else(|| {
        TokenDataError::invalid("fill_windows", "windows x seq_len overflows usize")
    })?;
    if inputs.len() != need || targets.len() != need {
        return Err(TokenDataError::invalid(
            "fill_windows",
            format!(
                "{} windows of {seq_len} tokens need buffers of {need} ids, got inputs {} and targets {}",
                starts.len(),
                inputs.len(),
                targets.len()
            ),
        ));
    }
    if seq_len == 0 {
        return Ok(());
    }
    for ((&s, x), y) in starts
        .iter()
        .zip(inputs.chunks_exact_mut(seq_len))
        .zip(targets.chunks_exact_mut(seq_len))
    {
        let window = s
            .checked_add(seq_len + 1)
            .and_then(|end| tokens.get(s..end))
            .ok_or_else(|| {
                TokenDataError::invalid(
                    "fill_windows",
                    format!(
                        "the window at {s} of {} tokens (inputs and the next target) runs past the \
                         {} tokens of the stream",
                        seq_len + 1,
                        tokens.len()
                    ),
                )
            })?;
        for (o, &t) in x.iter_mut().zip(&window[..seq_len]) {
            *o = token_i32(t);
        }
        for (o, &t) in y.iter_mut().zip(&window[1..]) {
            *o = token_i32(t);
        }
    }
    Ok(())
}

/// Draws `batch` random training windows per step for one rank, reproducibly from `(seed, rank)`.
///
/// The generator is counter-based: draw `i` (counting from 0) is `mix64(key + (i + 1) * GAMMA)`, SplitMix64
/// at position `i`, with `key = mix64(seed ^ mix64(rank ^ TAG))`. A start is drawn uniformly from
/// `0 .. n - T - 1` by Lemire's multiply-and-reject method (a rejection takes one more draw, so the
/// number of draws per step is almost always `batch`). The state is the number of draws taken
/// ([`position`](Self::position)); restoring it ([`set_position`](Self::set_position)) resumes the exact
/// sequence, so a checkpoint needs only that `u64` besides the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainWindowSampler {
    n_tokens: usize,
    seq_len: usize,
    batch: usize,
    seed: u64,
    rank: u64,
    key: u64,
    position: u64,
}

impl TrainWindowSampler {
    /// A sampler over a stream of `n_tokens` tokens, for windows of `seq_len` and `batch` windows per
    /// step, at position 0. Needs `n_tokens >= seq_len + 2` (at least one start to draw from).
    pub fn new(
        n_tokens: usize,
        seq_len: usize,
        batch: usize,
        seed: u64,
        rank: u64,
    ) -> Result<Self, TokenDataError> {
        if seq_len == 0 || batch == 0 {
            return Err(TokenDataError::invalid(
                "TrainWindowSampler::new",
                format!("seq_len ({seq_len}) and batch ({batch}) must be at least 1"),
            ));
        }
        if n_tokens < seq_len.saturating_add(2) {
            return Err(TokenDataError::invalid(
                "TrainWindowSampler::new",
                format!(
                    "{n_tokens} tokens hold no window of {seq_len}: starts are drawn from 0 .. n - T - 1, \
                     which needs n >= T + 2"
                ),
            ));
        }
        Ok(TrainWindowSampler {
            n_tokens,
            seq_len,
            batch,
            seed,
            rank,
            key: mix64(seed ^ mix64(rank ^ RANK_STREAM_TAG)),
            position: 0,
        })
    }

    /// The number of random draws taken so far: the sampler's whole mutable state.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Resumes at `position` (a value [`position`](Self::position) returned, e.g. from a checkpoint).
    pub fn set_position(&mut self, position: u64) {
        self.position = position;
    }

    /// The seed this sampler was built with.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The rank this sampler draws for.
    pub fn rank(&self) -> u64 {
        self.rank
    }

    /// The window length `T`.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The windows per step `B`.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The length of the stream the starts are drawn for.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// The number of possible starts, `n - T - 1`; starts lie in `0 .. start_count()`.
    pub fn start_count(&self) -> usize {
        self.n_tokens - self.seq_len - 1
    }

    fn next_u64(&mut self) -> u64 {
        self.position = self.position.wrapping_add(1);
        mix64(
            self.key
                .wrapping_add(self.position.wrapping_mul(SPLITMIX_GAMMA)),
        )
    }

    /// A uniform draw from `0 .. bound` (`bound >= 1`), without bias (Lemire 2019).
    fn next_below(&mut self, bound: u64) -> u64 {
        let mut product = u128::from(self.next_u64()) * u128::from(bound);
        if (product as u64) < bound {
            let threshold = bound.wrapping_neg() % bound;
            while (product as u64) < threshold {
                product = u128::from(self.next_u64()) * u128::from(bound);
            }
        }
        (product >> 64) as u64
    }

    /// The next step's `batch` window starts, advancing the position.
    pub fn next_starts(&mut self) -> Vec<usize> {
        let bound = self.start_count() as u64;
        (0..self.batch)
            // The draw is below `bound`, which came from a usize.
            .map(|_| self.next_below(bound) as usize)
            .collect()
    }

    /// Draws the next step's windows and copies them into `inputs` and `targets` (`batch * seq_len` ids
    /// each, row-major `[batch, seq_len]`); returns the starts. `tokens` must be the stream the sampler
    /// was built for (its length is checked).
    pub fn fill_next<T: TokenId>(
        &mut self,
        tokens: &[T],
        inputs: &mut [i32],
        targets: &mut [i32],
    ) -> Result<Vec<usize>, TokenDataError> {
        if tokens.len() != self.n_tokens {
            return Err(TokenDataError::invalid(
                "TrainWindowSampler::fill_next",
                format!(
                    "the sampler was built for {} tokens, the stream holds {}",
                    self.n_tokens,
                    tokens.len()
                ),
            ));
        }
        let need = self.batch * self.seq_len;
        if inputs.len() != need || targets.len() != need {
            // Checked before drawing, so a bad call does not advance the position.
            return Err(TokenDataError::invalid(
                "TrainWindowSampler::fill_next",
                format!(
                    "buffers of {need} ids needed (batch {} x seq_len {}), got inputs {} and targets {}",
                    self.batch,
                    self.seq_len,
                    inputs.len(),
                    targets.len()
                ),
            ));
        }
        let starts = self.next_starts();
        fill_windows(tokens, &starts, self.seq_len, inputs, targets)?;
        Ok(starts)
    }
}

/// Every non-overlapping window of a validation stream, in batches, exactly as the peer evaluates:
/// window `i` starts at `i*T`, `i = 0 .. (n-1)/T - 1`; batch `b` holds windows `b*B .. min((b+1)*B, W)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidationWindows {
    n_tokens: usize,
    seq_len: usize,
    batch: usize,
    windows: usize,
}

impl ValidationWindows {
    /// The windows of a stream of `n_tokens` tokens; needs at least one (`n_tokens >= seq_len + 1`).
    pub fn new(n_tokens: usize, seq_len: usize, batch: usize) -> Result<Self, TokenDataError> {
        if seq_len == 0 || batch == 0 {
            return Err(TokenDataError::invalid(
                "ValidationWindows::new",
                format!("seq_len ({seq_len}) and batch ({batch}) must be at least 1"),
            ));
        }
        let windows = n_tokens.saturating_sub(1) / seq_len;
        if windows == 0 {
            return Err(TokenDataError::invalid(
                "ValidationWindows::new",
                format!("{n_tokens} tokens hold no window of {seq_len} inputs and its next target"),
            ));
        }
        Ok(ValidationWindows {
            n_tokens,
            seq_len,
            batch,
            windows,
        })
    }

    /// The number of windows `W = (n-1)/T`.
    pub fn window_count(&self) -> usize {
        self.windows
    }

    /// The number of batches, `ceil(W / B)`.
    pub fn batch_count(&self) -> usize {
        self.windows.div_ceil(self.batch)
    }

    /// The window length `T`.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The windows per batch `B` (the last batch may hold fewer).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The indices of the windows of batch `b` (empty when `b >= batch_count()`).
    pub fn batch_windows(&self, b: usize) -> Range<usize> {
        let first = b.saturating_mul(self.batch).min(self.windows);
        first..first.saturating_add(self.batch).min(self.windows)
    }

    /// The token starts of the windows of batch `b`.
    pub fn batch_starts(&self, b: usize) -> Vec<usize> {
        self.batch_windows(b).map(|i| i * self.seq_len).collect()
    }

    /// Copies batch `b` into `inputs` and `targets` (at least `B * T` ids each; the first
    /// `windows * T` are written) and returns its number of windows.
    pub fn fill_batch<T: TokenId>(
        &self,
        tokens: &[T],
        b: usize,
        inputs: &mut [i32],
        targets: &mut [i32],
    ) -> Result<usize, TokenDataError> {
        if tokens.len() != self.n_tokens {
            return Err(TokenDataError::invalid(
                "ValidationWindows::fill_batch",
                format!(
                    "the windows were built for {} tokens, the stream holds {}",
                    self.n_tokens,
                    tokens.len()
                ),
            ));
        }
        if b >= self.batch_count() {
            return Err(TokenDataError::invalid(
                "ValidationWindows::fill_batch",
                format!("batch {b} of {}", self.batch_count()),
            ));
        }
        let starts = self.batch_starts(b);
        let used = starts.len() * self.seq_len;
        if inputs.len() < used || targets.len() < used {
            return Err(TokenDataError::invalid(
                "ValidationWindows::fill_batch",
                format!(
                    "batch {b} needs {used} ids, got inputs {} and targets {}",
                    inputs.len(),
                    targets.len()
                ),
            ));
        }
        fill_windows(
            tokens,
            &starts,
            self.seq_len,
            &mut inputs[..used],
            &mut targets[..used],
        )?;
        Ok(starts.len())
    }

    /// The validation loss from each batch's mean loss (in batch order): `sum(mean_b * windows_b) / W`,
    /// as the peer computes it.
    pub fn combine_batch_means(&self, batch_means: &[f64]) -> Result<f64, TokenDataError> {
        if batch_means.len() != self.batch_count() {
            return Err(TokenDataError::invalid(
                "ValidationWindows::combine_batch_means",
                format!(
                    "{} batch means given, the windows form {} batches",
                    batch_means.len(),
                    self.batch_count()
                ),
            ));
        }
        let total: f64 = batch_means
            .iter()
            .enumerate()
            .map(|(b, &m)| m * self.batch_windows(b).len() as f64)
            .sum();
        Ok(total / self.windows as f64)
    }
}

fn token_counts(tokens: &[u16]) -> Vec<u64> {
    let mut counts = vec![0u64; 1 << 16];
    for &t in tokens {
        counts[usize::from(t)] += 1;
    }
    counts
}

/// The entropy in nats of the unigram (token frequency) distribution of `tokens`:
/// `-sum_t p_t ln p_t` with `p_t = count_t / n`.
///
/// It is the loss of the best model that ignores context, evaluated on the same stream; a language model
/// that learned anything from context goes below it.
pub fn unigram_entropy_nats(tokens: &[u16]) -> Result<f64, TokenDataError> {
    if tokens.is_empty() {
        return Err(TokenDataError::invalid(
            "unigram_entropy_nats",
            "the entropy of an empty stream is undefined",
        ));
    }
    let n = tokens.len() as f64;
    Ok(token_counts(tokens)
        .into_iter()
        .filter(|&c| c > 0)
        .map(|c| {
            let p = c as f64 / n;
            -p * p.ln()
        })
        .sum())
}

/// The cross-entropy in nats of `eval` under the unigram distribution of `fit` with add-one (Laplace)
/// smoothing over `vocab_size` ids: `p_t = (count_t + 1) / (n + vocab_size)`, loss `-mean ln p_{eval_i}`.
///
/// This is the validation loss of a context-free model fitted on the training stream (the smoothing
/// gives ids unseen in `fit` a finite loss).
pub fn unigram_cross_entropy_nats(
    fit: &[u16],
    eval: &[u16],
    vocab_size: u32,
) -> Result<f64, TokenDataError> {
    if eval.is_empty() || vocab_size == 0 {
        return Err(TokenDataError::invalid(
            "unigram_cross_entropy_nats",
            "needs a non-empty evaluation stream and a vocabulary",
        ));
    }
    if let Some(&t) = eval.iter().find(|&&t| u32::from(t) >= vocab_size) {
        return Err(TokenDataError::invalid(
            "unigram_cross_entropy_nats",
            format!("evaluation id {t} is not below the vocabulary size {vocab_size}"),
        ));
    }
    let counts = token_counts(fit);
    let denominator = fit.len() as f64 + f64::from(vocab_size);
    let total: f64 = eval
        .iter()
        .map(|&t| -((counts[usize::from(t)] as f64 + 1.0) / denominator).ln())
        .sum();
    Ok(total / eval.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_the_published_sequence() {
        // SplitMix64 seeded with 1234567 (the reference implementation's test vector, Vigna's
        // splitmix64.c): the state advances by GAMMA before each output.
        let mut state: u64 = 1234567;
        let mut next = || {
            state = state.wrapping_add(SPLITMIX_GAMMA);
            mix64(state)
        };
        assert_eq!(next(), 6457827717110365317);
        assert_eq!(next(), 3203168211198807973);
        assert_eq!(next(), 9817491932198370423);
    }

    #[test]
    fn lemire_draw_stays_below_the_bound() {
        let mut s = TrainWindowSampler::new(10, 3, 1, 5, 0).unwrap();
        for bound in [1u64, 2, 3, 6, 7, 1000, u64::MAX] {
            for _ in 0..100 {
                assert!(s.next_below(bound) < bound);
            }
        }
    }
}
