//! Checking the dependency graph, not only the values (what Legion Spy does for Legion).
//!
//! Values can hide a missing dependency: two operations that must be ordered may simply
//! have run in the right order this time. So every plan a program submits is recorded by a
//! [`RecordingBackend`] (a wrapper, like `FaultBackend`, around any backend): its event,
//! the events it waits for (the edges the protocol emitted, data or order), the memory it
//! reads and writes (byte ranges of device pools, host arrays), and which operations had
//! already completed when it was submitted. [`GraphRecorder::check`] then derives the
//! orderings the sequential semantics require between plans that touch overlapping memory,
//! one of them writing (RAW, WAR, WAW), in program order, and checks that each is implied
//! by what the execution guarantees:
//!
//! - the emitted dependencies, transitively;
//! - same-stream FIFO order;
//! - completion before submission: a plan already complete when a later one was submitted
//!   precedes it (the protocol drops completed events from its tables, and a host wait
//!   makes what it waited for complete before the host goes on).
//!
//! The release of a pool's memory is checked the same way: every plan that used the pool
//! must have completed when it is released (a host action, so only completion counts).
//! A release is placed where the releasing device is in program order
//! (`protocol::current_issue`); one placed past the issue clock is itself reported
//! ([`GraphReport::misplaced`]), since plans made later could sort before it.
//!
//! A required ordering that none of these implies is a bug even if timing hid it. An
//! emitted dependency between two plans that share no memory with a write is counted as an
//! extra edge (over-synchronisation: it costs parallelism, not correctness).
//!
//! StreamProgram order is the order in which the protocol made the plans, their issue stamps
//! ([`Plan::issue`]): a program issued by one host thread has its plans made in program
//! order, by the [`tributary::Engine`] on the calling thread and by the actor system's
//! device actors in mailbox order, behind the round trips that make cross-device calls wait
//! for each other. Submission order is not program order in the actor system (its stream
//! actors submit the plans of different streams in any order), so the recorder sorts by
//! stamp; a host action (a pool release, the start of a program operation) is placed among
//! the plans by the issue clock ([`issue_clock`]) when it happens.
//!
//! Required orderings are kept transitively reduced, as the protocol's tables are: a read
//! needs the last overlapping write, a write needs the last overlapping write and the
//! latest overlapping read of each stream since (an earlier read on that stream precedes
//! the latest one by FIFO order). Memory is compared as it is, so the reuse of freed memory
//! by a later buffer is checked too.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    sync::{Arc, Mutex},
};

use tributary::{
    backend::{Backend, DeviceInfo, StreamQueue},
    kernels::{Access, RoutineSpec},
    memory::AlignedBuffer,
    protocol::{
        current_issue, issue_clock, ArgBinding, Dep, DepKind, GlobalLoc, Plan, StreamProgram, Work,
    },
    DeviceError, DeviceId, Event, PoolId, StreamId, Timeline,
};

/// Whether runners that can record the dependency graph do (`TRIBUTARY_GRAPH_CHECK=0`
/// turns it off, to measure its cost or to see what the value comparison alone catches).
pub fn enabled() -> bool {
    super::env_count("TRIBUTARY_GRAPH_CHECK", 1) != 0
}

/// A piece of memory plans touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Mem {
    /// A pool of a device.
    Pool { device: DeviceId, pool: PoolId },
    /// A host array (by address; the recorder keeps it alive, so addresses are not reused).
    Host(usize),
}

impl fmt::Display for Mem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mem::Pool { device, pool } => write!(f, "{device} {pool:?}"),
            Mem::Host(a) => write!(f, "host array {a:#x}"),
        }
    }
}

/// One memory access of a plan: bytes `start..end` of `mem`.
#[derive(Clone, Copy, Debug)]
struct Touch {
    mem: Mem,
    start: u64,
    end: u64,
    write: bool,
}

impl Touch {
    fn overlaps(&self, other: &Touch) -> bool {
        self.mem == other.mem && self.start < other.end && other.start < self.end
    }
}

/// What the recorder keeps of one submitted plan.
#[derive(Clone, Debug)]
struct Recorded {
    /// Its issue stamp (program order).
    issue: u64,
    stream: StreamId,
    seq: u64,
    label: String,
    /// The program operation during which it was submitted.
    op: usize,
    deps: Vec<(StreamId, u64, DepKind)>,
    /// Dependencies on operations not yet planned when this plan was submitted (the other
    /// half of a copy, decided later, possibly by the same thread): resolved into `deps`
    /// when the graph is checked. A decider must not wait for them at submit.
    deferred: Vec<(Event, DepKind)>,
    touches: Vec<Touch>,
    /// `(stream, completed sequence number)` of every stream when it was submitted.
    completed: Vec<(StreamId, u64)>,
}

/// The release of a pool's memory (a host action): every plan that used the pool must
/// have completed by then.
#[derive(Clone, Debug)]
struct Release {
    mem: Mem,
    /// The issue clock when it happened: plans with a lower stamp were made before it.
    issue: u64,
    op: usize,
    completed: Vec<(StreamId, u64)>,
}

#[derive(Default)]
struct State {
    /// `(issue clock, op)` at the start of each program operation.
    op_starts: Vec<(u64, usize)>,
    timelines: Vec<tributary::sync::Arc<Timeline>>,
    plans: Vec<Recorded>,
    releases: Vec<Release>,
    /// Releases placed past the issue clock (see [`GraphReport::misplaced`]).
    misplaced: Vec<String>,
    /// Host buffers of recorded plans, kept alive so that their addresses stay unique.
    keep: Vec<Arc<AlignedBuffer>>,
}

/// Collects the plans of one run; shared by a [`RecordingBackend`] and the test.
#[derive(Default)]
pub struct GraphRecorder {
    state: Mutex<State>,
}

// ---- reading plans: the one place that knows `Plan`'s API -------------------------------

/// The stream, sequence number, dependencies (those already planned, and those not yet)
/// and work of a plan.
#[allow(clippy::type_complexity)]
fn dep_parts(deps: &[Dep]) -> (Vec<(StreamId, u64, DepKind)>, Vec<(Event, DepKind)>) {
    let mut planned = Vec::new();
    let mut deferred = Vec::new();
    for d in deps {
        match d.event().planned_seq() {
            Some(seq) => planned.push((d.event().stream(), seq, d.kind())),
            None => deferred.push((d.event().clone(), d.kind())),
        }
    }
    (planned, deferred)
}

/// Where a kernel argument is, its size, and how the kernel uses it.
fn binding_parts(b: &ArgBinding) -> (GlobalLoc, u64, Access) {
    (b.loc(), b.bytes(), b.access())
}

fn device_touch(loc: GlobalLoc, bytes: u64, write: bool) -> Touch {
    Touch {
        mem: Mem::Pool {
            device: loc.device,
            pool: loc.loc.pool,
        },
        start: loc.loc.offset,
        end: loc.loc.offset + bytes.max(1),
        write,
    }
}

fn host_touch(host: &Arc<AlignedBuffer>, write: bool) -> Touch {
    Touch {
        mem: Mem::Host(Arc::as_ptr(host) as usize),
        start: 0,
        end: 1,
        write,
    }
}

/// The memory `work` reads and writes, and the host buffers it names.
fn touches(work: &Work) -> (Vec<Touch>, Vec<Arc<AlignedBuffer>>) {
    let mut out = Vec::new();
    let mut hosts = Vec::new();
    match work {
        Work::Run { args, merge, .. } => {
            for b in args.iter() {
                let (loc, bytes, access) = binding_parts(b);
                if access.reads() {
                    out.push(device_touch(loc, bytes, false));
                }
                if access.writes() {
                    out.push(device_touch(loc, bytes, true));
                }
            }
            if let Some(m) = merge {
                let (loc, bytes, _) = binding_parts(m);
                out.push(device_touch(loc, bytes, false));
            }
        }
        Work::Copy {
            src, dst, bytes, ..
        } => {
            out.push(device_touch(*src, *bytes, false));
            out.push(device_touch(*dst, *bytes, true));
        }
        Work::FromHost {
            host, dst, bytes, ..
        } => {
            out.push(host_touch(host, false));
            out.push(device_touch(*dst, *bytes, true));
            hosts.push(host.clone());
        }
        Work::ToHost {
            src, host, bytes, ..
        } => {
            out.push(device_touch(*src, *bytes, false));
            out.push(host_touch(host, true));
            hosts.push(host.clone());
        }
        Work::Memset { dst, bytes, .. } => out.push(device_touch(*dst, *bytes, true)),
        _ => {}
    }
    (out, hosts)
}

impl GraphRecorder {
    /// A recorder with nothing recorded.
    pub fn new() -> Arc<GraphRecorder> {
        Arc::new(GraphRecorder::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Plans submitted from now on belong to program operation `op`.
    pub fn begin_op(&self, op: usize) {
        let mut state = self.lock();
        state.op_starts.push((issue_clock(), op));
    }

    /// The program operation during which a plan with stamp `issue` was made.
    fn op_of(state: &State, issue: u64) -> usize {
        let i = state
            .op_starts
            .partition_point(|(start, _)| *start <= issue);
        i.checked_sub(1).map_or(0, |i| state.op_starts[i].1)
    }

    fn add_timeline(&self, timeline: tributary::sync::Arc<Timeline>) {
        self.lock().timelines.push(timeline);
    }

    fn record(&self, plan: &Plan) {
        self.record_op(
            plan.issue(),
            plan.stream(),
            plan.event().seq(),
            plan.deps(),
            plan.work(),
        );
    }

    /// Records every operation of a replayed stream's program, as the plans it stands for.
    fn record_program(&self, program: &StreamProgram) {
        for op in program.ops() {
            let work = op.to_work();
            self.record_op(op.issue(), program.stream(), op.seq(), op.deps(), &work);
        }
    }

    fn record_op(&self, issue: u64, stream: StreamId, seq: u64, deps: &[Dep], work: &Work) {
        let (deps, deferred) = dep_parts(deps);
        let (touches, hosts) = touches(work);
        let label = work.label();
        let mut state = self.lock();
        let completed = Self::completed(&state);
        let op = Self::op_of(&state, issue);
        state.keep.extend(hosts);
        state.plans.push(Recorded {
            issue,
            stream,
            seq,
            label,
            op,
            deps,
            deferred,
            touches,
            completed,
        });
    }

    fn completed(state: &State) -> Vec<(StreamId, u64)> {
        state
            .timelines
            .iter()
            .map(|t| (t.stream(), t.completed()))
            .collect()
    }

    fn release(&self, device: DeviceId, pool: PoolId) {
        let mut state = self.lock();
        // Where the device that releases it is in program order (the issue clock for a
        // single-owner engine; the operation being decided for a device actor).
        let issue = current_issue();
        let clock = issue_clock();
        if issue > clock {
            let at = Self::op_of(&state, clock);
            state.misplaced.push(format!(
                "[op {at}] the release of {device} {pool:?} is placed at issue {issue}, past \
                 the issue clock {clock}: a plan made after it could come before it"
            ));
        }
        let release = Release {
            mem: Mem::Pool { device, pool },
            issue,
            op: Self::op_of(&state, issue),
            completed: Self::completed(&state),
        };
        state.releases.push(release);
    }

    /// The pool releases so far, in the order they happened: device, pool, and where in
    /// program order they were placed (their issue clock).
    pub fn releases(&self) -> Vec<(DeviceId, PoolId, u64)> {
        self.lock()
            .releases
            .iter()
            .filter_map(|r| match r.mem {
                Mem::Pool { device, pool } => Some((device, pool, r.issue)),
                Mem::Host(_) => None,
            })
            .collect()
    }

    /// Checks the recorded graph (see the module docs).
    pub fn check(&self) -> GraphReport {
        let state = self.lock();
        let mut plans = state.plans.clone();
        drop(state);
        for p in &mut plans {
            // Every operation was planned (or refused) by the end of the run.
            for (e, kind) in p.deferred.drain(..) {
                p.deps.push((e.stream(), e.seq(), kind));
            }
        }
        let state = self.lock();
        plans.sort_by_key(|p| p.issue);
        let mut releases = state.releases.clone();
        releases.sort_by_key(|r| r.issue);
        let mut report = check_plans(&plans, &releases);
        report.misplaced = state.misplaced.clone();
        report
    }
}

/// One required ordering the execution did not guarantee.
#[derive(Clone, Debug)]
pub struct MissingEdge {
    /// StreamProgram operation of the earlier plan, and the plan.
    pub before_op: usize,
    /// The earlier plan, as `stream#seq label`.
    pub before: String,
    /// StreamProgram operation of the later plan.
    pub after_op: usize,
    /// The later plan.
    pub after: String,
    /// Why they must be ordered (`RAW on ...`).
    pub why: String,
}

impl fmt::Display for MissingEdge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "missing edge: [op {}] {} must complete before [op {}] {} starts ({}), \
             but no dependency, FIFO order or completion before submission implies it",
            self.before_op, self.before, self.after_op, self.after, self.why
        )
    }
}

/// What [`GraphRecorder::check`] found.
#[derive(Clone, Debug, Default)]
pub struct GraphReport {
    /// Plans recorded.
    pub plans: usize,
    /// Required orderings checked (transitively reduced, see the module docs).
    pub required: usize,
    /// Required orderings not implied.
    pub missing: Vec<MissingEdge>,
    /// Dependencies the protocol emitted (on plans of this run).
    pub deps: usize,
    /// Emitted dependencies between plans that share no memory with a write.
    pub extra: usize,
    /// Pool releases placed past the issue clock, among stamps not handed out yet (by
    /// `protocol::current_issue`, which places what a device does among its calls' plans):
    /// a plan made after the release, on a new pool with the same id, could then come
    /// before it and count as a use of the released pool. Always a bug in the placement.
    pub misplaced: Vec<String>,
}

fn conflict(a: &[Touch], b: &[Touch]) -> Option<(Touch, Touch)> {
    a.iter()
        .flat_map(|x| b.iter().map(move |y| (*x, *y)))
        .find(|(x, y)| (x.write || y.write) && x.overlaps(y))
}

/// One byte range of memory (the ranges of a piece of memory are disjoint): its last
/// writer and the latest reader of each stream since.
struct Segment {
    start: u64,
    end: u64,
    writer: Option<usize>,
    readers: Vec<usize>,
}

/// Splits the (disjoint) segments that straddle `start` or `end`, so that every segment
/// is either inside `start..end` or outside it.
fn split(segs: &mut Vec<Segment>, start: u64, end: u64) {
    for cut in [start, end] {
        let mut pieces = Vec::new();
        for seg in segs.iter_mut().filter(|s| s.start < cut && cut < s.end) {
            pieces.push(Segment {
                start: cut,
                end: seg.end,
                writer: seg.writer,
                readers: seg.readers.clone(),
            });
            seg.end = cut;
        }
        segs.extend(pieces);
    }
}

/// Checks `plans` in program order (sorted by issue stamp), with the pool `releases` among
/// them (sorted by issue clock).
fn check_plans(plans: &[Recorded], releases: &[Release]) -> GraphReport {
    let index: HashMap<(StreamId, u64), usize> = plans
        .iter()
        .enumerate()
        .map(|(i, p)| ((p.stream, p.seq), i))
        .collect();
    let mut streams: Vec<StreamId> = plans.iter().map(|p| p.stream).collect();
    for p in plans {
        streams.extend(p.completed.iter().map(|(s, _)| *s));
    }
    streams.sort();
    streams.dedup();
    let slot: HashMap<StreamId, usize> = streams.iter().enumerate().map(|(i, s)| (*s, i)).collect();

    // Happens-before as vector clocks: clock[q][k] = the highest sequence number of stream
    // k that precedes q. Predecessors: emitted deps, the previous plan of the stream, and
    // what had completed at submission. Kahn's order over those edges.
    let preds: Vec<Vec<usize>> = plans
        .iter()
        .map(|p| {
            let mut v: Vec<usize> = p
                .deps
                .iter()
                .filter_map(|(s, q, _)| index.get(&(*s, *q)).copied())
                .collect();
            v.extend(index.get(&(p.stream, p.seq.wrapping_sub(1))).copied());
            v.extend(
                p.completed
                    .iter()
                    .filter_map(|(s, c)| index.get(&(*s, *c)).copied()),
            );
            v
        })
        .collect();
    let mut succs = vec![Vec::new(); plans.len()];
    let mut waiting: Vec<usize> = preds.iter().map(Vec::len).collect();
    for (q, ps) in preds.iter().enumerate() {
        for &p in ps {
            succs[p].push(q);
        }
    }
    let mut clock = vec![vec![0u64; streams.len()]; plans.len()];
    let mut ready: Vec<usize> = (0..plans.len()).filter(|&q| waiting[q] == 0).collect();
    let mut done = 0;
    while let Some(q) = ready.pop() {
        done += 1;
        let mut c = vec![0u64; streams.len()];
        for &p in &preds[q] {
            for (x, y) in c.iter_mut().zip(&clock[p]) {
                *x = (*x).max(*y);
            }
        }
        for (s, n) in &plans[q].completed {
            let k = slot[s];
            c[k] = c[k].max(*n);
        }
        let k = slot[&plans[q].stream];
        c[k] = c[k].max(plans[q].seq);
        clock[q] = c;
        for &r in &succs[q] {
            waiting[r] -= 1;
            if waiting[r] == 0 {
                ready.push(r);
            }
        }
    }
    assert_eq!(
        done,
        plans.len(),
        "the recorded plans wait for each other in a cycle"
    );
    let precedes = |p: usize, q: usize| plans[p].seq <= clock[q][slot[&plans[p].stream]];
    let show = |i: usize| {
        let p = &plans[i];
        format!("{}#{} {}", p.stream, p.seq, p.label)
    };

    // Required orderings, in program (issue) order.
    let mut memory: HashMap<Mem, Vec<Segment>> = HashMap::new();
    let mut required: HashSet<(usize, usize)> = HashSet::new();
    let mut report = GraphReport {
        plans: plans.len(),
        ..GraphReport::default()
    };
    let mut releases = releases.iter().peekable();
    for q in 0..=plans.len() {
        // Pools released before plan `q` was made: every use must be complete, and a later
        // pool with the same id is other memory.
        while let Some(r) = releases.next_if(|r| plans.get(q).is_none_or(|p| r.issue <= p.issue)) {
            let mut users: Vec<usize> = Vec::new();
            for seg in memory.remove(&r.mem).into_iter().flatten() {
                users.extend(seg.writer);
                users.extend(seg.readers);
            }
            users.sort_unstable();
            users.dedup();
            for p in users {
                report.required += 1;
                let done = r
                    .completed
                    .iter()
                    .any(|(s, n)| *s == plans[p].stream && plans[p].seq <= *n);
                if !done {
                    report.missing.push(MissingEdge {
                        before_op: plans[p].op,
                        before: show(p),
                        after_op: r.op,
                        after: format!("the release of {}", r.mem),
                        why: "the pool's memory is freed".into(),
                    });
                }
            }
        }
        let Some(plan) = plans.get(q) else {
            break;
        };
        let mut need: Vec<(usize, &'static str, Touch)> = Vec::new();
        for t in &plan.touches {
            for seg in memory.get(&t.mem).into_iter().flatten() {
                if seg.start >= t.end || t.start >= seg.end {
                    continue;
                }
                if let Some(w) = seg.writer {
                    need.push((w, if t.write { "WAW" } else { "RAW" }, *t));
                }
                if t.write {
                    need.extend(seg.readers.iter().map(|&r| (r, "WAR", *t)));
                }
            }
        }
        for (p, kind, t) in need {
            if p == q || !required.insert((p, q)) {
                continue;
            }
            if !precedes(p, q) {
                report.missing.push(MissingEdge {
                    before_op: plans[p].op,
                    before: show(p),
                    after_op: plan.op,
                    after: show(q),
                    why: format!("{kind} on {} bytes {}..{}", t.mem, t.start, t.end),
                });
            }
        }
        for t in plan.touches.iter().filter(|t| !t.write) {
            let segs = memory.entry(t.mem).or_default();
            split(segs, t.start, t.end);
            let mut gaps = vec![(t.start, t.end)];
            for seg in segs
                .iter_mut()
                .filter(|s| t.start <= s.start && s.end <= t.end)
            {
                seg.readers.retain(|&r| plans[r].stream != plan.stream);
                seg.readers.push(q);
                gaps = gaps
                    .into_iter()
                    .flat_map(|(a, b)| [(a, b.min(seg.start)), (a.max(seg.end), b)])
                    .filter(|(a, b)| a < b)
                    .collect();
            }
            segs.extend(gaps.into_iter().map(|(start, end)| Segment {
                start,
                end,
                writer: None,
                readers: vec![q],
            }));
        }
        for t in plan.touches.iter().filter(|t| t.write) {
            let segs = memory.entry(t.mem).or_default();
            split(segs, t.start, t.end);
            segs.retain(|s| !(t.start <= s.start && s.end <= t.end));
            segs.push(Segment {
                start: t.start,
                end: t.end,
                writer: Some(q),
                readers: Vec::new(),
            });
        }
    }
    report.required += required.len();

    // Emitted edges no rule requires.
    for plan in plans {
        for (s, n, _) in &plan.deps {
            let Some(&p) = index.get(&(*s, *n)) else {
                continue;
            };
            report.deps += 1;
            if conflict(&plans[p].touches, &plan.touches).is_none() {
                report.extra += 1;
            }
        }
    }
    report
}

/// A backend that records every plan submitted to its streams in a [`GraphRecorder`], then
/// hands it to the wrapped backend unchanged.
pub struct RecordingBackend {
    inner: Arc<dyn Backend>,
    recorder: Arc<GraphRecorder>,
}

impl RecordingBackend {
    /// Wraps `inner`, recording into `recorder`.
    pub fn new(inner: Arc<dyn Backend>, recorder: Arc<GraphRecorder>) -> RecordingBackend {
        RecordingBackend { inner, recorder }
    }
}

impl Backend for RecordingBackend {
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
        self.inner.create_pool(device, pool, bytes, align)
    }

    fn release_pool(&self, device: DeviceId, pool: PoolId) {
        self.recorder.release(device, pool);
        self.inner.release_pool(device, pool)
    }

    unsafe fn start_stream(
        &self,
        stream: StreamId,
        timeline: tributary::sync::Arc<Timeline>,
    ) -> Result<Box<dyn StreamQueue>, DeviceError> {
        // SAFETY: our caller's promise, passed on unchanged: `RecordingQueue` forwards
        // exactly the plans it receives, untouched (it only reads them), to the queue of
        // the same stream and timeline.
        let inner = unsafe { self.inner.start_stream(stream, timeline.clone()) }?;
        self.recorder.add_timeline(timeline);
        Ok(Box::new(RecordingQueue {
            inner,
            recorder: self.recorder.clone(),
        }))
    }

    fn can_stream(&self, src: DeviceId, dst: DeviceId) -> bool {
        self.inner.can_stream(src, dst)
    }

    fn min_alignment(&self, device: DeviceId) -> u64 {
        self.inner.min_alignment(device)
    }

    fn check_routine(&self, device: DeviceId, spec: &RoutineSpec) -> tributary::Result<()> {
        self.inner.check_routine(device, spec)
    }

    fn device_info(&self, device: DeviceId) -> Result<DeviceInfo, DeviceError> {
        self.inner.device_info(device)
    }
}

struct RecordingQueue {
    inner: Box<dyn StreamQueue>,
    recorder: Arc<GraphRecorder>,
}

impl StreamQueue for RecordingQueue {
    fn submit(&self, plan: Plan) -> tributary::Result<()> {
        self.recorder.record(&plan);
        self.inner.submit(plan)
    }

    fn runs_programs(&self) -> bool {
        self.inner.runs_programs()
    }

    fn submit_program(&self, program: StreamProgram) -> tributary::Result<()> {
        self.recorder.record_program(&program);
        self.inner.submit_program(program)
    }

    fn shutdown(&self) {
        self.inner.shutdown()
    }

    fn shutdown_within(&self, timeout: std::time::Duration) -> bool {
        self.inner.shutdown_within(timeout)
    }
}

/// Totals of the graph checks of many programs, for the summary line.
#[derive(Clone, Copy, Debug, Default)]
pub struct GraphTotals {
    /// Programs checked.
    pub programs: u64,
    /// Plans recorded.
    pub plans: u64,
    /// Required orderings checked.
    pub required: u64,
    /// Required orderings missing.
    pub missing: u64,
    /// Dependencies emitted.
    pub deps: u64,
    /// Extra dependencies.
    pub extra: u64,
}

impl GraphTotals {
    /// Adds one program's report.
    pub fn add(&mut self, r: &GraphReport) {
        self.programs += 1;
        self.plans += r.plans as u64;
        self.required += r.required as u64;
        self.missing += r.missing.len() as u64;
        self.deps += r.deps as u64;
        self.extra += r.extra as u64;
    }
}

impl fmt::Display for GraphTotals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "graph check: {} programs, {} plans, {} required orderings, {} missing, {} extra \
             edges (of {} emitted dependencies)",
            self.programs, self.plans, self.required, self.missing, self.extra, self.deps
        )
    }
}
