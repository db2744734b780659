//! Models of the CPU stream queue (`src/backend/cpu.rs`, `cpu/pool.rs`, `cpu/stream.rs`),
//! on the real backend: its worker pool, locks, scheduling word and threads come from the
//! sync shim, so under loom the worker is a model thread and every hand-off is explored.
//! Every model runs on a pool of **one worker**, the case where a stream that held its
//! worker while waiting would deadlock the others.
//!
//! The contract checked: work accepted by `submit` runs, and its event completes only
//! after it ran (no lost work); work refused because the stream is shut down fails its
//! event (nobody waits forever), without making earlier operations look complete; and
//! `shutdown` drains what was accepted, then returns (no hang). A refused operation's event
//! fails only after its dependencies and the stream's earlier operations are decided, as
//! if it had waited for them (`src/protocol/unsubmitted.rs`): the tables prune everything
//! ordered before a completed event. On the pool: a stream whose head waits for another
//! stream gives its worker back (the other stream runs, then it does); a stream parked on
//! an event is woken when the event completes, whenever that happens; a stream's next plan
//! never overtakes its head; a failed data dependency fails the plan without running it.

use std::sync::Arc as StdArc;

use tributary::{
    backend::{
        cpu::{CpuBackend, CpuConfig},
        Backend, StreamQueue,
    },
    event::{Event, EventStatus},
    kernels::{Access, CpuKernel, Kernel},
    protocol::{ArgBinding, Dep, DepKind, GlobalLoc, Plan, StreamProgram, Work},
    sync::{thread, Arc, UnsafeCell},
    BufferLoc, DType, DeviceId, Error, Failure, PoolId, StreamId, Timeline,
};

use crate::harness::{builder, run_model};

const DEVICE: DeviceId = DeviceId(0);
const POOL: PoolId = PoolId(0);
/// Plans per stream a model may use (each writes its own word of the pool).
const SLOTS: u64 = 4;

/// How many times the kernel of a plan ran.
struct Runs(UnsafeCell<u32>);

// SAFETY: the cell is written by the kernel on the stream's worker and read only after
// the plan's event completed; loom checks that this order holds.
unsafe impl Sync for Runs {}
// SAFETY: as above (the cell only holds a `u32`).
unsafe impl Send for Runs {}

impl Runs {
    fn get(&self) -> u32 {
        // SAFETY: see the `Sync` impl; loom reports an unordered access.
        self.0.with(|p| unsafe { *p })
    }
}

/// One stream of a backend: its timeline and queue.
type Stream = (Arc<Timeline>, StdArc<dyn StreamQueue>);

/// `n` streams of a one-device CPU backend on a pool of one worker, with one 64-byte pool
/// for kernel arguments.
fn streams(n: u32) -> Vec<Stream> {
    let config = CpuConfig::default().with_workers(1);
    let backend = CpuBackend::with_config(DEVICE, 1, config).unwrap();
    backend.create_pool(DEVICE, POOL, 64, 64).unwrap();
    (0..n)
        .map(|index| {
            let sid = StreamId {
                device: DEVICE,
                index,
            };
            let timeline = Timeline::new(sid);
            // SAFETY: a fresh timeline, completed by this queue only; the plans submitted
            // are `counted`'s, each on its own word of the pool, made under
            // `Plan::from_parts`'s contract.
            let queue: StdArc<dyn StreamQueue> =
                StdArc::from(unsafe { backend.start_stream(sid, timeline.clone()) }.unwrap());
            (timeline, queue)
        })
        .collect()
}

/// A stream of a one-device CPU backend (one worker).
fn stream() -> Stream {
    streams(1).pop().unwrap()
}

/// Plan `seq` on `timeline`: a kernel that counts its runs in the returned cell.
fn counted(timeline: &Arc<Timeline>, seq: u64) -> (Plan, StdArc<Runs>) {
    counted_after(timeline, seq, Vec::new())
}

/// [`counted`], waiting for `deps` first (events of timelines no queue completes, which
/// the model signals itself; they stand for producers on other streams).
fn counted_after(timeline: &Arc<Timeline>, seq: u64, deps: Vec<Dep>) -> (Plan, StdArc<Runs>) {
    counted_reading(timeline, seq, deps, None)
}

/// [`counted_after`], whose kernel also reads `before`, the run count of a plan that must
/// have run first (its dependency, or its predecessor on the stream), and fails unless it
/// is 1. The read is a loom cell access: unordered with that plan's write, it is a
/// causality violation.
fn counted_reading(
    timeline: &Arc<Timeline>,
    seq: u64,
    deps: Vec<Dep>,
    before: Option<StdArc<Runs>>,
) -> (Plan, StdArc<Runs>) {
    assert!(seq < SLOTS, "model bug: too many plans on a stream");
    let runs = StdArc::new(Runs(UnsafeCell::new(0)));
    let r = runs.clone();
    let kernel = Kernel::Cpu(CpuKernel::new(move |_| {
        if let Some(before) = &before {
            let ran = before.get();
            if ran != 1 {
                return Err(format!("ran before the plan it must follow ({ran} runs)"));
            }
        }
        // SAFETY: see `Runs`.
        r.0.with_mut(|p| unsafe { *p += 1 });
        Ok(())
    }));
    let slot = u64::from(timeline.stream().index) * SLOTS + seq;
    let arg = ArgBinding::new(
        GlobalLoc {
            device: DEVICE,
            loc: BufferLoc {
                pool: POOL,
                offset: 4 * slot,
            },
        },
        4,
        DType::F32,
        [1].into(),
        Access::Write,
    );
    let work = Work::run(format!("counted#{seq}"), kernel, vec![arg], None);
    // SAFETY: `seq` is issued once, to this plan, on `timeline`, whose queue it is
    // submitted to; it needs no dependencies because no other plan touches its 4 bytes
    // (each plan writes its own word of the pool, by stream and sequence number), which
    // exist in the live pool `POOL`; `deps` only add waits.
    let plan = unsafe {
        Plan::from_parts(
            timeline.stream(),
            Event::new(timeline.clone(), seq),
            deps,
            work,
        )
    };
    (plan, runs)
}

/// Checks the outcome of one submission once its event is decided.
fn check(submitted: Result<(), Error>, waited: Result<(), Error>, runs: &Runs) {
    match submitted {
        Ok(()) => {
            assert_eq!(waited, Ok(()), "accepted work must succeed");
            assert_eq!(runs.get(), 1, "accepted work must run exactly once");
        }
        Err(e) => {
            assert!(matches!(e, Error::ShutDown(_)), "{e}");
            assert!(
                matches!(&waited, Err(Error::Failed(f)) if f.message.contains("shut down")),
                "refused work must fail its event, got {waited:?}"
            );
            assert_eq!(runs.get(), 0, "refused work must not run");
        }
    }
}

/// The owner submits two operations in order while another thread shuts the stream down:
/// every accepted operation runs before its event completes, every refused one fails its
/// event, and the owner's waits all return.
#[test]
fn submit_vs_shutdown() {
    run_model("queue::submit_vs_shutdown", builder(Some(3)), || {
        let (timeline, queue) = stream();
        let (p1, r1) = counted(&timeline, 1);
        let (p2, r2) = counted(&timeline, 2);
        let q = queue.clone();
        let owner = thread::spawn(move || {
            let e1 = p1.event().clone();
            let e2 = p2.event().clone();
            let s1 = q.submit(p1);
            let s2 = q.submit(p2);
            let w1 = e1.wait();
            check(s1, w1, &r1);
            let w2 = e2.wait();
            check(s2, w2, &r2);
        });
        queue.shutdown();
        owner.join().unwrap();
    });
}

/// Work queued before `shutdown` is drained, not dropped, even if the worker has not
/// started on it yet; `shutdown` returns only once it ran; a later submission is refused
/// and fails its event.
#[test]
fn shutdown_drains_queued_work() {
    run_model("queue::shutdown_drains_queued_work", builder(None), || {
        let (timeline, queue) = stream();
        let (p1, r1) = counted(&timeline, 1);
        let (p2, r2) = counted(&timeline, 2);
        let (e1, e2) = (p1.event().clone(), p2.event().clone());
        queue.submit(p1).unwrap();
        queue.shutdown();
        assert!(
            e1.is_done(),
            "shutdown returned before the queue was drained"
        );
        check(Ok(()), e1.wait(), &r1);
        let s2 = queue.submit(p2);
        check(s2, e2.wait(), &r2);
    });
}

/// A worker waiting for new work is woken by a submission (no lost wake-up in the
/// queue), and then by the shutdown.
#[test]
fn idle_worker_is_woken() {
    run_model("queue::idle_worker_is_woken", builder(None), || {
        let (timeline, queue) = stream();
        let (p1, r1) = counted(&timeline, 1);
        let e1 = p1.event().clone();
        thread::yield_now(); // let the worker reach its empty queue first, sometimes
        queue.submit(p1).unwrap();
        check(Ok(()), e1.wait(), &r1);
        queue.shutdown();
    });
}

/// A producer's event on another stream (a bare timeline the model signals itself).
fn producer() -> (Arc<Timeline>, Dep) {
    let other = Timeline::new(StreamId {
        device: DEVICE,
        index: 7,
    });
    let dep = Dep::new(Event::new(other.clone(), 1), DepKind::Data);
    (other, dep)
}

/// Work refused by a dead stream while a dependency of it still runs elsewhere: its event
/// fails, but only once the dependency completed (a waiter that sees it decided may reuse
/// what the dependency was still reading).
#[test]
fn refused_work_fails_after_its_dependencies() {
    run_model(
        "queue::refused_work_fails_after_its_dependencies",
        builder(None),
        || {
            let (timeline, queue) = stream();
            queue.shutdown();
            let (other, dep) = producer();
            let running = dep.event().clone();
            let (p1, r1) = counted_after(&timeline, 1, vec![dep]);
            let e1 = p1.event().clone();
            let finisher = thread::spawn(move || other.signal(1));
            let s1 = queue.submit(p1);
            let w1 = e1.wait();
            assert!(
                running.is_done(),
                "a refused operation's event was decided before its dependency completed"
            );
            check(s1, w1, &r1);
            finisher.join().unwrap();
        },
    );
}

/// Two refused operations, the first waiting for a producer on another stream: the second
/// is not decided before the first, so the first never looks successful (a failure
/// recorded for `seq` completes everything before it).
#[test]
fn refused_work_keeps_stream_order() {
    run_model(
        "queue::refused_work_keeps_stream_order",
        builder(Some(3)),
        || {
            let (timeline, queue) = stream();
            queue.shutdown();
            let (other, dep) = producer();
            let (p1, r1) = counted_after(&timeline, 1, vec![dep]);
            let (p2, r2) = counted(&timeline, 2);
            let (e1, e2) = (p1.event().clone(), p2.event().clone());
            let finisher = thread::spawn(move || other.signal(1));
            let s1 = queue.submit(p1);
            let s2 = queue.submit(p2);
            let w2 = e2.wait();
            assert!(
                matches!(e1.status(), EventStatus::Failed(_)),
                "operation 1 must be failed once operation 2 is decided, got {:?}",
                e1.status()
            );
            check(s2, w2, &r2);
            check(s1, e1.wait(), &r1);
            finisher.join().unwrap();
        },
    );
}

/// One worker, two streams, B's plan waiting for A's (a data dependency), B submitted
/// first: the worker takes B, finds its dependency pending, parks B on the event and runs
/// A, whose completion makes B ready again. A stream that held its worker while waiting
/// (the one-thread-per-stream design on a shared pool) deadlocks here.
#[test]
fn blocked_stream_on_one_worker() {
    run_model(
        "queue::blocked_stream_on_one_worker",
        builder(Some(3)),
        || {
            let mut both = streams(2);
            let (b, queue_b) = both.pop().unwrap();
            let (a, queue_a) = both.pop().unwrap();
            let (pa, ra) = counted(&a, 1);
            let dep = Dep::new(pa.event().clone(), DepKind::Data);
            let (pb, rb) = counted_reading(&b, 1, vec![dep], Some(ra.clone()));
            let (ea, eb) = (pa.event().clone(), pb.event().clone());
            queue_b.submit(pb).unwrap();
            queue_a.submit(pa).unwrap();
            check(Ok(()), eb.wait(), &rb);
            check(Ok(()), ea.wait(), &ra);
            queue_a.shutdown();
            queue_b.shutdown();
        },
    );
}

/// A stream parked on an event of another stream is woken when that event completes,
/// whenever the completion comes: before the worker polls the event, between its
/// registration and the worker giving the stream up (the stream is then still RUNNING:
/// the wake-up must make the worker look again), or after.
#[test]
fn parked_stream_is_woken() {
    run_model("queue::parked_stream_is_woken", builder(Some(3)), || {
        let (timeline, queue) = stream();
        let (other, dep) = producer();
        let (p1, r1) = counted_after(&timeline, 1, vec![dep]);
        let e1 = p1.event().clone();
        queue.submit(p1).unwrap();
        let finisher = thread::spawn(move || other.signal(1));
        check(Ok(()), e1.wait(), &r1);
        finisher.join().unwrap();
        queue.shutdown();
    });
}

/// A stream's second plan has no dependency of its own, but its head waits for another
/// stream: the second runs only after the head ran (in-order completion, DESIGN.md §5).
#[test]
fn next_plan_waits_for_its_head() {
    run_model(
        "queue::next_plan_waits_for_its_head",
        builder(Some(3)),
        || {
            let (timeline, queue) = stream();
            let (other, dep) = producer();
            let (p1, r1) = counted_after(&timeline, 1, vec![dep]);
            let (p2, r2) = counted_reading(&timeline, 2, Vec::new(), Some(r1.clone()));
            let (e1, e2) = (p1.event().clone(), p2.event().clone());
            queue.submit(p1).unwrap();
            queue.submit(p2).unwrap();
            let finisher = thread::spawn(move || other.signal(1));
            check(Ok(()), e2.wait(), &r2);
            check(Ok(()), e1.wait(), &r1);
            finisher.join().unwrap();
            queue.shutdown();
        },
    );
}

/// A plan whose data dependency fails (on another stream, while the plan is parked on
/// it) fails with the producer's root cause, without running; the stream keeps serving.
#[test]
fn failed_dependency_fails_the_plan_without_running_it() {
    run_model(
        "queue::failed_dependency_fails_the_plan_without_running_it",
        builder(Some(3)),
        || {
            let (timeline, queue) = stream();
            let (other, dep) = producer();
            let (p1, r1) = counted_after(&timeline, 1, vec![dep]);
            let (p2, r2) = counted(&timeline, 2);
            let (e1, e2) = (p1.event().clone(), p2.event().clone());
            queue.submit(p1).unwrap();
            queue.submit(p2).unwrap();
            let root = StdArc::new(Failure {
                stream: other.stream(),
                seq: 1,
                operation: "producer".into(),
                message: "failed".into(),
            });
            let cause = root.clone();
            let finisher = thread::spawn(move || other.fail(1, cause));
            assert!(
                matches!(e1.wait(), Err(Error::Failed(f)) if StdArc::ptr_eq(&f, &root)),
                "a failed data dependency must fail the plan with its root cause"
            );
            assert_eq!(r1.get(), 0, "a plan whose input failed must not run");
            check(Ok(()), e2.wait(), &r2);
            finisher.join().unwrap();
            queue.shutdown();
        },
    );
}

/// A replayed stream's program (DESIGN.md §4, "Compiled replays") on one worker: its first
/// operation waits for a plan of another stream submitted after it, its second for a
/// producer that a thread completes at any moment. The worker parks the program on each
/// wait (giving its worker to the other stream), resumes it at the operation it stopped
/// at, and runs every operation after its dependencies and its predecessor.
#[test]
fn program_runs_each_operation_after_its_dependencies() {
    run_model(
        "queue::program_runs_each_operation_after_its_dependencies",
        builder(Some(3)),
        || {
            let mut both = streams(2);
            let (b, queue_b) = both.pop().unwrap();
            let (a, queue_a) = both.pop().unwrap();
            let (pa, ra) = counted(&a, 1);
            let (other, late) = producer();
            let first = Dep::new(pa.event().clone(), DepKind::Data);
            let (pb1, rb1) = counted_reading(&b, 1, vec![first], Some(ra.clone()));
            let (pb2, rb2) = counted_reading(&b, 2, vec![late], Some(rb1.clone()));
            let (ea, eb1, eb2) = (pa.event().clone(), pb1.event().clone(), pb2.event().clone());
            let program = StreamProgram::from_plans([pb1, pb2]).unwrap();
            assert_eq!((program.first_seq(), program.len()), (1, 2));
            queue_b.submit_program(program).unwrap();
            queue_a.submit(pa).unwrap();
            let finisher = thread::spawn(move || other.signal(1));
            check(Ok(()), eb2.wait(), &rb2);
            check(Ok(()), eb1.wait(), &rb1);
            check(Ok(()), ea.wait(), &ra);
            finisher.join().unwrap();
            queue_a.shutdown();
            queue_b.shutdown();
        },
    );
}
