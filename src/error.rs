//! Errors as values.
//!
//! One enum, [`Error`], for everything the public API can refuse or report. Misuse gets a
//! variant that names what was wrong; a failed operation on a stream is reported as
//! [`Error::Failed`] carrying the [`Failure`] that caused it (the *root cause*), so that
//! every dependent operation fails with the same explanation (DESIGN.md §3, rule 6).

use std::{fmt, sync::Arc, time::Duration};

use serde::{Deserialize, Serialize};

use crate::ids::{ContextId, DeviceId, StreamId};

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The root cause of a failed operation on a stream.
///
/// Created once, where the failure happened (a panicking kernel, a driver error, a dead
/// worker), and shared by every operation that fails because of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The stream whose operation failed first.
    pub stream: StreamId,
    /// The event sequence number of that operation on its stream.
    pub seq: u64,
    /// What the operation was (routine name, `copy`, `from_host`, ...).
    pub operation: String,
    /// What went wrong.
    pub message: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (event {}#{}) failed: {}",
            self.operation, self.stream, self.seq, self.message
        )
    }
}

/// Errors a device or its driver reports, shared by every backend (mapped at the backend edge).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum DeviceError {
    /// The device ran out of memory.
    #[error("device out of memory ({requested} bytes requested)")]
    OutOfMemory {
        /// Bytes requested by the failing allocation.
        requested: u64,
    },
    /// The device was lost (driver reset, worker died).
    #[error("device lost: {0}")]
    Lost(String),
    /// The backend cannot be used on this machine (no driver, no library).
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// Any other driver error.
    #[error("unexpected device error: {0}")]
    Unexpected(String),
}

/// Everything that can go wrong in tributary.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Error {
    /// The node has no buffer in this context (it was never linked or initialised there).
    #[error("node {node} is not in context {context}")]
    NodeNotInContext {
        /// The node, as `label#id`.
        node: String,
        /// The context searched.
        context: ContextId,
    },
    /// The node already has a buffer in this context.
    #[error("node {node} is already in context {context}")]
    AlreadyInContext {
        /// The node, as `label#id`.
        node: String,
        /// The context.
        context: ContextId,
    },
    /// Data or an argument has the wrong element type.
    #[error("dtype mismatch for {node}: expected {expected}, got {found}")]
    DTypeMismatch {
        /// The node, as `label#id`.
        node: String,
        /// The dtype required.
        expected: String,
        /// The dtype given.
        found: String,
    },
    /// Data or an argument has the wrong number of elements or the wrong shape.
    #[error("size mismatch for {node}: expected {expected}, got {found}")]
    SizeMismatch {
        /// The node, as `label#id`.
        node: String,
        /// What was required (elements or shape).
        expected: String,
        /// What was given.
        found: String,
    },
    /// A memory-mode update contradicts the current mode (modes are only refined).
    #[error("memory mode of {node} cannot go from {current} to {requested}")]
    ModeConflict {
        /// The node, as `label#id`.
        node: String,
        /// The current mode.
        current: String,
        /// The requested mode.
        requested: String,
    },
    /// The node has no storage a context could hold (virtual or local).
    #[error("node {node} is {mode} and has no buffer in contexts")]
    NotMaterialized {
        /// The node, as `label#id`.
        node: String,
        /// Its memory mode.
        mode: String,
    },
    /// The operation needs a hosted node (one with a host array).
    #[error("node {node} is not hosted")]
    NotHosted {
        /// The node, as `label#id`.
        node: String,
    },
    /// The context was finalized and can no longer be used.
    #[error("context {context} is finalized")]
    ContextFinalized {
        /// The context.
        context: ContextId,
    },
    /// The context cannot be finalized while children still use its buffers.
    #[error("context {context} still has {children} live child context(s)")]
    ContextInUse {
        /// The context.
        context: ContextId,
        /// Number of children not yet finalized.
        children: usize,
    },
    /// A routine expects a different node in its stream's merge buffer.
    #[error("merge buffer of {stream} holds {found}, but the routine expects {expected}")]
    MergeBufferMismatch {
        /// The stream whose merge buffer was checked.
        stream: StreamId,
        /// The node the routine expects.
        expected: String,
        /// What the merge buffer holds (`nothing` when empty).
        found: String,
    },
    /// A second stream tried to write a node that is shared across the streams of a device.
    #[error("node {node} is shared across streams and owned by {owner}; {writer} cannot write it")]
    SecondWriter {
        /// The node, as `label#id`.
        node: String,
        /// The stream that owns (writes) the node.
        owner: StreamId,
        /// The stream that tried to write it.
        writer: StreamId,
    },
    /// A device's memory limit would be exceeded.
    #[error(
        "pool exhausted on {device}: {requested} bytes requested, {available} of {limit} available"
    )]
    PoolExhausted {
        /// The device.
        device: DeviceId,
        /// Bytes requested.
        requested: u64,
        /// Bytes still available under the limit.
        available: u64,
        /// The device's limit in bytes.
        limit: u64,
    },
    /// A size that cannot be allocated (zero elements, or overflowing `u64`).
    #[error("invalid size for {node}: {reason}")]
    InvalidSize {
        /// The node, as `label#id`.
        node: String,
        /// Why the size is invalid.
        reason: String,
    },
    /// A routine definition is malformed (same node twice, missing arguments, ...).
    #[error("invalid routine {routine}: {reason}")]
    InvalidRoutine {
        /// The routine name.
        routine: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A device index beyond the devices of the engine or system.
    #[error("no device {index}: there are {count} devices")]
    NoSuchDevice {
        /// The index asked for.
        index: usize,
        /// How many devices there are.
        count: usize,
    },
    /// A device, stream or context that this engine does not know.
    #[error("unknown {what}")]
    Unknown {
        /// What was looked up (e.g. `device d7`).
        what: String,
    },
    /// The destination cannot address the source memory in place (`StreamingFor`).
    #[error("streaming from {src} to {dst} is not possible: {reason}")]
    StreamingUnsupported {
        /// Source device.
        src: DeviceId,
        /// Destination device.
        dst: DeviceId,
        /// Why.
        reason: String,
    },
    /// An operation this waited on (directly or through its dependencies) failed.
    #[error("dependency failed: {0}")]
    Failed(Arc<Failure>),
    /// A bounded wait ran out of time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The bound.
        after: Duration,
    },
    /// The device or its driver reported an error.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The system (or the stream) has been shut down.
    #[error("shut down: {0}")]
    ShutDown(String),
    // ----- Validation of actor messages (tributary-actors) -------------------------------
    /// A stream index beyond the streams of a device.
    #[error("no stream {index} on {device}: it has {count} streams")]
    NoSuchStream {
        /// The device.
        device: DeviceId,
        /// The index asked for.
        index: usize,
        /// How many streams the device has.
        count: usize,
    },
    /// Two lists of one message that must have the same length do not.
    #[error("{what}: expected {expected} entries, got {found}")]
    LengthMismatch {
        /// Which list (and what its length must match).
        what: String,
        /// The length required.
        expected: usize,
        /// The length given.
        found: usize,
    },
    /// An index in a message points past the list it indexes.
    #[error("{what}: index {index} is out of range (length {len})")]
    IndexOutOfRange {
        /// What the index selects.
        what: String,
        /// The index given.
        index: usize,
        /// The length of the list.
        len: usize,
    },
    /// An actor panicked while handling a message (a bug, caught as a last line). The
    /// actor refuses every later message with this error, and the operations it had
    /// issued fail with it as their root cause.
    #[error("{actor} panicked while handling {message}: {panic}")]
    ActorPanicked {
        /// The actor (e.g. `device actor d0`).
        actor: String,
        /// The message it was handling.
        message: String,
        /// The panic's payload.
        panic: String,
    },
    /// The host array of a hosted node was to be written (or read) while a device
    /// operation that reads or writes it (or writes it) was still pending: wait for the
    /// events of `HostTable::begin_write` (or `pending_writes`) first.
    #[error("host array of {node} is in use by {pending} pending device operation(s)")]
    HostArrayBusy {
        /// The node.
        node: String,
        /// How many device operations were still pending.
        pending: usize,
    },
    /// A plan was submitted to the queue of a stream that does not complete its event
    /// (another stream, or the same stream of another engine). The plan is not run and its
    /// event is left to the queue that owns it.
    #[error("{operation}: a plan of stream {plan} was submitted to the queue of {queue}")]
    WrongStream {
        /// The plan's stream.
        plan: StreamId,
        /// The stream of the queue it was submitted to.
        queue: StreamId,
        /// The plan's operation.
        operation: String,
    },
}

impl Error {
    /// The root cause, when this error is a failed dependency.
    pub fn root_cause(&self) -> Option<&Failure> {
        match self {
            Error::Failed(f) => Some(f),
            _ => None,
        }
    }
}
