//! Plans: what the protocol asks a backend to do for one operation. See DESIGN.md §2, "Plan",
//! and §5, "Soundness".
//!
//! A [`Plan`] holds its stream, the events it waits for as [`Dep`]s, its work and the event it
//! completes. Every binding is resolved when the plan is made, at schedule time. Only the
//! protocol makes plans; [`Plan`] says how the types ensure it.

use std::{fmt, sync::Arc};

use crate::{
    error::{Error, Failure},
    event::Event,
    ids::{BufferLoc, DeviceId, StreamId},
    kernels::{Access, Bindings, Kernel},
    memory::AlignedBuffer,
    node::{DType, Shape},
};

/// A buffer location qualified by its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GlobalLoc {
    /// The device whose pools hold the buffer.
    pub device: DeviceId,
    /// The location inside that device's pools.
    pub loc: BufferLoc,
}

impl fmt::Display for GlobalLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.device, self.loc)
    }
}

/// Why an operation waits for an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DepKind {
    /// The operation reads what the event's operation wrote (read after write). If that
    /// operation failed, this one fails with the same root cause.
    Data,
    /// The operation must not start before the event's operation finished (write after
    /// read, write after write, reuse of memory). A failure there does not propagate.
    Order,
}

/// One event an operation waits for.
#[derive(Clone, Debug)]
pub struct Dep {
    pub(crate) event: Event,
    pub(crate) kind: DepKind,
}

impl Dep {
    /// A dependency on `event` of the given kind.
    ///
    /// Safe: a dependency alone does nothing; only a [`Plan`] (made by the protocol, or
    /// by the `unsafe` [`Plan::from_parts`]) makes a backend wait for it.
    pub fn new(event: Event, kind: DepKind) -> Dep {
        Dep { event, kind }
    }

    /// The event.
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// Why the operation waits for it.
    pub fn kind(&self) -> DepKind {
        self.kind
    }

    /// What this dependency, once decided with `outcome`, means for the plan waiting on
    /// it: the root cause to fail with (a failed [`DepKind::Data`] dependency), or `None`.
    /// Every executor folds its dependencies through this ([`await_deps`], the CPU pool).
    pub(crate) fn failure(&self, outcome: &Result<(), Error>) -> Option<Arc<Failure>> {
        match (outcome, self.kind) {
            (Err(Error::Failed(f)), DepKind::Data) if !mutant!("failure") => Some(f.clone()),
            _ => None,
        }
    }
}

/// A buffer bound as a kernel argument.
#[derive(Clone, Debug)]
pub struct ArgBinding {
    pub(crate) loc: GlobalLoc,
    pub(crate) bytes: u64,
    pub(crate) dtype: DType,
    pub(crate) shape: Shape,
    pub(crate) access: Access,
}

impl ArgBinding {
    /// A binding of `bytes` bytes at `loc`, holding `dtype` elements of `shape`, used as
    /// `access` says.
    ///
    /// Safe: a binding alone does nothing; only a [`Plan`] (made by the protocol, or by
    /// the `unsafe` [`Plan::from_parts`], whose contract covers its bindings) is executed.
    pub fn new(loc: GlobalLoc, bytes: u64, dtype: DType, shape: Shape, access: Access) -> Self {
        ArgBinding {
            loc,
            bytes,
            dtype,
            shape,
            access,
        }
    }

    /// Where the buffer is.
    pub fn loc(&self) -> GlobalLoc {
        self.loc
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// How the kernel uses it.
    pub fn access(&self) -> Access {
        self.access
    }
}

/// The work of one operation.
///
/// Its variants are `#[non_exhaustive]`: code outside this crate can inspect work but not
/// make it (see [`Plan`]).
// `Run` carries its index values inline (`Bindings`, ~80 bytes): boxing them would cost an
// allocation per schedule to save a memcpy of a value moved a few times.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub enum Work {
    /// Run a kernel over bound buffers.
    #[non_exhaustive]
    Run {
        /// Routine name (for errors and traces).
        name: Arc<str>,
        /// The kernel.
        kernel: Kernel,
        /// Parameters in the kernel's argument order (shared: resolved when the routine
        /// was linked).
        args: Arc<[ArgBinding]>,
        /// The merge-buffer argument, resolved at schedule time.
        merge: Option<ArgBinding>,
        /// The values of the routine's declared indices, snapshotted at schedule time
        /// (complete; empty for a routine without indices).
        bindings: Bindings,
    },
    /// Copy `bytes` from one buffer to another (possibly on another device).
    #[non_exhaustive]
    Copy {
        /// Source buffer.
        src: GlobalLoc,
        /// Destination buffer.
        dst: GlobalLoc,
        /// Bytes to copy.
        bytes: u64,
    },
    /// Copy a host array into a buffer.
    #[non_exhaustive]
    FromHost {
        /// The host array.
        host: Arc<AlignedBuffer>,
        /// Destination buffer.
        dst: GlobalLoc,
        /// Bytes to copy.
        bytes: u64,
    },
    /// Copy a buffer into a host array.
    #[non_exhaustive]
    ToHost {
        /// Source buffer.
        src: GlobalLoc,
        /// The host array.
        host: Arc<AlignedBuffer>,
        /// Bytes to copy.
        bytes: u64,
    },
    /// Zero a buffer.
    #[non_exhaustive]
    Memset {
        /// The buffer.
        dst: GlobalLoc,
        /// Bytes to zero.
        bytes: u64,
    },
    /// Nothing: only completes an event (used to mark a point on a stream).
    Marker,
}

/// Constructors, for the `unsafe` [`Plan::from_parts`] (the protocol builds the variants
/// directly). Safe: work does nothing until a plan carries it.
impl Work {
    /// [`Work::Run`]: `kernel` (called `name`) over `args`, with the merge buffer `merge`.
    pub fn run(
        name: impl Into<Arc<str>>,
        kernel: Kernel,
        args: Vec<ArgBinding>,
        merge: Option<ArgBinding>,
    ) -> Work {
        Work::run_bound(name, kernel, args, merge, Bindings::none())
    }

    /// [`Work::Run`] with values for the routine's indices.
    pub fn run_bound(
        name: impl Into<Arc<str>>,
        kernel: Kernel,
        args: Vec<ArgBinding>,
        merge: Option<ArgBinding>,
        bindings: Bindings,
    ) -> Work {
        Work::Run {
            name: name.into(),
            kernel,
            args: args.into(),
            merge,
            bindings,
        }
    }

    /// [`Work::Copy`] of `bytes` bytes from `src` to `dst`.
    pub fn copy(src: GlobalLoc, dst: GlobalLoc, bytes: u64) -> Work {
        Work::Copy { src, dst, bytes }
    }

    /// [`Work::FromHost`]: `bytes` bytes of `host` into `dst`.
    pub fn from_host(host: Arc<AlignedBuffer>, dst: GlobalLoc, bytes: u64) -> Work {
        Work::FromHost { host, dst, bytes }
    }

    /// [`Work::ToHost`]: `bytes` bytes of `src` into `host`.
    pub fn to_host(src: GlobalLoc, host: Arc<AlignedBuffer>, bytes: u64) -> Work {
        Work::ToHost { src, host, bytes }
    }

    /// [`Work::Memset`]: zero `bytes` bytes at `dst`.
    pub fn memset(dst: GlobalLoc, bytes: u64) -> Work {
        Work::Memset { dst, bytes }
    }
}

impl Work {
    /// A short name of the operation, for errors and traces.
    pub fn label(&self) -> String {
        self.plan_label().to_string()
    }

    /// [`Work::label`] as a value that becomes text only when displayed (a routine's name
    /// is shared): what a queue keeps per operation without allocating.
    pub fn plan_label(&self) -> PlanLabel {
        match self {
            Work::Run { name, .. } => PlanLabel::Routine(name.clone()),
            Work::Copy { src, dst, .. } => PlanLabel::Copy {
                src: *src,
                dst: *dst,
            },
            Work::FromHost { dst, .. } => PlanLabel::FromHost { dst: *dst },
            Work::ToHost { src, .. } => PlanLabel::ToHost { src: *src },
            Work::Memset { dst, .. } => PlanLabel::Memset { dst: *dst },
            Work::Marker => PlanLabel::Marker,
        }
    }

    /// Bytes moved or touched, for traces and bandwidth figures.
    pub fn bytes(&self) -> u64 {
        match self {
            Work::Run { args, .. } => args.iter().map(|a| a.bytes).sum(),
            Work::Copy { bytes, .. }
            | Work::FromHost { bytes, .. }
            | Work::ToHost { bytes, .. }
            | Work::Memset { bytes, .. } => *bytes,
            Work::Marker => 0,
        }
    }
}

/// What errors and traces call an operation ([`Work::plan_label`]): displayed as
/// [`Work::label`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanLabel {
    /// A routine, by name.
    Routine(Arc<str>),
    /// A copy between two locations.
    Copy {
        /// Where from.
        src: GlobalLoc,
        /// Where to.
        dst: GlobalLoc,
    },
    /// An upload to a location.
    FromHost {
        /// Where to.
        dst: GlobalLoc,
    },
    /// A download from a location.
    ToHost {
        /// Where from.
        src: GlobalLoc,
    },
    /// A zeroing of a location.
    Memset {
        /// Where.
        dst: GlobalLoc,
    },
    /// A marker.
    Marker,
}

impl fmt::Display for PlanLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanLabel::Routine(name) => f.write_str(name),
            PlanLabel::Copy { src, dst } => write!(f, "copy {src} -> {dst}"),
            PlanLabel::FromHost { dst } => write!(f, "from_host -> {dst}"),
            PlanLabel::ToHost { src } => write!(f, "to_host {src} ->"),
            PlanLabel::Memset { dst } => write!(f, "memset {dst}"),
            PlanLabel::Marker => f.write_str("marker"),
        }
    }
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// The dependencies of one plan. Up to four are held inline, so most plans allocate no
/// list for them.
pub type Deps = smallvec::SmallVec<[Dep; 4]>;

/// The plans of one operation, in issue order. Most operations make one plan, which is
/// held inline, so issuing allocates no list.
pub type Plans = smallvec::SmallVec<[Plan; 1]>;

/// Everything a stream must do for one operation.
///
/// Made by the protocol ([`DeviceState`](crate::protocol::DeviceState)) and consumed by
/// [`StreamQueue::submit`](crate::backend::StreamQueue::submit).
///
/// # Made by the protocol only
///
/// A backend executes a plan with raw memory accesses whose soundness rests on two facts
/// the protocol establishes when it makes the plan: the plan waits for every earlier use
/// that conflicts with it ([`Plan::deps`]), and the buffers it binds are the disjoint
/// buffers of distinct nodes (no two writable bindings of one plan overlap). A plan built
/// by hand could break either (two write bindings at one location give aliasing `&mut`;
/// two plans on two streams without dependencies race). So the types make the protocol
/// the only maker of plans:
///
/// - a `Plan` has private fields (read accessors only) and is not `Clone`: an owned
///   `Plan` is the one permission to run its operation and complete its event, consumed
///   by [`StreamQueue::submit`];
/// - its parts, [`Work`] (whose variants are `#[non_exhaustive]`), [`ArgBinding`] and
///   [`Dep`] (private fields), are made only through their constructors, which are safe
///   because a part does nothing until a plan carries it, and cannot be changed inside a
///   plan;
/// - outside the protocol ([`DeviceState`](crate::protocol::DeviceState)) the only
///   constructor is the `unsafe` [`Plan::from_parts`], whose contract is the protocol's
///   promise (for model checkers and backend tests);
/// - a queue refuses a plan for another stream ([`Error::WrongStream`]), so a plan cannot
///   complete an event of a timeline that its queue does not own.
///
/// [`StreamQueue::submit`]: crate::backend::StreamQueue::submit
#[derive(Debug)]
pub struct Plan {
    /// When the protocol made it ([`Plan::issue`]).
    pub(crate) issue: u64,
    /// The stream that runs it.
    pub(crate) stream: StreamId,
    /// The event it completes (its sequence number on `stream`).
    pub(crate) event: Event,
    /// What it waits for first. Every dependency is waited for, even after one failed, so
    /// that an operation completes only after all its dependencies completed: this is what
    /// makes pruning the tables sound (a completed write implies completed earlier uses).
    pub(crate) deps: Deps,
    /// The work.
    pub(crate) work: Work,
}

impl Plan {
    /// A plan made outside the protocol: `work` on `stream`, completing `event` after
    /// `deps`. For model checkers and backend tests that drive a queue directly.
    ///
    /// # Safety
    ///
    /// The plan must be one the protocol could have made, which is what every backend
    /// relies on when it touches memory:
    ///
    /// - `event` is the next unissued sequence number of `stream`'s timeline, issued to
    ///   this plan only, and the plan is submitted to the queue of `stream` that completes
    ///   that timeline;
    /// - `deps` order the plan after every operation, on any stream, that writes a buffer
    ///   (or host array) this plan reads or that uses a buffer (or host array) this plan
    ///   writes, and no such operation is issued later without depending on this plan;
    /// - no two bindings of `work` overlap unless both only read, and every location names
    ///   a live pool of the queue's backend with the stated size in bounds;
    /// - a host array in `work` is not accessed by the caller until `event` completes.
    pub unsafe fn from_parts(
        stream: StreamId,
        event: Event,
        deps: impl IntoIterator<Item = Dep>,
        work: Work,
    ) -> Plan {
        Plan {
            issue: next_issue(),
            stream,
            event,
            deps: deps.into_iter().collect(),
            work,
        }
    }

    /// The stream that runs it.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Its issue stamp: plans made later in this process (in the happens-before sense:
    /// on the same thread, or on a thread that learnt of this one) have higher stamps. Made
    /// in program order (one host thread, each call's plans made before it returns or
    /// posted behind it in the mailboxes its later calls use), the stamps are that order
    /// across every device and stream, which queues, where plans of different streams are
    /// submitted in any order, do not keep. For checkers and traces; see [`issue_clock`].
    pub fn issue(&self) -> u64 {
        self.issue
    }

    /// The event it completes (its sequence number on [`Plan::stream`]).
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// What it waits for first (see [`await_deps`]).
    pub fn deps(&self) -> &[Dep] {
        &self.deps
    }

    /// The work.
    pub fn work(&self) -> &Work {
        &self.work
    }

    /// Fails this plan's event with `message` without running it: for a plan that cannot
    /// be submitted (its stream's queue or actor is gone). Consumes the plan, which was
    /// the one permission to complete that event.
    ///
    /// The event is failed once the plan's dependencies and the previous operation of its
    /// stream are decided, as if the plan had waited for them and then failed: completing
    /// it earlier would let whatever is ordered after it go on while they still run (see
    /// `protocol/unsubmitted.rs`). Never blocks.
    pub fn fail_unsubmitted(self, message: impl Into<String>) {
        let seq = self.event.seq();
        let failure = std::sync::Arc::new(Failure {
            stream: self.stream,
            seq,
            operation: self.work.label(),
            message: message.into(),
        });
        let timeline = self.event.timeline().clone();
        super::unsubmitted::fail_when_ready(
            timeline,
            seq,
            self.deps.into_iter().map(|dep| dep.event),
            failure,
        );
    }

    /// Whether `timeline` is the one this plan completes an event of: the check every
    /// [`StreamQueue::submit`](crate::backend::StreamQueue::submit) makes before accepting
    /// it ([`Plan::check_queue`]).
    pub fn completes_on(&self, timeline: &crate::sync::Arc<crate::event::Timeline>) -> bool {
        crate::sync::Arc::ptr_eq(self.event.timeline(), timeline)
    }

    /// [`Error::WrongStream`] unless this plan's event is on `timeline`, the timeline of
    /// the queue it is submitted to (whose stream is `queue`). Every queue calls it first:
    /// a plan on a queue that does not complete its timeline would run unordered with the
    /// operations it was ordered against.
    pub fn check_queue(
        &self,
        queue: StreamId,
        timeline: &crate::sync::Arc<crate::event::Timeline>,
    ) -> Result<(), Error> {
        if self.stream == queue && self.completes_on(timeline) {
            Ok(())
        } else {
            Err(Error::WrongStream {
                plan: self.stream,
                queue,
                operation: self.work.label(),
            })
        }
    }
}

/// The process-wide issue counter behind [`Plan::issue`]. A statistic, not a lock: it
/// synchronises nothing (Relaxed) and only follows the order of the code that reads it,
/// which for one thread is program order and across threads is whatever the protocol's own
/// synchronisation (mailboxes, locks) already orders.
static ISSUE_CLOCK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The next issue stamp (for a plan being made now).
pub(crate) fn next_issue() -> u64 {
    ISSUE_CLOCK.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Issue stamps a host call reserves per step when it is posted to device actors: its
/// plans are stamped `base`, `base + 1`, ... and a later call's stamps start past them.
/// Reserved blocks start at a multiple of `OP_STAMPS` (`reserve_issue_stamps`), so the
/// end of the block a stamp is in is the end of its call's step.
pub const OP_STAMPS: u64 = 1 << 12;

crate::sync::thread::thread_local! {
    // loom's `thread_local!` takes no `const` initializer.
    #[allow(clippy::missing_const_for_thread_local)]
    /// The stamp in effect for what a device decides on this thread (set by
    /// `DeviceState::set_issue_stamp`), for host actions such as a pool release.
    static CURRENT_ISSUE: std::cell::Cell<Option<u64>> = std::cell::Cell::new(None);
}

/// Where in program order something a device does now belongs: the stamp of the operation
/// it is deciding on this thread (or, between operations, just after the last one it
/// decided), else the issue clock ([`issue_clock`]). Checkers place host actions (a
/// pool release) among plans with it.
pub fn current_issue() -> u64 {
    CURRENT_ISSUE.with(|c| c.get()).unwrap_or_else(issue_clock)
}

/// Sets [`current_issue`] for this thread.
pub(crate) fn set_current_issue(issue: Option<u64>) {
    CURRENT_ISSUE.with(|c| c.set(issue));
}

/// Reserves `n` consecutive issue stamps (a multiple of [`OP_STAMPS`]) and returns the
/// first: a host call posted to a device actor takes its stamps when it is posted (program
/// order), and the actor stamps the call's plans with them when it decides it later
/// ([`DeviceState::set_issue_stamp`]).
///
/// The first is a multiple of [`OP_STAMPS`] (the stamps skipped to get there are never
/// used): a device places what it does between calls (a pool release) at the end of the
/// `OP_STAMPS` block of its last stamp, which is then the end of that call's step and
/// before every stamp handed out later. Plans made without a reservation ([`next_issue`])
/// move the clock by one, so a reservation starting at the clock could straddle two
/// blocks, and the end of the first lay among the next call's stamps.
///
/// [`DeviceState::set_issue_stamp`]: crate::protocol::DeviceState::set_issue_stamp
pub(crate) fn reserve_issue_stamps(n: u64) -> u64 {
    debug_assert_eq!(n % OP_STAMPS, 0, "whole blocks of stamps are reserved");
    let update = |clock: u64| Some(clock.next_multiple_of(OP_STAMPS) + n);
    let before = ISSUE_CLOCK
        .fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            update,
        )
        .unwrap_or_else(|clock| clock);
    before.next_multiple_of(OP_STAMPS)
}

/// The issue clock now: every plan made before this call (in the happens-before sense) has
/// a lower [`Plan::issue`], every plan made after it a higher or equal one. For checkers
/// that place host actions (a pool release, the start of a program step) among plans.
pub fn issue_clock() -> u64 {
    ISSUE_CLOCK.load(std::sync::atomic::Ordering::Relaxed)
}

/// Waits for every dependency of a plan, as every executor must before running its work.
///
/// Returns the root cause of the first failed [`DepKind::Data`] dependency, if any: the
/// plan must then fail with it instead of running. Every dependency is waited for even
/// after one failed, so that a plan completes only after all its dependencies completed.
pub fn await_deps(deps: &[Dep]) -> Result<(), Arc<Failure>> {
    await_deps_observed(deps, |_, _| {})
}

/// [`await_deps`], calling `observe(dep, result)` around each wait that had to block
/// (the dependency was not complete when reached): `observe` is called with `None` before
/// blocking and with `Some(ok)` after. For timelines and profiling.
pub fn await_deps_observed(
    deps: &[Dep],
    mut observe: impl FnMut(&Dep, Option<bool>),
) -> Result<(), Arc<Failure>> {
    let mut failed: Option<Arc<Failure>> = None;
    for dep in deps {
        let blocked = !dep.event.is_done();
        if blocked {
            observe(dep, None);
        }
        let r = dep.event.wait();
        if blocked {
            observe(dep, Some(r.is_ok()));
        }
        if let Some(f) = dep.failure(&r) {
            failed.get_or_insert(f);
        }
    }
    match failed {
        Some(f) => Err(f),
        None => Ok(()),
    }
}
