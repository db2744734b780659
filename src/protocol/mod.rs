//! The synchronisation protocol as a sans-IO state machine. See DESIGN.md §3.
//!
//! [`DeviceState`] owns one device's tables and pools. Each operation becomes one or more
//! [`Plan`]s: which events to wait for, what to run and which event to complete. The engine in
//! [`crate::engine`] or the actor layer runs plans on backends, and loom models run them on
//! model threads. Nothing here waits or performs I/O.

mod context;
mod device;
mod host;
mod merge;
mod plan;
mod program;
mod tables;
mod unsubmitted;

pub use context::{ArrayEntry, Context, Routine};
pub(crate) use device::invalidated;
pub use device::{
    check_streaming_placement, device_to_device, DeviceState, DeviceStep, DeviceToDevicePlans,
    ReplayLinks, ReplayProgress, ReplayRun, Source, StepRecorder, TableSizes,
};
pub use host::{DeviceCopy, HostArrayObserver, HostRecord, HostTable};
pub use merge::MergeBufferUse;
pub use plan::OP_STAMPS;
pub use plan::{
    await_deps, await_deps_observed, current_issue, issue_clock, ArgBinding, Dep, DepKind, Deps,
    GlobalLoc, Plan, PlanLabel, Plans, Work,
};
pub(crate) use plan::{reserve_issue_stamps, set_current_issue};
pub use program::{StreamProgram, StreamProgramOp};
pub use tables::{BufferUses, Uses};
pub(crate) use unsubmitted::fail_when_ready;
