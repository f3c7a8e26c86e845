//! Ctrl-C while a model generates: a flag that the generation loops of
//! `te generate` and `te chat` poll between engine steps, so that they stop
//! the answer and keep (or print) what was generated. A second Ctrl-C
//! before the first was seen (a long step) ends the process at once, with
//! the status a shell gives SIGINT (130).

use std::sync::atomic::{AtomicBool, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Installs the handler (once per process).
///
/// Errors: the handler cannot be installed.
pub fn install() -> anyhow::Result<()> {
    ctrlc::set_handler(|| {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
    })
    .map_err(|e| anyhow::anyhow!("cannot catch Ctrl-C: {e}"))
}

/// Whether Ctrl-C was pressed since the last call (clears the flag).
pub fn take() -> bool {
    INTERRUPTED.swap(false, Ordering::SeqCst)
}
