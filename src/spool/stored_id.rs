//! A row's event id as the spool keeps it: rows written since schema 12
//! store `events.event_id` empty and carry the id in their payload only
//! (issue 35: it was a sixth of each row); older rows keep their text.
//!
//! One rule: **an id is read, never guessed**: text that is not an id, or a
//! payload that carries none, reads as no id, and the row then fails its
//! check before it is sent (I3).

use crate::event::envelope::{self, EventId};

/// A row's event id: the one stored with it (rows written before schema
/// 12), else the one its payload carries ([`envelope::event_id_of`]).
/// `None` when the stored text is not an id ([`EventId::parse`]) or not
/// text, or neither holds one (a damaged payload, which fails its digest
/// too): the row then fails its check on the delivery thread rather than
/// its read, so the rows behind it still flow.
pub(super) fn stored_event_id(
    stored: rusqlite::types::ValueRef<'_>,
    payload: &[u8],
) -> Option<EventId> {
    match stored.as_str() {
        Ok("") => envelope::event_id_of(payload),
        Ok(text) => EventId::parse(text),
        Err(_) => None,
    }
}

/// [`stored_event_id`] as text, for showing (status's FAILED rows): the
/// stored text as it is when there is one, else the payload's id, else
/// empty.
pub(super) fn stored_event_id_text(stored: String, payload: &[u8]) -> String {
    if stored.is_empty() {
        envelope::event_id_of(payload)
            .map(|id| id.hyphenated())
            .unwrap_or_default()
    } else {
        stored
    }
}
