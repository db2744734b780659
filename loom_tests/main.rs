//! loom models of tributary's synchronisation: the event timeline, the protocol driving
//! real streams, the CPU stream queue and worker pool, and the shim's channel. They run on
//! the real engine code compiled against loom (`--cfg tributary_loom`, see `src/sync.rs`):
//!
//! ```text
//! RUSTFLAGS="--cfg tributary_loom" CARGO_TARGET_DIR=target-loom \
//!     cargo test --release -p tributary-loom-tests --test loom -- --nocapture
//! ```
//!
//! Each model's doc comment says the rule it guards and the mutant that breaks it; each run
//! prints its preemption bound, interleavings and time (`harness::run_model`).
//! `loom_tests/run.sh` runs the models and the mutation check, and lists every mutant with
//! the models that must catch it. To replay a failure: `LOOM_CHECKPOINT_FILE` +
//! `LOOM_CHECKPOINT_INTERVAL=1` record the failing interleaving, then `LOOM_LOG=trace
//! LOOM_LOCATION=1` replays it with a trace (loom's documentation).
#![cfg(tributary_loom)]

mod actor_world;
mod actors;
mod channel;
mod event;
mod harness;
mod protocol;
mod queue;
mod world;
