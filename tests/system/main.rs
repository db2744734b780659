//! The system suite: the actor system (`System`, the actors' messages) driven as a host
//! application would, in one test binary (`cargo test --test system`; a test's path is
//! `<module>::<name>`).
//!
//! - `system_e2e`: end-to-end tests through `System`, on every backend;
//! - `system_replay`: captured steps replayed through `System`;
//! - `auto_replay`: repeated calls recognised and replayed by `System` without a capture;
//! - `system_threads`: `System` under several host threads at once;
//! - `actor_messages`: the actors' messages sent directly, as a host running its own actix;
//! - `decisions`: the device actors' decisions (`tributary::dispatch`) driven by hand;
//! - `data_parallel`: the data-parallel model (`tributary_testkit::model`) on every backend;
//! - `trace`: the Chrome traces of stream timelines;
//! - `bindings`: routines with bindings, through `Engine` and `System`.
//!
//! Shared support is the `tributary-testkit` crate (`testkit/`).

mod actor_messages;
mod auto_replay;
mod bindings;
mod data_parallel;
mod decisions;
mod system_e2e;
mod system_replay;
mod system_threads;
mod trace;
