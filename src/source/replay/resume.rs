//! Where a restarted replay goes on: the stored position of the last row
//! the spool committed ([`Replay::resume`], what it did: [`Resumed`]), and
//! the file identity a position is checked against ([`fingerprint`]).
//!
//! One rule: a restart neither skips a row nor sends one again under a
//! new id. The same file (same fingerprint; for a followed file, the same
//! inode and first bytes) continues just after the stored row; the same
//! configured `trace_id` over other content skips to the stored line; any
//! other file is another trace, played from its first row under its own
//! ids.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use super::lines::{read_line, LineRead};
use super::{tail_err, Replay};
use crate::event::reading::{PassInfo, ReplayPosition};
use crate::source::tail::TailResumed;
use crate::source::SourceError;

/// Bytes hashed at each end of the file for its fingerprint.
const FINGERPRINT_EDGE_BYTES: u64 = 64 * 1024;

/// What [`Replay::resume`] did, for the log line.
#[derive(Debug, Clone, PartialEq)]
pub enum Resumed {
    /// No stored position: from the first row.
    Fresh,
    /// Seeked to just after the stored row.
    After {
        /// Lap of the stored row.
        lap: u64,
        /// Line of the stored row.
        line: u64,
    },
    /// Same configured `trace_id` but another file content: lines were
    /// skipped up to the stored line (reached: `true`; the file is shorter
    /// than the stored position: `false`, and the lap counts as ended).
    SkippedTo {
        /// Lap of the stored row.
        lap: u64,
        /// Line of the stored row.
        line: u64,
        /// Whether the file still has that line.
        reached: bool,
    },
    /// The stored position belongs to another trace identity (the file
    /// changed and no `trace_id` is configured): a new trace, from the first
    /// row, with new event ids.
    NewTrace {
        /// The identity stored before.
        was: String,
    },
    /// Followed file: the stored file was found under another name (rotated
    /// while the agent was down); it is read to its end from the stored
    /// row, then the path's file follows as the next segment.
    InRotated {
        /// Segment of the stored row.
        lap: u64,
        /// Line of the stored row.
        line: u64,
        /// Where the stored file is now.
        file: PathBuf,
    },
    /// Followed file: the stored file is gone or was truncated; the path's
    /// file is played from its first row as segment `lap`.
    NextSegment {
        /// The new segment's number (the stored one + 1).
        lap: u64,
    },
}

impl Replay {
    /// Continues after `saved`, the position stored with the last row the
    /// spool committed (`None`: from the first row). Call before the first
    /// [`Replay::due`].
    ///
    /// - Same identity and same file: seeks just after the stored row.
    /// - Same configured `trace_id`, other content: skips lines up to the
    ///   stored line; a file shorter than that ends the stored lap.
    /// - Another identity: the file is a new trace, played from its first
    ///   row (lap 0) under new ids.
    /// - Followed file ([`Tail::resume`](crate::source::tail::Tail::resume)):
    ///   after the stored row if the file at the path is still the stored
    ///   one (inode and first bytes); else in the stored file found under
    ///   another name in its directory
    ///   ([`Resumed::InRotated`]); else the path's file from its first row
    ///   as the next segment ([`Resumed::NextSegment`]). A position stored
    ///   without a file identity skips lines up to the stored line.
    ///
    /// # Errors
    ///
    /// `Io` if seeking or reading the file fails.
    pub fn resume(&mut self, saved: Option<ReplayPosition>) -> Result<Resumed, SourceError> {
        let Some(saved) = saved else {
            return Ok(Resumed::Fresh);
        };
        if saved.trace_id != self.trace_id {
            return Ok(Resumed::NewTrace {
                was: saved.trace_id,
            });
        }
        if let Some(tail) = self.tail.as_mut() {
            let how = tail
                .resume(
                    saved.lap,
                    saved.line,
                    saved.offset,
                    saved.segment.as_deref(),
                )
                .map_err(tail_err)?;
            if tail.segment() != saved.lap {
                self.pass = PassInfo::default();
            }
            self.lap = tail.segment();
            self.line_no = tail.line_no();
            self.offset = tail.offset();
            let (lap, line) = (saved.lap, saved.line);
            return Ok(match how {
                TailResumed::Same => Resumed::After { lap, line },
                TailResumed::ByLine => Resumed::SkippedTo {
                    lap,
                    line,
                    reached: true,
                },
                TailResumed::Rotated(file) => Resumed::InRotated { lap, line, file },
                TailResumed::NextSegment => Resumed::NextSegment { lap: self.lap },
            });
        }
        self.lap = saved.lap;
        self.offset_ms = saved.shift_ms;
        self.pass = saved.pass.clone();
        let io_err = |source| SourceError::Io {
            path: self.spec.path.clone(),
            source,
        };
        let Some(reader) = self.reader.as_mut() else {
            return Ok(Resumed::Fresh);
        };
        if saved.fingerprint == self.fingerprint {
            reader.seek(SeekFrom::Start(saved.offset)).map_err(io_err)?;
            self.line_no = saved.line;
            self.offset = saved.offset;
            return Ok(Resumed::After {
                lap: saved.lap,
                line: saved.line,
            });
        }
        while self.line_no < saved.line {
            let (read, used) = read_line(reader, &mut self.line).map_err(io_err)?;
            if read == LineRead::Eof {
                self.end_of_pass();
                return Ok(Resumed::SkippedTo {
                    lap: saved.lap,
                    line: saved.line,
                    reached: false,
                });
            }
            self.line_no += 1;
            self.offset += used;
        }
        Ok(Resumed::SkippedTo {
            lap: saved.lap,
            line: saved.line,
            reached: true,
        })
    }
}

/// sha256 over the file's length and its first and last 64 KiB (the
/// header included), first 16 bytes in hex (32 characters). Cheap on any
/// file size; an edit in the middle of a large file that keeps its length
/// is not seen (configure `trace_id` to decide identity yourself).
///
/// # Errors
///
/// The file cannot be opened, measured or read.
pub fn fingerprint(path: &std::path::Path) -> io::Result<String> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut hash = Sha256::new();
    hash.update(len.to_be_bytes());
    let mut buf = Vec::new();
    (&mut file)
        .take(FINGERPRINT_EDGE_BYTES)
        .read_to_end(&mut buf)?;
    hash.update(&buf);
    if len > FINGERPRINT_EDGE_BYTES {
        file.seek(SeekFrom::Start(
            len.saturating_sub(FINGERPRINT_EDGE_BYTES)
                .max(FINGERPRINT_EDGE_BYTES),
        ))?;
        buf.clear();
        file.take(FINGERPRINT_EDGE_BYTES).read_to_end(&mut buf)?;
        hash.update(&buf);
    }
    Ok(hash.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn fingerprint_sees_length_head_and_tail() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let big = vec![b'a'; 300 * 1024];
        fs::write(&p, &big).unwrap();
        let base = fingerprint(&p).unwrap();
        assert_eq!(base.len(), 32);
        assert_eq!(base, fingerprint(&p).unwrap());
        for at in [0, big.len() - 1] {
            let mut other = big.clone();
            other[at] = b'b';
            fs::write(&p, &other).unwrap();
            assert_ne!(fingerprint(&p).unwrap(), base, "byte {at}");
        }
        fs::write(&p, &big[1..]).unwrap();
        assert_ne!(fingerprint(&p).unwrap(), base);
    }
}
