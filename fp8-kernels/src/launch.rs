//! Launching this crate's CUDA kernels: launch shapes, function lookup, and [`launch!`], through which
//! every kernel launch of the crate goes.
//!
//! A launch is the one unsafe step of a CUDA kernel call (cudarc cannot check a kernel's parameter list),
//! so its safety argument is made once, at [`Kernel::launch`] and [`launch!`], and each call site states
//! the kernel's C signature beside the arguments it passes.

use crate::kernel_source::KernelModule;
use crate::{CudaDevice, KernelError};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig,
    SyncOnDrop,
};
use std::sync::Arc;

/// Threads per block of the one-dimensional kernels.
pub(crate) const BLOCK: u32 = 256;

/// A 1-D launch over `items` work items with grid-stride loops: enough blocks to fill every SM several
/// times (at most `blocks_per_sm` per SM), never more than the items need, at least one.
pub(crate) fn grid_1d(sm_count: u32, items: u64, blocks_per_sm: u32) -> LaunchConfig {
    let needed = items.div_ceil(BLOCK as u64).max(1);
    let cap = (sm_count.max(1) as u64) * blocks_per_sm as u64;
    LaunchConfig {
        grid_dim: (needed.min(cap) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` threads (kernels that reduce everything inside one block, or run one thread).
pub(crate) fn one_block(threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The launch of the cast + transpose kernels (`cast_transpose_*`, `gelu[_bwd]_cast_transpose_*`) for a
/// `[rows, cols]` input: a one-dimensional block of 256 threads when both sides are multiples of 64 (the
/// kernels then take their vectorised 64x64-tile path), else a (32, 8) block over 32x32 tiles. At most
/// 16 blocks per SM, with grid-stride loops over the tiles.
pub(crate) fn cast_transpose_launch(sm_count: u32, rows: usize, cols: usize) -> LaunchConfig {
    let cap = sm_count.max(1) as usize * 16;
    if rows % 64 == 0 && cols % 64 == 0 && rows > 0 && cols > 0 {
        let tiles = (rows / 64) * (cols / 64);
        LaunchConfig {
            grid_dim: (tiles.clamp(1, cap) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    } else {
        let tiles = rows.div_ceil(32) * cols.div_ceil(32);
        LaunchConfig {
            grid_dim: (tiles.clamp(1, cap) as u32, 1, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// A function of a loaded module, compiling the module on first use.
pub(crate) fn function(
    dev: &CudaDevice,
    module: &KernelModule,
    name: &str,
) -> Result<CudaFunction, KernelError> {
    let m = dev.load_kernel_module(module)?;
    Ok(m.load_function(name)?)
}

/// Number of streaming multiprocessors of the device.
pub(crate) fn sm_count(dev: &CudaDevice) -> Result<u32, KernelError> {
    let n = dev.context().attribute(
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    Ok(n.max(1) as u32)
}

/// An optional buffer passed to a kernel as a pointer that is null when the buffer is absent (`float*
/// amax` when no amax is wanted): push `&arg.ptr`. While the value lives, the buffer is ordered on the
/// stream the way cudarc orders a slice argument; keep it until after the launch.
pub(crate) struct OptionalPtr<'a> {
    /// The device address, or 0.
    pub(crate) ptr: u64,
    _order: Option<SyncOnDrop<'a>>,
}

/// [`OptionalPtr`] of a buffer the kernel writes.
pub(crate) fn optional_ptr_mut<'a, T>(
    slice: Option<&'a mut CudaSlice<T>>,
    stream: &'a CudaStream,
) -> OptionalPtr<'a> {
    match slice {
        Some(s) => {
            let (ptr, order) = s.device_ptr_mut(stream);
            OptionalPtr {
                ptr,
                _order: Some(order),
            }
        }
        None => OptionalPtr {
            ptr: 0,
            _order: None,
        },
    }
}

/// [`OptionalPtr`] of a buffer the kernel only reads.
pub(crate) fn optional_ptr<'a, T>(
    slice: Option<&'a CudaSlice<T>>,
    stream: &'a CudaStream,
) -> OptionalPtr<'a> {
    match slice {
        Some(s) => {
            let (ptr, order) = s.device_ptr(stream);
            OptionalPtr {
                ptr,
                _order: Some(order),
            }
        }
        None => OptionalPtr {
            ptr: 0,
            _order: None,
        },
    }
}

/// A kernel of a loaded module, ready to launch on its device's compute stream.
pub(crate) struct Kernel {
    function: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    /// Kernel `name` of `module` (compiled for `dev` on first use).
    pub(crate) fn new(
        dev: &CudaDevice,
        module: &KernelModule,
        name: &str,
    ) -> Result<Self, KernelError> {
        Ok(Kernel {
            function: function(dev, module, name)?,
            stream: dev.stream().clone(),
        })
    }

    /// `push` itself: gives a closure that pushes this kernel's arguments its type (the lifetime of the
    /// arguments tied to the launch), so it can be written outside the unsafe launch.
    pub(crate) fn arguments<'a, F: FnOnce(&mut LaunchArgs<'a>)>(&'a self, push: F) -> F {
        push
    }

    /// Launches the kernel with `cfg` and the arguments `push` adds, in order. cudarc orders the launch
    /// after earlier work on the slices passed and keeps them alive until it is queued.
    ///
    /// # Safety
    /// The arguments must be the kernel's parameters in number, order and type (a device slice for a
    /// pointer parameter, a value of the same size and layout for a value parameter), and every memory
    /// access the kernel makes with these arguments under `cfg` must stay inside the buffers passed.
    pub(crate) unsafe fn launch<'a>(
        &'a self,
        cfg: LaunchConfig,
        push: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> Result<(), KernelError> {
        let mut args = self.stream.launch_builder(&self.function);
        push(&mut args);
        // SAFETY: the caller's contract (above) is what cudarc's launch requires.
        unsafe { args.launch(cfg) }?;
        Ok(())
    }
}

/// The number of parameters a C signature such as `"scale_<T>(T* x, u64 n, float a)"` declares: the
/// comma-separated entries between its outermost parentheses (0 for `()`).
pub(crate) const fn parameter_count(signature: &str) -> usize {
    let b = signature.as_bytes();
    let mut i = 0;
    while i < b.len() && b[i] != b'(' {
        i += 1;
    }
    i += 1;
    let (mut commas, mut depth, mut any) = (0, 0, false);
    while i < b.len() {
        match b[i] {
            b'(' => depth += 1,
            b')' if depth == 0 => break,
            b')' => depth -= 1,
            b',' if depth == 0 => commas += 1,
            b' ' | b'\t' | b'\n' => {}
            _ => any = true,
        }
        i += 1;
    }
    if any {
        commas + 1
    } else {
        0
    }
}

/// Launches kernel `name` of `module` on `dev` (a `&CudaDevice`) with launch configuration `cfg`, passing
/// the arguments in order; evaluates to `Result<(), KernelError>`:
///
/// ```ignore
/// launch!(dev, &CAST_MODULE, name, cfg,
///     "convert_<S>_<D>(const S* x, D* y, u64 n)",
///     [xs, ys, &n])
/// ```
///
/// The signature string is the kernel's declaration in its `.cu` file; the macro checks at compile time
/// that it declares as many parameters as arguments are passed. Arguments are device slices (`&CudaSlice`
/// for `const T*`, `&mut CudaSlice` for `T*`) or references to named values (`&n`): a temporary would be
/// dropped before the launch reads it.
///
/// Safety, stated once for every use: `launch!` is private to this crate, and each use passes the
/// arguments of the kernel whose signature it states, after the family's `mod.rs` checked every buffer
/// length against the extent that kernel touches for the given shape (see the validation before each
/// dispatch), so [`Kernel::launch`]'s contract holds.
macro_rules! launch {
    ($dev:expr, $module:expr, $name:expr, $cfg:expr, $signature:literal, [$($arg:expr),* $(,)?]) => {{
        const _: () = assert!(
            $crate::launch::parameter_count($signature) == <[&str]>::len(&[$(stringify!($arg)),*]),
            concat!("launch!: the arguments do not match ", $signature)
        );
        let cfg: ::cudarc::driver::LaunchConfig = $cfg;
        let name = $name;
        match $crate::launch::Kernel::new($dev, $module, ::core::convert::AsRef::<str>::as_ref(&name)) {
            Err(e) => Err(e),
            Ok(kernel) => {
                let push = kernel.arguments(|args| {
                    $(::cudarc::driver::PushKernelArg::arg(args, $arg);)*
                });
                // SAFETY: see the macro's documentation: the arguments are those of the stated signature,
                // and the caller validated the buffers against the extents the kernel touches.
                unsafe { kernel.launch(cfg, push) }
            }
        }
    }};
}
pub(crate) use launch;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts() {
        assert_eq!(parameter_count("k()"), 0);
        assert_eq!(parameter_count("k( )"), 0);
        assert_eq!(parameter_count("k(float* x)"), 1);
        assert_eq!(
            parameter_count("scale_<T>(T* x, u64 n, float a) extra, text"),
            3
        );
        assert_eq!(parameter_count("k(void (*f)(int, int), int n)"), 2);
    }

    #[test]
    fn grid_shapes() {
        let g = grid_1d(132, 10, 8);
        assert_eq!(g.grid_dim, (1, 1, 1));
        assert_eq!(grid_1d(132, 1 << 30, 8).grid_dim.0, 132 * 8);
        assert_eq!(cast_transpose_launch(132, 128, 64).block_dim, (256, 1, 1));
        assert_eq!(cast_transpose_launch(132, 100, 64).block_dim, (32, 8, 1));
    }
}
