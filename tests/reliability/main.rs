//! The reliability suite (DESIGN.md §7), in one test binary (`cargo test --test
//! reliability`; a test's path is `<module>::<name>`): random programs against the
//! sequential reference (`reliability_programs`), determinism (`reliability_determinism`),
//! faults (`reliability_faults`), bad input (`reliability_bad_input`) and a soak
//! (`reliability_soak`).
//!
//! Their programs, reference, generator, graph checker and runners are
//! `tributary_testkit::common`; the bad-input table's APIs `tributary_testkit::bad_input`.

mod reliability_bad_input;
mod reliability_determinism;
mod reliability_faults;
mod reliability_programs;
mod reliability_soak;
