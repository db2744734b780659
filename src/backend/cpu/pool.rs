//! The CPU backend's worker pool: streams multiplexed on about one thread per core. It
//! replaced a thread per stream, which woke a futex for every small plan (issue 18). The
//! model is in DESIGN.md §5, "The CPU worker model". This file keeps these invariants:
//!
//! - No lost wake-up. The ready queue, the parked and spinning counts and the stop flag live
//!   under one mutex. A worker parks only after it found the queue empty under that lock,
//!   and counts itself parked under it. [`WorkerPool::enqueue`] pushes and reads the counts
//!   under it too. Checked by `idle_worker_is_woken` in `loom_tests/queue.rs`; mutant
//!   `pool_lost_notify`.
//! - `enqueue` skips the notify while a worker spins. That is safe because a spinner checks
//!   the queue again under the lock before it parks.
//! - A worker that takes a stream while more are queued wakes a parked worker, so a burst
//!   spreads over the pool.
//! - When the last stream shuts down, the workers drain the ready queue and are joined. For
//!   `shutdown_within` the join has a deadline, and a worker stuck in a kernel is detached.
//!   A backend that starts streams again gets a new pool.

use std::{
    cell::Cell,
    collections::VecDeque,
    sync::Arc as StdArc,
    time::{Duration, Instant},
};

use crate::{
    error::DeviceError,
    sync::{
        atomic::{AtomicUsize, Ordering},
        spin::SpinWait,
        thread::{self, thread_local, JoinHandle},
        Condvar, Mutex,
    },
};

use super::stream::StreamTask;

// Not `const { … }`: loom's `thread_local!` does not accept it.
thread_local! {
    /// The address of the pool this thread works for (0: none), so that a pool is never
    /// asked to join the thread that is stopping it.
    #[allow(clippy::missing_const_for_thread_local)]
    static WORKER_OF: Cell<usize> = Cell::new(0);
}

/// A set of worker threads running ready streams.
pub(super) struct WorkerPool {
    spin: Duration,
    ready: Mutex<Ready>,
    /// Notified when a stream becomes ready for a parked worker, or the pool stops.
    wake: Condvar,
    /// `ready.queue.len()`, readable without the lock: what spinners poll, and what tells a
    /// running stream that others wait for a worker.
    ready_hint: AtomicUsize,
    lifecycle: Mutex<Lifecycle>,
    /// Notified when a worker exits.
    exited: Condvar,
}

struct Ready {
    queue: VecDeque<StdArc<StreamTask>>,
    /// Workers waiting on `wake`.
    parked: usize,
    /// Workers spinning for a ready stream; each re-checks `queue` under the lock before
    /// it parks.
    spinning: usize,
    /// The pool is stopping: workers exit once the queue is empty.
    stop: bool,
}

struct Lifecycle {
    /// Streams attached (started and not shut down).
    streams: usize,
    /// The last stream left; the pool takes no new ones.
    stopped: bool,
    threads: Vec<JoinHandle<()>>,
    /// Workers that have not exited yet.
    running: usize,
}

impl WorkerPool {
    /// Starts `workers` threads named `name-<i>`, with one stream (the caller's) attached.
    pub(super) fn start(
        name: &str,
        workers: usize,
        spin: Duration,
    ) -> Result<StdArc<WorkerPool>, DeviceError> {
        let pool = StdArc::new(WorkerPool {
            spin,
            ready: Mutex::new(Ready {
                queue: VecDeque::new(),
                parked: 0,
                spinning: 0,
                stop: false,
            }),
            wake: Condvar::new(),
            ready_hint: AtomicUsize::new(0),
            lifecycle: Mutex::new(Lifecycle {
                streams: 1,
                stopped: false,
                threads: Vec::new(),
                running: workers,
            }),
            exited: Condvar::new(),
        });
        for i in 0..workers {
            let worker = pool.clone();
            let builder = thread::Builder::new().name(format!("{name}-{i}"));
            // A loom model thread runs on a 32 KiB coroutine stack; a worker's frames hold a
            // plan or a resolved job inline (~800 bytes each, moved a few times), and a
            // mutant's blocking wait adds loom's own frames on top (`pool_blocking_wait`
            // overflowed it). Real threads have the platform's default (2 MiB on Linux).
            #[cfg(tributary_loom)]
            let builder = builder.stack_size(256 << 10);
            let spawned = builder.spawn(move || worker.work());
            match spawned {
                Ok(handle) => pool.lifecycle.lock().threads.push(handle),
                Err(e) => {
                    pool.lifecycle.lock().running -= workers - i;
                    pool.detach(None);
                    return Err(DeviceError::Unexpected(format!(
                        "cannot spawn CPU worker {i} of {workers}: {e}"
                    )));
                }
            }
        }
        Ok(pool)
    }

    /// The spin window of its workers.
    pub(super) fn spin(&self) -> Duration {
        self.spin
    }

    /// Whether some stream waits for a worker (a hint, read without the lock).
    pub(super) fn others_ready(&self) -> bool {
        // Relaxed: a hint; the hand-off itself goes through the `ready` lock.
        self.ready_hint.load(Ordering::Relaxed) > 0
    }

    /// Attaches one more stream; `false` if the pool has stopped (its last stream left),
    /// and the caller must start a new one.
    pub(super) fn attach(&self) -> bool {
        let mut life = self.lifecycle.lock();
        if life.stopped {
            return false;
        }
        life.streams += 1;
        true
    }

    /// Detaches one stream. The last one stops the pool and joins its workers, until
    /// `deadline` if there is one: `false` if a worker was still running then (it is
    /// detached and finishes on its own).
    pub(super) fn detach(&self, deadline: Option<Instant>) -> bool {
        let threads = {
            let mut life = self.lifecycle.lock();
            life.streams = life.streams.saturating_sub(1);
            if life.streams > 0 {
                return true;
            }
            life.stopped = true;
            std::mem::take(&mut life.threads)
        };
        self.ready.lock().stop = true;
        self.wake.notify_all();
        if WORKER_OF.with(Cell::get) == self.address() {
            // Stopped from one of our own workers (a kernel dropped the last stream): it
            // exits when it returns to the pool; the others are left to exit on their own.
            return true;
        }
        if let Some(deadline) = deadline {
            let mut life = self.lifecycle.lock();
            while life.running > 0 {
                let now = Instant::now();
                if now >= deadline {
                    // Dropping the handles detaches the threads.
                    return false;
                }
                life = self.exited.wait_timeout(life, deadline - now).0;
            }
        }
        for handle in threads {
            // A worker never unwinds (streams catch what their plans throw); nothing to
            // report if one did.
            let _ = handle.join();
        }
        true
    }

    /// Makes `stream` ready: a worker will run it.
    pub(super) fn enqueue(&self, stream: StdArc<StreamTask>) {
        let mut ready = self.ready.lock();
        if ready.stop {
            // Every stream has shut down (it took no more work, and what it took is done
            // or given up on): a late wake-up (a submission whose plan the worker already
            // ran, found it idle and scheduled it again) has nothing to run, and a stream
            // left in the queue of a pool without workers would keep both alive forever.
            return;
        }
        ready.queue.push_back(stream);
        // Relaxed: a hint (see the field).
        self.ready_hint.fetch_add(1, Ordering::Relaxed);
        // A spinning worker will find it (it re-checks under the lock before parking): no
        // system call. Otherwise wake a parked one.
        let wake = ready.parked > 0 && ready.spinning == 0;
        drop(ready);
        if wake && !mutant!("pool_lost_notify") {
            self.wake.notify_one();
        }
    }

    fn address(&self) -> usize {
        self as *const WorkerPool as usize
    }

    /// A worker: runs ready streams until the pool stops.
    fn work(self: StdArc<Self>) {
        WORKER_OF.with(|w| w.set(self.address()));
        let _exit = Exited(&self);
        while let Some(stream) = self.next_ready() {
            stream.run();
        }
    }

    /// The next ready stream: taken at once, or after spinning for the window, or after
    /// parking; `None` once the pool stops with nothing left to run.
    fn next_ready(&self) -> Option<StdArc<StreamTask>> {
        let mut ready = self.ready.lock();
        let mut spun = false;
        loop {
            if let Some(stream) = ready.queue.pop_front() {
                // Relaxed: a hint (see the field).
                self.ready_hint.fetch_sub(1, Ordering::Relaxed);
                if !ready.queue.is_empty() && ready.parked > 0 && ready.spinning == 0 {
                    // More ready streams than this worker: pass the wake-up on.
                    self.wake.notify_one();
                }
                return Some(stream);
            }
            if ready.stop {
                return None;
            }
            if !spun && !self.spin.is_zero() {
                spun = true;
                ready.spinning += 1;
                drop(ready);
                let mut spin = SpinWait::new(self.spin);
                while !self.others_ready() && spin.spin() {}
                ready = self.ready.lock();
                ready.spinning -= 1;
                continue;
            }
            ready.parked += 1;
            ready = self.wake.wait(ready);
            ready.parked -= 1;
            spun = false;
        }
    }
}

/// Counts a worker out when it exits (normally or not).
struct Exited<'a>(&'a WorkerPool);

impl Drop for Exited<'_> {
    fn drop(&mut self) {
        self.0.lifecycle.lock().running -= 1;
        self.0.exited.notify_all();
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_last_stream_stops_the_pool_and_joins_its_workers() {
        let pool = WorkerPool::start("test-pool", 2, Duration::from_micros(10)).unwrap();
        assert!(pool.attach(), "a running pool takes more streams");
        assert!(pool.detach(None), "not the last stream: nothing to join");
        assert_eq!(pool.lifecycle.lock().running, 2);
        assert!(pool.detach(None), "the last stream joins the workers");
        let life = pool.lifecycle.lock();
        assert_eq!((life.running, life.streams, life.stopped), (0, 0, true));
        assert!(life.threads.is_empty());
        drop(life);
        assert!(
            !pool.attach(),
            "a stopped pool takes no stream: start a new one"
        );
    }

    #[test]
    fn a_bounded_stop_returns_once_the_workers_exited() {
        let pool = WorkerPool::start("test-pool", 3, Duration::ZERO).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        assert!(pool.detach(Some(deadline)));
        assert_eq!(pool.lifecycle.lock().running, 0);
    }

    #[test]
    fn a_backend_restarts_its_pool_after_the_last_stream_left() {
        let backend = super::super::CpuBackend::with_config(
            crate::DeviceId(0),
            1,
            super::super::CpuConfig::default().with_workers(1),
        )
        .unwrap();
        let sid = |index| crate::StreamId {
            device: crate::DeviceId(0),
            index,
        };
        let first = backend.pool_for(sid(0)).unwrap();
        let second = backend.pool_for(sid(1)).unwrap();
        assert!(StdArc::ptr_eq(&first, &second), "streams share the pool");
        assert!(first.detach(None) && second.detach(None));
        let third = backend.pool_for(sid(0)).unwrap();
        assert!(
            !StdArc::ptr_eq(&first, &third),
            "a stopped pool is replaced"
        );
        assert!(third.detach(None));
    }
}
