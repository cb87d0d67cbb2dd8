//! A clean stop on SIGINT and SIGTERM: the first signal asks the run to stop after the current step
//! (the Trainer then agrees the stop over all ranks, saves, flushes its metrics and returns); a second
//! signal ends the process at once. A binary installs the handler with [`install`]; library callers
//! (tests) never see process-wide handlers unless they ask.

use std::sync::atomic::{AtomicI32, Ordering};

/// The first signal received (0: none).
static REQUESTED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only async-signal-safe operations here: an atomic swap and _exit.
    if REQUESTED.swap(sig, Ordering::SeqCst) != 0 {
        // SAFETY: _exit is async-signal-safe and ends the process without running any handler.
        unsafe { libc::_exit(128 + sig) };
    }
}

/// Installs the handler for SIGINT and SIGTERM (once per process; idempotent).
pub fn install() -> std::io::Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: `signal` with a handler that only touches an atomic and calls _exit.
        if unsafe { libc::signal(sig, handler) } == libc::SIG_ERR {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The signal that asked for a stop, if one did.
pub fn requested() -> Option<i32> {
    match REQUESTED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The signal's name (`SIGINT`, `SIGTERM`).
pub fn name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// The process exit code for a stop by `sig` (130 for SIGINT, 143 for SIGTERM, as shells report).
pub fn exit_code(sig: i32) -> u8 {
    u8::try_from(128 + sig).unwrap_or(u8::MAX)
}
