//! Flattening `[N, ...]` to `[N, features]` (a reshape: no copy).

use crate::layer::{module_without_state, Activation, InputGrad, Layer};
use crate::{NnError, Shape, Tensor};
use fsdp_shard::Ctx;

/// `[N, d1, d2, ...] -> [N, d1 * d2 * ...]`; the backward restores the input shape.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Flatten {
    in_shape: Option<Shape>,
}

impl Flatten {
    /// A flatten layer.
    pub fn new() -> Self {
        Self::default()
    }
}

module_without_state!(Flatten);

impl<T: Activation> Layer<T> for Flatten {
    fn forward(&mut self, _ctx: &mut Ctx<'_>, x: Tensor<T>) -> Result<Tensor<T>, NnError> {
        let s = x.shape();
        let n = s.dims()[0];
        let features = s.numel() / n.max(1);
        self.in_shape = Some(s);
        x.reshape(Shape::matrix(n, features)?)
    }

    fn backward_step(&mut self, _ctx: &mut Ctx<'_>, dy: Tensor<T>, need_dx: bool) -> InputGrad<T> {
        let s = self
            .in_shape
            .ok_or_else(|| NnError::usage("Flatten", "backward before forward"))?;
        if !need_dx {
            return Ok(None);
        }
        Ok(Some(dy.reshape(s)?))
    }
}
