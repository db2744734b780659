//! Automatic replay: the dispatcher recognises a repeated sequence of calls and replays it
//! without a capture call. See DESIGN.md §4, "Automatic replay".
//!
//! Explicit capture asks the user to find the repeated step and wrap it. Here the dispatcher
//! does it, in three phases, all under one lock ([`AutoReplay`]) that every call passes:
//!
//! 1. **Recognition.** Each call leaves a 64-bit fingerprint (routine, context, binding
//!    shape, copy endpoints and mode; never binding values) in a [`Recognizer`]. A period
//!    of `p` calls is found once the last `3p` calls repeat it three times in a row. Calls
//!    that cannot be captured (reads, transfers, queries: *observing* calls) take part as
//!    barriers; a call that could change what a capture decides (a finalize, a host write,
//!    an explicit capture or replay: *invalidating* calls) restarts recognition.
//! 2. **Learning.** The period is cut into *segments*, the runs of capturable calls between
//!    barriers. The next time a segment starts, its calls are issued for real while every
//!    device records them (`CaptureBuild`), exactly as `System::capture` does; once the
//!    devices decided them the segment has a [`Step`].
//! 3. **Replay.** From then on a call that matches the next call of the period exactly
//!    (the same routine, contexts, node, mode, binding shape) is *held*: it returns a
//!    [`HeldEvent`] at once, and the segment's last call replays the step with the held
//!    calls' index values, in one operation per device. Each held ticket becomes the last
//!    operation of its stream in the replay.
//!
//! **Fallback.** Held calls are issued exactly as they would have been, in their order, by
//! the first of: a call that does not match the period (the period is then forgotten and
//! learned again), a call that is not replayed (a barrier, another thread's call), a wait
//! on a held ticket, `System::issue_held`, a shutdown. Because every call, and every post of a held call or a replay, takes
//! the lock, a call that starts after a held call returned is posted after it: program
//! order is issue order, as without the feature. A learned step is replayed only while the
//! period repeats exactly and no invalidating call came, so its devices never refuse it:
//! what a replay checks (live contexts, merge buffers in place, hosted nodes current) only
//! changes through calls that end the period. An invalidating call is told and posted
//! under the lock; a host write is in flight from its start to its commit, and nothing is
//! learned, captured or replayed meanwhile (`AutoReplay::begin_write`).
//!
//! **Locks.** This lock comes before a hosted node's lock, never under one: held calls are
//! posted under it, and a post touching a hosted node takes that node's lock; so host
//! writes and reads tell the automatic replay before they take their node's lock.

use std::sync::Arc as StdArc;

use smallvec::SmallVec;

use crate::{
    engine::MergeBufferUse,
    error::{Error, Result},
    ids::StreamId,
    kernels::Bindings,
    node::TensorNode,
    pending::{Oneshot, OneshotPool, PendingEvent, PooledCell},
    protocol::{Context, Routine},
    replay::Step,
    sync::{Arc, Mutex},
    trace::{HostMark, Recorder},
};

use super::{
    messages::{Answer, DeviceOp},
    steps::CaptureBuild,
    system::{AllReduceCall, Dispatcher, Via},
};

/// The longest period recognised, in calls.
pub const MAX_PERIOD: usize = 1024;
/// The fewest calls a learned period without barriers has: a shorter one is learned as
/// its smallest multiple at least this long. A replay of a few calls costs about what
/// issuing them does; across devices each replay also pays its checks and copy answers.
/// 64 measured best of 32 and 64 on Task Bench's two-device runs (`BENCHMARKS.md`).
pub const MIN_PERIOD: usize = 64;
/// Fingerprints the recogniser keeps (a power of two above [`MAX_PERIOD`]).
const HISTORY: usize = 2 * MAX_PERIOD;

/// What a call that is not replayed does to the automatic replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Barrier {
    /// It only observes (a read, a transfer, a query, a new context or routine): it may be
    /// part of a period, as a barrier between segments. The fingerprint of its kind.
    Observing(u64),
    /// It may change what a captured step decides (a finalize, a host write, a context
    /// made from host data, an explicit capture or replay, a schedule or copy made outside
    /// the automatic replay): what was learned is forgotten.
    Invalidating,
}

impl Barrier {
    /// The kind of a read of a context's value (`Dispatcher::read_value`).
    pub(crate) const READ: u64 = 5;
    /// The kind of a query or a fence of every device.
    pub(crate) const QUERY: u64 = 7;
    /// The kind of a host read (`Dispatcher::host_read`).
    pub(crate) const HOST_READ: u64 = 8;

    /// An observing call of one kind (as [`Barrier::of`] makes it for one operation).
    pub(crate) fn observing(kind: u64) -> Barrier {
        Barrier::Observing(mix(SEED, kind) | 1)
    }

    /// What a call posting `ops` is.
    pub(crate) fn of<'a>(ops: impl Iterator<Item = &'a DeviceOp>) -> Barrier {
        let mut fp = SEED;
        for op in ops {
            let kind = match op {
                DeviceOp::Gated { op, .. } => match Barrier::of(std::iter::once(&**op)) {
                    Barrier::Observing(k) => k,
                    Barrier::Invalidating => return Barrier::Invalidating,
                },
                DeviceOp::NewContext { .. } => 1,
                DeviceOp::Link { .. } => 2,
                DeviceOp::Transfer { up, .. } => 3 + u64::from(*up),
                DeviceOp::Read { .. } => Barrier::READ,
                DeviceOp::TransferToHost { .. } => 6,
                DeviceOp::Query(_) => Barrier::QUERY,
                _ => return Barrier::Invalidating,
            };
            fp = mix(fp, kind);
        }
        Barrier::Observing(fp | 1)
    }
}

/// Where a barrier's fingerprint starts.
const SEED: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(h: u64, v: u64) -> u64 {
    (h.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95)
}

/// A call the automatic replay may replay, as the caller made it.
#[derive(Clone, Copy)]
pub(crate) enum Call<'a> {
    Schedule(&'a Routine, &'a Bindings),
    Copy {
        node: &'a TensorNode,
        src: &'a Context,
        dst: &'a Context,
        mode: &'a MergeBufferUse,
    },
    AllReduce(&'a AllReduceCall),
}

fn routine_fp(r: &Routine) -> u64 {
    StdArc::as_ptr(&r.0) as usize as u64
}

fn context_fp(c: &Context) -> u64 {
    mix(u64::from(c.device().0), c.id().0)
}

fn same_routine(a: &Routine, b: &Routine) -> bool {
    StdArc::ptr_eq(&a.0, &b.0)
}

fn same_context(a: &Context, b: &Context) -> bool {
    a.device() == b.device() && a.id() == b.id()
}

fn same_mode(a: &MergeBufferUse, b: &MergeBufferUse) -> bool {
    match (a, b) {
        (MergeBufferUse::No, MergeBufferUse::No) | (MergeBufferUse::Copy, MergeBufferUse::Copy) => {
            true
        }
        (MergeBufferUse::StreamingFor(x), MergeBufferUse::StreamingFor(y)) => same_routine(x, y),
        _ => false,
    }
}

fn same_all_reduce(a: &AllReduceCall, b: &AllReduceCall) -> bool {
    let routines = |x: &[Vec<Routine>], y: &[Vec<Routine>]| {
        x.len() == y.len()
            && x.iter().zip(y).all(|(x, y)| {
                x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_routine(x, y))
            })
    };
    a.steps == b.steps
        && a.transfer == b.transfer
        && a.nodes.len() == b.nodes.len()
        && a.nodes.iter().zip(&b.nodes).all(|(x, y)| x.id() == y.id())
        && a.contexts.len() == b.contexts.len()
        && a.contexts
            .iter()
            .zip(&b.contexts)
            .all(|(x, y)| same_context(x, y))
        && routines(&a.merge, &b.merge)
        && routines(&a.scale, &b.scale)
}

impl Call<'_> {
    /// The call's fingerprint (even: a capturable call); never its binding values.
    fn fingerprint(&self) -> u64 {
        let fp = match *self {
            Call::Schedule(r, b) => mix(mix(1, routine_fp(r)), u64::from(b.is_empty())),
            Call::Copy {
                node,
                src,
                dst,
                mode,
            } => {
                let mode = match mode {
                    MergeBufferUse::No => 0,
                    MergeBufferUse::Copy => 1,
                    MergeBufferUse::StreamingFor(r) => routine_fp(r),
                };
                let h = mix(mix(2, u64::from(node.id().0)), context_fp(src));
                mix(mix(h, context_fp(dst)), mode)
            }
            Call::AllReduce(c) => {
                let mut h = mix(3, c.steps.len() as u64);
                for x in &c.contexts {
                    h = mix(h, context_fp(x));
                }
                for n in &c.nodes {
                    h = mix(h, u64::from(n.id().0));
                }
                for r in c.merge.iter().chain(&c.scale).flatten() {
                    h = mix(h, routine_fp(r));
                }
                h
            }
        };
        fp & !1
    }

    /// The call kept to compare later calls with, and to issue again.
    fn key(&self) -> Key {
        match *self {
            Call::Schedule(r, b) => Key::Schedule {
                routine: r.clone(),
                indexed: !b.is_empty(),
            },
            Call::Copy {
                node,
                src,
                dst,
                mode,
            } => Key::Copy {
                node: node.clone(),
                src: src.clone(),
                dst: dst.clone(),
                mode: mode.clone(),
            },
            Call::AllReduce(c) => Key::AllReduce(StdArc::new(c.clone())),
        }
    }

    /// Issues the call now, as the dispatcher always does (its posts the automatic
    /// replay's own): its tickets, none for a copy between contexts sharing the buffer.
    fn issue(&self, d: &Dispatcher) -> Result<SmallVec<[PendingEvent; 1]>> {
        Ok(match *self {
            Call::Schedule(r, b) => {
                smallvec::smallvec![d.schedule_recorded(r, b.clone(), None, Via::Auto)?]
            }
            Call::Copy {
                node,
                src,
                dst,
                mode,
            } => d
                .device_to_device_recorded(node, src, dst, mode.clone(), None, Via::Auto)?
                .into_iter()
                .collect(),
            Call::AllReduce(c) => d
                .all_reduce_recorded(c, None, Via::Auto)?
                .into_iter()
                .collect(),
        })
    }

    /// [`Call::issue`], its tickets as the automatic replay returns them.
    fn issue_now(&self, d: &Dispatcher) -> Result<SmallVec<[Issued; 1]>> {
        Ok(self.issue(d)?.into_iter().map(Issued::Now).collect())
    }

    /// Issues the call into `build`, the capture of its segment.
    fn capture(
        &self,
        d: &Dispatcher,
        build: &mut CaptureBuild,
    ) -> Result<SmallVec<[PendingEvent; 1]>> {
        Ok(match *self {
            Call::Schedule(r, b) => {
                smallvec::smallvec![build.schedule(d, r, b.clone(), Via::Auto)?]
            }
            Call::Copy {
                node,
                src,
                dst,
                mode,
            } => build
                .device_to_device(d, node, src, dst, mode.clone(), Via::Auto)?
                .into_iter()
                .collect(),
            Call::AllReduce(c) => build.all_reduce(d, c, Via::Auto)?.into_iter().collect(),
        })
    }
}

/// A learned call, exactly: what a later call must be to be replayed. Cheap to clone.
#[derive(Clone)]
enum Key {
    Schedule {
        routine: Routine,
        indexed: bool,
    },
    Copy {
        node: TensorNode,
        src: Context,
        dst: Context,
        mode: MergeBufferUse,
    },
    AllReduce(StdArc<AllReduceCall>),
}

impl Key {
    fn matches(&self, call: &Call<'_>) -> bool {
        match (self, call) {
            (Key::Schedule { routine, indexed }, Call::Schedule(r, b)) => {
                same_routine(routine, r) && *indexed != b.is_empty()
            }
            (
                Key::Copy {
                    node,
                    src,
                    dst,
                    mode,
                },
                Call::Copy {
                    node: n,
                    src: s,
                    dst: t,
                    mode: m,
                },
            ) => {
                node.id() == n.id()
                    && same_context(src, s)
                    && same_context(dst, t)
                    && same_mode(mode, m)
            }
            (Key::AllReduce(c), Call::AllReduce(d)) => same_all_reduce(c, d),
            _ => false,
        }
    }

    /// The call again, with `bindings` (a schedule's).
    fn call<'a>(&'a self, bindings: &'a Bindings) -> Call<'a> {
        match self {
            Key::Schedule { routine, .. } => Call::Schedule(routine, bindings),
            Key::Copy {
                node,
                src,
                dst,
                mode,
            } => Call::Copy {
                node,
                src,
                dst,
                mode,
            },
            Key::AllReduce(c) => Call::AllReduce(c),
        }
    }
}

/// Finds periods in a stream of fingerprints: a period `p` is found once each of the last
/// `2p` fingerprints equals the one `p` before it (the last `3p` calls are the same `p`
/// calls three times). The candidate `p` is the distance to the previous occurrence of a
/// fingerprint that broke the run; O(1) per call, amortised.
///
/// The last occurrences are kept exactly, every fingerprint of the last [`MAX_PERIOD`]
/// calls: a table of one entry per bucket forgot one of two fingerprints sharing a bucket,
/// and a period made of them was never found (one period of two calls in 4,096).
pub struct Recognizer {
    history: Box<[u64]>,
    /// Each fingerprint's last call number, exactly for the last [`MAX_PERIOD`] calls.
    last_seen: LastSeen,
    calls: u64,
    candidate: u64,
    run: u64,
}

/// The last call number of each fingerprint seen in the last [`MAX_PERIOD`] calls, never
/// forgetting one of them: an open-addressing table (linear probing from a hash of the
/// fingerprint) with twice as many slots as live entries can number. A slot whose entry
/// is older than [`MAX_PERIOD`] calls is *stale*: reused for a fingerprint not in the table,
/// but never the end of a probe (only a never-used slot is), so no live entry behind it is
/// lost. When half the slots were ever used, the live entries are moved to a fresh table:
/// a rebuild of O(slots) every thousand or more new fingerprints.
struct LastSeen {
    /// `(fingerprint, call number)`; `NEVER` in the call number: never used.
    slots: Box<[(u64, u64)]>,
    /// The table a rebuild moves the live entries into (allocated once, swapped).
    spare: Box<[(u64, u64)]>,
    /// Slots ever used since the last rebuild.
    used: usize,
}

impl LastSeen {
    /// Slots: four times [`MAX_PERIOD`], so a table half used holds every live entry
    /// (at most `MAX_PERIOD + 1`) with room to spare.
    const SLOTS: usize = 4 * MAX_PERIOD;
    const NEVER: u64 = u64::MAX;

    fn new() -> LastSeen {
        let empty = || vec![(0, Self::NEVER); Self::SLOTS].into_boxed_slice();
        LastSeen {
            slots: empty(),
            spare: empty(),
            used: 0,
        }
    }

    fn home(fp: u64) -> usize {
        let h = mix(fp, 0);
        ((h ^ (h >> 29)) as usize) & (Self::SLOTS - 1)
    }

    fn live(at: u64, now: u64) -> bool {
        at != Self::NEVER && now - at <= MAX_PERIOD as u64
    }

    /// Records `fp` at call `now`; returns its previous call number, if it has one.
    fn replace(&mut self, fp: u64, now: u64) -> Option<u64> {
        let home = Self::home(fp);
        // Most calls find their fingerprint in its home slot.
        let (seen, at) = self.slots[home];
        if seen == fp && at != Self::NEVER {
            self.slots[home].1 = now;
            return Some(at);
        }
        self.probe(fp, now, home)
    }

    /// [`LastSeen::replace`] past the home slot.
    #[cold]
    #[inline(never)]
    fn probe(&mut self, fp: u64, now: u64, home: usize) -> Option<u64> {
        let mut reuse = None;
        let mut j = home;
        for _ in 0..Self::SLOTS {
            let (seen, at) = self.slots[j];
            if at == Self::NEVER {
                break;
            }
            if seen == fp {
                self.slots[j].1 = now;
                return Some(at);
            }
            if reuse.is_none() && !Self::live(at, now) {
                reuse = Some(j);
            }
            j = (j + 1) & (Self::SLOTS - 1);
        }
        match reuse {
            Some(r) => self.slots[r] = (fp, now),
            None => {
                self.slots[j] = (fp, now);
                self.used += 1;
                if self.used * 2 >= Self::SLOTS {
                    self.rebuild(now);
                }
            }
        }
        None
    }

    /// Moves the live entries into the spare table, which becomes the table.
    fn rebuild(&mut self, now: u64) {
        self.spare.fill((0, Self::NEVER));
        self.used = 0;
        for k in 0..Self::SLOTS {
            let (fp, at) = self.slots[k];
            if !Self::live(at, now) {
                continue;
            }
            let mut j = Self::home(fp);
            while self.spare[j].1 != Self::NEVER {
                j = (j + 1) & (Self::SLOTS - 1);
            }
            self.spare[j] = (fp, at);
            self.used += 1;
        }
        std::mem::swap(&mut self.slots, &mut self.spare);
    }

    #[cfg(test)]
    fn live_entries(&self, now: u64) -> usize {
        self.slots
            .iter()
            .filter(|&&(_, at)| Self::live(at, now))
            .count()
    }
}

impl Default for Recognizer {
    fn default() -> Self {
        Recognizer::new()
    }
}

impl Recognizer {
    /// An empty recogniser (its tables are allocated here, once).
    pub fn new() -> Recognizer {
        Recognizer {
            history: vec![0; HISTORY].into_boxed_slice(),
            last_seen: LastSeen::new(),
            calls: 0,
            candidate: 0,
            run: 0,
        }
    }

    /// Adds a call's fingerprint; `Some(p)` once the last `3p` calls repeat a period of `p`
    /// (the period is [`Recognizer::last`]`(p)`; the next call is expected to be its first).
    pub fn push(&mut self, fp: u64) -> Option<usize> {
        let i = self.calls;
        let c = self.candidate;
        let previous = self.last_seen.replace(fp, i);
        if c > 0 && self.history[((i - c) as usize) % HISTORY] == fp {
            self.run += 1;
        } else {
            match previous {
                Some(at) if i - at <= MAX_PERIOD as u64 => {
                    self.candidate = i - at;
                    self.run = 1;
                }
                _ => {
                    self.candidate = 0;
                    self.run = 0;
                }
            }
        }
        self.history[(i as usize) % HISTORY] = fp;
        self.calls += 1;
        let c = self.candidate;
        (c > 0 && self.run >= 2 * c).then_some(c as usize)
    }

    /// The last `p` fingerprints, oldest first.
    pub fn last(&self, p: usize) -> Vec<u64> {
        let n = self.calls;
        (n - p as u64..n)
            .map(|i| self.history[(i as usize) % HISTORY])
            .collect()
    }

    /// Forgets the current candidate: a period must be seen three times again.
    pub fn restart(&mut self) {
        self.candidate = 0;
        self.run = 0;
    }
}

/// What the automatic replay did ([`Dispatcher::replay_stats`], `System::replay_stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReplayStats {
    /// Calls the automatic replay saw (schedules, copies, all-reduces).
    pub calls: u64,
    /// Periods recognised (each learned anew after it broke).
    pub periods: u64,
    /// Segments captured into steps.
    pub steps: u64,
    /// Steps replayed.
    pub replays: u64,
    /// Calls replayed (held, then replayed as part of a step).
    pub calls_replayed: u64,
    /// Why held calls or learned periods were given up.
    pub fallbacks: Fallbacks,
}

/// Why the automatic replay fell back to issuing ([`ReplayStats::fallbacks`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Fallbacks {
    /// A call did not match the next call of the period: it was forgotten.
    pub mismatch: u64,
    /// An invalidating call (a finalize, a host write, an explicit capture or replay, an
    /// operation issued outside the automatic replay) made it forget a period.
    pub invalidated: u64,
    /// Held calls issued because a call that is not replayed came before their segment
    /// ended (a barrier, another thread's call).
    pub interrupted: u64,
    /// Held calls issued because a ticket of one of them was waited on.
    pub waited: u64,
    /// Segments whose capture a device refused (never replayed; the period is kept).
    pub capture_refused: u64,
}

/// Where a segment of the learned period stands.
enum SegmentState {
    /// Not captured yet: the next time it starts, it is.
    Waiting,
    /// Being captured (its calls issued and recorded).
    Capturing(CaptureBuild),
    /// Captured: its devices decide it (one fence each, waited for when it next starts).
    Deciding(CaptureBuild, Vec<Answer<()>>),
    /// Captured and decided: replayed from its next start.
    Ready(Step),
    /// Its capture was refused: issued call by call.
    Failed,
}

/// A run of capturable calls of the period, between barriers.
struct Segment {
    start: usize,
    len: usize,
    state: SegmentState,
}

/// A call of the learned period.
struct LearnedCall {
    fp: u64,
    /// Its segment (`None`: a barrier).
    segment: Option<usize>,
    /// The call exactly, once its segment was captured.
    key: Option<Key>,
    /// The streams of its tickets, in the order the call returns them.
    streams: SmallVec<[StreamId; 1]>,
}

/// A recognised period, rotated to start a segment right after a barrier when it has one.
struct Learned {
    calls: Vec<LearnedCall>,
    segments: Vec<Segment>,
    /// The position of the next expected call.
    pos: usize,
}

impl Learned {
    /// The period `fps` (oldest first; the next call is expected to be `fps[0]`), or `None`
    /// when it has no capturable call.
    fn new(fps: &[u64]) -> Option<Learned> {
        let p = fps.len();
        let barrier = |i: usize| fps[i % p] & 1 == 1;
        // A segment starts right after a barrier (at 0 when the period has none).
        let r = (0..p)
            .find(|&i| barrier(i + p - 1) && !barrier(i))
            .unwrap_or(0);
        if (0..p).all(barrier) {
            return None;
        }
        let mut calls: Vec<LearnedCall> = (0..p)
            .map(|i| LearnedCall {
                fp: fps[(i + r) % p],
                segment: None,
                key: None,
                streams: SmallVec::new(),
            })
            .collect();
        let mut segments: Vec<Segment> = Vec::new();
        for i in 0..p {
            if calls[i].fp & 1 == 1 {
                continue;
            }
            let continues = i > 0 && calls[i - 1].fp & 1 == 0;
            if !continues {
                segments.push(Segment {
                    start: i,
                    len: 0,
                    state: SegmentState::Waiting,
                });
            }
            let s = segments.len() - 1;
            segments[s].len += 1;
            calls[i].segment = Some(s);
        }
        Some(Learned {
            calls,
            segments,
            pos: (p - r) % p,
        })
    }
}

/// The hold side of a held call's ticket; dropped undecided, it decides it as refused.
struct HeldSlot {
    cell: Option<Arc<Oneshot<Result<PendingEvent>>>>,
    pool: Arc<OneshotPool<Result<PendingEvent>>>,
}

impl HeldSlot {
    fn resolve(mut self, value: Result<PendingEvent>) {
        if let Some(cell) = self.cell.take() {
            cell.set(value);
            self.pool.give_back(cell);
        }
    }
}

impl Drop for HeldSlot {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            cell.set(Err(Error::ShutDown(
                "the dispatcher stopped holding a call before it was issued".into(),
            )));
            self.pool.give_back(cell);
        }
    }
}

/// A held call: its position in the period, the call, its index values, its tickets' slots.
struct HeldCall {
    at: usize,
    key: Key,
    bindings: Bindings,
    slots: std::ops::Range<usize>,
}

/// The calls held for the segment being replayed.
#[derive(Default)]
struct Hold {
    generation: u64,
    /// When its first call was held (for the timeline's mark of its replay).
    since: Option<std::time::Instant>,
    segment: usize,
    calls: Vec<HeldCall>,
    slots: Vec<HeldSlot>,
    /// The index values of the held schedules of routines with indices (the step's slots).
    values: Vec<Bindings>,
}

struct AutoState {
    recognizer: Recognizer,
    learned: Option<Learned>,
    hold: Hold,
    stats: ReplayStats,
    /// Host writes in flight ([`AutoReplay::begin_write`] to [`AutoReplay::end_write`]):
    /// nothing is learned, captured or replayed meanwhile.
    writing: usize,
}

/// The automatic replay of one dispatcher (see the module documentation).
pub struct AutoReplay {
    state: Mutex<AutoState>,
    cells: Arc<OneshotPool<Result<PendingEvent>>>,
    /// The timeline, when one is recorded: each replay is marked on it.
    timeline: Option<StdArc<Recorder>>,
}

impl std::fmt::Debug for AutoReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AutoReplay").finish_non_exhaustive()
    }
}

/// A call's ticket as the automatic replay returns it.
#[derive(Clone, Debug)]
pub enum Issued {
    /// Issued at once.
    Now(PendingEvent),
    /// Held for a replay (see [`HeldEvent`]).
    Held(HeldEvent),
}

/// The ticket of a held call: the last operation of its stream in the replay of its segment,
/// or its own operation when it was issued instead. Asking for it before either happened
/// issues every held call first (a wait never waits on a call nobody will issue).
#[derive(Clone)]
pub struct HeldEvent {
    cell: PooledCell<Result<PendingEvent>>,
    dispatcher: StdArc<Dispatcher>,
    generation: u64,
}

impl std::fmt::Debug for HeldEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.cell.get() {
            Some(Ok(p)) => write!(f, "HeldEvent({p:?})"),
            Some(Err(e)) => write!(f, "HeldEvent(error: {e})"),
            None => f.write_str("HeldEvent(held)"),
        }
    }
}

impl HeldEvent {
    /// The operation, if the held call was issued or replayed already.
    pub fn try_pending(&self) -> Option<Result<PendingEvent>> {
        self.cell.get()
    }

    /// The operation: issues the held calls first if they still are (then counted in
    /// [`Fallbacks::waited`]).
    pub fn pending(&self) -> Result<PendingEvent> {
        if let Some(p) = self.cell.get() {
            return p;
        }
        if let Some(auto) = self.dispatcher.auto() {
            auto.release(&self.dispatcher, self.generation);
        }
        self.cell.get().unwrap_or_else(|| {
            Err(Error::Internal(
                "a held call was neither issued nor replayed".into(),
            ))
        })
    }
}

impl AutoReplay {
    pub(crate) fn new(timeline: Option<StdArc<Recorder>>) -> AutoReplay {
        AutoReplay {
            timeline,
            state: Mutex::new(AutoState {
                recognizer: Recognizer::new(),
                learned: None,
                hold: Hold::default(),
                stats: ReplayStats::default(),
                writing: 0,
            }),
            cells: OneshotPool::new(),
        }
    }

    pub(crate) fn stats(&self) -> ReplayStats {
        self.state.lock().stats
    }

    /// A call that is not replayed: issues what is held, then follows or forgets the period.
    pub(crate) fn interrupt(&self, d: &Dispatcher, barrier: Barrier) {
        self.interrupt_posting(d, barrier, || ());
    }

    /// [`AutoReplay::interrupt`], then `post` (the call's own post): under the lock for an
    /// invalidating call, so that nothing is learned or replayed between what it tells and
    /// what it does (a finalize posted after a step using its context was captured again
    /// would make the devices refuse that step's replay).
    pub(crate) fn interrupt_posting<T>(
        &self,
        d: &Dispatcher,
        barrier: Barrier,
        post: impl FnOnce() -> T,
    ) -> T {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        if !st.hold.calls.is_empty() && !mutant!("auto_no_flush") {
            st.stats.fallbacks.interrupted += st.hold.calls.len() as u64;
            flush(d, st);
        }
        match barrier {
            Barrier::Invalidating => {
                forget(st);
                let out = post();
                drop(guard);
                return out;
            }
            Barrier::Observing(fp) => {
                let followed = st.learned.as_mut().is_some_and(|l| {
                    let next = l.calls[l.pos].fp == fp;
                    if next {
                        l.pos = (l.pos + 1) % l.calls.len();
                    }
                    next
                });
                if !followed {
                    if st.learned.take().is_some() {
                        st.stats.fallbacks.mismatch += 1;
                        st.recognizer.restart();
                    }
                    if st.writing == 0 {
                        if let Some(p) = st.recognizer.push(fp) {
                            learn(st, p);
                        }
                    }
                }
            }
        }
        drop(guard);
        post()
    }

    /// A host write starts: what is held is issued and what was learned forgotten, and
    /// nothing is learned, captured or replayed until [`AutoReplay::end_write`] (the host
    /// array changes when the write commits, after its fences: a step captured before the
    /// commit and replayed after it would be refused, its hosted reads lagging).
    pub(crate) fn begin_write(&self, d: &Dispatcher) {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        if !st.hold.calls.is_empty() {
            st.stats.fallbacks.interrupted += st.hold.calls.len() as u64;
            flush(d, st);
        }
        forget(st);
        st.writing += 1;
    }

    /// A host write ended (committed or failed): what was learned during it is forgotten.
    pub(crate) fn end_write(&self) {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        st.writing = st.writing.saturating_sub(1);
        forget(st);
    }

    /// Issues whatever is held (counted as interrupted).
    pub(crate) fn release_all(&self, d: &Dispatcher) {
        let mut st = self.state.lock();
        let st = &mut *st;
        if !st.hold.calls.is_empty() {
            st.stats.fallbacks.interrupted += st.hold.calls.len() as u64;
            flush(d, st);
        }
    }

    /// A wait on a held ticket of hold `generation`: issues the hold if it still is.
    fn release(&self, d: &Dispatcher, generation: u64) {
        let mut st = self.state.lock();
        let st = &mut *st;
        if st.hold.generation == generation && !st.hold.calls.is_empty() {
            st.stats.fallbacks.waited += st.hold.calls.len() as u64;
            flush(d, st);
        }
    }

    /// A capturable call: issued, captured, or held (see the module documentation).
    pub(crate) fn call(
        &self,
        d: &StdArc<Dispatcher>,
        call: Call<'_>,
    ) -> Result<SmallVec<[Issued; 1]>> {
        let fp = call.fingerprint();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        st.stats.calls += 1;
        if st.writing > 0 {
            return call.issue_now(d);
        }
        if let Some(l) = &mut st.learned {
            let k = l.pos;
            let lc = &l.calls[k];
            let matches = lc.fp == fp && lc.key.as_ref().is_none_or(|key| key.matches(&call));
            match lc.segment {
                Some(s) if matches => {
                    l.pos = (k + 1) % l.calls.len();
                    return self.in_segment(d, st, call, k, s);
                }
                _ => {
                    if !st.hold.calls.is_empty() {
                        st.stats.fallbacks.interrupted += st.hold.calls.len() as u64;
                        flush(d, st);
                    }
                    st.learned = None;
                    st.stats.fallbacks.mismatch += 1;
                    st.recognizer.restart();
                }
            }
        }
        if let Some(p) = st.recognizer.push(fp) {
            learn(st, p);
        }
        call.issue_now(d)
    }

    /// The call at position `k` of the learned period, in segment `s`, matched.
    fn in_segment(
        &self,
        d: &StdArc<Dispatcher>,
        st: &mut AutoState,
        call: Call<'_>,
        k: usize,
        s: usize,
    ) -> Result<SmallVec<[Issued; 1]>> {
        let Some(l) = st.learned.as_mut() else {
            return Err(Error::Internal("no learned period".into()));
        };
        let seg = &mut l.segments[s];
        let first = k == seg.start;
        let last = k + 1 == seg.start + seg.len;
        if first {
            let state = std::mem::replace(&mut seg.state, SegmentState::Failed);
            seg.state = match state {
                SegmentState::Waiting => SegmentState::Capturing(CaptureBuild::new()),
                SegmentState::Deciding(build, fences) => {
                    // Its devices decided the capture long ago in a program that runs
                    // ahead (a period later); waiting here, when they did not, makes the
                    // replay start at the same call every run.
                    let decided = fences.iter().try_for_each(|f| f.wait());
                    match decided.and_then(|()| build.finish()) {
                        Ok(step) => {
                            st.stats.steps += 1;
                            SegmentState::Ready(step)
                        }
                        Err(_) => {
                            st.stats.fallbacks.capture_refused += 1;
                            SegmentState::Failed
                        }
                    }
                }
                // A capture left unfinished (a wait released it mid-segment) starts over.
                SegmentState::Capturing(_) => SegmentState::Capturing(CaptureBuild::new()),
                other => other,
            };
        }
        match &mut seg.state {
            SegmentState::Capturing(build) => {
                let issued = match call.capture(d, build) {
                    Ok(issued) => issued,
                    Err(e) => {
                        // Refused before posting: the period did not happen as learned.
                        st.learned = None;
                        st.recognizer.restart();
                        return Err(e);
                    }
                };
                let lc = &mut l.calls[k];
                lc.key = Some(call.key());
                lc.streams = issued.iter().map(|p| p.stream()).collect();
                if last {
                    let state = std::mem::replace(&mut seg.state, SegmentState::Failed);
                    if let SegmentState::Capturing(build) = state {
                        seg.state = match build.fences(d) {
                            Ok(fences) => SegmentState::Deciding(build, fences),
                            Err(_) => SegmentState::Failed,
                        };
                    }
                }
                Ok(issued.into_iter().map(Issued::Now).collect())
            }
            SegmentState::Ready(_)
                if first || (!st.hold.calls.is_empty() && st.hold.segment == s) =>
            {
                let hold = &mut st.hold;
                if first {
                    hold.generation += 1;
                    hold.segment = s;
                    hold.since = self.timeline.as_ref().map(|_| std::time::Instant::now());
                }
                let start = hold.slots.len();
                let mut tickets = SmallVec::new();
                for _ in 0..l.calls[k].streams.len() {
                    let cell = self.cells.take();
                    tickets.push(Issued::Held(HeldEvent {
                        cell: PooledCell::new(cell.clone(), Some(self.cells.clone())),
                        dispatcher: d.clone(),
                        generation: hold.generation,
                    }));
                    hold.slots.push(HeldSlot {
                        cell: Some(cell),
                        pool: self.cells.clone(),
                    });
                }
                let bindings = match call {
                    Call::Schedule(_, b) => b.clone(),
                    _ => Bindings::none(),
                };
                if !bindings.is_empty() {
                    hold.values.push(bindings.clone());
                }
                let Some(key) = l.calls[k].key.clone() else {
                    return Err(Error::Internal("a captured call has no key".into()));
                };
                hold.calls.push(HeldCall {
                    at: k,
                    key,
                    bindings,
                    slots: start..hold.slots.len(),
                });
                if last {
                    replay_hold(d, st, self.timeline.as_deref());
                }
                Ok(tickets)
            }
            _ => call.issue_now(d),
        }
    }
}

/// Forgets the learned period (an invalidating call; mutant `auto_stale` keeps it) and
/// restarts recognition.
fn forget(st: &mut AutoState) {
    if mutant!("auto_stale") {
        return;
    }
    if st.learned.take().is_some() {
        st.stats.fallbacks.invalidated += 1;
    }
    st.recognizer.restart();
}

/// Learns the period of the last `p` calls (see [`Learned::new`]); one without barriers
/// as its multiple of at least [`MIN_PERIOD`] calls.
fn learn(st: &mut AutoState, p: usize) {
    let mut fps = st.recognizer.last(p);
    if fps.iter().all(|fp| fp & 1 == 0) && p < MIN_PERIOD {
        let times = MIN_PERIOD.div_ceil(p).min(MAX_PERIOD / p);
        fps = fps.repeat(times);
    }
    st.learned = Learned::new(&fps);
    if st.learned.is_some() {
        st.stats.periods += 1;
    }
    st.recognizer.restart();
}

/// Replays the complete hold as its segment's step; issues it call by call if the replay
/// cannot be posted.
fn replay_hold(d: &Dispatcher, st: &mut AutoState, timeline: Option<&Recorder>) {
    let Some(l) = &st.learned else {
        return flush(d, st);
    };
    let SegmentState::Ready(step) = &l.segments[st.hold.segment].state else {
        return flush(d, st);
    };
    let hold = &mut st.hold;
    let values = (!hold.values.is_empty()).then_some(&hold.values[..]);
    if hold.values.len() != step.inner.slots.len() {
        return flush(d, st);
    }
    match d.replay_via(step, values, Via::Auto) {
        Ok(lasts) => {
            st.stats.replays += 1;
            st.stats.calls_replayed += hold.calls.len() as u64;
            if let (Some(rec), Some(since)) = (timeline, hold.since.take()) {
                rec.mark(HostMark {
                    name: format!("replayed {} calls of step {}", hold.calls.len(), step.id()),
                    start_ns: rec.ns(since),
                    end_ns: rec.ns(std::time::Instant::now()),
                });
            }
            let mut slots = hold.slots.drain(..);
            for held in hold.calls.drain(..) {
                for &stream in &l.calls[held.at].streams {
                    let Some(slot) = slots.next() else { break };
                    slot.resolve(
                        lasts
                            .iter()
                            .find(|p| p.stream() == stream)
                            .cloned()
                            .ok_or_else(|| {
                                Error::Internal(format!(
                                    "a replayed step has no operation on {stream}"
                                ))
                            }),
                    );
                }
            }
            drop(slots);
            hold.values.clear();
        }
        Err(_) => flush(d, st),
    }
}

/// Issues every held call, in order, as it would have been issued.
fn flush(d: &Dispatcher, st: &mut AutoState) {
    let hold = &mut st.hold;
    hold.values.clear();
    let mut slots = hold.slots.drain(..);
    for held in hold.calls.drain(..) {
        let issued = held.key.call(&held.bindings).issue(d);
        let n = held.slots.len();
        match issued {
            Ok(events) => {
                let mut events = events.into_iter();
                for _ in 0..n {
                    if let Some(slot) = slots.next() {
                        slot.resolve(events.next().ok_or_else(|| {
                            Error::Internal("a held call issued fewer tickets".into())
                        }));
                    }
                }
            }
            Err(e) => {
                for _ in 0..n {
                    if let Some(slot) = slots.next() {
                        slot.resolve(Err(e.clone()));
                    }
                }
            }
        }
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;

    fn feed(r: &mut Recognizer, fps: impl IntoIterator<Item = u64>) -> Vec<(usize, usize)> {
        fps.into_iter()
            .enumerate()
            .filter_map(|(i, fp)| r.push(fp).map(|p| (i, p)))
            .collect()
    }

    #[test]
    fn a_period_is_found_on_its_third_repetition() {
        let mut r = Recognizer::new();
        let period = [2u64, 4, 6, 8, 10];
        let found = feed(&mut r, period.iter().copied().cycle().take(15));
        // Found at the last call of the third repetition, with its five calls.
        assert_eq!(found.first(), Some(&(14, 5)));
        assert_eq!(r.last(5), period.to_vec());
    }

    #[test]
    fn a_period_repeating_a_call_inside_is_found_a_period_later_at_most() {
        let mut r = Recognizer::new();
        let period = [2u64, 4, 2, 6, 8];
        let found = feed(&mut r, period.iter().copied().cycle().take(20));
        let &(at, p) = found.first().expect("a period");
        assert_eq!(p, 5);
        assert!(at < 20, "found at call {at}");
        // The last five calls are the period, rotated to where it was found.
        let last = r.last(5);
        let rotated = (0..5).any(|k| (0..5).all(|i| last[i] == period[(i + k) % 5]));
        assert!(rotated, "{last:?}");
    }

    #[test]
    fn a_prefix_that_does_not_repeat_delays_nothing_after_it() {
        let mut r = Recognizer::new();
        let noise = (100..140).map(|x| x * 2);
        let period = [10u64, 12, 14];
        let found = feed(&mut r, noise.chain(period.iter().copied().cycle().take(9)));
        assert_eq!(found.first(), Some(&(48, 3)));
    }

    /// `n` even fingerprints with the same home slot in [`LastSeen`].
    fn same_home(n: usize) -> Vec<u64> {
        let home = LastSeen::home(2);
        (1..)
            .map(|x: u64| x * 2)
            .filter(|&fp| LastSeen::home(fp) == home)
            .take(n)
            .collect()
    }

    /// Two calls whose fingerprints share a slot of the table of last occurrences still
    /// make a period (a table that kept one entry per slot forgot one of them, and never
    /// found such a period: about one period of two calls in 4,096 was never replayed).
    #[test]
    fn a_period_of_calls_sharing_a_slot_is_found() {
        let fps = same_home(2);
        let mut r = Recognizer::new();
        let found = feed(&mut r, fps.iter().copied().cycle().take(6));
        assert_eq!(found.first(), Some(&(5, 2)));
    }

    /// A stale entry ahead of a live one on its probe does not hide it, and its slot is
    /// reused by a fingerprint not in the table.
    #[test]
    fn a_stale_entry_hides_no_live_one_behind_it() {
        let fps = same_home(3);
        let (a, b, c) = (fps[0], fps[1], fps[2]);
        let period = MAX_PERIOD as u64;
        let mut t = LastSeen::new();
        assert_eq!(t.replace(a, 0), None);
        assert_eq!(t.replace(b, 1), None);
        // `a` is stale from call `period + 1`; `b` is still live then.
        assert_eq!(t.replace(b, period + 1), Some(1));
        assert_eq!(t.replace(c, period + 2), None);
        assert_eq!(t.used, 2, "`c` took `a`'s stale slot");
        assert_eq!(t.replace(c, period + 3), Some(period + 2));
        assert_eq!(t.replace(b, period + 4), Some(period + 1));
    }

    #[test]
    fn held_tickets_cross_threads() {
        fn check<T: Send + Sync>() {}
        check::<HeldEvent>();
        check::<Issued>();
        check::<AutoReplay>();
    }

    #[test]
    fn no_period_in_distinct_calls() {
        let mut r = Recognizer::new();
        assert!(feed(&mut r, (0..10_000).map(|x| x * 2)).is_empty());
        // Rebuilt many times, never more than half used; every live entry kept.
        assert!(
            r.last_seen.used * 2 < LastSeen::SLOTS,
            "{}",
            r.last_seen.used
        );
        assert_eq!(r.last_seen.live_entries(r.calls - 1), MAX_PERIOD + 1);
    }

    /// After thousands of distinct calls (the table rebuilt many times), the longest period
    /// is still found on its third repetition: no fingerprint of it was dropped.
    #[test]
    fn the_longest_period_is_found_after_rebuilds() {
        let mut r = Recognizer::new();
        let p = MAX_PERIOD as u64;
        let noise = (0..5_000).map(|x| 2 * (x + p));
        let period = (0..3 * p).map(|x| (x % p) * 2);
        let found = feed(&mut r, noise.chain(period));
        assert_eq!(
            found.first(),
            Some(&(5_000 + 3 * MAX_PERIOD - 1, MAX_PERIOD))
        );
    }

    #[test]
    fn a_period_longer_than_the_limit_is_not_found() {
        let mut r = Recognizer::new();
        let p = MAX_PERIOD as u64 + 1;
        assert!(feed(&mut r, (0..4 * p).map(|x| (x % p) * 2)).is_empty());
    }

    #[test]
    fn a_learned_period_starts_after_its_barrier_and_splits_into_segments() {
        // Calls a b | c d e | (| = a barrier), seen as the last period b | c d e | a.
        let fps = [4, 1, 6, 8, 10, 3, 2];
        let l = Learned::new(&fps).expect("capturable calls");
        let order: Vec<u64> = l.calls.iter().map(|c| c.fp).collect();
        assert_eq!(order, vec![6, 8, 10, 3, 2, 4, 1]);
        let segs: Vec<(usize, usize)> = l.segments.iter().map(|s| (s.start, s.len)).collect();
        assert_eq!(segs, vec![(0, 3), (4, 2)]);
        // The next call is fps[0] (4), at its rotated position.
        assert_eq!(l.calls[l.pos].fp, 4);
        assert!(Learned::new(&[1, 3]).is_none());
    }
}
