//! Capture and replay on one device's tables. See DESIGN.md §4, "Step capture and replay".
//!
//! Capture: after the protocol planned an operation of a captured step for real, the
//! `record_*` functions describe it to the device's [`StepRecorder`] (which buffers it
//! touches, how, and where its merge buffer is), never changing a table.
//!
//! Replay ([`DeviceState::replay`]): once [`DeviceState::check_replay`] found nothing the
//! step's decisions depend on changed, the templates are issued in order with fresh
//! sequence numbers. A template's entry dependencies are looked up in the tables as they
//! are when the replay starts (they are left untouched until the last template is issued),
//! with the protocol's own `read_deps` / `write_deps`; its edges to earlier templates are
//! this replay's events. Then every touched buffer's record is set to the state the step
//! leaves: its last writer, and the readers since. No routine is resolved, no dependency is
//! inferred from a routine's parameters.

use std::sync::Arc;

use super::DeviceState;
use crate::{
    error::{Error, Invalidation, Result},
    event::Event,
    ids::{BufferLoc, StreamId},
    kernels::{Access, Bindings},
    node::TensorNode,
    protocol::{
        context::{Context, Routine},
        host::{DeviceCopy, HostTable},
        plan::{ArgBinding, Dep, Deps, GlobalLoc, Work},
        program::StreamProgram,
        tables::BufferUses,
    },
};
use smallvec::SmallVec;

use super::record::{
    AccessOf, Action, BufferKey, DepRef, DeviceStep, Reader, StepRecorder, Touched,
};

/// What a replay on one device needs from outside the device: the replay's index values,
/// and the other devices' halves of cross-device copies.
pub trait ReplayLinks {
    /// The values of schedule slot `slot` for this replay (`None`: those it was captured
    /// with).
    fn values(&self, slot: u32) -> Option<&Bindings>;
    /// The source's answer for incoming edge `e` (local number): what the copy waits for,
    /// or why the source could not answer. `None` until the source has answered.
    fn incoming(&mut self, e: u32) -> Option<Result<Deps>>;
    /// The destination operation of incoming edge `e` was planned as `event`.
    fn planned(&mut self, e: u32, event: &Event);
    /// Answers outgoing edge `e`: its destination waits for `deps`.
    fn answer(&mut self, e: u32, deps: Deps);
    /// The destination operation of outgoing edge `e` (a reader of a buffer of this
    /// device; deferred until its device plans it).
    fn reader(&self, e: u32) -> Event;
}

/// How far a replay on one device got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayProgress {
    /// Every template was issued and the tables hold the step's exit state.
    Done,
    /// A template waits for another device's answer; call [`DeviceState::replay`] again
    /// once it may have arrived. Nothing else may be decided on this device meanwhile.
    Blocked,
}

/// One replay of a [`DeviceStep`] in progress on its device.
#[derive(Debug)]
pub struct ReplayRun {
    step: Arc<DeviceStep>,
    /// Issue stamp of position 0 of the step.
    base: u64,
    /// Host-table order of position 0 of the step.
    host_base: u64,
    next: usize,
    events: Vec<Event>,
}

impl ReplayRun {
    /// A replay of `step` whose template at position `p` gets issue stamp `base + p` and
    /// host-table order `host_base + p`.
    pub fn new(step: Arc<DeviceStep>, base: u64, host_base: u64) -> ReplayRun {
        ReplayRun::with_events(step, base, host_base, Vec::new())
    }

    /// [`ReplayRun::new`] keeping this replay's events in `events` (emptied first): a list
    /// an earlier run gave back with [`ReplayRun::into_events`], so that a replay allocates
    /// none once the lists are as long as the step.
    pub fn with_events(
        step: Arc<DeviceStep>,
        base: u64,
        host_base: u64,
        mut events: Vec<Event>,
    ) -> ReplayRun {
        events.clear();
        events.reserve(step.templates.len());
        ReplayRun {
            step,
            base,
            host_base,
            next: 0,
            events,
        }
    }

    /// Moves the replay's position 0 to issue stamp `base` and host-table order
    /// `host_base` (before it issues anything: a part posted before its stamp was taken).
    pub fn rebase(&mut self, base: u64, host_base: u64) {
        if self.next == 0 {
            self.base = base;
            self.host_base = host_base;
        }
    }

    /// The list of this replay's events, emptied, for [`ReplayRun::with_events`].
    pub fn into_events(mut self) -> Vec<Event> {
        self.take_events()
    }

    /// [`ReplayRun::into_events`] for a run that stays where it is (the run is left with no
    /// events).
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        events
    }

    /// How many of the step's actions on this device are done.
    pub fn progress(&self) -> usize {
        self.next
    }

    /// The step.
    pub fn step(&self) -> &Arc<DeviceStep> {
        &self.step
    }

    /// After [`ReplayProgress::Done`]: the last event of every stream the step runs on,
    /// in stream order (what a caller waits for).
    pub fn last_events(&self) -> impl Iterator<Item = Event> + '_ {
        self.step
            .streams
            .iter()
            .filter_map(|&(_, t)| self.events.get(t as usize).cloned())
    }
}

impl DeviceState {
    /// An empty recorder for a step captured on this device.
    pub(crate) fn recorder(&self) -> StepRecorder {
        StepRecorder::new(self.device, self.instance, self.spare_lists.clone())
    }

    /// Where the buffer of `node` in `ctx` is and its size (a copy's source, as the
    /// destination half records it).
    pub(crate) fn source_of(&self, ctx: &Context, node: &TensorNode) -> Option<(GlobalLoc, u64)> {
        let loc = ctx.array(node.id())?.loc;
        let bytes = self.buffers.get(&loc)?.bytes;
        Some((self.global(loc), bytes))
    }

    /// Records the schedule of `routine` with `bindings` (complete) just planned, at
    /// `position` of the step; `slot` is its schedule slot if it declares indices.
    pub(crate) fn record_schedule(
        &self,
        rec: &mut StepRecorder,
        routine: &Routine,
        bindings: &Bindings,
        position: u32,
        slot: Option<u32>,
    ) {
        let ctx = routine.context();
        let stream = ctx.stream().index;
        rec.context(ctx.id());
        let spec = &routine.0.spec;
        let mut accesses = param_accesses(routine);
        let mut merge = None;
        if let Some(expected) = &spec.merge {
            // Planned, so the stream's merge buffer held `expected`.
            if let Some(a) = self.streams[stream as usize].merge.alloc {
                rec.merge(stream, expected, a.loc, false);
                accesses.push((BufferKey::Merge(stream), None, Access::Read));
                merge = Some(ArgBinding {
                    loc: self.global(a.loc),
                    bytes: expected.size_in_bytes().unwrap_or(0),
                    dtype: expected.dtype(),
                    shape: expected.shape().clone(),
                    access: Access::Read,
                });
            }
        }
        let reads_merge = merge.is_some();
        let work = run_work(routine, merge, bindings.clone());
        rec.operation(
            stream,
            position,
            work,
            &accesses,
            Vec::new(),
            slot,
            None,
            reads_merge,
        );
    }

    /// Records the source half of a copy of `node` from `ctx` just decided, at `position`:
    /// within this device (`edge == None`) or to another device (global edge `edge`).
    pub(crate) fn record_copy_source(
        &self,
        rec: &mut StepRecorder,
        ctx: &Context,
        node: &TensorNode,
        edge: Option<u32>,
    ) {
        rec.context(ctx.id());
        if let Some(entry) = ctx.array(node.id()) {
            rec.copy_source(BufferKey::Buffer(entry.loc), node, edge);
        }
    }

    /// Records the destination half of a copy just planned: `source` (where, how many
    /// bytes) copied into `dst` (the node's buffer, or the merge buffer), at `position`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record_copy_in(
        &self,
        rec: &mut StepRecorder,
        dst: &Context,
        node: &TensorNode,
        into_merge: bool,
        source: (GlobalLoc, u64),
        position: u32,
        edge: Option<u32>,
    ) {
        let stream = dst.stream().index;
        let (src, bytes) = source;
        let target = if into_merge {
            self.streams[stream as usize].merge.alloc.map(|a| a.loc)
        } else {
            dst.array(node.id()).map(|e| e.loc)
        };
        let Some(loc) = target.filter(|&loc| self.global(loc) != src) else {
            // Nothing was planned (both contexts share the buffer).
            rec.drop_local_source();
            return;
        };
        rec.context(dst.id());
        let (extra, incoming) = rec.copy_dest(edge);
        let work = Work::Copy {
            src,
            dst: self.global(loc),
            bytes,
        };
        let key = if into_merge {
            rec.merge(stream, node, loc, true);
            BufferKey::Merge(stream)
        } else {
            BufferKey::Buffer(loc)
        };
        let node_of = (!into_merge).then_some(node);
        rec.operation(
            stream,
            position,
            work,
            &[(key, node_of, Access::Write)],
            extra,
            None,
            incoming,
            into_merge,
        );
    }

    /// Records a streaming consumer just planned: `routine` reading `source` (where, how
    /// many bytes) in place, at `position`.
    pub(crate) fn record_streaming(
        &self,
        rec: &mut StepRecorder,
        routine: &Routine,
        source: (GlobalLoc, u64),
        position: u32,
        edge: Option<u32>,
    ) {
        let ctx = routine.context();
        rec.context(ctx.id());
        let spec = &routine.0.spec;
        let accesses = param_accesses(routine);
        let (extra, incoming) = rec.copy_dest(edge);
        let merge = spec.merge.as_ref().map(|expected| ArgBinding {
            loc: source.0,
            bytes: source.1,
            dtype: expected.dtype(),
            shape: expected.shape().clone(),
            access: Access::Read,
        });
        let work = run_work(routine, merge, routine.bindings());
        rec.operation(
            ctx.stream().index,
            position,
            work,
            &accesses,
            extra,
            None,
            incoming,
            false,
        );
    }

    /// Whether `step` can be replayed here as it was captured: it was captured on this
    /// device state, every context it uses is live, every merge buffer it uses is where it
    /// was and holds what the step reads first, and every hosted node it reads before
    /// writing it is current (no upload needed). Changes nothing.
    pub fn check_replay(&self, step: &DeviceStep, host: &HostTable) -> Result<(), Invalidation> {
        if step.instance != self.instance || step.device != self.device {
            return Err(Invalidation::Foreign {
                device: self.device,
            });
        }
        // A cache written only by this device's owner (not synchronisation): while no
        // context was made or finalized since the last check, none of the step's was.
        let now = (self.contexts.len(), self.next_context);
        let mut checked = step.checked.lock().unwrap_or_else(|p| p.into_inner());
        if *checked != Some(now) {
            if let Some(&context) = step
                .contexts
                .iter()
                .find(|c| !self.contexts.contains_key(c))
            {
                return Err(Invalidation::ContextFinalized {
                    device: self.device,
                    context,
                });
            }
            *checked = Some(now);
        }
        drop(checked);
        for m in &step.merges {
            let slot = &self.streams[m.stream as usize].merge;
            let here = slot.alloc.map(|a| a.loc);
            let moved = here != m.loc;
            let other = m
                .entry
                .as_ref()
                .is_some_and(|e| slot.node.as_ref() != Some(e));
            if moved || other {
                let at = |loc: Option<BufferLoc>| loc.map_or("nowhere".into(), |l| l.to_string());
                let node = |n: Option<&TensorNode>| n.map_or("nothing".into(), |n| n.to_string());
                return Err(Invalidation::MergeBufferChanged {
                    stream: StreamId {
                        device: self.device,
                        index: m.stream,
                    },
                    expected: format!(
                        "{} at {}",
                        node(m.entry.as_ref().or(m.exit.as_ref())),
                        at(m.loc)
                    ),
                    found: format!("{} at {}", node(slot.node.as_ref()), at(here)),
                });
            }
        }
        for b in &step.buffers {
            let (BufferKey::Buffer(loc), Some(node)) = (b.key, &b.node) else {
                continue;
            };
            if !b.entry_read || !node.mode().is_hosted() {
                continue;
            }
            let host_version = host.version(node.id());
            let buffer_version = self.buffers.get(&loc).and_then(|r| r.host_version);
            if buffer_version != Some(host_version) {
                return Err(Invalidation::HostWritten {
                    device: self.device,
                    node: node.to_string(),
                    buffer_version,
                    host_version,
                });
            }
        }
        Ok(())
    }

    /// Issues `run`'s templates, from where it stopped, into `out` as one [`StreamProgram`] per
    /// stream (per run of consecutive templates of a stream this call issued): until every
    /// template is issued ([`ReplayProgress::Done`], the tables then hold the step's exit state) or
    /// one waits for another device's answer ([`ReplayProgress::Blocked`]).
    ///
    /// The caller checked the step first ([`DeviceState::check_replay`], with no decision
    /// on this device in between) and decides nothing else on this device until the run
    /// is done. The caller resets the issue stamp afterwards
    /// ([`DeviceState::set_issue_stamp`]).
    pub fn replay(
        &mut self,
        run: &mut ReplayRun,
        links: &mut dyn ReplayLinks,
        host: &mut HostTable,
        out: &mut Vec<StreamProgram>,
    ) -> ReplayProgress {
        let step = run.step.clone();
        // Per lane of the step: where in `out` the program this call is filling for its
        // stream lies (each program is made in place there, not moved in and out of a list
        // of open ones).
        let mut open: SmallVec<[Option<usize>; 4]> = smallvec::smallvec![None; step.lanes.len()];
        while let Some(&action) = step.actions.get(run.next) {
            match action {
                Action::Answer(e, (a, b)) => {
                    let mut deps = Deps::new();
                    for d in &step.deps[a as usize..b as usize] {
                        self.replay_dep(d, 0, run, links, &mut None, &mut deps);
                    }
                    links.answer(e, deps);
                }
                Action::Issue(t) => {
                    let tpl = &step.templates[t as usize];
                    let mut answered = match tpl.incoming {
                        None => None,
                        Some(e) => match links.incoming(e) {
                            None => return ReplayProgress::Blocked,
                            Some(answer) => Some(answer),
                        },
                    };
                    let stream = StreamId {
                        device: self.device,
                        index: tpl.stream,
                    };
                    self.stamp_template(run.base + u64::from(tpl.position));
                    let event = self.issue(stream);
                    let _ = self.next_issue();
                    let slot = &mut open[tpl.lane as usize];
                    let at = match *slot {
                        Some(i) if out[i].continues(tpl.ordinal, event.seq()) => i,
                        _ => {
                            out.push(StreamProgram::open(
                                step.clone(),
                                stream,
                                event.timeline().clone(),
                                tpl.lane,
                                tpl.ordinal,
                                event.seq(),
                                run.base,
                            ));
                            out.len() - 1
                        }
                    };
                    *slot = Some(at);
                    // `at` is an index this call pushed, and nothing removes from `out`.
                    let program = &mut out[at];
                    for d in &step.deps[tpl.deps.0 as usize..tpl.deps.1 as usize] {
                        self.replay_dep(
                            d,
                            tpl.stream,
                            run,
                            links,
                            &mut answered,
                            program.deps_mut(),
                        );
                    }
                    let values = match (tpl.slot, &tpl.work) {
                        (Some(slot), Work::Run { .. }) => links.values(slot).cloned(),
                        _ => None,
                    };
                    // The source device could not answer (it stopped or failed while
                    // deciding): the copy fails like an operation whose device died, after
                    // its other dependencies.
                    let failed = match answered {
                        Some(Err(error)) => Some(error.to_string()),
                        _ => None,
                    };
                    program.push(values, failed);
                    if let Some(e) = tpl.incoming {
                        links.planned(e, &event);
                    }
                    run.events.push(event);
                }
            }
            run.next += 1;
        }
        self.exit_state(run, links, host);
        ReplayProgress::Done
    }

    /// The events `d` stands for in this replay, for a template on stream `stream`.
    fn replay_dep(
        &mut self,
        d: &DepRef,
        stream: u32,
        run: &ReplayRun,
        links: &mut dyn ReplayLinks,
        answered: &mut Option<Result<Deps>>,
        out: &mut impl Extend<Dep>,
    ) {
        match *d {
            DepRef::Local(t, kind) => {
                if let Some(event) = run.events.get(t as usize) {
                    out.extend([Dep {
                        event: event.clone(),
                        kind,
                    }]);
                }
            }
            DepRef::Remote(e) => out.extend([Dep {
                event: links.reader(e),
                kind: crate::protocol::DepKind::Order,
            }]),
            DepRef::Incoming(_) => {
                if let Some(Ok(deps)) = answered.take() {
                    out.extend(deps);
                }
            }
            DepRef::EntryRead(b) | DepRef::EntryWrite(b) => {
                if mutant!("replay_entry") {
                    return;
                }
                let write = matches!(d, DepRef::EntryWrite(_));
                let stream = StreamId {
                    device: self.device,
                    index: stream,
                };
                let uses = match run.step.buffers[b as usize].key {
                    BufferKey::Buffer(loc) => self.buffers.get_mut(&loc).map(|r| &mut r.uses),
                    BufferKey::Merge(s) => {
                        self.streams.get_mut(s as usize).map(|s| &mut s.merge.uses)
                    }
                };
                if let Some(uses) = uses {
                    if write {
                        uses.write_deps(stream, out);
                    } else {
                        uses.read_deps(out);
                    }
                }
            }
        }
    }

    /// Sets every touched buffer's record to the state the step leaves (its last writer,
    /// the readers since), updates host records of hosted nodes it wrote and the merge
    /// buffers' nodes.
    fn exit_state(&mut self, run: &ReplayRun, links: &mut dyn ReplayLinks, host: &mut HostTable) {
        // The step is the run's (not `self`'s): borrowed, not shared again.
        let step = &*run.step;
        // Each reader's event recorded as it is found (collected first, the list was moved
        // and dropped per buffer: a tenth of a replay's host instructions).
        let readers_of = |b: &Touched, uses: &mut BufferUses| {
            for r in &b.readers {
                let event = match *r {
                    Reader::Local(t) => run.events.get(t as usize).cloned(),
                    Reader::Remote(e) => Some(links.reader(e)),
                };
                if let Some(event) = event {
                    uses.record_read(event);
                }
            }
        };
        for b in &step.buffers {
            let writer = b.writer.and_then(|w| run.events.get(w as usize).cloned());
            match b.key {
                BufferKey::Buffer(loc) => {
                    let global = self.global(loc);
                    let Some(rec) = self.buffers.get_mut(&loc) else {
                        continue;
                    };
                    if let Some(w) = writer {
                        rec.uses.record_write(w);
                        rec.written = true;
                    }
                    readers_of(b, &mut rec.uses);
                    let (Some(w), Some(node)) = (b.writer, &b.node) else {
                        continue;
                    };
                    if !node.mode().is_hosted() {
                        continue;
                    }
                    rec.host_version = Some(host.version(node.id()));
                    let tpl = &step.templates[w as usize];
                    let copy = DeviceCopy {
                        stream: StreamId {
                            device: self.device,
                            index: tpl.stream,
                        },
                        loc: global,
                    };
                    let order = run.host_base + u64::from(tpl.position);
                    if let Ok(h) = host.record(node) {
                        h.device_wrote(copy, order);
                    }
                }
                BufferKey::Merge(s) => {
                    let Some(slot) = self.streams.get_mut(s as usize).map(|s| &mut s.merge) else {
                        continue;
                    };
                    if let Some(w) = writer {
                        slot.uses.record_write(w);
                    }
                    readers_of(b, &mut slot.uses);
                }
            }
        }
        for m in &step.merges {
            if let Some(n) = &m.exit {
                self.streams[m.stream as usize].merge.node = Some(n.clone());
            }
        }
    }
}

/// An [`Error`] for a step that cannot be replayed.
pub(crate) fn invalidated(step: u64, why: Invalidation) -> Error {
    Error::ReplayInvalidated { step, why }
}

/// The buffers a routine's parameters touch, as the step records them.
fn param_accesses(routine: &Routine) -> Vec<AccessOf<'_>> {
    routine
        .0
        .spec
        .params
        .iter()
        .zip(routine.0.args.iter())
        .map(|(p, b)| (BufferKey::Buffer(b.loc.loc), Some(&p.node), p.access))
        .collect()
}

/// The work of `routine` as it was planned: its arguments, `merge`, `bindings`.
fn run_work(routine: &Routine, merge: Option<ArgBinding>, bindings: Bindings) -> Work {
    Work::Run {
        name: routine.0.name.clone(),
        kernel: routine.0.spec.kernel.clone(),
        args: routine.0.args.clone(),
        merge,
        bindings,
    }
}
