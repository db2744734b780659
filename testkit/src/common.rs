//! Shared code of the reliability tests (DESIGN.md §1: "randomized programs compared
//! against a sequential reference"): programs, the reference, the generator, runners.

pub mod engine_runner;
pub mod generator;
pub mod graph;
pub mod program;
pub mod reference;
pub mod steps;
pub mod system_runner;
pub mod watchdog;

/// A count from the environment variable `var`, or `default`.
pub fn env_count(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}
