//! Models of the event timeline (`src/event.rs`): wake-ups, "reaches or passes",
//! failures, poisoning, timeouts, async waiters and the publication of an operation's
//! effects to whoever observes its completion.

use std::{
    future::Future,
    sync::Arc as StdArc,
    task::{Context, Poll, Wake, Waker},
    time::Duration,
};

use tributary::{
    event::{Event, Timeline},
    pending::{CellPool, PendingEvent, Planned},
    sync::{thread, Arc, UnsafeCell},
    DeviceId, Error, Failure, StreamId,
};

use crate::harness::{builder, run_model};

fn sid() -> StreamId {
    StreamId {
        device: DeviceId(0),
        index: 1,
    }
}

fn cause(message: &str) -> StdArc<Failure> {
    StdArc::new(Failure {
        stream: sid(),
        seq: 1,
        operation: "op".into(),
        message: message.into(),
    })
}

fn is_failed_with(r: &Result<(), Error>, c: &StdArc<Failure>) -> bool {
    matches!(r, Err(Error::Failed(f)) if StdArc::ptr_eq(f, c))
}

/// A blocking waiter and a signal: the waiter must be woken (no lost wake-up).
#[test]
fn wait_vs_signal() {
    run_model("event::wait_vs_signal", builder(None), || {
        let t = Timeline::new(sid());
        let t2 = t.clone();
        let h = thread::spawn(move || t2.wait(1));
        t.signal(1);
        assert_eq!(h.join().unwrap(), Ok(()));
    });
}

/// Two waiters on different sequence numbers, two signals, the second one jumping past
/// the first waiter's number: both are released ("reaches or passes").
#[test]
fn reaches_or_passes() {
    run_model("event::reaches_or_passes", builder(Some(3)), || {
        let t = Timeline::new(sid());
        let (t2, t3) = (t.clone(), t.clone());
        let h2 = thread::spawn(move || t2.wait(2));
        let h1 = thread::spawn(move || t3.wait(1));
        t.signal(1);
        t.signal(3);
        assert_eq!(h2.join().unwrap(), Ok(()));
        assert_eq!(h1.join().unwrap(), Ok(()));
        assert_eq!(t.completed(), 3);
    });
}

/// A timed wait whose deadline has passed returns `Timeout` (or `Ok` if the signal won)
/// without blocking and leaves the timeline usable: a later wait is still woken. A timed
/// wait with a long deadline behaves like `wait` (loom has no clock: its condition
/// variable never times out, so this checks the wake-up path of `wait_until`).
#[test]
fn timeout_vs_signal() {
    run_model("event::timeout_vs_signal", builder(None), || {
        let t = Timeline::new(sid());
        let t2 = t.clone();
        let h = thread::spawn(move || {
            let expired = t2.wait_timeout(1, Duration::ZERO);
            let long = t2.wait_timeout(1, Duration::from_secs(3600));
            (expired, long)
        });
        t.signal(1);
        let (expired, long) = h.join().unwrap();
        assert!(
            matches!(expired, Ok(()) | Err(Error::Timeout { .. })),
            "{expired:?}"
        );
        assert_eq!(long, Ok(()));
    });
}

/// Data written by a "stream" before it signals is visible to anyone who observes the
/// completion, through the lock-free `is_done` as well as through `wait`.
#[test]
fn completion_publishes_data() {
    struct Data(UnsafeCell<u64>);
    // SAFETY: in this model the only write happens before `signal(1)` and every read
    // after observing event 1 complete; loom checks exactly that.
    unsafe impl Sync for Data {}

    run_model("event::completion_publishes_data", builder(None), || {
        let t = Timeline::new(sid());
        let data = Arc::new(Data(UnsafeCell::new(0)));
        let (t2, d2) = (t.clone(), data.clone());
        let h = thread::spawn(move || {
            // SAFETY: the readers below read only after the event (checked by loom).
            d2.0.with_mut(|p| unsafe { *p = 7 });
            t2.signal(1);
        });
        if t.is_done(1) {
            // SAFETY: ordered after the write by the Acquire load in `is_done`.
            assert_eq!(data.0.with(|p| unsafe { *p }), 7);
        }
        assert_eq!(t.wait(1), Ok(()));
        // SAFETY: ordered after the write by the wait.
        assert_eq!(data.0.with(|p| unsafe { *p }), 7);
        h.join().unwrap();
    });
}

/// Two blocking waiters and a signal: each waiter spins for a moment before it parks
/// (`Timeline::wait`, "Spinning before parking"), and loom runs the signal before, during
/// and after each one's spin, so one may see the completion while spinning (without
/// registering: the signal owes it no wake-up) while the other parks and must be woken;
/// both see the data written before the signal.
#[test]
fn spinning_and_parked_waiters_see_completion() {
    struct Data(UnsafeCell<u64>);
    // SAFETY: the only write happens before `signal(1)`, every read after a wait observed
    // event 1 complete; loom checks exactly that.
    unsafe impl Sync for Data {}

    run_model(
        "event::spinning_and_parked_waiters_see_completion",
        builder(Some(3)),
        || {
            let t = Timeline::new(sid());
            let data = Arc::new(Data(UnsafeCell::new(0)));
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let (t, data) = (t.clone(), data.clone());
                    thread::spawn(move || {
                        let waited = t.wait(1);
                        // SAFETY: ordered after the write by the wait (checked by loom).
                        let seen = data.0.with(|p| unsafe { *p });
                        (waited, seen)
                    })
                })
                .collect();
            // SAFETY: the waiters read only after the event (checked by loom).
            data.0.with_mut(|p| unsafe { *p = 7 });
            t.signal(1);
            for waiter in waiters {
                assert_eq!(waiter.join().unwrap(), (Ok(()), 7));
            }
        },
    );
}

/// A failure alone wakes every waiter of the failed operation (nothing else will) and
/// fails it with the root cause; the operation after it still succeeds.
#[test]
fn failure_wakes_and_fails_every_waiter() {
    run_model(
        "event::failure_wakes_and_fails_every_waiter",
        builder(Some(3)),
        || {
            let t = Timeline::new(sid());
            let c = cause("boom");
            let (t2, t3) = (t.clone(), t.clone());
            let h1 = thread::spawn(move || t2.wait(1));
            let h2 = thread::spawn(move || t3.wait(1));
            t.fail(1, c.clone());
            let a1 = h1.join().unwrap();
            let a2 = h2.join().unwrap();
            assert!(is_failed_with(&a1, &c), "{a1:?}");
            assert!(is_failed_with(&a2, &c), "{a2:?}");
            t.signal(2);
            assert_eq!(t.wait(2), Ok(()));
            assert!(is_failed_with(&t.wait(1), &c));
        },
    );
}

/// Poisoning wakes a waiter that nothing else would release and fails it; racing with a
/// signal of an earlier operation, that operation's answer is one of the two possible
/// ones and never changes afterwards.
#[test]
fn poison_vs_signal_vs_waiter() {
    run_model(
        "event::poison_vs_signal_vs_waiter",
        builder(Some(3)),
        || {
            let t = Timeline::new(sid());
            let dead = cause("dead");
            let (t2, t3) = (t.clone(), t.clone());
            let h = thread::spawn(move || (t2.wait(1), t2.wait(2)));
            let s = thread::spawn(move || t3.signal(1));
            t.poison(dead.clone());
            let (r1, r2) = h.join().unwrap();
            s.join().unwrap();
            assert!(is_failed_with(&r2, &dead), "{r2:?}");
            assert!(r1 == Ok(()) || is_failed_with(&r1, &dead), "{r1:?}");
            // Stable: asking again gives the same answer.
            assert_eq!(t.wait(1), r1);
        },
    );
}

struct Unparker(loom::thread::Thread);

impl Wake for Unparker {
    fn wake(self: StdArc<Self>) {
        self.0.unpark();
    }
}

/// Polls `f` to completion on the current loom thread, parking between polls.
fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = Box::pin(f);
    let waker = Waker::from(StdArc::new(Unparker(loom::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        loom::thread::park();
    }
}

/// An async waiter and a signal: the waker registered by `poll` is woken.
#[test]
fn async_vs_signal() {
    run_model("event::async_vs_signal", builder(None), || {
        let t = Timeline::new(sid());
        let e = Event::new(t.clone(), 1);
        let h = thread::spawn(move || block_on(e.wait_async()));
        t.signal(1);
        assert_eq!(h.join().unwrap(), Ok(()));
    });
}

/// An async and a blocking waiter of the same event, two signals.
#[test]
fn async_and_blocking_vs_two_signals() {
    run_model(
        "event::async_and_blocking_vs_two_signals",
        builder(Some(3)),
        || {
            let t = Timeline::new(sid());
            let e = Event::new(t.clone(), 2);
            let t2 = t.clone();
            let h = thread::spawn(move || block_on(e.wait_async()));
            let h2 = thread::spawn(move || t2.wait(2));
            t.signal(1);
            t.signal(2);
            assert_eq!(h.join().unwrap(), Ok(()));
            assert_eq!(h2.join().unwrap(), Ok(()));
        },
    );
}

/// Poisoning wakes and fails an async waiter.
#[test]
fn async_vs_poison() {
    run_model("event::async_vs_poison", builder(None), || {
        let t = Timeline::new(sid());
        let e = Event::new(t.clone(), 1);
        let h = thread::spawn(move || block_on(e.wait_async()));
        let c = cause("dead");
        t.poison(c.clone());
        let r = h.join().unwrap();
        assert!(is_failed_with(&r, &c), "{r:?}");
    });
}

/// A deferred event (a copy's reader, left in the source's tables) can be a cell's last
/// holder: the ticket and the promise are gone while another thread still reads the
/// event. Its cell comes back to the pool only when that thread drops it, so the next
/// operation never gets a cell that thread still reads (mutant `cell_reuse`: the cell is
/// emptied while the reader reads it, which then sees no decision, or the next operation's
/// decision).
#[test]
fn a_deferred_event_gives_its_cell_back_only_as_its_last_holder() {
    run_model(
        "event::a_deferred_event_gives_its_cell_back_only_as_its_last_holder",
        builder(None),
        || {
            let pool = CellPool::new();
            let t = Timeline::new(sid());
            let (ticket, promise) = PendingEvent::pooled(t.clone(), &pool);
            let reader = ticket.event();
            promise.resolve(Planned::At(1));
            drop(ticket);
            let h = thread::spawn(move || {
                let seq = reader.planned_seq();
                drop(reader);
                seq
            });
            let (next, promise) = PendingEvent::pooled(t, &pool);
            promise.resolve(Planned::At(2));
            assert_eq!(next.planned(), Some(Planned::At(2)));
            assert_eq!(
                h.join().unwrap(),
                Some(1),
                "the reader saw its own decision"
            );
        },
    );
}

/// A pending event's cell comes back to its pool only from its last holder: the ticket
/// waiting for its operation while the deciding thread resolves it always sees the
/// decision, and the next operation gets an empty cell (mutant `cell_reuse`: a cell
/// emptied while its ticket still reads it leaves the ticket waiting forever).
#[test]
fn pooled_cell_is_reused_only_by_its_last_holder() {
    run_model(
        "event::pooled_cell_is_reused_only_by_its_last_holder",
        builder(None),
        || {
            let pool = CellPool::new();
            let t = Timeline::new(sid());
            let (ticket, promise) = PendingEvent::pooled(t.clone(), &pool);
            let h = thread::spawn(move || promise.resolve(Planned::At(1)));
            assert_eq!(ticket.wait_planned(None), Some(Planned::At(1)));
            drop(ticket);
            h.join().unwrap();
            let (next, promise) = PendingEvent::pooled(t, &pool);
            assert_eq!(next.planned(), None, "a reused cell starts empty");
            promise.resolve(Planned::At(2));
            assert_eq!(next.planned(), Some(Planned::At(2)));
        },
    );
}
