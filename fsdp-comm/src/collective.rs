//! The collective interface shared by both backends: element types, buffer views, the [`Communicator`]
//! trait and the [`CommWork`] handle of an issued collective.
//!
//! Layouts (the same on every backend):
//! - all-gather: `recv` is the concatenation of every rank's `send`, in rank order
//!   (`recv.len() == world_size * send.len()`);
//! - reduce-scatter: `send` is `world_size` equal chunks; rank `r` receives the reduction of chunk `r`
//!   (`send.len() == world_size * recv.len()`; a length not divisible by the world size is an error,
//!   callers pad);
//! - all-reduce: `recv` (same length as `send`) is the element-wise reduction over ranks;
//! - broadcast: every rank's `recv` receives the root's `send` (only the root's `send` is read, but every
//!   rank passes one of the same length);
//! - all-to-all: `send` and `recv` are `world_size` equal chunks; chunk `j` of rank `r`'s `send` lands in
//!   chunk `r` of rank `j`'s `recv` (`send.len() == recv.len()`, divisible by the world size; callers
//!   pad). No arithmetic, so every element type moves, FP8 codes and bytes included.
//!
//! Variable-count ("v") forms, for uneven shards (some ranks may hold none). `counts` has one entry per
//! rank and is the same on every rank; `offset(r) = sum(counts[..r])`:
//! - all-gather-v: rank `r`'s `send` has `counts[r]` elements; `recv` (`sum(counts)` elements) is every
//!   rank's `send` concatenated in rank order;
//! - reduce-scatter-v: `send` has `sum(counts)` elements on every rank; rank `r`'s `recv` (`counts[r]`
//!   elements) is the reduction over ranks of `send[offset(r)..offset(r) + counts[r]]`. F32, BF16 and
//!   F16 only: FP8 sums are refused (see [`Collective::ReduceScatterV`]);
//! - all-to-all-v: `send_counts` and `recv_counts` are this rank's own (they differ by rank). Chunk `j`
//!   of `send` (`send_counts[j]` elements, chunks consecutive in peer order) goes to rank `j`; chunk `j`
//!   of `recv` (`recv_counts[j]` elements) comes from rank `j`. Rank `r`'s `send_counts[j]` must equal
//!   rank `j`'s `recv_counts[r]`: thread ranks check it on every rank; NCCL cannot without an extra
//!   exchange, so there it is the caller's contract (a mismatch ends in the watchdog's timeout).
//!
//! Every length, every `counts` length and every overflowing sum of counts is an error before any data
//! moves.

use crate::error::CommError;
use fp8_core::Fp8Format;
use fp8_kernels::{Buffer, CudaDevice, Device, GpuEvent};
use half::{bf16, f16};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A reduction. There is deliberately no average: NCCL's `Avg` on FP8 premultiplies by a factor stored in
/// FP8 (1/3 becomes 0.34375); callers sum and fold `1/world_size` into their own scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (rounded per step, in ring order: see [`crate::ring`]).
    Sum,
    /// Maximum; a NaN loses against a number (like `fmaxf` and NCCL).
    Max,
    /// Minimum; a NaN loses against a number.
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

/// What the elements of a collective are. FP8 payloads live in `Buffer<u8>`; the format says how to add
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommDType {
    /// 32-bit float.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
    /// Opaque bytes: gather and broadcast only.
    Bytes,
    /// FP8 codes of the given format: gather, broadcast and reductions.
    Fp8(Fp8Format),
}

impl CommDType {
    /// Whether reductions are defined for this type.
    pub fn reducible(self) -> bool {
        !matches!(self, CommDType::Bytes)
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            CommDType::F32 => 4,
            CommDType::BF16 | CommDType::F16 => 2,
            CommDType::Bytes | CommDType::Fp8(_) => 1,
        }
    }
}

impl fmt::Display for CommDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommDType::F32 => f.write_str("f32"),
            CommDType::BF16 => f.write_str("bf16"),
            CommDType::F16 => f.write_str("f16"),
            CommDType::Bytes => f.write_str("bytes"),
            CommDType::Fp8(Fp8Format::E4M3) => f.write_str("fp8-e4m3"),
            CommDType::Fp8(Fp8Format::E5M2) => f.write_str("fp8-e5m2"),
        }
    }
}

/// A buffer a collective reads, tagged with its element type.
#[derive(Debug, Clone, Copy)]
pub enum SendBuf<'a> {
    /// f32 elements.
    F32(&'a Buffer<f32>),
    /// bf16 elements.
    BF16(&'a Buffer<bf16>),
    /// f16 elements.
    F16(&'a Buffer<f16>),
    /// Opaque bytes.
    Bytes(&'a Buffer<u8>),
    /// FP8 codes of a format.
    Fp8(&'a Buffer<u8>, Fp8Format),
}

/// A buffer a collective writes, tagged with its element type.
#[derive(Debug)]
pub enum RecvBuf<'a> {
    /// f32 elements.
    F32(&'a mut Buffer<f32>),
    /// bf16 elements.
    BF16(&'a mut Buffer<bf16>),
    /// f16 elements.
    F16(&'a mut Buffer<f16>),
    /// Opaque bytes.
    Bytes(&'a mut Buffer<u8>),
    /// FP8 codes of a format.
    Fp8(&'a mut Buffer<u8>, Fp8Format),
}

macro_rules! buf_from {
    ($t:ty, $v:ident) => {
        impl<'a> From<&'a Buffer<$t>> for SendBuf<'a> {
            fn from(b: &'a Buffer<$t>) -> Self {
                SendBuf::$v(b)
            }
        }
        impl<'a> From<&'a mut Buffer<$t>> for RecvBuf<'a> {
            fn from(b: &'a mut Buffer<$t>) -> Self {
                RecvBuf::$v(b)
            }
        }
    };
}
buf_from!(f32, F32);
buf_from!(bf16, BF16);
buf_from!(f16, F16);
buf_from!(u8, Bytes);

impl<'a> SendBuf<'a> {
    /// FP8 codes of `format` (a plain `&Buffer<u8>` converts to opaque bytes instead).
    pub fn fp8(buf: &'a Buffer<u8>, format: Fp8Format) -> Self {
        SendBuf::Fp8(buf, format)
    }

    /// The element type.
    pub fn dtype(&self) -> CommDType {
        match self {
            SendBuf::F32(_) => CommDType::F32,
            SendBuf::BF16(_) => CommDType::BF16,
            SendBuf::F16(_) => CommDType::F16,
            SendBuf::Bytes(_) => CommDType::Bytes,
            SendBuf::Fp8(_, f) => CommDType::Fp8(*f),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            SendBuf::F32(b) => b.len(),
            SendBuf::BF16(b) => b.len(),
            SendBuf::F16(b) => b.len(),
            SendBuf::Bytes(b) | SendBuf::Fp8(b, _) => b.len(),
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the buffer lives.
    pub fn device(&self) -> Device {
        match self {
            SendBuf::F32(b) => b.device(),
            SendBuf::BF16(b) => b.device(),
            SendBuf::F16(b) => b.device(),
            SendBuf::Bytes(b) | SendBuf::Fp8(b, _) => b.device(),
        }
    }
}

impl<'a> RecvBuf<'a> {
    /// FP8 codes of `format` (a plain `&mut Buffer<u8>` converts to opaque bytes instead).
    pub fn fp8(buf: &'a mut Buffer<u8>, format: Fp8Format) -> Self {
        RecvBuf::Fp8(buf, format)
    }

    /// The element type.
    pub fn dtype(&self) -> CommDType {
        match self {
            RecvBuf::F32(_) => CommDType::F32,
            RecvBuf::BF16(_) => CommDType::BF16,
            RecvBuf::F16(_) => CommDType::F16,
            RecvBuf::Bytes(_) => CommDType::Bytes,
            RecvBuf::Fp8(_, f) => CommDType::Fp8(*f),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            RecvBuf::F32(b) => b.len(),
            RecvBuf::BF16(b) => b.len(),
            RecvBuf::F16(b) => b.len(),
            RecvBuf::Bytes(b) | RecvBuf::Fp8(b, _) => b.len(),
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the buffer lives.
    pub fn device(&self) -> Device {
        match self {
            RecvBuf::F32(b) => b.device(),
            RecvBuf::BF16(b) => b.device(),
            RecvBuf::F16(b) => b.device(),
            RecvBuf::Bytes(b) | RecvBuf::Fp8(b, _) => b.device(),
        }
    }

    /// A read-only view of the same buffer (for in-place collectives).
    pub fn as_send(&self) -> SendBuf<'_> {
        match self {
            RecvBuf::F32(b) => SendBuf::F32(b),
            RecvBuf::BF16(b) => SendBuf::BF16(b),
            RecvBuf::F16(b) => SendBuf::F16(b),
            RecvBuf::Bytes(b) => SendBuf::Bytes(b),
            RecvBuf::Fp8(b, f) => SendBuf::Fp8(b, *f),
        }
    }
}

/// One collective call, as a value: what backends implement ([`Communicator::start`]).
#[derive(Debug)]
pub enum Collective<'a> {
    /// All-gather (see the module docs for the layout).
    AllGather {
        /// This rank's shard.
        send: SendBuf<'a>,
        /// `world_size * send.len()` elements.
        recv: RecvBuf<'a>,
    },
    /// Reduce-scatter.
    ReduceScatter {
        /// `world_size * recv.len()` elements.
        send: SendBuf<'a>,
        /// This rank's reduced chunk.
        recv: RecvBuf<'a>,
        /// The reduction.
        op: ReduceOp,
    },
    /// All-reduce, out of place.
    AllReduce {
        /// Input.
        send: SendBuf<'a>,
        /// Output, same length.
        recv: RecvBuf<'a>,
        /// The reduction.
        op: ReduceOp,
    },
    /// All-reduce, in place.
    AllReduceInPlace {
        /// Input and output.
        buf: RecvBuf<'a>,
        /// The reduction.
        op: ReduceOp,
    },
    /// Broadcast, out of place.
    Broadcast {
        /// Read on the root only; same length as `recv` on every rank.
        send: SendBuf<'a>,
        /// Receives the root's data.
        recv: RecvBuf<'a>,
        /// The source rank.
        root: usize,
    },
    /// Broadcast, in place: the root's buffer is the source.
    BroadcastInPlace {
        /// Source on the root, destination elsewhere.
        buf: RecvBuf<'a>,
        /// The source rank.
        root: usize,
    },
    /// All-to-all (see the module docs for the layout).
    AllToAll {
        /// `world_size` chunks, chunk `j` for rank `j`.
        send: SendBuf<'a>,
        /// Same length: chunk `j` from rank `j`.
        recv: RecvBuf<'a>,
    },
    /// All-gather of uneven shards (see the module docs for the layout).
    AllGatherV {
        /// This rank's shard: `counts[rank]` elements.
        send: SendBuf<'a>,
        /// `sum(counts)` elements: every rank's shard, in rank order.
        recv: RecvBuf<'a>,
        /// Elements of each rank's shard, one entry per rank, the same on every rank.
        counts: &'a [usize],
    },
    /// Reduce-scatter into uneven shards. Not for FP8: the FP8 [`Collective::ReduceScatter`] emulates
    /// NCCL's ring order on thread ranks, while NCCL runs this one as one reduction per root, whose
    /// order and per-step rounding the thread backend could not match.
    ReduceScatterV {
        /// `sum(counts)` elements.
        send: SendBuf<'a>,
        /// This rank's reduced shard: `counts[rank]` elements.
        recv: RecvBuf<'a>,
        /// Elements of each rank's shard, one entry per rank, the same on every rank.
        counts: &'a [usize],
        /// The reduction.
        op: ReduceOp,
    },
    /// All-to-all with a count per peer (see the module docs for the layout).
    AllToAllV {
        /// `sum(send_counts)` elements: chunk `j` (`send_counts[j]` elements) for rank `j`.
        send: SendBuf<'a>,
        /// Elements this rank sends to each rank, one entry per rank.
        send_counts: &'a [usize],
        /// `sum(recv_counts)` elements: chunk `j` (`recv_counts[j]` elements) from rank `j`.
        recv: RecvBuf<'a>,
        /// Elements this rank receives from each rank, one entry per rank.
        recv_counts: &'a [usize],
    },
}

/// The kind of a collective, for messages and cross-rank checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-reduce (either form).
    AllReduce,
    /// Broadcast (either form).
    Broadcast,
    /// Barrier.
    Barrier,
    /// All-to-all.
    AllToAll,
    /// All-gather of uneven shards.
    AllGatherV,
    /// Reduce-scatter into uneven shards.
    ReduceScatterV,
    /// All-to-all with a count per peer.
    AllToAllV,
}

impl CollectiveKind {
    /// The operation's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::AllGatherV => "all_gather_v",
            CollectiveKind::ReduceScatterV => "reduce_scatter_v",
            CollectiveKind::AllToAllV => "all_to_all_v",
        }
    }
}

impl<'a> Collective<'a> {
    /// The kind of the call.
    pub fn kind(&self) -> CollectiveKind {
        match self {
            Collective::AllGather { .. } => CollectiveKind::AllGather,
            Collective::ReduceScatter { .. } => CollectiveKind::ReduceScatter,
            Collective::AllReduce { .. } | Collective::AllReduceInPlace { .. } => {
                CollectiveKind::AllReduce
            }
            Collective::Broadcast { .. } | Collective::BroadcastInPlace { .. } => {
                CollectiveKind::Broadcast
            }
            Collective::AllToAll { .. } => CollectiveKind::AllToAll,
            Collective::AllGatherV { .. } => CollectiveKind::AllGatherV,
            Collective::ReduceScatterV { .. } => CollectiveKind::ReduceScatterV,
            Collective::AllToAllV { .. } => CollectiveKind::AllToAllV,
        }
    }

    /// The element type (of the receive buffer; send types are checked to match).
    pub fn dtype(&self) -> CommDType {
        match self {
            Collective::AllGather { recv, .. }
            | Collective::ReduceScatter { recv, .. }
            | Collective::AllReduce { recv, .. }
            | Collective::Broadcast { recv, .. }
            | Collective::AllToAll { recv, .. }
            | Collective::AllGatherV { recv, .. }
            | Collective::ReduceScatterV { recv, .. }
            | Collective::AllToAllV { recv, .. } => recv.dtype(),
            Collective::AllReduceInPlace { buf, .. } | Collective::BroadcastInPlace { buf, .. } => {
                buf.dtype()
            }
        }
    }

    /// The reduction, if any.
    pub fn op(&self) -> Option<ReduceOp> {
        match self {
            Collective::ReduceScatter { op, .. }
            | Collective::ReduceScatterV { op, .. }
            | Collective::AllReduce { op, .. }
            | Collective::AllReduceInPlace { op, .. } => Some(*op),
            _ => None,
        }
    }

    /// The root rank of a broadcast.
    pub fn root(&self) -> Option<usize> {
        match self {
            Collective::Broadcast { root, .. } | Collective::BroadcastInPlace { root, .. } => {
                Some(*root)
            }
            _ => None,
        }
    }

    /// `(send length, receive length)`.
    pub fn lengths(&self) -> (usize, usize) {
        match self {
            Collective::AllGather { send, recv }
            | Collective::ReduceScatter { send, recv, .. }
            | Collective::AllReduce { send, recv, .. }
            | Collective::Broadcast { send, recv, .. }
            | Collective::AllToAll { send, recv }
            | Collective::AllGatherV { send, recv, .. }
            | Collective::ReduceScatterV { send, recv, .. }
            | Collective::AllToAllV { send, recv, .. } => (send.len(), recv.len()),
            Collective::AllReduceInPlace { buf, .. } | Collective::BroadcastInPlace { buf, .. } => {
                (buf.len(), buf.len())
            }
        }
    }

    /// The per-rank counts of an all-gather-v or reduce-scatter-v (the same on every rank).
    pub fn counts(&self) -> Option<&'a [usize]> {
        match self {
            Collective::AllGatherV { counts, .. } | Collective::ReduceScatterV { counts, .. } => {
                Some(counts)
            }
            _ => None,
        }
    }

    /// `(send_counts, recv_counts)` of an all-to-all-v (this rank's own).
    pub fn exchange_counts(&self) -> Option<(&'a [usize], &'a [usize])> {
        match self {
            Collective::AllToAllV {
                send_counts,
                recv_counts,
                ..
            } => Some((send_counts, recv_counts)),
            _ => None,
        }
    }

    /// The send buffer (in-place forms: their one buffer).
    pub(crate) fn send_buf(&self) -> SendBuf<'_> {
        match self {
            Collective::AllGather { send, .. }
            | Collective::ReduceScatter { send, .. }
            | Collective::AllReduce { send, .. }
            | Collective::Broadcast { send, .. }
            | Collective::AllToAll { send, .. }
            | Collective::AllGatherV { send, .. }
            | Collective::ReduceScatterV { send, .. }
            | Collective::AllToAllV { send, .. } => *send,
            Collective::AllReduceInPlace { buf, .. } | Collective::BroadcastInPlace { buf, .. } => {
                buf.as_send()
            }
        }
    }

    /// The receive buffer (in-place forms: their one buffer).
    pub(crate) fn into_recv_buf(self) -> RecvBuf<'a> {
        match self {
            Collective::AllGather { recv, .. }
            | Collective::ReduceScatter { recv, .. }
            | Collective::AllReduce { recv, .. }
            | Collective::Broadcast { recv, .. }
            | Collective::AllToAll { recv, .. }
            | Collective::AllGatherV { recv, .. }
            | Collective::ReduceScatterV { recv, .. }
            | Collective::AllToAllV { recv, .. } => recv,
            Collective::AllReduceInPlace { buf, .. } | Collective::BroadcastInPlace { buf, .. } => {
                buf
            }
        }
    }

    /// Where the receive buffer lives.
    pub(crate) fn recv_device(&self) -> Device {
        match self {
            Collective::AllGather { recv, .. }
            | Collective::ReduceScatter { recv, .. }
            | Collective::AllReduce { recv, .. }
            | Collective::Broadcast { recv, .. }
            | Collective::AllToAll { recv, .. }
            | Collective::AllGatherV { recv, .. }
            | Collective::ReduceScatterV { recv, .. }
            | Collective::AllToAllV { recv, .. } => recv.device(),
            Collective::AllReduceInPlace { buf, .. } | Collective::BroadcastInPlace { buf, .. } => {
                buf.device()
            }
        }
    }

    /// Checks types, sizes, the root and the reduction against `world_size`, before any data moves:
    /// everything that is the same on every rank of a correct call. The rank's own lengths of the "v"
    /// forms (its shard, its self-exchange) are checked by [`Collective::validate_on_rank`], which the
    /// backends call.
    pub fn validate(&self, world_size: usize) -> Result<(), CommError> {
        let op_name = self.kind().name();
        let send_dtype = self.send_buf().dtype();
        let dtype = self.dtype();
        if send_dtype != dtype {
            return Err(CommError::DTypeMismatch {
                op: op_name,
                send: send_dtype.to_string(),
                recv: dtype.to_string(),
            });
        }
        if self.op().is_some() && !dtype.reducible() {
            return Err(CommError::Unsupported {
                op: op_name,
                dtype: dtype.to_string(),
                why: "bytes have no arithmetic; pass FP8 payloads with their format".into(),
            });
        }
        if self.kind() == CollectiveKind::ReduceScatterV && matches!(dtype, CommDType::Fp8(_)) {
            return Err(CommError::Unsupported {
                op: op_name,
                dtype: dtype.to_string(),
                why: "FP8 sums round at every step, and the thread backend emulates NCCL's ring \
                      reduce-scatter, not the per-root reductions NCCL runs for uneven shards; reduce \
                      in BF16 or F32, or pad the shards to equal lengths and use reduce_scatter"
                    .into(),
            });
        }
        if let Some(root) = self.root() {
            if root >= world_size {
                return Err(CommError::InvalidArgument {
                    op: op_name,
                    detail: format!("root rank {root} is not below the world size {world_size}"),
                });
            }
        }
        let (s, r) = self.lengths();
        let required = |what, expected: Option<usize>, actual| match expected {
            Some(e) if e == actual => Ok(()),
            Some(e) => Err(CommError::LengthMismatch {
                op: op_name,
                what,
                expected: e,
                actual,
            }),
            None => Err(CommError::InvalidArgument {
                op: op_name,
                detail: format!("{s} elements times world size {world_size} overflows"),
            }),
        };
        match self {
            Collective::AllGatherV { counts, .. } => {
                let total = counts_total(op_name, "counts (one per rank)", counts, world_size)?;
                required("receive buffer (sum of counts)", Some(total), r)
            }
            Collective::ReduceScatterV { counts, .. } => {
                let total = counts_total(op_name, "counts (one per rank)", counts, world_size)?;
                required("send buffer (sum of counts)", Some(total), s)
            }
            Collective::AllToAllV {
                send_counts,
                recv_counts,
                ..
            } => {
                let sent = counts_total(
                    op_name,
                    "send_counts (one per rank)",
                    send_counts,
                    world_size,
                )?;
                let received = counts_total(
                    op_name,
                    "recv_counts (one per rank)",
                    recv_counts,
                    world_size,
                )?;
                required("send buffer (sum of send_counts)", Some(sent), s)?;
                required("receive buffer (sum of recv_counts)", Some(received), r)
            }
            _ => match self.kind() {
                CollectiveKind::AllGather => required(
                    "receive buffer (world_size x send length)",
                    s.checked_mul(world_size),
                    r,
                ),
                CollectiveKind::ReduceScatter => required(
                    "send buffer (world_size x receive length)",
                    r.checked_mul(world_size),
                    s,
                ),
                CollectiveKind::AllToAll => {
                    required("receive buffer (send length)", Some(s), r)?;
                    if world_size == 0 || s % world_size != 0 {
                        return Err(CommError::NotDivisible {
                            op: op_name,
                            what: "send and receive buffers",
                            len: s,
                            world_size,
                        });
                    }
                    Ok(())
                }
                _ => required("receive buffer (send length)", Some(s), r),
            },
        }
    }

    /// [`Collective::validate`], then what depends on the calling rank: the "v" forms' own lengths
    /// (all-gather-v: `send` has `counts[rank]` elements; reduce-scatter-v: `recv` has `counts[rank]`;
    /// all-to-all-v: what this rank sends itself equals what it receives from itself).
    pub fn validate_on_rank(&self, rank: usize, world_size: usize) -> Result<(), CommError> {
        let op_name = self.kind().name();
        if rank >= world_size {
            return Err(CommError::InvalidArgument {
                op: op_name,
                detail: format!("rank {rank} is not below the world size {world_size}"),
            });
        }
        self.validate(world_size)?;
        let (s, r) = self.lengths();
        let own = |what, counts: &[usize], actual| match counts.get(rank) {
            Some(&expected) if expected == actual => Ok(()),
            Some(&expected) => Err(CommError::LengthMismatch {
                op: op_name,
                what,
                expected,
                actual,
            }),
            // validate() checked that there is one count per rank.
            None => Err(CommError::InvalidArgument {
                op: op_name,
                detail: format!("no count for rank {rank}"),
            }),
        };
        match self {
            Collective::AllGatherV { counts, .. } => own("send buffer (counts[rank])", counts, s),
            Collective::ReduceScatterV { counts, .. } => {
                own("receive buffer (counts[rank])", counts, r)
            }
            Collective::AllToAllV {
                send_counts,
                recv_counts,
                ..
            } => match (send_counts.get(rank), recv_counts.get(rank)) {
                (Some(&sent), Some(&received)) if sent != received => {
                    Err(CommError::LengthMismatch {
                        op: op_name,
                        what: "recv_counts[rank] (this rank's exchange with itself: \
                                   send_counts[rank])",
                        expected: sent,
                        actual: received,
                    })
                }
                _ => Ok(()),
            },
            _ => Ok(()),
        }
    }
}

/// The sum of a "v" collective's counts (`what` names them, "counts (one per rank)"), after checking
/// there is one per rank.
fn counts_total(
    op: &'static str,
    what: &'static str,
    counts: &[usize],
    world_size: usize,
) -> Result<usize, CommError> {
    if counts.len() != world_size {
        return Err(CommError::LengthMismatch {
            op,
            what,
            expected: world_size,
            actual: counts.len(),
        });
    }
    counts
        .iter()
        .try_fold(0usize, |acc, &c| acc.checked_add(c))
        .ok_or_else(|| CommError::InvalidArgument {
            op,
            detail: format!("the sum of {what} overflows"),
        })
}

/// The host-side state of a failure that later waits must report (shared with NCCL watchdogs).
pub(crate) type FailureFlag = Arc<Mutex<Option<CommError>>>;

/// A collective that has been issued. On the CPU it has already completed; on CUDA it is queued on the
/// communication stream and this handle holds the event that marks its end.
#[must_use = "wait on the work (or drop it after ordering the streams yourself)"]
pub struct CommWork {
    inner: WorkInner,
}

enum WorkInner {
    Done,
    Cuda {
        event: GpuEvent,
        device: CudaDevice,
        failure: FailureFlag,
        op: &'static str,
    },
}

impl fmt::Debug for CommWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            WorkInner::Done => f.write_str("CommWork(done)"),
            WorkInner::Cuda { op, .. } => write!(f, "CommWork({op} on CUDA)"),
        }
    }
}

impl CommWork {
    /// Work that has already completed (CPU backends).
    pub fn completed() -> Self {
        CommWork {
            inner: WorkInner::Done,
        }
    }

    /// Work queued on a CUDA communication stream, ending at `event`.
    pub(crate) fn cuda(
        event: GpuEvent,
        device: CudaDevice,
        failure: FailureFlag,
        op: &'static str,
    ) -> Self {
        CommWork {
            inner: WorkInner::Cuda {
                event,
                device,
                failure,
                op,
            },
        }
    }

    /// Orders the device's compute stream after this collective, without blocking the host: kernels
    /// queued on the compute stream afterwards see its result. A no-op on the CPU.
    pub fn wait(self) -> Result<(), CommError> {
        match &self.inner {
            WorkInner::Done => Ok(()),
            WorkInner::Cuda {
                event,
                device,
                failure,
                ..
            } => {
                check_failure(failure)?;
                event.wait_on(device.stream())?;
                Ok(())
            }
        }
    }

    /// Blocks the host until the collective has finished; returns the communicator's failure (timeout,
    /// abort) if one happened meanwhile.
    pub fn synchronize(&self, poll: Duration) -> Result<(), CommError> {
        match &self.inner {
            WorkInner::Done => Ok(()),
            WorkInner::Cuda { event, failure, .. } => loop {
                // Polling instead of cuEventSynchronize so that a watchdog abort is noticed.
                check_failure(failure)?;
                if event.is_complete() {
                    return check_failure(failure);
                }
                std::thread::sleep(poll);
            },
        }
    }

    /// Whether the collective has finished.
    pub fn is_complete(&self) -> bool {
        match &self.inner {
            WorkInner::Done => true,
            WorkInner::Cuda { event, .. } => event.is_complete(),
        }
    }

    /// The CUDA event marking the end of the collective (None on the CPU).
    pub fn event(&self) -> Option<&GpuEvent> {
        match &self.inner {
            WorkInner::Done => None,
            WorkInner::Cuda { event, .. } => Some(event),
        }
    }
}

fn check_failure(failure: &FailureFlag) -> Result<(), CommError> {
    match failure.lock() {
        Ok(g) => match g.as_ref() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        },
        Err(_) => Err(CommError::Poisoned("failure flag lock poisoned".into())),
    }
}

/// A group member that runs collectives. Object safe: fsdp layers hold `Arc<dyn Communicator>` and call
/// it from rank threads (thread backend) or the process's main thread (NCCL).
///
/// Backends implement [`Communicator::start`] and [`Communicator::barrier`]; the named methods are
/// provided. The blocking forms return when the result is usable by later work on the buffers' device
/// (on CUDA: ordered on the compute stream, the host is not blocked).
pub trait Communicator: Send + Sync {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The device whose buffers this communicator moves.
    fn device(&self) -> &Device;
    /// The backend's name ("threads", "nccl").
    fn backend(&self) -> &'static str;
    /// Blocks until every rank has called `barrier`.
    fn barrier(&self) -> Result<(), CommError>;
    /// Issues a collective and returns its handle.
    fn start(&self, call: Collective<'_>) -> Result<CommWork, CommError>;

    /// Records that this rank is about to fail because another rank failed, as learned from a
    /// collective's result (an all-reduce of error flags, say), so that a runner of thread ranks reports
    /// the other rank's error as the cause ([`crate::run_ranks`]). The default does nothing: with one
    /// process per rank, each rank prints its own error and the launcher names the first to exit.
    fn note_failure_caused_by_peer(&self) {}

    /// All-gather: `recv` = concatenation of every rank's `send`, in rank order.
    fn all_gather(&self, send: SendBuf<'_>, recv: RecvBuf<'_>) -> Result<(), CommError> {
        self.start(Collective::AllGather { send, recv })?.wait()
    }

    /// All-gather without ordering the compute stream: wait on the handle before using `recv`
    /// (prefetch).
    fn all_gather_async(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
    ) -> Result<CommWork, CommError> {
        self.start(Collective::AllGather { send, recv })
    }

    /// Reduce-scatter: rank `r` receives the reduction of chunk `r` of `send`.
    fn reduce_scatter(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.start(Collective::ReduceScatter { send, recv, op })?
            .wait()
    }

    /// Reduce-scatter, returning the handle.
    fn reduce_scatter_async(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
        op: ReduceOp,
    ) -> Result<CommWork, CommError> {
        self.start(Collective::ReduceScatter { send, recv, op })
    }

    /// All-reduce into `recv`.
    fn all_reduce(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.start(Collective::AllReduce { send, recv, op })?.wait()
    }

    /// All-reduce, returning the handle.
    fn all_reduce_async(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
        op: ReduceOp,
    ) -> Result<CommWork, CommError> {
        self.start(Collective::AllReduce { send, recv, op })
    }

    /// All-reduce in place, on the buffer's device (on CUDA: no host synchronisation).
    fn all_reduce_in_place(&self, buf: RecvBuf<'_>, op: ReduceOp) -> Result<(), CommError> {
        self.start(Collective::AllReduceInPlace { buf, op })?.wait()
    }

    /// Broadcast `send` of `root` into every rank's `recv`.
    fn broadcast(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
        root: usize,
    ) -> Result<(), CommError> {
        self.start(Collective::Broadcast { send, recv, root })?
            .wait()
    }

    /// Broadcast in place from `root`.
    fn broadcast_in_place(&self, buf: RecvBuf<'_>, root: usize) -> Result<(), CommError> {
        self.start(Collective::BroadcastInPlace { buf, root })?
            .wait()
    }

    /// All-to-all: `send` and `recv` are `world_size` equal chunks; chunk `j` of this rank's `send`
    /// goes to rank `j`, and chunk `j` of `recv` receives chunk `rank` of rank `j`'s `send` (e.g. FP8
    /// codes and their block scales, each rank getting the rows it owns).
    fn all_to_all(&self, send: SendBuf<'_>, recv: RecvBuf<'_>) -> Result<(), CommError> {
        self.start(Collective::AllToAll { send, recv })?.wait()
    }

    /// All-to-all, returning the handle.
    fn all_to_all_async(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
    ) -> Result<CommWork, CommError> {
        self.start(Collective::AllToAll { send, recv })
    }

    /// All-gather of uneven shards: `counts` has one entry per rank (the same on every rank), this
    /// rank's `send` has `counts[rank]` elements (zero is allowed), and `recv` (`sum(counts)` elements)
    /// receives every rank's `send`, concatenated in rank order. Every element type moves.
    fn all_gather_v(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
        counts: &[usize],
    ) -> Result<(), CommError> {
        self.start(Collective::AllGatherV { send, recv, counts })?
            .wait()
    }

    /// All-gather of uneven shards, returning the handle (wait on it before using `recv`).
    fn all_gather_v_async(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
        counts: &[usize],
    ) -> Result<CommWork, CommError> {
        self.start(Collective::AllGatherV { send, recv, counts })
    }

    /// Reduce-scatter into uneven shards: `counts` has one entry per rank (the same on every rank),
    /// `send` has `sum(counts)` elements, and this rank's `recv` (`counts[rank]` elements, zero allowed)
    /// receives the reduction over ranks of `send[offset..offset + counts[rank]]`, where `offset` is
    /// `sum(counts[..rank])`. F32, BF16 and F16; FP8 is refused with [`CommError::Unsupported`] (see
    /// [`Collective::ReduceScatterV`]), bytes have no arithmetic.
    fn reduce_scatter_v(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.start(Collective::ReduceScatterV {
            send,
            recv,
            counts,
            op,
        })?
        .wait()
    }

    /// Reduce-scatter into uneven shards, returning the handle.
    fn reduce_scatter_v_async(
        &self,
        send: SendBuf<'_>,
        recv: RecvBuf<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<CommWork, CommError> {
        self.start(Collective::ReduceScatterV {
            send,
            recv,
            counts,
            op,
        })
    }

    /// All-to-all with a count per peer: this rank sends `send_counts[j]` elements to rank `j` (the
    /// chunks of `send` are consecutive, in peer order) and receives `recv_counts[j]` elements from rank
    /// `j` into consecutive chunks of `recv`, in peer order. Both count slices have one entry per rank,
    /// zeros allowed; rank `r`'s `send_counts[j]` must equal rank `j`'s `recv_counts[r]`. Thread ranks
    /// check that on every rank ([`CommError::RankMismatch`]); NCCL cannot without an extra exchange,
    /// so there a mismatch is the caller's error and ends in the watchdog's timeout. Every element
    /// type moves.
    fn all_to_all_v(
        &self,
        send: SendBuf<'_>,
        send_counts: &[usize],
        recv: RecvBuf<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        self.start(Collective::AllToAllV {
            send,
            send_counts,
            recv,
            recv_counts,
        })?
        .wait()
    }

    /// All-to-all with a count per peer, returning the handle.
    fn all_to_all_v_async(
        &self,
        send: SendBuf<'_>,
        send_counts: &[usize],
        recv: RecvBuf<'_>,
        recv_counts: &[usize],
    ) -> Result<CommWork, CommError> {
        self.start(Collective::AllToAllV {
            send,
            send_counts,
            recv,
            recv_counts,
        })
    }

    /// All-reduce a small host vector of f32 (amaxes, non-finite counts) in place. On CUDA this copies
    /// to the device and back, so it synchronises the host: inside a GPU step use
    /// [`Communicator::all_reduce_in_place`] on a device buffer instead.
    fn all_reduce_host_f32(&self, values: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let mut buf = self.device().upload(values)?;
        self.all_reduce_in_place(RecvBuf::F32(&mut buf), op)?;
        let out = buf.to_vec()?;
        if out.len() != values.len() {
            return Err(CommError::LengthMismatch {
                op: "all_reduce_host_f32",
                what: "result",
                expected: values.len(),
                actual: out.len(),
            });
        }
        values.copy_from_slice(&out);
        Ok(())
    }
}
