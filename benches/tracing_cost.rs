//! What the structured `tracing` calls on the hot path cost with no subscriber installed:
//! a span entered plus an event per operation, beside the same loop without them.

use std::hint::black_box;

use criterion::Criterion;

/// Registers this module's benchmarks.
pub fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("tracing");
    g.bench_function("span_and_event_no_subscriber", |b| {
        b.iter(|| {
            let span =
                tracing::trace_span!("schedule", device = 0u32, stream = 1u32, routine = "fill");
            let _e = span.enter();
            tracing::trace!(seq = black_box(7u64), "scheduled");
            black_box(&span);
        })
    });
    g.bench_function("baseline_no_tracing", |b| {
        b.iter(|| {
            black_box(7u64);
        })
    });
    g.finish();
}
