//! Room on disk for a run's outputs, checked before the first step: a full filesystem found at the end
//! of a run would cost the run (or, before the save came first, its weights).
//!
//! [`check_room`] is the decision alone (what each output needs, the filesystem holding it and its free
//! bytes), so it is tested with made-up figures; [`filesystem_of`] measures a real one.

use std::path::{Path, PathBuf};

/// One output of a run and the bytes writing it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Output {
    /// The flag that named it (`--save`).
    pub flag: &'static str,
    /// The path it names.
    pub path: PathBuf,
    /// What is written there, for the message ("a checkpoint of this run").
    pub what: String,
    /// Bytes it takes beyond what the filesystem holds now.
    pub bytes: u64,
}

/// A filesystem: its device number (outputs with the same one share its free bytes) and the bytes an
/// unprivileged writer may still use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Filesystem {
    pub device: u64,
    pub free: u64,
}

/// The filesystem holding `path`, measured at its nearest existing ancestor (the path itself when it
/// exists): `statvfs`'s `f_bavail * f_frsize` (the blocks reserved for the superuser are not counted).
pub(crate) fn filesystem_of(path: &Path) -> std::io::Result<Filesystem> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let mut at = path;
    while !at.exists() {
        at = match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if at == Path::new(".") {
            break;
        }
    }
    let device = std::fs::metadata(at)?.dev();
    let c = std::ffi::CString::new(at.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs(3) reads the NUL-terminated path `c` (alive for the call) and writes only the
    // struct we pass, which is plain data that all-zero bytes initialise validly.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the fields' widths differ between platforms
    let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    Ok(Filesystem { device, free })
}

/// Bytes of the files under `dir` (what a checkpoint directory holds now; 0 when it does not exist).
pub(crate) fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Sizes in words: `3.1 GiB`, `12.0 MiB`, `640 bytes`.
pub(crate) fn size_text(bytes: u64) -> String {
    const UNITS: [(&str, u32); 4] = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
    for (unit, shift) in UNITS {
        if bytes >= 1u64 << shift {
            return format!("{:.1} {unit}", bytes as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{bytes} bytes")
}

/// Ok when every filesystem has room for all the outputs it holds together; else the message naming
/// each output's flag and path, what it needs and what is free.
pub(crate) fn check_room(outputs: &[(Output, Filesystem)]) -> Result<(), String> {
    let mut devices: Vec<u64> = Vec::new();
    for (_, fs) in outputs {
        if !devices.contains(&fs.device) {
            devices.push(fs.device);
        }
    }
    for device in devices {
        let here: Vec<&(Output, Filesystem)> =
            outputs.iter().filter(|(_, f)| f.device == device).collect();
        let need = here
            .iter()
            .fold(0u64, |a, (o, _)| a.saturating_add(o.bytes));
        let free = here.first().map_or(0, |(_, f)| f.free);
        if need <= free {
            continue;
        }
        let advice = "free some space or choose another location";
        return Err(match here.as_slice() {
            [(o, _)] => format!(
                "{} {}: writing {} needs about {} but the filesystem holding it has {} free; \
                 {advice}",
                o.flag,
                o.path.display(),
                o.what,
                size_text(o.bytes),
                size_text(free)
            ),
            _ => {
                let names: Vec<String> = here
                    .iter()
                    .map(|(o, _)| format!("{} {}", o.flag, o.path.display()))
                    .collect();
                let parts: Vec<String> = here
                    .iter()
                    .map(|(o, _)| format!("{} (about {})", o.what, size_text(o.bytes)))
                    .collect();
                format!(
                    "{}: they share a filesystem with {} free, but writing {} needs about {} \
                     together; {advice}",
                    names.join(" and "),
                    size_text(free),
                    parts.join(" and "),
                    size_text(need)
                )
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn out(flag: &'static str, path: &str, what: &str, bytes: u64) -> Output {
        Output {
            flag,
            path: PathBuf::from(path),
            what: what.to_string(),
            bytes,
        }
    }

    fn fs(device: u64, free: u64) -> Filesystem {
        Filesystem { device, free }
    }

    #[test]
    fn an_output_without_room_is_refused_naming_flag_path_need_and_free() {
        let save = out(
            "--save",
            "ckpt",
            "a checkpoint of this run",
            3 * GIB + GIB / 10,
        );
        let e = check_room(&[(save.clone(), fs(7, GIB + GIB / 5))]).unwrap_err();
        assert_eq!(
            e,
            "--save ckpt: writing a checkpoint of this run needs about 3.1 GiB but the filesystem \
             holding it has 1.2 GiB free; free some space or choose another location"
        );
        // Exactly enough is enough; one byte short is not.
        assert!(check_room(&[(save.clone(), fs(7, save.bytes))]).is_ok());
        assert!(check_room(&[(save.clone(), fs(7, save.bytes - 1))]).is_err());
    }

    #[test]
    fn outputs_on_one_filesystem_add_up_and_on_two_do_not() {
        let save = out("--save", "ckpt", "a checkpoint of this run", 2 * GIB);
        let export = out("--export", "w.safetensors", "the exported weights", GIB);
        // Each fits alone in 2.5 GiB; together they do not.
        let shared = [
            (save.clone(), fs(1, 5 * GIB / 2)),
            (export.clone(), fs(1, 5 * GIB / 2)),
        ];
        let e = check_room(&shared).unwrap_err();
        for w in [
            "--save ckpt and --export w.safetensors",
            "2.5 GiB free",
            "a checkpoint of this run (about 2.0 GiB)",
            "the exported weights (about 1.0 GiB)",
            "3.0 GiB together",
        ] {
            assert!(e.contains(w), "no {w:?} in {e}");
        }
        let apart = [
            (save.clone(), fs(1, 5 * GIB / 2)),
            (export.clone(), fs(2, 5 * GIB / 2)),
        ];
        assert!(check_room(&apart).is_ok());
        // Only the filesystem without room is named.
        let tight = [(save, fs(1, 5 * GIB / 2)), (export, fs(2, GIB / 2))];
        let e = check_room(&tight).unwrap_err();
        assert!(e.starts_with("--export w.safetensors: "), "{e}");
        assert!(!e.contains("--save"), "{e}");
        assert!(check_room(&[]).is_ok());
    }

    #[test]
    fn sizes_read_in_the_largest_whole_unit() {
        assert_eq!(size_text(640), "640 bytes");
        assert_eq!(size_text(1536), "1.5 KiB");
        assert_eq!(size_text(12 << 20), "12.0 MiB");
        assert_eq!(size_text(5 << 40), "5.0 TiB");
    }

    #[test]
    fn a_real_filesystem_is_measured_at_the_nearest_existing_ancestor() {
        let dir = std::env::temp_dir();
        let here = filesystem_of(&dir).unwrap();
        let below = filesystem_of(&dir.join("no-such-dir").join("nor-this.safetensors")).unwrap();
        assert_eq!(here.device, below.device);
        assert!(here.free > 0);
    }
}
