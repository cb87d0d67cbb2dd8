//! Writing a data file so that an interrupted write never leaves a file that looks complete.

use std::fs::File;
use std::io::{self, BufWriter};
use std::path::{Path, PathBuf};

/// Writes `path` through `path` + `.partial`: `write` fills a buffered writer of the partial file and
/// hands it back, then the file is synced and renamed into place. A failure comes with the path it
/// concerns (the partial file, or `path` for the rename).
pub(crate) fn write_via_partial(
    path: &Path,
    write: impl FnOnce(BufWriter<File>) -> io::Result<BufWriter<File>>,
) -> Result<(), (PathBuf, io::Error)> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let at_partial = |e| (partial.clone(), e);
    let writer =
        write(BufWriter::new(File::create(&partial).map_err(at_partial)?)).map_err(at_partial)?;
    let file = writer
        .into_inner()
        .map_err(|e| at_partial(e.into_error()))?;
    file.sync_all().map_err(at_partial)?;
    drop(file);
    std::fs::rename(&partial, path).map_err(|e| (path.to_path_buf(), e))
}
