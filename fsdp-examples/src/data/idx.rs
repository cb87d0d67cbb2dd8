//! The IDX file format of MNIST: read and write, plain or gzip-compressed.
//!
//! An IDX file is a big-endian header followed by the raw elements in row-major order:
//!
//! | bytes | meaning |
//! | --- | --- |
//! | 0, 1 | zero |
//! | 2 | element type: `0x08` u8, `0x09` i8, `0x0B` i16, `0x0C` i32, `0x0D` f32, `0x0E` f64 |
//! | 3 | number of dimensions `d` |
//! | 4 .. 4 + 4d | each dimension as a big-endian `u32` |
//! | then | `product(dims) * element size` bytes of data |
//!
//! MNIST uses unsigned bytes only (images `[n, 28, 28]`, labels `[n]`), so this module reads and writes
//! `u8` arrays and rejects the other element types with a clear error. A file that starts with the gzip
//! magic `1f 8b` is decompressed on the fly (as the original `*.gz` downloads are).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;

use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;

use super::error::DataError;
use super::partial_file::write_via_partial;

/// The element type byte of unsigned 8-bit IDX data.
pub const IDX_TYPE_U8: u8 = 0x08;

/// The first two bytes of every gzip stream.
pub const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// An n-dimensional array of bytes read from (or to be written to) an IDX file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// The dimensions, outermost first (`[n, rows, cols]` for MNIST images).
    pub dims: Vec<usize>,
    /// The elements in row-major order; `data.len()` is the product of `dims`.
    pub data: Vec<u8>,
}

impl IdxArray {
    /// Builds an array, checking that `data` holds exactly `product(dims)` elements.
    pub fn new(dims: Vec<usize>, data: Vec<u8>) -> Result<Self, DataError> {
        let expected = element_count(&dims).ok_or_else(|| {
            DataError::invalid(
                "IdxArray::new",
                format!("dimensions {dims:?} overflow usize"),
            )
        })?;
        if expected != data.len() {
            return Err(DataError::invalid(
                "IdxArray::new",
                format!(
                    "dimensions {dims:?} need {expected} elements, got {}",
                    data.len()
                ),
            ));
        }
        Ok(IdxArray { dims, data })
    }
}

/// Whether `bytes` starts with the gzip magic number.
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&GZIP_MAGIC)
}

fn element_count(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

fn element_type_name(code: u8) -> Option<&'static str> {
    match code {
        0x08 => Some("u8"),
        0x09 => Some("i8"),
        0x0B => Some("i16"),
        0x0C => Some("i32"),
        0x0D => Some("f32"),
        0x0E => Some("f64"),
        _ => None,
    }
}

/// Reads an IDX file of unsigned bytes, gzip-compressed or not.
///
/// Errors: [`DataError::Missing`] (naming the fetch command) when the file does not exist;
/// [`DataError::Malformed`] for a bad magic number or element type; [`DataError::Truncated`] and
/// [`DataError::TrailingBytes`] when the payload does not match the header; [`DataError::Gzip`] for a
/// corrupt compressed stream.
pub fn read_idx_u8(path: impl AsRef<Path>) -> Result<IdxArray, DataError> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| DataError::from_io(path, e))?;
    let mut buffered = BufReader::new(file);
    let head = buffered
        .fill_buf()
        .map_err(|e| DataError::from_io(path, e))?;
    if is_gzip(head) {
        let mut reader = BufReader::new(MultiGzDecoder::new(buffered));
        read_idx_u8_from(&mut reader, path, true)
    } else {
        read_idx_u8_from(&mut buffered, path, false)
    }
}

/// Parses IDX bytes already in memory (plain or gzip); `path` only names the source in errors.
pub fn parse_idx_u8(bytes: &[u8], path: impl AsRef<Path>) -> Result<IdxArray, DataError> {
    let path = path.as_ref();
    if is_gzip(bytes) {
        let mut reader = BufReader::new(MultiGzDecoder::new(bytes));
        read_idx_u8_from(&mut reader, path, true)
    } else {
        let mut reader = bytes;
        read_idx_u8_from(&mut reader, path, false)
    }
}

/// Reads up to `buf.len()` bytes, stopping early only at the end of the stream; returns the count.
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

fn read_idx_u8_from(
    reader: &mut impl Read,
    path: &Path,
    gzipped: bool,
) -> Result<IdxArray, DataError> {
    let io_err = |e: std::io::Error| -> DataError {
        if gzipped {
            DataError::Gzip {
                path: path.to_path_buf(),
                source: e,
            }
        } else {
            DataError::from_io(path, e)
        }
    };
    let malformed = |reason: String| DataError::Malformed {
        path: path.to_path_buf(),
        reason,
    };

    let mut magic = [0u8; 4];
    let got = read_full(reader, &mut magic).map_err(io_err)?;
    if got < 4 {
        return Err(malformed(format!(
            "the file holds {got} bytes, shorter than the 4-byte magic number"
        )));
    }
    if magic[0] != 0 || magic[1] != 0 {
        return Err(malformed(format!(
            "magic number {:02x} {:02x} {:02x} {:02x} does not start with two zero bytes",
            magic[0], magic[1], magic[2], magic[3]
        )));
    }
    if magic[2] != IDX_TYPE_U8 {
        return Err(malformed(match element_type_name(magic[2]) {
            Some(name) => format!(
                "element type {name} (0x{:02x}) is not supported; MNIST uses u8 (0x08)",
                magic[2]
            ),
            None => format!("unknown element type 0x{:02x}", magic[2]),
        }));
    }
    let ndims = usize::from(magic[3]);
    let mut dim_bytes = vec![0u8; 4 * ndims];
    let got = read_full(reader, &mut dim_bytes).map_err(io_err)?;
    if got < dim_bytes.len() {
        return Err(malformed(format!(
            "the header announces {ndims} dimensions but ends after {got} of their {} bytes",
            dim_bytes.len()
        )));
    }
    let dims: Vec<usize> = dim_bytes
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let expected = element_count(&dims)
        .ok_or_else(|| malformed(format!("dimensions {dims:?} overflow the address space")))?;

    // Read no more than the header promises, so a lying header cannot make us allocate unboundedly
    // ahead of the data actually present.
    let mut data = Vec::new();
    reader
        .by_ref()
        .take(expected as u64)
        .read_to_end(&mut data)
        .map_err(io_err)?;
    if data.len() < expected {
        return Err(DataError::Truncated {
            path: path.to_path_buf(),
            expected,
            found: data.len(),
        });
    }
    let extra = std::io::copy(reader, &mut std::io::sink()).map_err(io_err)?;
    if extra > 0 {
        return Err(DataError::TrailingBytes {
            path: path.to_path_buf(),
            expected,
            extra: extra as usize,
        });
    }
    Ok(IdxArray { dims, data })
}

/// Encodes an array as IDX bytes (uncompressed).
pub fn encode_idx_u8(array: &IdxArray) -> Result<Vec<u8>, DataError> {
    let count = element_count(&array.dims);
    if count != Some(array.data.len()) {
        return Err(DataError::invalid(
            "encode_idx_u8",
            format!(
                "dimensions {:?} do not match {} elements",
                array.dims,
                array.data.len()
            ),
        ));
    }
    let ndims = u8::try_from(array.dims.len()).map_err(|_| {
        DataError::invalid(
            "encode_idx_u8",
            format!("{} dimensions; IDX allows at most 255", array.dims.len()),
        )
    })?;
    let mut out = Vec::with_capacity(4 + 4 * array.dims.len() + array.data.len());
    out.extend_from_slice(&[0, 0, IDX_TYPE_U8, ndims]);
    for &d in &array.dims {
        let d = u32::try_from(d).map_err(|_| {
            DataError::invalid(
                "encode_idx_u8",
                format!("dimension {d} does not fit the IDX u32 field"),
            )
        })?;
        out.extend_from_slice(&d.to_be_bytes());
    }
    out.extend_from_slice(&array.data);
    Ok(out)
}

/// Writes an array as an IDX file, gzip-compressed when `gzip` is true.
///
/// The file is written under a temporary name and renamed into place, so an interrupted write never
/// leaves a file that looks complete.
pub fn write_idx_u8(path: impl AsRef<Path>, array: &IdxArray, gzip: bool) -> Result<(), DataError> {
    let path = path.as_ref();
    let bytes = encode_idx_u8(array)?;
    write_via_partial(path, |mut writer| {
        if gzip {
            let mut encoder = GzEncoder::new(writer, flate2::Compression::best());
            encoder.write_all(&bytes)?;
            writer = encoder.finish()?;
        } else {
            writer.write_all(&bytes)?;
        }
        Ok(writer)
    })
    .map_err(|(path, source)| DataError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout_is_big_endian() {
        let a = IdxArray::new(vec![2, 3], vec![1, 2, 3, 4, 5, 6]).unwrap();
        let bytes = encode_idx_u8(&a).unwrap();
        assert_eq!(&bytes[..4], &[0, 0, 8, 2]);
        assert_eq!(&bytes[4..8], &2u32.to_be_bytes());
        assert_eq!(&bytes[8..12], &3u32.to_be_bytes());
        assert_eq!(parse_idx_u8(&bytes, "mem").unwrap(), a);
    }

    #[test]
    fn element_count_detects_overflow() {
        assert_eq!(element_count(&[usize::MAX, 2]), None);
        assert_eq!(element_count(&[]), Some(1));
        assert_eq!(element_count(&[3, 0, 5]), Some(0));
    }
}
