//! The operations a device's inbox carries: one per host call and device, each decided by
//! [`crate::dispatch::DeviceCore`] in inbox order.
//!
//! An operation that returns a value carries a [`Reply`]; one that returns only an event
//! carries a [`SeqPromise`]. Each carries the program-order `stamp` taken when it was posted.
//! See DESIGN.md §4, "Inboxes: one order shared by every device, and batches".

use std::fmt;
use std::sync::Arc as StdArc;

use crate::{
    error::{Error, Result},
    event::Event,
    ids::{BufferLoc, StreamId},
    kernels::{Bindings, RoutineSpec},
    memory::{AlignedBuffer, PoolStats},
    node::TensorNode,
    pending::{Oneshot, OneshotPool, PooledCell, SeqPromise},
    protocol::{Context, Routine, Source, TableSizes},
    sync::Arc,
};

pub use super::replay::{PartBox, ReplayPart};
pub use super::steps::Record;

/// What the caller of an operation waits on: the cell its [`Reply`] fills.
pub type Answer<T> = Arc<Oneshot<Result<T>>>;

/// Where an operation's value goes. Answers once; dropped unanswered (its device stopped,
/// or panicked while deciding it), it answers [`Error::ShutDown`], so no caller waits
/// forever.
pub struct Reply<T: Clone> {
    cell: Option<Answer<T>>,
}

/// A reply and the answer its caller waits on.
pub fn reply<T: Clone>() -> (Reply<T>, Answer<T>) {
    let cell = Oneshot::new();
    (
        Reply {
            cell: Some(cell.clone()),
        },
        cell,
    )
}

impl<T: Clone> Reply<T> {
    /// Answers.
    pub fn send(mut self, value: Result<T>) {
        if let Some(cell) = self.cell.take() {
            cell.set(value);
        }
    }
}

impl<T: Clone> Drop for Reply<T> {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            cell.set(Err(Error::ShutDown(
                "the device stopped before answering".into(),
            )));
        }
    }
}

impl<T: Clone> fmt::Debug for Reply<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Reply")
    }
}

/// An [`Answer`] whose cell comes from a pool ([`pooled_reply`]) and goes back to it from
/// its last holder, as a pending event's does: the one-shots of copies and replays allocate
/// nothing in steady state.
pub type PooledAnswer<T> = PooledCell<Result<T>>;

/// The cells of [`PooledAnswer`]s of one type.
pub type AnswerPool<T> = OneshotPool<Result<T>>;

/// A [`Reply`] and the [`PooledAnswer`] its caller waits on, the cell from `pool`.
pub fn pooled_reply<T: Clone>(pool: &Arc<AnswerPool<T>>) -> (Reply<T>, PooledAnswer<T>) {
    let cell = pool.take();
    (
        Reply {
            cell: Some(cell.clone()),
        },
        PooledCell::new(cell, Some(pool.clone())),
    )
}

/// What the source device of a copy tells its destination: the buffer to read and what
/// to wait for, or why the copy is refused. The source holds the [`Reply`] half; the cell
/// is the dispatcher's, reused.
pub type Verdict = PooledAnswer<Source>;

/// Where the value of a [`DeviceOp::Read`] comes from.
#[derive(Clone, Debug)]
pub enum ReadValue {
    /// The buffer is copied into the caller's host buffer by this event.
    Device(Event),
    /// The buffer lags its host array: read the host array (nothing was planned).
    Host,
}

/// The destination half of a device-to-device call.
#[derive(Debug)]
pub enum Delivery {
    /// Copy into the node's own buffer of the destination context (`No`), or into the
    /// destination stream's merge buffer (`Copy`).
    Copy {
        /// The destination context.
        dst: Context,
        /// The node copied (for the host-array order of a copy into a hosted node's own
        /// buffer, `hosted.rs`).
        node: TensorNode,
        /// Into the merge buffer.
        into_merge: bool,
    },
    /// Schedule this consumer reading the source in place (`StreamingFor`).
    Streaming(Routine),
}

/// Queries about a device's state, answered in inbox order.
#[derive(Debug)]
pub enum Query {
    /// The last event issued on every stream.
    LastEvents(Reply<Vec<Event>>),
    /// The last event issued on one stream (index).
    StreamLastEvent(usize, Reply<Option<Event>>),
    /// Whether everything issued so far completed.
    IsIdle(Reply<bool>),
    /// Memory statistics.
    MemoryStats(Reply<PoolStats>),
    /// Sizes of the protocol tables.
    TableSizes(Reply<TableSizes>),
    /// Tables, pools and streams as JSON.
    DebugInfo(Reply<serde_json::Value>),
    /// Prune the tables now.
    Sweep(Reply<()>),
    /// Nothing: replies once every earlier operation is decided.
    Fence(Reply<()>),
}

/// One operation for a device; see the module documentation.
pub enum DeviceOp {
    /// A root context on stream `stream`.
    NewContext {
        /// Stream index.
        stream: usize,
        /// The context.
        reply: Reply<Context>,
    },
    /// Link a routine into `ctx`.
    Link {
        /// The context.
        ctx: Context,
        /// The routine (boxed: a link is rare, and inline its 184 bytes made every
        /// operation's message that size, moved several times between post and decision).
        spec: Box<RoutineSpec>,
        /// The linked routine.
        reply: Reply<Routine>,
    },
    /// Schedule a linked routine.
    Schedule {
        /// Program-order stamp.
        stamp: u64,
        /// The routine.
        routine: Routine,
        /// Values of its declared indices, checked and snapshotted when it was posted.
        bindings: Bindings,
        /// Its event.
        promise: SeqPromise,
    },
    /// Upload (`up`) or download the host array of a hosted node in `ctx`.
    Transfer {
        /// Program-order stamp.
        stamp: u64,
        /// The context.
        ctx: Context,
        /// The hosted node.
        node: TensorNode,
        /// `from_host` (true) or `to_host`.
        up: bool,
        /// Its event.
        promise: SeqPromise,
    },
    /// Add a buffer of hosted `node` to a child of `ctx` and upload the host array into it.
    InitFromHost {
        /// Program-order stamp.
        stamp: u64,
        /// The context.
        ctx: Context,
        /// The hosted node.
        node: TensorNode,
        /// The child context.
        reply: Reply<Context>,
    },
    /// Read `node` in `ctx` into a host buffer of its size: the value a routine would read
    /// (the host array for a lagging buffer), or the buffer as it is (`raw`).
    Read {
        /// The context.
        ctx: Context,
        /// The node.
        node: TensorNode,
        /// Destination.
        into: StdArc<AlignedBuffer>,
        /// Read the bytes as they are (a lagging buffer's stale value too).
        raw: bool,
        /// Where the value comes from.
        reply: Reply<ReadValue>,
    },
    /// Transfer the buffer at `loc` (written last on `stream`) into `node`'s host array.
    TransferToHost {
        /// Program-order stamp.
        stamp: u64,
        /// The stream that wrote the buffer last.
        stream: StreamId,
        /// The hosted node.
        node: TensorNode,
        /// The buffer.
        loc: BufferLoc,
        /// The transfer's event.
        reply: Reply<Event>,
    },
    /// The source half of a device-to-device call: describe `node`'s buffer in `ctx`
    /// (uploading it first if it lags its host array), record `reader` as a reader of it,
    /// and tell the destination ([`Verdict`]).
    CopySource {
        /// Program-order stamp.
        stamp: u64,
        /// The source context.
        ctx: Context,
        /// The node.
        node: TensorNode,
        /// The destination's operation (deferred: planned by the destination).
        reader: Event,
        /// Answered once decided.
        verdict: Reply<Source>,
    },
    /// The destination half: wait for the source's [`Verdict`], then plan the delivery.
    CopyDest {
        /// Program-order stamp.
        stamp: u64,
        /// What to plan.
        delivery: Delivery,
        /// The source's answer.
        verdict: Verdict,
        /// The delivery's event.
        promise: SeqPromise,
        /// The source half's device, told to forget its read record if this half refuses.
        source: SourceLink,
    },
    /// Record `event` as a reader of the buffer at `loc` (only the `late_source_read`
    /// mutant: the old shape, where the read was recorded after the copy was planned).
    RecordRead {
        /// The buffer.
        loc: BufferLoc,
        /// The reader.
        event: Event,
    },
    /// Forget `event` as a reader of the buffer at `loc`: its operation was refused.
    ForgetRead {
        /// The buffer.
        loc: BufferLoc,
        /// The deferred reader the source recorded.
        event: Event,
    },
    /// Finalize `ctx`.
    Finalize {
        /// Program-order stamp.
        stamp: u64,
        /// The context.
        ctx: Context,
        /// Done.
        reply: Reply<()>,
    },
    /// A query.
    Query(Query),
    /// `op` (a schedule or a copy half), decided as usual and recorded into a step being
    /// captured (`System::capture`, `super::capture`).
    Recorded {
        /// Where and as what it is recorded.
        record: Record,
        /// The operation.
        op: Box<DeviceOp>,
    },
    /// This device's part of a replay of a captured step: issued whole, in one decision
    /// (`super::replay`).
    Replay {
        /// Program-order stamp of the step's position 0.
        stamp: u64,
        /// The part.
        part: PartBox,
    },
    /// `op`, decided only once every gate is answered: fences of other devices that must
    /// have decided their earlier operations first (host-array order, `hosted.rs`).
    Gated {
        /// Fence answers to wait for.
        gates: Vec<Answer<()>>,
        /// The operation.
        op: Box<DeviceOp>,
    },
}

/// The source half of a copy as its destination half knows it: the source device's inbox
/// and the read it records (the destination's deferred event).
#[derive(Clone)]
pub struct SourceLink {
    pub(crate) inbox: Arc<crate::dispatch::Inbox<DeviceOp>>,
    /// The source buffer, if the source context holds the node (else nothing is recorded).
    pub(crate) loc: Option<BufferLoc>,
    pub(crate) reader: Event,
}

impl SourceLink {
    /// Tells the source to forget the read (the destination refused): posted behind
    /// whatever the source has queued, before the caller can learn of the refusal.
    pub(crate) fn forget(&self) {
        if let Some(loc) = self.loc {
            self.inbox.post_internal(DeviceOp::ForgetRead {
                loc,
                event: self.reader.clone(),
            });
        }
    }
}

impl fmt::Debug for SourceLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceLink")
            .field("device", &self.inbox.device())
            .field("loc", &self.loc)
            .finish()
    }
}

impl DeviceOp {
    /// A short name, for traces and panics.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceOp::NewContext { .. } => "NewContext",
            DeviceOp::Link { .. } => "Link",
            DeviceOp::Schedule { .. } => "Schedule",
            DeviceOp::Transfer { up: true, .. } => "FromHost",
            DeviceOp::Transfer { up: false, .. } => "ToHost",
            DeviceOp::InitFromHost { .. } => "InitFromHost",
            DeviceOp::Read { .. } => "Read",
            DeviceOp::TransferToHost { .. } => "TransferToHost",
            DeviceOp::CopySource { .. } => "CopySource",
            DeviceOp::CopyDest { .. } => "CopyDest",
            DeviceOp::RecordRead { .. } => "RecordRead",
            DeviceOp::ForgetRead { .. } => "ForgetRead",
            DeviceOp::Finalize { .. } => "Finalize",
            DeviceOp::Query(_) => "Query",
            DeviceOp::Recorded { op, .. } => op.name(),
            DeviceOp::Replay { .. } => "Replay",
            DeviceOp::Gated { op, .. } => op.name(),
        }
    }

    /// The program-order stamp field of operations that make plans.
    pub(crate) fn stamp_mut(&mut self) -> Option<&mut u64> {
        match self {
            DeviceOp::Schedule { stamp, .. }
            | DeviceOp::Transfer { stamp, .. }
            | DeviceOp::InitFromHost { stamp, .. }
            | DeviceOp::TransferToHost { stamp, .. }
            | DeviceOp::CopySource { stamp, .. }
            | DeviceOp::CopyDest { stamp, .. }
            | DeviceOp::Finalize { stamp, .. }
            | DeviceOp::Replay { stamp, .. } => Some(stamp),
            DeviceOp::Gated { op, .. } | DeviceOp::Recorded { op, .. } => op.stamp_mut(),
            DeviceOp::NewContext { .. }
            | DeviceOp::Link { .. }
            | DeviceOp::Read { .. }
            | DeviceOp::RecordRead { .. }
            | DeviceOp::ForgetRead { .. }
            | DeviceOp::Query(_) => None,
        }
    }

    /// Answers the operation with `error` without deciding anything (a poisoned or
    /// stopped device): replies get the error, promises are refused at the stream's last
    /// issued sequence number `issued(stream index)`.
    pub(crate) fn refuse(self, error: &Error, issued: impl Fn(usize) -> u64) {
        use crate::pending::Planned;
        let refused = |promise: SeqPromise, stream: StreamId| {
            promise.resolve(Planned::Refused(
                issued(stream.index as usize),
                error.clone(),
            ))
        };
        match self {
            DeviceOp::NewContext { reply, .. } => reply.send(Err(error.clone())),
            DeviceOp::Link { reply, .. } => reply.send(Err(error.clone())),
            DeviceOp::Schedule {
                routine, promise, ..
            } => refused(promise, routine.context().stream()),
            DeviceOp::Transfer { ctx, promise, .. } => refused(promise, ctx.stream()),
            DeviceOp::InitFromHost { reply, .. } => reply.send(Err(error.clone())),
            DeviceOp::Read { reply, .. } => reply.send(Err(error.clone())),
            DeviceOp::TransferToHost { reply, .. } => reply.send(Err(error.clone())),
            DeviceOp::CopySource { verdict, .. } => verdict.send(Err(error.clone())),
            DeviceOp::CopyDest {
                delivery,
                promise,
                source,
                ..
            } => {
                source.forget();
                let stream = match &delivery {
                    Delivery::Copy { dst, .. } => dst.stream(),
                    Delivery::Streaming(r) => r.context().stream(),
                };
                refused(promise, stream)
            }
            DeviceOp::RecordRead { .. } | DeviceOp::ForgetRead { .. } => {}
            DeviceOp::Finalize { reply, .. } => reply.send(Err(error.clone())),
            DeviceOp::Query(q) => match q {
                Query::LastEvents(r) => r.send(Err(error.clone())),
                Query::StreamLastEvent(_, r) => r.send(Err(error.clone())),
                Query::IsIdle(r) => r.send(Err(error.clone())),
                Query::MemoryStats(r) => r.send(Err(error.clone())),
                Query::TableSizes(r) => r.send(Err(error.clone())),
                Query::DebugInfo(r) => r.send(Err(error.clone())),
                Query::Sweep(r) | Query::Fence(r) => r.send(Err(error.clone())),
            },
            DeviceOp::Replay { part, .. } => {
                if let Some(p) = part.take() {
                    p.refuse(error, issued)
                }
            }
            DeviceOp::Gated { op, .. } | DeviceOp::Recorded { op, .. } => op.refuse(error, issued),
        }
    }
}

impl fmt::Debug for DeviceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The parts of one post, inline up to four (a post allocates no list for them).
pub(super) type Parts = smallvec::SmallVec<[Part; 4]>;

/// One operation of a call, before posting.
pub(super) struct Part {
    /// The device (index) it goes to.
    pub(super) device: usize,
    /// The call's step this part belongs to (stamps and placement of fences).
    pub(super) step: usize,
    /// Stamp offset within the step.
    pub(super) offset: u64,
    /// Steps of stamps the part spans (a replay's positions).
    pub(super) span: u64,
    /// A fence (placed before the step's other parts on its device).
    pub(super) fence: bool,
    /// The fences of other devices it is gated on (host-array order, `hosted.rs`).
    pub(super) gates: Vec<Answer<()>>,
    /// The operation.
    pub(super) op: DeviceOp,
}

impl Part {
    pub(super) fn new(device: usize, step: usize, offset: u64, op: DeviceOp) -> Part {
        Part {
            device,
            step,
            offset,
            span: 1,
            fence: false,
            gates: Vec::new(),
            op,
        }
    }

    /// The part takes `steps` steps of stamps from its own (at least one).
    pub(super) fn with_span(self, steps: u64) -> Part {
        Part {
            span: steps.max(1),
            ..self
        }
    }

    /// The part, recorded into a step being captured (if `record`).
    pub(super) fn recorded(self, record: Option<&Record>) -> Part {
        match record {
            None => self,
            Some(r) => Part {
                op: DeviceOp::Recorded {
                    record: r.clone(),
                    op: Box::new(self.op),
                },
                ..self
            },
        }
    }
}
