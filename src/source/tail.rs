//! Following a growing CSV file, like `tail -F`: the line source of a
//! replay with `follow = true`.
//!
//! Its one rule: **a line is handed out once it is complete, and each
//! complete line once, in one numbered segment.** A segment is one file
//! that sat at the path: the file opened first is segment 0 (or the
//! stored one on resume), and every rotation (the path now names another
//! inode: rename + create) or truncation (the file is shorter than what was
//! read, or its first bytes changed) starts the next one, read from its
//! start. A row's identity is `(segment, line)` within the trace, plus the
//! segment's inode and the digest of its first bytes ([`SegmentMark`]), so
//! rows of two files can never share an event id even if segment numbers
//! were ever reused (a power-cut rollback of the stored position).
//!
//! - At the end of the data nothing blocks: [`Tail::next_line`] answers
//!   [`TailLine::Wait`] and the caller asks again at its next poll.
//! - Bytes after the last newline are held back (not a line yet) until the
//!   newline arrives; only when the segment is left for a rotated file are
//!   they handed out as its last line, as a file's last line without a
//!   newline is elsewhere.
//! - After a rename, the old file (still open here) is read to its end
//!   before the new one is opened; a truncated file's content past the new
//!   end is gone and cannot be read.
//! - Each segment starts with the header line; it must equal the header
//!   the replay was opened with (the column positions depend on it).
//!   A new file without a complete header line yet is waited for.
//!
//! Limits (documented in docs/local-programs.md): a file truncated and rewritten
//! between two polls to at least the length read, with the same first
//! [`HEAD_BYTES`] bytes, is taken for the same file; lines a writer still
//! appends to a rotated file after this module moved to the new one are not
//! read.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::event::reading::SegmentMark;

/// Longest line kept; a longer one is consumed without being buffered and
/// counted as a skipped row (by a replay).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Bytes at the start of a segment whose digest is part of its identity.
pub const HEAD_BYTES: usize = 1024;

/// Directory entries looked at, at most, when resuming in a file that was
/// rotated away while the agent was down.
const MAX_DIR_ENTRIES: usize = 10_000;

/// What [`Tail::next_line`] gave.
#[derive(Debug, PartialEq, Eq)]
pub enum TailLine {
    /// A complete line is in the buffer, without its `\n` or `\r\n`.
    Line,
    /// A line longer than [`MAX_LINE_BYTES`] was skipped.
    TooLong,
    /// No complete line now: ask again at the next poll.
    Wait,
}

/// Why a tail cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum TailError {
    /// The file (or its directory) cannot be opened, read or measured;
    /// the caller tries again at its next poll.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The file's header line is not the one the replay was opened with, or
    /// is missing: nothing of this file is read (tried again at each poll,
    /// so a fixed file, or the next rotation, goes on).
    #[error("{}: {detail}", path.display())]
    Header {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the header found.
        detail: String,
    },
}

/// How [`Tail::resume`] continued.
#[derive(Debug, Clone, PartialEq)]
pub enum TailResumed {
    /// In the same file, just after the stored line.
    Same,
    /// In the stored file, found under another name in the directory
    /// (rotated while the agent was down); the path's file follows as the
    /// next segment.
    Rotated(PathBuf),
    /// The stored file is gone or was truncated: the path's file from its
    /// first row, as the next segment.
    NextSegment,
    /// No file identity was stored (a position written without follow):
    /// lines up to the stored line of this file are skipped as they come.
    ByLine,
}

/// One open file.
#[derive(Debug)]
struct Segment {
    reader: BufReader<File>,
    /// Where it was opened (the path, or a rotated name on resume).
    name: PathBuf,
    ino: u64,
    /// The first bytes consumed, up to [`HEAD_BYTES`].
    head: Vec<u8>,
    /// Digest of the whole `head` once it is full.
    head_digest: Option<String>,
    /// The header line was read and matched.
    header_done: bool,
    /// The header line did not match: the message.
    bad_header: Option<String>,
    /// Its last line was handed out and the path names another file: it is
    /// closed at the next call (kept until then for [`Tail::mark`]).
    ended: bool,
}

/// A followed file (see the module doc).
#[derive(Debug)]
pub struct Tail {
    path: PathBuf,
    header: String,
    seg: Option<Segment>,
    /// Number of `seg` (or of the segment last closed).
    segment: u64,
    /// Line number in the segment of the last complete line (header = 1).
    line_no: u64,
    /// Bytes of the segment's complete lines.
    offset: u64,
    /// The incomplete line read so far (empty while skipping).
    partial: Vec<u8>,
    /// Bytes of the incomplete line consumed (more than `partial` holds
    /// while skipping an over-long line).
    partial_len: u64,
    /// Inside a line longer than [`MAX_LINE_BYTES`].
    skipping: bool,
    /// Lines of `skip_in.0` up to line `skip_in.1` are dropped (resume by
    /// line).
    skip_in: Option<(u64, u64)>,
    /// Check for a truncation before the next read (set by
    /// [`Tail::new_poll`]): a file truncated and rewritten past the offset
    /// between two polls is seen before its bytes are taken for lines.
    probe_first: bool,
}

impl Tail {
    /// Opens `path` as segment 0 and reads its header line (BOM and line
    /// end removed), which every later segment must repeat.
    ///
    /// # Errors
    ///
    /// `Io` if the file cannot be opened or read, `Header` if it is not a
    /// regular file or has no complete header line yet.
    pub fn open(path: &Path) -> Result<(Tail, String), TailError> {
        let mut tail = Tail {
            path: path.to_path_buf(),
            header: String::new(),
            seg: None,
            segment: 0,
            line_no: 0,
            offset: 0,
            partial: Vec::new(),
            partial_len: 0,
            skipping: false,
            skip_in: None,
            probe_first: false,
        };
        let Some(seg) = open_segment(path).map_err(|e| tail.io(e))? else {
            return Err(tail.io(io::Error::from_raw_os_error(libc::ENOENT)));
        };
        tail.seg = Some(seg);
        let mut buf = Vec::new();
        match tail.read_complete(&mut buf).map_err(|e| tail.io(e))? {
            Some(TailLine::Line) => {}
            Some(_) => return Err(tail.header_err("header line is too long".into())),
            None => {
                return Err(tail.header_err(
                    "no complete header line yet (a followed file must start with its header)"
                        .into(),
                ))
            }
        }
        let header = header_text(&buf);
        tail.header = header.clone();
        if let Some(seg) = tail.seg.as_mut() {
            seg.header_done = true;
        }
        Ok((tail, header))
    }

    /// Number of the current segment (0 for the file first opened).
    pub fn segment(&self) -> u64 {
        self.segment
    }

    /// Line number in the segment of the last line handed out (header = 1).
    pub fn line_no(&self) -> u64 {
        self.line_no
    }

    /// Bytes of the segment up to and including the last line handed out.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The file read now (the path, or a rotated name being finished).
    pub fn current_name(&self) -> &Path {
        self.seg.as_ref().map_or(&self.path, |s| &s.name)
    }

    /// Identity of the current segment at the current offset.
    pub fn mark(&mut self) -> SegmentMark {
        let offset = self.offset;
        match self.seg.as_mut() {
            Some(seg) => {
                let n = usize::try_from(offset)
                    .unwrap_or(usize::MAX)
                    .min(HEAD_BYTES)
                    .min(seg.head.len());
                let head = if n == HEAD_BYTES {
                    seg.head_digest
                        .get_or_insert_with(|| digest(&seg.head[..n]))
                        .clone()
                } else {
                    digest(&seg.head[..n])
                };
                SegmentMark { ino: seg.ino, head }
            }
            None => SegmentMark {
                ino: 0,
                head: digest(&[]),
            },
        }
    }

    /// Continues after a stored position: `segment`, `line` and `offset`
    /// of the last row stored, `mark` its file's identity. Call right after
    /// [`Tail::open`].
    ///
    /// # Errors
    ///
    /// `Io` if a file cannot be read or seeked.
    pub fn resume(
        &mut self,
        segment: u64,
        line: u64,
        offset: u64,
        mark: Option<&SegmentMark>,
    ) -> Result<TailResumed, TailError> {
        let Some(mark) = mark else {
            self.segment = segment;
            self.skip_in = Some((segment, line));
            return Ok(TailResumed::ByLine);
        };
        let path = self.path.clone();
        let same = self.seg.as_ref().is_some_and(|s| s.ino == mark.ino);
        if same {
            if let Some(seg) = self.seg.as_mut() {
                if let Some(head) =
                    matches_mark(seg.reader.get_ref(), offset, mark).map_err(|source| {
                        TailError::Io {
                            path: path.clone(),
                            source,
                        }
                    })?
                {
                    self.continue_at(segment, line, offset, head)?;
                    return Ok(TailResumed::Same);
                }
            }
        } else if let Some((name, file, head)) =
            find_rotated(&path, offset, mark).map_err(|e| self.io(e))?
        {
            let seg = Segment {
                reader: BufReader::new(file),
                name: name.clone(),
                ino: mark.ino,
                head: Vec::new(),
                head_digest: None,
                header_done: true,
                bad_header: None,
                ended: false,
            };
            self.seg = Some(seg);
            self.continue_at(segment, line, offset, head)?;
            return Ok(TailResumed::Rotated(name));
        }
        // The path's file, already read past its header, from its first row.
        self.segment = segment.saturating_add(1);
        Ok(TailResumed::NextSegment)
    }

    /// Starts a poll: the next [`Tail::next_line`] first checks whether the
    /// file was truncated (one stat and a read of at most [`HEAD_BYTES`]).
    pub fn new_poll(&mut self) {
        self.probe_first = true;
    }

    /// The next complete line into `buf` (cleared first), or `Wait`.
    ///
    /// # Errors
    ///
    /// `Io` if reading or measuring fails, `Header` if the current file's
    /// header is not the replay's; both are tried again on the next call.
    pub fn next_line(&mut self, buf: &mut Vec<u8>) -> Result<TailLine, TailError> {
        if std::mem::take(&mut self.probe_first)
            && matches!(self.probe().map_err(|e| self.io(e))?, Probe::Truncated)
        {
            self.truncated();
        }
        // At most two segment switches per call, so one call stays short.
        for _ in 0..3 {
            if self.seg.as_ref().is_some_and(|s| s.ended) {
                self.seg = None;
            }
            if self.seg.is_none() && !self.start_segment()? {
                return Ok(TailLine::Wait);
            }
            if self.seg.as_ref().is_some_and(|s| s.bad_header.is_none()) {
                if let Some(read) = self.read_data_line(buf)? {
                    return Ok(read);
                }
            }
            match self.probe().map_err(|e| self.io(e))? {
                Probe::Same => {
                    if let Some(detail) = self.seg.as_ref().and_then(|s| s.bad_header.clone()) {
                        return Err(self.header_err(detail));
                    }
                    return Ok(TailLine::Wait);
                }
                Probe::Replaced => {
                    // Lines written to the old file between the read above
                    // and the stat: read them before leaving it.
                    if self.seg.as_ref().is_some_and(|s| s.bad_header.is_none()) {
                        if let Some(read) = self.read_data_line(buf)? {
                            return Ok(read);
                        }
                    }
                    let last = self.take_partial(buf);
                    log::info!(
                        "{}: rotated (another file now at the path): segment {} ended at line {}",
                        self.path.display(),
                        self.segment,
                        self.line_no
                    );
                    if last {
                        if let Some(seg) = self.seg.as_mut() {
                            seg.ended = true;
                        }
                        return Ok(TailLine::Line);
                    }
                    self.seg = None;
                }
                Probe::Truncated => self.truncated(),
            }
        }
        Ok(TailLine::Wait)
    }

    /// The current file was truncated: its segment ends here, the file at
    /// the path is read from its start as the next one.
    fn truncated(&mut self) {
        if self.partial_len > 0 {
            log::warn!(
                "{}: truncated with an incomplete line of {} bytes after line {}: that line is lost",
                self.path.display(),
                self.partial_len,
                self.line_no
            );
        }
        log::info!(
            "{}: truncated: segment {} ended at line {}, reading the file again from its start",
            self.path.display(),
            self.segment,
            self.line_no
        );
        self.clear_partial();
        self.seg = None;
    }

    /// A complete data line of the current segment (the header checked and
    /// lines to skip dropped on the way), or `None` at the end of the data.
    fn read_data_line(&mut self, buf: &mut Vec<u8>) -> Result<Option<TailLine>, TailError> {
        loop {
            let read = self.read_complete(buf).map_err(|e| self.io(e))?;
            let Some(read) = read else {
                return Ok(None);
            };
            let Some(seg) = self.seg.as_mut() else {
                return Ok(None);
            };
            if !seg.header_done {
                seg.header_done = true;
                let found = header_text(buf);
                if read != TailLine::Line || found != self.header {
                    let detail = format!(
                        "header of the new file differs from the replay's: {:?} (expected {:?}); its rows are not read",
                        super::excerpt(&found, 256),
                        super::excerpt(&self.header, 256)
                    );
                    seg.bad_header = Some(detail.clone());
                    return Err(self.header_err(detail));
                }
                continue;
            }
            if let Some((segment, line)) = self.skip_in {
                if segment == self.segment && self.line_no <= line {
                    continue;
                }
                self.skip_in = None;
            }
            return Ok(Some(read));
        }
    }

    /// Reads up to the next newline of the current segment. `None`: no
    /// complete line (what was read of an incomplete one is kept).
    fn read_complete(&mut self, buf: &mut Vec<u8>) -> io::Result<Option<TailLine>> {
        let Some(seg) = self.seg.as_mut() else {
            return Ok(None);
        };
        loop {
            let (used, complete) = {
                let avail = seg.reader.fill_buf()?;
                if avail.is_empty() {
                    return Ok(None);
                }
                let (used, complete) = match avail.iter().position(|&b| b == b'\n') {
                    Some(pos) => (pos + 1, true),
                    None => (avail.len(), false),
                };
                let room = HEAD_BYTES.saturating_sub(seg.head.len());
                seg.head.extend_from_slice(&avail[..used.min(room)]);
                if !self.skipping {
                    self.partial.extend_from_slice(&avail[..used]);
                }
                (used, complete)
            };
            seg.reader.consume(used);
            self.partial_len += used as u64;
            if !self.skipping && self.partial.len() > MAX_LINE_BYTES + 2 {
                self.skipping = true;
                self.partial.clear();
            }
            if !complete {
                continue;
            }
            self.line_no += 1;
            self.offset += self.partial_len;
            self.partial_len = 0;
            if std::mem::take(&mut self.skipping) {
                buf.clear();
                return Ok(Some(TailLine::TooLong));
            }
            let mut line = std::mem::take(&mut self.partial);
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            if line.len() > MAX_LINE_BYTES {
                buf.clear();
                return Ok(Some(TailLine::TooLong));
            }
            *buf = line;
            return Ok(Some(TailLine::Line));
        }
    }

    /// The incomplete last line of a segment being left, as a line (true),
    /// if there is one and it is short enough.
    fn take_partial(&mut self, buf: &mut Vec<u8>) -> bool {
        if self.partial_len == 0 {
            return false;
        }
        let header_ok = self
            .seg
            .as_ref()
            .is_some_and(|s| s.header_done && s.bad_header.is_none());
        let usable = !self.skipping && header_ok;
        self.line_no += 1;
        self.offset += self.partial_len;
        let mut line = std::mem::take(&mut self.partial);
        self.clear_partial();
        if !usable {
            return false;
        }
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        *buf = line;
        true
    }

    fn clear_partial(&mut self) {
        self.partial.clear();
        self.partial_len = 0;
        self.skipping = false;
    }

    /// Opens the path as the next segment; false if it does not exist yet.
    fn start_segment(&mut self) -> Result<bool, TailError> {
        let Some(seg) = open_segment(&self.path).map_err(|e| self.io(e))? else {
            return Ok(false);
        };
        self.segment = self.segment.saturating_add(1);
        self.line_no = 0;
        self.offset = 0;
        self.clear_partial();
        log::info!(
            "{}: following a new file (inode {}) as segment {}",
            self.path.display(),
            seg.ino,
            self.segment
        );
        self.seg = Some(seg);
        Ok(true)
    }

    /// Seeks the current segment to `offset` and takes `head` (its first
    /// bytes) as read.
    fn continue_at(
        &mut self,
        segment: u64,
        line: u64,
        offset: u64,
        head: Vec<u8>,
    ) -> Result<(), TailError> {
        let path = self.current_name().to_path_buf();
        let Some(seg) = self.seg.as_mut() else {
            return Ok(());
        };
        seg.reader
            .seek(SeekFrom::Start(offset))
            .map_err(|source| TailError::Io { path, source })?;
        seg.head = head;
        seg.head_digest = None;
        seg.header_done = true;
        self.segment = segment;
        self.line_no = line;
        self.offset = offset;
        self.clear_partial();
        Ok(())
    }

    /// Whether the current segment is still the file at the path, whole.
    fn probe(&self) -> io::Result<Probe> {
        let Some(seg) = self.seg.as_ref() else {
            return Ok(Probe::Same);
        };
        match std::fs::metadata(&self.path) {
            Ok(m) if m.ino() != seg.ino => return Ok(Probe::Replaced),
            Ok(_) => {}
            // Between the rename and the create: keep reading the old one.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let file = seg.reader.get_ref();
        if file.metadata()?.len() < self.offset + self.partial_len {
            return Ok(Probe::Truncated);
        }
        let n = usize::try_from(self.offset)
            .unwrap_or(usize::MAX)
            .min(seg.head.len());
        let mut now = vec![0u8; n];
        match file.read_exact_at(&mut now, 0) {
            Ok(()) if now == seg.head[..n] => Ok(Probe::Same),
            Ok(()) => Ok(Probe::Truncated),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(Probe::Truncated),
            Err(e) => Err(e),
        }
    }

    fn io(&self, source: io::Error) -> TailError {
        TailError::Io {
            path: self.current_name().to_path_buf(),
            source,
        }
    }

    fn header_err(&self, detail: String) -> TailError {
        TailError::Header {
            path: self.current_name().to_path_buf(),
            detail,
        }
    }
}

/// What [`Tail::probe`] found.
enum Probe {
    Same,
    Replaced,
    Truncated,
}

/// Opens `path` as a segment to be read from its start; `None` if it does
/// not exist.
fn open_segment(path: &Path) -> io::Result<Option<Segment>> {
    let not_regular = || io::Error::new(io::ErrorKind::InvalidInput, "not a regular file");
    // A FIFO would block the open, /dev/zero would be read for ever.
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => return Err(not_regular()),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    }
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    Ok(Some(Segment {
        reader: BufReader::new(file),
        name: path.to_path_buf(),
        ino: meta.ino(),
        head: Vec::new(),
        head_digest: None,
        header_done: false,
        bad_header: None,
        ended: false,
    }))
}

/// The first bytes of `file` if it is at least `offset` long and they
/// match `mark`'s digest.
fn matches_mark(file: &File, offset: u64, mark: &SegmentMark) -> io::Result<Option<Vec<u8>>> {
    if file.metadata()?.len() < offset {
        return Ok(None);
    }
    let n = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(HEAD_BYTES);
    let mut head = vec![0u8; n];
    file.read_exact_at(&mut head, 0)?;
    Ok((digest(&head) == mark.head).then_some(head))
}

/// The file with `mark`'s inode in the path's directory, if it still holds
/// the stored position (a rotated name such as `trace.csv.1`).
fn find_rotated(
    path: &Path,
    offset: u64,
    mark: &SegmentMark,
) -> io::Result<Option<(PathBuf, File, Vec<u8>)>> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    for entry in std::fs::read_dir(dir)?.take(MAX_DIR_ENTRIES) {
        let Ok(entry) = entry else { continue };
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() || meta.ino() != mark.ino {
            continue;
        }
        let name = entry.path();
        let file = File::open(&name)?;
        // Checked on the open file: the name may have moved since.
        if file.metadata()?.ino() != mark.ino {
            continue;
        }
        if let Some(head) = matches_mark(&file, offset, mark)? {
            return Ok(Some((name, file, head)));
        }
    }
    Ok(None)
}

/// A header line as text: invalid UTF-8 replaced, BOM removed.
fn header_text(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(line);
    text.strip_prefix('\u{feff}').unwrap_or(&text).to_owned()
}

/// sha256 of `bytes`, first 16 bytes in hex.
fn digest(bytes: &[u8]) -> String {
    Sha256::digest(bytes)[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::{self, OpenOptions};
    use std::io::Write;

    const HEADER: &str = "ts,v";

    fn append(path: &Path, text: &str) {
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    /// Every complete line now available, as text with (segment, line).
    fn lines(t: &mut Tail) -> Vec<(u64, u64, String)> {
        let mut out = Vec::new();
        let mut buf = Vec::new();
        t.new_poll();
        loop {
            match t.next_line(&mut buf).unwrap() {
                TailLine::Wait => return out,
                TailLine::Line => out.push((
                    t.segment(),
                    t.line_no(),
                    String::from_utf8(buf.clone()).unwrap(),
                )),
                TailLine::TooLong => out.push((t.segment(), t.line_no(), "<long>".into())),
            }
        }
    }

    fn texts(v: &[(u64, u64, String)]) -> Vec<&str> {
        v.iter().map(|(_, _, s)| s.as_str()).collect()
    }

    #[test]
    fn an_incomplete_line_waits_for_its_newline() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        append(&p, "ts,v\r\n1,a\n2,");
        let (mut t, header) = Tail::open(&p).unwrap();
        assert_eq!(header, HEADER);
        assert_eq!(lines(&mut t), [(0, 2, "1,a".to_owned())]);
        assert_eq!(t.offset(), 10);
        assert!(lines(&mut t).is_empty());
        append(&p, "b\r\n3,c\n");
        assert_eq!(texts(&lines(&mut t)), ["2,b", "3,c"]);
        assert_eq!((t.line_no(), t.offset()), (4, 19));
    }

    #[test]
    fn a_fifo_at_the_path_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fifo");
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) on a NUL-terminated path we own.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = Tail::open(&p).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn a_header_not_yet_complete_is_an_error_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        append(&p, "ts,");
        let e = Tail::open(&p).unwrap_err().to_string();
        assert!(e.contains("no complete header line"), "{e}");
        assert!(Tail::open(&dir.path().join("none")).is_err());
    }

    #[test]
    fn rotation_finishes_the_old_file_then_reads_the_new_one_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        append(&p, "ts,v\n1,a\n");
        let (mut t, _) = Tail::open(&p).unwrap();
        assert_eq!(texts(&lines(&mut t)), ["1,a"]);
        let first = t.mark();
        // Lines written just before the rename, and an incomplete last one.
        append(&p, "2,b\n3,");
        fs::rename(&p, dir.path().join("t.csv.1")).unwrap();
        // Between the rename and the create: the old file is still read.
        assert_eq!(texts(&lines(&mut t)), ["2,b"]);
        // The new file without its header yet: waited for.
        append(&p, "ts");
        // The old file's last line, without its newline, closes segment 0;
        // its position still names the old file.
        let mut buf = Vec::new();
        assert_eq!(t.next_line(&mut buf).unwrap(), TailLine::Line);
        assert_eq!(
            (buf.as_slice(), t.segment(), t.line_no()),
            (&b"3,"[..], 0, 4)
        );
        assert_eq!(t.mark().ino, first.ino);
        assert!(lines(&mut t).is_empty());
        assert_eq!(t.segment(), 1);
        append(&p, ",v\n4,d\n");
        assert_eq!(lines(&mut t), [(1, 2, "4,d".to_owned())]);
        assert_ne!(t.mark().ino, first.ino);
    }

    #[test]
    fn truncation_starts_the_next_segment_and_a_rewrite_is_seen_by_its_head() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        append(&p, "ts,v\n1,a\n2,b\n");
        let (mut t, _) = Tail::open(&p).unwrap();
        assert_eq!(lines(&mut t).len(), 2);
        // Truncated (copytruncate), then new lines, shorter than before.
        fs::write(&p, "ts,v\n5,e\n").unwrap();
        assert_eq!(lines(&mut t), [(1, 2, "5,e".to_owned())]);
        // Truncated and rewritten past the offset between two polls: the
        // first bytes differ, so it is seen before anything is read.
        fs::write(&p, "ts,v\n6,f\n7,g\n8,h\n").unwrap();
        assert_eq!(
            lines(&mut t),
            [
                (2, 2, "6,f".to_owned()),
                (2, 3, "7,g".to_owned()),
                (2, 4, "8,h".to_owned())
            ]
        );
    }

    #[test]
    fn a_new_file_with_another_header_is_refused_until_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        append(&p, "ts,v\n1,a\n");
        let (mut t, _) = Tail::open(&p).unwrap();
        assert_eq!(lines(&mut t).len(), 1);
        fs::rename(&p, dir.path().join("old")).unwrap();
        append(&p, "when,value\n2,b\n");
        let mut buf = Vec::new();
        let e = t.next_line(&mut buf).unwrap_err().to_string();
        assert!(e.contains("header of the new file differs"), "{e}");
        assert!(t.next_line(&mut buf).is_err(), "still refused");
        fs::remove_file(&p).unwrap();
        append(&p, "ts,v\n3,c\n");
        assert_eq!(lines(&mut t), [(2, 2, "3,c".to_owned())]);
    }

    #[test]
    fn an_over_long_line_is_skipped_even_while_incomplete() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        append(&p, "ts,v\n");
        let (mut t, _) = Tail::open(&p).unwrap();
        append(&p, &"x".repeat(MAX_LINE_BYTES + 10));
        assert!(lines(&mut t).is_empty());
        append(&p, "yy\n1,a\n");
        assert_eq!(texts(&lines(&mut t)), ["<long>", "1,a"]);
        assert_eq!(t.offset(), 5 + MAX_LINE_BYTES as u64 + 13 + 4);
    }

    /// Resume at every stored position gives the rest of an uninterrupted
    /// read: in the same file, in a file rotated while stopped, and after
    /// the file was truncated while stopped.
    #[test]
    fn resume_continues_in_the_same_or_rotated_file_or_the_next_segment() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        let rows: String = (0..40)
            .map(|k| format!("{k},{}\n", "v".repeat(2 * k)))
            .collect();
        append(&p, &format!("ts,v\n{rows}"));
        let (mut t, _) = Tail::open(&p).unwrap();
        let mut stored = Vec::new();
        let mut buf = Vec::new();
        while t.next_line(&mut buf).unwrap() == TailLine::Line {
            stored.push((t.segment(), t.line_no(), t.offset(), t.mark()));
        }
        assert_eq!(stored.len(), 40);
        // The head digest is fixed once 1 KiB is read.
        assert_ne!(stored[0].3, stored[10].3);
        assert_eq!(stored[38].3, stored[39].3);
        for (k, (seg, line, off, mark)) in stored.iter().enumerate() {
            let (mut again, _) = Tail::open(&p).unwrap();
            let how = again.resume(*seg, *line, *off, Some(mark)).unwrap();
            assert_eq!(how, TailResumed::Same);
            let rest = lines(&mut again);
            assert_eq!(rest.len(), 39 - k, "after row {k}");
            if let Some((_, l, text)) = rest.first() {
                assert_eq!(*l, *line + 1);
                assert!(text.starts_with(&format!("{},", k + 1)), "{text}");
            }
        }
        // Rotated while stopped: the rest of the old file, then the new one.
        let (seg, line, off, mark) = stored[29].clone();
        fs::rename(&p, dir.path().join("t.csv.1")).unwrap();
        append(&p, "ts,v\nnew,1\n");
        let (mut again, _) = Tail::open(&p).unwrap();
        let how = again.resume(seg, line, off, Some(&mark)).unwrap();
        assert_eq!(how, TailResumed::Rotated(dir.path().join("t.csv.1")));
        let rest = lines(&mut again);
        assert_eq!(rest.len(), 11);
        assert_eq!(rest[0].2, format!("30,{}", "v".repeat(60)));
        assert_eq!(rest[10], (1, 2, "new,1".to_owned()));
        // The old file gone: the new file from its first row, next segment.
        fs::remove_file(dir.path().join("t.csv.1")).unwrap();
        let (mut again, _) = Tail::open(&p).unwrap();
        let how = again.resume(seg, line, off, Some(&mark)).unwrap();
        assert_eq!(how, TailResumed::NextSegment);
        assert_eq!(lines(&mut again), [(1, 2, "new,1".to_owned())]);
        // Truncated in place while stopped: the same inode, shorter.
        let (mut t2, _) = Tail::open(&p).unwrap();
        let _ = lines(&mut t2);
        let (s2, l2, o2, m2) = (t2.segment(), t2.line_no(), t2.offset(), t2.mark());
        fs::write(&p, "ts,v\n").unwrap();
        let (mut again, _) = Tail::open(&p).unwrap();
        assert_eq!(
            again.resume(s2, l2, o2, Some(&m2)).unwrap(),
            TailResumed::NextSegment
        );
        append(&p, "after,1\n");
        assert_eq!(lines(&mut again), [(1, 2, "after,1".to_owned())]);
    }
}
