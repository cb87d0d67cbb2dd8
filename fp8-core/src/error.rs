//! The error type of `fp8-core`.

use crate::QType;

/// Everything that can go wrong in `fp8-core`. Each variant names the values involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[allow(missing_docs)] // variant fields are described by the messages
pub enum Fp8Error {
    /// Two buffers that must have the same length do not.
    #[error("length mismatch: expected {expected} elements, got {actual}")]
    LengthMismatch { expected: usize, actual: usize },
    /// A shape's element count does not match the data.
    #[error("shape {shape:?} holds {expected} elements but the data has {actual}")]
    ShapeMismatch {
        shape: Vec<usize>,
        expected: usize,
        actual: usize,
    },
    /// A byte buffer's length is not the element count times the element size.
    #[error("{qtype} data of {elements} elements needs {expected} bytes, got {actual}")]
    ByteLengthMismatch {
        qtype: QType,
        elements: usize,
        expected: usize,
        actual: usize,
    },
    /// A shape whose element count overflows `usize`.
    #[error("shape {0:?} has too many elements")]
    ShapeOverflow(Vec<usize>),
    /// A scale that is zero, negative, subnormal or not finite.
    #[error("invalid scale {0}: a scale must be a positive, normal, finite f32")]
    InvalidScale(f32),
    /// An amax history window of length zero.
    #[error("amax history length must be at least 1")]
    EmptyHistory,
    /// A margin that would push the scale out of the f32 range.
    #[error("margin {0} is out of range (allowed 0..=64)")]
    InvalidMargin(i32),
    /// An operation that needs an FP8 type was given another one.
    #[error("{0} is not an FP8 type")]
    NotFp8(QType),
    /// A scale block with a side of zero.
    #[error("block shape {block_rows}x{block_cols}: both sides must be at least 1")]
    InvalidBlockShape {
        block_rows: usize,
        block_cols: usize,
    },
    /// An element outside its matrix.
    #[error("element ({row}, {col}) is outside a {rows}x{cols} matrix")]
    ElementOutOfRange {
        row: usize,
        col: usize,
        rows: usize,
        cols: usize,
    },
    /// A block index not below the number of blocks.
    #[error("block {block} does not exist (the layout has {blocks} blocks)")]
    BlockOutOfRange { block: usize, blocks: usize },
    /// A recipe whose parts contradict each other (named in the message).
    #[error("invalid FP8 recipe: {0}")]
    InvalidRecipe(String),
    /// A type name that is not one of the known ones.
    #[error("unknown type name {0:?} (expected e4m3, e5m2, f16, bf16 or f32)")]
    UnknownQType(String),
}
