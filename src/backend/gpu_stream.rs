//! What the GPU backends' streams do alike, written once, as wgpu-hal's `auxil` does. Vulkan
//! and CUDA run each stream on a submit thread fed by a channel and a completion thread.
//! This module holds a plan's work lowered into a [`Job`] over the backend's regions, the
//! sending side of the channel, [`SubmitChannel`], the decisions that other streams of the
//! device wait on, the sorting of dependencies into device and host waits, and stopping the
//! threads. See DESIGN.md §5, "CUDA".
//!
//! Stopping with a deadline bounds the teardown too: a stream stopped with a deadline
//! records it in its backend's [`StopDeadline`], and the backend's last owner drops what
//! may block on the device (a CUDA context's destruction waits until the whole GPU is idle,
//! other devices' abandoned kernels included) with [`drop_by`] that deadline.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crossbeam_channel::{Receiver, Sender};
use smallvec::SmallVec;

use crate::{
    error::{DeviceError, Error, Failure, Result},
    event::{EventStatus, Timeline},
    ids::{DeviceId, StreamId},
    kernels::{Bindings, Kernel},
    memory::AlignedBuffer,
    protocol::{
        ArgBinding, Dep, DepKind, Deps, GlobalLoc, Plan, StreamProgram, StreamProgramOp, Work,
    },
    sync::Arc as SyncArc,
};

/// A kernel argument: its binding and the region it resolved to.
#[derive(Clone)]
pub(crate) struct Arg<R> {
    pub(crate) binding: ArgBinding,
    pub(crate) region: R,
}

/// `Err` naming the first argument whose region is not `local` (a kernel runs over its
/// device's memory only).
pub(crate) fn check_local<R>(
    args: &[Arg<R>],
    local: impl Fn(&R) -> bool,
) -> std::result::Result<(), String> {
    match args.iter().position(|a| !local(&a.region)) {
        Some(i) => Err(format!("argument {i} lives on another device")),
        None => Ok(()),
    }
}

/// A plan's work with every location resolved to a checked region `R` of the backend, and
/// a copy's route `C` between devices (`()` where the backend has one way only).
// `Run` carries its index values inline (`Bindings`, ~80 bytes): boxing them would cost an
// allocation per schedule to save a memcpy of a value moved a few times.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Job<R, C = ()> {
    Run {
        kernel: Kernel,
        args: Vec<Arg<R>>,
        merge: Option<Arg<R>>,
        /// The index values snapshotted into the plan.
        bindings: Bindings,
    },
    Copy {
        src: R,
        dst: R,
        // Read by the backends with more than one route (CUDA).
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        route: C,
        bytes: u64,
    },
    FromHost {
        host: Arc<AlignedBuffer>,
        dst: R,
        bytes: u64,
    },
    ToHost {
        src: R,
        host: Arc<AlignedBuffer>,
        bytes: u64,
    },
    Memset {
        dst: R,
        bytes: u64,
    },
    Marker,
}

impl<R, C> Job<R, C> {
    /// Lowers `work`: `resolve` checks a location's range and gives its region, `route`
    /// the way bytes go from one device to another; a host array must be exactly the
    /// transfer's size ([`super::check_host_array`]). An error fails the plan (after its
    /// dependencies, as every failure).
    pub(crate) fn lower(
        work: &Work,
        resolve: impl Fn(GlobalLoc, u64) -> std::result::Result<R, String>,
        route: impl FnOnce(DeviceId, DeviceId) -> std::result::Result<C, String>,
    ) -> std::result::Result<Job<R, C>, String> {
        let arg = |a: &ArgBinding| -> std::result::Result<Arg<R>, String> {
            Ok(Arg {
                region: resolve(a.loc, a.bytes)?,
                binding: a.clone(),
            })
        };
        Ok(match work {
            Work::Run {
                kernel,
                args,
                merge,
                bindings,
                ..
            } => Job::Run {
                bindings: bindings.clone(),
                kernel: kernel.clone(),
                args: args
                    .iter()
                    .map(arg)
                    .collect::<std::result::Result<_, _>>()?,
                merge: merge.as_ref().map(arg).transpose()?,
            },
            Work::Copy { src, dst, bytes } => Job::Copy {
                route: route(src.device, dst.device)?,
                src: resolve(*src, *bytes)?,
                dst: resolve(*dst, *bytes)?,
                bytes: *bytes,
            },
            Work::FromHost { host, dst, bytes } => {
                super::check_host_array(host.len(), *bytes)?;
                Job::FromHost {
                    host: host.clone(),
                    dst: resolve(*dst, *bytes)?,
                    bytes: *bytes,
                }
            }
            Work::ToHost { src, host, bytes } => {
                super::check_host_array(host.len(), *bytes)?;
                Job::ToHost {
                    src: resolve(*src, *bytes)?,
                    host: host.clone(),
                    bytes: *bytes,
                }
            }
            Work::Memset { dst, bytes } => Job::Memset {
                dst: resolve(*dst, *bytes)?,
                bytes: *bytes,
            },
            Work::Marker => Job::Marker,
        })
    }
}

/// The locations an operation's work names on devices, in the order [`Job::lower`]
/// resolves them (what a recording or a captured graph of it is made over); `None` for
/// host transfers, which are never recorded.
#[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
pub(crate) fn device_locations(work: &Work) -> Option<SmallVec<[(GlobalLoc, u64); 4]>> {
    let mut out = SmallVec::new();
    match work {
        Work::Run { args, merge, .. } => {
            out.extend(args.iter().chain(merge.iter()).map(|a| (a.loc, a.bytes)));
        }
        Work::Copy { src, dst, bytes } => {
            out.push((*src, *bytes));
            out.push((*dst, *bytes));
        }
        Work::Memset { dst, bytes } => out.push((*dst, *bytes)),
        Work::Marker => {}
        Work::FromHost { .. } | Work::ToHost { .. } => return None,
    }
    Some(out)
}

/// Why a replayed operation takes the plan path on a GPU stream (kept for the debug log).
#[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
pub(crate) type AsPlan = &'static str;

/// The regions of `op`'s work on this device, resolved with `resolve`, for a recording or
/// a captured graph of it; why not where `op` takes the plan path instead (it fails without
/// running, comes out of order after `last`, is host work, names a location that does not
/// resolve or is not `local`).
#[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
pub(crate) fn device_regions<R>(
    op: StreamProgramOp<'_>,
    last: u64,
    resolve: impl Fn(GlobalLoc, u64) -> std::result::Result<R, String>,
    local: impl Fn(&R) -> bool,
) -> std::result::Result<SmallVec<[R; 4]>, AsPlan> {
    if op.failed().is_some() {
        return Err("fails without running");
    }
    if op.seq() <= last {
        return Err("out of order");
    }
    let mut regions = SmallVec::new();
    for (loc, bytes) in device_locations(op.work()).ok_or("host work")? {
        let region = resolve(loc, bytes).map_err(|_| "unresolved")?;
        if !local(&region) {
            return Err("another device");
        }
        regions.push(region);
    }
    Ok(regions)
}

/// A plan on its way to the submit thread.
pub(crate) struct Submitted<J> {
    pub(crate) label: String,
    pub(crate) seq: u64,
    /// Bytes the work touches (for the timeline).
    pub(crate) bytes: u64,
    pub(crate) deps: Deps,
    /// The lowered work, or why it could not be lowered (the plan fails).
    pub(crate) job: std::result::Result<J, String>,
}

impl<J> Submitted<J> {
    /// `op` of a replay's program as the plan a queue that runs no programs would get,
    /// lowered with `lower` (an operation failing without running fails as that plan
    /// would, once its dependencies are decided).
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
    pub(crate) fn of_op(
        op: StreamProgramOp<'_>,
        lower: impl FnOnce(&Work) -> std::result::Result<J, String>,
    ) -> Submitted<J> {
        let work = op.to_work();
        Submitted {
            label: work.label(),
            seq: op.seq(),
            bytes: work.bytes(),
            deps: op.deps().iter().cloned().collect(),
            job: match op.failed() {
                Some(why) => Err(why.to_string()),
                None => lower(&work),
            },
        }
    }

    /// The plan's failure on `stream` with `message`.
    pub(crate) fn failure(&self, stream: StreamId, message: String) -> Arc<Failure> {
        Arc::new(Failure {
            stream,
            seq: self.seq,
            operation: self.label.clone(),
            message,
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Poisoned only by a panic while sending or joining, which leaves nothing half-done.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A GPU backend's names: in its failures, and in its stream threads' names.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BackendNames {
    /// The backend's name (in a panicked thread's failure), e.g. "Vulkan".
    pub(crate) backend: &'static str,
    /// The prefix of its threads' names, e.g. "vk": `tributary-vk-{stream}`.
    pub(crate) threads: &'static str,
}

/// What a stream's channel carries to its submit thread: a lowered plan, or a replay's
/// program (`P`: [`StreamProgram`] where the backend runs programs, [`Infallible`] where it
/// takes plans only). Sent by value: boxing a plan would cost an allocation per operation.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Sent<J, P = Infallible> {
    Plan(Submitted<J>),
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
    // the GPU streams use it
    Program(P),
}

/// The sending side of a stream's submit thread, and the stream's threads.
pub(crate) struct SubmitChannel<J, P = Infallible> {
    stream: StreamId,
    timeline: SyncArc<Timeline>,
    tx: Mutex<Option<Sender<Sent<J, P>>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The backend's name (in a panicked thread's failure).
    backend: &'static str,
    /// Where a stop with a deadline is recorded, if the backend asked for it.
    stop_deadline: Option<Arc<StopDeadline>>,
}

/// The deadline a backend's streams were stopped by ([`StreamQueue::shutdown_within`]),
/// recorded so that the backend's teardown keeps to it too ([`drop_by`]). Streams stopped
/// without a deadline record nothing; of several deadlines the latest is kept.
///
/// [`StreamQueue::shutdown_within`]: crate::backend::StreamQueue::shutdown_within
#[derive(Debug, Default)]
pub(crate) struct StopDeadline(Mutex<Option<Instant>>);

#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA backend records its stops
impl StopDeadline {
    /// Records that a stream was stopped with `deadline`.
    pub(crate) fn record(&self, deadline: Instant) {
        let mut d = lock(&self.0);
        *d = Some(d.map_or(deadline, |old| old.max(deadline)));
    }

    /// The deadline recorded, if any.
    pub(crate) fn get(&self) -> Option<Instant> {
        *lock(&self.0)
    }
}

/// Drops `value` within `deadline`: with none, in place (as [`crate::Engine`]'s drop stops
/// its streams and waits); with one, on a thread of its own, waiting for that drop until the
/// deadline and then returning, leaving the drop to finish on its thread. For what may block
/// on a device beyond a bounded shutdown: destroying a CUDA context waits until the GPU is
/// idle, kernels of devices the shutdown abandoned included. Where no thread can be
/// started, the value is dropped in place.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA backend's teardown uses it
pub(crate) fn drop_by<T: Send + 'static>(value: T, deadline: Option<Instant>) {
    let Some(deadline) = deadline else {
        drop(value);
        return;
    };
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(1);
    let spawned = std::thread::Builder::new()
        .name("tributary-teardown".into())
        .spawn(move || {
            drop(value);
            let _ = done_tx.send(());
        });
    if let Err(e) = spawned {
        // The closure, and the value with it, was dropped by the failed spawn.
        tracing::warn!(%e, "no teardown thread: dropped in place");
        return;
    }
    if mutant!("teardown_waits") {
        // The mutant: the teardown is waited for whatever the deadline.
        let _ = done_rx.recv();
        return;
    }
    if done_rx.recv_deadline(deadline).is_err() {
        tracing::debug!("teardown left running past the stop deadline");
    }
}

impl<J: Send + 'static, P: Send + 'static> SubmitChannel<J, P> {
    /// Starts the threads of the stream `timeline` completes: `completion` (named
    /// `tributary-{threads}-done-{stream}`) first, then `submit`
    /// (`tributary-{threads}-{stream}`) with the receiving side of the channel. If the
    /// submit thread cannot start, its closure is dropped (closing whatever it held for the
    /// completion thread, which then ends) and the completion thread is joined before the
    /// error returns.
    pub(crate) fn start(
        timeline: SyncArc<Timeline>,
        names: BackendNames,
        submit: impl FnOnce(Receiver<Sent<J, P>>) + Send + 'static,
        completion: impl FnOnce() + Send + 'static,
    ) -> std::result::Result<SubmitChannel<J, P>, DeviceError> {
        let stream = timeline.stream();
        let prefix = names.threads;
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| DeviceError::Unexpected(format!("cannot spawn a stream thread: {e}")))
        };
        let (tx, rx) = crossbeam_channel::unbounded::<Sent<J, P>>();
        let done = spawn(
            format!("tributary-{prefix}-done-{stream}"),
            Box::new(completion),
        )?;
        let submitting = match spawn(
            format!("tributary-{prefix}-{stream}"),
            Box::new(move || submit(rx)),
        ) {
            Ok(h) => h,
            Err(e) => {
                let _ = done.join();
                return Err(e);
            }
        };
        Ok(SubmitChannel {
            stream,
            timeline,
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(vec![submitting, done]),
            backend: names.backend,
            stop_deadline: None,
        })
    }

    /// Records a stop with a deadline in `deadline` (the backend's).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA backend records its stops
    pub(crate) fn recording_stops_in(mut self, deadline: Arc<StopDeadline>) -> Self {
        self.stop_deadline = Some(deadline);
        self
    }

    /// Checks that `plan` is this stream's ([`Plan::check_queue`]), lowers its work with
    /// `lower` and sends it to the submit thread. Once the stream stopped the plan is
    /// refused ([`Error::ShutDown`]) and its event fails, in order: once its dependencies
    /// and the operations still draining before it are decided
    /// (`protocol/unsubmitted.rs`).
    pub(crate) fn submit(
        &self,
        plan: Plan,
        lower: impl FnOnce(&Work) -> std::result::Result<J, String>,
    ) -> Result<()> {
        plan.check_queue(self.stream, &self.timeline)?;
        let seq = plan.event.seq();
        let label = plan.work.label();
        let item = Submitted {
            label: label.clone(),
            seq,
            bytes: plan.work.bytes(),
            job: lower(&plan.work),
            deps: plan.deps,
        };
        if let Some(Sent::Plan(item)) = self.send(Sent::Plan(item)) {
            crate::protocol::fail_when_ready(
                self.timeline.clone(),
                seq,
                item.deps.into_iter().map(|dep| dep.event().clone()),
                Arc::new(Failure {
                    stream: self.stream,
                    seq,
                    operation: label,
                    message: "stream is shut down".into(),
                }),
            );
            return Err(Error::ShutDown(format!("stream {}", self.stream)));
        }
        Ok(())
    }

    /// Sends `item` to the submit thread; gives it back once the stream stopped.
    fn send(&self, item: Sent<J, P>) -> Option<Sent<J, P>> {
        match lock(&self.tx).as_ref() {
            Some(tx) => tx.send(item).err().map(|e| e.0),
            None => Some(item),
        }
    }

    /// Closes the channel and joins the threads ([`join_stream_threads`]); `false` when the
    /// deadline passed first. A deadline is recorded where the backend asked
    /// ([`SubmitChannel::recording_stops_in`]).
    pub(crate) fn stop(&self, deadline: Option<Instant>) -> bool {
        if let (Some(d), Some(record)) = (deadline, &self.stop_deadline) {
            record.record(d);
        }
        drop(lock(&self.tx).take());
        join_stream_threads(
            &self.threads,
            deadline,
            &self.timeline,
            self.stream,
            self.backend,
        )
    }
}

impl<J: Send + 'static> SubmitChannel<J, StreamProgram> {
    /// Checks that `program` is this stream's ([`StreamProgram::check_queue`]) and sends it
    /// whole to the submit thread. Once the stream stopped it is refused
    /// ([`Error::ShutDown`]) and its events fail, in order, as a refused plan's.
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))] // the GPU streams use it
    pub(crate) fn submit_program(&self, program: StreamProgram) -> Result<()> {
        program.check_queue(self.stream, &self.timeline)?;
        if program.is_empty() {
            return Ok(());
        }
        let Some(Sent::Program(program)) = self.send(Sent::Program(program)) else {
            return Ok(());
        };
        program.fail_unsubmitted("stream is shut down");
        Err(Error::ShutDown(format!("stream {}", self.stream)))
    }
}

/// Joins a stream's `threads` (their channel must already be closed). With a `deadline`,
/// gives up when it passes: the threads are detached (they own what they use and finish
/// the queued work on their own) and `false` is returned. A thread that panicked poisons
/// the stream's `timeline`, so no waiter hangs on work it would have completed.
pub(crate) fn join_stream_threads(
    threads: &Mutex<Vec<JoinHandle<()>>>,
    deadline: Option<Instant>,
    timeline: &SyncArc<Timeline>,
    stream: StreamId,
    backend: &str,
) -> bool {
    let mut threads = threads.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(deadline) = deadline {
        while threads.iter().any(|h| !h.is_finished()) {
            if Instant::now() >= deadline {
                // Dropping the handles detaches the threads; it does not stop them.
                threads.clear();
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    for h in threads.drain(..) {
        if h.join().is_err() {
            timeline.poison(Arc::new(Failure {
                stream,
                seq: timeline.completed() + 1,
                operation: "worker".into(),
                message: format!("{backend} stream thread panicked"),
            }));
        }
    }
    true
}

/// What a stream's submit thread decided for its sequence numbers, published for the other
/// streams of its device (which wait on the device only for what is decided): every number
/// up to `upto` is decided; `open` holds what a decision left to say (a recorded event, a
/// root cause) until the number completes.
pub(crate) struct Decisions<D> {
    state: Mutex<DecisionState<D>>,
    cond: Condvar,
}

struct DecisionState<D> {
    upto: u64,
    open: BTreeMap<u64, D>,
    /// The submit thread is gone: nothing more will be decided.
    closed: bool,
}

/// A decision as a waiter sees it.
pub(crate) enum Decided<D> {
    /// Decided, with what it left (`None`: nothing, e.g. completed and forgotten).
    Yes(Option<D>),
    /// The stream stopped before deciding: only its timeline can say.
    Gone,
}

impl<D: Clone> Decisions<D> {
    pub(crate) fn new() -> Decisions<D> {
        Decisions {
            state: Mutex::new(DecisionState {
                upto: 0,
                open: BTreeMap::new(),
                closed: false,
            }),
            cond: Condvar::new(),
        }
    }

    /// Publishes the decision for `seq` (and everything before it), with what it leaves.
    pub(crate) fn decide(&self, seq: u64, left: Option<D>) {
        let mut d = lock(&self.state);
        d.upto = d.upto.max(seq);
        if let Some(x) = left {
            d.open.insert(seq, x);
        }
        drop(d);
        self.cond.notify_all();
    }

    /// Forgets what the decisions up to `seq` left: their timeline is complete.
    pub(crate) fn forget_upto(&self, seq: u64) {
        let mut d = lock(&self.state);
        d.open = d.open.split_off(&(seq + 1));
    }

    /// Nothing more will be decided (the submit thread ends).
    pub(crate) fn close(&self) {
        lock(&self.state).closed = true;
        self.cond.notify_all();
    }

    /// The decision for `seq` if it is made (or the stream stopped), without waiting.
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))] // the GPU streams use it
    pub(crate) fn peek(&self, seq: u64) -> Option<Decided<D>> {
        let d = lock(&self.state);
        if d.upto >= seq {
            Some(Decided::Yes(d.open.get(&seq).cloned()))
        } else if d.closed {
            Some(Decided::Gone)
        } else {
            None
        }
    }

    /// Waits until `seq` is decided, or the stream stopped.
    pub(crate) fn wait(&self, seq: u64) -> Decided<D> {
        let mut d = lock(&self.state);
        loop {
            if d.upto >= seq {
                return Decided::Yes(d.open.get(&seq).cloned());
            }
            if d.closed {
                return Decided::Gone;
            }
            d = self.cond.wait(d).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Receives the next item, polling for `window` before parking: a stream thread that just
/// handled an operation is likely to get the next one soon, and a futex wake-up costs
/// several microseconds (the CPU backend's workers spin for the same reason). `Err` once
/// the channel is closed and empty. Only the CUDA stream's threads use it so far.
#[cfg(feature = "cuda")]
pub(crate) fn recv_spinning<T>(
    rx: &Receiver<T>,
    window: Duration,
) -> std::result::Result<T, crossbeam_channel::RecvError> {
    let mut spin = crate::sync::spin::SpinWait::new(window);
    loop {
        match rx.try_recv() {
            Ok(x) => return Ok(x),
            Err(crossbeam_channel::TryRecvError::Disconnected) => {
                return Err(crossbeam_channel::RecvError)
            }
            Err(crossbeam_channel::TryRecvError::Empty) => {
                if !spin.spin() {
                    return rx.recv();
                }
            }
        }
    }
}

/// For a stream thread's exit guard: when the thread is unwinding from a panic, fails the
/// stream's next operation (`timeline` poisoned), so no waiter hangs on work it would have
/// completed.
pub(crate) fn poison_if_panicking(timeline: &Timeline, stream: StreamId, backend: &str) {
    if std::thread::panicking() {
        timeline.poison(Arc::new(Failure {
            stream,
            seq: timeline.completed() + 1,
            operation: "worker".into(),
            message: format!("{backend} submit thread died"),
        }));
    }
}

/// How the dependencies of one plan are to be waited for: `gpu`, on the device (the
/// backend's wait for another stream of the device); `failed`, the root cause of the first
/// failed data dependency (the plan fails without running).
pub(crate) struct Waits<W> {
    pub(crate) gpu: Vec<W>,
    pub(crate) failed: Option<Arc<Failure>>,
}

impl<W> Waits<W> {
    /// Sorts a plan's dependencies: a completed one needs nothing, a failed one is noted;
    /// each pending one goes to `pending`, which gives the wait to enqueue on the device (if
    /// any) and the failure it learned of (if any). Only data dependencies carry failures
    /// to the plan (rule 6); order dependencies only order it.
    pub(crate) fn classify(
        deps: &[Dep],
        mut pending: impl FnMut(&Dep) -> (Option<W>, Option<Arc<Failure>>),
    ) -> Waits<W> {
        let mut w = Waits {
            gpu: Vec::new(),
            failed: None,
        };
        for dep in deps {
            let failure = match dep.event.status() {
                EventStatus::Done => None,
                EventStatus::Failed(f) => Some(f),
                EventStatus::Pending => {
                    let (wait, failure) = pending(dep);
                    w.gpu.extend(wait);
                    failure
                }
            };
            if let Some(f) = failure {
                if dep.kind == DepKind::Data {
                    w.failed.get_or_insert(f);
                }
            }
        }
        w
    }
}

/// `StreamQueue` (and `Drop`) for a GPU stream type with a `channel: SubmitChannel<Job>`
/// field and a `resolve(&self, &Work) -> Result<Job, String>` method: submitting lowers and
/// sends, shutting down (or dropping) stops the channel and joins the threads.
///
/// `stream_queue_over_channel!(T, programs)` also hands replays' programs whole to the
/// submit thread (a `channel: SubmitChannel<Job, StreamProgram>`).
macro_rules! stream_queue_over_channel {
    ($stream:ty, programs) => {
        $crate::backend::gpu_stream::stream_queue_over_channel!($stream, {
            fn runs_programs(&self) -> bool {
                true
            }

            fn submit_program(
                &self,
                program: $crate::protocol::StreamProgram,
            ) -> $crate::error::Result<()> {
                self.channel.submit_program(program)
            }
        });
    };
    ($stream:ty) => {
        $crate::backend::gpu_stream::stream_queue_over_channel!($stream, {});
    };
    ($stream:ty, { $($programs:tt)* }) => {
        impl $crate::backend::StreamQueue for $stream {
            fn submit(&self, plan: $crate::protocol::Plan) -> $crate::error::Result<()> {
                self.channel.submit(plan, |work| self.resolve(work))
            }

            $($programs)*

            fn shutdown(&self) {
                self.channel.stop(None);
            }

            fn shutdown_within(&self, timeout: std::time::Duration) -> bool {
                self.channel.stop(Some(std::time::Instant::now() + timeout))
            }
        }

        impl Drop for $stream {
            fn drop(&mut self) {
                self.channel.stop(None);
            }
        }
    };
}
pub(crate) use stream_queue_over_channel;

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;

    /// Bound on every wait of the test below: far above anything it waits for, there only so
    /// that a failure (the mutant `teardown_waits`) ends the test instead of hanging it.
    const GENEROUS: Duration = Duration::from_secs(30);

    /// A value whose drop blocks until it is released, then says it finished.
    struct BlockingDrop {
        release: crossbeam_channel::Receiver<()>,
        dropped: crossbeam_channel::Sender<()>,
    }

    impl Drop for BlockingDrop {
        fn drop(&mut self) {
            let _ = self.release.recv();
            let _ = self.dropped.send(());
        }
    }

    /// `drop_by` with a deadline returns at it while the drop still blocks, and the drop
    /// finishes on its own thread once released; without a deadline it drops in place.
    /// Synchronised by channels only: the deadline is already past when `drop_by` is called,
    /// and the bound on each wait is only there to fail instead of hanging.
    #[test]
    fn drop_by_returns_at_the_deadline_and_the_drop_finishes_later() {
        let (release_tx, release_rx) = crossbeam_channel::unbounded();
        let (dropped_tx, dropped_rx) = crossbeam_channel::unbounded();
        let value = BlockingDrop {
            release: release_rx,
            dropped: dropped_tx,
        };
        let (returned_tx, returned_rx) = crossbeam_channel::unbounded();
        let caller = std::thread::spawn(move || {
            drop_by(value, Some(Instant::now()));
            let _ = returned_tx.send(());
        });
        let returned = returned_rx.recv_timeout(GENEROUS);
        let dropped_early = dropped_rx.try_recv().is_ok();
        // Released whatever happened, so that no thread is left blocked.
        release_tx.send(()).expect("the drop is waiting");
        assert!(
            returned.is_ok(),
            "drop_by did not return at its deadline while the drop was blocked"
        );
        assert!(!dropped_early, "the drop finished before it was released");
        dropped_rx
            .recv_timeout(GENEROUS)
            .expect("the drop finishes once released");
        caller.join().expect("the caller ran");

        // No deadline: dropped in place, before drop_by returns.
        let (release_tx, release_rx) = crossbeam_channel::unbounded();
        let (dropped_tx, dropped_rx) = crossbeam_channel::unbounded();
        release_tx.send(()).expect("the receiver is alive");
        drop_by(
            BlockingDrop {
                release: release_rx,
                dropped: dropped_tx,
            },
            None,
        );
        assert!(dropped_rx.try_recv().is_ok(), "dropped in place");

        let deadline = StopDeadline::default();
        assert_eq!(deadline.get(), None);
        let (early, late) = (Instant::now(), Instant::now() + GENEROUS);
        deadline.record(late);
        deadline.record(early);
        assert_eq!(deadline.get(), Some(late), "the latest deadline is kept");
    }

    /// Both ways of waiting get every item in order, and end once the channel is closed
    /// and drained: parking at once (no window) and polling first (a window longer than the
    /// test, so the items sent while it polls are taken by polling).
    #[test]
    fn spinning_receive_gets_every_item_then_ends() {
        for window in [Duration::ZERO, Duration::from_secs(5)] {
            let (tx, rx) = crossbeam_channel::unbounded::<u32>();
            let sender = std::thread::spawn(move || {
                for i in 0..100 {
                    tx.send(i).expect("the receiver is alive");
                    if i % 10 == 0 {
                        std::thread::yield_now();
                    }
                }
            });
            let got: Vec<u32> = std::iter::from_fn(|| recv_spinning(&rx, window).ok()).collect();
            sender.join().expect("the sender ran");
            assert_eq!(got, (0..100).collect::<Vec<_>>(), "window {window:?}");
        }
    }
}
