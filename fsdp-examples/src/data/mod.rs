//! The MNIST data pipeline: IDX files (plain or gzip), the MNIST CSV form, and [`MnistDataset`] with
//! PyTorch-style normalisation and batch extraction.
//!
//! Get the data with `scripts/fetch-mnist.sh` (writes `data/mnist/`); a real subset of 4000 training
//! and 1000 test digits is committed in this crate's `testdata/` ([`committed_subset_dir`]).

pub mod csv;
pub mod error;
pub mod idx;
pub mod mnist;
mod partial_file;
pub mod tokens;

pub use csv::{parse_mnist_csv, read_mnist_csv};
pub use error::{DataError, FETCH_COMMAND};
pub use idx::{encode_idx_u8, is_gzip, parse_idx_u8, read_idx_u8, write_idx_u8, IdxArray};
pub use mnist::{
    check_mnist_files, committed_subset_dir, normalize_pixel, resolve_data_file, MnistDataset,
    MnistSplit, MnistSummary, DEFAULT_MNIST_DIR, MNIST_CLASSES, MNIST_COLS, MNIST_MEAN, MNIST_ROWS,
    MNIST_STD,
};
