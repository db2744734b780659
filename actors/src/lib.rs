//! # tributary-actors: the actor system
//!
//! The host-facing layer of tributary, on actix. The design, with its rules and message
//! flows, is `DESIGN.md` at the repository root (§4 for this crate).
//!
//! ## Concepts
//!
//! - **Node** ([`tributary::TensorNode`], made with [`System::node`]): a tensor's
//!   description and memory mode; contexts hold its buffers.
//! - **Context**: what one stream of one device holds. [`ContextHandle`] is a context of a
//!   running system (it can link, read and finalize by itself); it wraps the protocol's
//!   [`tributary::protocol::Context`] value ([`ContextHandle::protocol_context`]), which
//!   the lower-level [`System`] methods take. Linking gives a child context.
//! - **Routine** ([`RoutineHandle`]): a kernel linked into a context;
//!   [`RoutineHandle::schedule`] issues it and returns a [`Ticket`] at once.
//! - **Event** ([`tributary::Event`], behind a [`Ticket`]): the completion of one
//!   operation on one stream. Operations wait for exactly the events they conflict with;
//!   the caller never writes a barrier.
//! - **Merge buffer**: one per stream, receiving another context's copy of a node
//!   ([`System::device_to_device`]) for a merge routine (`kernels::add_merge`,
//!   `kernels::copy_merge`); [`AllReducePlan`] builds all-reduces from these.
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
//!
//! ```text
//!                  ┌── device-local work ──▶ DeviceActor (pools, tables) ──▶ StreamActor ──▶ backend queue
//! host (System) ───┤                                ▲                            │
//!                  └── cross-device work ─▶ Coordinator ─▶ (source and destination DeviceActors)
//!    ▲                                                                           │
//!    └────────── tickets / events (wait, poll, future) ◀── completion events ────┘
//! ```
//!
//! - [`DeviceActor`] owns one device's protocol state (the engine's sans-IO
//!   `DeviceState`) and makes every scheduling decision in arrival order.
//! - `StreamActor` owns one stream's backend queue and publishes completions (only the
//!   device actor talks to it).
//! - [`Coordinator`] routes device-to-device operations between device actors.
//! - [`System`] spawns all of it from plain synchronous code and offers blocking and
//!   async methods; the messages in [`messages`] that a host may send in any order are
//!   public, for hosts already running actix (the module docs say which, and why the
//!   others are not).
//!
//! Scheduling returns a [`Ticket`] at once (no round trip); the device actor fills in the
//! event. Every failure reaches the caller as a typed error on the ticket, the event or the
//! reply; a stopped actor resolves its pending tickets with `Error::ShutDown`.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

/// `mutant!("rule")` is true when this crate is compiled with
/// `--cfg tributary_mutant="rule"` (`TRIBUTARY_MUTANT=rule`, through `build.rs`): the rule
/// of that name is then switched off, so its test can prove it notices
/// (`loom_tests/run.sh` lists every rule and the test that catches it).
#[allow(unused_macros)]
macro_rules! mutant {
    ($rule:literal) => {
        cfg!(tributary_mutant = $rule)
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
pub use tributary::MergeBufferUse;
