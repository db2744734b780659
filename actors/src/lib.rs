//! # tributary-actors: the actor system
//!
//! The host-facing layer of tributary, on actix. `DESIGN.md` at the repository root holds the
//! design, its rules and the message flows; §4 covers this crate.
//!
//! ## Concepts
//!
//! - **Node**: a tensor's description and memory mode, a [`tributary::TensorNode`] made with
//!   [`System::node`]. Contexts hold its buffers.
//! - **Context**: what one stream of one device holds. A [`ContextHandle`] can link, read and
//!   finalize by itself; linking gives a child context. Lower-level [`System`] methods take
//!   the [`tributary::protocol::Context`] from [`ContextHandle::protocol_context`].
//! - **Routine**: a kernel linked into a context, a [`RoutineHandle`]. Its
//!   [`RoutineHandle::schedule`] returns a [`Ticket`] at once.
//! - **Event**: the completion of one operation on one stream, a [`tributary::Event`] behind
//!   a [`Ticket`]. Operations wait for the events they conflict with; nobody writes barriers.
//! - **Merge buffer**: one per stream, filled by [`System::device_to_device`] for a merge
//!   routine such as `kernels::add_merge`. [`AllReducePlan`] builds all-reduces from these.
//!
//! ```
//! use tributary::{kernels, DType, MemoryMode, MergeBufferUse};
//! use tributary_actors::System;
//! let sys = System::builder().cpu_devices(2).spawn()?; // no async runtime needed
//! let g = sys.node("g", DType::F32, [4]).with_mode(MemoryMode::on_device())?;
//! let a = sys.context(0, 0)?.link(kernels::fill(&g, 1.0)?)?;
//! let b = sys.context(1, 0)?.link(kernels::fill(&g, 2.0)?)?;
//! a.schedule()?;
//! b.schedule()?;
//! let sum = b.context().link(kernels::add_merge(&g)?)?; // g += merge buffer
//! sys.device_to_device(&g, &a.context(), &sum.context(), MergeBufferUse::Copy)?;
//! sum.schedule()?;
//! assert_eq!(sum.context().read::<f32>(&g)?, vec![3.0; 4]);
//! sys.shutdown()?;
//! # Ok::<(), tributary::Error>(())
//! ```
//!
//! ## Actors
//!
//! ```text
//!                  ┌── device-local work ──▶ DeviceActor (pools, tables) ──▶ StreamActor ──▶ backend queue
//! host (System) ───┤                                ▲                            │
//!                  └── cross-device work ─▶ Coordinator ─▶ (source and destination DeviceActors)
//!    ▲                                                                           │
//!    └────────── tickets / events (wait, poll, future) ◀── completion events ────┘
//! ```
//!
//! - [`DeviceActor`] owns one device's protocol state; its decisions follow inbox order.
//! - `StreamActor` owns one stream's backend queue and publishes completions.
//! - [`Coordinator`] routes device-to-device messages between device actors.
//! - [`System`] spawns all of it and offers blocking and async methods.
//!
//! Hosts already running actix may send the public [`messages`] instead. Every failure
//! reaches the caller as a typed error on the ticket, the event or the reply. A stopped actor
//! resolves its pending tickets with `Error::ShutDown`.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

/// `mutant!("rule")` is true when the rule of that name is switched off, so its test can
/// prove it notices (`loom_tests/run.sh` lists every rule and the test that catches it):
/// when this crate is compiled with `--cfg tributary_mutant="rule"` (`TRIBUTARY_MUTANT=rule`,
/// through `build.rs`), or, in a build with every mutant (`TRIBUTARY_MUTANTS=1`), when the
/// process runs with `TRIBUTARY_ACTIVE_MUTANT=rule` (every rank of an `mpirun` inherits it).
#[cfg(not(tributary_mutants))]
#[allow(unused_macros)]
macro_rules! mutant {
    ($rule:literal) => {
        cfg!(tributary_mutant = $rule)
    };
}

/// See the other definition: the rule is also chosen when the process starts.
#[cfg(tributary_mutants)]
#[allow(unused_macros)]
macro_rules! mutant {
    ($rule:literal) => {
        cfg!(tributary_mutant = $rule) || tributary::mutants::active($rule)
    };
}

#[cfg(feature = "mpi")]
pub mod cluster;
mod collective;
mod config;
mod coordinator;
mod device;
mod guard;
mod handles;
mod host_arrays;
pub mod messages;
mod spawn;
mod steps;
mod stream;
mod system;
mod ticket;
mod ticketed;

pub use collective::{AllReducePlan, BucketedAllReduce};
pub use config::{StreamConfig, SystemBuilder, SystemConfig};
pub use coordinator::Coordinator;
pub use device::DeviceActor;
pub use handles::{ContextHandle, DeviceHandle, RoutineHandle, StreamHandle};
pub use steps::SystemCapture;
pub use system::{MemoryReport, ShutdownReport, System};
pub use ticket::{block_on, Ticket};
pub use tributary;
pub use tributary::dispatch::{Fallbacks, ReplayStats};
pub use tributary::MergeBufferUse;
