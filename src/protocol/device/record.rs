//! What one device records while a captured step runs for real, and the [`DeviceStep`] a
//! replay issues again. See DESIGN.md §4, "Step capture and replay".
//!
//! The captured plans cannot be kept: their dependencies were pruned of whatever had
//! completed, and they name that run's events. So the recorder keeps the rule instead.
//! Edges inside the step come from the protocol's rule 1 applied to a table of template
//! numbers that is never pruned. Entry dependencies name a buffer; a replay looks them up
//! in the live tables with [`BufferUses::read_deps`](crate::protocol::BufferUses::read_deps)
//! and [`BufferUses::write_deps`](crate::protocol::BufferUses::write_deps).
//!
//! The table here mirrors [`BufferUses`](crate::protocol::BufferUses). It may add an edge,
//! which costs a wait, but never drops one the protocol would make: the random programs
//! compare replayed steps with the sequential reference and check their dependency graph.
//! A copy between two devices records an answer on the source and an incoming edge on the
//! destination; both halves of a copy within one device fold into one template.

use std::{collections::HashMap, sync::Arc};

use crate::{
    error::Error,
    ids::{BufferLoc, ContextId, DeviceId},
    kernels::Access,
    node::TensorNode,
    protocol::plan::{DepKind, Work},
};

/// A buffer a step touches on its device: a node's buffer, or a stream's merge buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum BufferKey {
    /// A buffer of the device's pools.
    Buffer(BufferLoc),
    /// The merge buffer of stream `index` (wherever it lives: it may grow).
    Merge(u32),
}

/// What a template waits for, resolved to events on every replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DepRef {
    /// This replay's event of template `t` of the same device.
    Local(u32, DepKind),
    /// The operation another device plans for outgoing edge `e` (it reads a buffer of
    /// this device, which this template then overwrites): an order dependency.
    Remote(u32),
    /// What the source device answered for incoming edge `e` (data dependencies).
    Incoming(u32),
    /// The last write of touched buffer `b` when the replay starts (RAW).
    EntryRead(u32),
    /// The pending uses of touched buffer `b` on other streams when the replay starts (WAR,
    /// WAW), for a template on its own stream.
    EntryWrite(u32),
}

/// A reader recorded in the step's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reader {
    /// Template `t`.
    Local(u32),
    /// The destination operation of outgoing edge `e`.
    Remote(u32),
}

/// One buffer the step touches: what the step does to it, and its state when it ends.
#[derive(Clone, Debug)]
pub(crate) struct Touched {
    pub(crate) key: BufferKey,
    /// The node of a pool buffer (hosted nodes update the host table).
    pub(crate) node: Option<TensorNode>,
    /// Read before any write of the step: a hosted node must then be current when a replay
    /// starts (a lagging one would be uploaded first, which the captured step does not do).
    pub(crate) entry_read: bool,
    /// The step's last write (template index).
    pub(crate) writer: Option<u32>,
    /// Readers since that write (all readers of the step if it writes nothing), the latest
    /// per stream for local ones.
    pub(crate) readers: Vec<Reader>,
}

/// One operation of the step on this device, issued again by every replay.
#[derive(Clone, Debug)]
pub struct Template {
    /// Stream index.
    pub(crate) stream: u32,
    /// Position in the step's program order (over every device): its plan's issue stamp
    /// is the replay's base plus this.
    pub(crate) position: u32,
    /// The work, bindings resolved at capture (index values replaced per replay).
    pub(crate) work: Work,
    /// Its dependencies: `deps[start..end]` of the step.
    pub(crate) deps: (u32, u32),
    /// The step's schedule slot whose index values it takes (a routine declaring indices).
    pub(crate) slot: Option<u32>,
    /// The incoming edge whose destination operation this is (its promise is resolved
    /// with this template's event).
    pub(crate) incoming: Option<u32>,
    /// Whether its work names its stream's merge buffer.
    pub(crate) merge: bool,
    /// Its stream's place in [`DeviceStep::lanes`] (set when the recorder finishes).
    pub(crate) lane: u32,
    /// Its place in that lane: the templates of one stream run in this order.
    pub(crate) ordinal: u32,
}

/// What a replay does, in the step's order on this device.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Action {
    /// Issue template `t`.
    Issue(u32),
    /// Answer outgoing edge `e`: its destination waits for `deps[start..end]`.
    Answer(u32, (u32, u32)),
}

/// How a step uses the merge buffer of one stream.
#[derive(Clone, Debug)]
pub(crate) struct MergeUse {
    pub(crate) stream: u32,
    /// Where the merge buffer was when the capture last used it (every template of the
    /// step names it there).
    pub(crate) loc: Option<BufferLoc>,
    /// The node the step reads from it before copying anything into it, if it does.
    pub(crate) entry: Option<TensorNode>,
    /// The node the step copies into it last, if any (what the buffer holds after).
    pub(crate) exit: Option<TensorNode>,
}

/// A captured step's part on one device: its templates, the buffers they touch, and what
/// a replay must check first. Immutable once captured; shared by every replay.
#[derive(Debug)]
pub struct DeviceStep {
    pub(crate) device: DeviceId,
    /// The `DeviceState` instance it was captured on.
    pub(crate) instance: u64,
    pub(crate) templates: Vec<Template>,
    pub(crate) actions: Vec<Action>,
    pub(crate) deps: Vec<DepRef>,
    pub(crate) buffers: Vec<Touched>,
    pub(crate) contexts: Vec<ContextId>,
    pub(crate) merges: Vec<MergeUse>,
    /// Hosted nodes of touched buffers (their host records are read and updated).
    pub(crate) hosted: Vec<TensorNode>,
    /// Per stream used: `(stream index, last template on it)`.
    pub(crate) streams: Vec<(u32, u32)>,
    /// Per stream used, in the order of `streams`: its templates in order (what one
    /// [`StreamProgram`](crate::protocol::StreamProgram) of a replay runs a range of).
    pub(crate) lanes: Vec<Vec<u32>>,
    /// Global edge numbers of this device's outgoing and incoming edges (local order).
    pub(crate) outgoing: Vec<u32>,
    pub(crate) incoming: Vec<u32>,
    /// `(live contexts, contexts ever made)` of the device state when every context of the
    /// step was last found live: while both are unchanged, none was finalized since.
    pub(crate) checked: std::sync::Mutex<Option<(usize, u64)>>,
    /// The lists its replays borrow and give back: its device's, shared by every step
    /// captured there ([`SpareLists`]).
    pub(crate) spare: Arc<SpareLists>,
}

/// Event lists a device keeps for its next replays (more are freed): as many as the actor
/// layer's default inbox holds replays (see `POOLED_PARTS` in `src/dispatch/replay.rs`), a
/// high-water mark of what the program ran ahead.
const SPARE_EVENT_LISTS: usize = 4096;

/// Lists a device's replays borrow and give back once they hold memory, emptied: the
/// programs' ([`StreamProgram`](crate::protocol::StreamProgram)) and the replays' event
/// lists. One per device, shared by every step captured on it, so that a step captured
/// anew (a loop that captures its step once per epoch, a benchmark run that captures its
/// own) replays on the lists its device's earlier steps gave back instead of allocating
/// as many as it has replays in flight. Bounded: `SPARE_LISTS` program lists and
/// [`SPARE_EVENT_LISTS`] event lists, more are freed.
#[derive(Debug)]
pub(crate) struct SpareLists {
    pub(crate) programs: crate::sync::Mutex<Vec<ProgramLists>>,
    pub(crate) events: crate::sync::Mutex<Vec<Vec<crate::event::Event>>>,
}

impl SpareLists {
    /// Empty lists of lists, for a new device (or a step of its own).
    pub(crate) fn new() -> Arc<SpareLists> {
        Arc::new(SpareLists {
            programs: crate::sync::Mutex::new(Vec::new()),
            events: crate::sync::Mutex::new(Vec::new()),
        })
    }
}

/// A program's dependency list, its per-operation ends into it and its new index values:
/// kept for reuse once they hold memory, so that a replay allocates none of them. (Not
/// inline: a program moves from the replay to its stream's queue, and lists inline made it
/// half a kilobyte to copy at every move.)
pub(crate) type ProgramLists = (
    Vec<crate::protocol::Dep>,
    Vec<u32>,
    Vec<(u32, crate::kernels::Bindings)>,
);

impl DeviceStep {
    /// A step of one lane on `stream`: the works in order, with no dependencies of its own
    /// (for [`StreamProgram::from_plans`](crate::protocol::StreamProgram::from_plans)).
    pub(crate) fn of_lane(stream: crate::ids::StreamId, works: Vec<Work>) -> DeviceStep {
        let n = works.len() as u32;
        let templates = works
            .into_iter()
            .enumerate()
            .map(|(i, work)| Template {
                stream: stream.index,
                position: i as u32,
                work,
                deps: (0, 0),
                slot: None,
                incoming: None,
                merge: false,
                lane: 0,
                ordinal: i as u32,
            })
            .collect();
        DeviceStep {
            device: stream.device,
            instance: 0,
            templates,
            actions: (0..n).map(Action::Issue).collect(),
            deps: Vec::new(),
            buffers: Vec::new(),
            contexts: Vec::new(),
            merges: Vec::new(),
            hosted: Vec::new(),
            streams: vec![(stream.index, n.saturating_sub(1))],
            lanes: vec![(0..n).collect()],
            outgoing: Vec::new(),
            incoming: Vec::new(),
            checked: std::sync::Mutex::new(None),
            spare: SpareLists::new(),
        }
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// An empty list for a replay's events, one an earlier replay gave back if any
    /// ([`DeviceStep::give_back_events`]).
    pub fn events_list(&self) -> Vec<crate::event::Event> {
        self.spare.events.lock().pop().unwrap_or_default()
    }

    /// Keeps `events` (emptied) for a later replay's [`DeviceStep::events_list`].
    pub fn give_back_events(&self, mut events: Vec<crate::event::Event>) {
        events.clear();
        let mut spare = self.spare.events.lock();
        if spare.len() < SPARE_EVENT_LISTS && events.capacity() > 0 {
            spare.push(events);
        }
    }

    /// Number of operations a replay issues on this device.
    pub fn operations(&self) -> usize {
        self.templates.len()
    }

    /// The hosted nodes whose buffers the step touches on this device.
    pub fn hosted_nodes(&self) -> &[TensorNode] {
        &self.hosted
    }

    /// Number of operations a replay issues on stream `stream` of this device.
    pub fn stream_operations(&self, stream: usize) -> usize {
        self.streams
            .iter()
            .position(|&(s, _)| s as usize == stream)
            .and_then(|k| self.lanes.get(k))
            .map_or(0, Vec::len)
    }

    /// The step positions of the operations a replay issues on stream `stream` of this
    /// device, in the order they run there (see `StepCapture::position`).
    pub fn stream_positions(&self, stream: usize) -> impl Iterator<Item = u32> + '_ {
        self.streams
            .iter()
            .position(|&(s, _)| s as usize == stream)
            .and_then(|k| self.lanes.get(k))
            .into_iter()
            .flatten()
            .filter_map(|&t| self.templates.get(t as usize).map(|t| t.position))
    }

    /// Stream indices the step runs operations on, in order.
    pub fn streams(&self) -> impl Iterator<Item = usize> + '_ {
        self.streams.iter().map(|&(s, _)| s as usize)
    }

    /// Number of outgoing (this device is the source) and incoming cross-device copies.
    pub fn edges(&self) -> (usize, usize) {
        (self.outgoing.len(), self.incoming.len())
    }
}

/// The source half of a copy within one device, waiting for its destination half.
#[derive(Debug)]
struct LocalSource {
    buffer: u32,
    deps: Vec<DepRef>,
}

/// Records one device's part of a step while it is captured (see the module docs).
#[derive(Debug)]
pub struct StepRecorder {
    device: DeviceId,
    instance: u64,
    /// Its device's lists for replays, which the step will share.
    spare: Arc<SpareLists>,
    templates: Vec<Template>,
    actions: Vec<Action>,
    deps: Vec<DepRef>,
    buffers: Vec<Touched>,
    index: HashMap<BufferKey, u32>,
    contexts: Vec<ContextId>,
    merges: Vec<MergeUse>,
    outgoing: Vec<u32>,
    incoming: Vec<u32>,
    local_source: Option<LocalSource>,
    /// The first captured operation that was refused, by position.
    failure: Option<(u32, Error)>,
}

/// One access of a recorded operation: the buffer, its node (for pool buffers), how.
pub(crate) type AccessOf<'a> = (BufferKey, Option<&'a TensorNode>, Access);

impl StepRecorder {
    /// An empty recorder for device `device` of `DeviceState` instance `instance`, whose
    /// step's replays will borrow from `spare` (the device's).
    pub(crate) fn new(device: DeviceId, instance: u64, spare: Arc<SpareLists>) -> StepRecorder {
        StepRecorder {
            device,
            instance,
            spare,
            templates: Vec::new(),
            actions: Vec::new(),
            deps: Vec::new(),
            buffers: Vec::new(),
            index: HashMap::new(),
            contexts: Vec::new(),
            merges: Vec::new(),
            outgoing: Vec::new(),
            incoming: Vec::new(),
            local_source: None,
            failure: None,
        }
    }

    /// The device it records for.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Notes that the captured operation at `position` was refused with `error`: the
    /// capture fails with the first such error (the capture's calls are a step only if all
    /// of them were planned).
    pub fn fail(&mut self, position: u32, error: Error) {
        if self.failure.as_ref().is_none_or(|(p, _)| position < *p) {
            self.failure = Some((position, error));
        }
    }

    /// The first refusal, if any.
    pub fn failure(&self) -> Option<&(u32, Error)> {
        self.failure.as_ref()
    }

    pub(crate) fn context(&mut self, ctx: ContextId) {
        if !self.contexts.contains(&ctx) {
            self.contexts.push(ctx);
        }
    }

    fn buffer(&mut self, key: BufferKey, node: Option<&TensorNode>) -> u32 {
        if let Some(&b) = self.index.get(&key) {
            if let (Some(n), None) = (node, &self.buffers[b as usize].node) {
                self.buffers[b as usize].node = Some(n.clone());
            }
            return b;
        }
        let b = self.buffers.len() as u32;
        self.buffers.push(Touched {
            key,
            node: node.cloned(),
            entry_read: false,
            writer: None,
            readers: Vec::new(),
        });
        self.index.insert(key, b);
        b
    }

    /// Rule 1's read dependencies of buffer `b` at this point of the step.
    fn read_deps(&mut self, b: u32, out: &mut Vec<DepRef>) {
        let t = &mut self.buffers[b as usize];
        match t.writer {
            Some(w) => out.push(DepRef::Local(w, DepKind::Data)),
            None => {
                t.entry_read = true;
                out.push(DepRef::EntryRead(b));
            }
        }
    }

    /// Rule 1's write dependencies of buffer `b` for an operation on `stream`.
    fn write_deps(&self, b: u32, stream: u32, out: &mut Vec<DepRef>) {
        let t = &self.buffers[b as usize];
        for r in &t.readers {
            match *r {
                Reader::Local(j) if self.templates[j as usize].stream != stream => {
                    out.push(DepRef::Local(j, DepKind::Order))
                }
                Reader::Local(_) => {}
                Reader::Remote(e) => out.push(DepRef::Remote(e)),
            }
        }
        match t.writer {
            Some(w) if self.templates[w as usize].stream != stream => {
                out.push(DepRef::Local(w, DepKind::Order))
            }
            Some(_) => {}
            None => out.push(DepRef::EntryWrite(b)),
        }
    }

    fn record_read(&mut self, b: u32, reader: Reader) {
        let streams: Vec<u32> = self.templates.iter().map(|t| t.stream).collect();
        let readers = &mut self.buffers[b as usize].readers;
        if let Reader::Local(t) = reader {
            let stream = streams[t as usize];
            readers.retain(|r| !matches!(*r, Reader::Local(j) if streams[j as usize] == stream));
        }
        readers.push(reader);
    }

    fn record_write(&mut self, b: u32, t: u32) {
        let touched = &mut self.buffers[b as usize];
        touched.readers.clear();
        touched.writer = Some(t);
    }

    fn merge_use(&mut self, stream: u32) -> &mut MergeUse {
        let i = match self.merges.iter().position(|m| m.stream == stream) {
            Some(i) => i,
            None => {
                self.merges.push(MergeUse {
                    stream,
                    loc: None,
                    entry: None,
                    exit: None,
                });
                self.merges.len() - 1
            }
        };
        &mut self.merges[i]
    }

    /// Records the merge buffer of `stream` being read (expecting `node`) or written (with
    /// `node`) at `loc`.
    pub(crate) fn merge(&mut self, stream: u32, node: &TensorNode, loc: BufferLoc, write: bool) {
        let m = self.merge_use(stream);
        m.loc = Some(loc);
        if write {
            m.exit = Some(node.clone());
        } else if m.exit.is_none() && m.entry.is_none() {
            m.entry = Some(node.clone());
        }
    }

    /// Records an operation: `work` on `stream` at `position`, with `accesses` (rule 1,
    /// in the order the protocol applies it: every dependency, then every record), plus
    /// `extra` dependencies; `incoming` the edge it delivers; `reads_source` a buffer of
    /// this device it reads as a copy's source (a copy within the device). Returns its
    /// template index.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn operation(
        &mut self,
        stream: u32,
        position: u32,
        work: Work,
        accesses: &[AccessOf<'_>],
        mut extra: Vec<DepRef>,
        slot: Option<u32>,
        incoming: Option<u32>,
        merge: bool,
    ) -> u32 {
        let keys: Vec<(u32, Access)> = accesses
            .iter()
            .map(|&(key, node, access)| (self.buffer(key, node), access))
            .collect();
        let mut deps = Vec::new();
        for &(b, access) in &keys {
            if !matches!(access, Access::Write) {
                self.read_deps(b, &mut deps);
            }
            if !matches!(access, Access::Read) {
                self.write_deps(b, stream, &mut deps);
            }
        }
        if let Some(e) = incoming {
            deps.push(DepRef::Incoming(e));
        }
        deps.append(&mut extra);
        let t = self.templates.len() as u32;
        let start = self.deps.len() as u32;
        self.deps.extend(deps);
        self.templates.push(Template {
            stream,
            position,
            work,
            deps: (start, self.deps.len() as u32),
            slot,
            incoming,
            merge,
            lane: 0,
            ordinal: 0,
        });
        self.actions.push(Action::Issue(t));
        for &(b, access) in &keys {
            if matches!(access, Access::Read) {
                self.record_read(b, Reader::Local(t));
            } else {
                self.record_write(b, t);
            }
        }
        if let Some(src) = self.local_source.take() {
            self.record_read(src.buffer, Reader::Local(t));
        }
        t
    }

    /// The source half of a copy reading `key` (of `node`): within the device
    /// (`edge == None`) its dependencies go to the destination half recorded next;
    /// across devices they are answered to outgoing edge `edge` (a global edge number).
    pub(crate) fn copy_source(&mut self, key: BufferKey, node: &TensorNode, edge: Option<u32>) {
        let b = self.buffer(key, Some(node));
        let mut deps = Vec::new();
        self.read_deps(b, &mut deps);
        match edge {
            None => self.local_source = Some(LocalSource { buffer: b, deps }),
            Some(global) => {
                let e = self.outgoing.len() as u32;
                self.outgoing.push(global);
                let start = self.deps.len() as u32;
                self.deps.extend(deps);
                self.actions
                    .push(Action::Answer(e, (start, self.deps.len() as u32)));
                self.record_read(b, Reader::Remote(e));
            }
        }
    }

    /// The dependencies the destination half of a copy takes from its source: those the
    /// local source half recorded (`edge == None`), or the incoming edge's answer (returns
    /// the edge's local number).
    pub(crate) fn copy_dest(&mut self, edge: Option<u32>) -> (Vec<DepRef>, Option<u32>) {
        match edge {
            None => (
                self.local_source
                    .as_ref()
                    .map(|s| s.deps.clone())
                    .unwrap_or_default(),
                None,
            ),
            Some(global) => {
                let e = self.incoming.len() as u32;
                self.incoming.push(global);
                (Vec::new(), Some(e))
            }
        }
    }

    /// Forgets a local source half whose destination planned nothing.
    pub(crate) fn drop_local_source(&mut self) {
        self.local_source = None;
    }

    /// The device step: merge-buffer templates retargeted to where the capture last used
    /// each merge buffer (a buffer that grew during the capture is used at its final
    /// place by every replay), streams and hosted nodes collected.
    pub(crate) fn finish(mut self) -> Result<DeviceStep, Error> {
        if let Some((_, e)) = self.failure.take() {
            return Err(e);
        }
        for t in &mut self.templates {
            if !t.merge {
                continue;
            }
            let Some(loc) = self
                .merges
                .iter()
                .find(|m| m.stream == t.stream)
                .and_then(|m| m.loc)
            else {
                continue;
            };
            match &mut t.work {
                Work::Copy { dst, .. } => dst.loc = loc,
                Work::Run {
                    merge: Some(binding),
                    ..
                } => binding.loc.loc = loc,
                _ => {}
            }
        }
        let mut streams: Vec<(u32, u32)> = Vec::new();
        for (i, t) in self.templates.iter().enumerate() {
            match streams.iter_mut().find(|(s, _)| *s == t.stream) {
                Some(slot) => slot.1 = i as u32,
                None => streams.push((t.stream, i as u32)),
            }
        }
        streams.sort_unstable();
        let mut lanes: Vec<Vec<u32>> = vec![Vec::new(); streams.len()];
        for (i, t) in self.templates.iter_mut().enumerate() {
            let lane = streams
                .iter()
                .position(|&(s, _)| s == t.stream)
                .unwrap_or(0);
            t.lane = lane as u32;
            t.ordinal = lanes[lane].len() as u32;
            lanes[lane].push(i as u32);
        }
        let mut hosted: Vec<TensorNode> = Vec::new();
        for b in &self.buffers {
            if let Some(n) = &b.node {
                if n.mode().is_hosted() && !hosted.iter().any(|h| h.id() == n.id()) {
                    hosted.push(n.clone());
                }
            }
        }
        Ok(DeviceStep {
            device: self.device,
            instance: self.instance,
            templates: self.templates,
            actions: self.actions,
            deps: self.deps,
            buffers: self.buffers,
            contexts: self.contexts,
            merges: self.merges,
            hosted,
            streams,
            lanes,
            outgoing: self.outgoing,
            incoming: self.incoming,
            checked: std::sync::Mutex::new(None),
            spare: self.spare,
        })
    }
}
