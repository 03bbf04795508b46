//! The store on a thread of its own, so that the MQTT side gathers and
//! decodes batch N+1 while batch N commits.
//!
//! Its one rule: **at most one batch is with the store, and what it did
//! comes back whole, in submission order**: a caller hands over batch N+1
//! only after it has taken batch N's [`Done`], so acknowledgements can go
//! out in arrival order and only for a batch whose `Ok` it holds (the
//! caller's tag, e.g. the deliveries to acknowledge, travels with the batch
//! and comes back beside the store's answer). A batch that fails comes
//! back with its error and is never retried here; nothing after it is in
//! the store's hands.
//!
//! The thread lives in a [`std::thread::scope`] of the caller (it borrows
//! the store); it ends when the [`Committer`] is dropped, after the batch it
//! holds has committed or failed, so a stop drains the batch with the store
//! and drops nothing the store has already been given.

use super::batch::Item;
use super::notes::BoardNote;
use super::{LedgerSummary, SinkStats, Store, StoreError};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::thread::Scope;

/// What a committed batch left to do: its counters, the receipts it owes
/// (`(topic, payload)`, see [`super::outbox::owed`]) and the requests for
/// ranges its boards' notes made (signed, `(topic, payload)`).
#[derive(Debug, Default)]
pub struct Committed {
    /// The batch's counters.
    pub stats: SinkStats,
    /// Receipts owed, empty when receipts are off.
    pub owed: Vec<(String, Vec<u8>)>,
    /// Backfill requests to publish, empty without a key.
    pub asks: Vec<(String, Vec<u8>)>,
    /// The ledger's figures, when the batch asked for them.
    pub summary: Option<LedgerSummary>,
}

/// What goes to the store with a batch besides its events.
#[derive(Debug, Default)]
pub struct Extra {
    /// Boards' holdings and answers, applied after the events.
    pub notes: Vec<BoardNote>,
    /// Read the ledger's figures after.
    pub summary: bool,
}

/// A batch back from the store: the caller's tag, and `Ok` only if it
/// committed.
pub struct Done<T> {
    /// What was handed over with the batch, untouched.
    pub tag: T,
    /// [`Store::commit`]'s answer.
    pub result: Result<Committed, StoreError>,
}

/// A batch and its tag, on its way to the store thread.
struct Job<T> {
    items: Vec<Item>,
    extra: Extra,
    tag: T,
}

/// The handle of the store thread.
pub struct Committer<T> {
    jobs: Option<SyncSender<Job<T>>>,
    done: Receiver<Done<T>>,
    busy: bool,
}

impl<T: Send + Default> Committer<T> {
    /// Start the store thread in `scope`; with a `receipts` key it also
    /// works out (and signs) the receipts each committed batch owes.
    ///
    /// Errors: the thread could not be started (named in the message).
    pub fn start<'scope, 'env, S: Store + Send>(
        scope: &'scope Scope<'scope, 'env>,
        store: &'scope mut S,
        receipts: Option<std::sync::Arc<crate::event::signature::SigningKey>>,
    ) -> Result<Committer<T>, String>
    where
        T: 'scope,
    {
        // Rendezvous both ways: a batch is handed over only to a thread
        // that is waiting for one, and one answer at most waits.
        let (jobs, job_rx) = mpsc::sync_channel::<Job<T>>(0);
        let (done_tx, done) = mpsc::sync_channel::<Done<T>>(1);
        std::thread::Builder::new()
            .name("sink-store".into())
            .spawn_scoped(scope, move || {
                for Job { items, extra, tag } in job_rx {
                    let result = work(store, &items, extra, receipts.as_deref());
                    drop(items);
                    if done_tx.send(Done { tag, result }).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| format!("starting the sink's store thread: {e}"))?;
        Ok(Committer {
            jobs: Some(jobs),
            done,
            busy: false,
        })
    }

    /// Whether a batch is with the store (its [`Done`] not yet taken).
    pub fn busy(&self) -> bool {
        self.busy
    }

    /// Hand `items` (and `extra`) to the store. Call only when not [`Committer::busy`]:
    /// the last batch's [`Done`] has been taken.
    ///
    /// Errors: the store thread is gone (it panicked; the scope re-raises
    /// that panic when it ends).
    pub fn submit(&mut self, items: Vec<Item>, extra: Extra, tag: T) -> Result<(), String> {
        debug_assert!(!self.busy, "one batch with the store at most");
        let gone = || "the sink's store thread ended".to_owned();
        let jobs = self.jobs.as_ref().ok_or_else(gone)?;
        jobs.send(Job { items, extra, tag }).map_err(|_| gone())?;
        self.busy = true;
        Ok(())
    }

    /// The batch with the store if it is back; `None` while it is not, or
    /// when none is out.
    pub fn try_done(&mut self) -> Option<Done<T>> {
        self.wait_for(std::time::Duration::ZERO)
    }

    /// The batch with the store if it is back within `within`; `None`
    /// when it is not, or when none is out.
    pub fn wait_for(&mut self, within: std::time::Duration) -> Option<Done<T>> {
        if !self.busy {
            return None;
        }
        match self.done.recv_timeout(within) {
            Ok(d) => {
                self.busy = false;
                Some(d)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.busy = false;
                Some(self.lost())
            }
        }
    }

    /// The batch with the store, once it is back (`None` when none is out).
    pub fn wait(&mut self) -> Option<Done<T>> {
        if !self.busy {
            return None;
        }
        self.busy = false;
        Some(self.done.recv().unwrap_or_else(|_| self.lost()))
    }

    /// A store thread gone without an answer (it panicked): its batch is
    /// not committed (its tag is lost, an empty one comes back), and
    /// nothing more can be.
    fn lost(&mut self) -> Done<T> {
        self.jobs = None;
        Done {
            tag: T::default(),
            result: Err(StoreError::Fatal("the sink's store thread ended".into())),
        }
    }
}

/// One job on the store thread: the events in one transaction (with their
/// receipts, signed by `key`), then the boards' notes in another (with
/// their requests, signed by the same key: without one none is made), then
/// the ledger's figures if asked for. Nothing after a failure is done.
fn work<S: Store>(
    store: &mut S,
    items: &[Item],
    extra: Extra,
    key: Option<&crate::event::signature::SigningKey>,
) -> Result<Committed, StoreError> {
    let now = crate::event::envelope::wall_clock_ms().0;
    let mut out = Committed::default();
    if !items.is_empty() {
        let s = store.commit(items, now)?;
        if let Some(key) = key {
            out.owed = super::outbox::owed(items, &s.fates, key);
        }
        out.stats = s.stats;
    }
    if !extra.notes.is_empty() {
        let done = store.notes(&extra.notes, key.is_some(), now)?;
        out.stats.notes += done.applied;
        out.stats.gone_rows += done.gone_rows;
        for ask in &done.asks {
            let Some(key) = key else { break };
            if let Some(signed) = ask.signed(key, now) {
                out.stats.asks += 1;
                out.stats.asked_rows += ask.rows();
                log::info!(
                    "sink: asking {} for {} rows again ({})",
                    ask.device,
                    ask.rows(),
                    ask.ranges
                        .iter()
                        .map(|(s, r)| format!("{s} {r:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                out.asks.push(signed);
            }
        }
    }
    if extra.summary {
        out.summary = Some(store.ledger_summary()?);
    }
    Ok(out)
}
