//! Per-stream event timelines. See DESIGN.md §2, "Event".
//!
//! Each stream owns one [`Timeline`], a counter of completed operations. A stream numbers its
//! operations from 1 in issue order; 0 means "nothing" and is always done. An [`Event`] names
//! a stream and a number `n`, and is done once the stream has completed every operation up to
//! `n`. A failed operation is reported with [`Timeline::fail`], and the counter still
//! advances. A dead stream's timeline is poisoned with [`Timeline::poison`]: every operation
//! it has not completed fails with the cause.
//!
//! A wait that sees an operation done also sees its effects: [`Timeline::signal`] publishes
//! with `Release`, and every load that may conclude "done" uses `Acquire`.
//!
//! # How lost wake-ups are excluded
//!
//! Everything a waiter must not miss lives in one atomic word:
//!
//! ```text
//!   bits 63..3: completed sequence number    bit 2: POISONED
//!   bit 1: FAILED (some op ever failed)      bit 0: WAITERS (someone may be blocked or registered)
//! ```
//!
//! A waiter registers under the mutex and sets `WAITERS` with a read-modify-write. Only then
//! does it check its event. `signal` advances the counter with a compare-and-swap and takes
//! the lock only if the word it replaced had `WAITERS`. All read-modify-writes of one word are
//! totally ordered, whatever their memory orderings. If the signal comes after the waiter's
//! `fetch_or`, it sees `WAITERS`, takes the lock and wakes the waiter, which by then sleeps or
//! has stored its waker. If the signal comes first, the waiter's check sees the new counter.
//!
//! The handshake is on one location, so it needs no `SeqCst`, and loom checks it exactly.
//! `WAITERS` is cleared only under the lock, when nobody is registered. A signal notifies the
//! condition variable only once the lowest registered number is decided, so a host waiting for
//! the end of a long queue is not woken by every operation; mutant `wake_past_only`.
//!
//! # Signals below every waiter
//!
//! Nor does such a host make every operation's signal take the lock. The timeline keeps
//! `lowest`, the lowest number anyone is registered for (`u64::MAX` for none), never above
//! any registered number: a waiter lowers it (`fetch_min`) before its `fetch_or` of
//! `WAITERS`, which is `Release`; every removal recomputes it under the lock. A signal whose
//! compare-and-swap (`AcqRel`) replaced a word with `WAITERS` reads `lowest` after it and
//! takes the lock only if its number reaches it. If the waiter's `fetch_or` came first in
//! the word's order, the compare-and-swap acquires it, so the signal reads the waiter's
//! number or a later value (another registration's, lower, or a recomputation under the lock
//! made after the registration, which counts it while it is registered); if the signal came
//! first, the waiter's check sees the new counter, as above. A stale value read after a
//! removal is only lower, which costs a lock for nothing. Mutants: `lowest_read_before_cas`
//! (the number read before moving the counter) and `lowest_unsynchronised` (the
//! compare-and-swap without `Acquire`) lose the wake-up in `event::wait_vs_signal` and
//! `event::async_vs_signal`.
//!
//! A failure sets `FAILED` in the compare-and-swap that advances the counter past it. So a
//! reader that sees the counter past `n` without `FAILED` knows, without the lock, that
//! nothing up to `n` failed. The three flag bits limit sequence numbers to [`MAX_SEQ`].
//!
//! A blocking wait first polls the word for up to 50 µs with [`crate::sync::spin::SpinWait`],
//! without setting `WAITERS`. A completion inside that window costs neither side a system
//! call. No signal owes a wake-up to a waiter that is not registered, so this is safe. Async
//! waiters never spin.
//!
//! Only failed operations are kept in the map from sequence number to root cause. A poisoned
//! timeline stores its cause and the counter at poisoning; every later number reports it.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::Arc as StdArc; // immutable failure data shared with `Error::Failed`, not a lock
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::{Error, Failure, Result};
use crate::ids::StreamId;

#[doc(hidden)]
pub mod pending;
use self::pending::{Planned, PooledCell};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::{spin::SpinWait, Arc, Condvar, Mutex};

/// How long a blocking wait polls the timeline before it parks (module documentation,
/// "Spinning before parking"): long enough to cover a small operation another core is
/// running, short enough that an idle waiter stops using its core at once.
const WAIT_SPIN: Duration = Duration::from_micros(50);

/// The largest sequence number a timeline can represent (2^61 - 1).
///
/// Larger values given to [`Timeline::signal`] or [`Timeline::fail`] are clamped to it
/// (and trip a debug assertion); a wait on a larger value never completes.
pub const MAX_SEQ: u64 = u64::MAX >> SHIFT;

/// Someone is blocked in a wait or has a registered waker: `signal` must take the lock.
const WAITERS: u64 = 1;
/// Some operation of this timeline failed: look its sequence number up in the map.
const FAILED: u64 = 1 << 1;
/// The stream died: sequence numbers past the recorded boundary fail.
const POISONED: u64 = 1 << 2;
/// The completed counter starts at this bit.
const SHIFT: u32 = 3;
const FLAGS: u64 = (1 << SHIFT) - 1;

/// The completed counter held in a word.
#[inline]
fn counter(word: u64) -> u64 {
    word >> SHIFT
}

/// `word` with its counter replaced by `seq` (flags kept).
#[inline]
fn with_counter(word: u64, seq: u64) -> u64 {
    (seq << SHIFT) | (word & FLAGS)
}

/// The state of an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventStatus {
    /// The operation has not completed yet.
    Pending,
    /// The operation completed successfully.
    Done,
    /// The operation failed (or its stream died before it completed); the root cause.
    Failed(StdArc<Failure>),
}

impl EventStatus {
    /// Whether the operation is still pending.
    pub fn is_pending(&self) -> bool {
        matches!(self, EventStatus::Pending)
    }

    /// `None` while pending; otherwise the result a wait returns.
    fn into_result(self) -> Option<Result<()>> {
        match self {
            EventStatus::Pending => None,
            EventStatus::Done => Some(Ok(())),
            EventStatus::Failed(cause) => Some(Err(Error::Failed(cause))),
        }
    }
}

/// State behind the timeline's mutex.
/// A map kept as a vector sorted by key. A timeline has few waiters at a time, and a
/// vector keeps its capacity: registering and waking them allocates nothing once it has
/// grown (a `BTreeMap` allocates a node whenever it goes from empty to one entry).
#[derive(Debug)]
struct SortedMap<K, V>(Vec<(K, V)>);

impl<K, V> Default for SortedMap<K, V> {
    fn default() -> Self {
        SortedMap(Vec::new())
    }
}

impl<K: Ord + Copy, V> SortedMap<K, V> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn first_key(&self) -> Option<K> {
        self.0.first().map(|(k, _)| *k)
    }

    fn position(&self, key: &K) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.cmp(key))
    }

    fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let i = self.position(key).ok()?;
        Some(&mut self.0[i].1)
    }

    /// The value of `key`, inserted from `make` when absent.
    fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        let i = match self.position(&key) {
            Ok(i) => i,
            Err(i) => {
                self.0.insert(i, (key, make()));
                i
            }
        };
        &mut self.0[i].1
    }

    fn remove(&mut self, key: &K) -> Option<V> {
        let i = self.position(key).ok()?;
        Some(self.0.remove(i).1)
    }

    /// Moves the values of every key below `bound` (all of them for `None`) into `out`.
    fn take_below(&mut self, bound: Option<&K>, out: &mut impl Extend<V>) {
        let end = bound.map_or(self.0.len(), |b| self.0.partition_point(|(k, _)| k < b));
        out.extend(self.0.drain(..end).map(|(_, v)| v));
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Root causes of failed operations, by sequence number. Holds only failed operations.
    failures: BTreeMap<u64, StdArc<Failure>>,
    /// Set once, when the stream dies: the counter at that moment and the cause.
    poison: Option<(u64, StdArc<Failure>)>,
    /// Threads blocked in a wait, counted by the sequence number each waits for: a signal
    /// that decides none of them wakes nobody (no system call).
    blocked: SortedMap<u64, usize>,
    /// Registered async waiters, by (sequence number, registration id).
    wakers: SortedMap<(u64, u64), Waker>,
    /// Next registration id for `wakers`.
    next_waker_id: u64,
}

/// The completion timeline of one stream. `Send + Sync`; shared as `Arc<Timeline>`.
///
/// See the [module documentation](self) for the semantics and the wake-up protocol.
pub struct Timeline {
    stream: StreamId,
    /// Completed counter and flags; see the module documentation for the layout.
    word: AtomicU64,
    /// The lowest sequence number a blocked thread or a registered waker waits for
    /// (`u64::MAX` when none): `signal` takes the lock only once the counter reaches it
    /// (module documentation, "Signals below every waiter"). Never above the lowest
    /// registered number: lowered before a registration is announced, recomputed under the
    /// lock after every removal.
    lowest: AtomicU64,
    inner: Mutex<Inner>,
    cond: Condvar,
}

impl Timeline {
    /// A fresh timeline for `stream`: nothing completed yet (only sequence number 0 is done).
    pub fn new(stream: StreamId) -> Arc<Timeline> {
        Arc::new(Timeline {
            stream,
            word: AtomicU64::new(0),
            lowest: AtomicU64::new(u64::MAX),
            inner: Mutex::new(Inner::default()),
            cond: Condvar::new(),
        })
    }

    /// The stream this timeline belongs to.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// The highest `n` such that every operation up to `n` has finished (successfully or
    /// not). Operations that failed only because the stream was poisoned do not count as
    /// finished.
    pub fn completed(&self) -> u64 {
        // Acquire: a caller that sees `n` also sees the effects of operations up to `n`.
        counter(self.word.load(Ordering::Acquire))
    }

    /// Whether every operation up to `seq` has finished (`completed() >= seq`).
    ///
    /// One atomic load, no lock. This says nothing about success: use [`status`] for that.
    /// Operations that failed only because the stream was poisoned never become done
    /// (their work may still be in flight on the device), so a poller that must also notice
    /// a dead stream should use [`status`].
    ///
    /// [`status`]: Timeline::status
    pub fn is_done(&self, seq: u64) -> bool {
        // Acquire: pairs with the Release of `signal`, so `true` makes the operation's
        // effects (its outputs) visible to the caller.
        counter(self.word.load(Ordering::Acquire)) >= seq
    }

    /// The backend reports that every operation up to `seq` has finished.
    ///
    /// Monotonic: a value not above [`completed`](Timeline::completed) is ignored. Cheap:
    /// when nobody waits for `seq` or an earlier operation, one compare-and-swap and no lock
    /// (module documentation, "Signals below every waiter"). Operations in the range that
    /// were not reported with [`fail`](Timeline::fail) first count as successful.
    pub fn signal(&self, seq: u64) {
        let seq = clamp(seq);
        // The mutant reads the lowest waited-for number before moving the counter: a waiter
        // that registers in between is skipped and never woken.
        let early_lowest =
            mutant!("lowest_read_before_cas").then(|| self.lowest.load(Ordering::Acquire));
        // Relaxed: only the first guess for the compare-and-swap below, which re-reads.
        let mut cur = self.word.load(Ordering::Relaxed);
        loop {
            if counter(cur) >= seq {
                return;
            }
            // Success AcqRel. Release: publishes the operations' effects (and whatever was
            // done before this call) to every Acquire load that sees the new counter; the
            // read-modify-writes of waiters continue the release sequence. Acquire: when
            // the replaced word has WAITERS, a registration announced before this
            // compare-and-swap (its `fetch_or` is Release) happens before the load of
            // `lowest` below, which therefore sees that registration's number (or a later
            // value, computed under the lock). Failure Relaxed: we just retry.
            let success = match (mutant!("relaxed_signal"), mutant!("lowest_unsynchronised")) {
                (true, _) => Ordering::Relaxed,
                (false, true) => Ordering::Release,
                (false, false) => Ordering::AcqRel,
            };
            match self.word.compare_exchange_weak(
                cur,
                with_counter(cur, seq),
                success,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(actual) => cur = actual,
            }
        }
        if cur & WAITERS == 0 {
            // Fast path: nobody had registered when the counter moved, and anyone who
            // registers later sees the new counter (module documentation).
            return;
        }
        // Relaxed: ordered by the compare-and-swap's Acquire (above).
        let lowest = early_lowest.unwrap_or_else(|| self.lowest.load(Ordering::Relaxed));
        if seq < lowest {
            // Below every waiter: nobody to wake, no lock (module documentation, "Signals
            // below every waiter").
            return;
        }
        let mut inner = self.inner.lock();
        let woken = self.whom_to_wake(&mut inner);
        drop(inner);
        self.wake(woken);
    }

    /// The backend reports that operation `seq` failed with the root `cause`: the failure is
    /// recorded, then the timeline advances to `seq` as with [`signal`](Timeline::signal)
    /// (operations before `seq` not reported as failed count as successful).
    ///
    /// A failure reported for an operation that is already complete (`seq <= completed()`)
    /// is ignored, with a warning: waiters may already have been told it succeeded. Report
    /// the failure instead of (or before) the signal that covers it. If the stream was
    /// poisoned before `seq` completed, the poison cause stays the failure of `seq`.
    /// `seq == 0` is ignored (nothing to fail).
    pub fn fail(&self, seq: u64, cause: StdArc<Failure>) {
        if seq == 0 {
            tracing::warn!(stream = %self.stream, "failure reported for sequence number 0, ignored");
            return;
        }
        let seq = clamp(seq);
        let mut inner = self.inner.lock();
        // Under poison the poison cause wins for every seq past the boundary.
        let poisoned = matches!(inner.poison, Some((boundary, _)) if seq > boundary);
        let flag = if poisoned || mutant!("failed_bit") {
            0
        } else {
            FAILED
        };
        // Relaxed: only the first guess for the compare-and-swap below.
        let mut cur = self.word.load(Ordering::Relaxed);
        loop {
            if counter(cur) >= seq {
                drop(inner);
                tracing::warn!(
                    stream = %self.stream,
                    seq,
                    %cause,
                    "failure reported for an operation already complete, ignored"
                );
                return;
            }
            // Success Release: as in `signal`; the FAILED bit is set in the same step as
            // the counter passes `seq`, so no reader can see `seq` complete without it.
            // Failure Relaxed: we just retry.
            match self.word.compare_exchange_weak(
                cur,
                with_counter(cur, seq) | flag,
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(actual) => cur = actual,
            }
        }
        // Inserting after the compare-and-swap is fine: the map is only read under the
        // lock, which we hold, and readers that see FAILED go to the map.
        if !poisoned {
            inner.failures.insert(seq, cause);
        }
        // The lock is held, so `inner` says exactly who is registered.
        if (!inner.blocked.is_empty() || !inner.wakers.is_empty()) && !mutant!("fail_no_wake") {
            let woken = self.whom_to_wake(&mut inner);
            drop(inner);
            self.wake(woken);
        }
    }

    /// The stream died with `cause`: every operation not completed now (`seq >
    /// completed()`) fails with `cause`, now and in the future; all waiters are woken.
    ///
    /// Only the first poisoning counts; later calls are ignored. Later signals still
    /// advance [`completed`](Timeline::completed) (the device did finish that work, which
    /// matters for reusing memory), but the operations past the boundary stay failed.
    pub fn poison(&self, cause: StdArc<Failure>) {
        let mut inner = self.inner.lock();
        if inner.poison.is_some() {
            return;
        }
        // Release: a reader that sees POISONED without the lock then takes the lock to
        // read the cause; it can only get the lock after this critical section (it read a
        // value written inside it), and the Release/Acquire pair also orders anything done
        // before the poisoning. The returned counter is the boundary: the read-modify-write
        // makes it exact even against a concurrent lock-free `signal`.
        let prev = self.word.fetch_or(POISONED, Ordering::Release);
        inner.poison = Some((counter(prev), cause));
        let woken = self.whom_to_wake(&mut inner);
        drop(inner);
        self.wake(woken);
    }

    /// The recorded failure of operation `seq`: its own root cause if it failed, or the
    /// poison cause if the stream died before it completed. `None` if it succeeded or is
    /// still pending.
    pub fn failure_of(&self, seq: u64) -> Option<StdArc<Failure>> {
        match self.status(seq) {
            EventStatus::Failed(cause) => Some(cause),
            EventStatus::Pending | EventStatus::Done => None,
        }
    }

    /// The state of operation `seq`. Lock-free unless some operation failed or the stream
    /// was poisoned.
    pub fn status(&self, seq: u64) -> EventStatus {
        match self.status_fast(seq) {
            Some(status) => status,
            None => self.status_locked(seq, &self.inner.lock()),
        }
    }

    /// Blocks until operation `seq` has completed.
    ///
    /// `Ok(())` when it completed successfully; `Err(Error::Failed(cause))` when it failed
    /// or the stream was poisoned before it completed (the cause is the recorded root cause,
    /// the same `Arc`).
    pub fn wait(&self, seq: u64) -> Result<()> {
        self.wait_until(seq, None, Duration::MAX)
    }

    /// Like [`wait`](Timeline::wait), but gives up after `timeout` with
    /// `Err(Error::Timeout { what: "event d0s1#5", after: timeout })`.
    ///
    /// Under `tributary_loom` the clock is still the real one, but the condition variable
    /// has no timeout: a timed wait wakes up only when notified (see [`crate::sync`]).
    pub fn wait_timeout(&self, seq: u64, timeout: Duration) -> Result<()> {
        // An unrepresentable deadline is as good as none.
        let deadline = Instant::now().checked_add(timeout);
        self.wait_until(seq, deadline, timeout)
    }

    /// Like [`wait`](Timeline::wait), but gives up at `deadline` with `Error::Timeout`
    /// (its `after` is the time from the call to the deadline).
    pub fn wait_deadline(&self, seq: u64, deadline: Instant) -> Result<()> {
        let after = deadline.saturating_duration_since(Instant::now());
        self.wait_until(seq, Some(deadline), after)
    }

    /// The status without the lock, when the word alone decides it.
    fn status_fast(&self, seq: u64) -> Option<EventStatus> {
        if seq == 0 {
            return Some(EventStatus::Done);
        }
        // Acquire: pairs with the Release of `signal`/`fail`/`poison`; a `Done` answer makes
        // the operation's effects visible to the caller.
        let word = self.word.load(Ordering::Acquire);
        if word & POISONED != 0 {
            return None;
        }
        if counter(word) < seq {
            Some(EventStatus::Pending)
        } else if word & FAILED == 0 {
            // No failure was ever recorded up to the counter (module documentation).
            Some(EventStatus::Done)
        } else {
            None
        }
    }

    /// The status, with the lock held (so the word, the failure map and the poison agree).
    fn status_locked(&self, seq: u64, inner: &Inner) -> EventStatus {
        if seq == 0 {
            return EventStatus::Done;
        }
        if let Some((boundary, cause)) = &inner.poison {
            if seq > *boundary {
                return EventStatus::Failed(StdArc::clone(cause));
            }
        }
        // Acquire: as in `status_fast` (a lock-free `signal` may have moved the counter
        // since we locked; its effects must be visible if we report `Done`).
        let word = self.word.load(Ordering::Acquire);
        if counter(word) < seq {
            return EventStatus::Pending;
        }
        match inner.failures.get(&seq) {
            Some(cause) => EventStatus::Failed(StdArc::clone(cause)),
            None => EventStatus::Done,
        }
    }

    /// Polls the word for `window` without announcing a waiter (module documentation,
    /// "Spinning before parking"): the result if the operation is decided in that time,
    /// `None` when the window passed or the lock is needed to decide (a failure or a
    /// poison, whose cause is read under the lock).
    fn spin_for(&self, seq: u64, window: Duration) -> Option<Result<()>> {
        let mut spin = SpinWait::new(window);
        while spin.spin() {
            if mutant!("spin_relaxed") {
                // Relaxed: the mutant; a waiter that returns on this load has not
                // synchronised with the completion, so it may miss the operation's effects.
                if counter(self.word.load(Ordering::Relaxed)) >= seq {
                    return Some(Ok(()));
                }
            }
            match self.status_fast(seq) {
                Some(EventStatus::Pending) => {}
                Some(status) => return status.into_result(),
                None => return None,
            }
        }
        None
    }

    /// Lowers `lowest` to `seq`, then sets WAITERS, before the caller checks the status
    /// (module documentation). Called with the lock held, by a waiter about to register
    /// for `seq`.
    fn announce_waiter(&self, seq: u64) {
        if mutant!("lost_wakeup") {
            return;
        }
        // Relaxed: published by the Release of the `fetch_or` below.
        self.lowest.fetch_min(seq, Ordering::Relaxed);
        // Release: a `signal` whose compare-and-swap replaces a word with this bit (or a
        // later one) sees the `fetch_min` above. The handshake itself needs no ordering:
        // this read-modify-write is ordered with the `signal` compare-and-swaps in the
        // word's modification order whatever the ordering, and the status check that
        // follows makes its own Acquire load, which cannot read an older value than this
        // one (coherence).
        self.word.fetch_or(WAITERS, Ordering::Release);
    }

    /// After registrations were removed: publishes the lowest number still waited for, and
    /// clears WAITERS if nobody is registered any more. Called with the lock held.
    fn registrations_changed(&self, inner: &Inner) {
        let blocked = inner.blocked.first_key();
        let registered = inner.wakers.first_key().map(|(seq, _)| seq);
        let lowest = blocked
            .into_iter()
            .chain(registered)
            .min()
            .unwrap_or(u64::MAX);
        // Relaxed: a registration made later, under the lock, lowers it again before it
        // announces itself; a `signal` that reads an older, lower value merely takes the
        // lock for nothing.
        self.lowest.store(lowest, Ordering::Relaxed);
        if inner.blocked.is_empty() && inner.wakers.is_empty() {
            // Relaxed: the bit is only a hint for `signal` to take the lock; registrations
            // happen under the lock we hold, so no waiter can be lost by clearing it, and a
            // `signal` that still sees the old bit merely takes the lock for nothing.
            self.word.fetch_and(!WAITERS, Ordering::Relaxed);
        }
    }

    /// Decides whom to wake: whether the blocked threads are to be woken, and the wakers
    /// whose event is decided, taken out. Called with the lock held; [`Timeline::wake`]
    /// wakes them once it is released.
    fn whom_to_wake(&self, inner: &mut Inner) -> Woken {
        // Relaxed: only decides which wakers to take out; a woken future re-checks with an
        // Acquire load. Reads at least the value this thread just wrote (coherence).
        let word = self.word.load(Ordering::Relaxed);
        let mut ready = ReadyWakers::new();
        if inner.poison.is_some() {
            // Every pending sequence number is decided now (failed).
            inner.wakers.take_below(None, &mut ready);
        } else {
            inner
                .wakers
                .take_below(Some(&(counter(word) + 1, 0)), &mut ready);
        }
        // Wake the blocked threads only if the lowest number one of them waits for is
        // decided now (all of them when poisoned): a thread woken for nothing would cost
        // a system call here and a context switch there, for every operation completed
        // while a host waits for a later one (`sync_all`).
        let decided = |&lowest: &u64| {
            inner.poison.is_some()
                || if mutant!("wake_past_only") {
                    counter(word) > lowest
                } else {
                    counter(word) >= lowest
                }
        };
        let blocked = inner.blocked.first_key().as_ref().is_some_and(decided);
        self.registrations_changed(inner);
        Woken {
            blocked,
            wakers: ready,
        }
    }

    /// Wakes what [`Timeline::whom_to_wake`] decided, after the lock was released: a thread
    /// woken while the lock is held (on one core, the waker is preempted by the thread it
    /// woke) would find the lock taken, block on it, and cost another pair of system calls
    /// and context switches. A blocked thread cannot miss the notification: it checked its
    /// event under the lock before it waited, and it waited before this thread took the
    /// lock; one that registers after sees the new counter (module documentation).
    fn wake(&self, woken: Woken) {
        if woken.blocked {
            self.cond.notify_all();
        }
        wake_all(woken.wakers);
    }

    fn wait_until(&self, seq: u64, deadline: Option<Instant>, after: Duration) -> Result<()> {
        if let Some(result) = self.status_fast(seq).and_then(EventStatus::into_result) {
            return result;
        }
        if let Some(result) = self.spin_for(seq, after.min(WAIT_SPIN)) {
            return result;
        }
        let mut inner = self.inner.lock();
        *inner.blocked.get_or_insert_with(seq, || 0) += 1;
        self.announce_waiter(seq);
        let result = loop {
            if let Some(result) = self.status_locked(seq, &inner).into_result() {
                break result;
            }
            inner = match deadline {
                None => self.cond.wait(inner),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        break Err(Error::Timeout {
                            what: format!("event {}#{}", self.stream, seq),
                            after,
                        });
                    }
                    self.cond.wait_timeout(inner, deadline - now).0
                }
            };
        };
        if let Some(waiting) = inner.blocked.get_mut(&seq) {
            *waiting -= 1;
            if *waiting == 0 {
                inner.blocked.remove(&seq);
            }
        }
        self.registrations_changed(&inner);
        result
    }
}

/// Clamps a sequence number to [`MAX_SEQ`].
fn clamp(seq: u64) -> u64 {
    debug_assert!(seq <= MAX_SEQ, "sequence number {seq} exceeds MAX_SEQ");
    seq.min(MAX_SEQ)
}

/// Wakers taken out under the lock to be woken after it: a few inline.
type ReadyWakers = smallvec::SmallVec<[Waker; 4]>;

/// Whom a change of the timeline wakes, decided under the lock, woken after it.
struct Woken {
    /// The blocked threads (the lowest number one of them waits for is decided).
    blocked: bool,
    wakers: ReadyWakers,
}

/// Wakes wakers taken out under the lock, after it was released (a waker may run code that
/// takes the lock again).
fn wake_all(wakers: ReadyWakers) {
    for waker in wakers {
        waker.wake();
    }
}

impl fmt::Debug for Timeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Acquire: like `completed`; only for display.
        let word = self.word.load(Ordering::Acquire);
        f.debug_struct("Timeline")
            .field("stream", &self.stream)
            .field("completed", &counter(word))
            .field("failed", &(word & FAILED != 0))
            .field("poisoned", &(word & POISONED != 0))
            .finish_non_exhaustive()
    }
}

/// "Stream `S` has completed everything up to sequence number `n`": a cheap handle on one
/// point of a [`Timeline`].
///
/// Equality and hashing are by `(stream, seq)`, not by timeline identity. Debug and Display
/// show `d0s1#5` (device 0, stream 1, sequence number 5).
///
/// An event can also be *deferred* ([`crate::pending::PendingEvent::event`]): an operation
/// that another actor will plan on a known stream. Until it is planned it is pending; then
/// it is the event it was planned as (see `src/event/pending.rs` for a refused operation).
#[derive(Clone)]
pub struct Event {
    timeline: Arc<Timeline>,
    seq: u64,
    /// Set for a deferred event: the cell its sequence number arrives in (`seq` unused).
    deferred: Option<PooledCell<Planned>>,
}

impl Event {
    /// The event `seq` of `timeline`.
    pub fn new(timeline: Arc<Timeline>, seq: u64) -> Event {
        Event {
            timeline,
            seq,
            deferred: None,
        }
    }

    /// The operation that `cell` will say was planned on `timeline`'s stream.
    pub(crate) fn deferred(timeline: Arc<Timeline>, cell: PooledCell<Planned>) -> Event {
        Event {
            timeline,
            seq: 0,
            deferred: Some(cell),
        }
    }

    /// The stream of the event.
    pub fn stream(&self) -> StreamId {
        self.timeline.stream()
    }

    /// The sequence number of the event on its stream.
    ///
    /// For a deferred event this **blocks** until its operation is planned: only executors
    /// (stream threads, which may wait) call it on dependencies. [`Event::planned_seq`]
    /// never blocks.
    pub fn seq(&self) -> u64 {
        match &self.deferred {
            None => self.seq,
            Some(cell) => cell.wait().seq(),
        }
    }

    /// The sequence number if it is known: always for a plain event, once planned for a
    /// deferred one.
    pub fn planned_seq(&self) -> Option<u64> {
        match &self.deferred {
            None => Some(self.seq),
            Some(cell) => cell.get().map(|p| p.seq()),
        }
    }

    /// Whether this is a deferred event (planned by another actor; see
    /// [`crate::pending`]).
    pub fn is_deferred(&self) -> bool {
        self.deferred.is_some()
    }

    /// This event with its sequence number known: itself if plain, the planned event if
    /// deferred and planned, `None` while a deferred event is not planned yet.
    pub fn settled(&self) -> Option<Event> {
        self.planned_seq()
            .map(|seq| Event::new(self.timeline.clone(), seq))
    }

    /// The event of the operation `back` operations before this one on its stream: a
    /// handle to wait for, never to complete. `None` for a deferred event not planned yet,
    /// or before the stream's first operation. (A replay runs a stream's part of a step
    /// under consecutive numbers, so one event of it names all of them.)
    pub fn before(&self, back: u64) -> Option<Event> {
        let seq = self.planned_seq()?.checked_sub(back).filter(|&s| s > 0)?;
        Some(Event::new(self.timeline.clone(), seq))
    }

    /// The timeline the event belongs to.
    ///
    /// Crate-private: whoever holds a timeline can signal it, and a queue's timeline must
    /// be completed by that queue only (the contract of
    /// [`Backend::start_stream`](crate::backend::Backend::start_stream)); an event handed
    /// to a user can be waited for, not completed.
    pub(crate) fn timeline(&self) -> &Arc<Timeline> {
        &self.timeline
    }

    /// Whether the operation has finished; see [`Timeline::is_done`]. A deferred event not
    /// planned yet is not done.
    pub fn is_done(&self) -> bool {
        self.planned_seq()
            .is_some_and(|seq| self.timeline.is_done(seq))
    }

    /// The state of the operation; see [`Timeline::status`]. A deferred event not planned
    /// yet is pending.
    pub fn status(&self) -> EventStatus {
        match self.planned_seq() {
            Some(seq) => self.timeline.status(seq),
            None => EventStatus::Pending,
        }
    }

    /// Blocks until the operation has completed; see [`Timeline::wait`].
    pub fn wait(&self) -> Result<()> {
        self.timeline.wait(self.seq())
    }

    /// Blocks until the operation has completed or `timeout` has passed; see
    /// [`Timeline::wait_timeout`].
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now().checked_add(timeout);
        let seq = match &self.deferred {
            None => self.seq,
            Some(cell) => match cell.wait_deadline(deadline) {
                Some(p) => p.seq(),
                None => {
                    return Err(Error::Timeout {
                        what: format!("event {self} (not planned yet)"),
                        after: timeout,
                    })
                }
            },
        };
        match deadline {
            Some(d) => self.timeline.wait_deadline(seq, d).map_err(|e| match e {
                Error::Timeout { what, .. } => Error::Timeout {
                    what,
                    after: timeout,
                },
                other => other,
            }),
            None => self.timeline.wait(seq),
        }
    }

    /// A future that resolves like [`wait`](Event::wait), without blocking a thread: its
    /// waker is registered in the timeline and woken by `signal`, `fail` or `poison`.
    pub fn wait_async(&self) -> EventFuture {
        EventFuture {
            event: self.clone(),
            registration: None,
        }
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.planned_seq() {
            Some(seq) => write!(f, "{}#{}", self.stream(), seq),
            None => write!(f, "{}#?", self.stream()),
        }
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Plain events are equal when their stream and sequence number are; a deferred event is
/// equal only to a clone of itself (its identity is the operation it waits to learn of,
/// whatever it is planned as), so equality and hashes never change over time.
impl PartialEq for Event {
    fn eq(&self, other: &Event) -> bool {
        match (&self.deferred, &other.deferred) {
            (None, None) => (self.stream(), self.seq) == (other.stream(), other.seq),
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for Event {}

impl Hash for Event {
    fn hash<H: Hasher>(&self, state: &mut H) {
        match &self.deferred {
            None => (self.stream(), self.seq).hash(state),
            Some(cell) => (self.stream(), Arc::as_ptr(cell) as usize).hash(state),
        }
    }
}

/// The future of [`Event::wait_async`]: resolves to `Ok(())` when the operation completed
/// successfully, `Err(Error::Failed(cause))` when it failed or its stream died.
///
/// Dropping it before completion removes its waker from the timeline.
#[must_use = "futures do nothing unless polled"]
#[derive(Debug)]
pub struct EventFuture {
    event: Event,
    /// Registration id of our waker in the timeline, once registered.
    registration: Option<u64>,
}

impl EventFuture {
    /// The event this future waits for.
    pub fn event(&self) -> &Event {
        &self.event
    }
}

impl Future for EventFuture {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        if let Some(cell) = &this.event.deferred {
            // First the operation must be planned; then it is a plain event.
            match cell.poll_get(cx.waker()) {
                Some(planned) => {
                    this.event = Event::new(this.event.timeline.clone(), planned.seq());
                }
                None => return Poll::Pending,
            }
        }
        let seq = this.event.seq;
        let timeline = &*this.event.timeline;
        if this.registration.is_none() {
            if let Some(result) = timeline.status_fast(seq).and_then(EventStatus::into_result) {
                return Poll::Ready(result);
            }
        }
        let mut inner = timeline.inner.lock();
        // Announce before checking, exactly like a blocking waiter (module documentation):
        // a `signal` racing with this registration either is seen by the check below or
        // sees WAITERS and wakes the waker stored below.
        timeline.announce_waiter(seq);
        if let Some(result) = timeline.status_locked(seq, &inner).into_result() {
            if let Some(id) = this.registration.take() {
                inner.wakers.remove(&(seq, id));
            }
            timeline.registrations_changed(&inner);
            return Poll::Ready(result);
        }
        let id = match this.registration {
            Some(id) => id,
            None => {
                let id = inner.next_waker_id;
                inner.next_waker_id += 1;
                this.registration = Some(id);
                id
            }
        };
        // Store (or refresh) the waker; it may have been taken out by a wake-up already.
        let stored = inner
            .wakers
            .get_or_insert_with((seq, id), || cx.waker().clone());
        if !stored.will_wake(cx.waker()) {
            *stored = cx.waker().clone();
        }
        Poll::Pending
    }
}

impl Drop for EventFuture {
    fn drop(&mut self) {
        if let Some(id) = self.registration.take() {
            let timeline = &*self.event.timeline;
            let mut inner = timeline.inner.lock();
            inner.wakers.remove(&(self.event.seq, id));
            timeline.registrations_changed(&inner);
        }
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;
    use crate::ids::DeviceId;
    use std::collections::HashSet;
    use std::sync::atomic::AtomicBool;
    use std::task::Wake;

    fn sid(device: u32, index: u32) -> StreamId {
        StreamId {
            device: DeviceId(device),
            index,
        }
    }

    fn cause(stream: StreamId, seq: u64, message: &str) -> StdArc<Failure> {
        StdArc::new(Failure {
            stream,
            seq,
            operation: "kernel".to_owned(),
            message: message.to_owned(),
        })
    }

    fn failed_with(result: Result<()>) -> StdArc<Failure> {
        match result {
            Err(Error::Failed(cause)) => cause,
            other => panic!("expected Error::Failed, got {other:?}"),
        }
    }

    #[test]
    fn timeline_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Timeline>();
        check::<Event>();
        check::<EventFuture>();
    }

    #[test]
    fn seq_zero_is_always_done() {
        let t = Timeline::new(sid(0, 0));
        assert_eq!(t.completed(), 0);
        assert!(t.is_done(0));
        assert_eq!(t.status(0), EventStatus::Done);
        assert_eq!(t.wait(0), Ok(()));
        t.poison(cause(sid(0, 0), 1, "dead"));
        assert!(t.is_done(0));
        assert_eq!(t.wait(0), Ok(()));
        assert_eq!(t.failure_of(0), None);
    }

    #[test]
    fn signal_then_wait() {
        let t = Timeline::new(sid(0, 1));
        assert!(!t.is_done(1));
        assert_eq!(t.status(1), EventStatus::Pending);
        t.signal(1);
        assert!(t.is_done(1));
        assert_eq!(t.completed(), 1);
        assert_eq!(t.status(1), EventStatus::Done);
        assert_eq!(t.wait(1), Ok(()));
        assert_eq!(t.wait_timeout(1, Duration::ZERO), Ok(()));
        assert!(!t.is_done(2));
    }

    #[test]
    fn signal_reaches_or_passes() {
        let t = Timeline::new(sid(0, 0));
        t.signal(10);
        for seq in 1..=10 {
            assert!(t.is_done(seq));
            assert_eq!(t.wait(seq), Ok(()));
        }
        assert!(!t.is_done(11));
    }

    #[test]
    fn lower_signal_is_ignored() {
        let t = Timeline::new(sid(0, 0));
        t.signal(7);
        t.signal(3);
        t.signal(7);
        assert_eq!(t.completed(), 7);
        t.signal(8);
        assert_eq!(t.completed(), 8);
    }

    #[test]
    fn fail_records_cause_and_advances() {
        let s = sid(1, 0);
        let t = Timeline::new(s);
        let c = cause(s, 2, "boom");
        t.signal(1);
        t.fail(2, StdArc::clone(&c));
        assert_eq!(t.completed(), 2);
        assert!(t.is_done(2));
        assert_eq!(t.wait(1), Ok(()));
        let got = failed_with(t.wait(2));
        assert!(StdArc::ptr_eq(&got, &c));
        assert!(StdArc::ptr_eq(&t.failure_of(2).expect("failure"), &c));
        assert_eq!(t.failure_of(1), None);
        assert_eq!(t.status(2), EventStatus::Failed(StdArc::clone(&c)));
        // The stream keeps serving.
        t.signal(3);
        assert_eq!(t.wait(3), Ok(()));
        assert_eq!(t.failure_of(3), None);
        // Failing past a gap: ops in between succeeded.
        let c5 = cause(s, 5, "again");
        t.fail(5, StdArc::clone(&c5));
        assert_eq!(t.wait(4), Ok(()));
        assert!(StdArc::ptr_eq(&failed_with(t.wait(5)), &c5));
    }

    #[test]
    fn late_failure_is_ignored() {
        let s = sid(0, 0);
        let t = Timeline::new(s);
        t.signal(4);
        t.fail(3, cause(s, 3, "too late"));
        t.fail(0, cause(s, 0, "nothing"));
        assert_eq!(t.wait(3), Ok(()));
        assert_eq!(t.failure_of(3), None);
        assert_eq!(t.completed(), 4);
    }

    #[test]
    fn poison_fails_everything_not_completed() {
        let s = sid(0, 2);
        let t = Timeline::new(s);
        let c2 = cause(s, 2, "op failed");
        t.signal(1);
        t.fail(2, StdArc::clone(&c2));
        t.signal(3);
        let dead = cause(s, 4, "worker died");
        t.poison(StdArc::clone(&dead));
        // A second poison does not replace the cause.
        t.poison(cause(s, 9, "other"));
        assert_eq!(t.wait(1), Ok(()));
        assert!(StdArc::ptr_eq(&failed_with(t.wait(2)), &c2));
        assert_eq!(t.wait(3), Ok(()));
        for seq in [4, 5, 1000] {
            assert!(StdArc::ptr_eq(&failed_with(t.wait(seq)), &dead));
            assert!(StdArc::ptr_eq(&t.failure_of(seq).expect("poisoned"), &dead));
            assert!(!t.is_done(seq));
        }
        // Later signals advance the counter but cannot revive the failed ops.
        t.signal(5);
        t.fail(6, cause(s, 6, "ignored, poison wins"));
        assert_eq!(t.completed(), 6);
        assert!(t.is_done(5));
        assert!(StdArc::ptr_eq(&failed_with(t.wait(5)), &dead));
        assert!(StdArc::ptr_eq(&failed_with(t.wait(6)), &dead));
        assert_eq!(t.wait(3), Ok(()));
    }

    #[test]
    fn timeout_reports_the_event() {
        let t = Timeline::new(sid(0, 1));
        t.signal(4);
        let start = Instant::now();
        let err = t
            .wait_timeout(5, Duration::from_millis(40))
            .expect_err("must time out");
        let elapsed = start.elapsed();
        assert_eq!(
            err,
            Error::Timeout {
                what: "event d0s1#5".to_owned(),
                after: Duration::from_millis(40),
            }
        );
        assert!(elapsed >= Duration::from_millis(40), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
        // A deadline in the past: immediate timeout with `after` zero.
        let err = t
            .wait_deadline(5, Instant::now())
            .expect_err("must time out");
        assert!(matches!(err, Error::Timeout { after, .. } if after == Duration::ZERO));
        // A huge timeout does not overflow.
        assert_eq!(t.wait_timeout(4, Duration::MAX), Ok(()));
    }

    #[test]
    fn waiter_flag_is_cleared_after_waits() {
        let t = Timeline::new(sid(0, 0));
        let _ = t.wait_timeout(1, Duration::from_millis(1));
        // Relaxed: single-threaded test.
        assert_eq!(t.word.load(Ordering::Relaxed) & WAITERS, 0);
        let fut = Event::new(Arc::clone(&t), 1).wait_async();
        let mut fut = Box::pin(fut);
        let waker = Waker::from(StdArc::new(Flag::default()));
        let mut cx = Context::from_waker(&waker);
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        // Relaxed: single-threaded test.
        assert_ne!(t.word.load(Ordering::Relaxed) & WAITERS, 0);
        drop(fut);
        // Relaxed: single-threaded test.
        assert_eq!(t.word.load(Ordering::Relaxed) & WAITERS, 0);
        assert!(t.inner.lock().wakers.is_empty());
    }

    #[derive(Default)]
    struct Flag(AtomicBool);

    impl Wake for Flag {
        fn wake(self: StdArc<Self>) {
            // SeqCst: test code, keep it simple.
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn future_is_woken_by_signal_fail_and_poison() {
        let s = sid(2, 0);
        let t = Timeline::new(s);
        let flags: Vec<StdArc<Flag>> = (0..3).map(|_| StdArc::new(Flag::default())).collect();
        let mut futs: Vec<Pin<Box<EventFuture>>> = (1..=3)
            .map(|seq| Box::pin(Event::new(Arc::clone(&t), seq).wait_async()))
            .collect();
        for (fut, flag) in futs.iter_mut().zip(&flags) {
            let waker = Waker::from(StdArc::clone(flag));
            assert!(fut
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending());
        }
        let woken = |i: usize| flags[i].0.load(std::sync::atomic::Ordering::SeqCst);
        t.signal(1);
        assert!(woken(0) && !woken(1) && !woken(2));
        let c = cause(s, 2, "bad");
        t.fail(2, StdArc::clone(&c));
        assert!(woken(1) && !woken(2));
        let dead = cause(s, 3, "dead");
        t.poison(StdArc::clone(&dead));
        assert!(woken(2));
        let waker = Waker::from(StdArc::new(Flag::default()));
        let mut cx = Context::from_waker(&waker);
        assert_eq!(futs[0].as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        assert_eq!(
            futs[1].as_mut().poll(&mut cx),
            Poll::Ready(Err(Error::Failed(c)))
        );
        assert_eq!(
            futs[2].as_mut().poll(&mut cx),
            Poll::Ready(Err(Error::Failed(dead)))
        );
        assert!(t.inner.lock().wakers.is_empty());
    }

    #[test]
    fn future_ready_at_once_and_repolled() {
        let t = Timeline::new(sid(0, 0));
        t.signal(2);
        let mut fut = Box::pin(Event::new(Arc::clone(&t), 2).wait_async());
        let waker = Waker::from(StdArc::new(Flag::default()));
        let mut cx = Context::from_waker(&waker);
        assert_eq!(fut.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        // Polling again after completion keeps answering.
        assert_eq!(fut.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        assert_eq!(fut.event().seq(), 2);
    }

    #[test]
    fn event_identity_and_formatting() {
        let t1 = Timeline::new(sid(0, 1));
        let t1b = Timeline::new(sid(0, 1));
        let t2 = Timeline::new(sid(3, 0));
        let a = Event::new(Arc::clone(&t1), 5);
        assert_eq!(format!("{a:?}"), "d0s1#5");
        assert_eq!(a.to_string(), "d0s1#5");
        assert_eq!(a.stream(), sid(0, 1));
        assert_eq!(a.seq(), 5);
        assert!(Arc::ptr_eq(a.timeline(), &t1));
        // Equality is by (stream, seq).
        assert_eq!(a, Event::new(Arc::clone(&t1b), 5));
        assert_ne!(a, Event::new(Arc::clone(&t1), 6));
        assert_ne!(a, Event::new(Arc::clone(&t2), 5));
        // `Event` holds an `Arc<Timeline>` (interior mutability) but hashes only the
        // immutable (stream, seq): a safe key.
        #[allow(clippy::mutable_key_type)]
        let set: HashSet<Event> = [
            a.clone(),
            Event::new(t1b, 5),
            Event::new(Arc::clone(&t1), 6),
            Event::new(t2, 5),
        ]
        .into_iter()
        .collect();
        assert_eq!(set.len(), 3);
        assert!(!a.is_done());
        assert_eq!(a.status(), EventStatus::Pending);
        t1.signal(5);
        assert!(a.is_done());
        assert_eq!(a.wait(), Ok(()));
        assert_eq!(a.wait_timeout(Duration::ZERO), Ok(()));
        let dbg = format!("{:?}", *t1);
        assert!(dbg.contains("completed: 5"), "{dbg}");
    }

    #[test]
    fn blocked_waiter_woken_from_other_thread() {
        let t = Timeline::new(sid(0, 0));
        let t2 = Arc::clone(&t);
        let h = std::thread::spawn(move || t2.wait_timeout(3, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        t.signal(1);
        t.signal(3);
        assert_eq!(h.join().expect("waiter"), Ok(()));
        // Relaxed: the waiter was joined.
        assert_eq!(t.word.load(Ordering::Relaxed) & WAITERS, 0);
    }

    /// `lowest` follows the registrations: the lowest number waited for while someone
    /// waits (a blocked thread, an async waker), `u64::MAX` once nobody does; a signal below
    /// it leaves the waiters registered, one that reaches it releases them.
    #[test]
    fn lowest_tracks_the_lowest_registration() {
        let t = Timeline::new(sid(0, 0));
        // Relaxed: the test reads its own earlier stores, or waits for the other thread's.
        let lowest = |t: &Timeline| t.lowest.load(Ordering::Relaxed);
        assert_eq!(lowest(&t), u64::MAX);
        let t2 = Arc::clone(&t);
        let h = std::thread::spawn(move || t2.wait_timeout(5, Duration::from_secs(60)));
        while lowest(&t) != 5 {
            std::thread::yield_now();
        }
        let flag = StdArc::new(Flag::default());
        let waker = Waker::from(StdArc::clone(&flag));
        let woken = || flag.0.load(std::sync::atomic::Ordering::SeqCst);
        let mut fut = Box::pin(Event::new(Arc::clone(&t), 3).wait_async());
        assert!(fut
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        assert_eq!(lowest(&t), 3);
        t.signal(2);
        assert_eq!(lowest(&t), 3, "a signal below every waiter releases nobody");
        assert!(!woken());
        t.signal(3);
        assert!(woken(), "the waker was woken");
        assert_eq!(lowest(&t), 5, "the woken waker no longer counts");
        t.signal(4);
        assert_eq!(lowest(&t), 5, "the blocked thread still waits");
        t.signal(5);
        assert_eq!(h.join().expect("waiter"), Ok(()));
        assert_eq!(lowest(&t), u64::MAX);
        assert_eq!(t.word.load(Ordering::Relaxed) & WAITERS, 0);
    }

    #[test]
    fn max_seq_is_representable() {
        let t = Timeline::new(sid(0, 0));
        t.signal(MAX_SEQ);
        assert_eq!(t.completed(), MAX_SEQ);
        assert!(t.is_done(MAX_SEQ));
        assert!(!t.is_done(MAX_SEQ + 1));
    }
}
