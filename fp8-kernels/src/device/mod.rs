//! The device abstraction: [`Device`] (CPU or a CUDA GPU), element types, streams and events.
//!
//! Every kernel takes buffers ([`Buffer`], in `device/buffer.rs`) and runs where they live. CPU buffers are
//! plain `Vec`s processed with rayon; CUDA buffers are `cudarc` device slices used on the device's compute
//! stream. A second stream ([`CudaDevice::comm_stream`]) carries collectives so they can overlap compute,
//! ordered by [`GpuEvent`]s.
//!
//! This module depends on no kernel family: state a family keeps per GPU (cuBLASLt handles, for one)
//! lives in a typed slot of the device (`CudaDevice::state`) that the family creates on first use.

mod buffer;
mod element;
mod functions;

pub use buffer::{
    check_len, clear_host_buffer_cache, host_buffer_bytes, host_buffer_cache_bytes,
    reset_host_buffer_peak, set_uninit_poison, uninit_poison, Buffer, HostBufferBytes,
    UNINIT_POISON_BYTE,
};
pub(crate) use buffer::{cuda_slice, cuda_slice_mut, shape_len};
pub use element::{DType, Element, FloatElement};
pub(crate) use functions::{KernelName, LoadedFunction, NamePart};

use crate::KernelError;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaEvent, CudaModule, CudaSlice, CudaStream, DevicePtrMut};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

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
            (Device::Cuda(a), Device::Cuda(b)) => a.same_device(b),
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
            Device::Cpu => Ok(Buffer::from_vec(buffer::host_zeroed(len))),
            Device::Cuda(d) => {
                let slice = match d.cache_take::<T>(len) {
                    Some(mut s) => {
                        d.stream().memset_zeros(&mut s)?;
                        s
                    }
                    None => d.stream().alloc_zeros::<T>(len)?,
                };
                Ok(Buffer::from_cuda(slice, d.clone()))
            }
        }
    }

    /// A buffer of `len` elements whose contents are unspecified until written: for outputs a kernel
    /// overwrites completely (no fill pass: a reused buffer keeps its old values, a fresh CPU one is
    /// zeros; with [`uninit_poison`] on, every byte is [`UNINIT_POISON_BYTE`]). On CUDA it comes from the
    /// stream's memory pool, so a buffer freed earlier on the same stream is reused without a device sync.
    pub fn uninit<T: Element>(&self, len: usize) -> Result<Buffer<T>, KernelError> {
        match self {
            Device::Cpu => Ok(Buffer::from_vec(buffer::host_unfilled(len))),
            Device::Cuda(d) => {
                let mut slice = match d.cache_take::<T>(len) {
                    Some(s) => s,
                    // SAFETY: the slice is device memory of `len` elements of a plain-old-data type;
                    // every byte pattern is a valid `T`, and callers overwrite it before reading
                    // (documented above).
                    None => unsafe { d.stream().alloc::<T>(len) }?,
                };
                if uninit_poison() && len > 0 {
                    let stream = d.stream();
                    let (ptr, _guard) = slice.device_ptr_mut(stream);
                    // SAFETY: `ptr` is this stream's live allocation of `len` elements of a
                    // plain-old-data type (every byte pattern is a valid `T`); the fill is queued on
                    // the stream that uses the buffer, and the guard orders it there.
                    unsafe {
                        cudarc::driver::result::memset_d8_async(
                            ptr,
                            UNINIT_POISON_BYTE,
                            len * std::mem::size_of::<T>(),
                            stream.cu_stream(),
                        )
                    }?;
                }
                Ok(Buffer::from_cuda(slice, d.clone()))
            }
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<Buffer<T>, KernelError> {
        match self {
            Device::Cpu => Ok(Buffer::from_vec(data.to_vec())),
            Device::Cuda(d) => {
                let slice = d.stream().clone_htod(data)?;
                Ok(Buffer::from_cuda(slice, d.clone()))
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

/// A CUDA GPU: context, compute and communication streams, the loaded kernel modules and functions, and
/// the limits launches are shaped by (queried once, when the device is opened).
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<CudaInner>,
}

struct CudaInner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm_stream: Arc<CudaStream>,
    compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    sm_count: u32,
    /// Most shared memory a block may use when a kernel opts in (above the default 48 KiB).
    smem_per_block_optin: usize,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Functions of the loaded modules, each looked up once (see [`CudaDevice::function`]).
    functions: functions::FunctionCache<LoadedFunction>,
    /// Per-device state of kernel families, one value per type (see [`CudaDevice::state`]).
    states: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
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
/// temporary, which dominates a small model's step once layers allocate their temporaries per call.
/// Reusing the slice keeps its events, so the ordering cudarc maintains stays intact; reuse happens on the
/// same stream, after the work queued before it. Only buffers up to [`CACHE_MAX_BYTES`] are kept, at most
/// [`CACHE_CAP_BYTES`] in all, so a large model's peak memory is not inflated by idle buffers.
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
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as u32;
        let smem_per_block_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            .max(0) as usize;
        let stream = ctx.new_stream()?;
        let comm_stream = ctx.new_stream()?;
        Ok(CudaDevice {
            inner: Arc::new(CudaInner {
                ctx,
                stream,
                comm_stream,
                compute_capability,
                sm_count,
                smem_per_block_optin,
                modules: Mutex::new(HashMap::new()),
                functions: functions::FunctionCache::default(),
                states: Mutex::new(HashMap::new()),
                cache: Mutex::new(BufferCache::default()),
            }),
        })
    }

    /// A cached freed buffer of `len` elements of `T`, if there is one.
    pub(crate) fn cache_take<T: Element>(&self, len: usize) -> Option<CudaSlice<T>> {
        let mut c = self.inner.cache.lock().ok()?;
        let boxed = c.free.get_mut(&(TypeId::of::<T>(), len))?.pop()?;
        let slice = boxed.downcast::<CudaSlice<T>>().ok()?;
        c.idle_bytes = c.idle_bytes.saturating_sub(len * std::mem::size_of::<T>());
        Some(*slice)
    }

    /// Keeps a freed buffer for reuse when it is small enough and the cache has room; frees it otherwise.
    pub(crate) fn cache_put<T: Element>(&self, slice: CudaSlice<T>) {
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

    /// Number of streaming multiprocessors (launch grids are sized by it).
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// Most bytes of shared memory one block may use when its kernel opts in to more than the default
    /// 48 KiB (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`).
    pub fn shared_memory_per_block_optin(&self) -> usize {
        self.inner.smem_per_block_optin
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

    /// A module of this crate's kernel sources, compiled with
    /// [`compile_ptx`](crate::kernel_source::compile_ptx) (IEEE arithmetic) for this GPU on first use and
    /// cached under its name; an error where the module's architecture is not this GPU's
    /// ([`KernelModule::target_for`](crate::kernel_source::KernelModule::target_for)).
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
        let arch = module.target_for(self.compute_capability())?;
        let ptx = crate::kernel_source::compile_ptx(module, arch)?;
        let m = self.inner.ctx.load_module(ptx)?;
        cache.insert(module.name, m.clone());
        Ok(m)
    }

    /// Function `name` of `module`, looked up once per device (compiling the module on first use, see
    /// [`CudaDevice::load_kernel_module`]) and shared by every later launch, from any thread.
    pub(crate) fn function(
        &self,
        module: &crate::kernel_source::KernelModule,
        name: KernelName,
    ) -> Result<Arc<LoadedFunction>, KernelError> {
        self.inner
            .functions
            .get_or_load(module.name, name, |joined| {
                let m = self.load_kernel_module(module)?;
                Ok(LoadedFunction::new(m.load_function(joined)?))
            })
    }

    /// This device's value of type `S`, created by `make` on first use and shared afterwards (the
    /// cuBLASLt handle and workspace of the GEMM family, for one). Two threads may both run `make` the
    /// first time; the first value stored is kept and returned to both.
    pub(crate) fn state<S: Any + Send + Sync>(
        &self,
        make: impl FnOnce(&CudaDevice) -> Result<S, KernelError>,
    ) -> Result<Arc<S>, KernelError> {
        let lock = || {
            self.inner
                .states
                .lock()
                .map_err(|_| KernelError::Internal("device state lock poisoned".into()))
        };
        let stored = lock()?.get(&TypeId::of::<S>()).cloned();
        let any = match stored {
            Some(s) => s,
            None => {
                // Created without the lock held, so `make` may itself use other states of the device.
                let made: Arc<dyn Any + Send + Sync> = Arc::new(make(self)?);
                lock()?.entry(TypeId::of::<S>()).or_insert(made).clone()
            }
        };
        any.downcast::<S>()
            .map_err(|_| KernelError::Internal("device state of the wrong type".into()))
    }

    /// Whether `other` is this same device (the same context and streams), not merely the same ordinal.
    pub fn same_device(&self, other: &CudaDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
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

/// The CUDA device a buffer lives on, or `None` for a CPU buffer: the device a kernel call runs on is that
/// of its first buffer, and every other buffer must live there too ([`same_device`]).
pub(crate) fn cuda_of<T: Element>(x: &Buffer<T>) -> Option<CudaDevice> {
    x.as_cuda().map(|(_, d)| d.clone())
}

/// An error unless `b` lives on `dev` (the same CUDA device, or the CPU when `dev` is None).
pub(crate) fn same_device<T: Element>(
    what: &'static str,
    dev: &Option<CudaDevice>,
    b: &Buffer<T>,
) -> Result<(), KernelError> {
    let ok = match (dev, b.device()) {
        (None, Device::Cpu) => true,
        (Some(d), other) => other == Device::Cuda(d.clone()),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(KernelError::WrongDevice(what))
    }
}

/// Something a kernel call takes that lives on a device: a [`Buffer`], or an optional one (absent: no
/// constraint). Lets [`device_of`] check buffers of different element types in one list.
pub(crate) trait Placed {
    /// The device it lives on, or `None` when there is nothing (an absent optional buffer).
    fn placement(&self) -> Option<Device>;
}

impl<T: Element> Placed for Buffer<T> {
    fn placement(&self) -> Option<Device> {
        Some(self.device())
    }
}

impl<P: Placed + ?Sized> Placed for &P {
    fn placement(&self) -> Option<Device> {
        (**self).placement()
    }
}

impl<P: Placed + ?Sized> Placed for &mut P {
    fn placement(&self) -> Option<Device> {
        (**self).placement()
    }
}

impl<P: Placed> Placed for Option<P> {
    fn placement(&self) -> Option<Device> {
        self.as_ref().and_then(P::placement)
    }
}

/// The device a kernel call runs on: that of its first buffer (`None` for the CPU), after checking that
/// every other one lives there too ([`same_device`]).
pub(crate) fn device_of(
    what: &'static str,
    buffers: &[&dyn Placed],
) -> Result<Option<CudaDevice>, KernelError> {
    let mut placements = buffers.iter().filter_map(|b| b.placement());
    let Some(first) = placements.next() else {
        return Ok(None);
    };
    if placements.any(|d| d != first) {
        return Err(KernelError::WrongDevice(what));
    }
    Ok(match first {
        Device::Cuda(d) => Some(d),
        Device::Cpu => None,
    })
}

/// Runs one kernel call where its buffers live, after [`device_of`] checked that they all live together;
/// evaluates to `Result<(), KernelError>`:
///
/// ```ignore
/// dispatch!(WHAT, [x, y],
///     cpu: cpu::relu_forward(x.host(WHAT)?, y.host_mut(WHAT)?),
///     cuda(dev): cuda::relu_forward(&dev, x.cuda(WHAT)?, y.cuda_mut(WHAT)?))
/// ```
///
/// The `cpu` expression runs on the host (its value is dropped and the call returns `Ok(())`); the `cuda`
/// one, a `Result`, runs with `dev` bound to the buffers' [`CudaDevice`]. A list of only absent optional
/// buffers counts as the host. `?` in either returns from the enclosing function.
macro_rules! dispatch {
    ($what:expr, [$($buffer:expr),+ $(,)?], cpu: $cpu:expr, cuda($dev:ident): $cuda:expr $(,)?) => {
        match $crate::device::device_of($what, &[$(&$buffer),+])? {
            None => {
                $cpu;
                Ok(())
            }
            Some($dev) => $cuda,
        }
    };
}
pub(crate) use dispatch;

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Fills a reused buffer (one the host or CUDA cache kept) and a fresh one, and checks every byte.
    fn uninit_buffers_hold_the_poison_byte(dev: &Device) {
        set_uninit_poison(true);
        // A size the host cache keeps (128 KiB): the buffer below reuses this one's stale values.
        let n = 1 << 15;
        drop(dev.upload(&vec![1.5f32; n]).unwrap());
        let reused: Buffer<f32> = dev.uninit(n).unwrap();
        let bits = u32::from_ne_bytes([UNINIT_POISON_BYTE; 4]);
        assert!(reused.to_vec().unwrap().iter().all(|v| v.to_bits() == bits));
        let fresh: Buffer<u8> = dev.uninit(5).unwrap();
        assert_eq!(fresh.to_vec().unwrap(), vec![UNINIT_POISON_BYTE; 5]);
        assert!(uninit_poison());
    }

    #[test]
    fn uninit_buffers_hold_the_poison_byte_when_asked_cpu() {
        // Process-wide: the other tests of this binary then run with poisoned buffers too, which
        // cannot change a correct result.
        uninit_buffers_hold_the_poison_byte(&Device::cpu());
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn uninit_buffers_hold_the_poison_byte_when_asked_cuda() {
        uninit_buffers_hold_the_poison_byte(&Device::cuda(0).unwrap());
    }

    #[test]
    fn device_of_cpu_buffers_of_mixed_types() {
        let cpu = Device::cpu();
        let x: Buffer<f32> = cpu.zeros(3).unwrap();
        let mut mask: Buffer<u8> = cpu.zeros(3).unwrap();
        let absent: Option<&Buffer<f32>> = None;
        let present = Some(&x);
        let dev = device_of("t", &[&x, &mut mask, &absent, &present]).unwrap();
        assert!(dev.is_none());
        // Only absent optional buffers: nothing constrains the device.
        assert!(device_of("t", &[&absent]).unwrap().is_none());
    }
}
