//! `run_model`: every model goes through it, so that each one has a name, an explicit
//! preemption bound, and reports how many interleavings it explored and how long it took.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc as StdArc,
    },
    time::Instant,
};

use loom::model::Builder;
use tracing_subscriber::{fmt, util::SubscriberInitExt, EnvFilter};

/// A model builder with preemption bound `bound` (`None`: exhaustive, for the small
/// two-thread models).
///
/// The environment still wins, as in plain `loom::model`: `LOOM_MAX_PREEMPTIONS` overrides
/// the bound (for a deeper run by hand), `LOOM_MAX_BRANCHES` the branch limit (10 000 here:
/// the protocol models issue a few dozen synchronisation operations per thread), and
/// `LOOM_CHECKPOINT_FILE`, `LOOM_CHECKPOINT_INTERVAL`, `LOOM_LOG`, `LOOM_LOCATION` work
/// as loom documents them (see the crate documentation of `loom_tests/main.rs`).
pub fn builder(bound: Option<usize>) -> Builder {
    let mut b = Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        b.preemption_bound = bound;
    }
    if std::env::var_os("LOOM_MAX_BRANCHES").is_none() {
        b.max_branches = 10_000;
    }
    b
}

/// [`builder`] for a model that explores only an explicit window (`loom::explore` ..
/// `loom::stop_exploring`; see `World::begin_window`).
pub fn windowed(bound: Option<usize>) -> Builder {
    let mut b = builder(bound);
    b.expect_explicit_explore = true;
    b
}

/// Explores every interleaving of `f` allowed by `builder` and prints a one-line summary
/// (`--nocapture` shows it): the model's name, its bound, the number of interleavings
/// and the time taken.
pub fn run_model<F>(name: &str, builder: Builder, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    // `loom::model` installs this subscriber for `LOOM_LOG`; `Builder::check` does not.
    let _log = fmt::Subscriber::builder()
        .with_env_filter(EnvFilter::from_env("LOOM_LOG"))
        .with_test_writer()
        .without_time()
        .finish()
        .set_default();
    let iterations = StdArc::new(AtomicUsize::new(0));
    let counter = StdArc::clone(&iterations);
    let bound = builder.preemption_bound;
    let start = Instant::now();
    builder.check(move || {
        // Relaxed: a statistic read after `check` returns, on this thread.
        counter.fetch_add(1, Ordering::Relaxed);
        f();
    });
    println!(
        "loom model {name}: preemption bound {}, {} interleavings, {:.2?}",
        bound.map_or_else(|| "none".to_string(), |b| b.to_string()),
        // Relaxed: see above.
        iterations.load(Ordering::Relaxed),
        start.elapsed()
    );
}
