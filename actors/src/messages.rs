//! The message-based scheduling API, for hosts that already run actix.
//!
//! Such a host sends these messages to the actors at the addresses from
//! [`crate::System::device_actor`] and [`crate::System::coordinator`]. [`crate::System`] does
//! the same work by posting into the inboxes itself. Messages from one thread keep their
//! order. A host that mixes messages and `System` calls on one device must await each message
//! before its next `System` call.
//!
//! # Which messages are public, and why the others are not
//!
//! A public message may carry any payload and arrive in any order. The receiving actor
//! validates it and refuses a bad one with a typed error, changing nothing.
//!
//! - device actor: [`NewContext`], [`Link`], [`Schedule`], [`FromHost`], [`ToHost`],
//!   [`InitFromHost`], [`Finalize`], [`Fence`], [`LastEvents`], [`StreamLastEvent`],
//!   [`Sweep`], [`IsIdle`], [`GetMemoryStats`], [`GetTableSizes`], [`DebugInfo`];
//! - coordinator: [`DeviceToDevice`], [`AllReduce`], [`CreateNode`], [`RefineNode`].
//!
//! [`Schedule`], [`FromHost`] and [`ToHost`] produce an event: their `new` takes the system
//! and returns the [`crate::Ticket`] the device will decide. Host reads and writes have no
//! message; the [`crate::System`] methods order them with every device's work. The other
//! messages are crate-private, because a forged one could run work the protocol did not
//! decide or stop a device. See DESIGN.md §4, "Public and private messages".

use std::time::Instant;

use actix::{Message, Recipient};
use tributary::{
    kernels::{Bindings, RoutineSpec},
    memory::PoolStats,
    pending::SeqPromise,
    protocol::{Context, Routine, TableSizes},
    Event, MergeBufferUse, Result, StreamId, TensorNode,
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

/// Schedule a linked routine. No reply: the ticket from [`Schedule::new`] gets the event
/// or the error.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Schedule {
    /// The routine.
    pub routine: Routine,
    /// Values of the routine's declared indices (`Bindings::none()` for a routine that
    /// declares none); checked by the device, a bad one refuses the ticket.
    pub bindings: Bindings,
    /// Decides the ticket (`None`: the ticket was refused when the message was built).
    pub(crate) promise: Option<SeqPromise>,
}

/// Copy the host array of a hosted node into its buffer in `ctx` (the ticket gets the
/// event).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct FromHost {
    /// The context.
    pub ctx: Context,
    /// The hosted node.
    pub node: TensorNode,
    pub(crate) promise: Option<SeqPromise>,
}

/// Copy the buffer of a hosted node in `ctx` into its host array (the ticket gets the
/// event).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ToHost {
    /// The context.
    pub ctx: Context,
    /// The hosted node.
    pub node: TensorNode,
    pub(crate) promise: Option<SeqPromise>,
}

/// Add a buffer of `node` to a child of `ctx` and upload its host array into it (the
/// host array was written by the caller first). Replies with the child context.
#[derive(Message, Debug)]
#[rtype(result = "Result<Context>")]
pub struct InitFromHost {
    /// The context.
    pub ctx: Context,
    /// The hosted node.
    pub node: TensorNode,
}

/// Finalize a context: its buffers are freed after their pending uses.
#[derive(Message, Debug)]
#[rtype(result = "Result<()>")]
pub struct Finalize {
    /// The context.
    pub ctx: Context,
}

/// Replies once the device decided every operation posted before it.
#[derive(Message, Debug)]
#[rtype(result = "Result<()>")]
pub struct Fence;

/// The last event issued on every stream of the device.
#[derive(Message, Debug)]
#[rtype(result = "Result<Vec<Event>>")]
pub struct LastEvents;

/// Prune the device's tables now.
#[derive(Message, Debug)]
#[rtype(result = "Result<()>")]
pub struct Sweep;

/// Whether every operation issued on the device so far completed.
#[derive(Message, Debug)]
#[rtype(result = "Result<bool>")]
pub struct IsIdle;

/// Memory statistics of the device.
#[derive(Message, Debug)]
#[rtype(result = "Result<PoolStats>")]
pub struct GetMemoryStats;

/// The device's tables, pools and streams as JSON.
#[derive(Message, Debug)]
#[rtype(result = "Result<serde_json::Value>")]
pub struct DebugInfo;

/// Sizes of the device's protocol tables.
#[derive(Message, Debug)]
#[rtype(result = "Result<TableSizes>")]
pub struct GetTableSizes;

/// The last event issued on stream `stream` of the device, if any.
#[derive(Message, Debug)]
#[rtype(result = "Result<Option<Event>>")]
pub struct StreamLastEvent {
    /// Stream index.
    pub stream: usize,
}

/// The device actor's inbox has operations to decide (a kick from the post that found it
/// idle, read from the actor's stream of kicks).
#[derive(Debug)]
pub(crate) struct Drain;

/// A stream completed operations up to `seq` (coalesced).
#[derive(Message, Debug, Clone, Copy, PartialEq, Eq)]
#[rtype(result = "()")]
pub(crate) struct Completed {
    pub stream: StreamId,
    pub seq: u64,
}

/// Subscribe to a stream actor's completions.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub(crate) struct Subscribe(pub Recipient<Completed>);

/// Work was submitted to a stream that was not being watched.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub(crate) struct Watch;

/// Stop every stream of a device: queued work may finish until `deadline`.
#[derive(Message, Debug)]
#[rtype(result = "Vec<Abandoned>")]
pub(crate) struct StopStreams {
    pub deadline: Instant,
}

/// Operations a stopped stream gave up on.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Abandoned {
    /// The stream.
    pub stream: StreamId,
    /// First abandoned sequence number.
    pub from_seq: u64,
    /// Last abandoned sequence number.
    pub to_seq: u64,
}

/// Move `node` from `src` to `dst` (coordinator). Replies with the destination's event
/// once it is planned (`None` when both contexts share the buffer).
#[derive(Message, Debug)]
#[rtype(result = "Result<Option<Event>>")]
pub struct DeviceToDevice {
    /// The node.
    pub node: TensorNode,
    /// Source context.
    pub src: Context,
    /// Destination context.
    pub dst: Context,
    /// How the node is delivered.
    pub mode: MergeBufferUse,
}

/// Run an all-reduce step list (coordinator). Replies with the final events once every
/// step is planned.
#[derive(Message, Debug)]
#[rtype(result = "Result<Vec<Event>>")]
pub struct AllReduce {
    /// The steps.
    pub steps: Vec<tributary::collective::AllReduceStep>,
    /// The chunk nodes.
    pub nodes: Vec<TensorNode>,
    /// One context per participant.
    pub contexts: Vec<Context>,
    /// Per context, per chunk: the merge routine.
    pub merge: Vec<Vec<Routine>>,
    /// Per context: the scale routines.
    pub scale: Vec<Vec<Routine>>,
    /// How reduce steps move data.
    pub transfer: tributary::collective::Transfer,
}

/// Create a tensor node (coordinator).
#[derive(Message, Debug)]
#[rtype(result = "Result<TensorNode>")]
pub struct CreateNode {
    /// Label.
    pub label: String,
    /// Element type.
    pub dtype: tributary::DType,
    /// Shape.
    pub shape: tributary::Shape,
    /// Memory mode.
    pub mode: tributary::MemoryMode,
}

/// Refine a node's memory mode (coordinator).
#[derive(Message, Debug)]
#[rtype(result = "Result<tributary::MemoryMode>")]
pub struct RefineNode {
    /// The node.
    pub node: TensorNode,
    /// The mode to intersect with.
    pub mode: tributary::MemoryMode,
}

// The messages whose operation produces an event are made with the system that promises
// it and its ticket (`Schedule::new`, `FromHost::new`, `ToHost::new`: `ticketed.rs`).

impl InitFromHost {
    /// An [`InitFromHost`].
    pub fn new(ctx: Context, node: TensorNode) -> InitFromHost {
        InitFromHost { ctx, node }
    }
}

impl Finalize {
    /// A [`Finalize`].
    pub fn new(ctx: Context) -> Finalize {
        Finalize { ctx }
    }
}

impl DeviceToDevice {
    /// A [`DeviceToDevice`].
    pub fn new(
        node: TensorNode,
        src: Context,
        dst: Context,
        mode: MergeBufferUse,
    ) -> DeviceToDevice {
        DeviceToDevice {
            node,
            src,
            dst,
            mode,
        }
    }
}

impl AllReduce {
    /// An [`AllReduce`].
    pub fn new(
        steps: Vec<tributary::collective::AllReduceStep>,
        nodes: Vec<TensorNode>,
        contexts: Vec<Context>,
        merge: Vec<Vec<Routine>>,
        scale: Vec<Vec<Routine>>,
        transfer: tributary::collective::Transfer,
    ) -> AllReduce {
        AllReduce {
            steps,
            nodes,
            contexts,
            merge,
            scale,
            transfer,
        }
    }
}
