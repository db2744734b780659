//! What tributary's test suites and examples share (not published, not an API).
//!
//! - [`support`]: the backend kinds and how to get a backend (or why not), nodes, kernels
//!   that behave alike on every backend, and [`for_each_backend!`];
//! - [`common`]: the reliability suite's programs, sequential reference, generator, graph
//!   checker and runners;
//! - [`bad_input`]: the three ways a host reaches the protocol, for the table of misuses;
//! - [`cluster`]: the MPI launch harness of the cluster suite and [`cluster_test!`];
//! - [`model`]: the data-parallel MLP of `examples/data_parallel` and its tests;
//! - [`cpu_time`]: the CPU time of this process (`examples/idle_cpu.rs`,
//!   `tests/idle_cpu.rs`);
//! - [`alloc_count`]: a global allocator counting heap allocations (`examples/allocations.rs`,
//!   `tests/allocations.rs`).

// Test support, not an API: items carry docs where their names do not say it all (many of
// the reliability programs' fields and variants do not).
#![allow(missing_docs)]

pub mod alloc_count;
pub mod bad_input;
pub mod cluster;
pub mod common;
pub mod cpu_time;
pub mod model;
pub mod support;
