//! The NCCL library through cudarc: element types and reductions, whether the library loads, its
//! version and unique ids, call outcomes and errors, and the non-blocking init configuration. Calls go
//! through `cudarc::nccl::result`; the raw bindings (`sys`) are used where `result` has no wrapper.

use crate::collective::{CommDType, ReduceOp};
use crate::error::CommError;
use cudarc::nccl::result::{self, NcclError, NcclStatus};
use cudarc::nccl::sys;
use fp8_core::Fp8Format;
use std::ffi::CStr;

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
    result::get_nccl_version().map_err(|e| nccl_error("ncclGetVersion", e.0, None))
}

/// A fresh NCCL unique id (rank 0 makes it and hands it out through the rendezvous).
pub fn unique_id() -> Result<[u8; 128], CommError> {
    nccl_library_status()?;
    let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e.0, None))?;
    Ok(id.internal.map(|c| c as u8))
}

/// Where an NCCL call left its operation (a non-blocking communicator may return before it is done).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Progress {
    /// The operation completed.
    Done,
    /// The operation is still being enqueued or run (non-blocking communicator).
    InProgress,
}

/// The outcome of a call through `cudarc::nccl::result`: `ncclSuccess` and `ncclInProgress` are
/// progress, every other code (`ncclNumResults` included, which `result` passes as a status) the
/// failing code.
pub(super) fn progress(r: Result<NcclStatus, NcclError>) -> Result<Progress, sys::ncclResult_t> {
    match r {
        Ok(NcclStatus::Success) => Ok(Progress::Done),
        Ok(NcclStatus::InProgress) => Ok(Progress::InProgress),
        Ok(NcclStatus::NumResults) => Err(sys::ncclResult_t::ncclNumResults),
        Err(e) => Err(e.0),
    }
}

/// `ncclCommGetAsyncError` (cudarc has no wrapper for it): `Ok(state)` of the communicator's
/// asynchronous operations (`ncclSuccess` idle, `ncclInProgress`, or their error), or `Err(code)` when
/// the query itself failed.
///
/// # Safety
/// `comm` must be a live (not aborted, not destroyed) communicator that no other thread uses during the
/// call.
pub(super) unsafe fn async_state(
    comm: sys::ncclComm_t,
) -> Result<sys::ncclResult_t, sys::ncclResult_t> {
    let mut state = sys::ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is live and exclusively ours (the caller's contract); `state` is a valid out
    // pointer for the duration of the call.
    let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
    if r == sys::ncclResult_t::ncclSuccess {
        Ok(state)
    } else {
        Err(r)
    }
}

pub(super) fn nccl_error(
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

pub(super) fn nccl_config(version: i32) -> sys::ncclConfig_t {
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
}
