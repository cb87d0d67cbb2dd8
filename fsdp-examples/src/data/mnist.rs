//! The MNIST dataset: loading from IDX files, normalisation and batch extraction.

use std::path::{Path, PathBuf};

use super::error::DataError;
use super::idx::{read_idx_u8, write_idx_u8, IdxArray};

/// Mean of the MNIST training pixels scaled to [0, 1] (PyTorch's MNIST example uses it to normalise).
pub const MNIST_MEAN: f32 = 0.1307;
/// Standard deviation of the MNIST training pixels scaled to [0, 1].
pub const MNIST_STD: f32 = 0.3081;
/// Image height of MNIST.
pub const MNIST_ROWS: usize = 28;
/// Image width of MNIST.
pub const MNIST_COLS: usize = 28;
/// Number of classes (digits 0-9).
pub const MNIST_CLASSES: usize = 10;
/// Where `scripts/fetch-mnist.sh` writes the IDX files by default, relative to the repository root.
pub const DEFAULT_MNIST_DIR: &str = "data/mnist";

/// The directory of the committed MNIST subset (4000 training and 1000 test digits, gzipped IDX) of this
/// crate's source tree, for tests and quick demos. The path is fixed at build time, so it is valid only
/// on the machine that built the crate.
pub fn committed_subset_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata"))
}

/// One of the two MNIST splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MnistSplit {
    /// The 60000 training digits.
    Train,
    /// The 10000 test digits.
    Test,
}

impl MnistSplit {
    /// The standard file name of the split's images (`train-images-idx3-ubyte`, ...), without `.gz`.
    pub fn images_file_name(self) -> &'static str {
        match self {
            MnistSplit::Train => "train-images-idx3-ubyte",
            MnistSplit::Test => "t10k-images-idx3-ubyte",
        }
    }

    /// The standard file name of the split's labels, without `.gz`.
    pub fn labels_file_name(self) -> &'static str {
        match self {
            MnistSplit::Train => "train-labels-idx1-ubyte",
            MnistSplit::Test => "t10k-labels-idx1-ubyte",
        }
    }

    /// The number of digits in the full split (60000 or 10000).
    pub fn full_len(self) -> usize {
        match self {
            MnistSplit::Train => 60_000,
            MnistSplit::Test => 10_000,
        }
    }

    /// A lowercase name for messages (`train`, `test`).
    pub fn name(self) -> &'static str {
        match self {
            MnistSplit::Train => "train",
            MnistSplit::Test => "test",
        }
    }
}

/// Normalises one pixel as PyTorch's MNIST example does (`ToTensor` then `Normalize((0.1307,), (0.3081,))`),
/// in f32 arithmetic: `(p / 255 - 0.1307) / 0.3081`.
pub fn normalize_pixel(pixel: u8) -> f32 {
    (f32::from(pixel) / 255.0 - MNIST_MEAN) / MNIST_STD
}

/// [`normalize_pixel`] for all 256 byte values; batch extraction looks pixels up here.
fn normalization_table() -> [f32; 256] {
    let mut table = [0f32; 256];
    for (p, slot) in table.iter_mut().enumerate() {
        *slot = normalize_pixel(p as u8);
    }
    table
}

/// Finds `dir/name`, or `dir/name.gz` when only the compressed file exists. Something that is not a
/// file in either place (a directory, say) is [`DataError::NotAFile`] naming it, not "missing".
pub fn resolve_data_file(dir: impl AsRef<Path>, name: &str) -> Result<PathBuf, DataError> {
    let dir = dir.as_ref();
    let plain = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    for path in [&plain, &gz] {
        // Follows symbolic links, as opening the file will.
        match std::fs::metadata(path) {
            Ok(m) if m.is_file() => return Ok(path.clone()),
            Ok(m) => {
                return Err(DataError::NotAFile {
                    path: path.clone(),
                    kind: if m.is_dir() {
                        "directory"
                    } else {
                        "special file"
                    },
                })
            }
            Err(_) => {}
        }
    }
    Err(DataError::Missing {
        path: plain,
        dir: dir.to_path_buf(),
    })
}

/// Checks that `dir` holds the four MNIST files (each plain or `.gz`): [`DataError::MissingFiles`]
/// names every missing one, [`DataError::NotAFile`] a directory in a file's place.
pub fn check_mnist_files(dir: impl AsRef<Path>) -> Result<(), DataError> {
    let dir = dir.as_ref();
    let mut names = Vec::new();
    for split in [MnistSplit::Train, MnistSplit::Test] {
        for name in [split.images_file_name(), split.labels_file_name()] {
            match resolve_data_file(dir, name) {
                Ok(_) => {}
                Err(DataError::Missing { .. }) => names.push(name.to_string()),
                Err(e) => return Err(e),
            }
        }
    }
    if names.is_empty() {
        Ok(())
    } else {
        Err(DataError::MissingFiles {
            dir: dir.to_path_buf(),
            names,
        })
    }
}

/// Pixel statistics of a dataset, for checking a download.
#[derive(Debug, Clone, PartialEq)]
pub struct MnistSummary {
    /// Number of digits.
    pub len: usize,
    /// How many digits of each class 0-9.
    pub label_histogram: [usize; MNIST_CLASSES],
    /// Smallest pixel value.
    pub min_pixel: u8,
    /// Largest pixel value.
    pub max_pixel: u8,
    /// Mean of the pixels scaled to [0, 1] (0.1307 on the MNIST training set).
    pub mean: f64,
    /// Standard deviation of the pixels scaled to [0, 1] (0.3081 on the MNIST training set).
    pub std: f64,
}

/// MNIST digits held as raw bytes (`len * rows * cols` pixels, row-major) and labels 0-9.
///
/// Pixels stay `u8` in memory (a quarter of the f32 size) and are normalised when a batch is extracted
/// ([`MnistDataset::fill_batch`]) or all at once ([`MnistDataset::normalized_images`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MnistDataset {
    images: Vec<u8>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
}

impl MnistDataset {
    /// Builds a dataset from raw pixels and labels, checking sizes and that every label is 0-9.
    pub fn from_raw(
        images: Vec<u8>,
        labels: Vec<u8>,
        rows: usize,
        cols: usize,
    ) -> Result<Self, DataError> {
        let pixels = rows.checked_mul(cols).unwrap_or(0);
        if pixels == 0 {
            return Err(DataError::invalid(
                "MnistDataset::from_raw",
                format!("image shape {rows}x{cols} is empty or too large"),
            ));
        }
        if labels.is_empty() {
            return Err(DataError::invalid("MnistDataset::from_raw", "no digits"));
        }
        if labels.len().checked_mul(pixels) != Some(images.len()) {
            return Err(DataError::invalid(
                "MnistDataset::from_raw",
                format!(
                    "{} labels need {} pixels of {rows}x{cols} images, got {}",
                    labels.len(),
                    labels.len().saturating_mul(pixels),
                    images.len()
                ),
            ));
        }
        if let Some((i, &l)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| usize::from(l) >= MNIST_CLASSES)
        {
            return Err(DataError::invalid(
                "MnistDataset::from_raw",
                format!("label {l} of digit {i} is not 0-9"),
            ));
        }
        Ok(MnistDataset {
            images,
            labels,
            rows,
            cols,
        })
    }

    /// Loads a split from `dir`, which holds the standard IDX file names, each plain or with `.gz`.
    ///
    /// A missing file is [`DataError::Missing`], whose message names `scripts/fetch-mnist.sh`; images
    /// that are not 28x28 are [`DataError::NotMnist`] naming the file.
    pub fn load(dir: impl AsRef<Path>, split: MnistSplit) -> Result<Self, DataError> {
        let dir = dir.as_ref();
        let images = resolve_data_file(dir, split.images_file_name())?;
        let labels = resolve_data_file(dir, split.labels_file_name())?;
        let data = Self::from_idx_files(&images, &labels)?;
        if (data.rows, data.cols) != (MNIST_ROWS, MNIST_COLS) {
            return Err(DataError::NotMnist {
                path: images,
                reason: format!(
                    "the images are {}x{} pixels; MNIST digits are {MNIST_ROWS}x{MNIST_COLS}",
                    data.rows, data.cols
                ),
            });
        }
        Ok(data)
    }

    /// Loads images (`[n, rows, cols]`) and labels (`[n]`) from two IDX files and checks they agree.
    pub fn from_idx_files(
        images_path: impl AsRef<Path>,
        labels_path: impl AsRef<Path>,
    ) -> Result<Self, DataError> {
        let images_path = images_path.as_ref();
        let labels_path = labels_path.as_ref();
        let images = read_idx_u8(images_path)?;
        let labels = read_idx_u8(labels_path)?;
        let not_mnist = |path: &Path, reason: String| DataError::NotMnist {
            path: path.to_path_buf(),
            reason,
        };
        let [n, rows, cols] = images.dims[..] else {
            return Err(not_mnist(
                images_path,
                format!(
                    "images need 3 dimensions [n, rows, cols], the file has {:?}",
                    images.dims
                ),
            ));
        };
        let [n_labels] = labels.dims[..] else {
            return Err(not_mnist(
                labels_path,
                format!(
                    "labels need 1 dimension [n], the file has {:?}",
                    labels.dims
                ),
            ));
        };
        if n != n_labels {
            return Err(not_mnist(
                labels_path,
                format!(
                    "{n_labels} labels for the {n} images of {}",
                    images_path.display()
                ),
            ));
        }
        if n == 0 || rows == 0 || cols == 0 {
            return Err(not_mnist(
                images_path,
                format!("empty image array {:?}", images.dims),
            ));
        }
        if let Some((i, &l)) = labels
            .data
            .iter()
            .enumerate()
            .find(|(_, &l)| usize::from(l) >= MNIST_CLASSES)
        {
            return Err(not_mnist(
                labels_path,
                format!("label {l} of digit {i} is not 0-9"),
            ));
        }
        Ok(MnistDataset {
            images: images.data,
            labels: labels.data,
            rows,
            cols,
        })
    }

    /// Writes the dataset as the split's two standard IDX files into `dir` (created if needed), with
    /// `.gz` appended and gzip compression when `gzip` is true. Returns the paths written.
    pub fn write_idx(
        &self,
        dir: impl AsRef<Path>,
        split: MnistSplit,
        gzip: bool,
    ) -> Result<(PathBuf, PathBuf), DataError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| DataError::Io {
            path: dir.to_path_buf(),
            source: e,
        })?;
        let suffix = if gzip { ".gz" } else { "" };
        let images_path = dir.join(format!("{}{suffix}", split.images_file_name()));
        let labels_path = dir.join(format!("{}{suffix}", split.labels_file_name()));
        let images = IdxArray::new(vec![self.len(), self.rows, self.cols], self.images.clone())?;
        let labels = IdxArray::new(vec![self.len()], self.labels.clone())?;
        write_idx_u8(&images_path, &images, gzip)?;
        write_idx_u8(&labels_path, &labels, gzip)?;
        Ok((images_path, labels_path))
    }

    /// Number of digits.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Always false: a dataset holds at least one digit.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Image height.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Image width.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Pixels per image (`rows * cols`).
    pub fn pixels_per_image(&self) -> usize {
        self.rows * self.cols
    }

    /// All raw pixels, image after image.
    pub fn images(&self) -> &[u8] {
        &self.images
    }

    /// All labels.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// The raw pixels of digit `index`, or `None` past the end.
    pub fn image(&self, index: usize) -> Option<&[u8]> {
        let p = self.pixels_per_image();
        self.images
            .get(index.checked_mul(p)?..(index + 1).checked_mul(p)?)
    }

    /// The label of digit `index`, or `None` past the end.
    pub fn label(&self, index: usize) -> Option<u8> {
        self.labels.get(index).copied()
    }

    /// A new dataset of the digits at `indices`, in that order.
    pub fn subset(&self, indices: &[usize]) -> Result<Self, DataError> {
        let p = self.pixels_per_image();
        let mut images = Vec::with_capacity(indices.len() * p);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            let image = self
                .image(i)
                .ok_or_else(|| self.out_of_range("MnistDataset::subset", i))?;
            images.extend_from_slice(image);
            labels.push(self.labels[i]);
        }
        Self::from_raw(images, labels, self.rows, self.cols)
    }

    /// The first `n` digits (all of them when `n >= len`); `n` must be at least 1.
    pub fn first(&self, n: usize) -> Result<Self, DataError> {
        if n == 0 {
            return Err(DataError::invalid(
                "MnistDataset::first",
                "a dataset needs at least one digit",
            ));
        }
        let n = n.min(self.len());
        Ok(MnistDataset {
            images: self.images[..n * self.pixels_per_image()].to_vec(),
            labels: self.labels[..n].to_vec(),
            rows: self.rows,
            cols: self.cols,
        })
    }

    fn out_of_range(&self, what: &'static str, index: usize) -> DataError {
        DataError::invalid(
            what,
            format!("index {index} is out of range for {} digits", self.len()),
        )
    }

    /// Fills a batch: `images_out` receives the normalised digits at `indices` as NCHW `[B, 1, rows,
    /// cols]` f32 (B = `indices.len()`), `labels_out` their labels as i32.
    ///
    /// Errors when a buffer has the wrong length or an index is out of range; the buffers may be
    /// partly written then.
    pub fn fill_batch(
        &self,
        indices: &[usize],
        images_out: &mut [f32],
        labels_out: &mut [i32],
    ) -> Result<(), DataError> {
        let p = self.pixels_per_image();
        let want = indices.len().checked_mul(p);
        if want != Some(images_out.len()) {
            return Err(DataError::invalid(
                "MnistDataset::fill_batch",
                format!(
                    "images_out holds {} floats; {} digits of {}x{} need {}",
                    images_out.len(),
                    indices.len(),
                    self.rows,
                    self.cols,
                    indices.len().saturating_mul(p)
                ),
            ));
        }
        if labels_out.len() != indices.len() {
            return Err(DataError::invalid(
                "MnistDataset::fill_batch",
                format!(
                    "labels_out holds {} labels for {} digits",
                    labels_out.len(),
                    indices.len()
                ),
            ));
        }
        let table = normalization_table();
        for ((&i, out), label) in indices
            .iter()
            .zip(images_out.chunks_exact_mut(p))
            .zip(labels_out.iter_mut())
        {
            let image = self
                .image(i)
                .ok_or_else(|| self.out_of_range("MnistDataset::fill_batch", i))?;
            for (o, &px) in out.iter_mut().zip(image) {
                *o = table[usize::from(px)];
            }
            *label = i32::from(self.labels[i]);
        }
        Ok(())
    }

    /// All images normalised, `[len, 1, rows, cols]` f32 (e.g. to upload a whole split to a GPU once).
    pub fn normalized_images(&self) -> Vec<f32> {
        let table = normalization_table();
        self.images.iter().map(|&p| table[usize::from(p)]).collect()
    }

    /// All labels as i32.
    pub fn labels_i32(&self) -> Vec<i32> {
        self.labels.iter().map(|&l| i32::from(l)).collect()
    }

    /// Label histogram and pixel statistics.
    pub fn summary(&self) -> MnistSummary {
        let mut label_histogram = [0usize; MNIST_CLASSES];
        for &l in &self.labels {
            label_histogram[usize::from(l)] += 1;
        }
        let mut pixel_histogram = [0u64; 256];
        for &p in &self.images {
            pixel_histogram[usize::from(p)] += 1;
        }
        let min_pixel = pixel_histogram.iter().position(|&c| c > 0).unwrap_or(0) as u8;
        let max_pixel = pixel_histogram.iter().rposition(|&c| c > 0).unwrap_or(0) as u8;
        let n = self.images.len() as f64;
        let (mut sum, mut sum_sq) = (0f64, 0f64);
        for (p, &c) in pixel_histogram.iter().enumerate() {
            let x = p as f64 / 255.0;
            sum += c as f64 * x;
            sum_sq += c as f64 * x * x;
        }
        let mean = sum / n;
        let std = (sum_sq / n - mean * mean).max(0.0).sqrt();
        MnistSummary {
            len: self.len(),
            label_histogram,
            min_pixel,
            max_pixel,
            mean,
            std,
        }
    }
}
