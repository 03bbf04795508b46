//! Rate limits on new commands: per scope
//! (`commands.max_per_minute_per_scope`, [`RateLimiter`]) and global
//! budgets shared by a whole class of commands ([`Budget`]; which class
//! draws from which is [`super::admission`]'s rule).
//!
//! Its one rule: **a scope gets a burst of `per_minute` new commands,
//! refilled at `per_minute` per minute, and the limiter's memory stays
//! bounded whatever scopes arrive**. Time is passed in (a monotonic offset),
//! so the logic is tested without sleeping.
//!
//! Only new receipts take a token: a duplicate delivery of a known command
//! is answered from the store whatever the rate.

use std::collections::HashMap;
use std::time::Duration;

/// Scopes tracked at most. Beyond it, buckets that are full again (idle for
/// a minute) are dropped; if none is, unseen scopes share one bucket, so a
/// sender inventing scopes cannot grow memory nor escape the limit.
pub const MAX_SCOPES: usize = 1024;

/// The bucket shared by scopes that arrive while [`MAX_SCOPES`] are tracked.
const OVERFLOW: &str = "";

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Duration,
}

/// Token buckets by scope.
#[derive(Debug)]
pub struct RateLimiter {
    per_minute: f64,
    buckets: HashMap<String, Bucket>,
}

impl RateLimiter {
    /// A limiter allowing `per_minute` new commands per scope and minute.
    pub fn new(per_minute: u32) -> RateLimiter {
        RateLimiter {
            per_minute: f64::from(per_minute.max(1)),
            buckets: HashMap::new(),
        }
    }

    fn refill(&self, b: &mut Bucket, now: Duration) {
        let dt = now.saturating_sub(b.at).as_secs_f64();
        b.tokens = (b.tokens + dt * self.per_minute / 60.0).min(self.per_minute);
        b.at = now;
    }

    /// Scopes with a bucket of their own (the overflow bucket not counted).
    fn own(&self) -> usize {
        self.buckets.len() - usize::from(self.buckets.contains_key(OVERFLOW))
    }

    /// The key `scope` is counted under (itself, or the shared overflow
    /// bucket); one of the [`MAX_SCOPES`] slots is kept for the latter.
    fn key<'a>(&mut self, scope: &'a str, now: Duration) -> &'a str {
        if self.buckets.contains_key(scope) || self.own() < MAX_SCOPES - 1 {
            return scope;
        }
        let per_minute = self.per_minute;
        self.buckets.retain(|k, b| {
            let dt = now.saturating_sub(b.at).as_secs_f64();
            k == OVERFLOW || b.tokens + dt * per_minute / 60.0 < per_minute
        });
        if self.own() < MAX_SCOPES - 1 {
            scope
        } else {
            OVERFLOW
        }
    }

    /// Whether a new command in `scope` is within the limit at `now`
    /// (without taking a token: see [`RateLimiter::take`]).
    pub fn allows(&mut self, scope: &str, now: Duration) -> bool {
        let key = self.key(scope, now);
        let mut b = self.buckets.get(key).copied().unwrap_or(Bucket {
            tokens: self.per_minute,
            at: now,
        });
        self.refill(&mut b, now);
        b.tokens >= 1.0
    }

    /// Take a token for a new command accepted in `scope` at `now`.
    pub fn take(&mut self, scope: &str, now: Duration) {
        let key = self.key(scope, now).to_owned();
        let mut b = self.buckets.get(&key).copied().unwrap_or(Bucket {
            tokens: self.per_minute,
            at: now,
        });
        self.refill(&mut b, now);
        b.tokens = (b.tokens - 1.0).max(0.0);
        self.buckets.insert(key, b);
    }

    /// Scopes tracked now.
    pub fn tracked(&self) -> usize {
        self.buckets.len()
    }
}

/// One token bucket shared by every command it is asked for (a burst of
/// `per_minute`, refilled at `per_minute` per minute): the global budget of
/// a class of commands, whatever scopes they name.
#[derive(Debug)]
pub struct Budget {
    per_minute: f64,
    bucket: Option<Bucket>,
}

impl Budget {
    /// A budget of `per_minute` new commands per minute.
    pub fn new(per_minute: u32) -> Budget {
        Budget {
            per_minute: f64::from(per_minute.max(1)),
            bucket: None,
        }
    }

    fn at(&self, now: Duration) -> Bucket {
        let mut b = self.bucket.unwrap_or(Bucket {
            tokens: self.per_minute,
            at: now,
        });
        let dt = now.saturating_sub(b.at).as_secs_f64();
        b.tokens = (b.tokens + dt * self.per_minute / 60.0).min(self.per_minute);
        b.at = now;
        b
    }

    /// Whether one more fits at `now` (without taking it).
    pub fn allows(&self, now: Duration) -> bool {
        self.at(now).tokens >= 1.0
    }

    /// Take one at `now`.
    pub fn take(&mut self, now: Duration) {
        let mut b = self.at(now);
        b.tokens = (b.tokens - 1.0).max(0.0);
        self.bucket = Some(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    fn burst(r: &mut RateLimiter, scope: &str, at: Duration) -> usize {
        let mut n = 0;
        while r.allows(scope, at) {
            r.take(scope, at);
            n += 1;
        }
        n
    }

    #[test]
    fn a_scope_gets_a_burst_of_the_limit_then_one_more_per_refill_interval() {
        let mut r = RateLimiter::new(60);
        assert_eq!(burst(&mut r, "ops", s(0.0)), 60);
        assert!(!r.allows("ops", s(0.5)));
        assert!(r.allows("ops", s(1.0)), "one token per second at 60/min");
        r.take("ops", s(1.0));
        assert!(!r.allows("ops", s(1.5)));
        assert_eq!(
            burst(&mut r, "ops", s(61.0)),
            60,
            "full again after a minute"
        );
    }

    #[test]
    fn scopes_are_limited_independently() {
        let mut r = RateLimiter::new(2);
        assert_eq!(burst(&mut r, "a", s(0.0)), 2);
        assert_eq!(burst(&mut r, "b", s(0.0)), 2);
        assert!(!r.allows("a", s(0.0)));
    }

    #[test]
    fn asking_does_not_take_a_token() {
        let mut r = RateLimiter::new(1);
        for _ in 0..10 {
            assert!(r.allows("a", s(0.0)));
        }
        r.take("a", s(0.0));
        assert!(!r.allows("a", s(0.0)));
    }

    #[test]
    fn a_budget_is_one_bucket_whatever_asks() {
        let mut b = Budget::new(3);
        for _ in 0..3 {
            assert!(b.allows(s(0.0)));
            b.take(s(0.0));
        }
        assert!(!b.allows(s(0.0)));
        assert!(!b.allows(s(19.0)), "one token per 20 s at 3/min");
        assert!(b.allows(s(20.0)));
        b.take(s(20.0));
        assert!(!b.allows(s(20.0)));
        assert!(b.allows(s(200.0)));
    }

    #[test]
    fn invented_scopes_neither_grow_memory_nor_escape_the_limit() {
        let mut r = RateLimiter::new(5);
        let mut accepted = 0;
        for i in 0..10 * MAX_SCOPES {
            let scope = format!("s{i}");
            if r.allows(&scope, s(0.0)) {
                r.take(&scope, s(0.0));
                accepted += 1;
            }
        }
        assert!(r.tracked() <= MAX_SCOPES, "{}", r.tracked());
        // The first MAX_SCOPES - 1 scopes got a token each, the rest shared 5.
        assert_eq!(accepted, MAX_SCOPES - 1 + 5);
        // A minute later the idle buckets are full again and make room.
        assert!(r.allows("late-comer", s(60.0)));
        r.take("late-comer", s(60.0));
        assert!(r.tracked() <= MAX_SCOPES);
    }
}
