//! A small RAII wrapper over cuBLASLt (`cudarc::cublaslt::{result, sys}`): cudarc's safe cuBLASLt API has
//! no FP8 matmul, so this module owns the handle, a 32 MiB workspace, and a cache of matmul descriptors,
//! matrix layouts and the heuristic's algorithm per problem shape.
//!
//! One [`BlasLt`] exists per [`CudaDevice`] (created on first use and kept in the device's state slots),
//! and every call runs on the device's compute stream, so the workspace is never used by two GEMMs at once.
//!
//! It speaks cuBLASLt's column-major terms only ([`ColMajorMatmul`]); `cuda.rs` maps the family's
//! row-major GEMMs onto it.

use crate::{CudaDevice, KernelError};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, DevicePtrMut};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Workspace handed to cuBLASLt (its recommendation for Hopper is 32 MiB).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// The cuBLASLt state of one device: handle, workspace, preference and cached plans.
pub(crate) struct BlasLt {
    state: Mutex<State>,
}

impl std::fmt::Debug for BlasLt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plans = self.state.lock().map(|s| s.plans.len()).unwrap_or(0);
        write!(f, "BlasLt({plans} cached plans)")
    }
}

/// Elements between the two scale slots of the scratch buffer (keeps both 128-byte aligned).
const SCALE_SLOT: usize = 32;

struct State {
    handle: sys::cublasLtHandle_t,
    pref: sys::cublasLtMatmulPreference_t,
    workspace: CudaSlice<u8>,
    /// Aligned home for A/B scales whose address is not 16-byte aligned (e.g. `scale_inv` stored right
    /// after `scale` in a pair buffer): cuBLASLt answers NOT_SUPPORTED for such scale pointers, so the
    /// value is copied here on the stream first.
    scale_scratch: CudaSlice<f32>,
    plans: HashMap<PlanKey, Plan>,
}

// SAFETY: the raw cuBLASLt handles are only used while the mutex around `State` is held, and cuBLASLt
// handles may be used from any thread as long as calls are not concurrent.
unsafe impl Send for State {}

impl Drop for State {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `BlasLt::new` and destroyed exactly once, here. Errors cannot be reported
        // from a drop; the process keeps running either way.
        unsafe {
            let _ = lt::destroy_matmul_pref(self.pref);
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// Identifies a column-major matmul problem whose descriptor, layouts and algorithm can be reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    pub(crate) a_type: sys::cudaDataType_t,
    pub(crate) b_type: sys::cudaDataType_t,
    pub(crate) cd_type: sys::cudaDataType_t,
    pub(crate) compute: sys::cublasComputeType_t,
    pub(crate) trans_a: bool,
    pub(crate) trans_b: bool,
    pub(crate) m: u64,
    pub(crate) n: u64,
    pub(crate) k: u64,
    pub(crate) lda: i64,
    pub(crate) ldb: i64,
    pub(crate) ldd: i64,
    /// A and B carry scale pointers (FP8).
    pub(crate) scaled: bool,
    pub(crate) fast_accum: bool,
    /// cuBLASLt's scale modes of A and B (`cublasLtMatmulMatrixScale_t`): [`SCALE_SCALAR`] for one f32
    /// each, [`SCALE_VEC128`] or [`SCALE_BLK128X128`] for block scales.
    pub(crate) a_scale_mode: u32,
    pub(crate) b_scale_mode: u32,
}

/// One f32 scale for the whole matrix (cuBLASLt's default mode).
pub(crate) const SCALE_SCALAR: u32 =
    sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F as u32;
/// One f32 scale per 128 elements along K (1x128 tiles of a K-major operand).
pub(crate) const SCALE_VEC128: u32 =
    sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as u32;
/// One f32 scale per 128x128 block.
pub(crate) const SCALE_BLK128X128: u32 =
    sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as u32;

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    cd: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each object was created in `State::plan` and is destroyed once, here. Null handles
        // (a plan whose creation failed midway) are skipped.
        unsafe {
            if !self.cd.is_null() {
                let _ = lt::destroy_matrix_layout(self.cd);
            }
            if !self.b.is_null() {
                let _ = lt::destroy_matrix_layout(self.b);
            }
            if !self.a.is_null() {
                let _ = lt::destroy_matrix_layout(self.a);
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// One column-major matmul: `D[m, n] = alpha * op(A) op(B) + beta * D` (C aliases D), on device
/// addresses that the caller keeps alive (and ordered on the device's stream) until it is queued.
pub(crate) struct ColMajorMatmul {
    pub(crate) key: PlanKey,
    pub(crate) a: u64,
    pub(crate) b: u64,
    pub(crate) d: u64,
    pub(crate) alpha: f32,
    pub(crate) beta: f32,
    /// Addresses of the f32 scales of A and B (FP8): any alignment for one scale ([`SCALE_SCALAR`]),
    /// 16-byte aligned block scales in the order cuBLASLt reads them otherwise.
    pub(crate) a_scale: Option<u64>,
    pub(crate) b_scale: Option<u64>,
}

const OP_N: i32 = 0;
const OP_T: i32 = 1;

impl State {
    fn create_plan(
        handle: sys::cublasLtHandle_t,
        pref: sys::cublasLtMatmulPreference_t,
        key: &PlanKey,
    ) -> Result<Plan, KernelError> {
        let mut plan = Plan {
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            cd: std::ptr::null_mut(),
            // SAFETY: the algorithm struct is plain data (an array of u64); zero is a valid placeholder
            // that is overwritten by the heuristic below before any use.
            algo: unsafe { std::mem::zeroed() },
        };
        plan.desc = lt::create_matmul_desc(key.compute, sys::cudaDataType_t::CUDA_R_32F)?;
        let (ta, tb) = (
            if key.trans_a { OP_T } else { OP_N },
            if key.trans_b { OP_T } else { OP_N },
        );
        // SAFETY: `plan.desc` is a live descriptor; each buffer points to a value of the size passed.
        unsafe {
            set_desc(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &ta,
            )?;
            set_desc(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &tb,
            )?;
            if key.scaled {
                // The heuristic needs to know that scale pointers will be set; any non-null address
                // serves here, the real ones are set before each launch.
                let placeholder: u64 = 256;
                set_desc(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    &placeholder,
                )?;
                set_desc(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    &placeholder,
                )?;
                let fast: i8 = i8::from(key.fast_accum);
                set_desc(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                    &fast,
                )?;
                // Block scales: the modes tell cuBLASLt how to read the scale pointers (the scalar
                // default is left unset, as before block scales existed).
                if key.a_scale_mode != SCALE_SCALAR || key.b_scale_mode != SCALE_SCALAR {
                    set_desc(
                        plan.desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                        &key.a_scale_mode,
                    )?;
                    set_desc(
                        plan.desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                        &key.b_scale_mode,
                    )?;
                }
            }
        }
        let (a_rows, a_cols) = if key.trans_a {
            (key.k, key.m)
        } else {
            (key.m, key.k)
        };
        let (b_rows, b_cols) = if key.trans_b {
            (key.n, key.k)
        } else {
            (key.k, key.n)
        };
        plan.a = lt::create_matrix_layout(key.a_type, a_rows, a_cols, key.lda)?;
        plan.b = lt::create_matrix_layout(key.b_type, b_rows, b_cols, key.ldb)?;
        plan.cd = lt::create_matrix_layout(key.cd_type, key.m, key.n, key.ldd)?;
        // SAFETY: all descriptors are live; the heuristic only reads them.
        let heur = unsafe {
            lt::get_matmul_algo_heuristic(
                handle, plan.desc, plan.a, plan.b, plan.cd, plan.cd, pref,
            )?
        };
        plan.algo = heur.algo;
        Ok(plan)
    }
}

/// Sets one matmul-descriptor attribute from a typed value.
///
/// # Safety
/// `desc` must be a live descriptor and `T` the attribute's type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), KernelError> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        value as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )?;
    Ok(())
}

impl BlasLt {
    /// Creates the handle, preference and workspace for `dev`.
    fn new(dev: &CudaDevice) -> Result<Self, KernelError> {
        // cuBLASLt uses the calling thread's current context.
        dev.context().bind_to_thread()?;
        let workspace = dev.stream().alloc_zeros::<u8>(WORKSPACE_BYTES)?;
        let scale_scratch = dev.stream().alloc_zeros::<f32>(2 * SCALE_SLOT)?;
        let handle = lt::create_handle()?;
        let pref = match lt::create_matmul_pref() {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the handle was just created and is not used elsewhere.
                unsafe {
                    let _ = lt::destroy_handle(handle);
                }
                return Err(e.into());
            }
        };
        let state = State {
            handle,
            pref,
            workspace,
            scale_scratch,
            plans: HashMap::new(),
        };
        let ws: u64 = WORKSPACE_BYTES as u64;
        // SAFETY: `pref` is live; the attribute is a u64 byte count.
        unsafe {
            lt::set_matmul_pref_attribute(
                state.pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )?;
        }
        Ok(BlasLt {
            state: Mutex::new(state),
        })
    }

    /// The instance of `dev`, created on first use.
    pub(crate) fn for_device(dev: &CudaDevice) -> Result<Arc<BlasLt>, KernelError> {
        dev.state(BlasLt::new)
    }

    /// Queues `mm` on the device's compute stream.
    ///
    /// # Safety
    /// `mm.a`, `mm.b` and `mm.d` must be addresses of buffers of `dev` holding at least the matrices
    /// `mm.key` describes (rows, columns, leading dimensions and types), and the scale addresses those of
    /// one f32 each; all must stay allocated, and be ordered on the device's compute stream, until the
    /// matmul has run (a cudarc slice guard held across the call does both).
    pub(crate) unsafe fn run(
        &self,
        dev: &CudaDevice,
        mm: &ColMajorMatmul,
    ) -> Result<(), KernelError> {
        let mut guard = self
            .state
            .lock()
            .map_err(|_| KernelError::Internal("cuBLASLt state lock poisoned".into()))?;
        dev.context().bind_to_thread()?;
        let stream = dev.stream().clone();
        let state = &mut *guard;
        let (handle, pref) = (state.handle, state.pref);
        let plan = match state.plans.entry(mm.key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(State::create_plan(handle, pref, &mm.key)?)
            }
        };
        let (ws_ptr, _ws_guard) = state.workspace.device_ptr_mut(&stream);
        let (scratch, _scratch_guard) = state.scale_scratch.device_ptr_mut(&stream);
        let mut aligned = [0u64; 2];
        if let (Some(sa), Some(sb)) = (mm.a_scale, mm.b_scale) {
            let modes = [mm.key.a_scale_mode, mm.key.b_scale_mode];
            for (i, p) in [sa, sb].into_iter().enumerate() {
                aligned[i] = if p % 16 == 0 {
                    p
                } else if modes[i] != SCALE_SCALAR {
                    // Block scales are whole buffers (always aligned); a copy of one value would not do.
                    return Err(KernelError::Internal(format!(
                        "block scales at {p:#x} are not 16-byte aligned"
                    )));
                } else {
                    let dst = scratch + (i * SCALE_SLOT * std::mem::size_of::<f32>()) as u64;
                    // SAFETY: `p` addresses one f32 of a live device buffer (the caller's contract), `dst` a
                    // slot of the scratch buffer owned by this state; the copy is ordered on the stream
                    // before the GEMM that reads it.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            dst,
                            p,
                            std::mem::size_of::<f32>(),
                            stream.cu_stream(),
                        )?
                    };
                    dst
                };
            }
        }
        // SAFETY: the descriptor is live; scale pointers are device addresses of f32 values that stay
        // allocated until the GEMM has run (the callers hold the buffers across this call and the
        // stream orders later frees after it).
        unsafe {
            if let (Some(_), Some(_)) = (mm.a_scale, mm.b_scale) {
                let (sa, sb) = (aligned[0], aligned[1]);
                set_desc(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    &sa,
                )?;
                set_desc(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    &sb,
                )?;
            }
            lt::matmul(
                handle,
                plan.desc,
                &mm.alpha as *const f32 as *const c_void,
                &mm.beta as *const f32 as *const c_void,
                mm.a as *const c_void,
                plan.a,
                mm.b as *const c_void,
                plan.b,
                mm.d as *const c_void,
                plan.cd,
                mm.d as *mut c_void,
                plan.cd,
                &plan.algo,
                ws_ptr as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )?;
        }
        Ok(())
    }
}
