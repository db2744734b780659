//! Criterion benchmarks, each beside a raw baseline measured in the same run.
//!
//! `cargo bench --bench main` runs them all; `python3 benches/ratios.py` then prints the
//! ratio of every measurement to its baseline from criterion's estimates. Results and
//! their discussion are in `BENCHMARKS.md`.

use criterion::{criterion_group, criterion_main};

mod bindings;
mod copy;
mod latency;
mod overhead;
mod slab;
mod throughput;
mod tracing_cost;

criterion_group! {
    name = benches;
    config = criterion::Criterion::default()
        .sample_size(20)
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets =
        throughput::bench,
        latency::bench,
        slab::bench,
        copy::bench,
        tracing_cost::bench,
        overhead::bench,
        bindings::bench,
}
criterion_main!(benches);
