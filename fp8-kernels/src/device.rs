//! The device abstraction: [`Device`] (CPU or a CUDA GPU), typed [`Buffer`]s, copies, streams and events.
//!
//! Every kernel takes buffers and runs where they live. CPU buffers are plain `Vec`s processed with rayon;
//! CUDA buffers are `cudarc` device slices used on the device's compute stream. A second stream
//! ([`CudaDevice::comm_stream`]) carries collectives so they can overlap compute, ordered by [`GpuEvent`]s.

use crate::KernelError;
use cudarc::driver::{CudaContext, CudaEvent, CudaModule, CudaSlice, CudaStream};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes held by live CPU buffers in this process, and their high-water mark (see [`host_buffer_bytes`]).
static HOST_LIVE: AtomicUsize = AtomicUsize::new(0);
static HOST_PEAK: AtomicUsize = AtomicUsize::new(0);

/// Bytes held by the CPU [`Buffer`]s alive in this process (`live`) and the most held at once since the
/// last [`reset_host_buffer_peak`] (`peak`): the CPU analogue of the CUDA pool statistics
/// ([`CudaDevice::pool_memory`]), so memory claims can be checked without a GPU. Process-wide: buffers of
/// every thread (thread ranks included) count; element bytes only (`len * size_of::<T>()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostBufferBytes {
    /// Bytes held now.
    pub live: usize,
    /// High-water mark of `live`.
    pub peak: usize,
}

/// The live and peak bytes of CPU buffers (see [`HostBufferBytes`]).
pub fn host_buffer_bytes() -> HostBufferBytes {
    HostBufferBytes {
        live: HOST_LIVE.load(Ordering::SeqCst),
        peak: HOST_PEAK.load(Ordering::SeqCst),
    }
}

/// Resets the high-water mark of CPU buffer bytes to what is held now.
pub fn reset_host_buffer_peak() {
    HOST_PEAK.store(HOST_LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
}

fn host_alloc(bytes: usize) {
    let now = HOST_LIVE.fetch_add(bytes, Ordering::SeqCst) + bytes;
    HOST_PEAK.fetch_max(now, Ordering::SeqCst);
}

fn host_free(bytes: usize) {
    HOST_LIVE.fetch_sub(bytes, Ordering::SeqCst);
}

/// Element types a [`Buffer`] can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// Bytes (FP8 payloads; the format travels beside the buffer).
    U8,
    /// 32-bit signed integer (labels, indices).
    I32,
    /// 32-bit unsigned integer (masks, counters).
    U32,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
        };
        f.write_str(s)
    }
}

/// A type that can live in a [`Buffer`] on either device.
pub trait Element:
    cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
    + bytemuck::Pod
    + Default
    + fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// The runtime tag of the type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for u32 {
    const DTYPE: DType = DType::U32;
}

/// Where buffers live and kernels run.
#[derive(Clone)]
pub enum Device {
    /// The host, with rayon for parallel loops.
    Cpu,
    /// One CUDA GPU.
    Cuda(CudaDevice),
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("Cpu"),
            Device::Cuda(d) => write!(f, "Cuda({})", d.ordinal()),
        }
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Device::Cpu, Device::Cpu) => true,
            (Device::Cuda(a), Device::Cuda(b)) => Arc::ptr_eq(&a.inner, &b.inner),
            _ => false,
        }
    }
}

impl Device {
    /// The CPU device.
    pub fn cpu() -> Self {
        Device::Cpu
    }

    /// CUDA device `ordinal`. Missing CUDA libraries or GPUs are errors, never panics.
    pub fn cuda(ordinal: usize) -> Result<Self, KernelError> {
        Ok(Device::Cuda(CudaDevice::new(ordinal)?))
    }

    /// CUDA device 0 when one can be opened, else the CPU. The reason a GPU was not used is returned too.
    pub fn auto() -> (Self, Option<KernelError>) {
        match Device::cuda(0) {
            Ok(d) => (d, None),
            Err(e) => (Device::Cpu, Some(e)),
        }
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// The CUDA device, or an error naming the operation that needs one.
    pub fn as_cuda(&self, what: &'static str) -> Result<&CudaDevice, KernelError> {
        match self {
            Device::Cuda(d) => Ok(d),
            Device::Cpu => Err(KernelError::NeedsCuda(what)),
        }
    }

    /// A zero-filled buffer of `len` elements.
    pub fn zeros<T: Element>(&self, len: usize) -> Result<Buffer<T>, KernelError> {
        match self {
            Device::Cpu => Ok(Buffer::from_vec(vec![T::default(); len])),
            Device::Cuda(d) => {
                let slice = match d.cache_take::<T>(len) {
                    Some(mut s) => {
                        d.stream().memset_zeros(&mut s)?;
                        s
                    }
                    None => d.stream().alloc_zeros::<T>(len)?,
                };
                Ok(Buffer {
                    store: Store::Cuda {
                        slice: ManuallyDrop::new(slice),
                        device: d.clone(),
                    },
                })
            }
        }
    }

    /// A buffer of `len` elements whose contents are unspecified until written: for outputs a kernel
    /// overwrites completely (no fill pass on CUDA; zeros on the CPU). On CUDA it comes from the stream's
    /// memory pool, so a buffer freed earlier on the same stream is reused without a device sync.
    pub fn uninit<T: Element>(&self, len: usize) -> Result<Buffer<T>, KernelError> {
        match self {
            Device::Cpu => Ok(Buffer::from_vec(vec![T::default(); len])),
            Device::Cuda(d) => {
                let slice = match d.cache_take::<T>(len) {
                    Some(s) => s,
                    // SAFETY: the slice is device memory of `len` elements of a plain-old-data type; every
                    // byte pattern is a valid `T`, and callers overwrite it before reading (documented
                    // above).
                    None => unsafe { d.stream().alloc::<T>(len) }?,
                };
                Ok(Buffer {
                    store: Store::Cuda {
                        slice: ManuallyDrop::new(slice),
                        device: d.clone(),
                    },
                })
            }
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<Buffer<T>, KernelError> {
        match self {
            Device::Cpu => Ok(Buffer::from_vec(data.to_vec())),
            Device::Cuda(d) => {
                let slice = d.stream().clone_htod(data)?;
                Ok(Buffer {
                    store: Store::Cuda {
                        slice: ManuallyDrop::new(slice),
                        device: d.clone(),
                    },
                })
            }
        }
    }

    /// A buffer that takes ownership of `data` (no copy on the CPU).
    pub fn from_vec<T: Element>(&self, data: Vec<T>) -> Result<Buffer<T>, KernelError> {
        match self {
            Device::Cpu => Ok(Buffer::from_vec(data)),
            Device::Cuda(_) => self.upload(&data),
        }
    }

    /// Waits until all work queued on this device has finished (no-op on the CPU).
    pub fn synchronize(&self) -> Result<(), KernelError> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(d) => Ok(d.stream().synchronize()?),
        }
    }

    /// Bytes in use on the device as the driver reports them (`None` on the CPU).
    pub fn memory_used(&self) -> Result<Option<usize>, KernelError> {
        match self {
            Device::Cpu => Ok(None),
            Device::Cuda(d) => {
                let (free, total) = d.context().mem_get_info()?;
                Ok(Some(total.saturating_sub(free)))
            }
        }
    }
}

/// Whether a CUDA library can be loaded. cudarc panics on first use of a missing library, so this is
/// checked before anything touches CUDA.
pub fn cuda_library_status() -> Result<(), KernelError> {
    // SAFETY: these only try to dlopen the library and look up symbols; nothing is called.
    let checks: [(&'static str, bool); 3] = unsafe {
        [
            ("libcuda (driver)", cudarc::driver::sys::is_culib_present()),
            ("NVRTC", cudarc::nvrtc::sys::is_culib_present()),
            ("cuBLASLt", cudarc::cublaslt::sys::is_culib_present()),
        ]
    };
    for (name, present) in checks {
        if !present {
            return Err(KernelError::CudaUnavailable(format!(
                "{name} could not be loaded (is the CUDA toolkit on LD_LIBRARY_PATH?)"
            )));
        }
    }
    Ok(())
}

/// A CUDA GPU: context, compute and communication streams, and the loaded kernel modules.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<CudaInner>,
}

struct CudaInner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm_stream: Arc<CudaStream>,
    compute_capability: (i32, i32),
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// cuBLASLt handle and workspace of this device, created on first GEMM.
    blaslt: std::sync::OnceLock<Arc<crate::blaslt::BlasLt>>,
    /// Freed buffers kept for reuse (see [`BufferCache`]).
    cache: Mutex<BufferCache>,
}

/// Largest buffer the cache keeps: small and mid-size temporaries are where allocation cost shows.
const CACHE_MAX_BYTES: usize = 64 << 20;
/// Most bytes the cache holds idle (they count as memory in use while cached).
const CACHE_CAP_BYTES: usize = 256 << 20;

/// Freed device buffers by element type and length, reused by the next allocation of the same shape.
///
/// Each fresh allocation of a cudarc slice creates two CUDA events (cudarc orders buffers across the
/// compute and communication streams with them) and each free destroys them: tens of microseconds per
/// temporary, which dominates a small model's step. Reusing the slice keeps its events, so the ordering
/// cudarc maintains stays intact; reuse happens on the same stream, after the work queued before it.
/// Only buffers up to [`CACHE_MAX_BYTES`] are kept, at most [`CACHE_CAP_BYTES`] in all, so a large
/// model's peak memory is not inflated by idle buffers.
#[derive(Default)]
struct BufferCache {
    free: HashMap<(TypeId, usize), Vec<Box<dyn Any + Send>>>,
    idle_bytes: usize,
}

impl CudaDevice {
    /// Opens GPU `ordinal`, after checking that the CUDA libraries exist.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        cuda_library_status()?;
        let count = CudaContext::device_count()
            .map_err(|e| KernelError::CudaUnavailable(format!("no CUDA driver usable: {e}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(KernelError::CudaUnavailable(format!(
                "CUDA device {ordinal} requested but {count} device(s) present"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let compute_capability = ctx.compute_capability()?;
        let stream = ctx.new_stream()?;
        let comm_stream = ctx.new_stream()?;
        Ok(CudaDevice {
            inner: Arc::new(CudaInner {
                ctx,
                stream,
                comm_stream,
                compute_capability,
                modules: Mutex::new(HashMap::new()),
                blaslt: std::sync::OnceLock::new(),
                cache: Mutex::new(BufferCache::default()),
            }),
        })
    }

    /// A cached freed buffer of `len` elements of `T`, if there is one.
    fn cache_take<T: Element>(&self, len: usize) -> Option<CudaSlice<T>> {
        let mut c = self.inner.cache.lock().ok()?;
        let boxed = c.free.get_mut(&(TypeId::of::<T>(), len))?.pop()?;
        let slice = boxed.downcast::<CudaSlice<T>>().ok()?;
        c.idle_bytes = c.idle_bytes.saturating_sub(len * std::mem::size_of::<T>());
        Some(*slice)
    }

    /// Keeps a freed buffer for reuse when it is small enough and the cache has room; frees it otherwise.
    fn cache_put<T: Element>(&self, slice: CudaSlice<T>) {
        let bytes = slice.len() * std::mem::size_of::<T>();
        if bytes == 0 || bytes > CACHE_MAX_BYTES {
            return;
        }
        let Ok(mut c) = self.inner.cache.lock() else {
            return;
        };
        if c.idle_bytes + bytes > CACHE_CAP_BYTES {
            return;
        }
        c.idle_bytes += bytes;
        c.free
            .entry((TypeId::of::<T>(), slice.len()))
            .or_default()
            .push(Box::new(slice));
    }

    /// Frees every cached buffer (e.g. before measuring memory).
    pub fn clear_buffer_cache(&self) {
        if let Ok(mut c) = self.inner.cache.lock() {
            c.free.clear();
            c.idle_bytes = 0;
        }
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ctx.ordinal()
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The stream kernels run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// The stream collectives run on.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.inner.comm_stream
    }

    /// `(major, minor)` compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// An error unless the GPU has FP8 instructions (compute capability 8.9 or newer).
    pub fn require_fp8(&self) -> Result<(), KernelError> {
        let (maj, min) = self.compute_capability();
        if (maj, min) >= (8, 9) {
            Ok(())
        } else {
            Err(KernelError::Fp8Unsupported {
                major: maj,
                minor: min,
            })
        }
    }

    /// The module named `name`, compiled from `source` with NVRTC on first use and cached.
    pub fn module(
        &self,
        name: &'static str,
        source: &'static str,
    ) -> Result<Arc<CudaModule>, KernelError> {
        let mut cache = self
            .inner
            .modules
            .lock()
            .map_err(|_| KernelError::Internal("module cache lock poisoned".into()))?;
        if let Some(m) = cache.get(name) {
            return Ok(m.clone());
        }
        let (maj, min) = self.compute_capability();
        let arch = match (maj, min) {
            (8, 9) => "sm_89",
            (9, 0) => "sm_90",
            (10, 0) => "sm_100",
            (12, 0) => "sm_120",
            // Newer parts run sm_90 PTX through the driver's JIT.
            _ => "compute_90",
        };
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(arch),
            options: vec!["--use_fast_math".into(), "-default-device".into()],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| {
            KernelError::Compile {
                module: name,
                log: e.to_string(),
            }
        })?;
        let m = self.inner.ctx.load_module(ptx)?;
        cache.insert(name, m.clone());
        Ok(m)
    }

    /// A module of this crate's kernel sources, compiled with
    /// [`compile_ptx`](crate::kernel_source::compile_ptx) (IEEE arithmetic) for this GPU on first use and
    /// cached under its name.
    pub fn load_kernel_module(
        &self,
        module: &crate::kernel_source::KernelModule,
    ) -> Result<Arc<CudaModule>, KernelError> {
        let mut cache = self
            .inner
            .modules
            .lock()
            .map_err(|_| KernelError::Internal("module cache lock poisoned".into()))?;
        if let Some(m) = cache.get(module.name) {
            return Ok(m.clone());
        }
        let arch = crate::kernel_source::arch_for(self.compute_capability());
        let ptx = crate::kernel_source::compile_ptx(module, arch)?;
        let m = self.inner.ctx.load_module(ptx)?;
        cache.insert(module.name, m.clone());
        Ok(m)
    }

    /// The slot holding this device's cuBLASLt state (see `blaslt.rs`).
    pub(crate) fn blaslt_slot(&self) -> &std::sync::OnceLock<Arc<crate::blaslt::BlasLt>> {
        &self.inner.blaslt
    }

    /// Records an event on the compute stream.
    pub fn record_compute(&self) -> Result<GpuEvent, KernelError> {
        Ok(GpuEvent(self.stream().record_event(None)?))
    }

    /// Records an event on the communication stream.
    pub fn record_comm(&self) -> Result<GpuEvent, KernelError> {
        Ok(GpuEvent(self.comm_stream().record_event(None)?))
    }

    /// Statistics of the device's default stream-ordered memory pool, which every buffer allocation goes
    /// through (`cuMemAllocAsync`): `(used, used_high_water)` in bytes. The high-water mark is the peak of
    /// live buffer bytes since [`CudaDevice::reset_pool_high_water`], the analogue of PyTorch's
    /// `max_memory_allocated` (it excludes the CUDA context and cuBLASLt workspaces made outside the pool).
    pub fn pool_memory(&self) -> Result<(u64, u64), KernelError> {
        use cudarc::driver::sys;
        let pool = self.default_pool()?;
        let mut used = 0u64;
        let mut high = 0u64;
        // SAFETY: a valid pool handle of this device; both attributes are u64 values written to live locals.
        unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                (&mut used as *mut u64).cast(),
            )
            .result()?;
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut high as *mut u64).cast(),
            )
            .result()?;
        }
        Ok((used, high))
    }

    /// Resets the pool's high-water mark to its current use.
    pub fn reset_pool_high_water(&self) -> Result<(), KernelError> {
        use cudarc::driver::sys;
        let pool = self.default_pool()?;
        let mut zero = 0u64;
        // SAFETY: a valid pool handle; the driver only accepts 0 for this attribute, passed as a u64.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
            .result()?;
        }
        Ok(())
    }

    /// Sets the default memory pool's release threshold: memory the pool holds beyond `bytes` is returned
    /// to the driver at each synchronisation. The default (0) frees everything at every sync, so a step
    /// that allocates maps fresh memory again; `u64::MAX` keeps it cached between steps.
    pub fn set_pool_release_threshold(&self, bytes: u64) -> Result<(), KernelError> {
        use cudarc::driver::sys;
        let pool = self.default_pool()?;
        let mut value = bytes;
        // SAFETY: a valid pool handle; the attribute is a u64 read from a live local.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            )
            .result()?;
        }
        Ok(())
    }

    fn default_pool(&self) -> Result<cudarc::driver::sys::CUmemoryPool, KernelError> {
        use cudarc::driver::sys;
        self.context().bind_to_thread()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: writes one handle to a live local; the device handle comes from this device's context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.context().cu_device()).result()? };
        Ok(pool)
    }

    /// Records a timing event on the compute stream (for [`GpuEvent::elapsed_ms`]; plain events carry no
    /// timestamps and cost less).
    pub fn record_compute_timed(&self) -> Result<GpuEvent, KernelError> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(GpuEvent(self.stream().record_event(Some(flags))?))
    }

    /// Records a timing event on the communication stream.
    pub fn record_comm_timed(&self) -> Result<GpuEvent, KernelError> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(GpuEvent(self.comm_stream().record_event(Some(flags))?))
    }
}

/// A point in a stream's work; another stream can wait for it.
pub struct GpuEvent(CudaEvent);

impl GpuEvent {
    /// Makes `stream` wait (on the device, not the host) until the event has happened.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<(), KernelError> {
        Ok(stream.wait(&self.0)?)
    }

    /// Blocks the host until the event has happened.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        Ok(self.0.synchronize()?)
    }

    /// Whether the event has happened.
    pub fn is_complete(&self) -> bool {
        self.0.is_complete()
    }

    /// Milliseconds from this event to `end` (both timing events, see
    /// [`CudaDevice::record_compute_timed`]); waits for both to complete. Works across streams.
    pub fn elapsed_ms(&self, end: &GpuEvent) -> Result<f32, KernelError> {
        Ok(self.0.elapsed_ms(&end.0)?)
    }

    /// The underlying cudarc event.
    pub fn raw(&self) -> &CudaEvent {
        &self.0
    }
}

/// A typed buffer on a device.
pub struct Buffer<T: Element> {
    store: Store<T>,
}

enum Store<T: Element> {
    Host(Vec<T>),
    Cuda {
        /// Taken out only in `Drop`, to return the memory to the device's buffer cache.
        slice: ManuallyDrop<CudaSlice<T>>,
        device: CudaDevice,
    },
}

impl<T: Element> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Buffer<{}>({} on {:?})",
            T::DTYPE,
            self.len(),
            self.device()
        )
    }
}

impl<T: Element> Buffer<T> {
    /// A CPU buffer owning `data`.
    pub fn from_vec(data: Vec<T>) -> Self {
        host_alloc(std::mem::size_of_val(data.as_slice()));
        Buffer {
            store: Store::Host(data),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.store {
            Store::Host(v) => v.len(),
            Store::Cuda { slice, .. } => slice.len(),
        }
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> Device {
        match &self.store {
            Store::Host(_) => Device::Cpu,
            Store::Cuda { device, .. } => Device::Cuda(device.clone()),
        }
    }

    /// The host data, for CPU buffers.
    pub fn as_host(&self) -> Option<&[T]> {
        match &self.store {
            Store::Host(v) => Some(v),
            Store::Cuda { .. } => None,
        }
    }

    /// The host data, mutable, for CPU buffers.
    pub fn as_host_mut(&mut self) -> Option<&mut [T]> {
        match &mut self.store {
            Store::Host(v) => Some(v),
            Store::Cuda { .. } => None,
        }
    }

    /// The host data or an error naming the operation (for CPU-only code paths).
    pub fn host(&self, what: &'static str) -> Result<&[T], KernelError> {
        self.as_host().ok_or(KernelError::WrongDevice(what))
    }

    /// Mutable host data or an error naming the operation.
    pub fn host_mut(&mut self, what: &'static str) -> Result<&mut [T], KernelError> {
        self.as_host_mut().ok_or(KernelError::WrongDevice(what))
    }

    /// The CUDA slice and its device, for CUDA buffers.
    pub fn as_cuda(&self) -> Option<(&CudaSlice<T>, &CudaDevice)> {
        match &self.store {
            Store::Cuda { slice, device } => Some((&**slice, device)),
            Store::Host(_) => None,
        }
    }

    /// The CUDA slice (mutable) and its device, for CUDA buffers.
    pub fn as_cuda_mut(&mut self) -> Option<(&mut CudaSlice<T>, &CudaDevice)> {
        match &mut self.store {
            Store::Cuda { slice, device } => Some((&mut **slice, &*device)),
            Store::Host(_) => None,
        }
    }

    /// Copies the contents to a host `Vec` (waits for queued work on CUDA).
    pub fn to_vec(&self) -> Result<Vec<T>, KernelError> {
        match &self.store {
            Store::Host(v) => Ok(v.clone()),
            Store::Cuda { slice, device } => Ok(device.stream().clone_dtoh(&**slice)?),
        }
    }

    /// Overwrites the contents from host data of the same length.
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<(), KernelError> {
        if data.len() != self.len() {
            return Err(KernelError::LengthMismatch {
                what: "copy_from_host",
                expected: self.len(),
                actual: data.len(),
            });
        }
        match &mut self.store {
            Store::Host(v) => v.copy_from_slice(data),
            Store::Cuda { slice, device } => device.stream().memcpy_htod(data, &mut **slice)?,
        }
        Ok(())
    }

    /// Overwrites the contents from another buffer of the same length on the same device.
    pub fn copy_from(&mut self, src: &Buffer<T>) -> Result<(), KernelError> {
        if src.len() != self.len() {
            return Err(KernelError::LengthMismatch {
                what: "copy_from",
                expected: self.len(),
                actual: src.len(),
            });
        }
        match (&mut self.store, &src.store) {
            (Store::Host(d), Store::Host(s)) => d.copy_from_slice(s),
            (Store::Cuda { slice: d, device }, Store::Cuda { slice: s, .. }) => {
                device.stream().memcpy_dtod(&**s, &mut **d)?
            }
            _ => return Err(KernelError::WrongDevice("copy_from across devices")),
        }
        Ok(())
    }

    /// Copies this buffer to `device`.
    pub fn to_device(&self, device: &Device) -> Result<Buffer<T>, KernelError> {
        match (&self.store, device) {
            (Store::Host(v), d) => d.upload(v),
            (Store::Cuda { .. }, Device::Cpu) => Ok(Buffer::from_vec(self.to_vec()?)),
            (Store::Cuda { slice, device: src }, Device::Cuda(dst)) => {
                if Arc::ptr_eq(&src.inner, &dst.inner) {
                    let mut copy = match dst.cache_take::<T>(slice.len()) {
                        Some(c) => c,
                        // SAFETY: plain-old-data elements, overwritten by the copy just below.
                        None => unsafe { dst.stream().alloc::<T>(slice.len()) }?,
                    };
                    dst.stream().memcpy_dtod(&**slice, &mut copy)?;
                    Ok(Buffer {
                        store: Store::Cuda {
                            slice: ManuallyDrop::new(copy),
                            device: dst.clone(),
                        },
                    })
                } else {
                    device.upload(&self.to_vec()?)
                }
            }
        }
    }

    /// Sets every element to zero.
    pub fn fill_zero(&mut self) -> Result<(), KernelError> {
        match &mut self.store {
            Store::Host(v) => v.fill(T::default()),
            Store::Cuda { slice, device } => device.stream().memset_zeros(&mut **slice)?,
        }
        Ok(())
    }

    /// Copies `len` elements of `src` starting at `src_offset` into this buffer at `dst_offset` (same
    /// device; a device-to-device copy on CUDA). FSDP uses it to cut parameters out of flat buffers.
    pub fn copy_range_from(
        &mut self,
        dst_offset: usize,
        src: &Buffer<T>,
        src_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        let bad = |what: &str, off: usize, have: usize| KernelError::InvalidArgument {
            what: "copy_range_from",
            detail: format!(
                "{what} range {off}..{} exceeds length {have}",
                off.saturating_add(len)
            ),
        };
        if src_offset.checked_add(len).is_none_or(|e| e > src.len()) {
            return Err(bad("source", src_offset, src.len()));
        }
        if dst_offset.checked_add(len).is_none_or(|e| e > self.len()) {
            return Err(bad("destination", dst_offset, self.len()));
        }
        if len == 0 {
            return Ok(());
        }
        match (&mut self.store, &src.store) {
            (Store::Host(d), Store::Host(s)) => {
                d[dst_offset..dst_offset + len].copy_from_slice(&s[src_offset..src_offset + len])
            }
            (Store::Cuda { slice: d, device }, Store::Cuda { slice: s, .. }) => {
                let sv = s.slice(src_offset..src_offset + len);
                let mut dv = d.slice_mut(dst_offset..dst_offset + len);
                device.stream().memcpy_dtod(&sv, &mut dv)?
            }
            _ => return Err(KernelError::WrongDevice("copy_range_from across devices")),
        }
        Ok(())
    }
}

impl<T: Element> Drop for Buffer<T> {
    fn drop(&mut self) {
        match &mut self.store {
            // CUDA buffers are counted by the device's pool; only host bytes are tracked here.
            Store::Host(v) => host_free(std::mem::size_of_val(v.as_slice())),
            Store::Cuda { slice, device } => {
                // SAFETY: `slice` is taken exactly once, here, and the store is not used afterwards.
                let slice = unsafe { ManuallyDrop::take(slice) };
                device.cache_put(slice);
            }
        }
    }
}

/// The CUDA slice of a buffer, or an error naming the operation when it lives on the CPU.
pub(crate) fn cuda_slice<'a, T: Element>(
    b: &'a Buffer<T>,
    what: &'static str,
) -> Result<&'a CudaSlice<T>, KernelError> {
    b.as_cuda()
        .map(|(s, _)| s)
        .ok_or(KernelError::WrongDevice(what))
}

/// The mutable CUDA slice of a buffer, or an error naming the operation when it lives on the CPU.
pub(crate) fn cuda_slice_mut<'a, T: Element>(
    b: &'a mut Buffer<T>,
    what: &'static str,
) -> Result<&'a mut CudaSlice<T>, KernelError> {
    b.as_cuda_mut()
        .map(|(s, _)| s)
        .ok_or(KernelError::WrongDevice(what))
}

/// Checks that two lengths agree, naming the operation.
pub fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<(), KernelError> {
    if expected == actual {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch {
            what,
            expected,
            actual,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_buffers_copy_and_check_lengths() {
        let d = Device::cpu();
        let mut a = d.upload(&[1.0f32, 2.0, 3.0]).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a.num_bytes(), 12);
        let b = d.zeros::<f32>(3).unwrap();
        a.copy_from(&b).unwrap();
        assert_eq!(a.to_vec().unwrap(), vec![0.0; 3]);
        assert!(a.copy_from_host(&[1.0; 2]).is_err());
        let c = d.zeros::<f32>(4).unwrap();
        assert!(matches!(
            a.copy_from(&c),
            Err(KernelError::LengthMismatch {
                expected: 3,
                actual: 4,
                ..
            })
        ));
    }

    #[test]
    fn host_bytes_follow_allocation_and_drop() {
        // Other tests of this binary allocate concurrently: check only what this test's buffers must
        // do to the counters (peak >= live + ours while ours are alive).
        let a = Device::cpu().zeros::<f32>(1 << 20).unwrap();
        let held = host_buffer_bytes();
        assert!(held.live >= a.num_bytes());
        assert!(held.peak >= held.live);
        let b = Buffer::from_vec(vec![0u8; 3 << 20]);
        assert!(host_buffer_bytes().peak >= a.num_bytes() + b.num_bytes());
        drop(a);
        drop(b);
    }

    #[test]
    fn missing_cuda_is_an_error_not_a_panic() {
        // On a machine without CUDA this must return Err; with a GPU it returns a device.
        match Device::cuda(0) {
            Ok(d) => assert!(d.is_cuda()),
            Err(e) => assert!(matches!(
                e,
                KernelError::CudaUnavailable(_) | KernelError::Driver(_)
            )),
        }
        let (d, why) = Device::auto();
        assert_eq!(d.is_cuda(), why.is_none());
    }
}
