//! Fault injection, as test support: a [`Backend`] wrapper that makes chosen operations fail.
//!
//! [`FaultBackend`] wraps any backend. On every pool creation and every submitted plan it
//! consults a shared table of [`FaultRule`]s, the [`FaultRules`]. A matching rule's
//! [`Fault`] replaces what would have happened. Faults take effect where real failures do:
//! on the stream, after the operation's dependencies completed, through the wrapped
//! backend's own failure path. `Panic`, `Error` and `KillWorker` replace the work with a
//! [`Kernel::Cpu`] kernel that keeps the operation's label, so wrap the CPU backend for
//! them. `KillWorker` relies on the CPU backend treating an escaped panic as the death of
//! the stream's worker.
//!
//! ```
//! use std::sync::Arc;
//! use tributary::{backend::cpu::CpuBackend, backend::fault::*, DeviceId, Engine};
//!
//! let rules = FaultRules::default();
//! let backend = FaultBackend::new(Arc::new(CpuBackend::new(DeviceId(0), 2)), rules.clone());
//! let engine = Engine::with_backend(Arc::new(backend), 2, Default::default())?;
//! // Every routine whose name contains "boom" panics, once.
//! rules.add(FaultRule::once(Target::work().label("boom"), Fault::Panic("injected".into())));
//! # Ok::<(), tributary::Error>(())
//! ```

use std::{
    fmt,
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::{
    backend::{Backend, StreamQueue},
    error::{DeviceError, Result},
    event::{Event, Timeline},
    ids::{DeviceId, PoolId, StreamId},
    kernels::{CpuKernel, Kernel},
    protocol::{Dep, DepKind, Plan, Work},
    sync::Arc,
};

/// The kind of work a plan does, for matching ([`WorkTarget::kind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkKind {
    /// A routine ([`Work::Run`]).
    Run,
    /// A buffer-to-buffer copy ([`Work::Copy`]): device to device, merge-buffer copies.
    Copy,
    /// A host-to-device transfer ([`Work::FromHost`]).
    FromHost,
    /// A device-to-host transfer ([`Work::ToHost`]), including engine reads.
    ToHost,
    /// Zeroing a new buffer ([`Work::Memset`]).
    Memset,
    /// A marker ([`Work::Marker`]).
    Marker,
}

impl WorkKind {
    /// The kind of `work`.
    pub fn of(work: &Work) -> WorkKind {
        match work {
            Work::Run { .. } => WorkKind::Run,
            Work::Copy { .. } => WorkKind::Copy,
            Work::FromHost { .. } => WorkKind::FromHost,
            Work::ToHost { .. } => WorkKind::ToHost,
            Work::Memset { .. } => WorkKind::Memset,
            Work::Marker => WorkKind::Marker,
        }
    }
}

/// Which plans a [`Target::Work`] rule matches: all the criteria that are set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkTarget {
    /// Only plans on this stream.
    pub stream: Option<StreamId>,
    /// Only plans of this kind.
    pub kind: Option<WorkKind>,
    /// Only plans whose label ([`Work::label`], the routine name for routines) contains this.
    pub label: Option<String>,
}

impl WorkTarget {
    /// Restricts the target to plans on `stream`.
    pub fn stream(mut self, stream: StreamId) -> Self {
        self.stream = Some(stream);
        self
    }

    /// Restricts the target to plans of `kind`.
    pub fn kind(mut self, kind: WorkKind) -> Self {
        self.kind = Some(kind);
        self
    }

    /// Restricts the target to plans whose label contains `text`.
    pub fn label(mut self, text: impl Into<String>) -> Self {
        self.label = Some(text.into());
        self
    }

    fn matches(&self, plan: &Plan) -> bool {
        self.stream.is_none_or(|s| s == plan.stream)
            && self.kind.is_none_or(|k| k == WorkKind::of(&plan.work))
            && self
                .label
                .as_ref()
                .is_none_or(|l| plan.work.label().contains(l.as_str()))
    }
}

impl From<WorkTarget> for Target {
    fn from(w: WorkTarget) -> Target {
        Target::Work(w)
    }
}

/// What a rule applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// Plans submitted to streams.
    Work(WorkTarget),
    /// Creation of a pool's memory on a device (any device when `None`).
    PoolCreate(Option<DeviceId>),
}

impl Target {
    /// Every plan; narrow it with the [`WorkTarget`] builder methods.
    pub fn work() -> WorkTarget {
        WorkTarget::default()
    }
}

/// What happens to a matching operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The operation runs a kernel that panics with this message.
    Panic(String),
    /// The operation fails with this message without running (a pool creation fails with
    /// [`DeviceError::OutOfMemory`]).
    Error(String),
    /// The operation runs normally once this much time has passed since its submission.
    Delay(Duration),
    /// The stream's worker dies while running the operation: it fails, and every later
    /// operation of the stream fails with the worker's death as root cause.
    KillWorker,
}

/// One rule of a [`FaultRules`] table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// What it applies to.
    pub target: Target,
    /// What it does.
    pub fault: Fault,
    /// How many more matches it applies to (`None`: every match).
    pub times: Option<u32>,
}

impl FaultRule {
    /// A rule applying to every match.
    pub fn always(target: impl Into<Target>, fault: Fault) -> FaultRule {
        FaultRule {
            target: target.into(),
            fault,
            times: None,
        }
    }

    /// A rule applying to the first match only.
    pub fn once(target: impl Into<Target>, fault: Fault) -> FaultRule {
        FaultRule {
            target: target.into(),
            fault,
            times: Some(1),
        }
    }
}

/// Identifies a rule in its table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RuleId(u64);

#[derive(Default)]
struct Table {
    next: u64,
    rules: Vec<(RuleId, FaultRule, u32)>,
}

/// The shared rule table: clone it to keep a handle while the backend holds another.
#[derive(Clone, Default)]
pub struct FaultRules {
    table: Arc<Mutex<Table>>,
}

impl fmt::Debug for FaultRules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.lock();
        f.debug_list()
            .entries(t.rules.iter().map(|(id, r, hits)| (id, r, hits)))
            .finish()
    }
}

impl FaultRules {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a rule; rules are consulted in the order they were added, first match wins.
    pub fn add(&self, rule: FaultRule) -> RuleId {
        let mut t = self.lock();
        let id = RuleId(t.next);
        t.next += 1;
        t.rules.push((id, rule, 0));
        id
    }

    /// Removes a rule (and forgets its hit count).
    pub fn remove(&self, id: RuleId) {
        self.lock().rules.retain(|(i, _, _)| *i != id);
    }

    /// Removes every rule.
    pub fn clear(&self) {
        self.lock().rules.clear();
    }

    /// How many operations rule `id` has applied to so far (0 once removed).
    pub fn hits(&self, id: RuleId) -> u32 {
        self.lock()
            .rules
            .iter()
            .find(|(i, _, _)| *i == id)
            .map_or(0, |(_, _, h)| *h)
    }

    /// The fault of the first rule matching, counting the hit.
    fn take(&self, matches: impl Fn(&Target) -> bool) -> Option<Fault> {
        let mut t = self.lock();
        let (_, rule, hits) = t
            .rules
            .iter_mut()
            .find(|(_, r, _)| r.times != Some(0) && matches(&r.target))?;
        *hits += 1;
        if let Some(n) = rule.times.as_mut() {
            *n -= 1;
        }
        Some(rule.fault.clone())
    }
}

/// A backend whose operations fail where the rules say (see the [module docs](self)).
pub struct FaultBackend {
    inner: Arc<dyn Backend>,
    rules: FaultRules,
}

impl FaultBackend {
    /// Wraps `inner`; `rules` may be changed at any time through another handle.
    pub fn new(inner: Arc<dyn Backend>, rules: FaultRules) -> FaultBackend {
        FaultBackend { inner, rules }
    }

    /// The rule table.
    pub fn rules(&self) -> &FaultRules {
        &self.rules
    }
}

impl Backend for FaultBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn devices(&self) -> Vec<DeviceId> {
        self.inner.devices()
    }

    fn create_pool(
        &self,
        device: DeviceId,
        pool: PoolId,
        bytes: u64,
        align: u64,
    ) -> Result<(), DeviceError> {
        let fault = self.rules.take(|t| match t {
            Target::PoolCreate(d) => d.is_none_or(|d| d == device),
            Target::Work(_) => false,
        });
        match fault {
            Some(Fault::Delay(d)) => std::thread::sleep(d),
            Some(_) => return Err(DeviceError::OutOfMemory { requested: bytes }),
            None => {}
        }
        self.inner.create_pool(device, pool, bytes, align)
    }

    fn release_pool(&self, device: DeviceId, pool: PoolId) {
        self.inner.release_pool(device, pool)
    }

    fn device_info(&self, device: DeviceId) -> Result<super::DeviceInfo, DeviceError> {
        self.inner.device_info(device)
    }

    unsafe fn start_stream(
        &self,
        stream: StreamId,
        timeline: Arc<Timeline>,
    ) -> Result<Box<dyn StreamQueue>, DeviceError> {
        // SAFETY: our caller's promise, passed on: the plans `FaultQueue` forwards are the
        // caller's plans, with the same event, the same bindings (an injected kernel runs
        // over the operation's own bindings, or none) and at least the same dependencies
        // (a delay adds one), so they keep the protocol's ordering.
        let inner = unsafe { self.inner.start_stream(stream, timeline.clone()) }?;
        Ok(Box::new(FaultQueue {
            inner,
            rules: self.rules.clone(),
            timeline,
        }))
    }

    fn can_stream(&self, src: DeviceId, dst: DeviceId) -> bool {
        self.inner.can_stream(src, dst)
    }

    fn min_alignment(&self, device: DeviceId) -> u64 {
        self.inner.min_alignment(device)
    }

    fn check_routine(
        &self,
        device: DeviceId,
        spec: &crate::kernels::RoutineSpec,
    ) -> crate::error::Result<()> {
        self.inner.check_routine(device, spec)
    }
}

struct FaultQueue {
    inner: Box<dyn StreamQueue>,
    rules: FaultRules,
    timeline: Arc<Timeline>,
}

impl StreamQueue for FaultQueue {
    fn submit(&self, plan: Plan) -> Result<()> {
        let fault = self.rules.take(|t| match t {
            Target::Work(w) => w.matches(&plan),
            Target::PoolCreate(_) => false,
        });
        let plan = match fault {
            Some(fault) => inject(plan, fault, &self.timeline),
            None => plan,
        };
        self.inner.submit(plan)
    }

    fn shutdown(&self) {
        self.inner.shutdown()
    }

    fn shutdown_within(&self, timeout: Duration) -> bool {
        self.inner.shutdown_within(timeout)
    }
}

/// Replaces the work of `plan` by a CPU kernel with the same label, or delays it.
fn inject(mut plan: Plan, fault: Fault, timeline: &Arc<Timeline>) -> Plan {
    let kernel = match fault {
        Fault::Delay(d) => {
            plan.deps.push(Dep {
                event: timer(plan.stream, Instant::now() + d),
                kind: DepKind::Order,
            });
            return plan;
        }
        Fault::Panic(message) => CpuKernel::new(move |_| panic!("{message}")),
        Fault::Error(message) => CpuKernel::new(move |_| Err(message.clone())),
        Fault::KillWorker => {
            let (timeline, seq) = (timeline.clone(), plan.event.seq());
            // The payload is made when the kernel runs: a kernel dropped without running
            // must not unwind the thread that happens to drop it.
            CpuKernel::new(move |_| {
                std::panic::resume_unwind(Box::new(WorkerKiller {
                    timeline: timeline.clone(),
                    seq,
                    last: false,
                }))
            })
        }
    };
    // A routine keeps its bindings (a panicking kernel may see them); other work is only
    // replaced, its label kept so that the failure names it.
    plan.work = match plan.work {
        Work::Run {
            name,
            args,
            merge,
            bindings,
            ..
        } => Work::Run {
            name,
            kernel: Kernel::Cpu(kernel),
            args,
            merge,
            bindings,
        },
        other => Work::Run {
            name: other.label().into(),
            kernel: Kernel::Cpu(kernel),
            args: Vec::new().into(),
            merge: None,
            bindings: crate::kernels::Bindings::none(),
        },
    };
    plan
}

/// An event that completes at `at`, on a private timeline signalled by a timer thread.
fn timer(stream: StreamId, at: Instant) -> Event {
    let timeline = Timeline::new(StreamId {
        device: DeviceId(u32::MAX),
        index: stream.index,
    });
    let t = timeline.clone();
    let spawned = std::thread::Builder::new()
        .name("tributary-fault-timer".into())
        .spawn(move || {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            t.signal(1);
        });
    if spawned.is_err() {
        // No thread for the timer: no delay rather than a wait that never ends.
        timeline.signal(1);
    }
    Event::new(timeline, 1)
}

/// The panic payload of [`Fault::KillWorker`]: unwinds out of every `catch_unwind` between
/// the kernel and the worker's top frame, so that the worker thread itself dies.
///
/// Each time it is dropped (a `catch_unwind` caught it and let it go) it resumes unwinding
/// with a fresh payload: as long as its operation is still pending, to escape the next
/// catch; once the backend has failed the operation, one last time, to take the worker
/// down. The last payload drops quietly.
struct WorkerKiller {
    timeline: Arc<Timeline>,
    seq: u64,
    last: bool,
}

impl Drop for WorkerKiller {
    fn drop(&mut self) {
        if self.last || std::thread::panicking() {
            return;
        }
        let last = !self.timeline.status(self.seq).is_pending();
        std::panic::resume_unwind(Box::new(WorkerKiller {
            timeline: self.timeline.clone(),
            seq: self.seq,
            last,
        }));
    }
}

#[cfg(all(test, not(tributary_loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rules_count_hits_and_expire() {
        let rules = FaultRules::default();
        let a = rules.add(FaultRule::once(
            Target::PoolCreate(None),
            Fault::Error("x".into()),
        ));
        let b = rules.add(FaultRule::always(
            Target::PoolCreate(Some(DeviceId(1))),
            Fault::Error("y".into()),
        ));
        let pool = |t: &Target| matches!(t, Target::PoolCreate(_));
        assert_eq!(rules.take(pool), Some(Fault::Error("x".into())));
        assert_eq!(rules.take(pool), Some(Fault::Error("y".into())));
        assert_eq!(rules.take(pool), Some(Fault::Error("y".into())));
        assert_eq!((rules.hits(a), rules.hits(b)), (1, 2));
        rules.remove(b);
        assert_eq!(rules.take(pool), None);
        assert_eq!(rules.hits(b), 0);
    }
}
