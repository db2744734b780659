//! The per-device protocol state machine (DESIGN.md §3).
//!
//! [`DeviceState`] owns one device's tables and pools and turns every operation into
//! [`Plan`]s. It does no I/O: it neither waits nor runs anything. The one thing it asks of
//! the outside world while deciding is pool memory ([`PoolMemory`]): a slab the backend
//! cannot create fails the operation before any table changes. All table lookups and
//! updates happen here, at schedule time, in the order operations arrive; since a plan only
//! ever waits for events issued before it, the wait graph is acyclic and cannot deadlock.
//!
//! Rules, with where they are enforced:
//! 1. routine waits for RAW/WAR/WAW and host transfers: [`DeviceState::schedule`] through
//!    [`BufferUses::read_deps`] / [`BufferUses::write_deps`];
//! 2. host transfers: [`DeviceState::from_host`], [`DeviceState::to_host`] and the
//!    [`HostTable`] (host writes and reads are driven by the engine);
//! 3. device-to-device ([`device_to_device`]): [`DeviceState::source`] +
//!    [`DeviceState::upload_lagging_source`] (a copy never reads a stale value) +
//!    [`DeviceState::copy_in`] or [`DeviceState::schedule_streaming`] +
//!    [`DeviceState::record_remote_read`];
//! 4. merge buffer: the per-stream slot checked in `schedule`, its uses in `copy_in`;
//! 5. deferred reuse: [`DeviceState::finalize`] hands every pending use to the pools;
//! 6. failure: [`DepKind::Data`] dependencies carry failures to dependents (executors).

use std::sync::Arc;

mod replay;
pub(crate) use replay::invalidated;
pub use replay::{ReplayLinks, ReplayProgress, ReplayRun};

use crate::{
    error::{Error, Result},
    event::{Event, Timeline},
    ids::{BufferLoc, ContextId, DeviceId, IdMap, NodeId, StreamId},
    kernels::{Access, Bindings, RoutineSpec},
    memory::{Allocation, DevicePools, PoolConfig, PoolMemory, PoolStats},
    node::{MemoryMode, Sharing, TensorNode},
    protocol::{
        context::{ArrayEntry, Context, ContextInner, Routine, RoutineInner},
        host::{DeviceCopy, HostTable},
        plan::{next_issue, ArgBinding, Dep, DepKind, GlobalLoc, Plan, Work, OP_STAMPS},
        tables::BufferUses,
    },
    // Timelines are shared with the streams through the sync shim (loom under
    // `tributary_loom`); contexts, routines and host buffers are plain immutable data.
    sync::Arc as SyncArc,
};

/// Source of [`DeviceState`] instance numbers, which contexts carry: a context id alone is
/// only unique within its device state, and another engine's context must be refused,
/// not resolved to this one's buffers. An id counter, not synchronisation: `std`, not the
/// sync shim (as node ids).
static NEXT_INSTANCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// How often (in issued operations) the whole table is swept for completed events.
const SWEEP_EVERY: u32 = 1024;

/// A buffer read by a device-to-device operation, as seen by its source device.
///
/// Made only by [`DeviceState::source`] (private fields): the plans made from it read
/// `loc` after `deps`, so a hand-made one could read a buffer while it is written.
#[derive(Clone, Debug)]
pub struct Source {
    /// The node.
    pub(crate) node: TensorNode,
    /// Where the source buffer is.
    pub(crate) loc: GlobalLoc,
    /// Its size in bytes.
    pub(crate) bytes: u64,
    /// What a reader of it must wait for (its last write).
    pub(crate) deps: Vec<Dep>,
    /// The host version its content corresponds to (see [`HostTable`]).
    pub(crate) host_version: Option<u64>,
    /// `UninitialisedRead` when nothing has written the buffer: raised by the destination
    /// step, after its own checks, so that errors come in the order of the reference.
    pub(crate) unwritten: Option<Box<Error>>,
}

impl Source {
    /// The node.
    pub fn node(&self) -> &TensorNode {
        &self.node
    }

    /// Where the source buffer is.
    pub fn loc(&self) -> GlobalLoc {
        self.loc
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What a reader of it must wait for (its last write).
    pub fn deps(&self) -> &[Dep] {
        &self.deps
    }

    /// The host version its content corresponds to (see [`HostTable`]).
    pub fn host_version(&self) -> Option<u64> {
        self.host_version
    }

    /// [`Error::UninitialisedRead`] if nothing has written the source buffer (no routine,
    /// copy or upload; the node neither hosted nor declared zeroed): a copy of it would
    /// deliver whatever the allocation held.
    pub fn check_written(&self) -> Result<()> {
        match &self.unwritten {
            Some(e) => Err((**e).clone()),
            None => Ok(()),
        }
    }
}

/// Sizes of the protocol tables, to check that they stay bounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TableSizes {
    /// Live buffers with a use record.
    pub buffers: usize,
    /// Events held in all use records (buffers and merge buffers).
    pub events: usize,
    /// Live (not finalized) contexts.
    pub contexts: usize,
    /// Nodes with a device-local sharing decision.
    pub sharing_decisions: usize,
}

#[derive(Default)]
struct MergeSlot {
    node: Option<TensorNode>,
    alloc: Option<Allocation>,
    uses: BufferUses,
}

struct StreamState {
    id: StreamId,
    timeline: SyncArc<Timeline>,
    issued: u64,
    merge: MergeSlot,
}

struct BufferRecord {
    node: TensorNode,
    /// The node's size: what transfers and kernels touch (the allocation may be larger).
    bytes: u64,
    alloc: Allocation,
    uses: BufferUses,
    /// Host version the content corresponds to; `None` when unknown (must be uploaded).
    host_version: Option<u64>,
    stream: StreamId,
    /// Whether an operation has written it (or its node is declared zeroed): reading a
    /// buffer nothing wrote is `UninitialisedRead`.
    written: bool,
}

struct ContextRecord {
    parent: Option<ContextId>,
    children: usize,
    /// Buffers this context allocated and frees when finalized.
    delta: Vec<BufferLoc>,
}

/// An array added by linking, and whether the new context owns (and later frees) it.
type NewArray = (ArrayEntry, bool);

enum MergeFrom<'a> {
    Slot,
    Source(&'a Source),
}

enum Placement {
    Existing,
    Fresh,
    Candidate,
}

struct Decision {
    node: TensorNode,
    mode: MemoryMode,
    placement: Placement,
    sharing: Option<Sharing>,
    take_ownership: bool,
}

/// The protocol state of one device: pools, tables, streams and contexts.
pub struct DeviceState {
    instance: u64,
    device: DeviceId,
    streams: Vec<StreamState>,
    pools: DevicePools<Event>,
    memory: Box<dyn PoolMemory + Send>,
    contexts: IdMap<ContextId, ContextRecord>,
    next_context: u64,
    buffers: IdMap<BufferLoc, BufferRecord>,
    sharing: IdMap<NodeId, Sharing>,
    owner_stream: IdMap<NodeId, StreamId>,
    cross_stream_candidates: IdMap<NodeId, BufferLoc>,
    since_sweep: u32,
    /// The issue stamp of the next plan, while an operation with a stamp is decided.
    stamp: Option<u64>,
    /// The stamp of the last stamped operation decided.
    position: Option<u64>,
}

impl DeviceState {
    /// A device with one stream per timeline (timeline `i` is stream `i` of `device`), whose
    /// pools live in `memory` (the backend's slabs of this device).
    pub fn new(
        device: DeviceId,
        timelines: Vec<SyncArc<Timeline>>,
        pools: PoolConfig,
        memory: Box<dyn PoolMemory + Send>,
    ) -> Self {
        let streams = timelines
            .into_iter()
            .enumerate()
            .map(|(i, timeline)| StreamState {
                id: StreamId {
                    device,
                    index: i as u32,
                },
                timeline,
                issued: 0,
                merge: MergeSlot::default(),
            })
            .collect();
        DeviceState {
            instance: NEXT_INSTANCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            device,
            streams,
            pools: DevicePools::new(device, pools),
            memory,
            contexts: IdMap::default(),
            next_context: 0,
            buffers: IdMap::default(),
            sharing: IdMap::default(),
            owner_stream: IdMap::default(),
            cross_stream_candidates: IdMap::default(),
            since_sweep: 0,
            stamp: None,
            position: None,
        }
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Number of streams.
    pub fn stream_count(&self) -> usize {
        self.streams.len()
    }

    /// The timeline of stream `index`.
    pub fn timeline(&self, index: usize) -> Option<&SyncArc<Timeline>> {
        self.streams.get(index).map(|s| &s.timeline)
    }

    /// Returns to the pools the freed memory whose readers and writers completed, and
    /// says whether some still waits for work in flight (a [`sweep`] after that work
    /// completes reuses it). Costs nothing when nothing was freed.
    ///
    /// [`sweep`]: DeviceState::sweep
    pub fn reclaim_freed(&mut self) -> bool {
        if !self.pools.has_pending_frees() {
            return false;
        }
        self.pools.reclaim(&mut *self.memory);
        self.pools.has_pending_frees()
    }

    /// Memory statistics of the device's pools.
    pub fn pool_stats(&self) -> PoolStats {
        self.pools.stats()
    }

    /// Sizes of the tables.
    pub fn table_sizes(&self) -> TableSizes {
        TableSizes {
            buffers: self.buffers.len(),
            events: self.buffers.values().map(|b| b.uses.len()).sum::<usize>()
                + self
                    .streams
                    .iter()
                    .map(|s| s.merge.uses.len())
                    .sum::<usize>(),
            contexts: self.contexts.len(),
            sharing_decisions: self.sharing.len(),
        }
    }

    /// A new root context on stream `index`, holding no arrays.
    pub fn root_context(&mut self, index: usize) -> Result<Context> {
        let stream = self.stream_index(index)?;
        let id = self.new_context_record(None);
        Ok(Context(Arc::new(ContextInner {
            owner: self.instance,
            id,
            stream,
            parent: None,
            arrays: IdMap::default(),
        })))
    }

    fn stream_index(&self, index: usize) -> Result<StreamId> {
        self.streams
            .get(index)
            .map(|s| s.id)
            .ok_or(Error::NoSuchStream {
                device: self.device,
                index,
                count: self.streams.len(),
            })
    }

    fn new_context_record(&mut self, parent: Option<ContextId>) -> ContextId {
        let id = ContextId(self.next_context);
        self.next_context += 1;
        if let Some(p) = parent.and_then(|p| self.contexts.get_mut(&p)) {
            p.children += 1;
        }
        self.contexts.insert(
            id,
            ContextRecord {
                parent,
                children: 0,
                delta: Vec::new(),
            },
        );
        id
    }

    /// Checks that `ctx` belongs to this device (of this engine or system) and is live.
    pub fn check_context(&self, ctx: &Context) -> Result<()> {
        if ctx.0.owner != self.instance || ctx.device() != self.device {
            return Err(Error::ForeignContext {
                context: ctx.id(),
                stream: ctx.stream(),
                device: self.device,
            });
        }
        if ctx.stream().index as usize >= self.streams.len() {
            return Err(Error::NoSuchStream {
                device: self.device,
                index: ctx.stream().index as usize,
                count: self.streams.len(),
            });
        }
        if !self.contexts.contains_key(&ctx.id()) {
            return Err(Error::ContextFinalized { context: ctx.id() });
        }
        Ok(())
    }

    /// The issue stamp of the next plan: from the stamp of the operation being decided
    /// ([`DeviceState::set_issue_stamp`]), or the process-wide clock.
    fn next_issue(&mut self) -> u64 {
        match &mut self.stamp {
            Some(s) => {
                *s += 1;
                // What happens next in this operation (a pool release) comes after this plan.
                crate::protocol::set_current_issue(Some(*s));
                *s - 1
            }
            None => next_issue(),
        }
    }

    /// Stamps the plans of the operation decided next: `stamp`, `stamp + 1`, ... (the
    /// program-order stamp its host call took when it was posted; the actor layer decides
    /// operations of one program on several devices at different times, so the plans'
    /// stamps must come from the call, not from when they are made). `None`: from the
    /// process-wide clock again ([`crate::protocol::issue_clock`]), as a single-owner
    /// engine does.
    pub fn set_issue_stamp(&mut self, stamp: Option<u64>) {
        self.stamp = stamp;
        if let Some(s) = stamp {
            self.position = Some(s);
        }
        self.publish_position();
    }

    /// Sets the thread's [`current_issue`](crate::protocol::current_issue): the stamp of
    /// the operation being decided, or just after the last one decided (so that a pool
    /// released by a sweep is placed among the plans of the program where it happens).
    fn publish_position(&self) {
        let issue = self
            .stamp
            .or(self.position.map(|p| p - p % OP_STAMPS + OP_STAMPS - 1));
        crate::protocol::set_current_issue(issue);
    }

    /// How many operations issued on the device's streams have not completed yet.
    pub fn work_in_flight(&self) -> u64 {
        self.streams
            .iter()
            .map(|s| s.issued.saturating_sub(s.timeline.completed()))
            .sum()
    }

    /// The last sequence number issued on stream `index` (0: none yet).
    pub fn issued(&self, index: usize) -> u64 {
        self.streams.get(index).map_or(0, |s| s.issued)
    }

    fn issue(&mut self, stream: StreamId) -> Event {
        let s = &mut self.streams[stream.index as usize];
        s.issued += 1;
        let event = Event::new(s.timeline.clone(), s.issued);
        self.since_sweep += 1;
        if self.since_sweep >= SWEEP_EVERY {
            self.sweep();
        }
        event
    }

    /// The last event issued on every stream (what a device-wide sync waits for).
    pub fn last_events(&self) -> Vec<Event> {
        self.streams
            .iter()
            .filter(|s| s.issued > 0)
            .map(|s| Event::new(s.timeline.clone(), s.issued))
            .collect()
    }

    /// Drops completed events from every table and returns reusable memory to the pools.
    pub fn sweep(&mut self) {
        self.publish_position();
        self.since_sweep = 0;
        for b in self.buffers.values_mut() {
            b.uses.prune();
        }
        for s in &mut self.streams {
            s.merge.uses.prune();
        }
        self.pools.reclaim(&mut *self.memory);
    }

    fn global(&self, loc: BufferLoc) -> GlobalLoc {
        GlobalLoc {
            device: self.device,
            loc,
        }
    }

    fn entry<'c>(&self, ctx: &'c Context, node: &TensorNode) -> Result<&'c ArrayEntry> {
        ctx.array(node.id()).ok_or_else(|| Error::NodeNotInContext {
            node: node.to_string(),
            context: ctx.id(),
        })
    }

    // ----------------------------------------------------------------------------------
    // Linking: allocation decisions (DESIGN.md §3, "link-time allocation decisions").
    // ----------------------------------------------------------------------------------

    fn owner_check(
        &self,
        node: &TensorNode,
        stream: StreamId,
        pending_owner: &[NodeId],
    ) -> Result<bool> {
        match self.owner_stream.get(&node.id()) {
            Some(&owner) if owner != stream => Err(Error::SecondWriter {
                node: node.to_string(),
                owner,
                writer: stream,
            }),
            Some(_) => Ok(false),
            None => Ok(!pending_owner.contains(&node.id())),
        }
    }

    fn decide(
        &self,
        ctx: &Context,
        node: &TensorNode,
        writable: bool,
        owners: &[NodeId],
    ) -> Result<Decision> {
        let stream = ctx.stream();
        let mode = node
            .mode()
            .materialize()
            .ok_or_else(|| Error::NotMaterialized {
                node: node.to_string(),
                mode: node.mode().to_string(),
            })?;
        if let Some(entry) = ctx.array(node.id()) {
            let take_ownership =
                writable && entry.shared && self.owner_check(node, stream, owners)?;
            return Ok(Decision {
                node: node.clone(),
                mode,
                placement: Placement::Existing,
                sharing: None,
                take_ownership,
            });
        }
        let declared = mode.sharing();
        let local = self
            .sharing
            .get(&node.id())
            .copied()
            .unwrap_or(Sharing::Unset);
        let effective = if declared != Sharing::Unset {
            declared
        } else {
            local
        };
        let (placement, sharing, take_ownership) = match (writable, effective) {
            // Read-only data is shared by every stream of the device unless known per-stream.
            (false, Sharing::PerStream) => (Placement::Fresh, None, false),
            (false, _) => (
                Placement::Candidate,
                Some(Sharing::SharedCrossStreams),
                false,
            ),
            // A written shared node has one owner stream.
            (true, Sharing::SharedCrossStreams) => (
                Placement::Candidate,
                None,
                self.owner_check(node, stream, owners)?,
            ),
            (true, _) => (Placement::Fresh, Some(Sharing::PerStream), false),
        };
        Ok(Decision {
            node: node.clone(),
            mode,
            placement,
            sharing,
            take_ownership,
        })
    }

    /// Links a routine into `ctx`: allocates what it needs and returns the routine, whose
    /// context is a new child of `ctx`, plus plans that zero the new buffers.
    ///
    /// On error nothing changes (no allocation, no table or mode update).
    pub fn link(&mut self, ctx: &Context, spec: RoutineSpec) -> Result<(Routine, Vec<Plan>)> {
        self.check_context(ctx)?;
        let mut decisions = Vec::with_capacity(spec.params.len());
        let mut owners = Vec::new();
        for p in &spec.params {
            let writable = !matches!(p.access, Access::Read);
            let d = self.decide(ctx, &p.node, writable, &owners)?;
            if d.take_ownership {
                owners.push(d.node.id());
            }
            decisions.push(d);
        }
        if let Some(m) = &spec.merge {
            m.mode()
                .materialize()
                .ok_or_else(|| Error::NotMaterialized {
                    node: m.to_string(),
                    mode: m.mode().to_string(),
                })?;
            m.size_in_bytes()?;
        }
        let (arrays, plans) = self.place(ctx, decisions)?;
        let child = self.child_context(ctx, arrays);
        // The bindings of its buffers are fixed now (contexts are immutable): every
        // schedule shares them instead of resolving them again.
        let mut args = Vec::with_capacity(spec.params.len());
        for p in &spec.params {
            let e = self.entry(&child, &p.node)?;
            args.push(ArgBinding {
                loc: self.global(e.loc),
                bytes: e.bytes,
                dtype: p.node.dtype(),
                shape: p.node.shape().clone(),
                access: p.access,
            });
        }
        let routine = Routine(Arc::new(RoutineInner {
            empty_bindings: Bindings::empty_for(&spec.name, spec.indices()),
            name: spec.name.as_str().into(),
            args: args.into(),
            spec,
            context: child,
        }));
        Ok((routine, plans))
    }

    /// Allocates and records the buffers decided for a link; rolls back on failure.
    fn place(
        &mut self,
        ctx: &Context,
        decisions: Vec<Decision>,
    ) -> Result<(Vec<NewArray>, Vec<Plan>)> {
        let stream = ctx.stream();
        // Allocate first, so that a failure leaves every table untouched.
        let mut fresh: Vec<Option<Allocation>> = Vec::with_capacity(decisions.len());
        let mut made = Vec::new();
        for d in &decisions {
            let need = match d.placement {
                Placement::Existing => false,
                Placement::Fresh => true,
                Placement::Candidate => !self.cross_stream_candidates.contains_key(&d.node.id()),
            };
            if !need {
                fresh.push(None);
                continue;
            }
            let r = d.node.size_in_bytes().and_then(|bytes| {
                let align = d.node.dtype().size_in_bytes() as u64;
                self.pools.alloc(bytes, align, stream, &mut *self.memory)
            });
            match r {
                Ok(a) => {
                    made.push(a);
                    fresh.push(Some(a));
                }
                Err(e) => {
                    for a in made {
                        // Never used: no event to wait for.
                        let _ = self.pools.free(a, Vec::new(), stream);
                    }
                    return Err(e);
                }
            }
        }
        // Commit.
        let mut arrays = Vec::new();
        let mut plans = Vec::new();
        for (d, alloc) in decisions.into_iter().zip(fresh) {
            // Cannot fail: `decide` checked that the mode materializes.
            let _ = d.node.materialize();
            let _ = d.mode;
            if let Some(s) = d.sharing {
                self.sharing.insert(d.node.id(), s);
            }
            if d.take_ownership {
                self.owner_stream.insert(d.node.id(), stream);
            }
            let shared = matches!(d.placement, Placement::Candidate);
            if let Some(alloc) = alloc {
                let event = self.issue(stream);
                let mut uses = BufferUses::default();
                uses.record_write(event.clone());
                plans.push(Plan {
                    issue: self.next_issue(),
                    stream,
                    event,
                    deps: Vec::new(),
                    work: Work::Memset {
                        dst: self.global(alloc.loc),
                        bytes: alloc.bytes,
                    },
                });
                let bytes = d.node.size_in_bytes()?;
                self.buffers.insert(
                    alloc.loc,
                    BufferRecord {
                        node: d.node.clone(),
                        bytes,
                        alloc,
                        uses,
                        // Unknown to the host protocol: zeroed memory equals the host
                        // array only until a transfer to the host changes the array
                        // without a version change, so a hosted node is uploaded before
                        // its first read here.
                        host_version: None,
                        stream,
                        written: d.node.is_zeroed(),
                    },
                );
                if shared {
                    self.cross_stream_candidates.insert(d.node.id(), alloc.loc);
                }
                arrays.push((
                    ArrayEntry {
                        node: d.node.clone(),
                        loc: alloc.loc,
                        bytes,
                        shared,
                    },
                    !shared,
                ));
            } else if let Placement::Candidate = d.placement {
                if let Some(&loc) = self.cross_stream_candidates.get(&d.node.id()) {
                    if ctx.array(d.node.id()).is_none() {
                        let bytes = self.buffers.get(&loc).map_or(0, |b| b.bytes);
                        arrays.push((
                            ArrayEntry {
                                node: d.node.clone(),
                                loc,
                                bytes,
                                shared: true,
                            },
                            false,
                        ));
                    }
                }
            }
        }
        Ok((arrays, plans))
    }

    fn child_context(&mut self, parent: &Context, arrays: Vec<NewArray>) -> Context {
        let id = self.new_context_record(Some(parent.id()));
        let mut map = parent.0.arrays.clone();
        let mut delta = Vec::new();
        for (entry, owned) in arrays {
            if owned {
                delta.push(entry.loc);
            }
            map.insert(entry.node.id(), entry);
        }
        if let Some(r) = self.contexts.get_mut(&id) {
            r.delta = delta;
        }
        Context(Arc::new(ContextInner {
            owner: self.instance,
            id,
            stream: parent.stream(),
            parent: Some(parent.clone()),
            arrays: map,
        }))
    }

    /// Adds a buffer for `node` to a child of `ctx` without a routine (for `init_from_host`).
    ///
    /// The node must not be in `ctx` yet. Sharing follows the node's mode: shared nodes
    /// (hosted constants and volatiles, nodes declared or decided shared) get the device-wide
    /// buffer, others a fresh per-stream buffer. Returns the child and the plans to run.
    pub fn add_array(&mut self, ctx: &Context, node: &TensorNode) -> Result<(Context, Vec<Plan>)> {
        self.check_context(ctx)?;
        if ctx.contains(node) {
            return Err(Error::AlreadyInContext {
                node: node.to_string(),
                context: ctx.id(),
            });
        }
        let mode = node
            .mode()
            .materialize()
            .ok_or_else(|| Error::NotMaterialized {
                node: node.to_string(),
                mode: node.mode().to_string(),
            })?;
        let declared = mode.sharing();
        let local = self
            .sharing
            .get(&node.id())
            .copied()
            .unwrap_or(Sharing::Unset);
        let effective = if declared != Sharing::Unset {
            declared
        } else {
            local
        };
        let (placement, sharing) = match effective {
            Sharing::SharedCrossStreams => (Placement::Candidate, None),
            _ => (Placement::Fresh, Some(Sharing::PerStream)),
        };
        let d = Decision {
            node: node.clone(),
            mode,
            placement,
            sharing,
            take_ownership: false,
        };
        let (arrays, plans) = self.place(ctx, vec![d])?;
        Ok((self.child_context(ctx, arrays), plans))
    }

    // ----------------------------------------------------------------------------------
    // Scheduling (rule 1) and the merge buffer (rule 4).
    // ----------------------------------------------------------------------------------

    /// Schedules a linked routine: auto-uploads of lagging hosted inputs, then the routine.
    /// A routine that declares indices needs their values: [`DeviceState::schedule_with`].
    pub fn schedule(&mut self, routine: &Routine, host: &mut HostTable) -> Result<Vec<Plan>> {
        self.schedule_with(routine, &Bindings::none(), host)
    }

    /// [`DeviceState::schedule`] with values for the routine's declared indices, checked
    /// against its declarations first ([`Routine::bind`]: a missing, unknown, repeated or
    /// out-of-range value refuses the schedule and changes nothing) and snapshotted into
    /// the routine's plan.
    pub fn schedule_with(
        &mut self,
        routine: &Routine,
        bindings: &Bindings,
        host: &mut HostTable,
    ) -> Result<Vec<Plan>> {
        let bindings = routine.bind(bindings)?;
        self.schedule_inner(routine, MergeFrom::Slot, bindings, host)
    }

    /// Schedules `routine` reading `source` in place as its merge buffer (`StreamingFor`).
    ///
    /// The caller must record the routine's event (the last plan's) as a reader of the
    /// source on the source device ([`DeviceState::record_remote_read`]).
    pub fn schedule_streaming(
        &mut self,
        routine: &Routine,
        source: &Source,
        host: &mut HostTable,
    ) -> Result<Vec<Plan>> {
        self.check_streaming(routine, source)?;
        source.check_written()?;
        let bindings = routine.bind(Bindings::none())?;
        self.schedule_inner(routine, MergeFrom::Source(source), bindings, host)
    }

    /// Checks, without changing anything, that `routine` can be scheduled on this device
    /// reading `source` in place (`StreamingFor`): the checks of
    /// [`DeviceState::schedule_streaming`], made before a device-to-device operation
    /// plans anything on the source device.
    pub fn check_streaming(&self, routine: &Routine, source: &Source) -> Result<()> {
        self.check_context(routine.context())?;
        // A streaming consumer is scheduled without index values.
        routine.bind(Bindings::none())?;
        self.resolve(routine, &MergeFrom::Source(source))
            .map(|_| ())
    }

    /// Resolves the bindings of `routine` and its merge argument, and checks everything
    /// that can make scheduling it fail, without touching any table.
    fn resolve(
        &self,
        routine: &Routine,
        merge_from: &MergeFrom<'_>,
    ) -> Result<(Arc<[ArgBinding]>, Option<ArgBinding>)> {
        let ctx = routine.context();
        let stream = ctx.stream();
        let spec = &routine.0.spec;
        // Resolved when the routine was linked; its buffers must still be live.
        let bindings = routine.0.args.clone();
        for (p, b) in spec.params.iter().zip(bindings.iter()) {
            if !self.buffers.contains_key(&b.loc.loc) {
                return Err(Error::BufferNotFound {
                    node: p.node.to_string(),
                    loc: b.loc.loc,
                });
            }
        }
        if let MergeFrom::Source(src) = merge_from {
            if spec.merge.is_none() {
                return Err(Error::InvalidRoutine {
                    routine: spec.name.clone(),
                    reason: format!(
                        "it reads no merge buffer, so it cannot consume {}",
                        src.node
                    ),
                });
            }
            // Read in place while the kernel writes the same buffer: the kernel would get
            // overlapping shared and mutable views.
            if bindings
                .iter()
                .any(|b| b.loc == src.loc && b.access.writes())
            {
                return Err(Error::StreamingUnsupported {
                    src: src.loc.device,
                    dst: self.device,
                    reason: format!(
                        "the source buffer of {} is written by the consumer {}",
                        src.node, spec.name
                    ),
                });
            }
        }
        let merge = match (&spec.merge, merge_from) {
            (None, _) => None,
            (Some(expected), MergeFrom::Slot) => {
                let slot = &self.streams[stream.index as usize].merge;
                match (&slot.node, slot.alloc) {
                    (Some(n), Some(a)) if n == expected || mutant!("merge_check") => {
                        Some(ArgBinding {
                            loc: self.global(a.loc),
                            bytes: expected.size_in_bytes()?,
                            dtype: expected.dtype(),
                            shape: expected.shape().clone(),
                            access: Access::Read,
                        })
                    }
                    (found, _) => {
                        return Err(Error::MergeBufferMismatch {
                            stream,
                            expected: expected.to_string(),
                            found: found.as_ref().map_or("nothing".into(), |n| n.to_string()),
                        })
                    }
                }
            }
            (Some(expected), MergeFrom::Source(src)) => {
                if &src.node != expected {
                    return Err(Error::MergeBufferMismatch {
                        stream,
                        expected: expected.to_string(),
                        found: src.node.to_string(),
                    });
                }
                Some(ArgBinding {
                    loc: src.loc,
                    bytes: src.bytes,
                    dtype: expected.dtype(),
                    shape: expected.shape().clone(),
                    access: Access::Read,
                })
            }
        };
        Ok((bindings, merge))
    }

    fn schedule_inner(
        &mut self,
        routine: &Routine,
        merge_from: MergeFrom<'_>,
        bindings: Bindings,
        host: &mut HostTable,
    ) -> Result<Vec<Plan>> {
        let ctx = routine.context().clone();
        self.check_context(&ctx)?;
        let stream = ctx.stream();
        let spec = &routine.0.spec;

        // Resolve every binding before touching any table.
        let (args, merge) = self.resolve(routine, &merge_from)?;
        for (p, b) in spec.params.iter().zip(args.iter()) {
            if !matches!(p.access, Access::Write) {
                self.check_written(&ctx, &p.node, b.loc.loc, || {
                    format!("routine '{}'", spec.name)
                })?;
            }
        }

        // Automatic uploads of hosted inputs whose buffer lags the host array (rule 2).
        let mut plans = Vec::new();
        for (p, b) in spec.params.iter().zip(args.iter()) {
            if p.node.mode().is_hosted() && !matches!(p.access, Access::Write) {
                let version = host.version(p.node.id());
                let lagging = self
                    .buffers
                    .get(&b.loc.loc)
                    .is_some_and(|r| r.host_version != Some(version))
                    && !mutant!("host_upload");
                if lagging {
                    plans.push(self.plan_from_host(stream, &p.node, b.loc.loc, host)?);
                }
            }
        }

        // Rule 1: RAW on inputs, WAR and WAW on outputs (any stream, any device).
        let mut deps = Vec::new();
        for (p, b) in spec.params.iter().zip(args.iter()) {
            if let Some(rec) = self.buffers.get_mut(&b.loc.loc) {
                if !matches!(p.access, Access::Write) {
                    rec.uses.read_deps(&mut deps);
                }
                if !matches!(p.access, Access::Read) {
                    rec.uses.write_deps(stream, &mut deps);
                }
            }
        }
        match &merge_from {
            MergeFrom::Slot if merge.is_some() => {
                self.streams[stream.index as usize]
                    .merge
                    .uses
                    .read_deps(&mut deps);
            }
            MergeFrom::Source(src) => deps.extend(src.deps.iter().cloned()),
            MergeFrom::Slot => {}
        }

        let event = self.issue(stream);
        for (p, b) in spec.params.iter().zip(args.iter()) {
            let Some(rec) = self.buffers.get_mut(&b.loc.loc) else {
                continue;
            };
            if matches!(p.access, Access::Read) {
                rec.uses.record_read(event.clone());
            } else {
                rec.uses.record_write(event.clone());
                rec.written = true;
                rec.host_version = Some(host.version(p.node.id()));
                if p.node.mode().is_hosted() {
                    let order = host.order();
                    host.record(&p.node)?
                        .device_wrote(DeviceCopy { stream, loc: b.loc }, order);
                }
            }
        }
        if let (MergeFrom::Slot, Some(_)) = (&merge_from, &merge) {
            self.streams[stream.index as usize]
                .merge
                .uses
                .record_read(event.clone());
        }
        plans.push(Plan {
            issue: self.next_issue(),
            stream,
            event,
            deps,
            work: Work::Run {
                name: routine.0.name.clone(),
                kernel: spec.kernel.clone(),
                args,
                merge,
                bindings,
            },
        });
        Ok(plans)
    }

    // ----------------------------------------------------------------------------------
    // Host transfers (rule 2).
    // ----------------------------------------------------------------------------------

    /// `UninitialisedRead` if `what` (a routine, a copy) would read `node`'s buffer at
    /// `loc` in `ctx` and nothing has written it. A hosted node's buffer is uploaded before
    /// it is read, so it always has a value. The hint names a written buffer of the node
    /// on another stream of this device, if any.
    fn check_written(
        &self,
        ctx: &Context,
        node: &TensorNode,
        loc: BufferLoc,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let unwritten = self.buffers.get(&loc).is_some_and(|rec| !rec.written);
        if !unwritten || node.mode().is_hosted() {
            return Ok(());
        }
        let elsewhere = self
            .buffers
            .values()
            .filter(|rec| rec.written && rec.node.id() == node.id())
            .map(|rec| rec.stream)
            .min();
        let hint = match elsewhere {
            Some(stream) => format!(
                "; stream {stream} of this device holds a written buffer of it: share one \
                 buffer across the device's streams (`node.refine_sharing(Sharing::\
                 SharedCrossStreams)` before linking) or copy it into this context with \
                 `device_to_device`"
            ),
            None => String::new(),
        };
        Err(Error::UninitialisedRead {
            node: node.to_string(),
            context: ctx.id(),
            stream: ctx.stream(),
            what: what(),
            hint,
        })
    }

    fn plan_from_host(
        &mut self,
        stream: StreamId,
        node: &TensorNode,
        loc: BufferLoc,
        host: &mut HostTable,
    ) -> Result<Plan> {
        let hrec = host.record(node)?;
        let mut deps = Vec::new();
        // RAW on the host array (a pending to_host writes it).
        hrec.uses.read_deps(&mut deps);
        let Some(rec) = self.buffers.get_mut(&loc) else {
            return Err(Error::BufferNotFound {
                node: node.to_string(),
                loc,
            });
        };
        rec.uses.write_deps(stream, &mut deps);
        let bytes = rec.bytes;
        let event = self.issue(stream);
        let order = host.order();
        let (hrec, rec) = (host.record(node)?, self.buffers.get_mut(&loc));
        hrec.uses.record_read(event.clone());
        if let Some(rec) = rec {
            rec.uses.record_write(event.clone());
            rec.written = true;
            rec.host_version = Some(hrec.version);
        }
        let global = self.global(loc);
        // If this buffer held the newest value, it now equals the host array again.
        hrec.host_caught_up(Some(global), order);
        Ok(Plan {
            issue: self.next_issue(),
            stream,
            event,
            deps,
            work: Work::FromHost {
                host: hrec.array.clone(),
                dst: global,
                bytes,
            },
        })
    }

    fn hosted_entry<'c>(&self, ctx: &'c Context, node: &TensorNode) -> Result<&'c ArrayEntry> {
        self.check_context(ctx)?;
        if !node.mode().is_hosted() {
            return Err(Error::NotHosted {
                node: node.to_string(),
            });
        }
        self.entry(ctx, node)
    }

    /// Copies the host array of `node` into its buffer in `ctx`.
    pub fn from_host(
        &mut self,
        ctx: &Context,
        node: &TensorNode,
        host: &mut HostTable,
    ) -> Result<Plan> {
        let loc = self.hosted_entry(ctx, node)?.loc;
        self.plan_from_host(ctx.stream(), node, loc, host)
    }

    /// Copies the buffer of `node` in `ctx` into its host array.
    pub fn to_host(
        &mut self,
        ctx: &Context,
        node: &TensorNode,
        host: &mut HostTable,
    ) -> Result<Plan> {
        let loc = self.hosted_entry(ctx, node)?.loc;
        self.plan_to_host(ctx.stream(), node, loc, host)
    }

    /// Copies the buffer at `loc` (written last on `stream`) into `node`'s host array.
    pub fn plan_to_host(
        &mut self,
        stream: StreamId,
        node: &TensorNode,
        loc: BufferLoc,
        host: &mut HostTable,
    ) -> Result<Plan> {
        let Some(rec) = self.buffers.get_mut(&loc) else {
            return Err(Error::BufferNotFound {
                node: node.to_string(),
                loc,
            });
        };
        let mut deps = Vec::new();
        rec.uses.read_deps(&mut deps);
        let bytes = rec.bytes;
        let hrec = host.record(node)?;
        // WAR and WAW on the host array.
        hrec.uses.write_deps(stream, &mut deps);
        let event = self.issue(stream);
        if let Some(rec) = self.buffers.get_mut(&loc) {
            rec.uses.record_read(event.clone());
        }
        let order = host.order();
        let hrec = host.record(node)?;
        hrec.uses.record_write(event.clone());
        hrec.host_caught_up(None, order);
        Ok(Plan {
            issue: self.next_issue(),
            stream,
            event,
            deps,
            work: Work::ToHost {
                src: self.global(loc),
                host: hrec.array.clone(),
                bytes,
            },
        })
    }

    /// Copies the buffer of `node` in `ctx` into `into` (a caller-owned host buffer of the
    /// node's size): a read of the buffer that does not touch the node's host array.
    pub fn read_into(
        &mut self,
        ctx: &Context,
        node: &TensorNode,
        into: Arc<crate::memory::AlignedBuffer>,
    ) -> Result<Plan> {
        self.check_context(ctx)?;
        let loc = self.entry(ctx, node)?.loc;
        let Some(rec) = self.buffers.get_mut(&loc) else {
            return Err(Error::BufferNotFound {
                node: node.to_string(),
                loc,
            });
        };
        let mut deps = Vec::new();
        rec.uses.read_deps(&mut deps);
        let bytes = rec.bytes;
        let event = self.issue(ctx.stream());
        if let Some(rec) = self.buffers.get_mut(&loc) {
            rec.uses.record_read(event.clone());
        }
        Ok(Plan {
            issue: self.next_issue(),
            stream: ctx.stream(),
            event,
            deps,
            work: Work::ToHost {
                src: self.global(loc),
                host: into,
                bytes,
            },
        })
    }

    // ----------------------------------------------------------------------------------
    // Device to device (rule 3) and the merge buffer (rule 4).
    // ----------------------------------------------------------------------------------

    /// Describes `node`'s buffer in `ctx` as the source of a device-to-device operation.
    pub fn source(&mut self, ctx: &Context, node: &TensorNode) -> Result<Source> {
        self.check_context(ctx)?;
        let loc = self.entry(ctx, node)?.loc;
        let unwritten = self
            .check_written(ctx, node, loc, || "a copy".into())
            .err()
            .map(Box::new);
        let Some(rec) = self.buffers.get_mut(&loc) else {
            return Err(Error::BufferNotFound {
                node: node.to_string(),
                loc,
            });
        };
        let mut deps = Vec::new();
        rec.uses.read_deps(&mut deps);
        Ok(Source {
            node: node.clone(),
            loc: GlobalLoc {
                device: self.device,
                loc,
            },
            bytes: rec.bytes,
            deps,
            host_version: rec.host_version,
            unwritten,
        })
    }

    /// Whether the buffer of hosted `node` in `ctx` lags its host array: a host write came
    /// after the value it holds (or it was never uploaded), so what it stands for is the
    /// host array's value, which a routine reading it would upload first (rule 2).
    /// `false` for a node that is not hosted.
    pub fn lags(&self, ctx: &Context, node: &TensorNode, host: &HostTable) -> Result<bool> {
        self.check_context(ctx)?;
        let loc = self.entry(ctx, node)?.loc;
        Ok(node.mode().is_hosted()
            && self
                .buffers
                .get(&loc)
                .is_some_and(|r| r.host_version != Some(host.version(node.id()))))
    }

    /// Before a device-to-device operation reads `source` (described by
    /// [`DeviceState::source`] for `ctx`): if its buffer lags the host array, plans the
    /// upload that a routine reading it would do, on `ctx`'s stream, and makes the source's
    /// readers wait for that upload instead of the buffer's last write.
    ///
    /// The upload is an operation of this device like any [`DeviceState::from_host`]: it
    /// is recorded in the tables when planned, so the returned plan must be submitted
    /// whatever happens to the destination step afterwards. `None` when nothing lags.
    pub fn upload_lagging_source(
        &mut self,
        ctx: &Context,
        source: &mut Source,
        host: &mut HostTable,
    ) -> Result<Option<Plan>> {
        if !self.lags(ctx, &source.node, host)? {
            return Ok(None);
        }
        let plan = self.plan_from_host(ctx.stream(), &source.node, source.loc.loc, host)?;
        source.deps = vec![Dep {
            event: plan.event.clone(),
            kind: DepKind::Data,
        }];
        source.host_version = Some(host.version(source.node.id()));
        Ok(Some(plan))
    }

    /// Records that `event` (on any stream, any device) reads the buffer at `loc`.
    pub fn record_remote_read(&mut self, loc: BufferLoc, event: Event) {
        if mutant!("d2d_reader") {
            return;
        }
        if let Some(rec) = self.buffers.get_mut(&loc) {
            rec.uses.record_read(event);
        }
    }

    /// Forgets `event` as a reader of the buffer at `loc`: it was recorded by
    /// [`DeviceState::record_remote_read`] as a deferred event, and its operation was
    /// refused by its device (nothing reads the buffer).
    pub fn forget_remote_read(&mut self, loc: BufferLoc, event: &Event) {
        if let Some(rec) = self.buffers.get_mut(&loc) {
            rec.uses.forget_read(event);
        }
    }

    /// Copies `source` into `dst_ctx`: into the node's own buffer (`into_merge == false`,
    /// mode `No`) or into the stream's merge buffer (mode `Copy`).
    ///
    /// Returns `None` when there is nothing to do (the source *is* the destination buffer).
    /// The caller must record the returned plan's event as a reader of the source.
    pub fn copy_in(
        &mut self,
        dst_ctx: &Context,
        source: &Source,
        into_merge: bool,
        host: &mut HostTable,
    ) -> Result<Option<Plan>> {
        self.check_context(dst_ctx)?;
        let stream = dst_ctx.stream();
        let node = &source.node;
        if !into_merge {
            let loc = self.entry(dst_ctx, node)?.loc;
            let dst = self.global(loc);
            if dst == source.loc {
                return Ok(None);
            }
            source.check_written()?;
            let Some(rec) = self.buffers.get_mut(&loc) else {
                return Err(Error::BufferNotFound {
                    node: node.to_string(),
                    loc,
                });
            };
            let mut deps = source.deps.clone();
            rec.uses.write_deps(stream, &mut deps);
            let event = self.issue(stream);
            if let Some(rec) = self.buffers.get_mut(&loc) {
                rec.uses.record_write(event.clone());
                rec.written = true;
                rec.host_version = source.host_version;
            }
            if node.mode().is_hosted() {
                let order = host.order();
                let current = Some(host.version(node.id()));
                let hrec = host.record(node)?;
                if source.host_version == current {
                    hrec.device_wrote(DeviceCopy { stream, loc: dst }, order);
                } else {
                    // Not reached through `device_to_device`, which uploads a lagging
                    // source first; kept for a caller that composes the steps itself.
                    // The source lags the host array (a host write came after its value),
                    // so what it holds counts as the host's value: it would be uploaded
                    // before any routine read it (rule 2). So does the copy: it lags too,
                    // and is not a device value newer than the host. Counting it as the
                    // newest device write made the next host read transfer the stale value
                    // over the host write.
                    hrec.host_caught_up(Some(dst), order);
                }
            }
            return Ok(Some(Plan {
                issue: self.next_issue(),
                stream,
                event,
                deps,
                work: Work::Copy {
                    src: source.loc,
                    dst,
                    bytes: source.bytes,
                },
            }));
        }
        // Merge buffer: grows when a larger node arrives; the old one is retired after
        // its pending uses (rule 5), and reuse waits for the previous consumer (rule 4).
        source.check_written()?;
        let idx = stream.index as usize;
        let retire = self.streams[idx].merge.uses.all_events();
        let alloc = self
            .pools
            .merge_buffer(stream, source.bytes, retire, &mut *self.memory)?;
        let slot = &mut self.streams[idx].merge;
        if slot.alloc.map(|a| a.loc) != Some(alloc.loc) {
            slot.uses = BufferUses::default();
        }
        let mut deps = source.deps.clone();
        slot.uses.write_deps(stream, &mut deps);
        let event = self.issue(stream);
        let slot = &mut self.streams[idx].merge;
        slot.uses.record_write(event.clone());
        slot.alloc = Some(alloc);
        slot.node = Some(node.clone());
        Ok(Some(Plan {
            issue: self.next_issue(),
            stream,
            event,
            deps,
            work: Work::Copy {
                src: source.loc,
                dst: GlobalLoc {
                    device: self.device,
                    loc: alloc.loc,
                },
                bytes: source.bytes,
            },
        }))
    }

    // ----------------------------------------------------------------------------------
    // Finalization (rule 5) and device sync.
    // ----------------------------------------------------------------------------------

    /// Finalizes `ctx`: frees the buffers it allocated once every pending use of them has
    /// completed. Hosted nodes whose newest value lives only in a freed buffer are first
    /// transferred to their host array (the returned plans).
    pub fn finalize(&mut self, ctx: &Context, host: &mut HostTable) -> Result<Vec<Plan>> {
        self.check_context(ctx)?;
        let Some(record) = self.contexts.get(&ctx.id()) else {
            return Err(Error::ContextFinalized { context: ctx.id() });
        };
        if record.children > 0 {
            return Err(Error::ContextInUse {
                context: ctx.id(),
                children: record.children,
            });
        }
        let Some(record) = self.contexts.remove(&ctx.id()) else {
            return Err(Error::ContextFinalized { context: ctx.id() });
        };
        if let Some(p) = record.parent.and_then(|p| self.contexts.get_mut(&p)) {
            p.children -= 1;
        }
        let mut plans = Vec::new();
        for loc in record.delta {
            let global = self.global(loc);
            let write_back = self.buffers.get(&loc).and_then(|rec| {
                let node = rec.node.clone();
                let newer = host.get(node.id()).and_then(|h| h.newer_on_device());
                newer.filter(|c| c.loc == global).map(|c| (node, c.stream))
            });
            if let Some((node, stream)) = write_back {
                plans.push(self.plan_to_host(stream, &node, loc, host)?);
            }
            if let Some(mut rec) = self.buffers.remove(&loc) {
                let mut events = rec.uses.all_events();
                if mutant!("deferred_free") {
                    events.clear();
                }
                let _ = self.pools.free(rec.alloc, events, rec.stream);
            }
        }
        self.pools.reclaim(&mut *self.memory);
        Ok(plans)
    }

    /// Whether `ctx` is live (not finalized).
    pub fn is_live(&self, ctx: &Context) -> bool {
        ctx.0.owner == self.instance && self.contexts.contains_key(&ctx.id())
    }
}

/// What [`device_to_device`] planned. Submit `upload` (when there is one) whatever
/// `destination` says: it is already recorded in the source device's tables.
#[derive(Debug)]
pub struct DeviceToDevicePlans {
    /// The upload of a source buffer that lagged its host array, on the source's stream.
    pub upload: Option<Plan>,
    /// The copy or the streaming consumer (with the consumer's own uploads first), empty
    /// when both contexts share the buffer; or why the destination step failed after the
    /// upload was planned (a merge buffer that could not be allocated).
    pub destination: Result<Vec<Plan>>,
}

/// Plans a device-to-device operation of `node` from `src` (on `devices[si]`) to `dst` (on
/// `devices[di]`; may be the same device) (DESIGN.md §3, rule 3):
///
/// 1. every check that can refuse the operation, with nothing planned yet;
/// 2. the source describes its buffer and, if it lags the host array, plans its upload (a
///    copy never reads a stale value: a lagging buffer stands for the host's value);
/// 3. the destination plans the copy or the streaming consumer and assigns its event;
/// 4. the source records that event as a reader.
///
/// Nothing is planned when both contexts share the buffer (mode `No`). `can_stream` says
/// whether the destination can read the source in place. An `Err` means nothing was
/// planned; a failure after the upload was planned is in
/// [`DeviceToDevicePlans::destination`].
///
/// The single-owner composition used by [`crate::Engine`] and the loom models; the actor
/// coordinator performs the same steps with messages.
#[allow(clippy::too_many_arguments)]
pub fn device_to_device(
    devices: &mut [DeviceState],
    si: usize,
    di: usize,
    node: &TensorNode,
    src: &Context,
    dst: &Context,
    mode: super::MergeBufferUse,
    can_stream: bool,
    host: &mut HostTable,
) -> Result<DeviceToDevicePlans> {
    use super::MergeBufferUse;
    let count = devices.len();
    let unknown = |index: usize| Error::NoSuchDevice { index, count };
    devices
        .get(di)
        .ok_or_else(|| unknown(di))?
        .check_context(dst)?;
    check_streaming_placement(&mode, src, dst, can_stream)?;
    let mut source = devices
        .get_mut(si)
        .ok_or_else(|| unknown(si))?
        .source(src, node)?;
    let dst_state = devices.get(di).ok_or_else(|| unknown(di))?;
    match &mode {
        MergeBufferUse::No => {
            let loc = dst_state.entry(dst, node)?.loc;
            if dst_state.global(loc) == source.loc {
                return Ok(DeviceToDevicePlans {
                    upload: None,
                    destination: Ok(Vec::new()),
                });
            }
        }
        MergeBufferUse::Copy => {}
        MergeBufferUse::StreamingFor(routine) => dst_state.check_streaming(routine, &source)?,
    }
    let upload = devices[si].upload_lagging_source(src, &mut source, host)?;
    let dst_state = &mut devices[di];
    let destination = match mode {
        MergeBufferUse::No | MergeBufferUse::Copy => {
            let into_merge = matches!(mode, MergeBufferUse::Copy);
            dst_state
                .copy_in(dst, &source, into_merge, host)
                .map(|plan| plan.into_iter().collect::<Vec<_>>())
        }
        MergeBufferUse::StreamingFor(routine) => {
            dst_state.schedule_streaming(&routine, &source, host)
        }
    };
    if let Some(last) = destination.as_ref().ok().and_then(|p| p.last()) {
        devices[si].record_remote_read(source.loc.loc, last.event.clone());
    }
    Ok(DeviceToDevicePlans {
        upload,
        destination,
    })
}

/// The checks of a `StreamingFor` operation that need no device state: the consumer runs
/// on the destination stream, and the backend can read the source's memory there.
/// Shared by [`device_to_device`] and the actor coordinator.
pub fn check_streaming_placement(
    mode: &super::MergeBufferUse,
    src: &Context,
    dst: &Context,
    can_stream: bool,
) -> Result<()> {
    let super::MergeBufferUse::StreamingFor(routine) = mode else {
        return Ok(());
    };
    if routine.context().stream() != dst.stream() {
        return Err(Error::InvalidRoutine {
            routine: routine.name().into(),
            reason: format!(
                "streaming consumer runs on {}, destination is {}",
                routine.context().stream(),
                dst.stream()
            ),
        });
    }
    if !can_stream {
        return Err(Error::StreamingUnsupported {
            src: src.device(),
            dst: dst.device(),
            reason: "the backend cannot read that memory in place".into(),
        });
    }
    Ok(())
}
