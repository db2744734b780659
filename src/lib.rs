//! # tributary: the engine
//!
//! tributary spreads tensor computations over several devices (CPU, Vulkan, CUDA) and keeps
//! them correct without the caller writing a barrier. This crate is the engine: everything
//! except the actor layer (which lives in `tributary-actors`). It has no actix dependency.
//!
//! Design choices (see `DESIGN.md` for the contract):
//!
//! - **Program order is the specification.** Any program behaves as if every operation ran
//!   one after another in issue order. The [`protocol`] decides, when work is *scheduled*,
//!   which events each piece of work must wait for; work runs later on streams.
//! - **Sans-IO protocol.** [`protocol::DeviceState`] is a plain state machine: operations go
//!   in, [`protocol::Plan`]s (waits, work, event to record) come out. Backends execute plans.
//! - **Events are sequence numbers** on a per-stream [`event::Timeline`]; a failed operation
//!   fails every operation that depends on it with the root cause.
//! - **Memory is slab pools** addressed by [`BufferLoc`]; freed ranges return to use only
//!   after every event touching them has completed ([`memory`]).
//! - **All synchronisation primitives come from [`sync`]**, which swaps `std` for `loom`
//!   under `--cfg tributary_loom`, so the real engine code is model-checked.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

/// `mutant!("rule")` is true when the engine is compiled with
/// `--cfg tributary_mutant="rule"`: the protocol rule of that name is then switched off, so
/// the loom models and engine tests can prove they notice its absence.
macro_rules! mutant {
    ($rule:literal) => {
        cfg!(tributary_mutant = $rule)
    };
}

pub mod backend;
pub mod collective;
pub mod engine;
pub mod error;
pub mod event;
pub mod ids;
pub mod kernels;
pub mod memory;
pub mod node;
pub mod protocol;
pub mod sync;
pub mod trace;

pub use engine::{Engine, EngineConfig, MergeBufferUse};
pub use error::{DeviceError, Error, Failure, Result};
pub use event::{Event, EventStatus, Timeline};
pub use ids::{BufferLoc, ContextId, DeviceId, NodeId, PoolId, StreamId};
pub use node::{Bf16, DType, Element, HostedKind, MemoryMode, Shape, Sharing, TensorNode, F16};
