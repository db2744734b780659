//! The host side of the actor layer: [`Dispatcher`] turns each host call into operations for
//! the devices it concerns.
//!
//! The dispatcher decides where each part of a call goes and what the parts tell each other.
//! The device cores decide what each part plans, in their own inbox order. All of a call's
//! operations go out in one atomic post, [`super::inbox::post_atomically`], and take their
//! stamps inside it. So stamp order is the order every inbox agrees on.
//!
//! A copy is a source half and a destination half. The source records the destination's
//! [`PendingEvent`] as a reader and answers it. An all-reduce is one such pair per step, all
//! in one post. An operation that must follow another device's use of a host array is gated
//! on a fence of that device, posted with it. See DESIGN.md §4, "Cross-device calls without
//! round trips" and "Host arrays are shared by every device".

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc as StdArc;
use std::task::{Context as TaskContext, Poll};

use smallvec::SmallVec;

use crate::{
    collective::{AllReduceStep, Transfer},
    engine::MergeBufferUse,
    error::{Error, Result},
    event::{Event, Timeline},
    ids::{DeviceId, StreamId},
    kernels::{Bindings, RoutineSpec},
    memory::AlignedBuffer,
    node::TensorNode,
    pending::{CellPool, Oneshot, PendingEvent, SeqPromise},
    protocol::{
        check_streaming_placement, reserve_issue_stamps, Context, HostTable, Routine, Source,
    },
    replay::Edge,
    sync::{Arc, Mutex},
};

use super::{
    auto::{AutoReplay, Barrier, Call, Issued, ReplayStats},
    hosted::{self, hosted_uses, NodeGuard, NodeLock, NodeLocks},
    inbox::{post_atomically, Inbox, Refused},
    messages::Part,
    messages::{
        pooled_reply, reply, Answer, AnswerPool, Delivery, DeviceOp, Parts, Query, ReadValue,
        Record, SourceLink,
    },
    replay::ReplayPools,
};

/// Stamps reserved per step of a call (a copy's source half takes the first ones, its
/// destination half those from [`DEST_STAMPS`]).
pub(super) const STEP_STAMPS: u64 = crate::protocol::OP_STAMPS;
/// Offset of a destination half's stamps within its step.
const DEST_STAMPS: u64 = STEP_STAMPS / 2;

/// One device as the dispatcher sees it.
pub struct DeviceSlot {
    /// The device.
    pub id: DeviceId,
    /// Its inbox.
    pub inbox: Arc<Inbox<DeviceOp>>,
    /// Its streams' timelines (index = stream index).
    pub timelines: Vec<Arc<Timeline>>,
}

/// Whether the backend can read `src`'s memory in place on `dst`.
pub type CanStream = StdArc<dyn Fn(DeviceId, DeviceId) -> bool + Send + Sync>;

/// An all-reduce as the dispatcher receives it (checked whole before anything is posted).
#[derive(Clone, Debug)]
pub struct AllReduceCall {
    /// The steps, in issue order.
    pub steps: Vec<AllReduceStep>,
    /// The chunk nodes.
    pub nodes: Vec<TensorNode>,
    /// The contexts, one per participant.
    pub contexts: Vec<Context>,
    /// Per context, per chunk: the routine adding the merge buffer into the chunk.
    pub merge: Vec<Vec<Routine>>,
    /// Per context: scale routines (indexed by chunk), for means.
    pub scale: Vec<Vec<Routine>>,
    /// How reduce steps move data.
    pub transfer: Transfer,
}

/// A host write in flight, as the automatic replay knows it (`AutoReplay::begin_write`):
/// ended when dropped, on every path out of the write.
struct Writing<'d>(Option<&'d AutoReplay>);

impl<'d> Writing<'d> {
    fn begin(d: &'d Dispatcher) -> Writing<'d> {
        if let Some(auto) = &d.auto {
            auto.begin_write(d);
        }
        Writing(d.auto.as_ref())
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        if let Some(auto) = self.0 {
            auto.end_write();
        }
    }
}

/// Who makes a call's posts: the caller, or the automatic replay (`super::auto`) issuing
/// what it held, learning or replaying, under its lock (its posts do not interrupt it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    /// A call of its own: the automatic replay issues what it holds first.
    Caller,
    /// The automatic replay's own post.
    Auto,
}

/// Hands out the [`Record`] of a recorded call's next operation: `(positions it takes in
/// the step, the cross-device edge it is, the devices (indices) its parts go to)`.
pub(super) type Recording<'a> = &'a mut dyn FnMut(u32, Option<Edge>, &[usize]) -> Record;

/// The edge a copy from `src` to `dst` (its destination operation on `dst_stream`) is in a
/// captured step: none within one device.
fn copy_edge(src: &Context, dst: &Context, dst_stream: StreamId) -> Option<Edge> {
    (src.device() != dst.device()).then(|| Edge {
        src: src.device(),
        dst: dst.device(),
        dst_stream,
    })
}

/// Routes host calls into device inboxes; see the module documentation. Shared by every
/// host thread (`Send + Sync`); every method posts atomically.
pub struct Dispatcher {
    devices: Vec<DeviceSlot>,
    can_stream: CanStream,
    host: Arc<Mutex<HostTable>>,
    nodes: NodeLocks,
    /// Statistics: fences posted as gates, and fences waited for by the host.
    fences: FenceCounts,
    /// The cells of the pending events this dispatcher hands out, reused.
    cells: Arc<CellPool>,
    /// What replays reuse.
    replays: ReplayPools,
    /// The cells of copies' verdicts, reused.
    verdicts: Arc<AnswerPool<Source>>,
    /// The automatic replay, when it is on (`super::auto`).
    auto: Option<AutoReplay>,
}

/// How often host-array order cost a fence (statistics, [`Dispatcher::fence_counts`]).
#[derive(Debug, Default)]
struct FenceCounts {
    gates: std::sync::atomic::AtomicU64,
    waited: std::sync::atomic::AtomicU64,
}

/// Fences posted so far: `gates` ordered a device operation after another device's
/// earlier ones (no round trip); `waited` were waited for by a host call (host reads and
/// writes: one round trip per device each).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct FenceStats {
    /// Fences an operation was gated on.
    pub gates: u64,
    /// Fences a host call waited for.
    pub waited: u64,
}

impl Dispatcher {
    /// A dispatcher over `devices` (any order; sorted by id here), whose cores share the
    /// host arrays `host`.
    pub fn new(
        mut devices: Vec<DeviceSlot>,
        can_stream: CanStream,
        host: Arc<Mutex<HostTable>>,
    ) -> Dispatcher {
        devices.sort_by_key(|d| d.id);
        Dispatcher {
            devices,
            can_stream,
            host,
            nodes: NodeLocks::default(),
            fences: FenceCounts::default(),
            cells: CellPool::new(),
            replays: ReplayPools::new(),
            verdicts: AnswerPool::new(),
            auto: None,
        }
    }

    /// This dispatcher with the automatic replay on (`on`) or off (the default): see
    /// DESIGN.md §4, "Automatic replay". Each replay is marked on `timeline`, if given.
    pub fn with_auto_replay(
        mut self,
        on: bool,
        timeline: Option<StdArc<crate::trace::Recorder>>,
    ) -> Dispatcher {
        self.auto = on.then(|| AutoReplay::new(timeline));
        self
    }

    /// The automatic replay, when it is on.
    pub(super) fn auto(&self) -> Option<&AutoReplay> {
        self.auto.as_ref()
    }

    /// What the automatic replay did so far (`None` when it is off).
    pub fn replay_stats(&self) -> Option<ReplayStats> {
        self.auto.as_ref().map(|a| a.stats())
    }

    /// Issues every call the automatic replay holds, now (a shutdown does, so that they run).
    pub fn release_held(&self) {
        if let Some(auto) = &self.auto {
            auto.release_all(self);
        }
    }

    /// Tells the automatic replay of a call it does not replay: it issues what it holds
    /// first, and `barrier` says what the call does to what it learned.
    pub(crate) fn interrupt(&self, barrier: Barrier) {
        if let Some(auto) = &self.auto {
            auto.interrupt(self, barrier);
        }
    }

    /// Fences posted so far (see [`FenceStats`]).
    pub fn fence_counts(&self) -> FenceStats {
        use std::sync::atomic::Ordering::Relaxed;
        FenceStats {
            gates: self.fences.gates.load(Relaxed),
            waited: self.fences.waited.load(Relaxed),
        }
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// The devices, by index.
    pub fn devices(&self) -> &[DeviceSlot] {
        &self.devices
    }

    /// The host arrays.
    pub fn host(&self) -> &Arc<Mutex<HostTable>> {
        &self.host
    }

    /// The index of device `id`; [`Error::UnknownDevice`] if it is not one of ours.
    pub fn index_of(&self, id: DeviceId) -> Result<usize> {
        self.devices
            .iter()
            .position(|d| d.id == id)
            .ok_or(Error::UnknownDevice {
                device: id,
                count: self.devices.len(),
            })
    }

    /// Device `index`; [`Error::NoSuchDevice`] beyond the devices.
    pub fn slot(&self, index: usize) -> Result<&DeviceSlot> {
        self.devices.get(index).ok_or(Error::NoSuchDevice {
            index,
            count: self.devices.len(),
        })
    }

    /// The timeline of `stream`.
    fn timeline(&self, stream: StreamId) -> Result<Arc<Timeline>> {
        let slot = &self.devices[self.index_of(stream.device)?];
        slot.timelines
            .get(stream.index as usize)
            .cloned()
            .ok_or(Error::NoSuchStream {
                device: stream.device,
                index: stream.index as usize,
                count: slot.timelines.len(),
            })
    }

    fn pending(&self, stream: StreamId) -> Result<(PendingEvent, SeqPromise)> {
        Ok(PendingEvent::pooled(self.timeline(stream)?, &self.cells))
    }

    /// What replays reuse (`super::replay`).
    pub(super) fn replay_pools(&self) -> &ReplayPools {
        &self.replays
    }

    /// A pending operation on `stream` and the promise that decides it (for messages that
    /// hand their ticket out before they are posted).
    pub fn pending_event(&self, stream: StreamId) -> Result<(PendingEvent, SeqPromise)> {
        self.pending(stream)
    }

    fn closed(r: Refused) -> Error {
        match r {
            Refused::Closed(device) => Error::ShutDown(format!("device {device} is shut down")),
        }
    }

    /// Posts `parts` as one atomic step: stamps, host-array gates, one post. A call of its
    /// own to the automatic replay: what it holds is issued first (`super::auto`).
    pub(super) fn post(&self, parts: Parts) -> Result<()> {
        match &self.auto {
            None => self.post_now(parts),
            Some(auto) => {
                // An invalidating call's post happens under the automatic replay's lock
                // (`AutoReplay::interrupt_posting`).
                let barrier = Barrier::of(parts.iter().map(|p| &p.op));
                auto.interrupt_posting(self, barrier, || self.post_now(parts))
            }
        }
    }

    /// [`Dispatcher::post`] for a call made `via` the caller or the automatic replay.
    pub(super) fn post_via(&self, via: Via, parts: Parts) -> Result<()> {
        match via {
            Via::Caller => self.post(parts),
            Via::Auto => self.post_now(parts),
        }
    }

    /// [`Dispatcher::post`] without the automatic replay's interruption: its own posts.
    fn post_now(&self, mut parts: Parts) -> Result<()> {
        if parts.len() == 1 {
            if let Some(p) = parts.pop() {
                return self.post_one_now(p);
            }
        }
        self.post_holding_now(parts, None)
    }

    /// One operation to one device, a call of its own to the automatic replay.
    pub(super) fn post_one(&self, p: Part) -> Result<()> {
        match &self.auto {
            None => self.post_one_now(p),
            Some(auto) => {
                let barrier = Barrier::of(std::iter::once(&p.op));
                auto.interrupt_posting(self, barrier, || self.post_one_now(p))
            }
        }
    }

    /// [`Dispatcher::post_one`] for a call made `via` the caller or the automatic replay.
    pub(super) fn post_one_via(&self, via: Via, p: Part) -> Result<()> {
        match via {
            Via::Caller => self.post_one(p),
            Via::Auto => self.post_one_now(p),
        }
    }

    /// One operation to one device: no allocation unless it touches a hosted node (then
    /// the general path takes its node locks and gates).
    fn post_one_now(&self, p: Part) -> Result<()> {
        let mut hosted = false;
        hosted_uses(&p.op, |_, _| hosted = true);
        if hosted {
            return self.post_holding_now(Parts::from_iter([p]), None);
        }
        let Part {
            device,
            offset,
            span,
            op,
            ..
        } = p;
        let mut op = Some(op);
        self.devices[device]
            .inbox
            .post_with(|push| {
                if let Some(mut op) = op.take() {
                    // Inside the lock: stamp order is this inbox's order.
                    if let Some(s) = op.stamp_mut() {
                        *s = reserve_issue_stamps(span * STEP_STAMPS) + offset;
                    }
                    push(op);
                }
            })
            .map_err(Self::closed)
    }

    /// [`Dispatcher::post`] by a caller that already holds `held` (a host read or write,
    /// or a read of a hosted node, posting under its node's lock).
    ///
    /// Without the automatic replay's interruption: a caller holding a node's lock told it
    /// before taking the lock (`host_write`), and a post with no node lock held passes
    /// [`Dispatcher::post`] first.
    fn post_holding_now(&self, mut parts: Parts, held: Option<&NodeGuard>) -> Result<()> {
        let guards = hosted::gate(&self.nodes, &self.fences.gates, &mut parts, held);
        // By device, then (stable) fences before the other parts of their step on their
        // device (see `gate`). Nothing here allocates for up to four parts and devices.
        parts.sort_by_key(|p| (p.device, p.step, !p.fence));
        let mut devices: SmallVec<[usize; 4]> = parts.iter().map(|p| p.device).collect();
        devices.dedup();
        let steps = parts
            .iter()
            .map(|p| p.step as u64 + p.span)
            .max()
            .unwrap_or(1);
        let inboxes: SmallVec<[&Inbox<DeviceOp>; 4]> =
            devices.iter().map(|&d| &*self.devices[d].inbox).collect();
        let mut stamped = false;
        let result = post_atomically(&inboxes, |i, push| {
            if !stamped {
                // Inside every lock: stamp order is the order all these inboxes agree on.
                let base = reserve_issue_stamps(steps * STEP_STAMPS);
                for p in parts.iter_mut() {
                    if let Some(s) = p.op.stamp_mut() {
                        *s = base + p.step as u64 * STEP_STAMPS + p.offset;
                    }
                }
                stamped = true;
            }
            // `post_atomically` fills the inboxes once each, in device order: this device's
            // parts lead what is left.
            let mine = parts.iter().take_while(|p| p.device == devices[i]).count();
            for p in parts.drain(..mine) {
                if p.gates.is_empty() {
                    push(p.op);
                } else {
                    push(DeviceOp::Gated {
                        gates: p.gates,
                        op: Box::new(p.op),
                    });
                }
            }
        });
        drop(guards);
        result.map_err(Self::closed)
    }

    /// Posts `op` to device `index` (whatever device its contexts name: the device checks
    /// them, so an operation sent to the wrong actor is refused there).
    pub fn post_to(&self, index: usize, op: DeviceOp) -> Result<()> {
        self.slot(index)?;
        self.post(Parts::from_iter([Part::new(index, 0, 0, op)]))
    }

    /// Posts `make(reply)` to device `index` and returns the answer to wait on.
    pub fn request<T: Clone>(
        &self,
        index: usize,
        make: impl FnOnce(super::messages::Reply<T>) -> DeviceOp,
    ) -> Result<Answer<T>> {
        self.request_via(Via::Caller, index, make)
    }

    /// [`Dispatcher::request`], posted `via` the caller or the automatic replay (its
    /// capture's fences).
    pub(super) fn request_via<T: Clone>(
        &self,
        via: Via,
        index: usize,
        make: impl FnOnce(super::messages::Reply<T>) -> DeviceOp,
    ) -> Result<Answer<T>> {
        self.slot(index)?;
        let (r, answer) = reply();
        self.post_via(via, Parts::from_iter([Part::new(index, 0, 0, make(r))]))?;
        Ok(answer)
    }

    /// A root context on stream `stream` of device `index`.
    pub fn new_context(&self, index: usize, stream: usize) -> Result<Answer<Context>> {
        self.request(index, |reply| DeviceOp::NewContext { stream, reply })
    }

    /// Links `spec` into `ctx`.
    pub fn link(&self, ctx: &Context, spec: RoutineSpec) -> Result<Answer<Routine>> {
        let d = self.index_of(ctx.device())?;
        self.request(d, |reply| DeviceOp::Link {
            ctx: ctx.clone(),
            spec: Box::new(spec),
            reply,
        })
    }

    /// Schedules `routine` with `bindings` (checked by the caller, `Routine::bind`): its
    /// event, planned when its device reaches it.
    pub fn schedule(&self, routine: &Routine, bindings: Bindings) -> Result<PendingEvent> {
        self.schedule_recorded(routine, bindings, None, Via::Caller)
    }

    /// [`Dispatcher::schedule`], recorded into a step being captured if `record`.
    pub(super) fn schedule_recorded(
        &self,
        routine: &Routine,
        bindings: Bindings,
        record: Option<&Record>,
        via: Via,
    ) -> Result<PendingEvent> {
        let (pending, promise) = self.pending(routine.context().stream())?;
        let d = self.index_of(routine.context().device())?;
        let part = Part::new(
            d,
            0,
            0,
            DeviceOp::Schedule {
                stamp: 0,
                routine: routine.clone(),
                bindings,
                promise,
            },
        );
        self.post_one_via(via, part.recorded(record))?;
        Ok(pending)
    }

    /// [`Dispatcher::schedule`] through the automatic replay, when it is on: issued, or
    /// held for a replay of its segment ([`Issued`]; see DESIGN.md §4, "Automatic replay").
    pub fn auto_schedule(
        self: &StdArc<Self>,
        routine: &Routine,
        bindings: Bindings,
    ) -> Result<Issued> {
        match &self.auto {
            None => Ok(Issued::Now(self.schedule(routine, bindings)?)),
            Some(auto) => auto
                .call(self, Call::Schedule(routine, &bindings))?
                .pop()
                .ok_or_else(|| Error::Internal("a schedule returned no ticket".into())),
        }
    }

    /// [`Dispatcher::device_to_device`] through the automatic replay, when it is on.
    pub fn auto_device_to_device(
        self: &StdArc<Self>,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Issued>> {
        match &self.auto {
            None => Ok(self
                .device_to_device(node, src, dst, mode)?
                .map(Issued::Now)),
            Some(auto) => Ok(auto
                .call(
                    self,
                    Call::Copy {
                        node,
                        src,
                        dst,
                        mode: &mode,
                    },
                )?
                .pop()),
        }
    }

    /// [`Dispatcher::all_reduce`] through the automatic replay, when it is on.
    pub fn auto_all_reduce(self: &StdArc<Self>, call: &AllReduceCall) -> Result<Vec<Issued>> {
        match &self.auto {
            None => Ok(self
                .all_reduce(call)?
                .into_iter()
                .map(Issued::Now)
                .collect()),
            Some(auto) => Ok(auto.call(self, Call::AllReduce(call))?.into_vec()),
        }
    }

    /// Uploads (`up`) or downloads the host array of hosted `node` in `ctx`.
    pub fn transfer(&self, ctx: &Context, node: &TensorNode, up: bool) -> Result<PendingEvent> {
        let (pending, promise) = self.pending(ctx.stream())?;
        self.transfer_with(ctx, node, up, promise)?;
        Ok(pending)
    }

    /// [`Dispatcher::transfer`], deciding `promise`.
    pub fn transfer_with(
        &self,
        ctx: &Context,
        node: &TensorNode,
        up: bool,
        promise: SeqPromise,
    ) -> Result<()> {
        let d = self.index_of(ctx.device())?;
        self.post(smallvec::smallvec![Part::new(
            d,
            0,
            0,
            DeviceOp::Transfer {
                stamp: 0,
                ctx: ctx.clone(),
                node: node.clone(),
                up,
                promise,
            },
        )])
    }

    /// Adds a buffer of hosted `node` to a child of `ctx`, uploaded from the host array.
    pub fn init_from_host(&self, ctx: &Context, node: &TensorNode) -> Result<Answer<Context>> {
        let d = self.index_of(ctx.device())?;
        self.request(d, |reply| DeviceOp::InitFromHost {
            stamp: 0,
            ctx: ctx.clone(),
            node: node.clone(),
            reply,
        })
    }

    /// Reads `node` in `ctx` into `into`: the value a routine would read (or the bytes as
    /// they are, `raw`).
    pub fn read(
        &self,
        ctx: &Context,
        node: &TensorNode,
        into: StdArc<AlignedBuffer>,
        raw: bool,
    ) -> Result<Answer<ReadValue>> {
        let d = self.index_of(ctx.device())?;
        self.request(d, |reply| DeviceOp::Read {
            ctx: ctx.clone(),
            node: node.clone(),
            into,
            raw,
            reply,
        })
    }

    /// Finalizes `ctx`.
    pub fn finalize(&self, ctx: &Context) -> Result<Answer<()>> {
        let d = self.index_of(ctx.device())?;
        self.request(d, |reply| DeviceOp::Finalize {
            stamp: 0,
            ctx: ctx.clone(),
            reply,
        })
    }

    /// A query to device `index`.
    pub fn query<T: Clone>(
        &self,
        index: usize,
        make: impl FnOnce(super::messages::Reply<T>) -> Query,
    ) -> Result<Answer<T>> {
        self.request(index, |r| DeviceOp::Query(make(r)))
    }

    /// Fences every device at one point: answered once each device decided everything
    /// posted before.
    pub fn fence_all(&self) -> Result<Vec<Answer<()>>> {
        self.interrupt(Barrier::observing(Barrier::QUERY));
        self.fence_all_now()
    }

    /// [`Dispatcher::fence_all`] without the automatic replay's interruption (posted under a
    /// node's lock, after the caller told it).
    fn fence_all_now(&self) -> Result<Vec<Answer<()>>> {
        let mut answers = Vec::new();
        let parts = (0..self.devices.len())
            .map(|d| {
                let (r, a) = reply::<()>();
                answers.push(a);
                Part::new(d, 0, 0, DeviceOp::Query(Query::Fence(r)))
            })
            .collect();
        self.post_now(parts)?;
        Ok(answers)
    }

    /// Moves `node` from `src` to `dst` (DESIGN.md §3, rule 3): `None` when both contexts
    /// share the buffer (nothing to do); otherwise the destination's operation, planned
    /// when the destination reaches it (or refused with the typed error of the first
    /// check that fails, as `protocol::device_to_device` orders them).
    pub fn device_to_device(
        &self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<PendingEvent>> {
        self.device_to_device_recorded(node, src, dst, mode, None, Via::Caller)
    }

    /// [`Dispatcher::device_to_device`], both halves recorded into a step being captured
    /// if `record` is given (asked for once the call is known to post).
    pub(super) fn device_to_device_recorded(
        &self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
        record: Option<Recording<'_>>,
        via: Via,
    ) -> Result<Option<PendingEvent>> {
        let di = self.index_of(dst.device())?;
        check_streaming_placement(
            &mode,
            src,
            dst,
            (self.can_stream)(src.device(), dst.device()),
        )?;
        let si = self.index_of(src.device())?;
        if let MergeBufferUse::No = mode {
            let shared = src.device() == dst.device()
                && matches!(
                    (src.array(node.id()), dst.array(node.id())),
                    (Some(a), Some(b)) if a.loc == b.loc
                );
            if shared {
                return Ok(None);
            }
        }
        if let MergeBufferUse::StreamingFor(routine) = &mode {
            check_streaming_consumer(routine, node, src)?;
        }
        let dst_stream = match &mode {
            MergeBufferUse::StreamingFor(r) => r.context().stream(),
            _ => dst.stream(),
        };
        let (pending, promise) = self.pending(dst.stream())?;
        let record = record.map(|r| r(2, copy_edge(src, dst, dst_stream), &[si, di]));
        let delivery = match mode {
            MergeBufferUse::No => Delivery::Copy {
                dst: dst.clone(),
                node: node.clone(),
                into_merge: false,
            },
            MergeBufferUse::Copy => Delivery::Copy {
                dst: dst.clone(),
                node: node.clone(),
                into_merge: true,
            },
            MergeBufferUse::StreamingFor(r) => Delivery::Streaming(r),
        };
        let mut parts = Parts::new();
        self.copy_parts(
            &mut parts,
            0,
            si,
            di,
            src,
            node,
            delivery,
            pending.clone(),
            promise,
        );
        let parts = parts
            .into_iter()
            .map(|p| p.recorded(record.as_ref()))
            .collect();
        self.post_via(via, parts)?;
        Ok(Some(pending))
    }

    /// The two halves of one copy, at step `step`.
    #[allow(clippy::too_many_arguments)]
    fn copy_parts(
        &self,
        parts: &mut Parts,
        step: usize,
        si: usize,
        di: usize,
        src: &Context,
        node: &TensorNode,
        delivery: Delivery,
        pending: PendingEvent,
        promise: SeqPromise,
    ) {
        let (verdict_reply, verdict) = pooled_reply(&self.verdicts);
        parts.push(Part::new(
            si,
            step,
            0,
            DeviceOp::CopySource {
                stamp: 0,
                ctx: src.clone(),
                node: node.clone(),
                reader: pending.event(),
                verdict: verdict_reply,
            },
        ));
        let link = SourceLink {
            inbox: self.devices[si].inbox.clone(),
            loc: src.array(node.id()).map(|e| e.loc),
            reader: pending.event(),
        };
        parts.push(Part::new(
            di,
            step,
            DEST_STAMPS,
            DeviceOp::CopyDest {
                stamp: 0,
                delivery,
                verdict,
                promise,
                source: link,
            },
        ));
    }

    /// Issues an all-reduce, checked whole first (nothing is posted if any part of it is
    /// malformed); returns the final event of every chunk in every context.
    pub fn all_reduce(&self, call: &AllReduceCall) -> Result<Vec<PendingEvent>> {
        self.all_reduce_recorded(call, None, Via::Caller)
    }

    /// [`Dispatcher::all_reduce`], every operation of every step recorded into a step
    /// being captured if `record` is given (asked once per operation, in step order, once
    /// the call is checked).
    pub(super) fn all_reduce_recorded(
        &self,
        call: &AllReduceCall,
        mut record: Option<Recording<'_>>,
        via: Via,
    ) -> Result<Vec<PendingEvent>> {
        check_all_reduce(call, &*self.can_stream)?;
        // Wraps the parts from `start` on (one operation) into `record`'s next record.
        let mut recorded = |parts: &mut Parts, start: usize, positions: u32, edge| {
            if let Some(r) = record.as_mut() {
                let devices: Vec<usize> = parts[start..].iter().map(|p| p.device).collect();
                let r = r(positions, edge, &devices);
                let op: Parts = parts.drain(start..).map(|p| p.recorded(Some(&r))).collect();
                parts.extend(op);
            }
        };
        let index: Vec<usize> = call
            .contexts
            .iter()
            .map(|c| self.index_of(c.device()))
            .collect::<Result<_>>()?;
        let chunks = call.nodes.len();
        let mut last: Vec<Option<PendingEvent>> = vec![None; call.contexts.len() * chunks];
        let mut parts = Parts::new();
        for (k, step) in call.steps.iter().enumerate() {
            match *step {
                AllReduceStep::Reduce { chunk, src, dst } => {
                    let streaming = match call.transfer {
                        Transfer::Copy => false,
                        Transfer::Streaming => true,
                        Transfer::Auto => (self.can_stream)(
                            call.contexts[src].device(),
                            call.contexts[dst].device(),
                        ),
                    };
                    let (s, d) = (&call.contexts[src], &call.contexts[dst]);
                    let merge = call.merge[dst][chunk].clone();
                    let start = parts.len();
                    if streaming {
                        let (pending, promise) = self.pending(d.stream())?;
                        let edge = copy_edge(s, d, merge.context().stream());
                        self.copy_parts(
                            &mut parts,
                            k,
                            index[src],
                            index[dst],
                            s,
                            &call.nodes[chunk],
                            Delivery::Streaming(merge),
                            pending.clone(),
                            promise,
                        );
                        recorded(&mut parts, start, 2, edge);
                        last[dst * chunks + chunk] = Some(pending);
                    } else {
                        let (copy, promise) = self.pending(d.stream())?;
                        self.copy_parts(
                            &mut parts,
                            k,
                            index[src],
                            index[dst],
                            s,
                            &call.nodes[chunk],
                            Delivery::Copy {
                                dst: d.clone(),
                                node: call.nodes[chunk].clone(),
                                into_merge: true,
                            },
                            copy,
                            promise,
                        );
                        recorded(&mut parts, start, 2, copy_edge(s, d, d.stream()));
                        let (pending, promise) = self.pending(d.stream())?;
                        let start = parts.len();
                        parts.push(Part::new(
                            index[dst],
                            k,
                            DEST_STAMPS + STEP_STAMPS / 4,
                            DeviceOp::Schedule {
                                stamp: 0,
                                routine: merge,
                                bindings: Bindings::none(),
                                promise,
                            },
                        ));
                        recorded(&mut parts, start, 1, None);
                        last[dst * chunks + chunk] = Some(pending);
                    }
                }
                AllReduceStep::Broadcast { chunk, src, dst } => {
                    let (s, d) = (&call.contexts[src], &call.contexts[dst]);
                    let (pending, promise) = self.pending(d.stream())?;
                    let start = parts.len();
                    self.copy_parts(
                        &mut parts,
                        k,
                        index[src],
                        index[dst],
                        s,
                        &call.nodes[chunk],
                        Delivery::Copy {
                            dst: d.clone(),
                            node: call.nodes[chunk].clone(),
                            into_merge: false,
                        },
                        pending.clone(),
                        promise,
                    );
                    recorded(&mut parts, start, 2, copy_edge(s, d, d.stream()));
                    last[dst * chunks + chunk] = Some(pending);
                }
                AllReduceStep::Scale { chunk, ctx } => {
                    let routine = call.scale[ctx][chunk].clone();
                    let (pending, promise) = self.pending(routine.context().stream())?;
                    let start = parts.len();
                    parts.push(Part::new(
                        index[ctx],
                        k,
                        0,
                        DeviceOp::Schedule {
                            stamp: 0,
                            routine,
                            bindings: Bindings::none(),
                            promise,
                        },
                    ));
                    recorded(&mut parts, start, 1, None);
                    last[ctx * chunks + chunk] = Some(pending);
                }
            }
        }
        self.post_via(via, parts)?;
        Ok(last.into_iter().flatten().collect())
    }

    /// Writes the host value of hosted `node` (`bytes`, its exact size): waits, holding
    /// the node's lock, until every device decided its earlier operations and every
    /// pending transfer of the host array completed, then writes it; every device buffer
    /// then lags and is uploaded before its next read.
    pub async fn host_write(&self, node: &TensorNode, bytes: &[u8]) -> Result<()> {
        // A host write can invalidate what the automatic replay learned (`super::auto`):
        // nothing is learned or replayed from here until the write is over (`Writing`).
        // Told before the node's lock is taken, and nothing posted under it passes the
        // automatic replay: its lock is never awaited under a node's lock (it takes node
        // locks itself, posting held calls that touch hosted nodes).
        let _writing = Writing::begin(self);
        let guard = NodeLock::lock(&self.nodes.get(node.id())).await;
        for fence in self.fence_all_now()? {
            // Relaxed: a statistic.
            self.fences
                .waited
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = answer(fence).await;
        }
        loop {
            let pending = {
                let mut host = self.host.lock();
                let pending = host.begin_write(node)?;
                if pending.iter().all(Event::is_done) {
                    host.set_order(reserve_issue_stamps(STEP_STAMPS));
                    host.commit_write(node, bytes)?;
                    break;
                }
                pending
            };
            for e in pending {
                // Order only: a failed transfer still must not overlap the write.
                let _ = e.wait_async().await;
            }
        }
        guard.with(|o| o.clear());
        Ok(())
    }

    /// Reads the host value of hosted `node`: the newest device value is transferred
    /// first (by program-order stamp), then the host array is read once every transfer
    /// into it completed. Holds the node's lock throughout.
    pub async fn host_read(&self, node: &TensorNode) -> Result<Vec<u8>> {
        // The automatic replay is told before the node's lock is taken (see `host_write`).
        self.interrupt(Barrier::observing(Barrier::HOST_READ));
        let guard = NodeLock::lock(&self.nodes.get(node.id())).await;
        for fence in self.fence_all_now()? {
            // Relaxed: a statistic.
            self.fences
                .waited
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = answer(fence).await;
        }
        let newer = self.host.lock().record(node)?.newer_on_device();
        if let Some(copy) = newer {
            let d = self.index_of(copy.loc.device)?;
            let (r, transfer) = reply();
            // Posted under the node's lock, after every device's fence: nothing else can
            // touch the node's host array between that point and this transfer.
            self.post_holding_now(
                smallvec::smallvec![Part::new(
                    d,
                    0,
                    0,
                    DeviceOp::TransferToHost {
                        stamp: 0,
                        stream: copy.stream,
                        node: node.clone(),
                        loc: copy.loc.loc,
                        reply: r,
                    },
                )],
                Some(&guard),
            )?;
            answer(transfer).await?;
        }
        let bytes = self.read_host_array(node).await;
        guard.with(|o| o.clear());
        bytes
    }

    /// Reads `node` in `ctx`: what a routine of `ctx` would read (the buffer after its
    /// last write, or the host array for a buffer lagging a host write), or with `raw`
    /// the buffer's bytes as they are.
    pub async fn read_value(&self, ctx: &Context, node: &TensorNode, raw: bool) -> Result<Vec<u8>> {
        let bytes = node.size_in_bytes()? as usize;
        let into = StdArc::new(AlignedBuffer::new(bytes, 64)?);
        // The automatic replay is told before a node's lock is taken (see `host_write`).
        self.interrupt(Barrier::observing(Barrier::READ));
        // A hosted node's value may be the host array's: hold the node's lock so that no
        // host write or transfer lands between the decision and the read.
        let guard = if node.mode().is_hosted() && !raw {
            Some(NodeLock::lock(&self.nodes.get(node.id())).await)
        } else {
            None
        };
        let d = self.index_of(ctx.device())?;
        let (r, read) = reply();
        self.post_holding_now(
            smallvec::smallvec![Part::new(
                d,
                0,
                0,
                DeviceOp::Read {
                    ctx: ctx.clone(),
                    node: node.clone(),
                    into: into.clone(),
                    raw,
                    reply: r,
                },
            )],
            guard.as_ref(),
        )?;
        let out = match answer(read).await? {
            ReadValue::Host => self.read_host_array(node).await,
            ReadValue::Device(event) => {
                event.wait_async().await?;
                // SAFETY: the copy into `into` completed (its event was awaited) and no
                // device operation holds another reference to it.
                let data = unsafe { into.bytes(0, bytes) }.map_err(crate::DeviceError::from)?;
                Ok(data.to_vec())
            }
        };
        drop(guard);
        out
    }

    /// The host array of hosted `node` as it is now, once every pending transfer into it
    /// completed (failed transfers report their cause).
    async fn read_host_array(&self, node: &TensorNode) -> Result<Vec<u8>> {
        loop {
            let pending = self.host.lock().pending_writes(node)?;
            if pending.iter().all(Event::is_done) {
                for e in &pending {
                    e.wait()?;
                }
                // Read under the lock: no new transfer into the array can be planned meanwhile.
                return self.host.lock().read_bytes(node);
            }
            for e in pending {
                let _ = e.wait_async().await;
            }
        }
    }
}

/// The checks of a `StreamingFor` consumer that need no device state (the rest are the
/// destination's): it reads a merge buffer, expects `node` there, and does not write the
/// source buffer it would read in place.
fn check_streaming_consumer(routine: &Routine, node: &TensorNode, src: &Context) -> Result<()> {
    let spec = routine.spec();
    let Some(expected) = &spec.merge else {
        return Err(Error::InvalidRoutine {
            routine: spec.name.clone(),
            reason: format!("it reads no merge buffer, so it cannot consume {node}"),
        });
    };
    let consumer = routine.context();
    if consumer.device() == src.device() {
        if let Some(source) = src.array(node.id()) {
            let writes_source = spec.params.iter().any(|p| {
                p.access.writes() && consumer.array(p.node.id()).map(|e| e.loc) == Some(source.loc)
            });
            if writes_source {
                return Err(Error::StreamingUnsupported {
                    src: src.device(),
                    dst: consumer.device(),
                    reason: format!(
                        "the source buffer of {node} is written by the consumer {}",
                        spec.name
                    ),
                });
            }
        }
    }
    if expected != node {
        return Err(Error::MergeBufferMismatch {
            stream: consumer.stream(),
            expected: expected.to_string(),
            found: node.to_string(),
        });
    }
    Ok(())
}

/// Checks an all-reduce before any step is posted, so a malformed one changes nothing:
/// the lists agree in length, every step's indices are in range, every context used holds
/// its chunk, every routine runs on its context's stream (the merge routines reading
/// their chunk from the merge buffer), and streaming is possible where required.
fn check_all_reduce(
    msg: &AllReduceCall,
    can_stream: &dyn Fn(DeviceId, DeviceId) -> bool,
) -> Result<()> {
    let (n, chunks) = (msg.contexts.len(), msg.nodes.len());
    let length = |what: String, expected: usize, found: usize| {
        if expected == found {
            Ok(())
        } else {
            Err(Error::LengthMismatch {
                what,
                expected,
                found,
            })
        }
    };
    let index = |what: String, index: usize, len: usize| {
        if index < len {
            Ok(index)
        } else {
            Err(Error::IndexOutOfRange { what, index, len })
        }
    };
    length(
        "all-reduce merge routines (a list per context)".into(),
        n,
        msg.merge.len(),
    )?;
    length(
        "all-reduce scale routines (a list per context)".into(),
        n,
        msg.scale.len(),
    )?;
    let on_stream = |r: &Routine, ctx: usize, what: &str| {
        let (stream, want) = (r.context().stream(), msg.contexts[ctx].stream());
        if stream == want {
            Ok(())
        } else {
            Err(Error::InvalidRoutine {
                routine: r.name().into(),
                reason: format!(
                    "{what} of context {ctx} runs on {stream}, the context is on {want}"
                ),
            })
        }
    };
    for (ctx, routines) in msg.merge.iter().enumerate() {
        length(
            format!("all-reduce merge routines of context {ctx} (one per chunk)"),
            chunks,
            routines.len(),
        )?;
        for (chunk, r) in routines.iter().enumerate() {
            on_stream(r, ctx, "merge routine")?;
            if r.spec().merge.as_ref() != Some(&msg.nodes[chunk]) {
                return Err(Error::InvalidRoutine {
                    routine: r.name().into(),
                    reason: format!(
                        "the merge routine of chunk {chunk} must read {} from the merge buffer",
                        msg.nodes[chunk]
                    ),
                });
            }
        }
    }
    for (ctx, routines) in msg.scale.iter().enumerate() {
        for r in routines {
            on_stream(r, ctx, "scale routine")?;
        }
    }
    let holds = |ctx: usize, chunk: usize| {
        let (c, node) = (&msg.contexts[ctx], &msg.nodes[chunk]);
        if c.contains(node) {
            Ok(())
        } else {
            Err(Error::NodeNotInContext {
                node: node.to_string(),
                context: c.id(),
            })
        }
    };
    for (k, step) in msg.steps.iter().enumerate() {
        match *step {
            AllReduceStep::Reduce { chunk, src, dst }
            | AllReduceStep::Broadcast { chunk, src, dst } => {
                let chunk = index(format!("chunk of step {k}"), chunk, chunks)?;
                let src = index(format!("source context of step {k}"), src, n)?;
                let dst = index(format!("destination context of step {k}"), dst, n)?;
                holds(src, chunk)?;
                holds(dst, chunk)?;
                let (s, d) = (msg.contexts[src].device(), msg.contexts[dst].device());
                if matches!(step, AllReduceStep::Reduce { .. })
                    && msg.transfer == Transfer::Streaming
                    && !can_stream(s, d)
                {
                    return Err(Error::StreamingUnsupported {
                        src: s,
                        dst: d,
                        reason: "the backend cannot read that memory in place".into(),
                    });
                }
            }
            AllReduceStep::Scale { chunk, ctx } => {
                let ctx = index(format!("context of step {k}"), ctx, n)?;
                let chunk = index(format!("chunk of step {k}"), chunk, chunks)?;
                index(
                    format!("scale routine of context {ctx} for step {k}"),
                    chunk,
                    msg.scale[ctx].len(),
                )?;
                holds(ctx, chunk)?;
            }
        }
    }
    Ok(())
}

/// Waits for an answer asynchronously.
pub fn answer<T: Clone>(cell: Answer<T>) -> AnswerFuture<T> {
    AnswerFuture { cell }
}

/// The future of [`answer`].
#[must_use = "futures do nothing unless polled"]
pub struct AnswerFuture<T> {
    cell: Arc<Oneshot<Result<T>>>,
}

impl<T: Clone> Future for AnswerFuture<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<T>> {
        match self.cell.poll_get(cx.waker()) {
            Some(v) => Poll::Ready(v),
            None => Poll::Pending,
        }
    }
}
