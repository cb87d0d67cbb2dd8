//! The error type of `fp8-kernels`.

/// Everything that can go wrong in a kernel call. CUDA failures keep the driver's message.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // variant fields are described by the messages
pub enum KernelError {
    /// CUDA cannot be used here: a library is missing, no GPU, or the driver failed to start.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),
    /// The GPU lacks FP8 instructions.
    #[error("FP8 needs compute capability 8.9 or newer; this GPU is {major}.{minor}")]
    Fp8Unsupported { major: i32, minor: i32 },
    /// An operation that exists only on CUDA was called on the CPU.
    #[error("{0} needs a CUDA device")]
    NeedsCuda(&'static str),
    /// Buffers on different devices, or a CPU-only path given a GPU buffer.
    #[error("{0}: buffers are on the wrong device")]
    WrongDevice(&'static str),
    /// Two sizes that must agree do not.
    #[error("{what}: expected {expected} elements, got {actual}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A shape or parameter outside what the kernel supports.
    #[error("{what}: {detail}")]
    InvalidArgument { what: &'static str, detail: String },
    /// NVRTC rejected a kernel source.
    #[error("compiling CUDA module {module} failed: {log}")]
    Compile { module: &'static str, log: String },
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A cuBLASLt call failed.
    #[error("cuBLASLt error: {0:?}")]
    Blas(cudarc::cublaslt::result::CublasError),
    /// An error from fp8-core (formats, scaling).
    #[error(transparent)]
    Core(#[from] fp8_core::Fp8Error),
    /// A bug: an internal invariant failed.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<cudarc::cublaslt::result::CublasError> for KernelError {
    fn from(e: cudarc::cublaslt::result::CublasError) -> Self {
        KernelError::Blas(e)
    }
}
