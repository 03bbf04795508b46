//! This process's I/O counters as the kernel keeps them (`/proc/self/io`).
//!
//! Its one rule, as the rest of [`crate::os`]: it says what the kernel said;
//! what the figures mean (a write budget, a wear rate) is decided above.

/// `write_bytes` of `/proc/self/io`: bytes this process caused to be sent to
/// the block layer (<https://docs.kernel.org/filesystems/proc.html>), or
/// `None` where the file is missing or unreadable (a kernel without task I/O
/// accounting).
pub fn proc_write_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_a_write_counter() {
        assert!(proc_write_bytes().is_some());
    }
}
