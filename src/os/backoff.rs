//! Capped exponential backoff with jitter: how long to wait before the next
//! attempt after a failure (a reconnect, a storage write the spool refused,
//! a local broker that went away).
//!
//! One rule: the delay doubles up to its cap and is reset only by a
//! success, so a failing peer is never retried in a tight loop.

use std::time::Duration;

/// Capped exponential backoff with ±25 % jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    current: Duration,
    rng: u64,
}

impl Backoff {
    /// Start at `min`, double up to `max`.
    pub fn new(min: Duration, max: Duration) -> Backoff {
        let mut seed = [0u8; 8];
        // A fixed seed only makes jitter predictable; it is never a correctness issue.
        let _ = getrandom::fill(&mut seed);
        Backoff {
            min,
            max,
            current: min,
            rng: u64::from_le_bytes(seed) | 1,
        }
    }

    /// The next delay; doubles the base for the following call.
    pub fn next_delay(&mut self) -> Duration {
        // xorshift64: cheap jitter, no dependency.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let base = self.current;
        self.current = (self.current * 2).min(self.max);
        let frac = (self.rng % 501) as f64 / 1000.0 + 0.75; // 0.75..=1.25
        base.mul_f64(frac).min(self.max)
    }

    /// Back to `min` (after a successful connection).
    pub fn reset(&mut self) {
        self.current = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_with_bounded_jitter() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(1000));
        let d: Vec<u128> = (0..8).map(|_| b.next_delay().as_millis()).collect();
        assert!((75..=125).contains(&d[0]), "{d:?}");
        assert!((150..=250).contains(&d[1]), "{d:?}");
        assert!(d[5..].iter().all(|&x| (750..=1000).contains(&x)), "{d:?}");
        b.reset();
        assert!(b.next_delay().as_millis() <= 125);
    }
}
