//! The in-process backend: `N` ranks as threads of one process, exchanging through shared memory.
//!
//! Every collective is one round of a generation-counted barrier (a `Mutex` and a `Condvar`): each rank
//! deposits a copy of its input and a description of the call, the last rank to arrive checks that all
//! descriptions agree and publishes the deposits, and each rank then computes its own output from them.
//! Reductions follow [`crate::ring`], so results do not depend on thread timing.
//!
//! Failures never hang: a rank that does not arrive within the group's timeout makes the waiting ranks
//! fail with [`CommError::Timeout`] naming the operation and the missing ranks; a rank that panics, or
//! whose communicator is dropped while others wait for it, poisons the group so every rank gets an
//! error. A rank whose own arguments are wrong (sizes, types) still takes part in the round with an
//! error marker, so every rank fails at once instead of waiting for a timeout.
//!
//! The variable-count collectives take part the same way: all-gather-v and reduce-scatter-v compare
//! their counts across ranks like any size, and all-to-all-v compares every pair of ranks (rank `r`'s
//! `send_counts[j]` against rank `j`'s `recv_counts[r]`) before any rank writes its output.

use crate::collective::{
    Collective, CollectiveKind, CommDType, CommWork, Communicator, RecvBuf, ReduceOp, SendBuf,
};
use crate::error::CommError;
use crate::ring::{self, RingElement};
use fp8_kernels::{Buffer, Device, Element};
use half::{bf16, f16};
use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Default time a rank waits for the others in one collective.
pub const DEFAULT_THREAD_TIMEOUT: Duration = Duration::from_secs(60);

/// A copy of one rank's input.
#[derive(Debug, Clone)]
enum HostData {
    None,
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    U8(Vec<u8>),
}

/// Element types a host copy can hold.
trait HostElem: Element + Copy {
    fn slice(d: &HostData) -> Option<&[Self]>;
}

macro_rules! host_elem {
    ($t:ty, $v:ident) => {
        impl HostElem for $t {
            fn slice(d: &HostData) -> Option<&[Self]> {
                match d {
                    HostData::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
host_elem!(f32, F32);
host_elem!(bf16, BF16);
host_elem!(f16, F16);
host_elem!(u8, U8);

/// What a rank called, compared across ranks before data is combined.
#[derive(Debug, Clone, PartialEq)]
struct OpDesc {
    kind: CollectiveKind,
    dtype: Option<CommDType>,
    op: Option<ReduceOp>,
    root: Option<usize>,
    /// The send length every rank must share; `None` where it differs by rank by design (the shard of
    /// an all-gather-v, the chunks of an all-to-all-v).
    send_len: Option<usize>,
    /// The receive length every rank must share, or `None` likewise.
    recv_len: Option<usize>,
    /// The counts of an all-gather-v or reduce-scatter-v, the same on every rank.
    counts: Option<Vec<usize>>,
}

impl OpDesc {
    /// The description of `call`: only what every rank of a correct call shares.
    fn of(call: &Collective<'_>) -> Self {
        let (send_len, recv_len) = call.lengths();
        let (send_len, recv_len) = match call.kind() {
            CollectiveKind::AllGatherV => (None, Some(recv_len)),
            CollectiveKind::ReduceScatterV => (Some(send_len), None),
            CollectiveKind::AllToAllV => (None, None),
            _ => (Some(send_len), Some(recv_len)),
        };
        OpDesc {
            kind: call.kind(),
            dtype: Some(call.dtype()),
            op: call.op(),
            root: call.root(),
            send_len,
            recv_len,
            counts: call.counts().map(<[usize]>::to_vec),
        }
    }

    fn barrier() -> Self {
        OpDesc {
            kind: CollectiveKind::Barrier,
            dtype: None,
            op: None,
            root: None,
            send_len: None,
            recv_len: None,
            counts: None,
        }
    }
}

/// At most this many counts are named in messages (a group may have thousands of ranks).
const COUNTS_SHOWN: usize = 16;

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind.name())?;
        if let Some(d) = self.dtype {
            write!(f, " {d}")?;
        }
        if let Some(op) = self.op {
            write!(f, " {op}")?;
        }
        if let Some(root) = self.root {
            write!(f, " root {root}")?;
        }
        if let Some(counts) = &self.counts {
            let shown: Vec<String> = counts
                .iter()
                .take(COUNTS_SHOWN)
                .map(usize::to_string)
                .collect();
            let more = if counts.len() > COUNTS_SHOWN {
                ", ..."
            } else {
                ""
            };
            write!(f, " counts [{}{more}]", shown.join(", "))?;
        }
        if let Some(n) = self.send_len {
            write!(f, " send {n}")?;
        }
        if let Some(n) = self.recv_len {
            write!(f, " recv {n}")?;
        }
        Ok(())
    }
}

struct Deposit {
    desc: OpDesc,
    data: Result<HostData, CommError>,
    /// `(send_counts, recv_counts)` of an all-to-all-v: this rank's own, checked against its peers'.
    exchange: Option<(Vec<usize>, Vec<usize>)>,
}

/// What every rank of a completed round sees: each rank's input and, for an all-to-all-v, each rank's
/// `send_counts` (where its chunk for a given peer starts).
struct Round {
    data: Vec<HostData>,
    send_counts: Vec<Vec<usize>>,
}

type Outcome = Result<Arc<Round>, CommError>;

struct State {
    generation: u64,
    arrived: usize,
    slots: Vec<Option<Deposit>>,
    /// The result of the last completed generation; nobody can complete the next one before every rank
    /// has read this one, because every rank must arrive for it.
    outcome: Option<Outcome>,
    poisoned: Option<CommError>,
    departed: Vec<bool>,
    /// Ranks whose collective failed because of another rank (it left, panicked, rejected its
    /// arguments or did not arrive): their errors are consequences, not causes.
    saw_peer_failure: Vec<bool>,
}

struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, State>, CommError> {
        // The state lock is never held across user code, so poisoning means a bug here; report it.
        self.state
            .lock()
            .map_err(|_| CommError::Poisoned("thread group state lock poisoned".into()))
    }

    fn mark_peer_failure(&self, rank: usize) {
        if let Ok(mut st) = self.state.lock() {
            if let Some(flag) = st.saw_peer_failure.get_mut(rank) {
                *flag = true;
            }
        }
    }

    /// Which ranks saw a collective fail because of another rank.
    fn peer_failures(&self) -> Vec<bool> {
        self.state
            .lock()
            .map(|st| st.saw_peer_failure.clone())
            .unwrap_or_else(|_| vec![false; self.world_size])
    }

    fn poison(&self, err: CommError) {
        if let Ok(mut st) = self.state.lock() {
            if st.poisoned.is_none() {
                st.poisoned = Some(err);
            }
        }
        self.cv.notify_all();
    }

    /// One round of the barrier: deposit, wait for all ranks (or a failure), return all deposits.
    fn exchange(
        &self,
        rank: usize,
        desc: OpDesc,
        data: Result<HostData, CommError>,
        exchange: Option<(Vec<usize>, Vec<usize>)>,
    ) -> Result<Arc<Round>, CommError> {
        let mut st = self.lock()?;
        if let Some(e) = &st.poisoned {
            return Err(e.clone());
        }
        if st.slots[rank].is_some() {
            return Err(CommError::Poisoned(format!(
                "rank {rank} entered a collective twice at once (one communicator shared by two threads)"
            )));
        }
        let op_name = desc.to_string();
        st.slots[rank] = Some(Deposit {
            desc,
            data,
            exchange,
        });
        st.arrived += 1;
        let my_generation = st.generation;
        if st.arrived == self.world_size {
            let deposits: Vec<Deposit> = st.slots.iter_mut().filter_map(Option::take).collect();
            let outcome = combine_deposits(deposits);
            st.arrived = 0;
            st.generation += 1;
            st.outcome = Some(outcome.clone());
            drop(st);
            self.cv.notify_all();
            return outcome;
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            if st.generation != my_generation {
                return match &st.outcome {
                    Some(o) => o.clone(),
                    None => Err(CommError::Poisoned(
                        "collective finished without a result".into(),
                    )),
                };
            }
            if let Some(e) = &st.poisoned {
                return Err(e.clone());
            }
            let missing: Vec<usize> = (0..self.world_size)
                .filter(|&r| st.slots[r].is_none())
                .collect();
            let gone: Vec<usize> = missing
                .iter()
                .copied()
                .filter(|&r| st.departed[r])
                .collect();
            if !gone.is_empty() {
                let e = CommError::RankExited {
                    op: op_name,
                    ranks: gone,
                };
                st.poisoned = Some(e.clone());
                drop(st);
                self.cv.notify_all();
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                let e = CommError::Timeout {
                    op: op_name,
                    rank,
                    missing,
                    timeout: self.timeout,
                };
                st.poisoned = Some(e.clone());
                drop(st);
                self.cv.notify_all();
                return Err(e);
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .map_err(|_| CommError::Poisoned("thread group state lock poisoned".into()))?
                .0;
        }
    }
}

/// Checks that all ranks made the same call and none rejected its arguments; returns the data.
fn combine_deposits(deposits: Vec<Deposit>) -> Outcome {
    let first = deposits
        .first()
        .map(|d| d.desc.clone())
        .ok_or_else(|| CommError::Poisoned("empty collective round".into()))?;
    for (r, d) in deposits.iter().enumerate() {
        if let Err(e) = &d.data {
            return Err(CommError::PeerFailed {
                op: first.kind.name().to_string(),
                rank: r,
                detail: e.to_string(),
            });
        }
    }
    if let Some((r, d)) = deposits.iter().enumerate().find(|(_, d)| d.desc != first) {
        return Err(CommError::RankMismatch {
            op: first.kind.name().to_string(),
            detail: format!("rank 0 called `{first}` but rank {r} called `{}`", d.desc),
        });
    }
    let send_counts = if first.kind == CollectiveKind::AllToAllV {
        check_exchange_counts(&deposits)?
    } else {
        Vec::new()
    };
    let mut data = Vec::with_capacity(deposits.len());
    for d in deposits {
        data.push(d.data?);
    }
    Ok(Arc::new(Round { data, send_counts }))
}

/// Checks that what every rank of an all-to-all-v sends each peer is what that peer expects from it;
/// returns every rank's `send_counts`.
fn check_exchange_counts(deposits: &[Deposit]) -> Result<Vec<Vec<usize>>, CommError> {
    let op = CollectiveKind::AllToAllV.name().to_string();
    let n = deposits.len();
    let mut sends = Vec::with_capacity(n);
    let mut recvs = Vec::with_capacity(n);
    for (r, d) in deposits.iter().enumerate() {
        // validate() gave every rank one count per rank; anything else is a bug here, not a hang.
        match &d.exchange {
            Some((s, rc)) if s.len() == n && rc.len() == n => {
                sends.push(s.as_slice());
                recvs.push(rc.as_slice());
            }
            _ => {
                return Err(CommError::Poisoned(format!(
                    "rank {r} deposited no counts for {op}"
                )))
            }
        }
    }
    for (r, sent) in sends.iter().enumerate() {
        for (j, received) in recvs.iter().enumerate() {
            if sent[j] != received[r] {
                return Err(CommError::RankMismatch {
                    op,
                    detail: format!(
                        "rank {r} sends {} elements to rank {j} (send_counts[{j}]), but rank {j} \
                         expects {} from rank {r} (recv_counts[{r}])",
                        sent[j], received[r]
                    ),
                });
            }
        }
    }
    Ok(sends.into_iter().map(<[usize]>::to_vec).collect())
}

/// The most thread ranks one group may have: each rank is an OS thread of this process, and far
/// fewer already oversubscribe any machine (programs cap theirs by the cores).
pub const MAX_THREAD_RANKS: usize = 4096;

/// A group of thread ranks sharing one exchange.
pub struct ThreadGroup;

impl ThreadGroup {
    /// Creates the communicators of a group of `world_size` ranks (index = rank). Each must be moved to
    /// its own thread. `timeout` bounds every wait for other ranks.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: usize, timeout: Duration) -> Result<Vec<ThreadComm>, CommError> {
        if world_size == 0 {
            return Err(CommError::InvalidArgument {
                op: "ThreadGroup::new",
                detail: "world size must be at least 1".into(),
            });
        }
        if timeout.is_zero() {
            return Err(CommError::InvalidArgument {
                op: "ThreadGroup::new",
                detail: "timeout must be positive".into(),
            });
        }
        if world_size > MAX_THREAD_RANKS {
            return Err(CommError::InvalidArgument {
                op: "ThreadGroup::new",
                detail: format!(
                    "world size {world_size} exceeds the limit of {MAX_THREAD_RANKS} thread ranks"
                ),
            });
        }
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                generation: 0,
                arrived: 0,
                slots: (0..world_size).map(|_| None).collect(),
                outcome: None,
                poisoned: None,
                departed: vec![false; world_size],
                saw_peer_failure: vec![false; world_size],
            }),
            cv: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
                device: Device::Cpu,
            })
            .collect())
    }
}

/// One rank of a [`ThreadGroup`]. Dropping it tells the others this rank has left (collectives still
/// waiting for it fail at once); dropping it during a panic poisons the group.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    device: Device,
}

impl fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ThreadComm(rank {} of {})",
            self.rank, self.shared.world_size
        )
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.poison(CommError::RankPanicked {
                rank: self.rank,
                message: "panicked while holding its communicator".into(),
            });
        }
        if let Ok(mut st) = self.shared.state.lock() {
            st.departed[self.rank] = true;
        }
        self.shared.cv.notify_all();
    }
}

impl ThreadComm {
    /// The timeout of every wait.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Marks the group failed with `reason`: every rank's current and later collectives return it.
    pub fn poison(&self, reason: CommError) {
        self.shared.poison(reason);
    }

    fn run(&self, call: Collective<'_>) -> Result<(), CommError> {
        let n = self.shared.world_size;
        let desc = OpDesc::of(&call);
        let exchange = call
            .exchange_counts()
            .map(|(s, r)| (s.to_vec(), r.to_vec()));
        let deposit = call
            .validate_on_rank(self.rank, n)
            .and_then(|()| self.deposit_of(&call))
            .and_then(|d| check_recv_on_host(&call).map(|()| d));
        // A rank whose own arguments are wrong reports its own error; the others report it as a peer's.
        let own_error = deposit.as_ref().err().cloned();
        let data = self.shared.exchange(self.rank, desc, deposit, exchange);
        if let Some(e) = own_error {
            return Err(e);
        }
        let data = data.inspect_err(|_| self.shared.mark_peer_failure(self.rank))?;
        self.write_output(call, &data)
    }

    /// The copy of this rank's input that the other ranks need.
    fn deposit_of(&self, call: &Collective<'_>) -> Result<HostData, CommError> {
        let needs_input = match call.root() {
            Some(root) => root == self.rank,
            None => true,
        };
        if !needs_input {
            return Ok(HostData::None);
        }
        let send = call.send_buf();
        let what = "thread backend (send buffer must be on the CPU)";
        Ok(match send {
            SendBuf::F32(b) => HostData::F32(b.host(what)?.to_vec()),
            SendBuf::BF16(b) => HostData::BF16(b.host(what)?.to_vec()),
            SendBuf::F16(b) => HostData::F16(b.host(what)?.to_vec()),
            SendBuf::Bytes(b) | SendBuf::Fp8(b, _) => HostData::U8(b.host(what)?.to_vec()),
        })
    }

    fn write_output(&self, call: Collective<'_>, round: &Round) -> Result<(), CommError> {
        let rank = self.rank;
        let kind = call.kind();
        let op = call.op().unwrap_or(ReduceOp::Sum);
        let root = call.root().unwrap_or(0);
        let (send_len, _) = call.lengths();
        // All-gather-v and reduce-scatter-v: the shared counts; all-to-all-v: this rank's recv_counts.
        let counts = match call.exchange_counts() {
            Some((_, recv_counts)) => recv_counts,
            None => call.counts().unwrap_or(&[]),
        };
        let recv = call.into_recv_buf();
        let data = &round.data;
        let plan = Plan {
            kind,
            rank,
            root,
            send_len,
            counts,
            peer_send_counts: &round.send_counts,
        };
        match recv {
            RecvBuf::F32(b) => plan.apply(data, b, |a, x| f32::combine(op, a, x)),
            RecvBuf::BF16(b) => plan.apply(data, b, |a, x| bf16::combine(op, a, x)),
            RecvBuf::F16(b) => plan.apply(data, b, |a, x| f16::combine(op, a, x)),
            RecvBuf::Fp8(b, format) => {
                let table = ring::fp8_combine_table(format, op);
                plan.apply(data, b, |a, x| table[((a as usize) << 8) | x as usize])
            }
            // Reductions of bytes were rejected by validate(); this combine is never reached.
            RecvBuf::Bytes(b) => plan.apply(data, b, |a, _| a),
        }
    }
}

fn check_recv_on_host(call: &Collective<'_>) -> Result<(), CommError> {
    if call.recv_device().is_cuda() {
        return Err(CommError::Device(
            "thread backend: receive buffer must be on the CPU".into(),
        ));
    }
    Ok(())
}

/// How a rank turns the published deposits into its output.
struct Plan<'c> {
    kind: CollectiveKind,
    rank: usize,
    root: usize,
    send_len: usize,
    /// All-gather-v and reduce-scatter-v: every rank's count; all-to-all-v: this rank's `recv_counts`.
    counts: &'c [usize],
    /// All-to-all-v: every rank's `send_counts`.
    peer_send_counts: &'c [Vec<usize>],
}

/// `start..start + len` of `v`, or an error instead of a panic (validation makes this unreachable).
fn piece<T>(v: &[T], start: usize, len: usize) -> Result<&[T], CommError> {
    start
        .checked_add(len)
        .and_then(|end| v.get(start..end))
        .ok_or_else(|| CommError::Poisoned(format!("piece {start}+{len} outside {}", v.len())))
}

/// The mutable form of [`piece`].
fn piece_mut<T>(v: &mut [T], start: usize, len: usize) -> Result<&mut [T], CommError> {
    let have = v.len();
    start
        .checked_add(len)
        .and_then(|end| v.get_mut(start..end))
        .ok_or_else(|| CommError::Poisoned(format!("piece {start}+{len} outside {have}")))
}

impl Plan<'_> {
    fn apply<T: HostElem>(
        &self,
        data: &[HostData],
        out: &mut Buffer<T>,
        combine: impl Fn(T, T) -> T,
    ) -> Result<(), CommError> {
        let out = out.host_mut("thread backend (receive buffer must be on the CPU)")?;
        let n = data.len();
        let input = |r: usize| -> Result<&[T], CommError> {
            data.get(r).and_then(T::slice).ok_or_else(|| {
                CommError::Poisoned(format!("rank {r} deposited data of another type"))
            })
        };
        match self.kind {
            CollectiveKind::AllGather => {
                for r in 0..n {
                    out[r * self.send_len..(r + 1) * self.send_len].copy_from_slice(input(r)?);
                }
            }
            CollectiveKind::Broadcast => out.copy_from_slice(input(self.root)?),
            CollectiveKind::ReduceScatter => {
                let inputs = (0..n).map(input).collect::<Result<Vec<_>, _>>()?;
                let len = out.len();
                let range = self.rank * len..(self.rank + 1) * len;
                ring::reduce_chunk_with(&inputs, self.rank, range, out, combine);
            }
            CollectiveKind::AllReduce => {
                let inputs = (0..n).map(input).collect::<Result<Vec<_>, _>>()?;
                let len = out.len();
                for c in 0..n {
                    let range = ring::chunk_range(len, n, c);
                    let dst = &mut out[range.clone()];
                    ring::reduce_chunk_with(&inputs, c, range, dst, &combine);
                }
            }
            CollectiveKind::AllToAll => {
                // validate() checked that the length splits into n chunks on every rank.
                let chunk = out.len() / n;
                let mine = self.rank * chunk..(self.rank + 1) * chunk;
                for (j, dst) in out.chunks_exact_mut(chunk.max(1)).enumerate() {
                    dst.copy_from_slice(&input(j)?[mine.clone()]);
                }
            }
            CollectiveKind::AllGatherV => {
                let mut offset = 0;
                for (r, &count) in self.counts.iter().enumerate() {
                    piece_mut(out, offset, count)?.copy_from_slice(piece(input(r)?, 0, count)?);
                    offset += count;
                }
            }
            CollectiveKind::ReduceScatterV => {
                let inputs = (0..n).map(input).collect::<Result<Vec<_>, _>>()?;
                let offset: usize = self.counts.iter().take(self.rank).sum();
                let count = out.len();
                for x in &inputs {
                    piece(x, offset, count)?;
                }
                // The ring order of chunk `rank`, as the even reduce-scatter; NCCL's per-root reduction
                // may add in another order (the float sums agree to rounding).
                ring::reduce_chunk_with(&inputs, self.rank, offset..offset + count, out, combine);
            }
            CollectiveKind::AllToAllV => {
                let mut offset = 0;
                for (j, &count) in self.counts.iter().enumerate() {
                    // Where rank j's chunk for this rank starts in its send buffer.
                    let peer = self.peer_send_counts.get(j).ok_or_else(|| {
                        CommError::Poisoned(format!("no send_counts of rank {j}"))
                    })?;
                    let start: usize = peer.iter().take(self.rank).sum();
                    piece_mut(out, offset, count)?.copy_from_slice(piece(input(j)?, start, count)?);
                    offset += count;
                }
            }
            CollectiveKind::Barrier => {}
        }
        Ok(())
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.shared
            .exchange(self.rank, OpDesc::barrier(), Ok(HostData::None), None)
            .map(|_| ())
            .inspect_err(|_| self.shared.mark_peer_failure(self.rank))
    }

    fn start(&self, call: Collective<'_>) -> Result<CommWork, CommError> {
        self.run(call)?;
        Ok(CommWork::completed())
    }

    fn note_failure_caused_by_peer(&self) {
        self.shared.mark_peer_failure(self.rank);
    }
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

/// Runs `f` on `world_size` rank threads (scoped, so `f` may borrow) and returns every rank's result,
/// in rank order. A rank that panics becomes [`CommError::RankPanicked`] on that rank and poisons the
/// group, so the other ranks' collectives fail instead of hanging.
///
/// Fails only if the group or a thread cannot be created.
pub fn run_ranks_each<R, E, F>(
    world_size: usize,
    timeout: Duration,
    f: F,
) -> Result<Vec<Result<R, E>>, CommError>
where
    F: Fn(ThreadComm) -> Result<R, E> + Sync,
    R: Send,
    E: From<CommError> + Send,
{
    run_ranks_flagged(world_size, timeout, f).map(|(results, _)| results)
}

/// Every rank's result, and whether each rank saw a collective fail because of another rank.
type FlaggedResults<R, E> = (Vec<Result<R, E>>, Vec<bool>);

/// [`run_ranks_each`], with which ranks saw a collective fail because of another rank.
fn run_ranks_flagged<R, E, F>(
    world_size: usize,
    timeout: Duration,
    f: F,
) -> Result<FlaggedResults<R, E>, CommError>
where
    F: Fn(ThreadComm) -> Result<R, E> + Sync,
    R: Send,
    E: From<CommError> + Send,
{
    let comms = ThreadGroup::new(world_size, timeout)?;
    let group = comms
        .first()
        .map(|c| c.shared.clone())
        .ok_or_else(|| CommError::Poisoned("empty thread group".into()))?;
    let f = &f;
    let results = std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(world_size);
        for comm in comms {
            let rank = comm.rank;
            let shared = comm.shared.clone();
            let shared_for_thread = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(scope, move || {
                    match catch_unwind(AssertUnwindSafe(|| f(comm))) {
                        Ok(r) => r,
                        Err(p) => {
                            let e = CommError::RankPanicked {
                                rank,
                                message: panic_message(p.as_ref()),
                            };
                            shared_for_thread.poison(e.clone());
                            Err(E::from(e))
                        }
                    }
                });
            match handle {
                Ok(h) => handles.push(h),
                Err(e) => {
                    shared.poison(CommError::io("spawning a rank thread", e));
                    // Threads already started see the poison and return; scope joins them.
                    return Err(CommError::Launch(format!(
                        "could not spawn the thread of rank {rank}"
                    )));
                }
            }
        }
        Ok(handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|p| {
                    Err(E::from(CommError::RankPanicked {
                        rank,
                        message: panic_message(p.as_ref()),
                    }))
                })
            })
            .collect())
    })?;
    Ok((results, group.peer_failures()))
}

/// Every failed rank's error, the cause first: what [`run_ranks_failures`] returns.
#[derive(Debug)]
pub struct RankFailures<E> {
    /// The rank whose error is the cause.
    pub rank: usize,
    /// Its error.
    pub error: E,
    /// The other failed ranks' errors, in rank order: consequences of the cause (a peer left, the group
    /// was poisoned, a peer rejected its arguments or did not arrive), or independent failures.
    pub others: Vec<(usize, E)>,
}

impl<E: fmt::Display> fmt::Display for RankFailures<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.error)?;
        for (r, e) in &self.others {
            write!(f, "; then rank {r}: {e}")?;
        }
        Ok(())
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for RankFailures<E> {}

/// Like [`run_ranks_each`] with an explicit timeout, but returns all results or one error: the error
/// of the cause (see [`run_ranks_failures`]).
pub fn run_ranks_timeout<R, E, F>(world_size: usize, timeout: Duration, f: F) -> Result<Vec<R>, E>
where
    F: Fn(ThreadComm) -> Result<R, E> + Sync,
    R: Send,
    E: From<CommError> + Send,
{
    run_ranks_failures(world_size, timeout, f).map_err(|failures| failures.error)
}

/// Like [`run_ranks_timeout`], but a failure keeps every failed rank's error, the cause first.
///
/// The cause is the first rank that panicked if any; else, among the ranks whose error did not come
/// from a collective failing because of another rank (a peer that left, panicked, rejected its
/// arguments or did not arrive) and that did not say their failure was another rank's
/// ([`Communicator::note_failure_caused_by_peer`]), the one that returned first; else the rank that
/// returned first.
/// So when rank 0 fails alone (a bad path, say) and rank 1 then finds it gone, rank 0's error is the
/// one reported, whichever thread returns first.
pub fn run_ranks_failures<R, E, F>(
    world_size: usize,
    timeout: Duration,
    f: F,
) -> Result<Vec<R>, RankFailures<E>>
where
    F: Fn(ThreadComm) -> Result<R, E> + Sync,
    R: Send,
    E: From<CommError> + Send,
{
    // Completion order of failing ranks, to pick the first of several independent failures.
    let seq = AtomicUsize::new(0);
    let panicked = Mutex::new(Vec::new());
    let run = run_ranks_flagged(world_size, timeout, |comm| {
        let rank = comm.rank;
        let r = catch_unwind(AssertUnwindSafe(|| f(comm)));
        let r = match r {
            Ok(r) => r,
            Err(p) => {
                if let Ok(mut v) = panicked.lock() {
                    v.push(rank);
                }
                std::panic::resume_unwind(p)
            }
        };
        let order = seq.fetch_add(1, Ordering::SeqCst);
        r.map_err(|err| Ordered { order, err })
    });
    let (results, saw_peer_failure) = match run {
        Ok(v) => v,
        Err(e) => {
            return Err(RankFailures {
                rank: 0,
                error: E::from(e),
                others: Vec::new(),
            })
        }
    };
    let first_panic = panicked.lock().ok().and_then(|v| v.iter().min().copied());
    let mut values = Vec::with_capacity(world_size);
    let mut failed: Vec<(usize, usize, E)> = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => values.push(v),
            Err(Ordered { order, err }) => failed.push((rank, order, err)),
        }
    }
    // Rank of the cause: a panic, else the first own failure, else the first failure.
    let cause = first_panic
        .filter(|p| failed.iter().any(|(r, _, _)| r == p))
        .or_else(|| {
            failed
                .iter()
                .filter(|(r, _, _)| !saw_peer_failure.get(*r).copied().unwrap_or(false))
                .min_by_key(|(_, o, _)| *o)
                .map(|(r, _, _)| *r)
        })
        .or_else(|| failed.iter().min_by_key(|(_, o, _)| *o).map(|(r, _, _)| *r));
    let Some(cause) = cause else {
        return Ok(values);
    };
    let mut error = None;
    let mut others = Vec::new();
    for (rank, _, err) in failed {
        if rank == cause {
            error = Some(err);
        } else {
            others.push((rank, err));
        }
    }
    match error {
        Some(error) => Err(RankFailures {
            rank: cause,
            error,
            others,
        }),
        // The cause is one of the failed ranks by construction; keep an error if that ever breaks.
        None => Err(RankFailures {
            rank: cause,
            error: E::from(CommError::Poisoned(format!(
                "rank {cause} failed without an error"
            ))),
            others,
        }),
    }
}

/// Runs `f` on `world_size` rank threads with [`DEFAULT_THREAD_TIMEOUT`]; see [`run_ranks_timeout`].
pub fn run_ranks<R, E, F>(world_size: usize, f: F) -> Result<Vec<R>, E>
where
    F: Fn(ThreadComm) -> Result<R, E> + Sync,
    R: Send,
    E: From<CommError> + Send,
{
    run_ranks_timeout(world_size, DEFAULT_THREAD_TIMEOUT, f)
}

/// A rank's error tagged with the order in which ranks failed.
struct Ordered<E> {
    order: usize,
    err: E,
}

impl<E: From<CommError>> From<CommError> for Ordered<E> {
    fn from(e: CommError) -> Self {
        // Errors made by run_ranks_flagged itself (a panicking rank) sort last; panics are picked apart.
        Ordered {
            order: usize::MAX,
            err: E::from(e),
        }
    }
}
