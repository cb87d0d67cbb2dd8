//! Launching this crate's CUDA kernels: launch shapes, [`Kernel`] (a function of a module, looked up once
//! per device) and [`launch!`], through which every kernel launch of the crate goes.
//!
//! A launch is the one unsafe step of a CUDA kernel call (cudarc cannot check a kernel's parameter list),
//! so its safety argument is made once, at [`Kernel::launch`] and [`launch!`], and each call site states
//! the kernel's C signature beside the arguments it passes. Nothing else in the crate builds a launch
//! (the test `launches_go_through_launch_macro` reads the sources to keep it so).
//!
//! The hot path of a launch does no string work and no driver query: a kernel is named by static pieces
//! ([`kernel_name!`]), its function comes from the device's cache (one `cuModuleGetFunction` per device
//! and name, see [`CudaDevice::function`]), and grids are sized by the SM count the device queried when it
//! was opened ([`CudaDevice::sm_count`]).

use crate::device::{KernelName, LoadedFunction};
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

/// Blocks per SM of the grid-stride kernels.
pub(crate) const BLOCKS_PER_SM: u32 = 8;

/// A grid-stride launch over `items` work items on `dev`: [`grid_1d`] with [`BLOCKS_PER_SM`].
pub(crate) fn grid(dev: &CudaDevice, items: u64) -> LaunchConfig {
    grid_1d(dev.sm_count(), items, BLOCKS_PER_SM)
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
    loaded: Arc<LoadedFunction>,
    dev: CudaDevice,
}

impl Kernel {
    /// Kernel `name` of `module` on `dev`: from the device's function cache, looked up (and the module
    /// compiled) on first use. `module` may be built at run time (the attention tile variants): the cache
    /// keys it by its name.
    pub(crate) fn new(
        dev: &CudaDevice,
        module: &KernelModule,
        name: impl Into<KernelName>,
    ) -> Result<Self, KernelError> {
        Ok(Kernel {
            loaded: dev.function(module, name.into())?,
            dev: dev.clone(),
        })
    }

    /// The cudarc function (for occupancy queries).
    pub(crate) fn function(&self) -> &CudaFunction {
        self.loaded.function()
    }

    /// Lets launches of this kernel use `bytes` of dynamic shared memory (needed above 48 KiB; the
    /// caller checked [`CudaDevice::shared_memory_per_block_optin`]). One driver call per device and
    /// kernel for each larger size; none when an earlier call allowed as much.
    pub(crate) fn allow_dynamic_smem(&self, bytes: usize) -> Result<(), KernelError> {
        self.loaded.allow_dynamic_smem(self.dev.context(), bytes)
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
        let mut args = self.dev.stream().launch_builder(self.loaded.function());
        push(&mut args);
        // SAFETY: the caller's contract (above) is what cudarc's launch requires.
        unsafe { args.launch(cfg) }?;
        Ok(())
    }
}

/// A [`KernelName`] joined from pieces, each a `&'static str` or a number (`u32`, `usize`) written in
/// decimal: `kernel_name!("ln_fwd_", T::NAME, "_nv", nv)` names `ln_fwd_bf16_nv4`. No string is built at
/// the call; the device's function cache joins the pieces once, when it first looks the kernel up.
macro_rules! kernel_name {
    ($($part:expr),+ $(,)?) => {
        $crate::device::KernelName::from_parts([$($crate::device::NamePart::from($part)),+])
    };
}
pub(crate) use kernel_name;

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

/// Launches a kernel with launch configuration `cfg`, passing the arguments in order; evaluates to
/// `Result<(), KernelError>`. Two forms, one checked path:
///
/// ```ignore
/// // Kernel `name` of `module` on `dev` (a `&CudaDevice`), from the device's function cache:
/// launch!(dev, &CAST_MODULE, kernel_name!("convert_", S::NAME, "_", D::NAME), cfg,
///     "convert_<S>_<D>(const S* x, D* y, u64 n)",
///     [xs, ys, &n])
/// // A `&Kernel` looked up before (to raise its shared-memory limit or query its occupancy first):
/// launch!(kernel: &k, cfg, "attn_fwd_<tiles>_hd<HD>(const u16* qkv, ...)", [qkv, ...])
/// ```
///
/// The name is a `&'static str` or a [`kernel_name!`]. The signature string is the kernel's declaration
/// in its `.cu` file; the macro checks at compile time that it declares as many parameters as arguments
/// are passed. Arguments are device slices or views (`&CudaSlice` for `const T*`, `&mut CudaSlice` for
/// `T*`), references to named values (`&n`: a temporary would be dropped before the launch reads it), or
/// the `&p.ptr` of an [`OptionalPtr`] for a pointer that may be null.
///
/// Safety, stated once for every use: `launch!` is private to this crate, and each use passes the
/// arguments of the kernel whose signature it states, after the family's `mod.rs` checked every buffer
/// length against the extent that kernel touches for the given shape (see the validation before each
/// dispatch), so [`Kernel::launch`]'s contract holds.
macro_rules! launch {
    (kernel: $kernel:expr, $cfg:expr, $signature:literal, [$($arg:expr),* $(,)?]) => {{
        const _: () = assert!(
            $crate::launch::parameter_count($signature) == <[&str]>::len(&[$(stringify!($arg)),*]),
            "{}",
            concat!("launch!: the arguments do not match ", $signature)
        );
        let cfg: ::cudarc::driver::LaunchConfig = $cfg;
        let kernel: &$crate::launch::Kernel = $kernel;
        let push = kernel.arguments(|args| {
            $(::cudarc::driver::PushKernelArg::arg(args, $arg);)*
        });
        // SAFETY: see the macro's documentation: the arguments are those of the stated signature, and
        // the caller validated the buffers against the extents the kernel touches.
        unsafe { kernel.launch(cfg, push) }
    }};
    ($dev:expr, $module:expr, $name:expr, $cfg:expr, $signature:literal, [$($arg:expr),* $(,)?]) => {{
        let cfg: ::cudarc::driver::LaunchConfig = $cfg;
        match $crate::launch::Kernel::new($dev, $module, $name) {
            Err(e) => Err(e),
            Ok(kernel) => $crate::launch::launch!(kernel: &kernel, cfg, $signature, [$($arg),*]),
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

    /// The text of each `launch!(...)` invocation in `source` (parentheses matched outside string
    /// literals).
    fn launch_invocations(source: &str) -> Vec<&str> {
        let mut found = Vec::new();
        let mut rest = source;
        while let Some(at) = rest.find("launch!(") {
            let body = &rest[at + "launch!(".len()..];
            let (mut depth, mut in_string, mut escaped, mut end) = (1, false, false, body.len());
            for (i, c) in body.char_indices() {
                match (in_string, c) {
                    (true, _) if escaped => escaped = false,
                    (true, '\\') => escaped = true,
                    (true, '"') => in_string = false,
                    (true, _) => {}
                    (false, '"') => in_string = true,
                    (false, '(') => depth += 1,
                    (false, ')') => {
                        depth -= 1;
                        if depth == 0 {
                            end = i;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            found.push(&body[..end]);
            rest = &body[end..];
        }
        found
    }

    fn rust_sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                rust_sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// Every kernel launch of the crate goes through `launch!` (this file is the only one that builds a
    /// launch); functions are looked up and device limits queried only by the device's caches; and no
    /// `launch!` builds its kernel's name with `format!` (names are `kernel_name!` pieces).
    #[test]
    fn launches_go_through_launch_macro() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        rust_sources(&src, &mut files);
        // (text, the only files allowed to hold it)
        let confined: [(&str, &[&str]); 5] = [
            ("launch_builder(", &["launch.rs"]),
            ("LaunchArgs", &["launch.rs"]),
            ("load_function(", &["device/mod.rs"]),
            (".set_attribute(", &["device/functions.rs"]),
            ("MULTIPROCESSOR_COUNT", &["device/mod.rs"]),
        ];
        let (mut launches, mut problems) = (0, Vec::new());
        for path in &files {
            let rel = path
                .strip_prefix(&src)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            if rel == "launch.rs" {
                continue;
            }
            let text = std::fs::read_to_string(path).unwrap();
            for (needle, allowed) in confined {
                if text.contains(needle) && !allowed.contains(&rel.as_str()) {
                    problems.push(format!("{rel}: {needle}"));
                }
            }
            for invocation in launch_invocations(&text) {
                launches += 1;
                if invocation.contains("format!") {
                    problems.push(format!("{rel}: a launch! names its kernel with format!"));
                }
            }
        }
        assert!(
            problems.is_empty(),
            "launch plumbing outside launch.rs: {problems:#?}"
        );
        // The walk saw the crate's launches (72 when this test was written), so it checks something.
        assert!(
            launches >= 70,
            "only {launches} launch! invocations found under {src:?}"
        );
    }

    #[test]
    fn invocations_are_found_whole() {
        let text = r#"let a = launch!(dev, &M, "k", cfg, "k(int (*f)(int), char c)", [f, &c])?;
            launch!(kernel: &k, cfg, "q(const char* s)", [&s]) // ")" in a comment
            "#;
        let found = launch_invocations(text);
        assert_eq!(found.len(), 2);
        assert!(found[0].ends_with("[f, &c]"), "{}", found[0]);
        assert!(found[1].ends_with("[&s]"), "{}", found[1]);
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
