//! The fast way a batch's events go into PostgreSQL: one binary `COPY
//! events FROM STDIN` of the batch's first deliveries, in key order.
//!
//! Its one rule: `COPY` never skips a row, so it stores a batch only when
//! every one of its keys is new; any key already stored (by another sink,
//! or by this one before a redelivery) makes the whole `COPY` fail with a
//! unique violation (SQLSTATE 23505, after waiting for the transaction that
//! holds the key, as `INSERT .. ON CONFLICT` would), and the caller rolls
//! the transaction back and stores the batch the careful way
//! (`super::postgres`). Its rows are written in one multi-row heap insert
//! and a few WAL records (<https://www.postgresql.org/docs/current/sql-copy.html>),
//! where `INSERT .. ON CONFLICT` takes a speculative insertion per row.

use super::batch::{self, Item, Key};
use bytes::BytesMut;
use postgres::binary_copy::BinaryCopyInWriter;
use postgres::types::{to_sql_checked, IsNull, ToSql, Type};
use postgres::Transaction;
use std::collections::{HashMap, HashSet};

const COPY_EVENTS: &str = "COPY events (event_id, device_id, stream, seq, ts_ms, clock_trusted,
                    received_ms, fields, payload, digest, topic, boot_id, mono_ms,
                    ts_corrected_ms) FROM STDIN (FORMAT binary)";

const TYPES: [Type; 14] = [
    Type::UUID,
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::INT8,
    Type::BOOL,
    Type::INT8,
    Type::JSONB,
    Type::BYTEA,
    Type::BYTEA,
    Type::TEXT,
    Type::UUID,
    Type::INT8,
    Type::INT8,
];

/// A UUID in its binary form (16 bytes).
#[derive(Debug)]
struct Uuid([u8; 16]);

impl Uuid {
    /// The canonical text form (8-4-4-4-12 hex, as
    /// [`super::message::decode`] leaves it); `None` for anything else.
    fn parse(text: &str) -> Option<Uuid> {
        let b = text.as_bytes();
        if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
            return None;
        }
        let digits: Vec<u8> = b
            .iter()
            .enumerate()
            .filter(|(i, _)| ![8, 13, 18, 23].contains(i))
            .map(|(_, &c)| (c as char).to_digit(16).map(|d| d as u8))
            .collect::<Option<_>>()?;
        let mut out = [0u8; 16];
        for (o, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
            *o = pair[0] << 4 | pair[1];
        }
        Some(Uuid(out))
    }
}

impl ToSql for Uuid {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        out.extend_from_slice(&self.0);
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::UUID
    }

    to_sql_checked!();
}

/// JSON text as `jsonb`'s binary form: version 1, then the text (the
/// server parses it as it parses a text `jsonb`).
#[derive(Debug)]
struct Jsonb<'a>(&'a str);

impl ToSql for Jsonb<'_> {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        out.extend_from_slice(&[1]);
        out.extend_from_slice(self.0.as_bytes());
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB
    }

    to_sql_checked!();
}

/// `COPY` the candidates (`cands`: the first delivery of each key, in key
/// order) into `events`, with the corrected time `fixes` holds for a key;
/// returns their keys, all of which this transaction created. `Ok(None)`: an event id this module cannot put in binary form
/// (nothing was sent; store the batch the careful way).
///
/// Errors: the server's; a unique violation (23505) means some key was
/// already stored, and leaves the transaction aborted.
pub fn copy_events(
    tx: &mut Transaction<'_>,
    items: &[Item],
    cands: &[usize],
    fixes: &HashMap<Key, i64>,
    now_ms: i64,
) -> Result<Option<HashSet<Key>>, postgres::Error> {
    let mut rows = Vec::with_capacity(cands.len());
    for it in cands.iter().map(|&i| &items[i]) {
        if let Ok(e) = &it.read {
            match Uuid::parse(&e.event_id) {
                Some(id) => rows.push((it, e, id)),
                None => return Ok(None),
            }
        }
    }
    let mut w = BinaryCopyInWriter::new(tx.copy_in(COPY_EVENTS)?, &TYPES);
    for (it, e, id) in &rows {
        let boot = e.mono.map(|m| Uuid(m.boot_id.0));
        let mono = e.mono.map(|m| m.mono_ms as i64);
        let fixed = fixes.get(&batch::key(e)).copied();
        w.write(&[
            id,
            &e.device_id,
            &e.stream,
            &e.seq,
            &e.ts_ms,
            &e.clock_trusted,
            &now_ms,
            &Jsonb(&e.fields_json),
            &it.payload,
            &&e.digest[..],
            &it.topic,
            &boot,
            &mono,
            &fixed,
        ])?;
    }
    w.finish()?;
    Ok(Some(rows.iter().map(|(_, e, _)| batch::key(e)).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_text_becomes_its_sixteen_bytes_and_nothing_else_passes() {
        let u = Uuid::parse("0123abcd-0000-4000-8000-00000000ff01").map(|u| u.0);
        let mut want = [0u8; 16];
        want[..4].copy_from_slice(&[0x01, 0x23, 0xab, 0xcd]);
        want[6] = 0x40;
        want[8] = 0x80;
        want[14..].copy_from_slice(&[0xff, 0x01]);
        assert_eq!(u, Some(want));
        for bad in [
            "",
            "0123abcd-0000-4000-8000-00000000ff0",
            "0123abcd-0000-4000-8000-00000000ff0g",
            "0123abcd00000400080000000000ff01----",
            "+123abcd-0000-4000-8000-00000000ff01",
        ] {
            assert!(Uuid::parse(bad).is_none(), "{bad}");
        }
    }
}
