//! The shared state of an NCCL communicator (its handle under a lock, the recorded failure, the queued
//! collectives with their deadlines) and the watchdog thread that aborts the communicator when NCCL
//! reports an error or a collective misses its deadline.

use super::library::{async_state, nccl_error};
use crate::collective::FailureFlag;
use crate::error::CommError;
use cudarc::nccl::{result, sys};
use fp8_kernels::GpuEvent;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(super) struct Handle {
    pub(super) comm: sys::ncclComm_t,
    pub(super) aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls are not concurrent; every
// use goes through the Mutex that owns this handle.
unsafe impl Send for Handle {}

pub(super) struct Pending {
    pub(super) op: &'static str,
    pub(super) event: GpuEvent,
    pub(super) deadline: Instant,
}

pub(super) struct Shared {
    pub(super) rank: usize,
    pub(super) handle: Mutex<Handle>,
    pub(super) failure: FailureFlag,
    pub(super) pending: Mutex<Vec<Pending>>,
    pub(super) stop: AtomicBool,
    pub(super) timeout: Duration,
    pub(super) poll: Duration,
}

impl Shared {
    pub(super) fn lock(&self) -> Result<MutexGuard<'_, Handle>, CommError> {
        self.handle
            .lock()
            .map_err(|_| CommError::Poisoned("NCCL handle lock poisoned".into()))
    }

    pub(super) fn failure(&self) -> Option<CommError> {
        self.failure.lock().ok().and_then(|g| g.clone())
    }

    pub(super) fn set_failure(&self, e: CommError) {
        if let Ok(mut g) = self.failure.lock() {
            if g.is_none() {
                *g = Some(e);
            }
        }
    }

    /// Records `e` and aborts the communicator (once). The lock must be held by the caller.
    pub(super) fn abort_locked(&self, h: &mut Handle, e: CommError) {
        self.set_failure(e);
        if !h.aborted && !h.comm.is_null() {
            // SAFETY: the communicator is live (not aborted) and we hold its lock. Its result is not
            // used: after abort the handle is never touched again.
            let _ = unsafe { result::comm_abort(h.comm) };
        }
        h.aborted = true;
        if let Ok(mut p) = self.pending.lock() {
            p.clear();
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator is idle (`ncclSuccess`).
    pub(super) fn wait_ready(
        &self,
        what: &'static str,
        deadline: Instant,
    ) -> Result<(), CommError> {
        loop {
            {
                let mut h = self.lock()?;
                if h.aborted {
                    return Err(self
                        .failure()
                        .unwrap_or_else(|| CommError::Aborted("communicator aborted".into())));
                }
                // SAFETY: live communicator (not aborted) under its lock.
                let st = match unsafe { async_state(h.comm) } {
                    Ok(st) => st,
                    Err(r) => {
                        let e = nccl_error("ncclCommGetAsyncError", r, Some(h.comm));
                        self.abort_locked(&mut h, e.clone());
                        return Err(e);
                    }
                };
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

pub(super) fn watchdog(shared: Arc<Shared>, ctx: Arc<cudarc::driver::CudaContext>) {
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
        // SAFETY: live communicator (not aborted) under its lock.
        let err = match unsafe { async_state(h.comm) } {
            Err(r) => Some(nccl_error("ncclCommGetAsyncError", r, Some(h.comm))),
            Ok(sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => None,
            Ok(st) => Some(nccl_error("asynchronous operation", st, Some(h.comm))),
        };
        let err = err.or_else(|| {
            expired.map(|op| {
                CommError::Aborted(format!(
                    "NCCL {op} did not finish within {:?} on rank {} (a peer is missing, stuck or \
                     dead); the watchdog aborted the communicator",
                    shared.timeout, shared.rank
                ))
            })
        });
        if let Some(e) = err {
            shared.abort_locked(&mut h, e);
        }
    }
}
