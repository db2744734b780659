//! loom models of tributary's synchronisation: the event timeline, the protocol driving
//! real streams, the CPU stream queue and worker pool, and the shim's channel. They run on
//! the real engine code compiled against loom (`--cfg tributary_loom`, see `src/sync.rs`):
//!
//! ```text
//! RUSTFLAGS="--cfg tributary_loom" CARGO_TARGET_DIR=target-loom \
//!     cargo test --release --test loom -- --nocapture
//! ```
//!
//! `loom_tests/README.md` lists every model (the rule it guards, threads, preemption
//! bound, time, the mutants it catches) and how to replay a failure:
//! `LOOM_CHECKPOINT_FILE` + `LOOM_CHECKPOINT_INTERVAL=1` to record the failing
//! interleaving, then `LOOM_LOG=trace LOOM_LOCATION=1` to replay it with a trace.
//! `loom_tests/run.sh` runs the models and the mutation check.
#![cfg(tributary_loom)]

mod actor_world;
mod actors;
mod channel;
mod event;
mod harness;
mod protocol;
mod queue;
mod world;
