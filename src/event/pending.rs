//! Events that another actor plans later: [`PendingEvent`], and the one-shot cell behind it,
//! [`Oneshot`]. See DESIGN.md §4, "Cross-device calls without round trips".
//!
//! A copy from device A to device B is posted to both at once. A records the copy as a reader
//! of its source before B has planned it. What A records is a [`PendingEvent`]: the operation
//! B will plan on its stream. A later write of the source waits for it through
//! [`PendingEvent::event`]: first for B to plan it, then for it to complete.
//! `System::schedule` returns the same cell at once.
//!
//! - Only the actor that owns the [`SeqPromise`] decides the sequence number, and only once.
//!   The stream is known from the start.
//! - A refused operation resolves to the last sequence number issued on its stream, with the
//!   typed error. As a buffer use it is over once everything before it on that stream is.
//!   This keeps the tables' rule that a later use by a stream supersedes an earlier one.
//! - A promise dropped unresolved resolves to [`MAX_SEQ`]. Its actor stopped or panicked, so
//!   the stream's timeline is poisoned and a wait ends with the poison cause. The ticket
//!   reports [`Error::ShutDown`].
//!
//! The cells use [`crate::sync`], so the loom models check them with the protocol.

use std::fmt;
use std::future::Future;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use crate::{
    error::{Error, Result},
    event::{Event, EventStatus, Timeline, MAX_SEQ},
    ids::StreamId,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Condvar, Mutex,
    },
};

/// A value set once by one party and read by any number of others: blocking, with a
/// deadline, or asynchronously (wakers).
pub struct Oneshot<T> {
    /// Set (Release) after the value is stored, for lock-free polling.
    ready: AtomicBool,
    state: Mutex<OneshotState<T>>,
    cond: Condvar,
}

struct OneshotState<T> {
    value: Option<T>,
    /// Inline up to two (a set moves them out to wake them): registering allocates nothing.
    wakers: smallvec::SmallVec<[Waker; 2]>,
    blocked: usize,
}

impl<T: Clone> Oneshot<T> {
    /// An empty cell.
    pub fn new() -> Arc<Oneshot<T>> {
        Arc::new(Oneshot {
            ready: AtomicBool::new(false),
            state: Mutex::new(OneshotState {
                value: None,
                wakers: smallvec::SmallVec::new(),
                blocked: 0,
            }),
            cond: Condvar::new(),
        })
    }

    /// Stores `value` if the cell is empty (the first value wins) and wakes every waiter.
    /// Returns whether this call set it.
    pub fn set(&self, value: T) -> bool {
        let wakers = {
            let mut s = self.state.lock();
            if s.value.is_some() {
                return false;
            }
            s.value = Some(value);
            // Release: a reader that sees `ready` also sees the value (it reads it under
            // the lock anyway; the flag only spares the lock).
            self.ready.store(true, Ordering::Release);
            if s.blocked > 0 {
                self.cond.notify_all();
            }
            std::mem::take(&mut s.wakers)
        };
        for w in wakers {
            w.wake();
        }
        true
    }

    /// Whether the value is set.
    pub fn is_set(&self) -> bool {
        // Acquire: pairs with the Release in `set`.
        self.ready.load(Ordering::Acquire)
    }

    /// The value, if set.
    pub fn get(&self) -> Option<T> {
        if !self.is_set() {
            return None;
        }
        self.state.lock().value.clone()
    }

    /// Blocks until the value is set (or `deadline` passes: `None`).
    pub fn wait_deadline(&self, deadline: Option<Instant>) -> Option<T> {
        if let Some(v) = self.get() {
            return Some(v);
        }
        let mut s = self.state.lock();
        s.blocked += 1;
        let out = loop {
            if let Some(v) = &s.value {
                break Some(v.clone());
            }
            s = match deadline {
                None => self.cond.wait(s),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break None;
                    }
                    self.cond.wait_timeout(s, d - now).0
                }
            };
        };
        s.blocked -= 1;
        out
    }

    /// Blocks until the value is set.
    pub fn wait(&self) -> T {
        match self.wait_deadline(None) {
            Some(v) => v,
            // `wait_deadline(None)` only returns with a value.
            None => unreachable!("an unbounded wait returned without a value"),
        }
    }

    /// The value if set; otherwise registers `waker` to be woken when it is.
    pub fn poll_get(&self, waker: &Waker) -> Option<T> {
        if let Some(v) = self.get() {
            return Some(v);
        }
        let mut s = self.state.lock();
        if let Some(v) = &s.value {
            return Some(v.clone());
        }
        if !s.wakers.iter().any(|w| w.will_wake(waker)) {
            s.wakers.push(waker.clone());
        }
        None
    }
}

impl<T> fmt::Debug for Oneshot<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Oneshot")
            .field("set", &self.ready.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// How the operation behind a [`PendingEvent`] was decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Planned {
    /// Planned as operation `seq` of the stream.
    At(u64),
    /// Refused with this error; nothing was planned. The sequence number is the last one
    /// issued on the stream before the refusal (see the module documentation).
    Refused(u64, Error),
}

impl Planned {
    /// The sequence number a dependency on the operation waits for.
    pub fn seq(&self) -> u64 {
        match self {
            Planned::At(seq) | Planned::Refused(seq, _) => *seq,
        }
    }
}

/// Cells of [`PendingEvent`]s given back for reuse, so that issuing through the actor layer
/// allocates no cell per operation in steady state.
///
/// A cell comes back only from its last holder, which [`Arc::get_mut`] proves: no ticket,
/// promise or deferred event can still read it when it is emptied for its next operation
/// (loom model `event::pooled_cell_is_reused_only_by_its_last_holder`, mutant
/// `cell_reuse`).
pub type CellPool = OneshotPool<Planned>;

/// One-shot cells given back for reuse by their last holder (see [`CellPool`]): the pending
/// events' cells, and the actor layer's answers a copy's source gives its destination.
pub struct OneshotPool<T: Clone> {
    free: Mutex<Vec<Arc<Oneshot<T>>>>,
}

/// Cells a [`OneshotPool`] keeps at most; more are freed. A high-water mark of the
/// one-shots in flight: about what the default inboxes (4,096 operations each) can hold
/// when every operation has a few (a replay across devices has a pending event per stream
/// and per copy, a check per device and an answer per copy). Empty cells, about a hundred
/// bytes each.
const POOLED_CELLS: usize = 65_536;

impl<T: Clone> Default for OneshotPool<T> {
    fn default() -> Self {
        OneshotPool {
            free: Mutex::new(Vec::new()),
        }
    }
}

impl<T: Clone> fmt::Debug for OneshotPool<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OneshotPool")
    }
}

impl<T: Clone> OneshotPool<T> {
    /// An empty pool.
    pub fn new() -> Arc<OneshotPool<T>> {
        Arc::new(OneshotPool::default())
    }

    /// An empty cell: a kept one, or a new one.
    pub(crate) fn take(&self) -> Arc<Oneshot<T>> {
        self.free.lock().pop().unwrap_or_else(Oneshot::new)
    }

    /// Takes `cell` back if the caller holds its last reference; otherwise drops the
    /// caller's reference.
    pub(crate) fn give_back(&self, mut cell: Arc<Oneshot<T>>) {
        let unique = Arc::get_mut(&mut cell).is_some() || mutant!("cell_reuse");
        if !unique {
            return;
        }
        cell.clear();
        let mut free = self.free.lock();
        if free.len() < POOLED_CELLS {
            free.push(cell);
        }
    }
}

impl<T> Oneshot<T> {
    /// Empties the cell for its next use (its last holder only: see [`CellPool`]).
    fn clear(&self) {
        let mut s = self.state.lock();
        s.value = None;
        s.wakers.clear();
        s.blocked = 0;
        self.ready.store(false, Ordering::Relaxed);
    }
}

/// A hold on a one-shot cell that goes back to its pool (if it came from one) when its
/// last holder drops it (its [`OneshotPool`] proves that with `Arc::get_mut`). A
/// [`PendingEvent`], a deferred [`Event`] and the actor layer's pooled answers hold their
/// cells this way. A deferred event must too: a copy's reader (a deferred event in the
/// source's tables) often outlives the copy's ticket and promise, and its cell would
/// otherwise be freed and the next operation allocate one.
pub struct PooledCell<T: Clone> {
    /// Taken only by `drop`.
    cell: ManuallyDrop<Arc<Oneshot<T>>>,
    pool: Option<Arc<OneshotPool<T>>>,
}

impl<T: Clone> PooledCell<T> {
    /// A hold on `cell`, given back to `pool` by its last holder (`None`: freed then).
    pub(crate) fn new(cell: Arc<Oneshot<T>>, pool: Option<Arc<OneshotPool<T>>>) -> Self {
        PooledCell {
            cell: ManuallyDrop::new(cell),
            pool,
        }
    }
}

impl<T: Clone> std::ops::Deref for PooledCell<T> {
    type Target = Arc<Oneshot<T>>;

    fn deref(&self) -> &Arc<Oneshot<T>> {
        &self.cell
    }
}

impl<T: Clone> Clone for PooledCell<T> {
    fn clone(&self) -> Self {
        PooledCell::new(Arc::clone(&self.cell), self.pool.clone())
    }
}

impl<T: Clone> Drop for PooledCell<T> {
    fn drop(&mut self) {
        // SAFETY: `drop` runs once and nothing uses `self.cell` after this line.
        let cell = unsafe { ManuallyDrop::take(&mut self.cell) };
        if let Some(pool) = &self.pool {
            pool.give_back(cell);
        }
    }
}

impl<T: Clone> fmt::Debug for PooledCell<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PooledCell")
    }
}

/// An operation that an actor will plan on a known stream; see the module documentation.
/// Cheap to clone.
#[derive(Clone)]
pub struct PendingEvent {
    timeline: Arc<Timeline>,
    cell: PooledCell<Planned>,
}

/// The deciding side of a [`PendingEvent`]: only the actor that plans the operation holds
/// it. Dropped unresolved, it resolves the event as refused at [`MAX_SEQ`] with
/// [`Error::ShutDown`].
pub struct SeqPromise {
    cell: Option<Arc<Oneshot<Planned>>>,
    pool: Option<Arc<CellPool>>,
}

impl PendingEvent {
    /// A pending operation on `timeline`'s stream and the promise that decides it, its cell
    /// not pooled (the unit tests'; the engine and the actor layer use
    /// [`PendingEvent::pooled`]). Crate-private: `tests/engine/compile_fail` shows a user
    /// cannot make one.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn new(timeline: Arc<Timeline>) -> (PendingEvent, SeqPromise) {
        PendingEvent::with_cell(timeline, Oneshot::new(), None)
    }

    /// [`PendingEvent::new`] with a cell from `pool`, given back to it by the last holder.
    pub fn pooled(timeline: Arc<Timeline>, pool: &Arc<CellPool>) -> (PendingEvent, SeqPromise) {
        PendingEvent::with_cell(timeline, pool.take(), Some(pool.clone()))
    }

    fn with_cell(
        timeline: Arc<Timeline>,
        cell: Arc<Oneshot<Planned>>,
        pool: Option<Arc<CellPool>>,
    ) -> (PendingEvent, SeqPromise) {
        (
            PendingEvent {
                timeline,
                cell: PooledCell::new(cell.clone(), pool.clone()),
            },
            SeqPromise {
                cell: Some(cell),
                pool,
            },
        )
    }

    /// The stream the operation runs on.
    pub fn stream(&self) -> StreamId {
        self.timeline.stream()
    }

    /// How the operation was decided, once it was.
    pub fn planned(&self) -> Option<Planned> {
        self.cell.get()
    }

    /// Blocks until the operation is decided; `None` if `deadline` passed first.
    pub fn wait_planned(&self, deadline: Option<Instant>) -> Option<Planned> {
        self.cell.wait_deadline(deadline)
    }

    /// The operation's event once planned, or the error that refused it.
    pub fn outcome(&self) -> Option<Result<Event>> {
        self.planned().map(|p| self.to_event(p))
    }

    /// The status of the operation `back` operations before this one on its stream (`0`:
    /// this one) once planned, read without making an [`Event`] (no reference count is
    /// touched: a network stream's worker asks this of every operation it takes); `Err` if
    /// this operation was refused or there is no such earlier operation.
    pub fn status_before(&self, back: u64) -> Option<Result<EventStatus>> {
        self.planned().map(|planned| match planned {
            Planned::At(seq) => match seq.checked_sub(back).filter(|&s| s > 0) {
                Some(seq) => Ok(self.timeline.status(seq)),
                None => Err(Error::Internal(format!(
                    "the operation {back} before {}#{seq}",
                    self.stream()
                ))),
            },
            Planned::Refused(_, e) => Err(e),
        })
    }

    fn to_event(&self, planned: Planned) -> Result<Event> {
        match planned {
            Planned::At(seq) => Ok(Event::new(self.timeline.clone(), seq)),
            Planned::Refused(_, e) => Err(e),
        }
    }

    /// Waits asynchronously until the operation is decided: its event, or the error that
    /// refused it.
    pub fn planned_async(&self) -> PlannedFuture {
        PlannedFuture {
            pending: self.clone(),
        }
    }

    /// This operation as an [`Event`]: a use of a buffer that is over once the operation
    /// is planned and complete (or refused, and everything issued before it on its stream
    /// complete).
    pub fn event(&self) -> Event {
        Event::deferred(self.timeline.clone(), self.cell.clone())
    }
}

impl fmt::Debug for PendingEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.planned() {
            Some(Planned::At(seq)) => write!(f, "{}#{seq}", self.stream()),
            Some(Planned::Refused(_, e)) => write!(f, "{}#refused({e})", self.stream()),
            None => write!(f, "{}#?", self.stream()),
        }
    }
}

impl SeqPromise {
    /// Decides the operation.
    pub fn resolve(mut self, planned: Planned) {
        if let Some(cell) = self.cell.take() {
            cell.set(planned);
            if let Some(pool) = &self.pool {
                pool.give_back(cell);
            }
        }
    }
}

impl Drop for SeqPromise {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            cell.set(Planned::Refused(
                MAX_SEQ,
                Error::ShutDown("the actor stopped before planning the operation".into()),
            ));
            if let Some(pool) = &self.pool {
                pool.give_back(cell);
            }
        }
    }
}

impl fmt::Debug for SeqPromise {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SeqPromise")
    }
}

/// The future of [`PendingEvent::planned_async`].
#[must_use = "futures do nothing unless polled"]
#[derive(Debug)]
pub struct PlannedFuture {
    pending: PendingEvent,
}

impl Future for PlannedFuture {
    type Output = Result<Event>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Event>> {
        match self.pending.cell.poll_get(cx.waker()) {
            Some(p) => Poll::Ready(self.pending.to_event(p)),
            None => Poll::Pending,
        }
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;
    use crate::ids::DeviceId;
    use std::time::Duration;

    fn timeline() -> Arc<Timeline> {
        Timeline::new(StreamId {
            device: DeviceId(1),
            index: 0,
        })
    }

    #[test]
    fn a_deferred_event_waits_to_be_planned_then_for_completion() {
        let t = timeline();
        let (pending, promise) = PendingEvent::new(t.clone());
        let event = pending.event();
        assert!(!event.is_done());
        assert!(event.status().is_pending());
        assert_eq!(format!("{pending:?}"), "d1s0#?");
        let waiter = {
            let event = event.clone();
            std::thread::spawn(move || event.wait())
        };
        promise.resolve(Planned::At(2));
        assert!(!event.is_done(), "planned, not complete");
        t.signal(2);
        assert_eq!(waiter.join().expect("waiter"), Ok(()));
        assert!(event.is_done());
        assert_eq!(event.seq(), 2);
        assert_eq!(pending.outcome(), Some(Ok(Event::new(t, 2))));
    }

    #[test]
    fn a_refused_operation_is_over_once_its_stream_caught_up_and_reports_its_error() {
        let t = timeline();
        let (pending, promise) = PendingEvent::new(t.clone());
        let refusal = Error::ShutDown("refused for the test".into());
        promise.resolve(Planned::Refused(3, refusal.clone()));
        assert_eq!(pending.outcome(), Some(Err(refusal)));
        let event = pending.event();
        assert!(
            !event.is_done(),
            "operation 3 of the stream is still pending"
        );
        t.signal(3);
        assert!(event.is_done());
    }

    #[test]
    fn a_dropped_promise_fails_waiters_instead_of_hanging() {
        let t = timeline();
        let (pending, promise) = PendingEvent::new(t.clone());
        drop(promise);
        assert!(matches!(pending.outcome(), Some(Err(Error::ShutDown(_)))));
        // The actor that dropped it poisons its streams: the wait ends.
        t.poison(std::sync::Arc::new(crate::Failure {
            stream: t.stream(),
            seq: 1,
            operation: "actor".into(),
            message: "stopped".into(),
        }));
        assert!(pending
            .event()
            .wait_timeout(Duration::from_secs(5))
            .is_err());
    }

    #[test]
    fn oneshot_first_value_wins_and_wakes_async_waiters() {
        let cell = Oneshot::<u32>::new();
        let fut = PlannedFuture {
            pending: PendingEvent::new(timeline()).0,
        };
        drop(fut);
        assert!(cell.set(1));
        assert!(!cell.set(2));
        assert_eq!(cell.get(), Some(1));
        assert_eq!(cell.wait(), 1);
    }
}
