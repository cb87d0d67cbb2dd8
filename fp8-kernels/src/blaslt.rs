//! A small RAII wrapper over cuBLASLt (`cudarc::cublaslt::{result, sys}`): cudarc's safe cuBLASLt API has
//! no FP8 matmul, so this module owns the handle, a 32 MiB workspace, and a cache of matmul descriptors,
//! matrix layouts and the heuristic's algorithm per problem shape.
//!
//! One [`BlasLt`] exists per [`CudaDevice`] (created on first use and kept in the device), and every call
//! runs on the device's compute stream, so the workspace is never used by two GEMMs at once.
//!
//! The public entry points are the GEMM functions of [`crate::gemm`]; this module maps their row-major
//! problems onto cuBLASLt's column-major ones: row-major `C[m, n] = op(A) op(B)` is column-major
//! `C^T[n, m] = op(B)^T op(A)^T`, so B becomes cuBLASLt's "A" and A its "B".

use crate::device::cuda_slice;
use crate::gemm::{DeviceScalar, Fp8Matrix, GemmOutput, GemmSpec, Transpose};
use crate::kernel_source::KernelModule;
use crate::{Buffer, CudaDevice, DType, Device, Element, KernelError};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use fp8_core::Fp8Format;
use half::bf16;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Workspace handed to cuBLASLt (its recommendation for Hopper is 32 MiB).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// cuBLASLt FP8 wants every dimension to be a multiple of this.
pub const FP8_DIM_MULTIPLE: usize = 16;

/// The layout kernels of the FP8 GEMM path: re-layout/padding of operands, un-padding of results, FP8 to
/// BF16 for E5M2 x E5M2.
pub const GEMM_LAYOUT_MODULE: KernelModule = KernelModule {
    name: "fp8_kernels_gemm_layout",
    files: &["common.cuh", "gemm_layout.cu"],
    source: concat!(
        include_str!("../cuda/common.cuh"),
        include_str!("../cuda/gemm_layout.cu")
    ),
};

/// The cuBLASLt state of one device: handle, workspace, preference and cached plans.
pub struct BlasLt {
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
struct PlanKey {
    a_type: sys::cudaDataType_t,
    b_type: sys::cudaDataType_t,
    cd_type: sys::cudaDataType_t,
    compute: sys::cublasComputeType_t,
    trans_a: bool,
    trans_b: bool,
    m: u64,
    n: u64,
    k: u64,
    lda: i64,
    ldb: i64,
    ldd: i64,
    scaled: bool,
    fast_accum: bool,
}

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

/// One column-major matmul: `D[m, n] = alpha * op(A) op(B) + beta * D` (C aliases D).
struct ColMajorMatmul {
    key: PlanKey,
    a: u64,
    b: u64,
    d: u64,
    alpha: f32,
    beta: f32,
    a_scale: Option<u64>,
    b_scale: Option<u64>,
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
    pub fn new(dev: &CudaDevice) -> Result<Self, KernelError> {
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
    pub fn for_device(dev: &CudaDevice) -> Result<Arc<BlasLt>, KernelError> {
        let slot = dev.blaslt_slot();
        if let Some(b) = slot.get() {
            return Ok(b.clone());
        }
        let created = Arc::new(BlasLt::new(dev)?);
        // Another thread may have won the race; either instance is fine, keep the stored one.
        let _ = slot.set(created);
        slot.get()
            .cloned()
            .ok_or_else(|| KernelError::Internal("cuBLASLt slot empty after set".into()))
    }

    /// Number of cached plans (descriptor + layouts + algorithm per shape).
    pub fn cached_plans(&self) -> usize {
        self.state.lock().map(|s| s.plans.len()).unwrap_or(0)
    }

    fn run(&self, dev: &CudaDevice, mm: &ColMajorMatmul) -> Result<(), KernelError> {
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
            for (i, p) in [sa, sb].into_iter().enumerate() {
                aligned[i] = if p % 16 == 0 {
                    p
                } else {
                    let dst = scratch + (i * SCALE_SLOT * std::mem::size_of::<f32>()) as u64;
                    // SAFETY: `p` addresses one f32 inside a live device buffer (checked by
                    // `scalar_ptr`), `dst` a slot of the scratch buffer owned by this state; the copy is
                    // ordered on the stream before the GEMM that reads it.
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

/// cuBLASLt type tags of the element types GEMMs take.
fn cuda_type(d: DType) -> Result<sys::cudaDataType_t, KernelError> {
    match d {
        DType::F32 => Ok(sys::cudaDataType_t::CUDA_R_32F),
        DType::BF16 => Ok(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType_t::CUDA_R_16F),
        other => Err(KernelError::InvalidArgument {
            what: "gemm",
            detail: format!("{other} is not a GEMM element type"),
        }),
    }
}

fn fp8_type(f: Fp8Format) -> sys::cudaDataType_t {
    match f {
        Fp8Format::E4M3 => sys::cudaDataType_t::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => sys::cudaDataType_t::CUDA_R_8F_E5M2,
    }
}

fn same_device(what: &'static str, dev: &CudaDevice, other: &Device) -> Result<(), KernelError> {
    if *other == Device::Cuda(dev.clone()) {
        Ok(())
    } else {
        Err(KernelError::WrongDevice(what))
    }
}

fn grid_1d(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn to_i64(what: &'static str, x: usize) -> Result<i64, KernelError> {
    i64::try_from(x).map_err(|_| KernelError::InvalidArgument {
        what,
        detail: format!("{x} does not fit in i64"),
    })
}

/// `c = beta * c` on the device (the empty-sum GEMM, k = 0).
fn scale_output<O: GemmOutput>(
    dev: &CudaDevice,
    rows: usize,
    cols: usize,
    beta: f32,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    if beta == 0.0 {
        return c.fill_zero();
    }
    let zeros = dev.stream().alloc_zeros::<f32>(rows * cols)?;
    unpad_into(dev, &zeros, cols, rows, cols, beta, c)
}

/// `c[i, j] = tmp[i * ld + j] + beta * c[i, j]` over the `rows x cols` of `c`.
fn unpad_into<O: GemmOutput>(
    dev: &CudaDevice,
    tmp: &CudaSlice<f32>,
    ld: usize,
    rows: usize,
    cols: usize,
    beta: f32,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    let module = dev.load_kernel_module(&GEMM_LAYOUT_MODULE)?;
    let name = match O::DTYPE {
        DType::F32 => "gemm_unpad_f32",
        DType::BF16 => "gemm_unpad_bf16",
        other => {
            return Err(KernelError::InvalidArgument {
                what: "gemm output",
                detail: format!("{other} is not a GEMM output type"),
            })
        }
    };
    let f = module.load_function(name)?;
    let (ld, r, cl) = (
        to_i64("gemm", ld)?,
        to_i64("gemm", rows)?,
        to_i64("gemm", cols)?,
    );
    let (cs, _) = c
        .as_cuda_mut()
        .ok_or(KernelError::WrongDevice("gemm output"))?;
    let stream = dev.stream();
    let mut launch = stream.launch_builder(&f);
    launch.arg(tmp).arg(&ld).arg(&r).arg(&cl).arg(&beta).arg(cs);
    // SAFETY: the kernel reads `rows x cols` entries of `tmp` at stride `ld` (tmp holds at least
    // `rows * ld` values, cols <= ld) and writes the `rows * cols` elements of `c`; argument types match
    // the kernel signature (const float*, 3 x long long, float, float*/unsigned short*).
    unsafe { launch.launch(grid_1d(rows * cols)) }?;
    Ok(())
}

/// Copies `op(src)` (src is `src_rows x src_cols` codes) into a zero-padded `dst_rows x dst_cols` buffer.
fn relayout_u8(
    dev: &CudaDevice,
    src: &CudaSlice<u8>,
    src_rows: usize,
    src_cols: usize,
    transpose: bool,
    dst_rows: usize,
    dst_cols: usize,
) -> Result<CudaSlice<u8>, KernelError> {
    let module = dev.load_kernel_module(&GEMM_LAYOUT_MODULE)?;
    let f = module.load_function("gemm_relayout_u8")?;
    let stream = dev.stream();
    // SAFETY: every element is written by the kernel below (zeros outside the source).
    let mut dst = unsafe { stream.alloc::<u8>(dst_rows * dst_cols) }?;
    let (sr, sc, dr, dc) = (
        to_i64("gemm", src_rows)?,
        to_i64("gemm", src_cols)?,
        to_i64("gemm", dst_rows)?,
        to_i64("gemm", dst_cols)?,
    );
    let tr: i32 = i32::from(transpose);
    let grid_x =
        u32::try_from(dst_cols.div_ceil(32)).map_err(|_| KernelError::InvalidArgument {
            what: "gemm",
            detail: format!("{dst_cols} columns are too many for one grid"),
        })?;
    let grid_y = dst_rows.div_ceil(32).clamp(1, 65535) as u32;
    let cfg = LaunchConfig {
        grid_dim: (grid_x.max(1), grid_y, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(src)
        .arg(&sr)
        .arg(&sc)
        .arg(&tr)
        .arg(&mut dst)
        .arg(&dr)
        .arg(&dc);
    // SAFETY: the kernel reads src within `src_rows x src_cols` (its length) and writes dst within
    // `dst_rows x dst_cols` (its length); the argument types match the kernel signature.
    unsafe { launch.launch(cfg) }?;
    Ok(dst)
}

/// F32 or BF16 GEMM (any transposes, any shape) through cuBLASLt.
pub(crate) fn gemm_float<T: Element, O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: &Buffer<T>,
    b: &Buffer<T>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    same_device("gemm: A", dev, &a.device())?;
    same_device("gemm: B", dev, &b.device())?;
    let (m, n, k) = (spec.m, spec.n, spec.k);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        return scale_output(dev, m, n, spec.beta, c);
    }
    let in_type = cuda_type(T::DTYPE)?;
    let compute = if T::DTYPE == DType::F32 && spec.allow_tf32 {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    let key = PlanKey {
        a_type: in_type,
        b_type: in_type,
        cd_type: cuda_type(O::DTYPE)?,
        compute,
        trans_a: spec.trans_b.is_yes(),
        trans_b: spec.trans_a.is_yes(),
        m: n as u64,
        n: m as u64,
        k: k as u64,
        lda: to_i64("gemm", if spec.trans_b.is_yes() { k } else { n })?,
        ldb: to_i64("gemm", if spec.trans_a.is_yes() { m } else { k })?,
        ldd: to_i64("gemm", n)?,
        scaled: false,
        fast_accum: false,
    };
    let blas = BlasLt::for_device(dev)?;
    let stream = dev.stream().clone();
    let (pa, _ga) = cuda_slice(a, "gemm: A")?.device_ptr(&stream);
    let (pb, _gb) = cuda_slice(b, "gemm: B")?.device_ptr(&stream);
    let (cs, _) = c.as_cuda_mut().ok_or(KernelError::WrongDevice("gemm: C"))?;
    let (pd, _gd) = cs.device_ptr_mut(&stream);
    blas.run(
        dev,
        &ColMajorMatmul {
            key,
            a: pb,
            b: pa,
            d: pd,
            alpha: spec.alpha,
            beta: spec.beta,
            a_scale: None,
            b_scale: None,
        },
    )
}

fn scalar_ptr(
    what: &'static str,
    s: &DeviceScalar<'_>,
    stream: &Arc<cudarc::driver::CudaStream>,
) -> Result<u64, KernelError> {
    let slice = cuda_slice(s.buffer, what)?;
    if s.index >= slice.len() {
        return Err(KernelError::InvalidArgument {
            what,
            detail: format!("scale index {} out of {}", s.index, slice.len()),
        });
    }
    let (p, _g) = slice.device_ptr(stream);
    Ok(p + (s.index * std::mem::size_of::<f32>()) as u64)
}

/// FP8 GEMM through cuBLASLt, re-laying out or padding operands that break its FP8 rules.
pub(crate) fn gemm_fp8<O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: Fp8Matrix<'_>,
    b: Fp8Matrix<'_>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    dev.require_fp8()?;
    for (what, d) in [
        ("gemm_fp8: A", a.data.device()),
        ("gemm_fp8: B", b.data.device()),
        ("gemm_fp8: A scale", a.scale_inv.buffer.device()),
        ("gemm_fp8: B scale", b.scale_inv.buffer.device()),
    ] {
        same_device(what, dev, &d)?;
    }
    let (m, n, k) = (spec.m, spec.n, spec.k);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if a.format == Fp8Format::E5M2 && b.format == Fp8Format::E5M2 {
        return gemm_e5m2_pair_as_bf16(dev, spec, a, b, c);
    }
    let stream = dev.stream().clone();
    let fits = [m, n, k]
        .iter()
        .all(|&d| d > 0 && d % FP8_DIM_MULTIPLE == 0);
    let pad = |d: usize| d.div_ceil(FP8_DIM_MULTIPLE).max(1) * FP8_DIM_MULTIPLE;
    let (mp, np, kp) = if fits {
        (m, n, k)
    } else {
        (pad(m), pad(n), pad(k))
    };

    let a_src = cuda_slice(a.data, "gemm_fp8: A")?;
    let b_src = cuda_slice(b.data, "gemm_fp8: B")?;
    // A must be [m, k] row-major (K-major), B must be [n, k] row-major.
    let a_tmp = if fits && !spec.trans_a.is_yes() {
        None
    } else {
        let (sr, sc) = if spec.trans_a.is_yes() {
            (k, m)
        } else {
            (m, k)
        };
        Some(relayout_u8(
            dev,
            a_src,
            sr,
            sc,
            spec.trans_a.is_yes(),
            mp,
            kp,
        )?)
    };
    let b_tmp = if fits && spec.trans_b.is_yes() {
        None
    } else {
        let (sr, sc) = if spec.trans_b.is_yes() {
            (n, k)
        } else {
            (k, n)
        };
        Some(relayout_u8(
            dev,
            b_src,
            sr,
            sc,
            !spec.trans_b.is_yes(),
            np,
            kp,
        )?)
    };
    let a_use = a_tmp.as_ref().unwrap_or(a_src);
    let b_use = b_tmp.as_ref().unwrap_or(b_src);
    let sa = scalar_ptr("gemm_fp8: A scale", &a.scale_inv, &stream)?;
    let sb = scalar_ptr("gemm_fp8: B scale", &b.scale_inv, &stream)?;
    let blas = BlasLt::for_device(dev)?;
    let (pa, _ga) = a_use.device_ptr(&stream);
    let (pb, _gb) = b_use.device_ptr(&stream);
    let key = |cd_type| -> Result<PlanKey, KernelError> {
        Ok(PlanKey {
            a_type: fp8_type(b.format),
            b_type: fp8_type(a.format),
            cd_type,
            compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            trans_a: true,
            trans_b: false,
            m: np as u64,
            n: mp as u64,
            k: kp as u64,
            lda: to_i64("gemm", kp)?,
            ldb: to_i64("gemm", kp)?,
            ldd: to_i64("gemm", np)?,
            scaled: true,
            fast_accum: spec.fp8_fast_accum,
        })
    };
    if fits {
        let cd_type = cuda_type(O::DTYPE)?;
        let (cs, _) = c
            .as_cuda_mut()
            .ok_or(KernelError::WrongDevice("gemm_fp8: C"))?;
        let (pd, _gd) = cs.device_ptr_mut(&stream);
        blas.run(
            dev,
            &ColMajorMatmul {
                key: key(cd_type)?,
                a: pb,
                b: pa,
                d: pd,
                alpha: spec.alpha,
                beta: spec.beta,
                a_scale: Some(sb),
                b_scale: Some(sa),
            },
        )
    } else {
        // SAFETY: the GEMM below writes every element (beta = 0).
        let mut tmp = unsafe { stream.alloc::<f32>(mp * np) }?;
        {
            let (pd, _gd) = tmp.device_ptr_mut(&stream);
            blas.run(
                dev,
                &ColMajorMatmul {
                    key: key(sys::cudaDataType_t::CUDA_R_32F)?,
                    a: pb,
                    b: pa,
                    d: pd,
                    alpha: spec.alpha,
                    beta: 0.0,
                    a_scale: Some(sb),
                    b_scale: Some(sa),
                },
            )?;
        }
        unpad_into(dev, &tmp, np, m, n, spec.beta, c)
    }
}

/// E5M2 x E5M2 has no cuBLASLt FP8 kernel: dequantize both to BF16 (exact for power-of-two scales) and
/// run a BF16 GEMM.
fn gemm_e5m2_pair_as_bf16<O: GemmOutput>(
    dev: &CudaDevice,
    spec: &GemmSpec,
    a: Fp8Matrix<'_>,
    b: Fp8Matrix<'_>,
    c: &mut Buffer<O>,
) -> Result<(), KernelError> {
    let a16 = fp8_to_bf16(dev, &a)?;
    let b16 = fp8_to_bf16(dev, &b)?;
    gemm_float(dev, spec, &a16, &b16, c)
}

fn fp8_to_bf16(dev: &CudaDevice, x: &Fp8Matrix<'_>) -> Result<Buffer<bf16>, KernelError> {
    let module = dev.load_kernel_module(&GEMM_LAYOUT_MODULE)?;
    let f = module.load_function("gemm_fp8_to_bf16")?;
    let n = x.data.len();
    let mut out = Device::Cuda(dev.clone()).zeros::<bf16>(n)?;
    let src = cuda_slice(x.data, "gemm_fp8")?;
    let scales = cuda_slice(x.scale_inv.buffer, "gemm_fp8 scale")?;
    let format: i32 = match x.format {
        Fp8Format::E4M3 => 0,
        Fp8Format::E5M2 => 1,
    };
    let (idx, len) = (to_i64("gemm", x.scale_inv.index)?, to_i64("gemm", n)?);
    let (dst, _) = out
        .as_cuda_mut()
        .ok_or_else(|| KernelError::Internal("fresh CUDA buffer is not on CUDA".into()))?;
    let stream = dev.stream();
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(src)
        .arg(&format)
        .arg(scales)
        .arg(&idx)
        .arg(dst)
        .arg(&len);
    // SAFETY: the kernel reads n codes and one scale (index checked by DeviceScalar::new / scalar_ptr
    // callers) and writes n bf16 values; argument types match the kernel signature.
    unsafe { launch.launch(grid_1d(n)) }?;
    Ok(out)
}

/// Whether FP8 GEMMs of this row-major shape and transposes run on cuBLASLt directly (no re-layout, no
/// padding): `trans_a = No`, `trans_b = Yes`, and m, n, k multiples of 16.
pub fn fp8_runs_directly(spec: &GemmSpec) -> bool {
    !spec.trans_a.is_yes()
        && spec.trans_b == Transpose::Yes
        && [spec.m, spec.n, spec.k]
            .iter()
            .all(|&d| d > 0 && d % FP8_DIM_MULTIPLE == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_fp8_rule() {
        let s = GemmSpec::new(32, 48, 64).transposes(Transpose::No, Transpose::Yes);
        assert!(fp8_runs_directly(&s));
        assert!(!fp8_runs_directly(&GemmSpec::new(32, 48, 64)));
        assert!(!fp8_runs_directly(
            &GemmSpec::new(32, 40, 64).transposes(Transpose::No, Transpose::Yes)
        ));
        assert!(!fp8_runs_directly(
            &GemmSpec::new(0, 48, 64).transposes(Transpose::No, Transpose::Yes)
        ));
    }
}
