//! # tributary: the engine
//!
//! tributary spreads tensor computations over several devices: CPU, Vulkan and CUDA. It keeps
//! them correct without the caller writing a barrier. This crate is the engine; the actor
//! layer is `tributary-actors`, so this crate has no actix dependency. `DESIGN.md` at the
//! repository root holds the design: §2 defines each concept and §3 states the rules.
//!
//! ## Concepts
//!
//! - A [`TensorNode`] describes a tensor: its label, [`DType`], [`Shape`] and [`MemoryMode`].
//!   The mode says where the node may live and who may change it. Contexts hold its buffers.
//! - A [`protocol::Context`] is what one stream of one device holds: which nodes have a
//!   buffer there, and where. Linking a routine into a context gives a child context with the
//!   routine's nodes added. Finalizing a context frees what it added.
//! - A [`protocol::Routine`] is a kernel linked into a context, with the access of each node.
//!   The kernel is a built-in, a Rust closure, a Vulkan shader or a CUDA kernel; see
//!   [`kernels`]. Scheduling a routine issues it on the context's stream.
//! - An [`Event`] is the completion of one operation: a sequence number on its stream's
//!   [`Timeline`]. Each operation waits for exactly the earlier operations it conflicts with.
//!   A failed operation fails its dependents with the same root cause, a [`Failure`].
//! - Each stream has one merge buffer. [`MergeBufferUse::Copy`] copies another context's node
//!   into it, for a merge routine such as [`kernels::add_merge`] or [`kernels::copy_merge`].
//!   With [`MergeBufferUse::StreamingFor`] the routine reads the source in place. Data
//!   parallelism and the [`collective`] all-reduces are built from these.
//!
//! ```
//! use tributary::{kernels, DType, Engine, EngineConfig, MemoryMode, MergeBufferUse, TensorNode};
//! let mut e = Engine::cpu(EngineConfig::default())?; // 2 CPU devices x 2 streams
//! let g = TensorNode::new("g", DType::F32, [4]).with_mode(MemoryMode::on_device())?;
//! let (c0, c1) = (e.context(0, 0)?, e.context(1, 0)?);
//! let a = e.link(&c0, kernels::fill(&g, 1.0)?)?; // routine: g = 1 on device 0
//! let b = e.link(&c1, kernels::fill(&g, 2.0)?)?; // routine: g = 2 on device 1
//! e.schedule(&a)?; // returns an event at once
//! e.schedule(&b)?;
//! let sum = e.link(b.context(), kernels::add_merge(&g)?)?; // g += merge buffer
//! e.device_to_device(&g, a.context(), sum.context(), MergeBufferUse::Copy)?;
//! e.schedule(&sum)?;
//! assert_eq!(e.read::<f32>(sum.context(), &g)?, vec![3.0; 4]); // waits for what it needs
//! # Ok::<(), tributary::Error>(())
//! ```
//!
//! ## Design choices
//!
//! - **Program order is the specification.** A program behaves as if its operations ran one
//!   after another in issue order. The [`protocol`] decides what each operation waits for
//!   when it is scheduled; the work runs later, on streams.
//! - **The protocol is sans-IO.** [`protocol::DeviceState`] takes operations and gives
//!   [`protocol::Plan`]s. Backends execute the plans.
//! - **Memory is slab pools**, addressed by [`BufferLoc`]. A freed range returns to use only
//!   after every event that touches it has completed; see [`memory`].
//! - **Errors are values.** Each [`Error`] variant names the condition and carries the
//!   offending value.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

/// `mutant!("rule")` is true when the protocol rule of that name is switched off, so the
/// loom models and engine tests can prove they notice its absence: when the engine is
/// compiled with `--cfg tributary_mutant="rule"` (`TRIBUTARY_MUTANT=rule`, through
/// `build.rs`), or, in a build with every mutant (`TRIBUTARY_MUTANTS=1`, `--cfg
/// tributary_mutants`), when the process runs with `TRIBUTARY_ACTIVE_MUTANT=rule`. One such
/// build serves the whole mutation check (`loom_tests/run.sh`).
#[cfg(not(tributary_mutants))]
macro_rules! mutant {
    ($rule:literal) => {
        cfg!(tributary_mutant = $rule)
    };
}

/// See the other definition: the rule is also chosen when the process starts.
#[cfg(tributary_mutants)]
macro_rules! mutant {
    ($rule:literal) => {
        cfg!(tributary_mutant = $rule) || $crate::mutants::active($rule)
    };
}

/// The run-time choice of a mutant, in a build with every mutant (`--cfg
/// tributary_mutants`, never a normal build).
#[cfg(tributary_mutants)]
#[doc(hidden)]
pub mod mutants {
    /// Whether `rule` is the mutant this process runs (`TRIBUTARY_ACTIVE_MUTANT`, read once:
    /// plain `std`, not the loom shim, so it adds no interleaving to a model).
    pub fn active(rule: &str) -> bool {
        static ACTIVE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        ACTIVE.get_or_init(|| std::env::var("TRIBUTARY_ACTIVE_MUTANT").unwrap_or_default()) == rule
    }
}

pub mod backend;
pub mod collective;
// Internal: the actor layer's decisions, for `tributary-actors` and the loom models. Not
// part of the API (DESIGN.md §4, "The public API").
#[doc(hidden)]
pub mod dispatch;
mod dtype;
pub mod engine;
pub mod error;
pub mod event;
pub mod ids;
pub mod kernels;
pub mod memory;
pub mod node;
mod param;
pub mod protocol;
pub mod replay;
// Internal: the synchronisation shim (`std`, or loom under `--cfg tributary_loom`), for the
// actor crate and the loom models. Not part of the API.
#[doc(hidden)]
pub mod sync;
pub mod trace;

pub use engine::{Capture, Engine, EngineConfig};
pub use error::{DeviceError, Error, Failure, Invalidation, Result};
// Internal: deferred events, for the actor crate. Not part of the API.
#[doc(hidden)]
pub use event::pending;
pub use event::{Event, EventStatus, Timeline};
/// The `half` crate behind [`F16`] and [`Bf16`] (e.g. `half::slice::HalfFloatSliceExt` for
/// bulk conversions).
pub use half;
pub use ids::{BufferLoc, ContextId, DeviceId, NodeId, PoolId, StreamId};
pub use node::{Bf16, DType, Element, HostedKind, MemoryMode, Shape, Sharing, TensorNode, F16};
pub use protocol::MergeBufferUse;
pub use replay::{Step, StepBindings, StreamLasts};
