//! The NCCL backend: one process per GPU.
//!
//! The communicator is owned over cudarc's NCCL wrappers `cudarc::nccl::result` rather than its safe
//! `Comm` (which blocks in init, is not `Send`, hides its handle and panics when abort fails); the raw
//! bindings (`cudarc::nccl::sys`) are used only where `result` has no wrapper: the non-blocking init
//! configuration (`ncclConfig_t`), `ncclCommGetAsyncError`, and the error strings.
//!
//! - init is non-blocking (`ncclCommInitRankConfig` with `blocking = 0`), polled with
//!   `ncclCommGetAsyncError` until ready or until the init deadline, then aborted;
//! - collectives are queued on the device's communication stream, after an event recorded on the compute
//!   stream; each returns a [`CommWork`] whose event the compute stream waits on (device side only, the
//!   host is not blocked), so fsdp layers can prefetch;
//! - a watchdog thread polls `ncclCommGetAsyncError` and the events of queued collectives, and calls
//!   `ncclCommAbort` when NCCL reports an error or a collective is not done by its deadline; later calls
//!   (and waits on outstanding work) return the reason.
//!
//! FP8 sums use NCCL's native FP8 types (`ncclFloat8e4m3`, `ncclFloat8e5m2`: NCCL >= 2.24, sm_90);
//! gathers, broadcasts and all-to-alls of FP8 payloads move bytes. NCCL's `Avg` is never used. NCCL has
//! no all-to-all call: it is one group (`ncclGroupStart`/`ncclGroupEnd`) of a `ncclSend` and a
//! `ncclRecv` per peer, this rank included.
//!
//! NCCL has no variable-count collectives either; each is one group: all-gather-v a `ncclBroadcast`
//! per rank with a non-empty shard (into that rank's offset of `recv`), reduce-scatter-v a `ncclReduce`
//! per such rank (from its offset of `send`), all-to-all-v a `ncclSend` and a `ncclRecv` per peer with
//! a non-zero count. Pieces of zero elements are skipped, the same on both ends because the counts are
//! (all-gather-v and reduce-scatter-v share theirs; all-to-all-v's match pairwise by contract, which
//! only the thread backend can check).
//!
//! Files: this one holds [`NcclComm`] (init, issue, the [`Communicator`] implementation); `library.rs`
//! the calls into the NCCL library (types, status, errors, the init configuration); `watchdog.rs` the
//! shared state of a communicator and the thread that aborts it.

mod library;
mod watchdog;

pub use library::{
    nccl_dtype, nccl_library_status, nccl_op, nccl_version, unique_id, Fp8E4M3Byte, Fp8E5M2Byte,
    NCCL_FP8_MIN_VERSION,
};

use crate::collective::{
    Collective, CommDType, CommWork, Communicator, RecvBuf, ReduceOp, SendBuf,
};
use crate::error::CommError;
use crate::rendezvous::{self, DistEnv};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudarc::nccl::result::{self, NcclError, NcclStatus};
use cudarc::nccl::sys;
use fp8_kernels::{Buffer, CudaDevice, Device, Element};
use library::{async_state, nccl_config, nccl_error, progress, Progress};
use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use watchdog::{watchdog, Handle, Pending, Shared};

/// Default bound on one collective (and on init).
pub const DEFAULT_NCCL_TIMEOUT: Duration = Duration::from_secs(300);

/// Timeouts of the NCCL backend.
#[derive(Debug, Clone)]
pub struct NcclConfig {
    /// Bound on each collective, from issue to completion (the watchdog aborts after it).
    pub timeout: Duration,
    /// Bound on communicator init.
    pub init_timeout: Duration,
    /// Bound on the TCP rendezvous.
    pub rendezvous_timeout: Duration,
    /// How often the watchdog and host waits poll.
    pub poll_interval: Duration,
}

impl Default for NcclConfig {
    fn default() -> Self {
        NcclConfig {
            timeout: DEFAULT_NCCL_TIMEOUT,
            init_timeout: DEFAULT_NCCL_TIMEOUT,
            rendezvous_timeout: rendezvous::DEFAULT_RENDEZVOUS_TIMEOUT,
            poll_interval: Duration::from_millis(5),
        }
    }
}

impl NcclConfig {
    /// All three bounds set to `t`.
    pub fn with_timeout(t: Duration) -> Self {
        NcclConfig {
            timeout: t,
            init_timeout: t,
            rendezvous_timeout: t,
            ..Default::default()
        }
    }
}

/// A rank of an NCCL communicator on one GPU.
pub struct NcclComm {
    rank: usize,
    world_size: usize,
    device: Device,
    cuda: CudaDevice,
    version: i32,
    shared: Arc<Shared>,
    watchdog: Option<JoinHandle<()>>,
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {} on GPU {}, NCCL {})",
            self.rank,
            self.world_size,
            self.cuda.ordinal(),
            self.version
        )
    }
}

impl NcclComm {
    /// Rendezvous from the torchrun-style environment (`LOCAL_RANK` picks the GPU) and init. Without
    /// `RANK` in the environment this is a job of one rank on GPU 0.
    pub fn from_env(cfg: &NcclConfig) -> Result<Self, CommError> {
        let env = if DistEnv::is_launched() {
            DistEnv::from_env()?
        } else {
            DistEnv::single()
        };
        Self::from_dist_env(&env, cfg)
    }

    /// Rendezvous as `env` says and init on GPU `env.local_rank`.
    pub fn from_dist_env(env: &DistEnv, cfg: &NcclConfig) -> Result<Self, CommError> {
        nccl_library_status()?;
        let cuda = CudaDevice::new(env.local_rank)?;
        Self::from_dist_env_on(env, cuda, cfg)
    }

    /// Rendezvous as `env` says and init on an already opened GPU. Collectives accept only buffers of
    /// this same [`CudaDevice`] (its compute stream is the one they are ordered against).
    pub fn from_dist_env_on(
        env: &DistEnv,
        cuda: CudaDevice,
        cfg: &NcclConfig,
    ) -> Result<Self, CommError> {
        nccl_library_status()?;
        let blob = rendezvous::exchange(
            env,
            || unique_id().map(|id| id.to_vec()),
            cfg.rendezvous_timeout,
        )?;
        let id: [u8; 128] = blob.as_slice().try_into().map_err(|_| {
            CommError::Rendezvous(format!(
                "received {} bytes where an NCCL unique id has 128",
                blob.len()
            ))
        })?;
        Self::init(cuda, env.rank, env.world_size, &id, cfg)
    }

    /// Joins the communicator identified by `id` as `rank` of `world_size` on `cuda`.
    pub fn init(
        cuda: CudaDevice,
        rank: usize,
        world_size: usize,
        id: &[u8; 128],
        cfg: &NcclConfig,
    ) -> Result<Self, CommError> {
        nccl_library_status()?;
        if world_size == 0 || rank >= world_size || i32::try_from(world_size).is_err() {
            return Err(CommError::InvalidArgument {
                op: "NcclComm::init",
                detail: format!("rank {rank} of world size {world_size}"),
            });
        }
        let version = nccl_version()?;
        cuda.context().bind_to_thread()?;
        let mut config = nccl_config(version);
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid for writes/reads for the call; the context of the
        // target GPU is current on this thread (NCCL uses the current device).
        let r = progress(unsafe {
            result::comm_init_rank_config(
                &mut comm,
                world_size as i32,
                uid,
                rank as i32,
                &mut config,
            )
        });
        // A null communicator with a success code is an error too (NCCL's own failure reporting aside).
        let failed = match r {
            Err(code) => Some(code),
            Ok(_) if comm.is_null() => Some(sys::ncclResult_t::ncclSuccess),
            Ok(_) => None,
        };
        if let Some(code) = failed {
            let e = nccl_error("ncclCommInitRankConfig", code, None);
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed back; aborted once and never used again.
                let _ = unsafe { result::comm_abort(comm) };
            }
            return Err(e);
        }
        let shared = Arc::new(Shared {
            rank,
            handle: Mutex::new(Handle {
                comm,
                aborted: false,
            }),
            failure: Arc::new(Mutex::new(None)),
            pending: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            timeout: cfg.timeout,
            poll: cfg.poll_interval,
        });
        // Dropping `this` on an init failure aborts the communicator (it is marked aborted by then).
        let mut this = NcclComm {
            rank,
            world_size,
            device: Device::Cuda(cuda.clone()),
            cuda,
            version,
            shared: shared.clone(),
            watchdog: None,
        };
        shared
            .wait_ready("ncclCommInitRankConfig", Instant::now() + cfg.init_timeout)
            .map_err(|e| match e {
                CommError::Aborted(_) => CommError::Timeout {
                    op: "NCCL communicator init".into(),
                    rank,
                    missing: Vec::new(),
                    timeout: cfg.init_timeout,
                },
                e => e,
            })?;
        let ctx = this.cuda.context().clone();
        let handle = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || watchdog(shared, ctx))
            .map_err(|e| CommError::io("spawning the NCCL watchdog", e))?;
        this.watchdog = Some(handle);
        Ok(this)
    }

    /// The NCCL library version.
    pub fn nccl_version(&self) -> i32 {
        self.version
    }

    /// The GPU.
    pub fn cuda(&self) -> &CudaDevice {
        &self.cuda
    }

    /// The failure that ended this communicator, if any.
    pub fn failure(&self) -> Option<CommError> {
        self.shared.failure()
    }

    /// Aborts the communicator now (e.g. when another part of the job failed): outstanding and later
    /// collectives return `reason`.
    pub fn abort(&self, reason: &str) {
        if let Ok(mut h) = self.shared.lock() {
            self.shared
                .abort_locked(&mut h, CommError::Aborted(reason.to_string()));
        }
    }

    fn require_fp8_reductions(&self, dtype: CommDType) -> Result<(), CommError> {
        let unsupported = |why: String| CommError::Unsupported {
            op: "NCCL reduction",
            dtype: dtype.to_string(),
            why,
        };
        if self.version < NCCL_FP8_MIN_VERSION {
            return Err(unsupported(format!(
                "NCCL {} has no FP8 types (2.24 or newer needed)",
                self.version
            )));
        }
        let cc = self.cuda.compute_capability();
        if cc < (9, 0) {
            return Err(unsupported(format!(
                "NCCL reduces FP8 on sm_90 or newer; this GPU is {}.{}",
                cc.0, cc.1
            )));
        }
        Ok(())
    }

    fn slice_of<'b, T: Element>(&self, b: &'b Buffer<T>) -> Result<&'b CudaSlice<T>, CommError> {
        match b.as_cuda() {
            Some((s, d)) if Device::Cuda(d.clone()) == self.device => Ok(s),
            Some(_) => Err(CommError::Device(
                "NCCL backend: buffer is on another GPU than the communicator".into(),
            )),
            None => Err(CommError::Device(
                "NCCL backend: buffer is on the CPU".into(),
            )),
        }
    }

    fn slice_of_mut<'b, T: Element>(
        &self,
        b: &'b mut Buffer<T>,
    ) -> Result<&'b mut CudaSlice<T>, CommError> {
        let on_this_gpu = match b.as_cuda() {
            Some((_, d)) => Device::Cuda(d.clone()) == self.device,
            None => {
                return Err(CommError::Device(
                    "NCCL backend: buffer is on the CPU".into(),
                ))
            }
        };
        if !on_this_gpu {
            return Err(CommError::Device(
                "NCCL backend: buffer is on another GPU than the communicator".into(),
            ));
        }
        b.as_cuda_mut()
            .map(|(s, _)| s)
            .ok_or_else(|| CommError::Device("NCCL backend: buffer is on the CPU".into()))
    }

    fn send_ptr<'b>(
        &self,
        send: SendBuf<'b>,
        stream: &'b CudaStream,
    ) -> Result<(CUdeviceptr, SyncOnDrop<'b>), CommError> {
        Ok(match send {
            SendBuf::F32(b) => self.slice_of(b)?.device_ptr(stream),
            SendBuf::BF16(b) => self.slice_of(b)?.device_ptr(stream),
            SendBuf::F16(b) => self.slice_of(b)?.device_ptr(stream),
            SendBuf::Bytes(b) | SendBuf::Fp8(b, _) => self.slice_of(b)?.device_ptr(stream),
        })
    }

    fn recv_ptr<'b>(
        &self,
        recv: RecvBuf<'b>,
        stream: &'b CudaStream,
    ) -> Result<(CUdeviceptr, SyncOnDrop<'b>), CommError> {
        Ok(match recv {
            RecvBuf::F32(b) => self.slice_of_mut(b)?.device_ptr_mut(stream),
            RecvBuf::BF16(b) => self.slice_of_mut(b)?.device_ptr_mut(stream),
            RecvBuf::F16(b) => self.slice_of_mut(b)?.device_ptr_mut(stream),
            RecvBuf::Bytes(b) | RecvBuf::Fp8(b, _) => self.slice_of_mut(b)?.device_ptr_mut(stream),
        })
    }

    /// Queues one NCCL call on the communication stream, ordered after the compute stream's work, and
    /// returns the handle of its completion.
    fn issue(
        &self,
        op: &'static str,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<NcclStatus, NcclError>,
    ) -> Result<CommWork, CommError> {
        if let Some(e) = self.shared.failure() {
            return Err(e);
        }
        self.cuda.context().bind_to_thread()?;
        let stream = self.cuda.comm_stream();
        self.cuda.record_compute()?.wait_on(stream)?;
        let deadline = Instant::now() + self.shared.timeout;
        let r = {
            let mut h = self.shared.lock()?;
            if h.aborted {
                return Err(self
                    .shared
                    .failure()
                    .unwrap_or_else(|| CommError::Aborted("communicator aborted".into())));
            }
            match progress(call(h.comm, stream.cu_stream() as sys::cudaStream_t)) {
                Ok(p) => p,
                Err(code) => {
                    let e = nccl_error(op, code, Some(h.comm));
                    self.shared.abort_locked(&mut h, e.clone());
                    return Err(e);
                }
            }
        };
        if r == Progress::InProgress {
            // Non-blocking communicators may still be enqueueing (e.g. connecting on first use).
            self.shared.wait_ready(op, deadline)?;
        }
        let done = self.cuda.record_comm()?;
        let watched = self.cuda.record_comm()?;
        if let Ok(mut p) = self.shared.pending.lock() {
            p.push(Pending {
                op,
                event: watched,
                deadline,
            });
        }
        Ok(CommWork::cuda(
            done,
            self.cuda.clone(),
            self.shared.failure.clone(),
            op,
        ))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        let _ = self.cuda.context().bind_to_thread();
        let Ok(mut h) = self.shared.handle.lock() else {
            return;
        };
        if h.aborted || h.comm.is_null() {
            return;
        }
        // Finalize flushes outstanding work (non-blocking: poll it), then destroy; abort if that fails or
        // does not finish in time.
        // SAFETY: live communicator under its lock.
        let mut finalized = progress(unsafe { result::comm_finalize(h.comm) }).is_ok();
        let deadline = Instant::now() + self.shared.timeout;
        while finalized {
            // SAFETY: live communicator (finalizing, not destroyed) under its lock.
            match unsafe { async_state(h.comm) } {
                Err(_) => finalized = false,
                Ok(sys::ncclResult_t::ncclSuccess) => break,
                Ok(sys::ncclResult_t::ncclInProgress) if Instant::now() < deadline => {
                    std::thread::sleep(self.shared.poll)
                }
                Ok(_) => finalized = false,
            }
        }
        // SAFETY: live communicator; it is released here and never used again. The results are not
        // used: nothing is left to report to from a drop.
        unsafe {
            if finalized {
                let _ = result::comm_destroy(h.comm);
            } else {
                let _ = result::comm_abort(h.comm);
            }
        }
        h.aborted = true;
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn barrier(&self) -> Result<(), CommError> {
        // NCCL has no barrier: a one-element all-reduce the host waits for.
        let mut token = self.device.zeros::<f32>(1)?;
        let work = self.start(Collective::AllReduceInPlace {
            buf: RecvBuf::F32(&mut token),
            op: ReduceOp::Sum,
        })?;
        work.synchronize(self.shared.poll)
    }

    fn start(&self, call: Collective<'_>) -> Result<CommWork, CommError> {
        call.validate_on_rank(self.rank, self.world_size)?;
        let dtype = call.dtype();
        let reduction = call.op();
        if reduction.is_some() && matches!(dtype, CommDType::Fp8(_)) {
            self.require_fp8_reductions(dtype)?;
        }
        let (send_len, recv_len) = call.lengths();
        if send_len == 0 && recv_len == 0 {
            // Every rank has the same (empty) sizes; NCCL would do nothing either.
            return Ok(CommWork::completed());
        }
        let name = call.kind().name();
        let dt = nccl_dtype(dtype, reduction.is_some());
        let red = nccl_op(reduction.unwrap_or(ReduceOp::Sum));
        let stream = self.cuda.comm_stream().clone();
        // One NCCL entry point per collective; the in-place forms pass their one buffer as both sides
        // (NCCL allows send == recv).
        let (entry, send, recv) = match call {
            Collective::AllGather { send, recv } => (NcclEntry::AllGather, Some(send), recv),
            Collective::ReduceScatter { send, recv, .. } => {
                (NcclEntry::ReduceScatter, Some(send), recv)
            }
            Collective::AllReduce { send, recv, .. } => (NcclEntry::AllReduce, Some(send), recv),
            Collective::AllReduceInPlace { buf, .. } => (NcclEntry::AllReduce, None, buf),
            Collective::Broadcast { send, recv, root } => {
                (NcclEntry::Broadcast(root), Some(send), recv)
            }
            Collective::BroadcastInPlace { buf, root } => (NcclEntry::Broadcast(root), None, buf),
            Collective::AllToAll { send, recv } => (NcclEntry::AllToAll, Some(send), recv),
            Collective::AllGatherV { send, recv, counts } => {
                (NcclEntry::AllGatherV(counts), Some(send), recv)
            }
            Collective::ReduceScatterV {
                send, recv, counts, ..
            } => (NcclEntry::ReduceScatterV(counts), Some(send), recv),
            Collective::AllToAllV {
                send,
                send_counts,
                recv,
                recv_counts,
            } => (
                NcclEntry::AllToAllV {
                    send_counts,
                    recv_counts,
                },
                Some(send),
                recv,
            ),
        };
        // The pointer guards record the buffers' read/write events on the communication stream when
        // they drop, after the call is queued, so cudarc orders later uses and frees after it.
        let (s, _gs) = match send {
            Some(send) => {
                let (s, g) = self.send_ptr(send, &stream)?;
                (Some(s), Some(g))
            }
            None => (None, None),
        };
        let (r, _gr) = self.recv_ptr(recv, &stream)?;
        let s = s.unwrap_or(r) as usize as *const c_void;
        let r = r as usize as *mut c_void;
        // All-to-all: chunk bytes per peer (the lengths were checked to split into world_size chunks).
        let world = self.world_size;
        let chunk = recv_len / world;
        let elem_bytes = dtype.size_bytes();
        let chunk_bytes = chunk * elem_bytes;
        self.issue(name, |comm, st| {
            // SAFETY: device pointers of live buffers on this communicator's GPU, their lengths
            // validated for the collective (all-gather: recv = world_size * send elements;
            // reduce-scatter: send = world_size * recv; all-reduce and broadcast: equal; all-to-all:
            // equal, world_size chunks of `chunk` elements, so every peer's offset and extent lie inside
            // both buffers; the "v" forms: one count per rank, recv = sum(counts) and send =
            // counts[rank] (all-gather-v), send = sum(counts) and recv = counts[rank]
            // (reduce-scatter-v), send = sum(send_counts) and recv = sum(recv_counts) (all-to-all-v)),
            // the root checked below world_size.
            unsafe {
                match entry {
                    NcclEntry::AllToAll => {
                        all_to_all(s, r, chunk, chunk_bytes, world, dt, comm, st)
                    }
                    NcclEntry::AllGatherV(counts) => {
                        all_gather_v(s, r, counts, elem_bytes, dt, comm, st)
                    }
                    NcclEntry::ReduceScatterV(counts) => {
                        reduce_scatter_v(s, r, counts, elem_bytes, dt, red, comm, st)
                    }
                    NcclEntry::AllToAllV {
                        send_counts,
                        recv_counts,
                    } => all_to_all_v(s, r, send_counts, recv_counts, elem_bytes, dt, comm, st),
                    NcclEntry::AllGather => result::all_gather(s, r, send_len, dt, comm, st),
                    NcclEntry::ReduceScatter => {
                        result::reduce_scatter(s, r, recv_len, dt, red, comm, st)
                    }
                    NcclEntry::AllReduce => result::all_reduce(s, r, recv_len, dt, red, comm, st),
                    NcclEntry::Broadcast(root) => {
                        result::broadcast(s, r, recv_len, dt, root as i32, comm, st)
                    }
                }
            }
        })
    }
}

/// The NCCL call a [`Collective`] becomes.
#[derive(Clone, Copy)]
enum NcclEntry<'c> {
    AllGather,
    ReduceScatter,
    AllReduce,
    Broadcast(usize),
    AllToAll,
    AllGatherV(&'c [usize]),
    ReduceScatterV(&'c [usize]),
    AllToAllV {
        send_counts: &'c [usize],
        recv_counts: &'c [usize],
    },
}

/// `base` moved by `bytes` bytes. Only address arithmetic (NCCL dereferences on the device), so
/// `wrapping_add`, which needs no `unsafe`; callers keep the result inside the buffer.
fn byte_offset(base: *const c_void, bytes: usize) -> *const c_void {
    base.cast::<u8>().wrapping_add(bytes).cast()
}

/// The mutable form of [`byte_offset`].
fn byte_offset_mut(base: *mut c_void, bytes: usize) -> *mut c_void {
    base.cast::<u8>().wrapping_add(bytes).cast()
}

/// Runs `body` (NCCL calls) between `ncclGroupStart` and `ncclGroupEnd`. The group is ended even when
/// a call inside fails, and that call's error is the one returned.
fn grouped(body: impl FnOnce() -> Result<(), NcclError>) -> Result<NcclStatus, NcclError> {
    result::group_start()?;
    let inside = body();
    let end = result::group_end();
    match inside {
        Err(e) => Err(e),
        Ok(()) => end,
    }
}

/// All-gather-v as one group of `ncclBroadcast`s, one per rank `root` with `counts[root] > 0`: the
/// root's `send` into `recv` at element `sum(counts[..root])`.
///
/// Broadcasts rather than send/receive pairs: they run on the ring and tree channels the even
/// collectives already use, each rank receiving `sum(counts)` elements and forwarding them along the
/// ring as in NCCL's own all-gather, where pairs would connect every rank to every peer (a buffer per
/// peer) and make each rank push its shard `world_size - 1` times through its own links. (PyTorch
/// gathers uneven shards the same way.)
///
/// # Safety
/// `send` points at `counts[rank]` elements of `dt` and `recv` at `sum(counts)` elements, both on the
/// communicator's GPU; `counts` has one entry per rank; `comm` is live and used by no other thread during
/// the call; `stream` belongs to the communicator's device.
#[allow(clippy::too_many_arguments)]
unsafe fn all_gather_v(
    send: *const c_void,
    recv: *mut c_void,
    counts: &[usize],
    elem_bytes: usize,
    dt: sys::ncclDataType_t,
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> Result<NcclStatus, NcclError> {
    grouped(|| {
        let mut offset = 0usize;
        for (root, &count) in counts.iter().enumerate() {
            if count > 0 {
                let dst = byte_offset_mut(recv, offset * elem_bytes);
                // `root` is below the world size, which fits an i32 (checked at init).
                // SAFETY: `dst` is `count` elements inside `recv` (offset + count <= sum(counts)); on
                // the root `send` holds `count` elements, elsewhere NCCL does not read it; `comm` and
                // `stream` as the caller guarantees.
                unsafe { result::broadcast(send, dst, count, dt, root as i32, comm, stream) }?;
            }
            offset += count;
        }
        Ok(())
    })
}

/// Reduce-scatter-v as one group of `ncclReduce`s, one per rank `root` with `counts[root] > 0`: the
/// `counts[root]` elements of `send` at `sum(counts[..root])`, reduced into the root's `recv`. (Reduces
/// to each root, as PyTorch does for uneven shards: NCCL's even reduce-scatter needs equal chunks.)
///
/// # Safety
/// `send` points at `sum(counts)` elements of `dt` and `recv` at `counts[rank]` elements, both on the
/// communicator's GPU; `counts` has one entry per rank; `comm` and `stream` as for [`all_gather_v`].
#[allow(clippy::too_many_arguments)]
unsafe fn reduce_scatter_v(
    send: *const c_void,
    recv: *mut c_void,
    counts: &[usize],
    elem_bytes: usize,
    dt: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> Result<NcclStatus, NcclError> {
    grouped(|| {
        let mut offset = 0usize;
        for (root, &count) in counts.iter().enumerate() {
            if count > 0 {
                let src = byte_offset(send, offset * elem_bytes);
                // SAFETY: `src` is `count` elements inside `send` (offset + count <= sum(counts)); on
                // the root `recv` holds `count` elements, elsewhere NCCL does not write it; `root` fits
                // an i32 (world size checked at init); `comm` and `stream` as the caller guarantees.
                unsafe { result::reduce(src, recv, count, dt, op, root as i32, comm, stream) }?;
            }
            offset += count;
        }
        Ok(())
    })
}

/// All-to-all-v as one group: for each peer `p` (this rank included), send `send_counts[p]` elements of
/// `send` from `sum(send_counts[..p])` and receive `recv_counts[p]` into `recv` at
/// `sum(recv_counts[..p])`, skipping zero counts (the peer skips the matching call, the counts agreeing
/// pairwise).
///
/// # Safety
/// `send` points at `sum(send_counts)` and `recv` at `sum(recv_counts)` elements of `dt` on the
/// communicator's GPU; both count slices have one entry per rank; `comm` and `stream` as for
/// [`all_gather_v`].
#[allow(clippy::too_many_arguments)]
unsafe fn all_to_all_v(
    send: *const c_void,
    recv: *mut c_void,
    send_counts: &[usize],
    recv_counts: &[usize],
    elem_bytes: usize,
    dt: sys::ncclDataType_t,
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> Result<NcclStatus, NcclError> {
    grouped(|| {
        let (mut send_offset, mut recv_offset) = (0usize, 0usize);
        for (peer, (&sc, &rc)) in send_counts.iter().zip(recv_counts).enumerate() {
            // `peer` is below the world size, which fits an i32 (checked at init).
            let p = peer as i32;
            if sc > 0 {
                let sp = byte_offset(send, send_offset * elem_bytes);
                // SAFETY: `sp` is `sc` elements inside `send`; `comm` and `stream` as the caller
                // guarantees.
                unsafe { result::send(sp, sc, dt, p, comm, stream) }?;
            }
            if rc > 0 {
                let rp = byte_offset_mut(recv, recv_offset * elem_bytes);
                // SAFETY: `rp` is `rc` elements inside `recv`; `comm` and `stream` as above.
                unsafe { result::recv(rp, rc, dt, p, comm, stream) }?;
            }
            send_offset += sc;
            recv_offset += rc;
        }
        Ok(())
    })
}

/// The all-to-all as one NCCL group: for each peer `p` (this rank included), send chunk `p` of `send`
/// and receive chunk `p` of `recv`, `chunk` elements (`chunk_bytes` bytes) of `dt` each. NCCL runs the
/// group's transfers concurrently when the group ends. A failing call inside the group still ends the
/// group, and its error is the one returned.
///
/// # Safety
/// `send` and `recv` are device pointers of buffers on the communicator's GPU holding `world * chunk`
/// elements of `dt`; `comm` is live and used by no other thread during the call; `stream` belongs to the
/// communicator's device.
#[allow(clippy::too_many_arguments)]
unsafe fn all_to_all(
    send: *const c_void,
    recv: *mut c_void,
    chunk: usize,
    chunk_bytes: usize,
    world: usize,
    dt: sys::ncclDataType_t,
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> Result<NcclStatus, NcclError> {
    result::group_start()?;
    let mut failed = None;
    for peer in 0..world {
        let offset = peer * chunk_bytes;
        // SAFETY: peer < world, so `offset + chunk_bytes` is within both buffers (the caller's
        // contract); the pointers are only offset here, NCCL dereferences them on the device.
        let (sp, rp) = unsafe {
            (
                send.cast::<u8>().add(offset).cast::<c_void>(),
                recv.cast::<u8>().add(offset).cast::<c_void>(),
            )
        };
        // `peer` is below the world size, which fits an i32 (checked at init).
        let p = peer as i32;
        // SAFETY: `sp` points at `chunk` elements of `dt` inside `send` on the communicator's GPU;
        // `comm` and `stream` as the caller guarantees.
        if let Err(e) = unsafe { result::send(sp, chunk, dt, p, comm, stream) } {
            failed = Some(e);
            break;
        }
        // SAFETY: `rp` points at `chunk` elements of `dt` inside `recv`; `comm` and `stream` as above.
        if let Err(e) = unsafe { result::recv(rp, chunk, dt, p, comm, stream) } {
            failed = Some(e);
            break;
        }
    }
    let end = result::group_end();
    match failed {
        Some(e) => Err(e),
        None => end,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without NCCL (CI) every entry point returns the typed error; with it (the GPU machine) the
    /// library answers. The collectives themselves are checked on GPUs by the `nccl_check` example.
    #[test]
    fn missing_nccl_is_an_error_present_nccl_answers() {
        if nccl_library_status().is_ok() {
            let version = nccl_version().expect("NCCL loads: its version must be readable");
            assert!(version >= 20000, "NCCL version code {version}");
            return;
        }
        assert!(matches!(unique_id(), Err(CommError::NcclUnavailable(_))));
        assert!(matches!(nccl_version(), Err(CommError::NcclUnavailable(_))));
        let e = NcclComm::from_dist_env(&DistEnv::single(), &NcclConfig::default()).unwrap_err();
        assert!(matches!(e, CommError::NcclUnavailable(_)), "{e}");
    }
}
