//! # tributary-actors: the actor system
//!
//! The host-facing layer of tributary (DESIGN.md §4), on actix:
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

mod collective;
mod coordinator;
mod device;
mod guard;
pub mod messages;
mod stream;
mod system;
mod ticket;

pub use collective::{AllReducePlan, BucketedAllReduce};
pub use coordinator::Coordinator;
pub use device::DeviceActor;
pub use system::{
    ContextHandle, DeviceHandle, MemoryReport, RoutineHandle, ShutdownReport, StreamConfig,
    StreamHandle, System, SystemBuilder, SystemConfig,
};
pub use ticket::{block_on, Ticket, TicketSender};
pub use tributary;
pub use tributary::MergeBufferUse;
