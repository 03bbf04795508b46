//! True time for readings taken before a board's clock was synchronized:
//! which clock anchors the sink believes, and the corrected time it stores
//! beside a reading's own (`ts_corrected_ms`).
//!
//! Pure: no I/O, the sink's clock passed in. Its one rule: **a reading is
//! moved only by a believed anchor of its own device and boot, taken after
//! it**, to `anchor.wall_ms - (anchor.mono_ms - reading.mono_ms)`
//! ([`crate::event::clock::Anchor::corrected_ms`]), and only when its own
//! time was off: flagged untrusted, or more than [`MOVE_MS`] away from that.
//! The stored payload and `ts_ms` never change.
//!
//! An anchor is believed when its envelope and its fields name one instant
//! of one boot, its board trusted its clock, the time it gives is neither
//! before [`EARLIEST_MS`] (at the boot's start) nor more than [`FUTURE_MS`]
//! ahead of the sink's clock, and it agrees within [`AGREE_MS`] with the
//! anchor already believed for that boot, if any. Any other is kept aside
//! with its [`Refused`] reason and moves nothing.

use super::message::Event;
use crate::event::clock::{field, Anchor, BootId, MonoStamp, CLOCK_STREAM};

/// The earliest true time an anchor may give, at the start of its boot:
/// 2020-01-01T00:00:00Z (Unix ms). No edgespool board booted before it;
/// an anchor that would put readings there would move them by years.
pub const EARLIEST_MS: i64 = 1_577_836_800_000;

/// How far ahead of the sink's clock an anchor's wall time may be: one
/// day, more than any clock skew between a synchronized board and a
/// synchronized sink, far less than a wrongly set year.
pub const FUTURE_MS: i64 = 86_400_000;

/// How far two anchors of one boot may disagree (wall less monotonic) and
/// still be one clock: time sync slews both clocks alike, so only a step
/// of the wall clock between them, or a forged anchor, moves it by more.
pub const AGREE_MS: i64 = 1_000;

/// A reading flagged trusted is moved only when its time is more than this
/// away from the corrected one: a clock already right (an RTC) within a
/// second is left as sent.
pub const MOVE_MS: i64 = 1_000;

/// Why an anchor moves nothing, as the side table `clock_refused` keeps it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// Its envelope carries no boot id and monotonic time.
    #[error("the anchor's envelope carries no boot_id and mono_ms")]
    NoStamp,
    /// A field of the anchor is missing or not of its type.
    #[error("the anchor's field {0} is missing or of the wrong type")]
    Field(&'static str),
    /// Its fields name another boot than its envelope.
    #[error("the anchor is of another boot: its fields say {fields}, its envelope {envelope}")]
    OtherBoot {
        /// The boot its fields name.
        fields: String,
        /// The boot its envelope carries.
        envelope: String,
    },
    /// Its fields name another instant than its envelope.
    #[error(
        "the anchor's fields (mono_ms {mono_ms}, wall_ms {wall_ms}) are not its envelope's \
         instant (mono_ms {env_mono_ms}, ts_ms {env_ts_ms})"
    )]
    OtherInstant {
        /// The fields' monotonic time.
        mono_ms: i64,
        /// The fields' wall time.
        wall_ms: i64,
        /// The envelope's monotonic time.
        env_mono_ms: i64,
        /// The envelope's `ts_ms`.
        env_ts_ms: i64,
    },
    /// Its board did not trust its own clock.
    #[error("the anchor is flagged clock_trusted false")]
    Untrusted,
    /// Its boot would have begun before [`EARLIEST_MS`].
    #[error(
        "the anchor would move time by years: its boot began at {boot_start_ms} ms, \
         before 2020-01-01 ({EARLIEST_MS} ms)"
    )]
    TooEarly {
        /// `wall_ms - mono_ms`.
        boot_start_ms: i64,
    },
    /// Its wall time is more than [`FUTURE_MS`] ahead of the sink's clock.
    #[error(
        "the anchor would move time by years: wall_ms {wall_ms} is more than a day ahead \
         of the sink's clock ({now_ms})"
    )]
    Future {
        /// The anchor's wall time.
        wall_ms: i64,
        /// The sink's clock.
        now_ms: i64,
    },
    /// Another anchor of the boot is believed, and this one disagrees.
    #[error(
        "the anchor contradicts the one stored for boot {boot}: it puts the boot's start \
         {by_ms} ms away (at most {AGREE_MS})"
    )]
    Contradicts {
        /// The boot.
        boot: String,
        /// This anchor's offset less the stored one's.
        by_ms: i64,
    },
}

/// Whether `e` is a clock anchor: an event of [`CLOCK_STREAM`] (the
/// stream its topic names, see [`super::identity`]).
pub fn is_anchor(e: &Event) -> bool {
    e.stream == CLOCK_STREAM
}

/// The anchor `e` (an event of [`CLOCK_STREAM`]) states, once its
/// envelope and its fields agree and its board trusted its clock.
///
/// Errors: [`Refused`], naming what does not hold.
pub fn anchor_of(e: &Event) -> Result<Anchor, Refused> {
    let stamp = e.mono.ok_or(Refused::NoStamp)?;
    let fields: serde_json::Value =
        serde_json::from_str(&e.fields_json).map_err(|_| Refused::Field("fields"))?;
    let boot = fields
        .get(field::BOOT_ID)
        .and_then(|v| v.as_str())
        .and_then(BootId::parse)
        .ok_or(Refused::Field(field::BOOT_ID))?;
    let int = |k: &'static str| {
        fields
            .get(k)
            .and_then(|v| v.as_i64().or_else(|| v.as_f64().map(|f| f as i64)))
            .ok_or(Refused::Field(k))
    };
    let (mono_ms, wall_ms) = (int(field::MONO_MS)?, int(field::WALL_MS)?);
    if boot != stamp.boot_id {
        return Err(Refused::OtherBoot {
            fields: boot.simple(),
            envelope: stamp.boot_id.simple(),
        });
    }
    if mono_ms != stamp.mono_ms as i64 || wall_ms != e.ts_ms {
        return Err(Refused::OtherInstant {
            mono_ms,
            wall_ms,
            env_mono_ms: stamp.mono_ms as i64,
            env_ts_ms: e.ts_ms,
        });
    }
    if !e.clock_trusted {
        return Err(Refused::Untrusted);
    }
    Ok(Anchor { at: stamp, wall_ms })
}

/// What a believable anchor does: `Ok(true)` when it is the boot's first
/// (stored, and the boot's readings moved), `Ok(false)` when it agrees
/// with `stored` (nothing changes), at the sink's clock `now_ms`.
///
/// Errors: [`Refused`]: out of bounds, or contradicting `stored`.
pub fn judge(a: &Anchor, stored: Option<&Anchor>, now_ms: i64) -> Result<bool, Refused> {
    let boot_start_ms = a.offset_ms();
    if boot_start_ms < EARLIEST_MS {
        return Err(Refused::TooEarly { boot_start_ms });
    }
    if a.wall_ms > now_ms.saturating_add(FUTURE_MS) {
        return Err(Refused::Future {
            wall_ms: a.wall_ms,
            now_ms,
        });
    }
    let Some(s) = stored else {
        return Ok(true);
    };
    let by_ms = a.offset_ms() - s.offset_ms();
    if by_ms.abs() > AGREE_MS {
        return Err(Refused::Contradicts {
            boot: a.at.boot_id.simple(),
            by_ms,
        });
    }
    Ok(false)
}

/// The corrected time of a reading (`ts_ms`, `trusted`, `mono`) by the
/// believed anchor `a` of its device: `None` when the anchor is of
/// another boot, taken before the reading, or the reading's own time
/// stands (trusted, within [`MOVE_MS`]).
pub fn corrected(a: &Anchor, ts_ms: i64, trusted: bool, mono: &MonoStamp) -> Option<i64> {
    if mono.boot_id != a.at.boot_id {
        return None;
    }
    let t = a.corrected_ms(mono.mono_ms)?;
    (!trusted || (t - ts_ms).abs() > MOVE_MS).then_some(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::reading::FieldValue;

    const BOOT: BootId = BootId([5; 16]);
    /// 2026-12-05T02:00:00Z.
    const NOW: i64 = 1_796_436_000_000;

    fn anchor_event(boot_in_fields: BootId, mono: u64, wall: i64, trusted: bool) -> Event {
        let a = Anchor {
            at: MonoStamp {
                boot_id: boot_in_fields,
                mono_ms: mono,
            },
            wall_ms: wall,
        };
        let fields: serde_json::Map<String, serde_json::Value> = a
            .fields(2000)
            .into_iter()
            .map(|(k, v)| {
                let j = match v {
                    FieldValue::Num(n) => serde_json::json!(n as i64),
                    FieldValue::Text(t) => serde_json::json!(t),
                    FieldValue::Bool(b) => serde_json::json!(b),
                };
                (k, j)
            })
            .collect();
        Event {
            event_id: "00000000-0000-4000-8000-000000000001".into(),
            device_id: "gw".into(),
            stream: CLOCK_STREAM.into(),
            seq: 1,
            ts_ms: wall,
            clock_trusted: trusted,
            mono: Some(MonoStamp {
                boot_id: BOOT,
                mono_ms: mono,
            }),
            fields_json: serde_json::Value::Object(fields).to_string(),
            digest: [0; 32],
        }
    }

    #[test]
    fn an_anchor_is_read_only_when_its_envelope_and_fields_are_one_instant() {
        let e = anchor_event(BOOT, 600_000, NOW, true);
        let a = anchor_of(&e).unwrap();
        assert_eq!((a.at.mono_ms, a.wall_ms), (600_000, NOW));
        let other = anchor_event(BootId([6; 16]), 600_000, NOW, true);
        assert!(matches!(anchor_of(&other), Err(Refused::OtherBoot { .. })));
        let mut moved = e.clone();
        moved.ts_ms += 3_600_000;
        assert!(matches!(
            anchor_of(&moved),
            Err(Refused::OtherInstant { .. })
        ));
        let mut bare = e.clone();
        bare.mono = None;
        assert_eq!(anchor_of(&bare), Err(Refused::NoStamp));
        let untrusted = anchor_event(BOOT, 600_000, NOW, false);
        assert_eq!(anchor_of(&untrusted), Err(Refused::Untrusted));
        let mut no_wall = e;
        no_wall.fields_json =
            r#"{"boot_id":"05050505050505050505050505050505","mono_ms":600000}"#.into();
        assert_eq!(anchor_of(&no_wall), Err(Refused::Field("wall_ms")));
    }

    fn at(mono_ms: u64, wall_ms: i64) -> Anchor {
        Anchor {
            at: MonoStamp {
                boot_id: BOOT,
                mono_ms,
            },
            wall_ms,
        }
    }

    #[test]
    fn an_anchor_that_would_move_time_by_years_or_contradicts_the_first_is_refused() {
        assert_eq!(judge(&at(600_000, NOW), None, NOW), Ok(true));
        // A boot that began in 2019; a wall time two days ahead.
        let early = at(600_000, EARLIEST_MS + 599_999);
        assert!(matches!(
            judge(&early, None, NOW),
            Err(Refused::TooEarly { .. })
        ));
        let ahead = at(600_000, NOW + 2 * FUTURE_MS);
        assert!(matches!(
            judge(&ahead, None, NOW),
            Err(Refused::Future { .. })
        ));
        assert_eq!(judge(&at(600_000, NOW + FUTURE_MS), None, NOW), Ok(true));
        // A second anchor an hour later on the same line agrees; one whose
        // wall clock was stepped 3 h does not.
        let first = at(600_000, NOW);
        let later = at(4_200_000, NOW + 3_600_000 + 400);
        assert_eq!(judge(&later, Some(&first), NOW + 3_600_000), Ok(false));
        let stepped = at(4_200_000, NOW + 3 * 3_600_000);
        assert_eq!(
            judge(&stepped, Some(&first), NOW),
            Err(Refused::Contradicts {
                boot: BOOT.simple(),
                by_ms: 2 * 3_600_000
            })
        );
    }

    #[test]
    fn readings_before_the_anchor_whose_clock_was_off_are_moved_to_true_time() {
        let a = at(600_000, NOW);
        let stamp = |mono_ms| MonoStamp {
            boot_id: BOOT,
            mono_ms,
        };
        // Taken at 100 s with the clock 3 h behind, then 3 h ahead.
        let true_time = NOW - 500_000;
        for off in [-3 * 3_600_000, 3 * 3_600_000] {
            assert_eq!(
                corrected(&a, true_time + off, true, &stamp(100_000)),
                Some(true_time)
            );
        }
        // Within a second: left as sent, unless flagged untrusted.
        assert_eq!(corrected(&a, true_time + 900, true, &stamp(100_000)), None);
        assert_eq!(
            corrected(&a, true_time + 900, false, &stamp(100_000)),
            Some(true_time)
        );
        // After the anchor, or of another boot: never.
        assert_eq!(corrected(&a, 5, false, &stamp(600_001)), None);
        let other = MonoStamp {
            boot_id: BootId([6; 16]),
            mono_ms: 100_000,
        };
        assert_eq!(corrected(&a, 5, false, &other), None);
    }
}
