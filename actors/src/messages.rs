//! The message-based scheduling API.
//!
//! A host that already runs actix sends these messages to the actors directly (the
//! addresses come from [`crate::System::device_actor`] and [`crate::System::coordinator`]);
//! [`crate::System`] wraps the same messages in blocking and async methods. Messages to one
//! device actor are processed in the order they arrive, which is the program order of the
//! sending thread.
//!
//! # Which messages are public, and why the others are not
//!
//! A public message is one a host may send with any payload, in any order, without making
//! an actor run work the protocol did not decide: every one is validated by the actor that
//! receives it, and a bad one is answered with a typed error carrying the offending value
//! (a stream index with the stream count, a context unknown to the device, lists of an
//! all-reduce whose lengths disagree, ...), with nothing changed. None can crash an actor.
//!
//! - device actor: [`NewContext`], [`Link`], [`Schedule`], [`FromHost`], [`ToHost`],
//!   [`InitFromHost`], [`Finalize`], [`Fence`], [`LastEvents`], [`StreamLastEvent`],
//!   [`Sweep`], [`IsIdle`], [`GetMemoryStats`], [`GetTableSizes`], [`DebugInfo`];
//! - coordinator: [`DeviceToDevice`], [`AllReduce`], [`CreateNode`], [`RefineNode`].
//!
//! Messages that update the shared host table carry a program-order stamp, which only
//! [`crate::System::next_order`] hands out: they are built with `new(&system, ...)`, right
//! before they are sent, so a host cannot forge the order the host table relies on. Host
//! arrays themselves (host reads and writes, reads into host memory) have no message: use
//! the [`crate::System`] methods, which wait for the device operations they depend on. A
//! host sending raw messages to *several* devices that touch one hosted node orders them
//! itself: await a [`Fence`] from the device that got the previous such message first (what
//! `System` does for its own calls).
//!
//! Crate-private, because their payload is a step of the protocol that the actors
//! compose, and a forged one would run work the protocol did not decide: `Submit` (plans
//! for a stream queue), `GetSource` / `CopyIn` / `ScheduleStreaming` / `RecordRead` (the
//! steps of a device-to-device operation: a forged source could copy from any buffer with
//! any size, a forged reader record could make a buffer wait for an event that never
//! completes), `TransferToHost` (copies a buffer chosen by the caller into a host array),
//! `ReadNode` / `ReadInto` (copy into a caller-owned buffer that the caller could share
//! with another copy), `Completed` / `Subscribe` (stream-to-device completion notices) and
//! `StopStreams` (stops the stream actors, after which submitted work would never run;
//! [`crate::System::shutdown`] sends it).

use std::{sync::Arc, time::Instant};

use actix::{Message, Recipient};
use tributary::{
    kernels::{Bindings, RoutineSpec},
    memory::{AlignedBuffer, PoolStats},
    protocol::{Context, Plan, Routine, Source, TableSizes},
    BufferLoc, Event, MergeBufferUse, Result, StreamId, TensorNode,
};

use crate::{
    system::System,
    ticket::{Ticket, TicketSender},
};

/// A new root context on stream `stream` of the device.
#[derive(Message, Debug)]
#[rtype(result = "Result<Context>")]
pub struct NewContext {
    /// Stream index on the device.
    pub stream: usize,
}

/// Link a routine into a context; replies with the routine (its context is the child).
#[derive(Message, Debug)]
#[rtype(result = "Result<Routine>")]
pub struct Link {
    /// Context to link into.
    pub ctx: Context,
    /// The routine.
    pub spec: RoutineSpec,
}

/// Schedule a linked routine. No reply: the ticket receives the event or the error.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Schedule {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// The routine.
    pub routine: Routine,
    /// Where the outcome goes.
    pub ticket: TicketSender,
    /// Values of the routine's declared indices (`Bindings::none()` for a routine without
    /// indices); the device actor checks them against the routine and refuses the
    /// schedule through the ticket (`MissingBinding`, `UnknownBinding`,
    /// `BindingOutOfRange`).
    pub bindings: Bindings,
}

/// Copy the host array of a hosted node into its buffer in `ctx` (ticket gets the event).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct FromHost {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// The context.
    pub ctx: Context,
    /// The hosted node.
    pub node: TensorNode,
    /// Where the outcome goes.
    pub ticket: TicketSender,
}

/// Copy the buffer of a hosted node in `ctx` into its host array (ticket gets the event).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ToHost {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// The context.
    pub ctx: Context,
    /// The hosted node.
    pub node: TensorNode,
    /// Where the outcome goes.
    pub ticket: TicketSender,
}

/// Add a buffer of `node` to a child of `ctx` and upload its host array into it (the
/// host array was written by the caller first). Replies with the child context.
#[derive(Message, Debug)]
#[rtype(result = "Result<Context>")]
pub struct InitFromHost {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// The context.
    pub ctx: Context,
    /// The hosted node.
    pub node: TensorNode,
}

/// Read the value of `node` in `ctx` into a caller-owned host buffer: the buffer, unless
/// it lags its host array ([`ReadValue::Host`]: the value is the host array's, which a
/// routine would upload first; nothing is planned).
#[derive(Message, Debug)]
#[rtype(result = "Result<ReadValue>")]
pub(crate) struct ReadNode {
    /// The context.
    pub ctx: Context,
    /// The node.
    pub node: TensorNode,
    /// Destination (the node's size), for a read of the buffer.
    pub into: Arc<AlignedBuffer>,
}

/// Where the value of a [`ReadNode`] comes from.
#[derive(Debug)]
pub(crate) enum ReadValue {
    /// The buffer is copied into the caller's host buffer by this event.
    Device(Event),
    /// The buffer lags its host array: read the host array.
    Host,
}

/// Copy the bytes of `node`'s buffer in `ctx`, as they are (stale or not), into a
/// caller-owned host buffer (`read_device_raw`).
#[derive(Message, Debug)]
#[rtype(result = "Result<Event>")]
pub(crate) struct ReadInto {
    /// The context.
    pub ctx: Context,
    /// The node.
    pub node: TensorNode,
    /// Destination (the node's size).
    pub into: Arc<AlignedBuffer>,
}

/// Transfer the buffer at `loc` (written last on `stream`) into `node`'s host array.
#[derive(Message, Debug)]
#[rtype(result = "Result<Event>")]
pub(crate) struct TransferToHost {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// The stream that wrote the buffer last.
    pub stream: StreamId,
    /// The hosted node.
    pub node: TensorNode,
    /// The buffer.
    pub loc: BufferLoc,
}

/// Describe `node`'s buffer in `ctx` as the source of a device-to-device operation. If the
/// buffer lags its host array, the device first uploads it (an operation of this device,
/// on `ctx`'s stream, like `FromHost`): a copy never reads a stale value.
#[derive(Message, Debug)]
#[rtype(result = "Result<Source>")]
pub(crate) struct GetSource {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub order: u64,
    /// The source context.
    pub ctx: Context,
    /// The node.
    pub node: TensorNode,
}

/// Copy a source into `dst` (own buffer, or the stream's merge buffer).
#[derive(Message, Debug)]
#[rtype(result = "Result<Option<Event>>")]
pub(crate) struct CopyIn {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// Destination context.
    pub dst: Context,
    /// The source.
    pub source: Source,
    /// `true` for the merge buffer (`Copy`), `false` for the node's buffer (`No`).
    pub into_merge: bool,
}

/// Schedule `routine` reading `source` in place as its merge input (`StreamingFor`).
#[derive(Message, Debug)]
#[rtype(result = "Result<Event>")]
pub(crate) struct ScheduleStreaming {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// The consumer routine.
    pub routine: Routine,
    /// The source it reads.
    pub source: Source,
}

/// Record that `event` reads the buffer at `loc` of this device.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub(crate) struct RecordRead {
    /// The buffer.
    pub loc: BufferLoc,
    /// The reading operation's event.
    pub event: Event,
}

/// Finalize a context (buffers freed after their pending uses).
#[derive(Message, Debug)]
#[rtype(result = "Result<()>")]
pub struct Finalize {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// The context.
    pub ctx: Context,
}

/// Replies once every message sent to the device before it has been processed.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Fence;

/// The last event issued on every stream of the device (what a sync waits for).
#[derive(Message, Debug)]
#[rtype(result = "Vec<Event>")]
pub struct LastEvents;

/// Drop completed events from the tables and return memory to the pools.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Sweep;

/// Whether every operation issued on the device has completed.
#[derive(Message, Debug)]
#[rtype(result = "bool")]
pub struct IsIdle;

/// Memory statistics of the device's pools.
#[derive(Message, Debug)]
#[rtype(result = "PoolStats")]
pub struct GetMemoryStats;

/// Debug information about the device as JSON (tables, pools, streams).
#[derive(Message, Debug)]
#[rtype(result = "serde_json::Value")]
pub struct DebugInfo;

/// Sizes of the device's protocol tables.
#[derive(Message, Debug)]
#[rtype(result = "TableSizes")]
pub struct GetTableSizes;

/// A stream completed everything up to `seq` (published by stream actors).
#[derive(Message, Debug, Clone, Copy, PartialEq, Eq)]
#[rtype(result = "()")]
pub(crate) struct Completed {
    /// The stream.
    pub stream: StreamId,
    /// Everything up to this sequence number completed (successfully or not).
    pub seq: u64,
}

/// Plans for one stream, in order (device actor to stream actor).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub(crate) struct Submit(pub(crate) Vec<Plan>);

/// Subscribe to a stream's (or every stream of a device's) completion events.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub(crate) struct Subscribe(pub Recipient<Completed>);

/// Stop the streams: let queued work finish until `deadline`, then abandon what is left.
/// Replies with the abandoned operations as (stream, sequence numbers not completed).
#[derive(Message, Debug)]
#[rtype(result = "Vec<Abandoned>")]
pub(crate) struct StopStreams {
    /// When to give up waiting for queued work.
    pub deadline: Instant,
}

/// Operations a stream had to abandon at shutdown.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Abandoned {
    /// The stream.
    pub stream: StreamId,
    /// First abandoned sequence number.
    pub from_seq: u64,
    /// Last abandoned sequence number.
    pub to_seq: u64,
}

/// Move a node between contexts (any devices), routed by the coordinator.
#[derive(Message, Debug)]
#[rtype(result = "Result<Option<Event>>")]
pub struct DeviceToDevice {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// The node.
    pub node: TensorNode,
    /// Source context.
    pub src: Context,
    /// Destination context.
    pub dst: Context,
    /// How the destination receives it.
    pub mode: MergeBufferUse,
}

/// Carry out an all-reduce plan (see `tributary::collective`), routed by the coordinator.
/// Replies with the final event of every (context, chunk) once every step was issued.
#[derive(Message, Debug)]
#[rtype(result = "Result<Vec<Event>>")]
pub struct AllReduce {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub(crate) order: u64,
    /// The steps, in issue order.
    pub steps: Vec<tributary::collective::Step>,
    /// The chunks (one node each).
    pub nodes: Vec<TensorNode>,
    /// The contexts, by index.
    pub contexts: Vec<Context>,
    /// `merge[ctx][chunk]`: `add_merge(node)` linked in that context.
    pub merge: Vec<Vec<Routine>>,
    /// `scale[ctx][chunk]`: `scale_in_place(node, 1/n)`, for a mean.
    pub scale: Vec<Vec<Routine>>,
    /// How reduce steps move data.
    pub transfer: tributary::collective::Transfer,
}

/// Create a tensor node (handled by the coordinator; nodes are plain values, so a host may
/// also create them directly with `TensorNode::new`).
#[derive(Message, Debug)]
#[rtype(result = "Result<TensorNode>")]
pub struct CreateNode {
    /// Label.
    pub label: String,
    /// Element type.
    pub dtype: tributary::DType,
    /// Shape.
    pub shape: tributary::Shape,
    /// Initial refinement of the memory mode.
    pub mode: tributary::MemoryMode,
}

/// Refine a node's memory mode (refinement only; a contradiction is an error).
#[derive(Message, Debug)]
#[rtype(result = "Result<tributary::MemoryMode>")]
pub struct RefineNode {
    /// The node.
    pub node: TensorNode,
    /// The refinement.
    pub mode: tributary::MemoryMode,
}

/// The last event issued on one stream of the device (what `await` of a stream waits for).
#[derive(Message, Debug)]
#[rtype(result = "Result<Option<Event>>")]
pub struct StreamLastEvent {
    /// Stream index.
    pub stream: usize,
}

// ----- Constructors of the stamped messages ---------------------------------------------
//
// The program-order stamp is taken from the system when the message is built: build each
// message right before sending it.

impl Schedule {
    /// Schedules `routine`; the ticket receives its event or the typed error refusing it.
    pub fn new(sys: &System, routine: Routine) -> (Schedule, Ticket) {
        let (ticket, sender) = Ticket::new();
        let msg = Schedule {
            order: sys.next_order(),
            routine,
            ticket: sender,
            bindings: Bindings::none(),
        };
        (msg, ticket)
    }
}

impl FromHost {
    /// Uploads the host array of hosted `node` into its buffer in `ctx`.
    pub fn new(sys: &System, ctx: Context, node: TensorNode) -> (FromHost, Ticket) {
        let (ticket, sender) = Ticket::new();
        let msg = FromHost {
            order: sys.next_order(),
            ctx,
            node,
            ticket: sender,
        };
        (msg, ticket)
    }
}

impl ToHost {
    /// Downloads the buffer of hosted `node` in `ctx` into its host array.
    pub fn new(sys: &System, ctx: Context, node: TensorNode) -> (ToHost, Ticket) {
        let (ticket, sender) = Ticket::new();
        let msg = ToHost {
            order: sys.next_order(),
            ctx,
            node,
            ticket: sender,
        };
        (msg, ticket)
    }
}

impl InitFromHost {
    /// Adds a buffer of hosted `node` to a child of `ctx`, initialised from its host array
    /// (write that first with [`System::host_write`]).
    pub fn new(sys: &System, ctx: Context, node: TensorNode) -> InitFromHost {
        InitFromHost {
            order: sys.next_order(),
            ctx,
            node,
        }
    }
}

impl Finalize {
    /// Finalizes `ctx`.
    pub fn new(sys: &System, ctx: Context) -> Finalize {
        Finalize {
            order: sys.next_order(),
            ctx,
        }
    }
}

impl DeviceToDevice {
    /// Moves `node` from `src` to `dst` (any devices) in `mode`.
    pub fn new(
        sys: &System,
        node: TensorNode,
        src: Context,
        dst: Context,
        mode: MergeBufferUse,
    ) -> DeviceToDevice {
        DeviceToDevice {
            order: sys.next_order(),
            node,
            src,
            dst,
            mode,
        }
    }
}

impl AllReduce {
    /// Carries out `steps` over `contexts` (see the fields for what each list holds).
    pub fn new(
        sys: &System,
        steps: Vec<tributary::collective::Step>,
        nodes: Vec<TensorNode>,
        contexts: Vec<Context>,
        merge: Vec<Vec<Routine>>,
        scale: Vec<Vec<Routine>>,
        transfer: tributary::collective::Transfer,
    ) -> AllReduce {
        AllReduce {
            order: sys.next_order(),
            steps,
            nodes,
            contexts,
            merge,
            scale,
            transfer,
        }
    }
}
