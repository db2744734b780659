//! The message-based scheduling API.
//!
//! Every operation of the system is a public message type. A host that already runs
//! actix sends them to the actors directly ([`crate::DeviceActor`], [`crate::Coordinator`]);
//! [`crate::System`] wraps them in blocking and async methods. Messages to one device actor
//! are processed in the order they arrive, which is the program order of the sending thread.

use std::{sync::Arc, time::Instant};

use actix::{Message, Recipient};
use tributary::{
    kernels::RoutineSpec,
    memory::{AlignedBuffer, PoolStats},
    protocol::{Context, Plan, Routine, Source, TableSizes},
    BufferLoc, Event, MergeBufferUse, Result, StreamId, TensorNode,
};

use crate::ticket::TicketSender;

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
    pub order: u64,
    /// The routine.
    pub routine: Routine,
    /// Where the outcome goes.
    pub ticket: TicketSender,
}

/// Copy the host array of a hosted node into its buffer in `ctx` (ticket gets the event).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct FromHost {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub order: u64,
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
    pub order: u64,
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
    pub order: u64,
    /// The context.
    pub ctx: Context,
    /// The hosted node.
    pub node: TensorNode,
}

/// Copy the buffer of `node` in `ctx` into a caller-owned host buffer.
#[derive(Message, Debug)]
#[rtype(result = "Result<Event>")]
pub struct ReadInto {
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
pub struct TransferToHost {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub order: u64,
    /// The stream that wrote the buffer last.
    pub stream: StreamId,
    /// The hosted node.
    pub node: TensorNode,
    /// The buffer.
    pub loc: BufferLoc,
}

/// Describe `node`'s buffer in `ctx` as the source of a device-to-device operation.
#[derive(Message, Debug)]
#[rtype(result = "Result<Source>")]
pub struct GetSource {
    /// The source context.
    pub ctx: Context,
    /// The node.
    pub node: TensorNode,
}

/// Copy a source into `dst` (own buffer, or the stream's merge buffer).
#[derive(Message, Debug)]
#[rtype(result = "Result<Option<Event>>")]
pub struct CopyIn {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub order: u64,
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
pub struct ScheduleStreaming {
    /// Program-order stamp of the host call (see `System::next_order`): device actors
    /// process messages independently, and the host table keeps the newest update.
    pub order: u64,
    /// The consumer routine.
    pub routine: Routine,
    /// The source it reads.
    pub source: Source,
}

/// Record that `event` reads the buffer at `loc` of this device.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct RecordRead {
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
    pub order: u64,
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
pub struct Completed {
    /// The stream.
    pub stream: StreamId,
    /// Everything up to this sequence number completed (successfully or not).
    pub seq: u64,
}

/// Plans for one stream, in order (device actor to stream actor).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Submit(pub Vec<Plan>);

/// Subscribe to a stream's (or every stream of a device's) completion events.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Subscribe(pub Recipient<Completed>);

/// Stop the streams: let queued work finish until `deadline`, then abandon what is left.
/// Replies with the abandoned operations as (stream, sequence numbers not completed).
#[derive(Message, Debug)]
#[rtype(result = "Vec<Abandoned>")]
pub struct StopStreams {
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
    pub order: u64,
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
    pub order: u64,
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
