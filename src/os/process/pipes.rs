//! Draining a child's stdout and stderr: a reader thread per pipe keeps at
//! most a fixed number of bytes and reads and discards the rest.
//!
//! Its one rule: **a pipe is always read to its end**, so a chatty child
//! never blocks on a full pipe, and what is kept never grows past its limit.

use std::io::{self, Read};
use std::process::Child;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Instant;

/// Size of one read from a pipe.
const CHUNK: usize = 4096;

/// What was kept from one pipe.
#[derive(Debug, Clone, Default)]
pub(crate) struct Captured {
    /// The first bytes, up to the pipe's limit.
    pub(crate) bytes: Vec<u8>,
    /// More came than was kept.
    pub(crate) truncated: bool,
}

/// Which of the two pipes.
#[derive(Clone, Copy)]
pub(super) enum Stream {
    /// The child's stdout.
    Stdout,
    /// The child's stderr.
    Stderr,
}

/// The bytes a reader thread keeps, shared so that what came before a kill
/// can be returned even if the pipe never closes.
struct Buffer {
    kept: Captured,
    /// Bytes still to keep; 0 once the owner has taken them.
    room: usize,
}

impl Buffer {
    fn push(&mut self, data: &[u8]) {
        let take = data.len().min(self.room);
        self.kept.bytes.extend_from_slice(&data[..take]);
        self.room -= take;
        if take < data.len() {
            self.kept.truncated = true;
        }
    }
}

/// One pipe being drained by a reader thread.
pub(super) struct Pipe {
    buffer: Arc<Mutex<Buffer>>,
    /// The thread's end: `Ok` on EOF. It ends at the latest when the run's
    /// processes are killed, so it is never joined; the result arrives here.
    done: Receiver<io::Result<()>>,
    finished: bool,
}

impl Pipe {
    /// `None` if the deadline passed before EOF.
    pub(super) fn finish(&mut self, deadline: Instant) -> Option<io::Result<()>> {
        if self.finished {
            return Some(Ok(()));
        }
        let result = match self
            .done
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(r) => Some(r),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Err(io::Error::other(
                "output reader ended without a result",
            ))),
        };
        if matches!(result, Some(Ok(()))) {
            self.finished = true;
        }
        result
    }

    /// A copy of what was kept so far; the reader discards anything that
    /// comes later. A copy, so that a timeout after one pipe was collected
    /// still returns both.
    pub(super) fn snapshot(&self) -> Captured {
        let mut buffer = lock(&self.buffer);
        buffer.room = 0;
        buffer.kept.clone()
    }
}

/// A reader never panics while holding the lock, and the buffer is valid
/// after any push anyway, so a poisoned lock is used as it is.
fn lock(buffer: &Mutex<Buffer>) -> MutexGuard<'_, Buffer> {
    buffer.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Takes the child's stdout and stderr and starts a reader thread on each.
pub(super) fn start_readers(
    child: &mut Child,
    stdout_keep: usize,
    stderr_keep: usize,
) -> io::Result<(Pipe, Pipe)> {
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| io::Error::other("stdout was not captured"))?;
    let stderr = child
        .stderr
        .take()
        .ok_or_else(|| io::Error::other("stderr was not captured"))?;
    let out = spawn_reader("proc-stdout", stdout, stdout_keep)?;
    let err = spawn_reader("proc-stderr", stderr, stderr_keep)?;
    Ok((out, err))
}

fn spawn_reader<R: Read + Send + 'static>(name: &str, stream: R, keep: usize) -> io::Result<Pipe> {
    let buffer = Arc::new(Mutex::new(Buffer {
        kept: Captured::default(),
        room: keep,
    }));
    let (tx, done) = mpsc::channel();
    let shared = Arc::clone(&buffer);
    thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            // The receiver may have given up already; nothing to do then.
            let _ = tx.send(drain(stream, &shared));
        })?;
    Ok(Pipe {
        buffer,
        done,
        finished: false,
    })
}

/// Reads to EOF, keeping what the buffer has room for and discarding the
/// rest so the writer is never blocked on a full pipe.
fn drain<R: Read>(mut stream: R, buffer: &Mutex<Buffer>) -> io::Result<()> {
    let mut chunk = [0u8; CHUNK];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => return Ok(()),
            Ok(n) => lock(buffer).push(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}
