//! Flatten: NCHW to `[N, C*H*W]`.

use super::NnError;

/// Flattens `[N, C, H, W]` to `[N, C*H*W]`. Row-major NCHW data already is that matrix, so no data moves:
/// the layer only checks and maps shapes (forward and backward are the identity on the buffers).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Flatten;

impl Flatten {
    /// The flattened shape `[N, C*H*W]` of an NCHW shape.
    pub fn output_shape(&self, shape: [usize; 4]) -> Result<[usize; 2], NnError> {
        let [n, c, h, w] = shape;
        c.checked_mul(h)
            .and_then(|v| v.checked_mul(w))
            .map(|f| [n, f])
            .ok_or_else(|| NnError::usage("Flatten", format!("shape {shape:?} overflows")))
    }
}
