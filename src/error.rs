//! Errors as values. See DESIGN.md §2, "Errors".
//!
//! One enum, [`Error`], covers everything the public API can refuse or report. A failed
//! operation is [`Error::Failed`] with the [`Failure`] that caused it. So every dependent fails
//! with the same root cause.

use std::{fmt, path::PathBuf, sync::Arc, time::Duration};

use serde::{Deserialize, Serialize};

use crate::{
    ids::{BufferLoc, ContextId, DeviceId, StreamId},
    param::{ArgError, IndexType},
};

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
#[non_exhaustive]
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
///
/// Each variant carries the offending value (the index and the count, the node, the file
/// and the parser's message, ...). [`Error::kind`] names the variant, for logs and tests.
/// New variants may be added in minor releases (`#[non_exhaustive]`).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The node has no buffer in this context (it was never linked or initialised there).
    #[error("node {node} is not in context {context}")]
    NodeNotInContext {
        /// The node, as `label#id`.
        node: String,
        /// The context searched.
        context: ContextId,
    },
    /// A routine or a copy would read a buffer that no operation has written: no routine
    /// or copy wrote it, no host array stands behind it, and the node is not declared
    /// zero-initialised ([`TensorNode::new_zeroed`](crate::TensorNode::new_zeroed)). The
    /// bytes would be whatever the allocation held, which no program means to read.
    #[error("{what} reads {node} in context {context} (stream {stream}), but nothing has written that buffer{hint}")]
    UninitialisedRead {
        /// The node, as `label#id`.
        node: String,
        /// The context whose buffer would be read.
        context: ContextId,
        /// Its stream.
        stream: StreamId,
        /// The reading operation (`routine 'name'`, `a copy`).
        what: String,
        /// How to fix it when the protocol knows (another stream of the device holds a
        /// written buffer of the node); empty otherwise.
        hint: String,
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
    /// Plans given to [`StreamProgram::from_plans`](crate::protocol::StreamProgram::from_plans) do not
    /// make one stream's program (none, several streams, or sequence numbers that do not
    /// follow one another).
    #[error("invalid program: {reason}")]
    InvalidProgram {
        /// Which plan does not fit, and why.
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
    /// A schedule gave no value for an index the routine declares
    /// ([`RoutineSpec::with_index`](crate::kernels::RoutineSpec::with_index)); `schedule`
    /// of a routine with indices gives none.
    #[error("routine {routine}: no value for its index {binding} (it declares {declared})")]
    MissingBinding {
        /// The routine's name.
        routine: String,
        /// The index without a value.
        binding: String,
        /// Every index the routine declares, with its type.
        declared: String,
    },
    /// A schedule gave a value for an index the routine does not declare.
    #[error(
        "routine {routine} declares no index {binding} (given {value}; it declares {declared})"
    )]
    UnknownBinding {
        /// The routine's name.
        routine: String,
        /// The name given.
        binding: String,
        /// The value given for it.
        value: i64,
        /// Every index the routine declares, with its type.
        declared: String,
    },
    /// A schedule gave two values for one index.
    #[error("routine {routine}: index {binding} given twice ({first}, then {second})")]
    DuplicateBinding {
        /// The routine's name.
        routine: String,
        /// The index.
        binding: String,
        /// The first value given.
        first: i64,
        /// The second value given.
        second: i64,
    },
    /// A value does not fit the type its index declares.
    #[error("routine {routine}: {value} is out of range for its index {binding}: {ty}")]
    BindingOutOfRange {
        /// The routine's name.
        routine: String,
        /// The index.
        binding: String,
        /// The value given.
        value: i64,
        /// The index's declared type.
        ty: IndexType,
    },
    /// A shader's push constants (its immediates, then its indices' values) exceed what
    /// the device allows (`maxPushConstantsSize`; 128 bytes on lavapipe); refused at link.
    #[error("routine {routine}: {bytes} bytes of push constants ({immediates} of immediates, then its indices), device {device} allows {limit}")]
    PushConstantsTooLarge {
        /// The routine's name.
        routine: String,
        /// The device.
        device: DeviceId,
        /// Push-constant bytes the routine needs.
        bytes: usize,
        /// Of those, the shader's own immediates.
        immediates: usize,
        /// The device's limit.
        limit: u32,
    },
    /// A device index beyond the devices of the engine or system.
    #[error("no device {index}: there are {count} devices")]
    NoSuchDevice {
        /// The index asked for.
        index: usize,
        /// How many devices there are.
        count: usize,
    },
    /// A stream index beyond the streams of a device.
    #[error("no stream {index} on {device}: it has {count} streams")]
    NoSuchStream {
        /// The device.
        device: DeviceId,
        /// The stream index asked for.
        index: usize,
        /// How many streams the device has.
        count: usize,
    },
    /// A device id that is none of this engine's (or system's) devices.
    #[error("device {device} is not one of the {count} devices here")]
    UnknownDevice {
        /// The device id given.
        device: DeviceId,
        /// How many devices there are.
        count: usize,
    },
    /// A stream of another device than the one asked to use it.
    #[error("stream {stream} does not belong to {device}")]
    ForeignStream {
        /// The stream given.
        stream: StreamId,
        /// The device that was asked to use it.
        device: DeviceId,
    },
    /// A context that another engine (or system) created, or one naming a stream its
    /// device does not have.
    #[error("context {context} (on {stream}) is not a context of {device} here")]
    ForeignContext {
        /// The context given.
        context: ContextId,
        /// The stream the context says it runs on.
        stream: StreamId,
        /// The device asked to use it.
        device: DeviceId,
    },
    /// A node's buffer has no record on its device (its context was finalized under it).
    #[error("buffer {loc} of {node} is not on its device")]
    BufferNotFound {
        /// The node, as `label#id`.
        node: String,
        /// Where the context says the buffer is.
        loc: BufferLoc,
    },
    /// A free of memory that is not (or no longer) allocated: a double free or a stale
    /// allocation.
    #[error("{bytes} bytes at {loc} are not a live allocation")]
    NotLive {
        /// Where the allocation was.
        loc: BufferLoc,
        /// Its size in bytes.
        bytes: u64,
    },
    /// A configuration document or file that cannot be read or parsed.
    #[error("configuration {} ({format}): {message}", path.as_ref().map_or_else(|| "text".to_string(), |p| p.display().to_string()))]
    ConfigParse {
        /// The file, when it came from one.
        path: Option<PathBuf>,
        /// The format tried (`toml`, `json`).
        format: String,
        /// The reader's or the parser's message (with line and column).
        message: String,
    },
    /// A configuration value that cannot be used.
    #[error("configuration: {setting} = {value} is not usable: {reason}")]
    InvalidConfig {
        /// The setting (`cpu_devices`, `streams`, ...).
        setting: String,
        /// Its value.
        value: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// Bytes that are not elements of the type asked for (a read as the wrong type, a
    /// length that is not a whole number of elements).
    #[error(transparent)]
    Argument(#[from] ArgError),
    /// An operating-system resource could not be had (a thread, a file written on request).
    #[error("{what}: {message}")]
    Io {
        /// What was attempted (`spawn the actor thread`, `write trace.json`).
        what: String,
        /// The operating system's message.
        message: String,
    },
    /// A step the engine relies on produced nothing (a bug in tributary: please report it).
    #[error("internal error: {0}")]
    Internal(String),
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
    // ----- A cluster of systems across processes (tributary-actors, feature `mpi`) -------
    /// A rank sent nothing for a network operation within the cluster's deadline: it
    /// exited, died, or stopped issuing the same operations as this rank.
    #[error("rank {rank} sent nothing for {operation} (network call {call}) within {waited:?}: it exited, died or stopped issuing the same operations")]
    RankUnreachable {
        /// The rank that was waited for.
        rank: usize,
        /// The network call's index (the n-th network operation of this rank's program).
        call: u64,
        /// The operation (`all_reduce of dw1 [8, 32] f32 sum`, ...).
        operation: String,
        /// The deadline that ran out.
        waited: Duration,
    },
    /// Two ranks issued different network operations as the same call: the SPMD contract
    /// (every rank issues the same collectives, on the same nodes, shapes and dtypes, in the
    /// same order) was broken. Every rank involved reports it.
    #[error("network call {call}: rank {rank} issued {theirs}, rank {this_rank} issued {ours} (every rank must issue the same collectives in the same order)")]
    CollectiveMismatch {
        /// The call's index.
        call: u64,
        /// The rank whose operation differs from this rank's.
        rank: usize,
        /// This rank.
        this_rank: usize,
        /// What this rank issued.
        ours: String,
        /// What `rank` issued.
        theirs: String,
    },
    /// A rank could not take part in a network operation because its own input failed
    /// there (a failed dependency on that rank; its own error names the cause).
    #[error("rank {rank} could not take part in {operation} (network call {call}): its input failed there")]
    RankInputFailed {
        /// The rank whose input failed.
        rank: usize,
        /// The call's index.
        call: u64,
        /// The operation.
        operation: String,
    },
    /// A rank index outside the cluster.
    #[error("no rank {rank}: the cluster has {size} ranks")]
    NoSuchRank {
        /// The rank given.
        rank: usize,
        /// The number of ranks.
        size: usize,
    },
    /// A captured step cannot be replayed as it was captured: something its captured
    /// decisions depend on changed since (DESIGN.md §4, "Step capture and replay").
    /// Nothing of the replay was planned.
    #[error("captured step {step} cannot be replayed: {why}")]
    ReplayInvalidated {
        /// The step's number (unique in the process).
        step: u64,
        /// What changed, with the offending value.
        why: Invalidation,
    },
    /// An MPI function returned an error code.
    #[error("{function} failed with MPI error {code}: {message}")]
    Mpi {
        /// The MPI function.
        function: String,
        /// Its error code.
        code: i32,
        /// The MPI library's text for the code.
        message: String,
    },
}

impl Error {
    /// The variant's name (`"NoSuchDevice"`, `"DTypeMismatch"`, ...), for logs and tests
    /// that compare errors by kind.
    ///
    /// ```
    /// let e = tributary::Error::NoSuchDevice { index: 3, count: 2 };
    /// assert_eq!(e.kind(), "NoSuchDevice");
    /// assert_eq!(e.to_string(), "no device 3: there are 2 devices");
    /// ```
    pub fn kind(&self) -> &'static str {
        match self {
            Error::NodeNotInContext { .. } => "NodeNotInContext",
            Error::AlreadyInContext { .. } => "AlreadyInContext",
            Error::UninitialisedRead { .. } => "UninitialisedRead",
            Error::DTypeMismatch { .. } => "DTypeMismatch",
            Error::SizeMismatch { .. } => "SizeMismatch",
            Error::ModeConflict { .. } => "ModeConflict",
            Error::NotMaterialized { .. } => "NotMaterialized",
            Error::NotHosted { .. } => "NotHosted",
            Error::ContextFinalized { .. } => "ContextFinalized",
            Error::ContextInUse { .. } => "ContextInUse",
            Error::MergeBufferMismatch { .. } => "MergeBufferMismatch",
            Error::SecondWriter { .. } => "SecondWriter",
            Error::PoolExhausted { .. } => "PoolExhausted",
            Error::InvalidSize { .. } => "InvalidSize",
            Error::InvalidRoutine { .. } => "InvalidRoutine",
            Error::InvalidProgram { .. } => "InvalidProgram",
            Error::MissingBinding { .. } => "MissingBinding",
            Error::UnknownBinding { .. } => "UnknownBinding",
            Error::DuplicateBinding { .. } => "DuplicateBinding",
            Error::BindingOutOfRange { .. } => "BindingOutOfRange",
            Error::PushConstantsTooLarge { .. } => "PushConstantsTooLarge",
            Error::NoSuchDevice { .. } => "NoSuchDevice",
            Error::NoSuchStream { .. } => "NoSuchStream",
            Error::UnknownDevice { .. } => "UnknownDevice",
            Error::ForeignStream { .. } => "ForeignStream",
            Error::ForeignContext { .. } => "ForeignContext",
            Error::BufferNotFound { .. } => "BufferNotFound",
            Error::NotLive { .. } => "NotLive",
            Error::ConfigParse { .. } => "ConfigParse",
            Error::InvalidConfig { .. } => "InvalidConfig",
            Error::Argument(_) => "Argument",
            Error::Io { .. } => "Io",
            Error::Internal(_) => "Internal",
            Error::StreamingUnsupported { .. } => "StreamingUnsupported",
            Error::Failed(_) => "Failed",
            Error::Timeout { .. } => "Timeout",
            Error::Device(_) => "Device",
            Error::ShutDown(_) => "ShutDown",
            Error::LengthMismatch { .. } => "LengthMismatch",
            Error::IndexOutOfRange { .. } => "IndexOutOfRange",
            Error::ActorPanicked { .. } => "ActorPanicked",
            Error::HostArrayBusy { .. } => "HostArrayBusy",
            Error::WrongStream { .. } => "WrongStream",
            Error::RankUnreachable { .. } => "RankUnreachable",
            Error::CollectiveMismatch { .. } => "CollectiveMismatch",
            Error::RankInputFailed { .. } => "RankInputFailed",
            Error::NoSuchRank { .. } => "NoSuchRank",
            Error::Mpi { .. } => "Mpi",
            Error::ReplayInvalidated { .. } => "ReplayInvalidated",
        }
    }

    /// The root cause, when this error is a failed dependency.
    pub fn root_cause(&self) -> Option<&Failure> {
        match self {
            Error::Failed(f) => Some(f),
            _ => None,
        }
    }
}

/// Why a captured step cannot be replayed ([`Error::ReplayInvalidated`]): each variant is
/// one kind of change that would alter a captured decision, with the offending value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Invalidation {
    /// A context the step uses (a routine's, a copy's source or destination) was
    /// finalized: its buffers may be gone or reused.
    #[error("context {context} on {device} was finalized")]
    ContextFinalized {
        /// The device.
        device: DeviceId,
        /// The finalized context.
        context: ContextId,
    },
    /// A hosted node the step reads before writing it lags its host array (a host write
    /// since the capture, or a buffer never uploaded): issued directly, the step would
    /// upload it first, and the captured plan has no upload.
    #[error(
        "hosted node {node} lags its host array on {device} (buffer holds version \
         {buffer_version:?}, the host array is at version {host_version}): the captured \
         step has no upload"
    )]
    HostWritten {
        /// The device.
        device: DeviceId,
        /// The node, as `label#id`.
        node: String,
        /// The host version the device buffer holds (`None`: never uploaded).
        buffer_version: Option<u64>,
        /// The host array's version now.
        host_version: u64,
    },
    /// The merge buffer of a stream the step uses now holds another node, or was
    /// reallocated (a larger node was copied into it), since the capture.
    #[error("merge buffer of {stream}: the step expects {expected}, it holds {found}")]
    MergeBufferChanged {
        /// The stream.
        stream: StreamId,
        /// What the step was captured with (node and location).
        expected: String,
        /// What the merge buffer holds now.
        found: String,
    },
    /// Replay values that do not fit the captured schedules (another step's values, a
    /// schedule given a routine's bindings with other declared indices, a missing value).
    #[error("schedule {schedule} of the step ({routine}): {reason}")]
    BindingShape {
        /// The schedule, counted among the step's schedules that declare indices.
        schedule: usize,
        /// The routine captured there.
        routine: String,
        /// What does not fit.
        reason: String,
    },
    /// The step was captured on another engine or system.
    #[error("the step was captured by another engine or system (device {device})")]
    Foreign {
        /// The device that refused it.
        device: DeviceId,
    },
}

/// The text of a panic's payload (`&str` or `String` payloads; a placeholder otherwise).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}
