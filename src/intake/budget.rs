//! Budgets for the readings other programs hand the agent (the ingest
//! socket's connections, the local-broker bridges) while they are held in
//! memory: from the moment a producer has parsed one until its producer got
//! the commit's outcome. A budget counts readings and bytes; budgets nest
//! (a connection inside its listener inside the whole input), and a reading
//! takes room at every level at once.
//!
//! Its one rule: **a producer takes room before it hands a reading over,
//! and gives it back only when the reading's outcome arrived**, so what
//! waits in the ingest thread's channel and buffer is bounded by the
//! budget, whatever the clients send. A producer that finds no room waits
//! (backpressure: it stops reading its client) or refuses; it never buffers.
//!
//! The tree the agent builds ([`InputBudget`]):
//! ```text
//! input (ingest.max_buffered_bytes, INPUT_MAX_READINGS)
//!  ├── unix socket (half of it) ── one per connection (ingest.max_connection_bytes, MAX_PENDING)
//!  ├── tcp port    (half of it) ── one per connection
//!  └── bridges     (half of it)
//! ```
//! Half each, so one listener (say the loopback TCP port, open to every
//! local user) can never take the room of the other or of the bridges.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Readings from the socket and the bridges that may be held in memory at
/// once (half of the ingest thread's buffer; the board's own sources keep
/// the other half, see `crate::agent`).
pub const INPUT_MAX_READINGS: usize = 5_000;

/// How often a waiting producer looks at its stop condition.
const WAIT_STEP: Duration = Duration::from_millis(100);

/// Readings and bytes in use at one level.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Readings held.
    pub readings: usize,
    /// Bytes held (estimated heap bytes, [`crate::spool::NewEvent::heap_bytes`]).
    pub bytes: usize,
}

/// One level of the tree: its limits, what is in use, its parent.
#[derive(Debug)]
pub struct Budget {
    /// What a full level is called in counters and messages, e.g.
    /// `connection` (the config key is in [`Budget::key`]).
    name: &'static str,
    /// The config key that sets its byte limit, for messages.
    key: &'static str,
    max_readings: usize,
    max_bytes: usize,
    used: Mutex<Usage>,
    freed: Condvar,
    parent: Option<Arc<Budget>>,
}

/// Room taken for one reading at every level from a leaf up; given back
/// when dropped (and waiting producers are woken).
#[derive(Debug)]
pub struct Hold {
    leaf: Arc<Budget>,
    bytes: usize,
}

/// No room: which level is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full {
    /// The level's name (`connection`, `listener`, `input`, `bridges`).
    pub level: &'static str,
    /// The config key of its byte limit (`ingest.max_connection_bytes`, ...).
    pub key: &'static str,
    /// Its byte limit.
    pub max_bytes: usize,
}

impl Budget {
    /// A root level: at most `max_readings` readings and `max_bytes` bytes.
    pub fn root(
        name: &'static str,
        key: &'static str,
        max_readings: usize,
        max_bytes: usize,
    ) -> Arc<Budget> {
        Arc::new(Budget {
            name,
            key,
            max_readings: max_readings.max(1),
            max_bytes: max_bytes.max(1),
            used: Mutex::new(Usage::default()),
            freed: Condvar::new(),
            parent: None,
        })
    }

    /// A level inside this one, with its own (smaller or equal) limits.
    pub fn child(
        self: &Arc<Self>,
        name: &'static str,
        key: &'static str,
        max_readings: usize,
        max_bytes: usize,
    ) -> Arc<Budget> {
        Arc::new(Budget {
            name,
            key,
            max_readings: max_readings.max(1),
            max_bytes: max_bytes.max(1),
            used: Mutex::new(Usage::default()),
            freed: Condvar::new(),
            parent: Some(self.clone()),
        })
    }

    /// What is in use at this level.
    pub fn usage(&self) -> Usage {
        *lock(&self.used)
    }

    /// This level's byte limit.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    fn full(&self) -> Full {
        Full {
            level: self.name,
            key: self.key,
            max_bytes: self.max_bytes,
        }
    }

    /// Whether one more reading of `bytes` fits in `u`. A reading larger
    /// than the whole level fits only when the level holds nothing, so an
    /// outsized reading still goes through (alone) instead of never.
    fn fits(&self, u: &Usage, bytes: usize) -> bool {
        u.readings < self.max_readings
            && (u.bytes == 0 || u.bytes.saturating_add(bytes) <= self.max_bytes)
    }

    /// Take room for one reading of `bytes` at this level and every level
    /// above, all or nothing.
    ///
    /// Errors: the lowest level that has no room.
    pub fn try_take(self: &Arc<Self>, bytes: usize) -> Result<Hold, Full> {
        // Locked leaf first, root last, by every taker: one order, no deadlock.
        let mut levels: Vec<(&Budget, MutexGuard<'_, Usage>)> = Vec::new();
        let mut at: Option<&Budget> = Some(self);
        while let Some(b) = at {
            let guard = lock(&b.used);
            if !b.fits(&guard, bytes) {
                return Err(b.full());
            }
            levels.push((b, guard));
            at = b.parent.as_deref();
        }
        for (_, u) in &mut levels {
            u.readings += 1;
            u.bytes = u.bytes.saturating_add(bytes);
        }
        Ok(Hold {
            leaf: self.clone(),
            bytes,
        })
    }

    /// Take room as [`Budget::try_take`] does, waiting while a level is
    /// full (backpressure) until `deadline` (none: no limit) or until
    /// `stop()` says to give up, looked at every 100 ms.
    ///
    /// Returns the hold and, if it had to wait, the first level it waited
    /// for. Errors: still no room at the deadline or at the stop (the level
    /// that was full).
    pub fn take(
        self: &Arc<Self>,
        bytes: usize,
        deadline: Option<Instant>,
        stop: &dyn Fn() -> bool,
    ) -> Result<(Hold, Option<Full>), Full> {
        let mut waited: Option<Full> = None;
        loop {
            let full = match self.try_take(bytes) {
                Ok(h) => return Ok((h, waited)),
                Err(f) => f,
            };
            waited.get_or_insert(full);
            if stop() || deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(full);
            }
            let step = deadline
                .map(|d| d.saturating_duration_since(Instant::now()).min(WAIT_STEP))
                .unwrap_or(WAIT_STEP);
            self.wait_at(full.level, bytes, step);
        }
    }

    /// Sleep on the level called `level` (on the way up from here) until
    /// it may fit `bytes` or `step` passed.
    fn wait_at(&self, level: &str, bytes: usize, step: Duration) {
        let mut at: Option<&Budget> = Some(self);
        while let Some(b) = at {
            if b.name == level {
                let guard = lock(&b.used);
                if !b.fits(&guard, bytes) {
                    let _ = b.freed.wait_timeout(guard, step);
                }
                return;
            }
            at = b.parent.as_deref();
        }
    }
}

impl Hold {
    /// The bytes this hold took at each level.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut at: Option<&Budget> = Some(&self.leaf);
        while let Some(b) = at {
            {
                let mut u = lock(&b.used);
                u.readings = u.readings.saturating_sub(1);
                u.bytes = u.bytes.saturating_sub(self.bytes);
            }
            b.freed.notify_all();
            at = b.parent.as_deref();
        }
    }
}

/// A poisoned lock still holds correct numbers (every update is complete
/// before anything can panic), so its value is used.
fn lock(m: &Mutex<Usage>) -> MutexGuard<'_, Usage> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The agent's input budgets: the whole, and the share of each listener and
/// of the bridges (see the module doc).
#[derive(Debug, Clone)]
pub struct InputBudget {
    /// Everything the socket and the bridges hold in memory.
    pub input: Arc<Budget>,
    /// The Unix socket's connections.
    pub unix: Arc<Budget>,
    /// The TCP port's connections.
    pub tcp: Arc<Budget>,
    /// Every `kind = "mqtt"` source.
    pub bridges: Arc<Budget>,
}

impl InputBudget {
    /// The tree for `max_bytes` (`ingest.max_buffered_bytes`): each
    /// listener and the bridges may take half of it, and half of
    /// [`INPUT_MAX_READINGS`].
    pub fn new(max_bytes: usize) -> InputBudget {
        let input = Budget::root(
            "input",
            "ingest.max_buffered_bytes",
            INPUT_MAX_READINGS,
            max_bytes,
        );
        let half = |name| {
            input.child(
                name,
                "ingest.max_buffered_bytes",
                INPUT_MAX_READINGS / 2,
                max_bytes / 2,
            )
        };
        InputBudget {
            unix: half("listener"),
            tcp: half("listener"),
            bridges: half("bridges"),
            input,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_taken_at_every_level_and_given_back_on_drop() {
        let root = Budget::root("input", "k.root", 10, 100);
        let a = root.child("listener", "k.l", 10, 60);
        let c1 = a.child("connection", "k.c", 3, 40);
        let c2 = a.child("connection", "k.c", 3, 40);
        let h1 = c1.try_take(30).expect("fits");
        assert_eq!(c1.try_take(30).unwrap_err().level, "connection");
        let h2 = c2
            .try_take(30)
            .expect("fits its own connection and the listener");
        assert_eq!(c2.try_take(1).unwrap_err().level, "listener");
        assert_eq!(
            root.usage(),
            Usage {
                readings: 2,
                bytes: 60
            }
        );
        drop(h1);
        assert_eq!(
            a.usage(),
            Usage {
                readings: 1,
                bytes: 30
            }
        );
        let h3 = c1.try_take(30).expect("room again");
        drop((h2, h3));
        assert_eq!(root.usage(), Usage::default());
    }

    #[test]
    fn counts_bound_as_well_as_bytes() {
        let root = Budget::root("input", "k", 2, 1000);
        let (_a, _b) = (root.try_take(1).unwrap(), root.try_take(1).unwrap());
        assert!(root.try_take(1).is_err());
    }

    #[test]
    fn an_outsized_reading_goes_alone() {
        let root = Budget::root("input", "k", 10, 100);
        let c = root.child("connection", "k.c", 10, 10);
        let big = c.try_take(500).expect("alone it goes");
        assert_eq!(c.try_take(1).unwrap_err().level, "connection");
        drop(big);
        let _small = c.try_take(5).expect("fits");
        assert_eq!(c.try_take(500).unwrap_err().level, "connection");
    }

    #[test]
    fn a_waiting_taker_gets_room_when_a_hold_is_dropped_or_gives_up_at_its_deadline() {
        let root = Budget::root("input", "k", 10, 100);
        let held = root.try_take(100).unwrap();
        let r = root.clone();
        let waiter = std::thread::spawn(move || {
            r.take(50, None, &|| false)
                .map(|(h, waited)| (h.bytes(), waited.map(|f| f.level)))
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(held);
        assert_eq!(waiter.join().unwrap(), Ok((50, Some("input"))));
        let _h = root.try_take(100).unwrap();
        let t = Instant::now();
        let late = root.take(1, Some(t + Duration::from_millis(150)), &|| false);
        assert_eq!(late.unwrap_err().level, "input");
        assert!(t.elapsed() >= Duration::from_millis(150));
        let stopped = root.take(1, None, &|| true);
        assert!(stopped.is_err());
    }

    #[test]
    fn each_listener_and_the_bridges_get_half() {
        let b = InputBudget::new(1000);
        let _u = b.unix.try_take(500).unwrap();
        assert_eq!(b.unix.try_take(1).unwrap_err().level, "listener");
        let _t = b.tcp.try_take(400).unwrap();
        let _br = b.bridges.try_take(100).unwrap();
        assert_eq!(b.bridges.try_take(1).unwrap_err().level, "input");
    }
}
