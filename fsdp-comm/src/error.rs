//! The error type of `fsdp-comm`.

use std::time::Duration;

/// Everything that can go wrong in a collective, the rendezvous or the launcher.
///
/// The type is `Clone` because one failure (a timeout, a panicking rank) is reported to every rank of a
/// group; foreign errors are therefore kept as their messages.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[allow(missing_docs)] // variant fields are described by the messages
pub enum CommError {
    /// A buffer has the wrong number of elements for the operation.
    #[error("{op}: {what} has {actual} elements but {expected} are required")]
    LengthMismatch {
        op: &'static str,
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A buffer that must split into `world_size` equal chunks does not.
    #[error(
        "{op}: {what} have {len} elements, not divisible by the world size {world_size} (pad them)"
    )]
    NotDivisible {
        op: &'static str,
        what: &'static str,
        len: usize,
        world_size: usize,
    },
    /// Send and receive buffers hold different element types.
    #[error("{op}: send buffer holds {send} but receive buffer holds {recv}")]
    DTypeMismatch {
        op: &'static str,
        send: String,
        recv: String,
    },
    /// The operation is not defined for this element type (e.g. a sum of raw bytes).
    #[error("{op} is not supported for {dtype}: {why}")]
    Unsupported {
        op: &'static str,
        dtype: String,
        why: String,
    },
    /// An argument outside its range (a root rank, a world size).
    #[error("{op}: {detail}")]
    InvalidArgument { op: &'static str, detail: String },
    /// Ranks called different collectives, or the same one with different sizes.
    #[error("{op}: ranks disagree: {detail}")]
    RankMismatch { op: String, detail: String },
    /// Another rank rejected its own arguments, so this collective failed on every rank.
    #[error("{op} failed on rank {rank}: {detail}")]
    PeerFailed {
        op: String,
        rank: usize,
        detail: String,
    },
    /// Some ranks did not arrive in time.
    #[error("{op} timed out after {timeout:?} (seen by rank {rank}): rank(s) {missing:?} did not arrive")]
    Timeout {
        op: String,
        rank: usize,
        missing: Vec<usize>,
        timeout: Duration,
    },
    /// A rank left the group (its communicator was dropped) while others waited for it. This is a
    /// consequence: the rank that left usually failed, and its own error is the cause.
    #[error(
        "{op}: rank(s) {ranks:?} left the group before joining this collective (a consequence: \
         see the error of rank(s) {ranks:?} for the cause)"
    )]
    RankExited { op: String, ranks: Vec<usize> },
    /// The group is unusable since an earlier failure (panic, timeout, abort).
    #[error("communicator group is poisoned by an earlier failure: {0}")]
    Poisoned(String),
    /// A rank's closure panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked { rank: usize, message: String },
    /// A device or buffer error from fp8-kernels.
    #[error("device error: {0}")]
    Device(String),
    /// The NCCL library cannot be used here.
    #[error("NCCL is not available: {0}")]
    NcclUnavailable(String),
    /// An NCCL call failed.
    #[error("NCCL {call} failed: {code} ({message})")]
    Nccl {
        call: &'static str,
        code: String,
        message: String,
    },
    /// The NCCL communicator was aborted by the watchdog.
    #[error("NCCL communicator aborted: {0}")]
    Aborted(String),
    /// A required environment variable is missing or malformed.
    #[error("environment variable {name}: {detail}")]
    Env { name: String, detail: String },
    /// The TCP rendezvous failed.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// An I/O error, with what was being done.
    #[error("{what}: {message}")]
    Io { what: String, message: String },
    /// The launcher could not start or supervise its processes.
    #[error("launcher: {0}")]
    Launch(String),
}

impl From<fp8_kernels::KernelError> for CommError {
    fn from(e: fp8_kernels::KernelError) -> Self {
        CommError::Device(e.to_string())
    }
}

impl From<cudarc::driver::DriverError> for CommError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CommError::Device(format!("CUDA driver error: {e}"))
    }
}

impl CommError {
    /// An I/O error with context.
    pub(crate) fn io(what: impl Into<String>, e: std::io::Error) -> Self {
        CommError::Io {
            what: what.into(),
            message: e.to_string(),
        }
    }
}
