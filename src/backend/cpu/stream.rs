//! One CPU stream as a task of the worker pool: a FIFO of submitted plans that one worker at
//! a time runs, and that parks on a dependency instead of holding a worker. How this keeps
//! the backend contract on a shared pool is in DESIGN.md §5, "The CPU worker model".
//!
//! # Ownership: one worker at a time
//!
//! The stream's `state` word says who may run it:
//!
//! ```text
//!   IDLE ──schedule──▶ SCHEDULED (in the ready queue) ──a worker pops it──▶ RUNNING
//!    ▲                                                                       │  │
//!    └──────── nothing to do (queue empty, or head parked on an event) ──────┘  │ schedule
//!              compare-and-swap RUNNING → IDLE; fails if NOTIFIED: run again   ▼
//!                                                                         NOTIFIED
//! ```
//!
//! `schedule` comes from a submission or from the waker of the head's event. It moves an
//! idle stream to the ready queue, or marks a running one NOTIFIED. The worker gives the
//! stream up only by a compare-and-swap from RUNNING. So a wake-up that arrives while the
//! worker runs the stream makes it look again instead of being lost. Checked by
//! `parked_stream_is_woken` in `loom_tests/queue.rs`; mutant `pool_lost_wake`.
//!
//! A failed data dependency fails the head without running it, but only once the other
//! dependencies are decided too; see [`Dep::failure`].
//!
//! A panic that escapes `catch_unwind` kills the stream, not the pool's worker. The
//! timeline is poisoned with "stream worker died", the queued plans fail with it, and later
//! submissions are refused.

use std::{
    any::Any,
    collections::VecDeque,
    future::Future,
    panic::{catch_unwind, AssertUnwindSafe},
    pin::Pin,
    sync::Arc as StdArc,
    task::{Context, Poll, Wake, Waker},
    time::Instant,
};

use crate::{
    error::{Error, Failure, Result},
    event::{EventFuture, EventStatus, Timeline},
    ids::StreamId,
    protocol::{Dep, StreamProgram, StreamProgramOp, Work},
    sync::{
        atomic::{AtomicUsize, Ordering},
        spin::SpinWait,
        Arc as SyncArc, Mutex,
    },
    trace::{Recorder, TraceKind, TraceRecord},
};

use super::{pool::WorkerPool, Ready, Shared, Submitted};

/// Not ready, not running: nothing to do, or the head waits with a waker registered.
const IDLE: usize = 0;
/// In the pool's ready queue.
const SCHEDULED: usize = 1;
/// A worker runs it.
const RUNNING: usize = 2;
/// A worker runs it and something happened meanwhile: look again before giving it up.
const NOTIFIED: usize = 3;

/// What a worker does with a stream after running it for a while.
enum Outcome {
    /// Nothing to do: give it up (unless notified meanwhile).
    Idle,
    /// Ran a plan while other streams wait: to the back of the ready queue.
    Yield,
}

/// What a stream accepts: a plan, or a replayed stream's program (run in place, one
/// operation after the other, as its plans would be).
// Both held inline: a plan (~460 bytes: its work and dependencies) is resolved only when it
// runs, and boxing it would allocate per issued operation (DESIGN.md, "Issuing without
// allocation"); a program (~150 bytes) keeps its lists where its step reuses them.
#[allow(clippy::large_enum_variant)]
pub(super) enum Item {
    Plan(Submitted),
    StreamProgram(StreamProgram),
}

impl Item {
    /// The sequence number of its last operation.
    fn last_seq(&self) -> u64 {
        match self {
            Item::Plan(p) => p.seq,
            Item::StreamProgram(p) => p.last_seq(),
        }
    }
}

/// Plans and programs accepted and not yet taken by a worker.
struct Incoming {
    items: VecDeque<Item>,
    /// No more plans are accepted (shut down, or the stream died).
    closed: bool,
    /// Highest sequence number accepted.
    last_accepted: u64,
}

/// The plan or program at the head of the stream, while the dependencies of its current
/// operation are decided.
struct Head {
    item: Item,
    /// The operation of a program that runs next (0 for a plan).
    op: usize,
    /// How far the current operation's dependencies are decided.
    progress: Progress,
}

/// What the head's current operation learned of its dependencies so far.
#[derive(Default)]
struct Progress {
    /// Dependencies before this index are decided.
    next_dep: usize,
    /// Root cause of the first failed data dependency.
    failed: Option<StdArc<Failure>>,
    /// The registration on the pending dependency `next_dep`, while the stream is parked.
    waiting: Option<EventFuture>,
    /// When the head found `next_dep` pending (recorded as a wait when it is decided).
    blocked_since: Option<Instant>,
}

/// The head's current operation as its dependencies are decided: borrowed from its plan or
/// program.
#[derive(Clone, Copy)]
struct Current<'a> {
    deps: &'a [Dep],
    seq: u64,
    work: &'a Work,
}

impl<'a> Current<'a> {
    fn of_plan(plan: &'a Submitted) -> Current<'a> {
        Current {
            deps: &plan.deps,
            seq: plan.seq,
            work: &plan.work,
        }
    }

    fn of_op(op: &StreamProgramOp<'a>) -> Current<'a> {
        Current {
            deps: op.deps(),
            seq: op.seq(),
            work: op.work(),
        }
    }
}

/// A stream of the CPU backend, run by a [`WorkerPool`].
pub(super) struct StreamTask {
    stream: StreamId,
    timeline: SyncArc<Timeline>,
    pool: StdArc<WorkerPool>,
    /// The backend's pools, against which a program's operations are resolved when they
    /// run.
    shared: StdArc<Shared>,
    recorder: Option<StdArc<Recorder>>,
    incoming: Mutex<Incoming>,
    /// `IDLE`, `SCHEDULED`, `RUNNING` or `NOTIFIED` (module documentation).
    state: AtomicUsize,
    /// The head plan; touched only by the worker that owns the stream (never contended).
    head: Mutex<Option<Head>>,
}

impl StreamTask {
    pub(super) fn new(
        stream: StreamId,
        timeline: SyncArc<Timeline>,
        pool: StdArc<WorkerPool>,
        shared: StdArc<Shared>,
        recorder: Option<StdArc<Recorder>>,
    ) -> StdArc<StreamTask> {
        StdArc::new(StreamTask {
            stream,
            timeline,
            pool,
            shared,
            recorder,
            incoming: Mutex::new(Incoming {
                items: VecDeque::new(),
                closed: false,
                last_accepted: 0,
            }),
            state: AtomicUsize::new(IDLE),
            head: Mutex::new(None),
        })
    }

    /// Accepts `item` (the stream will run it; `None`), or gives it back if the stream no
    /// longer accepts work. Never waits for work. Inlined into the submission, so the item
    /// is built where it is pushed from.
    #[inline]
    pub(super) fn push(self: &StdArc<Self>, item: Item) -> Option<Item> {
        let mut incoming = self.incoming.lock();
        if incoming.closed {
            return Some(item);
        }
        incoming.last_accepted = incoming.last_accepted.max(item.last_seq());
        incoming.items.push_back(item);
        drop(incoming);
        self.schedule();
        None
    }

    /// Stops accepting work; returns the highest sequence number accepted (0: none), after
    /// which nothing more is accepted.
    pub(super) fn close(&self) -> u64 {
        let mut incoming = self.incoming.lock();
        incoming.closed = true;
        incoming.last_accepted
    }

    /// Makes the stream ready if it is idle, or tells the worker running it to look again.
    fn schedule(self: &StdArc<Self>) {
        // Acquire (and AcqRel below): the word hands the stream from worker to worker; the
        // data it guards is under locks of its own, so this is belt and braces.
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            let next = match current {
                IDLE => SCHEDULED,
                RUNNING => NOTIFIED,
                _ => return,
            };
            match self.state.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    if current == IDLE {
                        self.pool.enqueue(self.clone());
                    }
                    return;
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// Runs the stream on the calling worker (which took it from the ready queue) until it
    /// has nothing to do or yields to other ready streams.
    pub(super) fn run(self: &StdArc<Self>) {
        // AcqRel: see `schedule`. Only the worker that popped a SCHEDULED stream writes it
        // while it is SCHEDULED (`schedule` leaves that state alone).
        let was = self.state.swap(RUNNING, Ordering::AcqRel);
        debug_assert_eq!(was, SCHEDULED, "a stream ran without being scheduled");
        loop {
            let outcome = match catch_unwind(AssertUnwindSafe(|| self.drain())) {
                Ok(outcome) => outcome,
                Err(payload) => {
                    self.die(payload);
                    Outcome::Idle
                }
            };
            match outcome {
                Outcome::Yield => {
                    // AcqRel: see `schedule`.
                    self.state.swap(SCHEDULED, Ordering::AcqRel);
                    self.pool.enqueue(self.clone());
                    return;
                }
                Outcome::Idle => {
                    if mutant!("pool_lost_wake") {
                        // Release: the mutant gives the stream up unconditionally.
                        self.state.store(IDLE, Ordering::Release);
                        return;
                    }
                    // AcqRel/Acquire: see `schedule`.
                    match self.state.compare_exchange(
                        RUNNING,
                        IDLE,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => return,
                        // NOTIFIED: something arrived while we ran; look again.
                        Err(_) => {
                            // AcqRel: see `schedule`.
                            self.state.swap(RUNNING, Ordering::AcqRel);
                        }
                    }
                }
            }
        }
    }

    /// Runs head plans while their dependencies are decided.
    fn drain(self: &StdArc<Self>) -> Outcome {
        let mut head = self.head.lock();
        let mut skipped = false;
        loop {
            if head.is_none() {
                // Taken straight into the head (an item is several hundred bytes, each move
                // a copy).
                *head = self.incoming.lock().items.pop_front().map(Head::new);
            }
            let Some(current) = head.as_mut() else {
                return Outcome::Idle;
            };
            let Head { item, op, progress } = current;
            // A program's operation is looked up once per pass (its `op` is several
            // bounds-checked lookups): for its dependencies, then its run.
            let (program, this) = match &*item {
                Item::Plan(p) => (None, Current::of_plan(p)),
                Item::StreamProgram(p) => match p.op(*op) {
                    Some(o) => (Some((p, o)), Current::of_op(&o)),
                    None => {
                        *head = None;
                        continue;
                    }
                },
            };
            // The mutant runs a program's operations without waiting for anything.
            let skips = program.is_some() && mutant!("program_skips_deps");
            if !skips && !self.deps_decided(this, progress) {
                if mutant!("pool_out_of_order") && !skipped {
                    // The mutant lets a later plan overtake a head that waits.
                    skipped = true;
                    let mut incoming = self.incoming.lock();
                    if let Some(next) = incoming.items.pop_front() {
                        if let Some(blocked) = head.replace(Head::new(next)) {
                            incoming.items.push_front(blocked.item);
                        }
                        drop(incoming);
                        continue;
                    }
                }
                return Outcome::Idle;
            }
            if let Some((program, o)) = program {
                // An operation that could not be planned (its copy's source did not answer)
                // fails with its own reason, after its dependencies.
                let unplanned = o.failed();
                let failed = progress.failed.take().filter(|_| unplanned.is_none());
                let label = o.work().plan_label();
                let ready = Ready {
                    label: &label,
                    seq: o.seq(),
                    deps: o.deps(),
                };
                let run = || match unplanned {
                    Some(why) => Err(why.to_string()),
                    None => self.shared.run_work(o.work(), o.bindings()),
                };
                super::complete(
                    self.stream,
                    &self.timeline,
                    ready,
                    || o.work().bytes(),
                    run,
                    failed,
                    self.recorder.as_deref(),
                );
                *op += 1;
                *progress = Progress::default();
                if *op >= program.len() {
                    *head = None;
                }
            } else if let Some(Head {
                item: Item::Plan(item),
                progress,
                ..
            }) = head.take()
            {
                let label = item.work.plan_label();
                let ready = Ready {
                    label: &label,
                    seq: item.seq,
                    deps: &item.deps,
                };
                super::complete(
                    self.stream,
                    &self.timeline,
                    ready,
                    || item.work.bytes(),
                    || self.shared.run_work(&item.work, None),
                    progress.failed,
                    self.recorder.as_deref(),
                );
            }
            if self.pool.others_ready() {
                return Outcome::Yield;
            }
        }
    }

    /// Decides the current operation's dependencies in order, from where `progress` says;
    /// `false` when one is still pending after the spin window (a waker is then registered
    /// on it).
    fn deps_decided(self: &StdArc<Self>, this: Current<'_>, progress: &mut Progress) -> bool {
        let Progress {
            next_dep,
            failed,
            waiting,
            blocked_since,
        } = progress;
        loop {
            let Some(dep) = this.deps.get(*next_dep) else {
                return true;
            };
            let outcome = match waiting.as_mut() {
                Some(waiting) => match self.poll(waiting) {
                    Poll::Ready(outcome) => outcome,
                    Poll::Pending => return false,
                },
                None => match self.settle(dep, blocked_since) {
                    Some(outcome) => outcome,
                    None if mutant!("pool_blocking_wait") => {
                        // The mutant holds the worker until the dependency completes.
                        dep.event().wait()
                    }
                    None => {
                        let waiting = waiting.insert(dep.event().wait_async());
                        match self.poll(waiting) {
                            Poll::Ready(outcome) => outcome,
                            Poll::Pending => return false,
                        }
                    }
                },
            };
            *waiting = None;
            if let (Some(since), Some(rec)) = (blocked_since.take(), &self.recorder) {
                rec.record(TraceRecord {
                    kind: TraceKind::Wait,
                    name: this.work.label(),
                    stream: self.stream,
                    seq: this.seq,
                    start_ns: rec.ns(since),
                    end_ns: rec.ns(Instant::now()),
                    bytes: 0,
                    waited_for: Some((dep.event().stream(), dep.event().seq())),
                    after: Vec::new(),
                    ok: outcome.is_ok(),
                });
            }
            if let Some(root) = dep.failure(&outcome) {
                failed.get_or_insert(root);
            }
            *next_dep += 1;
        }
    }

    /// The outcome of `dep` if it is decided now, or within the spin window while no
    /// other stream is ready; `None` if it is still pending then. Notes in
    /// `blocked_since` when it was first found pending (for the trace).
    fn settle(&self, dep: &Dep, blocked_since: &mut Option<Instant>) -> Option<Result<()>> {
        let decided = || match dep.event().status() {
            EventStatus::Pending => None,
            EventStatus::Done => Some(Ok(())),
            EventStatus::Failed(cause) => Some(Err(Error::Failed(cause))),
        };
        if let Some(outcome) = decided() {
            return Some(outcome);
        }
        if self.recorder.is_some() {
            *blocked_since = Some(Instant::now());
        }
        let mut spin = SpinWait::new(self.pool.spin());
        while !self.pool.others_ready() && spin.spin() {
            if let Some(outcome) = decided() {
                return Some(outcome);
            }
        }
        None
    }

    /// Polls the registration on a pending dependency with this stream as the waker.
    fn poll(self: &StdArc<Self>, waiting: &mut EventFuture) -> Poll<Result<()>> {
        let waker = Waker::from(self.clone());
        Pin::new(waiting).poll(&mut Context::from_waker(&waker))
    }

    /// A panic escaped a plan's `catch_unwind`: the stream dies as if its own thread had
    /// (module documentation), and the worker goes on.
    fn die(&self, payload: Box<dyn Any + Send>) {
        tracing::error!(stream = %self.stream, "stream worker died");
        self.timeline.poison(StdArc::new(Failure {
            stream: self.stream,
            seq: self.timeline.completed() + 1,
            operation: "worker".into(),
            message: "stream worker died".into(),
        }));
        let queued = {
            let mut incoming = self.incoming.lock();
            incoming.closed = true;
            std::mem::take(&mut incoming.items)
        };
        let head = self.head.lock().take();
        drop_quietly(Box::new((queued, head)));
        drop_quietly(payload);
    }
}

impl Head {
    fn new(item: Item) -> Head {
        Head {
            item,
            op: 0,
            progress: Progress::default(),
        }
    }
}

/// The waker of a parked stream: the event it waits for completed.
impl Wake for StreamTask {
    fn wake(self: StdArc<Self>) {
        self.schedule();
    }

    fn wake_by_ref(self: &StdArc<Self>) {
        self.schedule();
    }
}

/// Drops `value`, catching any panic its drop raises, and the panics that dropping those
/// payloads raises in turn (fault injection's worker killer resumes unwinding from its
/// drop until it is told the operation failed; the last one drops quietly).
fn drop_quietly(value: Box<dyn Any + Send>) {
    let mut next = Some(value);
    while let Some(value) = next.take() {
        if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(value))) {
            next = Some(again);
        }
    }
}
