//! The per-device protocol state machine. See DESIGN.md §3.
//!
//! [`DeviceState`] owns one device's tables and pools and turns each operation into [`Plan`]s.
//! It neither waits nor runs anything. While deciding it asks only for pool memory, through
//! [`PoolMemory`]; a slab the backend cannot create fails the operation before any table
//! changes. Where the rules of §3 are enforced:
//!
//! 1. [`DeviceState::schedule`], through [`BufferUses::read_deps`] and [`BufferUses::write_deps`].
//! 2. [`DeviceState::from_host`], [`DeviceState::to_host`] and the [`HostTable`]. The engine
//!    drives host reads and writes.
//! 3. [`device_to_device`] composes [`DeviceState::source`],
//!    [`DeviceState::upload_lagging_source`], [`DeviceState::copy_in`] or
//!    [`DeviceState::schedule_streaming`], and [`DeviceState::record_remote_read`].
//! 4. `schedule` checks the merge-buffer slot, and `copy_in` records its uses.
//! 5. [`DeviceState::finalize`] hands every pending use to the pools.
//! 6. [`DepKind::Data`] dependencies carry failures, which executors apply.
//!
//! This file holds the state, its tables and the issue order. Each job on them has a file:
//! `context.rs`, `schedule.rs`, `host.rs`, `copy.rs` and `replay.rs`.

use std::sync::Arc;

mod context;
mod copy;
mod host;
mod record;
mod replay;
mod schedule;

pub use copy::{check_streaming_placement, device_to_device, DeviceToDevicePlans, Source};
pub use record::{DeviceStep, StepRecorder};
pub(crate) use replay::invalidated;
pub use replay::{ReplayLinks, ReplayProgress, ReplayRun};

use crate::{
    error::{Error, Result},
    event::{Event, Timeline},
    ids::{BufferLoc, ContextId, DeviceId, IdMap, NodeId, StreamId},
    memory::{Allocation, DevicePools, PoolConfig, PoolMemory, PoolStats},
    node::{MemoryMode, Sharing, TensorNode},
    protocol::{
        context::{ArrayEntry, Context, ContextInner},
        plan::{next_issue, GlobalLoc, OP_STAMPS},
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
    /// The stamp of the operation being decided: the position once it is decided.
    deciding: Option<u64>,
    /// The stamp of the last stamped operation decided (or replayed template).
    position: Option<u64>,
    /// The lists every step captured here lends its replays ([`record::SpareLists`]).
    spare_lists: std::sync::Arc<record::SpareLists>,
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
            deciding: None,
            position: None,
            spare_lists: record::SpareLists::new(),
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
        self.publish_position();
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
    /// engine does; the operation stamped before is then decided, and what the device does
    /// between operations (a sweep's pool release) is placed after it (a device actor's
    /// operations all have stamps).
    pub fn set_issue_stamp(&mut self, stamp: Option<u64>) {
        match stamp {
            Some(s) => self.deciding = Some(s),
            None => {
                if let Some(s) = self.deciding.take() {
                    self.advance_position(s);
                }
            }
        }
        self.stamp = stamp;
        self.publish_position();
    }

    /// Drops the stamp of an operation that was not decided after all: it waits for
    /// another device's answer or a host gate, and will be decided again later. What the
    /// device does meanwhile (returning freed memory after its batch) stays placed after
    /// what it decided before, and before the plans that operation will make: placed after
    /// them, the release of a pool came after the plans on a new pool with the same id that
    /// the operation made once it could go on (a replay's templates decided before it
    /// waited keep their place).
    pub(crate) fn abandon_issue_stamp(&mut self) {
        self.stamp = None;
        self.deciding = None;
        self.publish_position();
    }

    /// Stamps a replayed template being decided (it is decided once stamped).
    fn stamp_template(&mut self, stamp: u64) {
        self.stamp = Some(stamp);
        self.advance_position(stamp);
        self.publish_position();
    }

    fn advance_position(&mut self, stamp: u64) {
        self.position = Some(self.position.map_or(stamp, |p| p.max(stamp)));
    }

    /// Back to the issue clock for everything, as a single-owner engine is outside a
    /// replay: no stamp for the next plans, and what the device does between operations
    /// is placed by the clock too. The engine's later plans take the clock's stamps, so
    /// the position of the replay's last operation would place its later pool releases
    /// before them (and before the plans that used the pools).
    pub(crate) fn clear_issue_stamp(&mut self) {
        self.stamp = None;
        self.deciding = None;
        self.position = None;
        self.publish_position();
    }

    /// Sets the thread's [`current_issue`](crate::protocol::current_issue): the stamp of
    /// the operation being decided, or just after the last one decided (so that a pool
    /// released by a sweep is placed among the plans of the program where it happens):
    /// the end of the `OP_STAMPS` block of its stamp, which is the end of its call's step
    /// because reservations start blocks ([`crate::protocol::reserve_issue_stamps`]).
    /// Every method that may release a pool outside an operation calls it first: the
    /// thread may have decided for another device since.
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
}

#[cfg(all(test, not(tributary_loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{
        ids::PoolId,
        kernels,
        node::DType,
        protocol::{current_issue, reserve_issue_stamps, HostTable},
    };

    /// Pool memory that keeps, for each release, the pool and [`current_issue`] then (what
    /// the graph checker of the random programs places the release by).
    #[derive(Clone, Default)]
    struct Releases(Arc<std::sync::Mutex<Vec<(PoolId, u64)>>>);

    impl PoolMemory for Releases {
        fn create_pool(&mut self, _pool: PoolId, _bytes: u64, _align: u64) -> Result<()> {
            Ok(())
        }

        fn release_pool(&mut self, pool: PoolId) {
            self.0.lock().unwrap().push((pool, current_issue()));
        }
    }

    fn device(index: u32, pool_bytes: u64, memory: Releases) -> DeviceState {
        let device = DeviceId(index);
        DeviceState::new(
            device,
            vec![Timeline::new(StreamId { device, index: 0 })],
            PoolConfig {
                pool_bytes,
                ..PoolConfig::default()
            },
            Box::new(memory),
        )
    }

    /// A pool released between operations (by a sweep, or while an operation without a
    /// stamp such as a link is decided) is placed after the plans of the last operation
    /// the device decided and before the stamps of every later call. A call's stamps used
    /// to start wherever the clock was, and "the end of its block" was rounded to a
    /// multiple of `OP_STAMPS`, which could lie among the next call's stamps: the checker
    /// then saw the next call's plans on a new pool with a reused id before the release of
    /// the old one (a "missing edge" of `system_device_programs_match_the_reference`).
    #[test]
    fn releases_between_operations_are_placed_before_every_later_call() {
        let mut state = device(0, 1 << 20, Releases::default());
        for bump in [1, 7, OP_STAMPS / 2 + 3] {
            for offset in [0, 1, OP_STAMPS / 2, OP_STAMPS - 1] {
                // Plans made without a stamp (a link's memsets, the engine's) move the
                // clock by one each.
                for _ in 0..bump {
                    next_issue();
                }
                let base = reserve_issue_stamps(OP_STAMPS);
                assert_eq!(base % OP_STAMPS, 0, "a call's stamps start a block");
                state.set_issue_stamp(Some(base + offset));
                state.set_issue_stamp(None);
                let placed = current_issue();
                assert!(
                    base + offset <= placed && placed < base + OP_STAMPS,
                    "bump {bump}, offset {offset}: a release after the call stamped \
                     {base}..{} is placed at {placed}",
                    base + OP_STAMPS
                );
            }
        }
    }

    /// A device that returns freed memory after its batch (`reclaim_freed`) places the
    /// releases by its own position, not by whatever another device decided last on the
    /// same thread (a host thread decides for any device whose inbox it found idle).
    #[test]
    fn reclaim_places_releases_by_the_device_that_releases() {
        let releases = Releases::default();
        let mut a = device(0, 256, releases.clone());
        let mut b = device(1, 256, Releases::default());
        let root = a.root_context(0).unwrap();
        let mut children = Vec::new();
        for name in ["x", "y"] {
            // 1 KiB: a dedicated pool each.
            let node = TensorNode::new(name, DType::F32, vec![256]);
            let (routine, _memset) = a.link(&root, kernels::fill(&node, 1.0).unwrap()).unwrap();
            children.push(routine.context().clone());
        }
        let finalize = reserve_issue_stamps(OP_STAMPS);
        a.set_issue_stamp(Some(finalize));
        for child in &children {
            a.finalize(child, &mut HostTable::default()).unwrap();
        }
        a.set_issue_stamp(None);
        assert!(
            releases.0.lock().unwrap().is_empty(),
            "the memsets still run"
        );
        // Device b decides a later call on this thread.
        let later = reserve_issue_stamps(OP_STAMPS);
        b.set_issue_stamp(Some(later));
        b.set_issue_stamp(None);
        // The memsets complete; a's memory comes back, one empty pool is released.
        a.timeline(0).unwrap().signal(a.issued(0));
        a.reclaim_freed();
        let released = releases.0.lock().unwrap().clone();
        assert_eq!(released.len(), 1, "{released:?}");
        let placed = released[0].1;
        assert!(
            finalize <= placed && placed < later,
            "the release after a's call stamped {finalize} is placed at {placed}, among \
             b's later call ({later})"
        );
    }
}
