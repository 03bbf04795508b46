//! What boards say about themselves on `<topic_prefix>/holdings` (their
//! holdings, their answers to requests) as the sink reads them, and the
//! requests it sends back on `<topic_prefix>/backfill`.
//!
//! Pure: no I/O. Its one rule, as for events ([`super::identity`]): **the
//! board is the one the topic names**: a note whose `board` is another is
//! set aside (counted), never applied to the ledger, and a request goes to
//! the topic of the board it asks, signed for that board and naming the
//! nonce of that board's last holdings
//! ([`crate::event::backfill::Request::check`]).

use crate::event::backfill::{self, Note, Token};
use crate::event::signature::SigningKey;

pub use super::identity::HOLDINGS_LEVEL;

/// A note from a board, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoardNote {
    /// The board the topic names (its `device_id`).
    pub device: String,
    /// Its `topic_prefix`.
    pub prefix: String,
    /// What it said.
    pub note: Note,
}

/// Why a delivery on a holdings topic was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoteError {
    /// Not a message of [`crate::event::backfill`]'s shapes.
    #[error("unreadable holdings note on {topic}: {why}")]
    Unreadable {
        /// Its topic.
        topic: String,
        /// The parser's reason.
        why: String,
    },
    /// Signed with another board's name than its topic's.
    #[error("a note on {topic} names board {claim:?}")]
    Forged {
        /// Its topic.
        topic: String,
        /// The board the payload named.
        claim: String,
    },
}

/// The prefix and device of a holdings topic (`<prefix>/holdings`, a
/// prefix without a level the sink reads identities by), or `None` for any
/// other topic.
pub fn of_holdings_topic(topic: &str) -> Option<(&str, &str)> {
    let prefix = topic.strip_suffix(HOLDINGS_LEVEL)?.strip_suffix('/')?;
    let device = prefix.rsplit('/').next()?;
    let fine = !device.is_empty()
        && !prefix
            .split('/')
            .any(|l| l.is_empty() || super::identity::reserved(l));
    fine.then_some((prefix, device))
}

/// Read a delivery on a holdings topic.
///
/// Errors: [`NoteError`] (the caller counts it and acknowledges the
/// delivery: a note is worth nothing twice).
pub fn read(topic: &str, payload: &[u8]) -> Result<BoardNote, NoteError> {
    let Some((prefix, device)) = of_holdings_topic(topic) else {
        return Err(NoteError::Unreadable {
            topic: topic.to_owned(),
            why: "not <prefix>/holdings".into(),
        });
    };
    let note = backfill::parse_note(payload).map_err(|e| NoteError::Unreadable {
        topic: topic.to_owned(),
        why: e.to_string(),
    })?;
    let claim = match &note {
        Note::Holdings(h) => &h.board,
        Note::Answer(a) => &a.board,
    };
    if claim != device {
        return Err(NoteError::Forged {
            topic: topic.to_owned(),
            claim: claim.clone(),
        });
    }
    Ok(BoardNote {
        device: device.to_owned(),
        prefix: prefix.to_owned(),
        note,
    })
}

/// The filter the holdings of the boards an events filter names come on:
/// `P/events/#` and `P/events/S` → `P/holdings`. `None` for a filter whose
/// second-to-last level is not `events` (`edgespool/#` matches them
/// already).
pub fn holdings_filter(filter: &str) -> Option<String> {
    let (rest, _) = filter.rsplit_once('/')?;
    match rest.rsplit_once('/') {
        Some((p, "events")) => Some(format!("{p}/{HOLDINGS_LEVEL}")),
        None if rest == "events" => Some(HOLDINGS_LEVEL.to_owned()),
        _ => None,
    }
}

/// A request the ledger wants sent to one board.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    /// The board.
    pub device: String,
    /// Its `topic_prefix`.
    pub prefix: String,
    /// The nonce of its last holdings.
    pub nonce: Token,
    /// Per stream, the ranges.
    pub ranges: Vec<(String, Vec<(i64, i64)>)>,
}

impl Ask {
    /// Rows asked for.
    pub fn rows(&self) -> u64 {
        self.ranges
            .iter()
            .flat_map(|(_, r)| r.iter())
            .map(|(f, l)| (l - f + 1).max(0) as u64)
            .sum()
    }

    /// `(topic, payload)`: the request on `<prefix>/backfill`, with a
    /// fresh id, made at `now_ms`, signed by `key`; `None` when no id can
    /// be drawn (no randomness: nothing is sent).
    pub fn signed(&self, key: &SigningKey, now_ms: i64) -> Option<(String, Vec<u8>)> {
        let id = backfill::fresh_token().ok()?;
        let payload =
            backfill::encode_request(&self.device, &self.nonce, &id, now_ms, &self.ranges, key);
        Some((format!("{}/backfill", self.prefix), payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::backfill::{Held, Holdings};

    #[test]
    fn the_board_is_the_topics_and_a_note_naming_another_is_set_aside() {
        assert_eq!(
            of_holdings_topic("edgespool/gw1/holdings"),
            Some(("edgespool/gw1", "gw1"))
        );
        for t in [
            "holdings",
            "/holdings",
            "edgespool/gw1/status",
            "edgespool/evil/events/gw1/holdings",
            "edgespool//holdings",
        ] {
            assert_eq!(of_holdings_topic(t), None, "{t}");
        }
        let h = |board: &str| {
            backfill::encode_holdings(&Holdings {
                board: board.into(),
                nonce: [1; 16],
                streams: vec![(
                    "s".into(),
                    Held {
                        oldest: 1,
                        newest: 2,
                        pending: 3,
                    },
                )],
                more: false,
            })
        };
        let ok = read("edgespool/gw1/holdings", &h("gw1")).expect("read");
        assert_eq!(
            (ok.device.as_str(), ok.prefix.as_str()),
            ("gw1", "edgespool/gw1")
        );
        assert!(matches!(
            read("edgespool/evil/holdings", &h("gw1")),
            Err(NoteError::Forged { .. })
        ));
        assert!(matches!(
            read("edgespool/gw1/holdings", b"junk"),
            Err(NoteError::Unreadable { .. })
        ));
    }

    #[test]
    fn the_holdings_filter_follows_the_events_filter() {
        assert_eq!(
            holdings_filter("edgespool/+/events/#").as_deref(),
            Some("edgespool/+/holdings")
        );
        assert_eq!(
            holdings_filter("es/d1/events/load").as_deref(),
            Some("es/d1/holdings")
        );
        assert_eq!(holdings_filter("events/#").as_deref(), Some("holdings"));
        assert_eq!(holdings_filter("edgespool/#"), None);
    }

    #[test]
    fn an_ask_is_signed_for_its_board_on_its_backfill_topic() {
        let key = SigningKey::generate().expect("keygen").0;
        let ask = Ask {
            device: "gw1".into(),
            prefix: "edgespool/gw1".into(),
            nonce: [4; 16],
            ranges: vec![("s".into(), vec![(301, 1000)])],
        };
        assert_eq!(ask.rows(), 700);
        let (topic, p) = ask.signed(&key, 5).expect("signed");
        assert_eq!(topic, "edgespool/gw1/backfill");
        let r = backfill::parse_request(&p).expect("parses");
        assert_eq!(r.check("gw1", &[key.public()]), Ok(()));
        assert_eq!(r.nonce, [4; 16]);
    }
}
