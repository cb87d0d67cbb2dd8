//! [`TensorView`]: a borrowed buffer with a shape, what layers pass to each other.

use crate::NnError;
use fp8_kernels::{Buffer, Device, Element};

/// The most dimensions a [`Shape`] holds (NCHW images).
pub const MAX_RANK: usize = 4;

/// A row-major shape of up to [`MAX_RANK`] dimensions.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: [usize; MAX_RANK],
    rank: usize,
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.dims())
    }
}

impl Shape {
    /// A shape from its dimensions (1 to [`MAX_RANK`] of them).
    pub fn new(dims: &[usize]) -> Result<Self, NnError> {
        if dims.is_empty() || dims.len() > MAX_RANK {
            return Err(NnError::usage(
                "Shape",
                format!("{} dimensions (1 to {MAX_RANK} supported)", dims.len()),
            ));
        }
        if dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .is_none()
        {
            return Err(NnError::usage("Shape", format!("{dims:?} overflows")));
        }
        let mut d = [1; MAX_RANK];
        d[..dims.len()].copy_from_slice(dims);
        Ok(Shape {
            dims: d,
            rank: dims.len(),
        })
    }

    /// `[rows, cols]`.
    pub fn matrix(rows: usize, cols: usize) -> Result<Self, NnError> {
        Self::new(&[rows, cols])
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.rank]
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims().iter().product()
    }

    /// The last dimension.
    pub fn last(&self) -> usize {
        self.dims[self.rank - 1]
    }

    /// Elements before the last dimension (rows of a matrix view).
    pub fn rows(&self) -> usize {
        self.numel() / self.last().max(1)
    }

    /// The four dimensions of an NCHW shape, or an error naming `layer`.
    pub fn nchw(&self, layer: &str) -> Result<[usize; 4], NnError> {
        if self.rank != 4 {
            return Err(NnError::usage(
                layer,
                format!("expects an NCHW input, got shape {self:?}"),
            ));
        }
        Ok(self.dims)
    }

    /// The same shape with the last dimension replaced.
    pub fn with_last(&self, last: usize) -> Result<Self, NnError> {
        let mut d = self.dims;
        d[self.rank - 1] = last;
        Self::new(&d[..self.rank])
    }
}

/// A buffer and the shape it holds: an activation or a gradient passed from layer to layer. Tensors move:
/// a layer that needs its input for the backward keeps it, otherwise the input's memory is freed as soon
/// as the layer is done with it (on CUDA it returns to the stream's pool and is reused at once), so only
/// what a backward needs outlives a layer.
#[derive(Debug)]
pub struct Tensor<T: Element = f32> {
    data: Buffer<T>,
    shape: Shape,
}

impl<T: Element> Tensor<T> {
    /// `data` as `shape`; the sizes must agree.
    pub fn new(data: Buffer<T>, shape: Shape) -> Result<Self, NnError> {
        if data.len() != shape.numel() {
            return Err(NnError::usage(
                "Tensor",
                format!("{} elements for shape {shape:?}", data.len()),
            ));
        }
        Ok(Tensor { data, shape })
    }

    /// A tensor of `shape` on `device` whose contents a kernel will overwrite.
    pub fn uninit(device: &Device, shape: Shape) -> Result<Self, NnError> {
        Ok(Tensor {
            data: device.uninit(shape.numel())?,
            shape,
        })
    }

    /// A zero tensor of `shape` on `device`.
    pub fn zeros(device: &Device, shape: Shape) -> Result<Self, NnError> {
        Ok(Tensor {
            data: device.zeros(shape.numel())?,
            shape,
        })
    }

    /// The data.
    pub fn data(&self) -> &Buffer<T> {
        &self.data
    }

    /// The data, mutable.
    pub fn data_mut(&mut self) -> &mut Buffer<T> {
        &mut self.data
    }

    /// The shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.data.device()
    }

    /// The same data as another shape of the same size (free).
    pub fn reshape(self, shape: Shape) -> Result<Self, NnError> {
        Self::new(self.data, shape)
    }

    /// The buffer.
    pub fn into_data(self) -> Buffer<T> {
        self.data
    }
}
