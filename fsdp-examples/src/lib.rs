//! The models, data and binaries of fp8-fsdp, each a task of the `fsdp_train::Trainer`: a model here is
//! its layers, its data and its loss, and needs no training loop of its own.
//!
//! - [`data`]: IDX files (plain or gzip), MNIST CSV, [`data::MnistDataset`] with PyTorch-style
//!   normalisation and NCHW batch extraction; tokenised text in llm.c's format (`data::tokens`).
//!   `scripts/fetch-mnist.sh` downloads the full MNIST; a real subset is committed in this crate's
//!   `testdata/`.
//! - [`mnist`]: the reference MNIST net and its task ([`mnist::MnistTask`]); binary `mnist_fsdp`.
//! - [`gpt`]: the GPT-2 family language model ([`gpt::Gpt`], presets, FLOPs per token).
//! - [`hf`]: Hugging Face interop for Llama 3 (`config.json`, the fused-name map, safetensors
//!   directories, single or sharded).
//! - [`lm`]: language models on the Trainer ([`lm::LmTask`]: the peer's data, optimizer, schedule and
//!   validation, sampling); binary `lm_fsdp`.
//! - [`mlp`]: the MLP-stack benchmark model; binary `mlp_bench`.
//! - [`sampler`]: [`sampler::DistributedSampler`], one seeded shuffle per epoch with the same global
//!   order for every world size.
//!
//! Two ranks split one epoch of a tiny dataset written to and read back from an IDX file:
//!
//! ```
//! use fsdp_examples::data::{parse_idx_u8, encode_idx_u8, IdxArray, MnistDataset};
//! use fsdp_examples::sampler::{DistributedSampler, Remainder};
//!
//! // Five 2x2 "images" and their labels, through the IDX encoder and reader.
//! let pixels: Vec<u8> = (0..20).map(|i| (i * 12) as u8).collect();
//! let bytes = encode_idx_u8(&IdxArray::new(vec![5, 2, 2], pixels.clone())?)?;
//! let read = parse_idx_u8(&bytes, "in-memory")?;
//! assert_eq!(read.dims, [5, 2, 2]);
//! let data = MnistDataset::from_raw(read.data, vec![3, 1, 4, 1, 5], 2, 2)?;
//!
//! // Five samples over two ranks, padded by wrapping: 3 per rank, disjoint but for the one pad.
//! let rank0 = DistributedSampler::new(data.len(), 2, 0, 42, Remainder::Pad)?;
//! let rank1 = rank0.for_rank(1)?;
//! let (a, b) = (rank0.indices(1), rank1.indices(1));
//! assert_eq!((a.len(), b.len()), (3, 3));
//! assert_eq!(rank1.num_real_samples(), 2); // rank 1's last sample is the pad
//! let mut seen: Vec<usize> = a.iter().chain(&b[..2]).copied().collect();
//! seen.sort();
//! assert_eq!(seen, [0, 1, 2, 3, 4]);
//!
//! // The global order interleaves the ranks and does not depend on the world size.
//! let one_rank = DistributedSampler::new(data.len(), 1, 0, 42, Remainder::Pad)?;
//! assert_eq!(one_rank.indices(1)[..4], [a[0], b[0], a[1], b[1]]);
//!
//! // A normalised NCHW batch of rank 0's first two samples.
//! let mut images = vec![0f32; 2 * 4];
//! let mut labels = vec![0i32; 2];
//! data.fill_batch(&a[..2], &mut images, &mut labels)?;
//! assert_eq!(labels[0], i32::from(data.labels()[a[0]]));
//! assert_eq!(images[0], (f32::from(pixels[4 * a[0]]) / 255.0 - 0.1307) / 0.3081);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

pub mod data;
mod decoder;
mod error;
pub mod gpt;
pub mod hf;
pub mod llama;
pub mod lm;
pub mod mlp;
pub mod mnist;
pub mod sampler;

pub use error::ModelError;
