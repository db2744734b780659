//! What per-schedule bindings cost: scheduling a routine that reads an index given by each
//! schedule, against what a user wrote before bindings existed (the Task Bench port did):
//! the same routine scheduled without values, its closure counting its own runs with an
//! atomic to know its step. Engine level (no actor hop), so the protocol's and the CPU
//! backend's own cost is what is measured, execution included.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use criterion::Criterion;
use tributary::{
    kernels::{Access, RoutineSpec},
    protocol::Routine,
    DType, Engine, EngineConfig, MemoryMode, TensorNode,
};

/// A routine writing its step into one element: from its indices (`indices` of them, the
/// step is the first) or, with none, from a run counter.
fn routine(engine: &mut Engine, indices: usize) -> Routine {
    let y = TensorNode::new("y", DType::I32, [1])
        .with_mode(MemoryMode::on_device())
        .expect("mode");
    let runs = AtomicU64::new(0);
    let mut spec = RoutineSpec::custom("step", vec![(y, Access::Write)], None, move |a| {
        let step = if indices == 0 {
            runs.fetch_add(1, Ordering::Relaxed) as i64
        } else {
            a.index("i0")?
        };
        a.output::<i32>(0)?[0] = step as i32;
        Ok(())
    })
    .expect("spec");
    for i in 0..indices {
        spec = spec.with_index(&format!("i{i}")).expect("index");
    }
    let ctx = engine.context(0, 0).expect("ctx");
    engine.link(&ctx, spec).expect("link")
}

fn engine() -> Engine {
    Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: 1,
        ..Default::default()
    })
    .expect("engine")
}

fn timed(engine: &mut Engine, iters: u64, mut schedule: impl FnMut(&mut Engine, i64)) -> Duration {
    let start = Instant::now();
    for step in 0..iters {
        schedule(engine, step as i64);
    }
    engine.sync_all().expect("sync");
    start.elapsed()
}

/// Registers this module's benchmarks.
pub fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("bindings");
    let mut e = engine();
    let counted = routine(&mut e, 0);
    g.bench_function("atomic_counter", |b| {
        b.iter_custom(|iters| {
            timed(&mut e, iters, |e, _| {
                drop(e.schedule(&counted).expect("schedule"))
            })
        })
    });
    let one = routine(&mut e, 1);
    g.bench_function("pairs_1_index", |b| {
        b.iter_custom(|iters| {
            timed(&mut e, iters, |e, step| {
                drop(e.schedule_with(&one, &[("i0", step)]).expect("schedule"))
            })
        })
    });
    let mut bindings = one.bindings();
    g.bench_function("reused_bindings_1_index", |b| {
        b.iter_custom(|iters| {
            timed(&mut e, iters, |e, step| {
                bindings.set("i0", step).expect("set");
                drop(e.schedule_with(&one, &bindings).expect("schedule"))
            })
        })
    });
    let four = routine(&mut e, 4);
    g.bench_function("pairs_4_indices", |b| {
        b.iter_custom(|iters| {
            timed(&mut e, iters, |e, step| {
                let pairs = [("i0", step), ("i1", 1), ("i2", 2), ("i3", 3)];
                drop(e.schedule_with(&four, &pairs).expect("schedule"))
            })
        })
    });
    g.bench_function("atomic_counter_again", |b| {
        b.iter_custom(|iters| {
            timed(&mut e, iters, |e, _| {
                drop(e.schedule(&counted).expect("schedule"))
            })
        })
    });
    g.finish();
}
