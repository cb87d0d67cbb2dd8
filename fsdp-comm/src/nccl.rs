//! The NCCL backend: one process per GPU.
//!
//! The communicator is owned over `cudarc::nccl::{result, sys}` rather than cudarc's safe `Comm`
//! (which blocks in init, is not `Send`, hides its handle and panics when abort fails):
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
//! gathers and broadcasts of FP8 payloads move bytes. NCCL's `Avg` is never used.

use crate::collective::{
    Collective, CommDType, CommWork, Communicator, FailureFlag, RecvBuf, ReduceOp, SendBuf,
};
use crate::error::CommError;
use crate::rendezvous::{self, DistEnv};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudarc::nccl::sys;
use fp8_core::Fp8Format;
use fp8_kernels::{Buffer, CudaDevice, Device, Element, GpuEvent};
use std::ffi::{c_void, CStr};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Default bound on one collective (and on init).
pub const DEFAULT_NCCL_TIMEOUT: Duration = Duration::from_secs(300);

/// The first NCCL release with FP8 types: `NCCL_VERSION(2, 24, 0)`.
pub const NCCL_FP8_MIN_VERSION: i32 = 22400;

/// An E4M3 byte as NCCL sees it (`ncclFloat8e4m3`), for cudarc's typed NCCL API.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fp8E4M3Byte(pub u8);

/// An E5M2 byte as NCCL sees it (`ncclFloat8e5m2`).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fp8E5M2Byte(pub u8);

impl cudarc::nccl::NcclType for Fp8E4M3Byte {
    fn as_nccl_type() -> sys::ncclDataType_t {
        sys::ncclDataType_t::ncclFloat8e4m3
    }
}

impl cudarc::nccl::NcclType for Fp8E5M2Byte {
    fn as_nccl_type() -> sys::ncclDataType_t {
        sys::ncclDataType_t::ncclFloat8e5m2
    }
}

/// NCCL's element type for `dtype`; reductions of FP8 use NCCL's FP8 types, moves use bytes.
pub fn nccl_dtype(dtype: CommDType, reduction: bool) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match dtype {
        CommDType::F32 => T::ncclFloat32,
        CommDType::BF16 => T::ncclBfloat16,
        CommDType::F16 => T::ncclFloat16,
        CommDType::Bytes => T::ncclUint8,
        CommDType::Fp8(_) if !reduction => T::ncclUint8,
        CommDType::Fp8(Fp8Format::E4M3) => T::ncclFloat8e4m3,
        CommDType::Fp8(Fp8Format::E5M2) => T::ncclFloat8e5m2,
    }
}

/// NCCL's reduction for `op` (never `ncclAvg`).
pub fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// Whether NCCL (and the CUDA driver) can be loaded. cudarc panics on first use of a missing library,
/// so this runs before any NCCL call.
pub fn nccl_library_status() -> Result<(), CommError> {
    fp8_kernels::device::cuda_library_status()
        .map_err(|e| CommError::NcclUnavailable(e.to_string()))?;
    // SAFETY: only tries to dlopen the library; nothing is called.
    let present = unsafe { sys::is_culib_present() };
    if present {
        Ok(())
    } else {
        Err(CommError::NcclUnavailable(
            "libnccl could not be loaded (is libnccl.so on LD_LIBRARY_PATH?)".into(),
        ))
    }
}

/// The NCCL library version, e.g. 22809 for 2.28.9.
pub fn nccl_version() -> Result<i32, CommError> {
    nccl_library_status()?;
    cudarc::nccl::result::get_nccl_version().map_err(|e| nccl_error("ncclGetVersion", e.0, None))
}

/// A fresh NCCL unique id (rank 0 makes it and hands it out through the rendezvous).
pub fn unique_id() -> Result<[u8; 128], CommError> {
    nccl_library_status()?;
    let id = cudarc::nccl::result::get_uniqueid()
        .map_err(|e| nccl_error("ncclGetUniqueId", e.0, None))?;
    Ok(id.internal.map(|c| c as u8))
}

fn nccl_error(
    call: &'static str,
    code: sys::ncclResult_t,
    comm: Option<sys::ncclComm_t>,
) -> CommError {
    // SAFETY: ncclGetErrorString returns a static C string for any code (or null).
    let mut message = unsafe { c_string(sys::ncclGetErrorString(code)) };
    if let Some(c) = comm.filter(|c| !c.is_null()) {
        // SAFETY: `c` is a live communicator (callers hold its lock and checked it is not aborted).
        let last = unsafe { c_string(sys::ncclGetLastError(c)) };
        if !last.is_empty() {
            message = format!("{message}; {last}");
        }
    }
    CommError::Nccl {
        call,
        code: format!("{code:?}"),
        message,
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string valid for the duration of the call.
unsafe fn c_string(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: guaranteed by the caller.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

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

struct Handle {
    comm: sys::ncclComm_t,
    aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls are not concurrent; every
// use goes through the Mutex that owns this handle.
unsafe impl Send for Handle {}

struct Pending {
    op: &'static str,
    event: GpuEvent,
    deadline: Instant,
}

struct Shared {
    rank: usize,
    handle: Mutex<Handle>,
    failure: FailureFlag,
    pending: Mutex<Vec<Pending>>,
    stop: AtomicBool,
    timeout: Duration,
    poll: Duration,
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, Handle>, CommError> {
        self.handle
            .lock()
            .map_err(|_| CommError::Poisoned("NCCL handle lock poisoned".into()))
    }

    fn failure(&self) -> Option<CommError> {
        self.failure.lock().ok().and_then(|g| g.clone())
    }

    fn set_failure(&self, e: CommError) {
        if let Ok(mut g) = self.failure.lock() {
            if g.is_none() {
                *g = Some(e);
            }
        }
    }

    /// Records `e` and aborts the communicator (once). The lock must be held by the caller.
    fn abort_locked(&self, h: &mut Handle, e: CommError) {
        self.set_failure(e);
        if !h.aborted && !h.comm.is_null() {
            // SAFETY: the communicator is live (not aborted) and we hold its lock. Its result is not
            // used: after abort the handle is never touched again.
            unsafe {
                sys::ncclCommAbort(h.comm);
            }
        }
        h.aborted = true;
        if let Ok(mut p) = self.pending.lock() {
            p.clear();
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator is idle (`ncclSuccess`).
    fn wait_ready(&self, what: &'static str, deadline: Instant) -> Result<(), CommError> {
        loop {
            {
                let mut h = self.lock()?;
                if h.aborted {
                    return Err(self
                        .failure()
                        .unwrap_or_else(|| CommError::Aborted("communicator aborted".into())));
                }
                let mut st = sys::ncclResult_t::ncclSuccess;
                // SAFETY: live communicator under its lock; `st` is a valid out pointer.
                let r = unsafe { sys::ncclCommGetAsyncError(h.comm, &mut st) };
                if r != sys::ncclResult_t::ncclSuccess {
                    let e = nccl_error("ncclCommGetAsyncError", r, Some(h.comm));
                    self.abort_locked(&mut h, e.clone());
                    return Err(e);
                }
                match st {
                    sys::ncclResult_t::ncclSuccess => return Ok(()),
                    sys::ncclResult_t::ncclInProgress => {
                        if Instant::now() >= deadline {
                            let e = CommError::Aborted(format!(
                                "{what} was still in progress on rank {} after its deadline (a peer \
                                 did not join or is stuck)",
                                self.rank
                            ));
                            self.abort_locked(&mut h, e.clone());
                            return Err(e);
                        }
                    }
                    other => {
                        let e = nccl_error(what, other, Some(h.comm));
                        self.abort_locked(&mut h, e.clone());
                        return Err(e);
                    }
                }
            }
            std::thread::sleep(self.poll);
        }
    }
}

fn watchdog(shared: Arc<Shared>, ctx: Arc<cudarc::driver::CudaContext>) {
    // Event queries need the context current on this thread.
    let _ = ctx.bind_to_thread();
    // Coarser than host waits: deadlines are seconds to minutes, the lock is shared with issuing.
    let interval = (shared.poll * 10).min(Duration::from_millis(100));
    while !shared.stop.load(Ordering::Acquire) {
        std::thread::sleep(interval);
        let now = Instant::now();
        let expired = match shared.pending.lock() {
            Ok(mut p) => {
                p.retain(|w| !w.event.is_complete());
                p.iter().find(|w| now >= w.deadline).map(|w| w.op)
            }
            Err(_) => None,
        };
        let Ok(mut h) = shared.handle.lock() else {
            return;
        };
        if h.aborted {
            continue;
        }
        let mut st = sys::ncclResult_t::ncclSuccess;
        // SAFETY: live communicator under its lock; `st` is a valid out pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(h.comm, &mut st) };
        let err = if r != sys::ncclResult_t::ncclSuccess {
            Some(nccl_error("ncclCommGetAsyncError", r, Some(h.comm)))
        } else if !matches!(
            st,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) {
            Some(nccl_error("asynchronous operation", st, Some(h.comm)))
        } else {
            expired.map(|op| {
                CommError::Aborted(format!(
                    "NCCL {op} did not finish within {:?} on rank {} (a peer is missing, stuck or \
                     dead); the watchdog aborted the communicator",
                    shared.timeout, shared.rank
                ))
            })
        };
        if let Some(e) = err {
            shared.abort_locked(&mut h, e);
        }
    }
}

fn nccl_config(version: i32) -> sys::ncclConfig_t {
    // NCCL_CONFIG_INITIALIZER: undefined fields are INT_MIN / NULL so NCCL applies its defaults. NCCL
    // reads at most its own struct size and only the fields its `version` knows, so the newer layout
    // in cudarc's bindings is accepted by older 2.2x libraries.
    const UNDEF: std::ffi::c_int = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: version as std::ffi::c_uint,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
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
        let r = unsafe {
            sys::ncclCommInitRankConfig(&mut comm, world_size as i32, uid, rank as i32, &mut config)
        };
        if !matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) || comm.is_null()
        {
            let e = nccl_error("ncclCommInitRankConfig", r, None);
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed back; aborted once and never used again.
                unsafe {
                    sys::ncclCommAbort(comm);
                }
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
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
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
            let r = call(h.comm, stream.cu_stream() as sys::cudaStream_t);
            if !matches!(
                r,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            ) {
                let e = nccl_error(op, r, Some(h.comm));
                self.shared.abort_locked(&mut h, e.clone());
                return Err(e);
            }
            r
        };
        if r == sys::ncclResult_t::ncclInProgress {
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
        let r = unsafe { sys::ncclCommFinalize(h.comm) };
        let mut finalized = matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        );
        let deadline = Instant::now() + self.shared.timeout;
        while finalized {
            let mut st = sys::ncclResult_t::ncclSuccess;
            // SAFETY: live communicator under its lock; valid out pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(h.comm, &mut st) };
            if r != sys::ncclResult_t::ncclSuccess {
                finalized = false;
            } else if st == sys::ncclResult_t::ncclSuccess {
                break;
            } else if st != sys::ncclResult_t::ncclInProgress || Instant::now() >= deadline {
                finalized = false;
            } else {
                std::thread::sleep(self.shared.poll);
            }
        }
        // SAFETY: live communicator; it is released here and never used again.
        unsafe {
            if finalized {
                sys::ncclCommDestroy(h.comm);
            } else {
                sys::ncclCommAbort(h.comm);
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
        call.validate(self.world_size)?;
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
        // The pointer guards record the buffers' read/write events on the communication stream when
        // they drop, after the call is queued, so cudarc orders later uses and frees after it.
        match call {
            Collective::AllGather { send, recv } => {
                let (s, _gs) = self.send_ptr(send, &stream)?;
                let (r, _gr) = self.recv_ptr(recv, &stream)?;
                self.issue(name, |comm, st| {
                    // SAFETY: device pointers of live buffers with the validated lengths
                    // (recv = world_size * send elements) on this communicator's GPU.
                    unsafe {
                        sys::ncclAllGather(
                            s as usize as *const c_void,
                            r as usize as *mut c_void,
                            send_len,
                            dt,
                            comm,
                            st,
                        )
                    }
                })
            }
            Collective::ReduceScatter { send, recv, .. } => {
                let (s, _gs) = self.send_ptr(send, &stream)?;
                let (r, _gr) = self.recv_ptr(recv, &stream)?;
                self.issue(name, |comm, st| {
                    // SAFETY: validated lengths (send = world_size * recv elements), live buffers.
                    unsafe {
                        sys::ncclReduceScatter(
                            s as usize as *const c_void,
                            r as usize as *mut c_void,
                            recv_len,
                            dt,
                            red,
                            comm,
                            st,
                        )
                    }
                })
            }
            Collective::AllReduce { send, recv, .. } => {
                let (s, _gs) = self.send_ptr(send, &stream)?;
                let (r, _gr) = self.recv_ptr(recv, &stream)?;
                self.issue(name, |comm, st| {
                    // SAFETY: equal validated lengths, live buffers.
                    unsafe {
                        sys::ncclAllReduce(
                            s as usize as *const c_void,
                            r as usize as *mut c_void,
                            recv_len,
                            dt,
                            red,
                            comm,
                            st,
                        )
                    }
                })
            }
            Collective::AllReduceInPlace { buf, .. } => {
                let (p, _g) = self.recv_ptr(buf, &stream)?;
                self.issue(name, |comm, st| {
                    // SAFETY: in place (send == recv) is allowed by NCCL; live buffer.
                    unsafe {
                        sys::ncclAllReduce(
                            p as usize as *const c_void,
                            p as usize as *mut c_void,
                            recv_len,
                            dt,
                            red,
                            comm,
                            st,
                        )
                    }
                })
            }
            Collective::Broadcast { send, recv, root } => {
                let (s, _gs) = self.send_ptr(send, &stream)?;
                let (r, _gr) = self.recv_ptr(recv, &stream)?;
                self.issue(name, |comm, st| {
                    // SAFETY: equal validated lengths, root checked below world_size, live buffers.
                    unsafe {
                        sys::ncclBroadcast(
                            s as usize as *const c_void,
                            r as usize as *mut c_void,
                            recv_len,
                            dt,
                            root as i32,
                            comm,
                            st,
                        )
                    }
                })
            }
            Collective::BroadcastInPlace { buf, root } => {
                let (p, _g) = self.recv_ptr(buf, &stream)?;
                self.issue(name, |comm, st| {
                    // SAFETY: in place is allowed by NCCL; root checked; live buffer.
                    unsafe {
                        sys::ncclBroadcast(
                            p as usize as *const c_void,
                            p as usize as *mut c_void,
                            recv_len,
                            dt,
                            root as i32,
                            comm,
                            st,
                        )
                    }
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_and_ops_map_to_nccl_without_avg() {
        use sys::ncclDataType_t as T;
        assert_eq!(
            nccl_dtype(CommDType::Fp8(Fp8Format::E4M3), true),
            T::ncclFloat8e4m3
        );
        assert_eq!(
            nccl_dtype(CommDType::Fp8(Fp8Format::E5M2), true),
            T::ncclFloat8e5m2
        );
        assert_eq!(
            nccl_dtype(CommDType::Fp8(Fp8Format::E5M2), false),
            T::ncclUint8
        );
        assert_eq!(nccl_dtype(CommDType::BF16, true), T::ncclBfloat16);
        assert_eq!(nccl_dtype(CommDType::F16, true), T::ncclFloat16);
        assert_eq!(nccl_dtype(CommDType::F32, false), T::ncclFloat32);
        assert_eq!(nccl_dtype(CommDType::Bytes, false), T::ncclUint8);
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            assert_ne!(nccl_op(op), sys::ncclRedOp_t::ncclAvg);
        }
        assert_eq!(
            <Fp8E4M3Byte as cudarc::nccl::NcclType>::as_nccl_type(),
            T::ncclFloat8e4m3
        );
        assert_eq!(std::mem::size_of::<Fp8E5M2Byte>(), 1);
    }

    #[test]
    fn config_is_non_blocking_with_nccl_defaults() {
        let c = nccl_config(22809);
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.version, 22809);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(c.minCTAs, i32::MIN);
        assert!(c.netName.is_null());
    }

    #[test]
    fn missing_nccl_is_an_error_not_a_panic() {
        if nccl_library_status().is_ok() {
            println!(
                "skipped: NCCL is present here (the GPU path is checked by the nccl_check binary)"
            );
            return;
        }
        assert!(matches!(unique_id(), Err(CommError::NcclUnavailable(_))));
        assert!(matches!(nccl_version(), Err(CommError::NcclUnavailable(_))));
        let e = NcclComm::from_dist_env(&DistEnv::single(), &NcclConfig::default()).unwrap_err();
        assert!(matches!(e, CommError::NcclUnavailable(_)), "{e}");
    }
}
