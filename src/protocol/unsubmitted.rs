//! Failing a plan that will never run, without breaking the order of its event. See
//! DESIGN.md §5.
//!
//! Once an event completes, the tables forget everything ordered before it. So a plan refused
//! by a dead queue must fail its event only after its dependencies and its stream's previous
//! operation. Failing it at once could let a waiter, or a buffer's release, go on while a
//! dependency still runs.
//!
//! [`fail_when_ready`] never blocks the caller: a waker sits on the first pending event and
//! moves on to the next when it fires. Refused plans of one stream form a chain, so one
//! failure wakes the next. The outermost wake-up on the thread runs the chain as a
//! trampoline, not nested, so a long chain cannot overflow the stack.

use std::{
    cell::{Cell, RefCell},
    future::Future,
    pin::Pin,
    sync::Arc as StdArc,
    task::{Context, Poll, Wake, Waker},
};

use crate::{
    error::Failure,
    event::{Event, EventFuture, Timeline},
    sync::{thread::thread_local, Arc, Mutex},
};

// Not `const { … }` initialisers: loom's `thread_local!` does not accept them.
thread_local! {
    /// Whether this thread is already running deferred failures (then a wake-up is queued).
    #[allow(clippy::missing_const_for_thread_local)]
    static RUNNING: Cell<bool> = Cell::new(false);
    /// Deferred failures woken while this thread was running one.
    #[allow(clippy::missing_const_for_thread_local)]
    static WOKEN: RefCell<Vec<StdArc<DeferredFailure>>> = RefCell::new(Vec::new());
}

/// Fails operation `seq` of `timeline` with `failure` once every event in `deps` and
/// operation `seq - 1` of the same timeline are decided (completed, failed, or their
/// stream poisoned). Returns at once; the failure is recorded now if nothing is pending.
pub(crate) fn fail_when_ready(
    timeline: Arc<Timeline>,
    seq: u64,
    deps: impl IntoIterator<Item = Event>,
    failure: StdArc<Failure>,
) {
    let mut pending: Vec<Event> = deps.into_iter().collect();
    if seq > 1 && !mutant!("unsubmitted_out_of_order") {
        pending.push(Event::new(timeline.clone(), seq - 1));
    }
    if mutant!("unsubmitted_before_deps") {
        pending.clear();
    }
    let task = StdArc::new(DeferredFailure {
        state: Mutex::new(State {
            pending,
            waiting: None,
            done: false,
        }),
        timeline,
        seq,
        failure,
    });
    Wake::wake(task);
}

/// A failure waiting for the events before it.
struct DeferredFailure {
    state: Mutex<State>,
    timeline: Arc<Timeline>,
    seq: u64,
    failure: StdArc<Failure>,
}

struct State {
    /// Events not yet seen decided (checked from the back).
    pending: Vec<Event>,
    /// The registration on the event being waited for (dropping it unregisters the waker).
    waiting: Option<EventFuture>,
    /// The failure was recorded.
    done: bool,
}

impl DeferredFailure {
    /// Moves past every decided event; registers on the first pending one, or records the
    /// failure when none is left. Called once at the start and then by each wake-up.
    fn advance(self: &StdArc<Self>) {
        let waker = Waker::from(StdArc::clone(self));
        let mut cx = Context::from_waker(&waker);
        let mut state = self.state.lock();
        if state.done {
            return;
        }
        loop {
            let fut = match state.waiting.as_mut() {
                Some(fut) => fut,
                None => match state.pending.pop() {
                    Some(event) => state.waiting.insert(event.wait_async()),
                    None => break,
                },
            };
            // Ready with either outcome: a failed or poisoned dependency is decided too.
            match Pin::new(fut).poll(&mut cx) {
                Poll::Ready(_) => state.waiting = None,
                // The waker is registered; a completion re-enters `advance`, which waits for
                // the lock we hold, then polls again.
                Poll::Pending => return,
            }
        }
        state.done = true;
        drop(state);
        self.timeline.fail(self.seq, StdArc::clone(&self.failure));
    }
}

impl Wake for DeferredFailure {
    fn wake(self: StdArc<Self>) {
        if RUNNING.with(Cell::get) {
            // Recording our failure would wake the next in the chain, nested: queue it for
            // the loop below, which is running further up this thread's stack.
            WOKEN.with(|woken| woken.borrow_mut().push(self));
            return;
        }
        RUNNING.with(|running| running.set(true));
        self.advance();
        // Each borrow is released before `advance`, which may queue more.
        while let Some(next) = WOKEN.with(|woken| woken.borrow_mut().pop()) {
            next.advance();
        }
        RUNNING.with(|running| running.set(false));
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;
    use crate::{error::Error, event::EventStatus, DeviceId, StreamId};

    fn sid(index: u32) -> StreamId {
        StreamId {
            device: DeviceId(0),
            index,
        }
    }

    fn failure(stream: StreamId, seq: u64) -> StdArc<Failure> {
        StdArc::new(Failure {
            stream,
            seq,
            operation: "refused".into(),
            message: "stream is shut down".into(),
        })
    }

    #[test]
    fn fails_only_after_every_dependency_completed() {
        let dead = Timeline::new(sid(0));
        let (a, b) = (Timeline::new(sid(1)), Timeline::new(sid(2)));
        let deps = [Event::new(a.clone(), 2), Event::new(b.clone(), 1)];
        fail_when_ready(dead.clone(), 1, deps, failure(sid(0), 1));
        assert_eq!(dead.status(1), EventStatus::Pending);
        a.signal(2);
        assert_eq!(dead.status(1), EventStatus::Pending, "b#1 is still running");
        b.fail(1, failure(sid(2), 1));
        assert!(
            matches!(dead.status(1), EventStatus::Failed(f) if f.message.contains("shut down")),
            "{:?}",
            dead.status(1)
        );
    }

    #[test]
    fn fails_only_after_the_previous_operation_of_its_stream() {
        let dead = Timeline::new(sid(0));
        let other = Timeline::new(sid(1));
        fail_when_ready(
            dead.clone(),
            1,
            [Event::new(other.clone(), 1)],
            failure(sid(0), 1),
        );
        fail_when_ready(dead.clone(), 2, [], failure(sid(0), 2));
        // Failing 2 now would advance the counter past 1 and report 1 as successful.
        assert_eq!(dead.status(2), EventStatus::Pending);
        assert_eq!(dead.status(1), EventStatus::Pending);
        other.signal(1);
        assert!(matches!(dead.status(1), EventStatus::Failed(_)));
        assert!(matches!(dead.status(2), EventStatus::Failed(_)));
        assert!(matches!(
            Event::new(dead.clone(), 1).wait(),
            Err(Error::Failed(_))
        ));
    }

    #[test]
    fn fails_at_once_when_nothing_is_pending() {
        let dead = Timeline::new(sid(0));
        let done = Timeline::new(sid(1));
        done.signal(3);
        fail_when_ready(dead.clone(), 1, [Event::new(done, 3)], failure(sid(0), 1));
        assert!(matches!(dead.status(1), EventStatus::Failed(_)));
    }

    #[test]
    fn a_long_chain_of_refused_plans_fails_without_nesting() {
        let dead = Timeline::new(sid(0));
        let other = Timeline::new(sid(1));
        const N: u64 = 200_000;
        fail_when_ready(
            dead.clone(),
            1,
            [Event::new(other.clone(), 1)],
            failure(sid(0), 1),
        );
        for seq in 2..=N {
            fail_when_ready(dead.clone(), seq, [], failure(sid(0), seq));
        }
        assert_eq!(dead.completed(), 0);
        // One completion releases the whole chain; nested wake-ups would overflow the
        // stack of this (2 MiB) test thread long before 200,000.
        other.signal(1);
        assert_eq!(dead.completed(), N);
        assert!(matches!(dead.status(N / 2), EventStatus::Failed(_)));
    }

    #[test]
    fn a_poisoned_dependency_counts_as_decided() {
        let dead = Timeline::new(sid(0));
        let lost = Timeline::new(sid(1));
        fail_when_ready(
            dead.clone(),
            1,
            [Event::new(lost.clone(), 1)],
            failure(sid(0), 1),
        );
        lost.poison(failure(sid(1), 1));
        assert!(matches!(dead.status(1), EventStatus::Failed(_)));
    }
}
