//! Typed buffers on a device ([`Buffer`]), their copies, and the byte accounting of CPU buffers.
//!
//! A CPU buffer is a `Vec` (counted in [`host_buffer_bytes`]); a CUDA buffer is a cudarc device slice
//! tied to its [`CudaDevice`], used on that device's compute stream. Kernels reach the slices through
//! [`Buffer::cuda`] and [`Buffer::cuda_mut`], which turn a buffer on the wrong device into an error.

use super::{CudaDevice, Device, Element};
use crate::KernelError;
use cudarc::driver::CudaSlice;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicUsize, Ordering};

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
