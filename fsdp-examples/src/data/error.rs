//! The error type of the data pipeline.

use std::path::PathBuf;

/// The command that downloads MNIST and writes the IDX files; named by every "file missing" error.
pub const FETCH_COMMAND: &str = "scripts/fetch-mnist.sh";

/// Everything that can go wrong while reading or writing data files.
///
/// Every variant that concerns a file names it, so a user sees which file is bad and why.
#[derive(Debug, thiserror::Error)]
#[allow(missing_docs)] // variant fields are described by the messages
pub enum DataError {
    /// A data file does not exist (neither plain nor with `.gz`).
    #[error(
        "{} not found: run `{FETCH_COMMAND} {}` to download MNIST and write the IDX files",
        path.display(),
        dir.display()
    )]
    Missing { path: PathBuf, dir: PathBuf },
    /// Files of a data directory do not exist (neither plain nor with `.gz`); all of them are named.
    #[error(
        "MNIST files missing in {}: {} (neither plain nor .gz); run `{FETCH_COMMAND} {}` to \
         download MNIST and write the IDX files",
        dir.display(),
        names.join(", "),
        dir.display()
    )]
    MissingFiles { dir: PathBuf, names: Vec<String> },
    /// Something other than a regular file (a directory, say) is where a data file should be.
    #[error("{}: is a {kind}, not a data file; move it away or point to another directory", path.display())]
    NotAFile { path: PathBuf, kind: &'static str },
    /// The operating system refused a read or write.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A gzip stream that cannot be decompressed.
    #[error("{}: corrupt gzip stream: {source}", path.display())]
    Gzip {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The header of an IDX file is not valid (magic number, element type, dimensions).
    #[error("{}: not a valid IDX file: {reason}", path.display())]
    Malformed { path: PathBuf, reason: String },
    /// The payload is shorter than the header promises.
    #[error(
        "{}: truncated: the header promises {expected} bytes of data, the file holds {found}; \
         delete it and run `{FETCH_COMMAND}` again",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        expected: usize,
        found: usize,
    },
    /// The payload is longer than the header promises (a foreign or corrupt file).
    #[error(
        "{}: {extra} unexpected bytes after the {expected} bytes the header promises",
        path.display()
    )]
    TrailingBytes {
        path: PathBuf,
        expected: usize,
        extra: usize,
    },
    /// A file is a valid IDX file but not what an MNIST split needs.
    #[error("{}: not MNIST data: {reason}", path.display())]
    NotMnist { path: PathBuf, reason: String },
    /// A line of an MNIST CSV file cannot be parsed.
    #[error("{}:{line}: {reason}", path.display())]
    Csv {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    /// Arguments that do not fit together (buffer sizes, indices, shapes).
    #[error("{what}: {detail}")]
    InvalidArgument { what: &'static str, detail: String },
}

impl DataError {
    /// Wraps an I/O error, turning "not found" into [`DataError::Missing`] with the fetch hint.
    pub(crate) fn from_io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("."));
            DataError::Missing { path, dir }
        } else {
            DataError::Io { path, source }
        }
    }

    /// Whether this says data files are missing (so fetching them may help).
    pub fn is_missing(&self) -> bool {
        matches!(
            self,
            DataError::Missing { .. } | DataError::MissingFiles { .. }
        )
    }

    pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> Self {
        DataError::InvalidArgument {
            what,
            detail: detail.into(),
        }
    }
}
