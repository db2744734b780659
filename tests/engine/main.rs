//! The engine suite: the single-owner `Engine` and what it rests on, in one test binary
//! (`cargo test --test engine`; a test's path is `<module>::<name>`).
//!
//! - `engine_protocol`: the synchronisation protocol through `Engine`, on every backend;
//! - `engine_replay`: captured steps replayed, each invalidation;
//! - `replay_backends`: replays on every backend compute what issuing computes (and what
//!   Vulkan records once and resubmits);
//! - `kernels_cpu`: the CPU backend's built-in kernels;
//! - `cpu_pool`: the CPU backend's worker pool seen from the public API;
//! - `pool_props`: the memory pools' properties (proptest);
//! - `event_timeline`: events and timelines, blocking and async waits;
//! - `compile_fail`: what user code cannot do (trybuild cases in `compile_fail/`).
//!
//! Shared support is the `tributary-testkit` crate (`testkit/`).

mod compile_fail;
mod cpu_pool;
mod engine_protocol;
mod engine_replay;
mod event_timeline;
mod kernels_cpu;
mod pool_props;
mod replay_backends;
