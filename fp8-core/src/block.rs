//! Block scaling: one scale per tile of a matrix instead of one per tensor (DeepSeek-V3's recipe).
//!
//! A matrix is row-major `[rows, cols]`, its reduction dimension (the GEMM's `K`) the last one, `cols`.
//! [`ScalingGranularity`] names how it is cut into scale blocks:
//!
//! - [`ScalingGranularity::PerTensor`]: one block, the whole matrix (today's per-tensor scaling);
//! - [`ScalingGranularity::Block1x128`]: tiles of 1 row x 128 columns, along the reduction dimension
//!   (activations and output gradients);
//! - [`ScalingGranularity::Block128x128`]: blocks of 128 x 128 (weights).
//!
//! The weight-gradient GEMM reduces over the token dimension, the rows of the activation: there the
//! activation needs tiles of 128 rows within one column (128x1). That is the 1x128 layout of the
//! transposed matrix, `BlockLayout::new(cols, rows, Block1x128)`; [`BlockLayout::with_block_shape`]
//! also describes it untransposed, `(rows, cols, 128, 1)`.
//!
//! [`BlockLayout`] gives the grid of blocks of a shape, the block of an element and the extent of a
//! block. Shapes need not be multiples of the block: the last block of a row or column of blocks is
//! then **partial**, holding only the real elements (no padding is stored in the data), and its scale
//! comes from the amax of those real elements alone. Blocks, and so scales, are numbered row-major over
//! the grid.
//!
//! Each block's scale follows [`block_scale`]: `fmax / amax` (power of two rounded down, or exact
//! rounded down to fit), margin 0; a block whose amax is zero or not finite gets scale 1.
//!
//! ```
//! use fp8_core::{BlockLayout, ScalingGranularity};
//!
//! // 300 tokens x 200 features in 1x128 tiles: 2 tiles per row, the second holding 72 columns.
//! let l = BlockLayout::new(300, 200, ScalingGranularity::Block1x128)?;
//! assert_eq!(l.grid(), [300, 2]);
//! assert_eq!(l.block_of(5, 130)?, 5 * 2 + 1);
//! assert_eq!(l.block_extent(11)?.cols, 72);
//! // The same matrix in 128x128 blocks: a 3 x 2 grid; the last block is 44 x 72.
//! let w = BlockLayout::new(300, 200, ScalingGranularity::Block128x128)?;
//! assert_eq!((w.num_blocks(), w.block_extent(5)?.len()), (6, 44 * 72));
//! # Ok::<(), fp8_core::Fp8Error>(())
//! ```

use crate::{compute_scale, Fp8Error, ScaleRounding};
use std::fmt;

/// The side of a scale block (DeepSeek-V3's tiles and blocks; cuBLASLt's `VEC128_32F` and
/// `BLK128x128_32F` scale modes).
pub const BLOCK_SIZE: usize = 128;

/// How a matrix is cut into scale blocks (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScalingGranularity {
    /// One scale for the whole tensor.
    #[default]
    PerTensor,
    /// One scale per 1 x 128 tile along the last (reduction) dimension.
    Block1x128,
    /// One scale per 128 x 128 block.
    Block128x128,
}

impl ScalingGranularity {
    /// The name in messages and recipe descriptions: `per-tensor`, `1x128`, `128x128`.
    pub const fn name(self) -> &'static str {
        match self {
            ScalingGranularity::PerTensor => "per-tensor",
            ScalingGranularity::Block1x128 => "1x128",
            ScalingGranularity::Block128x128 => "128x128",
        }
    }

    /// Whether the granularity has several scales per tensor.
    pub const fn is_block(self) -> bool {
        !matches!(self, ScalingGranularity::PerTensor)
    }

    /// The block shape `(block_rows, block_cols)` for a `[rows, cols]` matrix (per-tensor: the matrix
    /// itself, at least 1 x 1).
    pub const fn block_shape(self, rows: usize, cols: usize) -> (usize, usize) {
        match self {
            ScalingGranularity::PerTensor => (
                if rows > 0 { rows } else { 1 },
                if cols > 0 { cols } else { 1 },
            ),
            ScalingGranularity::Block1x128 => (1, BLOCK_SIZE),
            ScalingGranularity::Block128x128 => (BLOCK_SIZE, BLOCK_SIZE),
        }
    }
}

impl fmt::Display for ScalingGranularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The real elements of one block: rows `row0 .. row0 + rows`, columns `col0 .. col0 + cols`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockExtent {
    /// First row.
    pub row0: usize,
    /// Number of rows (less than the block's height for a partial last block).
    pub rows: usize,
    /// First column.
    pub col0: usize,
    /// Number of columns (less than the block's width for a partial last block).
    pub cols: usize,
}

impl BlockExtent {
    /// Number of real elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether the block holds no element (never the case for a block of a [`BlockLayout`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The scale blocks of a row-major `[rows, cols]` matrix (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockLayout {
    rows: usize,
    cols: usize,
    block_rows: usize,
    block_cols: usize,
}

impl BlockLayout {
    /// The layout of `granularity` over a `[rows, cols]` matrix. Errors when `rows * cols` overflows.
    pub fn new(
        rows: usize,
        cols: usize,
        granularity: ScalingGranularity,
    ) -> Result<Self, Fp8Error> {
        let (br, bc) = granularity.block_shape(rows, cols);
        Self::with_block_shape(rows, cols, br, bc)
    }

    /// Blocks of `block_rows x block_cols` over a `[rows, cols]` matrix (e.g. `(128, 1)`: the 128x1
    /// tiles of the weight-gradient GEMM's operand, untransposed). Errors when a block side is 0 or
    /// `rows * cols` overflows.
    pub fn with_block_shape(
        rows: usize,
        cols: usize,
        block_rows: usize,
        block_cols: usize,
    ) -> Result<Self, Fp8Error> {
        if block_rows == 0 || block_cols == 0 {
            return Err(Fp8Error::InvalidBlockShape {
                block_rows,
                block_cols,
            });
        }
        if rows.checked_mul(cols).is_none() {
            return Err(Fp8Error::ShapeOverflow(vec![rows, cols]));
        }
        Ok(BlockLayout {
            rows,
            cols,
            block_rows,
            block_cols,
        })
    }

    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of the matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The full block shape `[block_rows, block_cols]` (partial blocks are smaller).
    pub fn block_shape(&self) -> [usize; 2] {
        [self.block_rows, self.block_cols]
    }

    /// Number of elements of the matrix.
    pub fn numel(&self) -> usize {
        // Checked at construction.
        self.rows * self.cols
    }

    /// The grid of blocks `[block rows, block columns]`: `ceil(rows / block_rows)` by
    /// `ceil(cols / block_cols)` (an empty matrix has no blocks).
    pub fn grid(&self) -> [usize; 2] {
        [
            self.rows.div_ceil(self.block_rows),
            self.cols.div_ceil(self.block_cols),
        ]
    }

    /// Number of blocks, the length of the scale vector.
    pub fn num_blocks(&self) -> usize {
        let [gr, gc] = self.grid();
        // At most numel, so no overflow.
        gr * gc
    }

    /// The transposed matrix `[cols, rows]` with transposed blocks (`block_cols x block_rows`): block
    /// `(i, j)` of this layout is block `(j, i)` of the transpose, with the same elements.
    pub fn transposed(&self) -> BlockLayout {
        BlockLayout {
            rows: self.cols,
            cols: self.rows,
            block_rows: self.block_cols,
            block_cols: self.block_rows,
        }
    }

    /// The grid position `[block row, block column]` of element `(row, col)`. Errors outside the
    /// matrix.
    pub fn block_position(&self, row: usize, col: usize) -> Result<[usize; 2], Fp8Error> {
        if row >= self.rows || col >= self.cols {
            return Err(Fp8Error::ElementOutOfRange {
                row,
                col,
                rows: self.rows,
                cols: self.cols,
            });
        }
        Ok([row / self.block_rows, col / self.block_cols])
    }

    /// The index (row-major over the grid) of the block holding element `(row, col)`: the index of its
    /// scale. Errors outside the matrix.
    pub fn block_of(&self, row: usize, col: usize) -> Result<usize, Fp8Error> {
        let [i, j] = self.block_position(row, col)?;
        Ok(i * self.grid()[1] + j)
    }

    /// The real elements of block `block` (partial at the bottom and right edges). Errors when
    /// `block >= num_blocks()`.
    pub fn block_extent(&self, block: usize) -> Result<BlockExtent, Fp8Error> {
        let n = self.num_blocks();
        if block >= n {
            return Err(Fp8Error::BlockOutOfRange { block, blocks: n });
        }
        let gc = self.grid()[1];
        let (i, j) = (block / gc, block % gc);
        let (row0, col0) = (i * self.block_rows, j * self.block_cols);
        Ok(BlockExtent {
            row0,
            rows: self.block_rows.min(self.rows - row0),
            col0,
            cols: self.block_cols.min(self.cols - col0),
        })
    }
}

/// The scale of one block whose amax (largest `|x|` of its real elements, NaN ignored) is `amax`, for a
/// format whose largest finite value is `fmax`: [`compute_scale`] with margin 0 and the previous scale
/// taken as 1. So `amax * scale <= fmax` in f32, the scale is `fmax / amax` rounded down (to a power of
/// two with [`ScaleRounding::PowerOfTwo`]), and a block whose amax is zero (all zeros) or not finite
/// gets scale 1.
pub fn block_scale(amax: f32, fmax: f32, rounding: ScaleRounding) -> f32 {
    compute_scale(amax, fmax, 0, rounding, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_of_the_three_granularities() {
        let t = BlockLayout::new(300, 200, ScalingGranularity::PerTensor).unwrap();
        assert_eq!(
            (t.grid(), t.block_extent(0).unwrap().len()),
            ([1, 1], 60000)
        );
        let a = BlockLayout::new(300, 200, ScalingGranularity::Block1x128).unwrap();
        assert_eq!(a.grid(), [300, 2]);
        assert_eq!(a.block_of(299, 199).unwrap(), 599);
        assert_eq!(
            a.block_extent(599).unwrap(),
            BlockExtent {
                row0: 299,
                rows: 1,
                col0: 128,
                cols: 72
            }
        );
        let w = BlockLayout::new(256, 128, ScalingGranularity::Block128x128).unwrap();
        assert_eq!(w.grid(), [2, 1]);
        assert_eq!(w.block_extent(1).unwrap().len(), 128 * 128);
        // The 128x1 tiles of a matrix are the 1x128 tiles of its transpose.
        let col = BlockLayout::with_block_shape(300, 200, 128, 1).unwrap();
        assert_eq!(
            col.transposed(),
            BlockLayout::new(200, 300, ScalingGranularity::Block1x128).unwrap()
        );
    }

    #[test]
    fn empty_matrices_have_no_blocks() {
        for g in [
            ScalingGranularity::PerTensor,
            ScalingGranularity::Block1x128,
            ScalingGranularity::Block128x128,
        ] {
            for (r, c) in [(0, 0), (0, 5), (7, 0)] {
                let l = BlockLayout::new(r, c, g).unwrap();
                assert_eq!(l.num_blocks(), 0, "{g} {r}x{c}");
                assert!(l.block_extent(0).is_err());
                assert!(l.block_of(0, 0).is_err());
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert_eq!(
            BlockLayout::with_block_shape(4, 4, 0, 1),
            Err(Fp8Error::InvalidBlockShape {
                block_rows: 0,
                block_cols: 1
            })
        );
        assert!(matches!(
            BlockLayout::new(usize::MAX, 2, ScalingGranularity::Block1x128),
            Err(Fp8Error::ShapeOverflow(_))
        ));
        let l = BlockLayout::new(3, 130, ScalingGranularity::Block1x128).unwrap();
        assert_eq!(
            l.block_of(3, 0),
            Err(Fp8Error::ElementOutOfRange {
                row: 3,
                col: 0,
                rows: 3,
                cols: 130
            })
        );
        assert!(l.block_of(0, 130).is_err());
        assert_eq!(
            l.block_extent(6),
            Err(Fp8Error::BlockOutOfRange {
                block: 6,
                blocks: 6
            })
        );
    }

    #[test]
    fn block_scale_rule() {
        // 448 / 3 = 149.3: 128 as a power of two, 149.33.. exactly (rounded down to fit).
        assert_eq!(block_scale(3.0, 448.0, ScaleRounding::PowerOfTwo), 128.0);
        let s = block_scale(3.0, 448.0, ScaleRounding::Exact);
        assert!(3.0 * s <= 448.0 && s > 149.3, "{s}");
        for a in [0.0, f32::INFINITY, f32::NAN] {
            assert_eq!(block_scale(a, 448.0, ScaleRounding::Exact), 1.0);
            assert_eq!(block_scale(a, 448.0, ScaleRounding::PowerOfTwo), 1.0);
        }
    }
}
