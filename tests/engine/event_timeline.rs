//! Event timelines across real threads: wake-ups, failures, poisoning, timeouts and async
//! waits (DESIGN.md §2 "Event", §3 rule 6).
#![cfg(not(tributary_loom))]

use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use tributary::event::{Event, EventStatus, Timeline};
use tributary::{DeviceId, Error, Failure, StreamId};

/// Generous bound for waits that must succeed: a lost wake-up fails the test instead of
/// hanging it.
const LONG: Duration = Duration::from_secs(20);

fn sid(device: u32, index: u32) -> StreamId {
    StreamId {
        device: DeviceId(device),
        index,
    }
}

fn cause(stream: StreamId, seq: u64, message: &str) -> Arc<Failure> {
    Arc::new(Failure {
        stream,
        seq,
        operation: "routine".to_owned(),
        message: message.to_owned(),
    })
}

fn failed_with(result: tributary::Result<()>) -> Arc<Failure> {
    match result {
        Err(Error::Failed(cause)) => cause,
        other => panic!("expected Error::Failed, got {other:?}"),
    }
}

/// A waker that unparks the thread running `block_on`, and records that it was used.
struct ThreadWaker {
    thread: thread::Thread,
    woken: AtomicBool,
}

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // SeqCst: test code; the flag is checked after unpark.
        self.woken.store(true, Ordering::SeqCst);
        self.thread.unpark();
    }
}

/// A tiny executor: polls `fut` on this thread, parking between polls; panics if it is not
/// ready within `limit` (so that a lost wake-up is a failure, not a hang). Returns the
/// output and whether the waker was ever woken.
fn block_on<F: Future>(fut: F, limit: Duration) -> (F::Output, bool) {
    let mut fut = pin!(fut);
    let waker_state = Arc::new(ThreadWaker {
        thread: thread::current(),
        woken: AtomicBool::new(false),
    });
    let waker = Waker::from(Arc::clone(&waker_state));
    let mut cx = Context::from_waker(&waker);
    let deadline = Instant::now() + limit;
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return (out, waker_state.woken.load(Ordering::SeqCst));
        }
        let now = Instant::now();
        assert!(now < deadline, "future not woken within {limit:?}");
        // Parking may return spuriously (or at once if unparked earlier): just poll again.
        thread::park_timeout(deadline - now);
    }
}

/// Polls all futures on this thread until every one is ready; outputs in order.
fn join_all<F: Future + Unpin>(mut futs: Vec<F>, limit: Duration) -> Vec<F::Output> {
    let waker_state = Arc::new(ThreadWaker {
        thread: thread::current(),
        woken: AtomicBool::new(false),
    });
    let waker = Waker::from(waker_state);
    let mut cx = Context::from_waker(&waker);
    let mut outs: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    let deadline = Instant::now() + limit;
    loop {
        for (fut, out) in futs.iter_mut().zip(outs.iter_mut()) {
            if out.is_none() {
                if let Poll::Ready(v) = Pin::new(fut).poll(&mut cx) {
                    *out = Some(v);
                }
            }
        }
        if outs.iter().all(Option::is_some) {
            return outs.into_iter().flatten().collect();
        }
        let now = Instant::now();
        assert!(now < deadline, "futures not all woken within {limit:?}");
        thread::park_timeout(deadline - now);
    }
}

/// Spins a little, so that the two sides of a race start in varying orders.
fn jitter(i: u64) {
    for _ in 0..(i.wrapping_mul(2654435761) % 512) {
        std::hint::spin_loop();
    }
}

#[test]
fn signal_then_wait_on_another_thread() {
    let t = Timeline::new(sid(0, 0));
    t.signal(1);
    let t2 = Arc::clone(&t);
    let got = thread::spawn(move || t2.wait_timeout(1, LONG))
        .join()
        .expect("waiter");
    assert_eq!(got, Ok(()));
}

#[test]
fn wait_then_signal_never_loses_the_wakeup() {
    for i in 0..2_000 {
        let t = Timeline::new(sid(0, 1));
        let t2 = Arc::clone(&t);
        let waiter = thread::spawn(move || t2.wait_timeout(1, LONG));
        jitter(i);
        t.signal(1);
        assert_eq!(waiter.join().expect("waiter"), Ok(()), "iteration {i}");
    }
}

#[test]
fn signalling_thread_racing_a_blocked_waiter() {
    // The signal comes from a spawned thread, the wait on the test thread.
    for i in 0..2_000 {
        let t = Timeline::new(sid(1, 0));
        let t2 = Arc::clone(&t);
        let signaller = thread::spawn(move || {
            jitter(i);
            t2.signal(2);
        });
        assert_eq!(t.wait_timeout(2, LONG), Ok(()), "iteration {i}");
        signaller.join().expect("signaller");
    }
}

#[test]
fn higher_signal_satisfies_lower_waits() {
    let t = Timeline::new(sid(0, 0));
    let waiters: Vec<_> = [3, 1, 10]
        .into_iter()
        .map(|seq| {
            let t = Arc::clone(&t);
            thread::spawn(move || t.wait_timeout(seq, LONG))
        })
        .collect();
    thread::sleep(Duration::from_millis(10));
    t.signal(10);
    for w in waiters {
        assert_eq!(w.join().expect("waiter"), Ok(()));
    }
    // A lower signal afterwards changes nothing.
    t.signal(5);
    assert_eq!(t.completed(), 10);
    assert!(t.is_done(10) && !t.is_done(11));
}

#[test]
fn many_waiters_on_many_seqs_all_woken() {
    const SEQS: u64 = 64;
    const THREADS: u64 = 8;
    let t = Timeline::new(sid(2, 3));
    let start = Arc::new(Barrier::new(THREADS as usize + 1));
    let waiters: Vec<_> = (0..THREADS)
        .map(|k| {
            let t = Arc::clone(&t);
            let start = Arc::clone(&start);
            thread::spawn(move || {
                start.wait();
                // Each thread waits on every THREADS-th seq, in increasing order, blocking
                // while the signaller advances one step at a time.
                let mut seen = 0;
                for seq in (1 + k..=SEQS).step_by(THREADS as usize) {
                    assert_eq!(t.wait_timeout(seq, LONG), Ok(()), "seq {seq}");
                    assert!(t.completed() >= seq);
                    seen += 1;
                }
                seen
            })
        })
        .collect();
    start.wait();
    for seq in 1..=SEQS {
        t.signal(seq);
        if seq % 4 == 0 {
            thread::yield_now();
        }
    }
    let total: u64 = waiters.into_iter().map(|w| w.join().expect("waiter")).sum();
    assert_eq!(total, SEQS);
}

#[test]
fn completion_publishes_the_operations_effects() {
    // The "backend" writes an output, then signals; a waiter that returns Ok must see it.
    for i in 0..500 {
        let t = Timeline::new(sid(0, 0));
        let output = Arc::new(AtomicU64::new(0));
        let (t2, out2) = (Arc::clone(&t), Arc::clone(&output));
        let backend = thread::spawn(move || {
            jitter(i);
            // Relaxed on purpose: the event must provide the ordering.
            out2.store(i + 1, Ordering::Relaxed);
            t2.signal(1);
        });
        assert_eq!(t.wait_timeout(1, LONG), Ok(()));
        // Relaxed on purpose: ordered by the wait.
        assert_eq!(output.load(Ordering::Relaxed), i + 1);
        backend.join().expect("backend");
    }
}

#[test]
fn failed_op_fails_its_waiters_with_the_same_cause() {
    let s = sid(0, 1);
    let t = Timeline::new(s);
    let c = cause(s, 2, "kernel panicked");
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let t = Arc::clone(&t);
            thread::spawn(move || t.wait_timeout(2, LONG))
        })
        .collect();
    let later = {
        let t = Arc::clone(&t);
        thread::spawn(move || t.wait_timeout(3, LONG))
    };
    thread::sleep(Duration::from_millis(10));
    t.signal(1);
    t.fail(2, Arc::clone(&c));
    for w in waiters {
        let got = failed_with(w.join().expect("waiter"));
        assert!(Arc::ptr_eq(&got, &c));
    }
    assert!(Arc::ptr_eq(&failed_with(t.wait(2)), &c));
    assert_eq!(t.wait(1), Ok(()));
    // The stream keeps serving after the failure.
    t.signal(3);
    assert_eq!(later.join().expect("waiter"), Ok(()));
    assert_eq!(t.status(3), EventStatus::Done);
    assert_eq!(t.status(2), EventStatus::Failed(Arc::clone(&c)));
    assert!(Arc::ptr_eq(&t.failure_of(2).expect("recorded"), &c));
}

#[test]
fn poison_fails_pending_and_future_waits_but_not_completed_ones() {
    let s = sid(1, 1);
    let t = Timeline::new(s);
    t.signal(2);
    let pending: Vec<_> = [3, 4, 50]
        .into_iter()
        .map(|seq| {
            let t = Arc::clone(&t);
            thread::spawn(move || t.wait_timeout(seq, LONG))
        })
        .collect();
    thread::sleep(Duration::from_millis(20));
    let dead = cause(s, 3, "worker thread died");
    t.poison(Arc::clone(&dead));
    for w in pending {
        assert!(Arc::ptr_eq(&failed_with(w.join().expect("waiter")), &dead));
    }
    // Completed before the poisoning: still fine.
    assert_eq!(t.wait(1), Ok(()));
    assert_eq!(t.wait(2), Ok(()));
    // Future waits fail at once, even untimed ones.
    let start = Instant::now();
    assert!(Arc::ptr_eq(&failed_with(t.wait(3)), &dead));
    assert!(Arc::ptr_eq(&failed_with(t.wait(1_000_000)), &dead));
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(t.status(4), EventStatus::Failed(Arc::clone(&dead)));
    assert!(Arc::ptr_eq(&t.failure_of(7).expect("poisoned"), &dead));
    assert_eq!(t.failure_of(2), None);
}

#[test]
fn poison_racing_signal_is_consistent() {
    // Whatever the interleaving, an op whose wait returned Ok never reports a failure later.
    for i in 0..1_000 {
        let s = sid(0, 0);
        let t = Timeline::new(s);
        let t2 = Arc::clone(&t);
        let signaller = thread::spawn(move || {
            for seq in 1..=4 {
                t2.signal(seq);
            }
        });
        jitter(i);
        t.poison(cause(s, 0, "died"));
        let results: Vec<_> = (1..=4).map(|seq| t.wait_timeout(seq, LONG)).collect();
        signaller.join().expect("signaller");
        // Ok for a prefix, then failures, and nothing changes afterwards.
        let oks = results.iter().take_while(|r| r.is_ok()).count();
        assert!(results[oks..].iter().all(Result::is_err), "{results:?}");
        for (seq, r) in (1..=4).zip(&results) {
            assert_eq!(&t.wait(seq), r, "iteration {i}, seq {seq}");
        }
    }
}

#[test]
fn timeout_returns_in_roughly_the_time() {
    let t = Timeline::new(sid(0, 1));
    t.signal(4);
    let t2 = Arc::clone(&t);
    let h = thread::spawn(move || {
        let start = Instant::now();
        let r = t2.wait_timeout(5, Duration::from_millis(100));
        (r, start.elapsed())
    });
    // Unrelated signals in the meantime do not end the wait early.
    thread::sleep(Duration::from_millis(20));
    t.signal(4);
    t.signal(3);
    let (r, elapsed) = h.join().expect("waiter");
    assert_eq!(
        r,
        Err(Error::Timeout {
            what: "event d0s1#5".to_owned(),
            after: Duration::from_millis(100),
        })
    );
    assert!(elapsed >= Duration::from_millis(100), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    // Event::wait_timeout and wait_deadline agree.
    let e = Event::new(Arc::clone(&t), 6);
    assert!(matches!(
        e.wait_timeout(Duration::from_millis(5)),
        Err(Error::Timeout { .. })
    ));
    let deadline = Instant::now() + Duration::from_millis(5);
    assert!(matches!(
        t.wait_deadline(6, deadline),
        Err(Error::Timeout { what, .. }) if what == "event d0s1#6"
    ));
    assert!(Instant::now() >= deadline);
    // After timing out, a later signal still satisfies a new wait.
    t.signal(6);
    assert_eq!(e.wait_timeout(LONG), Ok(()));
}

#[test]
fn async_wait_woken_from_another_thread() {
    let t = Timeline::new(sid(3, 0));
    let e = Event::new(Arc::clone(&t), 2);
    let t2 = Arc::clone(&t);
    let signaller = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        t2.signal(1);
        thread::sleep(Duration::from_millis(10));
        t2.signal(2);
    });
    let (out, woken) = block_on(e.wait_async(), LONG);
    assert_eq!(out, Ok(()));
    assert!(woken, "the future must have been woken by signal");
    signaller.join().expect("signaller");
}

#[test]
fn async_wait_never_loses_the_wakeup() {
    for i in 0..2_000 {
        let t = Timeline::new(sid(0, 0));
        let e = Event::new(Arc::clone(&t), 1);
        let t2 = Arc::clone(&t);
        let signaller = thread::spawn(move || {
            jitter(i);
            t2.signal(1);
        });
        let (out, _) = block_on(e.wait_async(), LONG);
        assert_eq!(out, Ok(()), "iteration {i}");
        signaller.join().expect("signaller");
    }
}

#[test]
fn async_waits_see_failures_and_poison() {
    let s = sid(0, 2);
    let t = Timeline::new(s);
    let futs: Vec<_> = (1..=4)
        .map(|seq| Event::new(Arc::clone(&t), seq).wait_async())
        .collect();
    let c = cause(s, 2, "bad op");
    let dead = cause(s, 3, "stream died");
    let (t2, c2, dead2) = (Arc::clone(&t), Arc::clone(&c), Arc::clone(&dead));
    let backend = thread::spawn(move || {
        thread::sleep(Duration::from_millis(20));
        t2.signal(1);
        t2.fail(2, c2);
        thread::sleep(Duration::from_millis(10));
        t2.poison(dead2);
    });
    let outs = join_all(futs, LONG);
    backend.join().expect("backend");
    assert_eq!(outs[0], Ok(()));
    assert!(Arc::ptr_eq(&failed_with(outs[1].clone()), &c));
    assert!(Arc::ptr_eq(&failed_with(outs[2].clone()), &dead));
    assert!(Arc::ptr_eq(&failed_with(outs[3].clone()), &dead));
}

#[test]
fn many_async_and_blocking_waiters_on_many_seqs() {
    const SEQS: u64 = 100;
    let t = Timeline::new(sid(1, 2));
    // Async waiters on one executor thread, blocking waiters on others, one signaller.
    let t_async = Arc::clone(&t);
    let executor = thread::spawn(move || {
        let futs: Vec<_> = (1..=SEQS)
            .rev()
            .map(|seq| Event::new(Arc::clone(&t_async), seq).wait_async())
            .collect();
        join_all(futs, LONG)
    });
    let blocking: Vec<_> = (0..4_u64)
        .map(|k| {
            let t = Arc::clone(&t);
            thread::spawn(move || {
                (1..=SEQS)
                    .filter(|seq| seq % 4 == k)
                    .map(|seq| t.wait_timeout(seq, LONG))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for seq in 1..=SEQS {
        t.signal(seq);
        if seq % 8 == 0 {
            thread::sleep(Duration::from_millis(1));
        }
    }
    let outs = executor.join().expect("executor");
    assert_eq!(outs.len() as u64, SEQS);
    assert!(outs.iter().all(Result::is_ok));
    for b in blocking {
        assert!(b.join().expect("waiter").iter().all(Result::is_ok));
    }
}

#[test]
fn dropping_a_pending_future_leaves_other_waiters_intact() {
    let t = Timeline::new(sid(0, 0));
    let e = Event::new(Arc::clone(&t), 1);
    // Register a future, then drop it before completion.
    {
        let mut fut = Box::pin(e.wait_async());
        let waker = Waker::from(Arc::new(ThreadWaker {
            thread: thread::current(),
            woken: AtomicBool::new(false),
        }));
        assert!(fut
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
    }
    let t2 = Arc::clone(&t);
    let signaller = thread::spawn(move || {
        thread::sleep(Duration::from_millis(20));
        t2.signal(1);
    });
    let (out, woken) = block_on(e.wait_async(), LONG);
    assert_eq!(out, Ok(()));
    assert!(woken);
    signaller.join().expect("signaller");
}
