//! Neural-network layers over fully sharded parameters: [`Linear`] (FP8 per tensor or block-scaled,
//! BF16 or F32), [`Conv2d`], [`MaxPool2d`], [`Dropout`], [`Relu`], [`Gelu`], [`Flatten`],
//! [`LogSoftmaxNll`], the transformer MLP ([`Mlp`], [`MlpBlock`]), the transformer layers
//! ([`Embedding`], [`Norm`] (LayerNorm / RMSNorm, fused with an FP8 linear's input cast), [`CausalSelfAttention`], [`LmHead`] (chunked head + cross-entropy),
//! [`TransformerBlock`], with [`TokenBatch`] for their inputs; see `docs/transformer-layers.md`), and the
//! containers that compose them ([`Sequential`]; any struct of modules).
//!
//! A layer is a [`fsdp_shard::Module`]: it declares its parameters (initialised as PyTorch does), its
//! FP8 scaling metas and its counters, and gets typed ids for them when the model is wrapped by
//! [`fsdp_shard::FsdpModel`]. Its forward and backward take the pass's [`fsdp_shard::Ctx`], which hands
//! out gathered parameters and takes gradients: the layer never sees shards, units or collectives.
//! Tensors ([`Tensor`]) move from layer to layer, so only what a backward needs outlives a layer.
//! Every computation is an `fp8-kernels` kernel, so a layer runs where the model lives (CPU or CUDA).
//! See `docs/architecture.md` and `docs/your-model.md`.
//!
//! A two-layer network trained for one step on two thread ranks:
//!
//! ```
//! use fp8_kernels::Device;
//! use fsdp_comm::{run_ranks, Communicator, ThreadComm};
//! use fsdp_nn::{Layer, Linear, LinearPrecision, NnError, Relu, Sequential, Shape, Tensor};
//! use fsdp_shard::{FsdpConfig, FsdpModel, Mode, WrapPolicy};
//! use std::sync::Arc;
//!
//! let losses = run_ranks(2, |comm: ThreadComm| {
//!     let comm: Arc<dyn Communicator> = Arc::new(comm);
//!     let net = Sequential::new()
//!         .push("fc1", Linear::new(8, 16)?.with_precision(LinearPrecision::F32)?.with_seed(1))
//!         .push("relu", Relu::new())
//!         .push("fc2", Linear::new(16, 1)?.with_precision(LinearPrecision::F32)?.with_seed(2));
//!     let mut model = FsdpModel::new(net, comm, WrapPolicy::Single, FsdpConfig::default())?;
//!     let dev = model.device().clone();
//!     let x = Tensor::new(dev.upload(&[0.5f32; 32])?, Shape::matrix(4, 8)?)?;
//!     let y = model.forward(Mode::Train, |net, ctx| net.forward(ctx, x))?;
//!     // d(sum y)/dy = 1
//!     let dy = Tensor::new(dev.upload(&[1.0f32; 4])?, y.shape())?;
//!     model.backward(|net, ctx| net.backward_params(ctx, dy))?;
//!     Ok::<_, NnError>(y.data().to_vec()?)
//! })?;
//! assert_eq!(losses[0], losses[1]); // the same parameters on both ranks
//! # Ok::<(), NnError>(())
//! ```
#![warn(missing_docs)]

mod activation;
mod attention;
mod block;
mod conv;
mod convert;
mod dropout;
mod embedding;
mod error;
mod flatten;
pub mod init;
mod layer;
mod linear;
mod lm_head;
mod loss;
mod mlp;
mod norm;
mod plain_param;
mod pool;
mod retype;
mod tensor;
mod tokens;

pub use activation::{Gelu, Relu};
pub use attention::{CausalSelfAttention, KvCache, Rope};
pub use block::{BlockConfig, BlockNames, TransformerBlock};
pub use conv::Conv2d;
pub use convert::{
    convert_lm_heads_to_fp8, convert_to_fp8, fp8_auto_ratio, linear_precisions,
    set_linear_precision, Fp8Filter, LinearInfo, DEFAULT_FP8_AUTO_THRESHOLD,
};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use error::NnError;
pub use flatten::Flatten;
pub use layer::{Activation, InputGrad, Layer, Recompute, Sequential};
pub use linear::{
    block_scalable, BlockFp8Saved, BlockScaling, Fp8Saved, Linear, LinearPrecision, WeightInit,
};
pub use lm_head::{LmHead, LossStats, DEFAULT_HEAD_CHUNK};
pub use loss::LogSoftmaxNll;
pub use mlp::{Mlp, MlpActivation, MlpBlock};
pub use norm::Norm;
pub use pool::MaxPool2d;
pub use tensor::{Shape, Tensor, MAX_RANK};
pub use tokens::TokenBatch;
