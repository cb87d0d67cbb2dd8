//! Typed buffers on a device ([`Buffer`]), their copies, and the byte accounting of CPU buffers.
//!
//! A CPU buffer is a `Vec` (counted in [`host_buffer_bytes`]); a CUDA buffer is a cudarc device slice
//! tied to its [`CudaDevice`], used on that device's compute stream. Kernels reach the slices through
//! [`Buffer::cuda`] and [`Buffer::cuda_mut`], which turn a buffer on the wrong device into an error.

use super::{CudaDevice, Device, Element};
use crate::KernelError;
use cudarc::driver::CudaSlice;
use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

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

/// Smallest CPU buffer the host cache keeps: below it the system allocator reuses memory cheaply.
const HOST_CACHE_MIN_BYTES: usize = 64 << 10;
/// Largest CPU buffer the host cache keeps (an evaluation batch's im2col matrix is hundreds of MiB).
const HOST_CACHE_MAX_BYTES: usize = 1 << 30;
/// Most bytes one thread's host cache holds idle. What it holds is bounded by what the thread freed, its
/// working set; [`clear_host_buffer_cache`] gives it back (the Trainer does after each evaluation).
const HOST_CACHE_CAP_BYTES: usize = 2 << 30;

/// Freed CPU buffers of one thread by element type and length, reused by the next allocation of that
/// shape on the same thread.
///
/// Layers allocate their temporaries per call (an im2col matrix of tens of MiB in a convolution). Large
/// allocations come from fresh `mmap`s, whose every page faults on first touch and is returned to the
/// system on free: on a small CPU the page faults cost more than the arithmetic. Keeping the vectors of a
/// thread (one rank per thread) makes the steady state allocation-free, as the CUDA device's buffer cache
/// does on the GPU. Per thread, so it takes no lock; a thread's cache is freed when the thread ends.
#[derive(Default)]
struct HostCache {
    free: HashMap<(TypeId, usize), Vec<Box<dyn Any>>>,
    idle_bytes: usize,
}

thread_local! {
    static HOST_CACHE: RefCell<HostCache> = RefCell::new(HostCache::default());
}

/// A vector of `len` elements from this thread's host cache when it holds one of that shape (its contents
/// are what the last owner left), else a fresh zero-filled one.
fn host_reused<T: Element>(len: usize) -> Option<Vec<T>> {
    HOST_CACHE
        .try_with(|c| {
            let mut c = c.try_borrow_mut().ok()?;
            let boxed = c.free.get_mut(&(TypeId::of::<T>(), len))?.pop()?;
            let v = boxed.downcast::<Vec<T>>().ok()?;
            c.idle_bytes = c.idle_bytes.saturating_sub(len * std::mem::size_of::<T>());
            Some(*v)
        })
        .ok()
        .flatten()
}

/// A zero-filled vector of `len` elements (reused from this thread's host cache when it can be).
pub(crate) fn host_zeroed<T: Element>(len: usize) -> Vec<T> {
    match host_reused(len) {
        Some(mut v) => {
            v.fill(T::default());
            v
        }
        None => vec![T::default(); len],
    }
}

/// A vector of `len` elements whose contents are unspecified: a reused one keeps its old values (the
/// caller overwrites them, as for a CUDA `uninit`), a fresh one is zero-filled.
pub(crate) fn host_unfilled<T: Element>(len: usize) -> Vec<T> {
    let mut v = host_reused(len).unwrap_or_else(|| vec![T::default(); len]);
    if uninit_poison() {
        bytemuck::cast_slice_mut::<T, u8>(&mut v).fill(UNINIT_POISON_BYTE);
    }
    v
}

/// The byte [`Device::uninit`] buffers are filled with while [`uninit_poison`] is on: every F32 and BF16
/// element reads about `3.4e38`, every E4M3 code is NaN, every integer is large. A result that depends on
/// such a value is far off, so a test that reads memory nothing wrote fails instead of passing on
/// zeros or on a stale copy of the right answer.
pub const UNINIT_POISON_BYTE: u8 = 0x7F;

/// 0: not read yet, 1: off, 2: on.
static POISON: AtomicU8 = AtomicU8::new(0);

/// Whether [`Device::uninit`] fills its buffers with [`UNINIT_POISON_BYTE`] (CPU and CUDA). Off unless the
/// environment variable `FP8_KERNELS_POISON_UNINIT` is `1` when first asked, or [`set_uninit_poison`]
/// turned it on. CI runs every test with it on (`.ci/run`). Process-wide; turning it on never changes a
/// correct result, only the cost of one fill per buffer.
pub fn uninit_poison() -> bool {
    match POISON.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var_os("FP8_KERNELS_POISON_UNINIT").is_some_and(|v| v == "1");
            // Another thread may have set it in between: its value wins.
            let _ = POISON.compare_exchange(
                0,
                if on { 2 } else { 1 },
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            POISON.load(Ordering::Relaxed) == 2
        }
        v => v == 2,
    }
}

/// Turns the poison fill of [`Device::uninit`] buffers on or off for the whole process (see
/// [`uninit_poison`]).
pub fn set_uninit_poison(on: bool) {
    POISON.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Keeps a freed vector in this thread's host cache when its size is in the cached range and the cache
/// has room; frees it otherwise.
fn host_cache_put<T: Element>(v: Vec<T>) {
    let bytes = std::mem::size_of_val(v.as_slice());
    if !(HOST_CACHE_MIN_BYTES..=HOST_CACHE_MAX_BYTES).contains(&bytes) {
        return;
    }
    // A buffer dropped while the thread's locals are torn down is simply freed.
    let _ = HOST_CACHE.try_with(|c| {
        let Ok(mut c) = c.try_borrow_mut() else {
            return;
        };
        if c.idle_bytes + bytes > HOST_CACHE_CAP_BYTES {
            return;
        }
        c.idle_bytes += bytes;
        c.free
            .entry((TypeId::of::<T>(), v.len()))
            .or_default()
            .push(Box::new(v));
    });
}

/// Frees the CPU buffers this thread's host cache holds idle.
pub fn clear_host_buffer_cache() {
    let _ = HOST_CACHE.try_with(|c| {
        if let Ok(mut c) = c.try_borrow_mut() {
            c.free.clear();
            c.idle_bytes = 0;
        }
    });
}

/// Bytes this thread's host cache holds idle (not counted in [`host_buffer_bytes`]).
pub fn host_buffer_cache_bytes() -> usize {
    HOST_CACHE
        .try_with(|c| c.try_borrow().map_or(0, |c| c.idle_bytes))
        .unwrap_or(0)
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
    /// A CUDA buffer owning `slice` of `device`.
    pub(crate) fn from_cuda(slice: CudaSlice<T>, device: CudaDevice) -> Self {
        Buffer {
            store: Store::Cuda {
                slice: ManuallyDrop::new(slice),
                device,
            },
        }
    }

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

    /// The CUDA slice or an error naming the operation (the CUDA side of a kernel call; the mirror of
    /// [`Buffer::host`]).
    pub(crate) fn cuda(&self, what: &'static str) -> Result<&CudaSlice<T>, KernelError> {
        self.as_cuda()
            .map(|(s, _)| s)
            .ok_or(KernelError::WrongDevice(what))
    }

    /// The mutable CUDA slice or an error naming the operation.
    pub(crate) fn cuda_mut(
        &mut self,
        what: &'static str,
    ) -> Result<&mut CudaSlice<T>, KernelError> {
        self.as_cuda_mut()
            .map(|(s, _)| s)
            .ok_or(KernelError::WrongDevice(what))
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
                if src.same_device(dst) {
                    let mut copy = match dst.cache_take::<T>(slice.len()) {
                        Some(c) => c,
                        // SAFETY: plain-old-data elements, overwritten by the copy just below.
                        None => unsafe { dst.stream().alloc::<T>(slice.len()) }?,
                    };
                    dst.stream().memcpy_dtod(&**slice, &mut copy)?;
                    Ok(Buffer::from_cuda(copy, dst.clone()))
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
    /// device; a device-to-device copy on CUDA), e.g. to cut a tensor out of a flat buffer.
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
            Store::Host(v) => {
                host_free(std::mem::size_of_val(v.as_slice()));
                host_cache_put(std::mem::take(v));
            }
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
    b.cuda(what)
}

/// The mutable CUDA slice of a buffer, or an error naming the operation when it lives on the CPU.
pub(crate) fn cuda_slice_mut<'a, T: Element>(
    b: &'a mut Buffer<T>,
    what: &'static str,
) -> Result<&'a mut CudaSlice<T>, KernelError> {
    b.cuda_mut(what)
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

/// Elements of a tensor of shape `dims` (their product), or an error naming the operation when it
/// overflows `usize`.
pub(crate) fn shape_len(what: &'static str, dims: &[usize]) -> Result<usize, KernelError> {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| KernelError::InvalidArgument {
            what,
            detail: format!("shape {dims:?} has more elements than usize holds"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_cpu_buffers_are_reused_zeroed_on_the_same_thread() {
        // Its own thread: the cache is per thread and other tests run beside this one.
        std::thread::spawn(|| {
            let d = Device::cpu();
            let len = (HOST_CACHE_MIN_BYTES / 4) * 3;
            let mut a = d.uninit::<f32>(len).unwrap();
            a.as_host_mut().unwrap().fill(7.5);
            let ptr = a.as_host().unwrap().as_ptr();
            drop(a);
            assert_eq!(host_buffer_cache_bytes(), len * 4);
            // Another shape or type does not take it.
            let other = d.zeros::<f32>(len + 1).unwrap();
            let bytes = d.zeros::<u8>(len * 4).unwrap();
            assert_eq!(host_buffer_cache_bytes(), len * 4);
            let b = d.zeros::<f32>(len).unwrap();
            assert_eq!(
                b.as_host().unwrap().as_ptr(),
                ptr,
                "the freed vector is reused"
            );
            assert!(
                b.as_host().unwrap().iter().all(|&x| x == 0.0),
                "zeros() clears it"
            );
            assert_eq!(host_buffer_cache_bytes(), 0);
            drop(b);
            // uninit() takes it as it is: its caller overwrites every element.
            let b = d.uninit::<f32>(len).unwrap();
            assert_eq!(b.as_host().unwrap().as_ptr(), ptr);
            drop((b, other, bytes));
            assert_eq!(host_buffer_cache_bytes(), len * 4 * 3 + 4);
            clear_host_buffer_cache();
            assert_eq!(host_buffer_cache_bytes(), 0);
            // Small buffers are left to the system allocator.
            drop(d.zeros::<f32>(16).unwrap());
            assert_eq!(host_buffer_cache_bytes(), 0);
        })
        .join()
        .unwrap();
    }

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
}
