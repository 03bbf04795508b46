//! Thread helpers shared by every part that starts threads.
//!
//! One rule: a stop never waits on a thread past its deadline; a thread
//! that does not finish is left behind and named in the log (its work is
//! replayed or reported at the next start).

use std::time::{Duration, Instant};

/// Join `h` if it finishes before `deadline`; otherwise leave it running
/// (its work is replayed or reported at the next start) and say so.
pub fn join_within(h: std::thread::JoinHandle<()>, deadline: Instant, what: &str) {
    while !h.is_finished() {
        if Instant::now() >= deadline {
            log::warn!("{what} did not stop in time; leaving it behind");
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = h.join();
}
