//! How the cost of scheduling grows: with the number of inputs/outputs of a routine, and
//! with the number of operations already completed (it must not). Engine level (no actor
//! hop), so the protocol's own cost is what is measured; the baseline is the same loop
//! running the routine's closure directly on the calling thread.

use std::time::{Duration, Instant};

use criterion::Criterion;
use tributary::{
    kernels::{Access, RoutineSpec},
    DType, Engine, EngineConfig, MemoryMode, TensorNode,
};

fn routine(engine: &mut Engine, params: usize) -> tributary::protocol::Routine {
    let nodes: Vec<(TensorNode, Access)> = (0..params)
        .map(|i| {
            // Zeroed: the routine reads parameters nothing writes (only their count matters).
            let n = TensorNode::new_zeroed(format!("p{i}"), DType::F32, [4])
                .with_mode(MemoryMode::on_device())
                .expect("mode");
            (n, if i == 0 { Access::Write } else { Access::Read })
        })
        .collect();
    let spec = RoutineSpec::custom("noop", nodes, None, |_| Ok(())).expect("spec");
    let ctx = engine.context(0, 0).expect("ctx");
    engine.link(&ctx, spec).expect("link")
}

fn run(engine: &mut Engine, r: &tributary::protocol::Routine, iters: u64) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        engine.schedule(r).expect("schedule");
    }
    engine.sync_all().expect("sync");
    start.elapsed()
}

/// Registers this module's benchmarks.
pub fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("overhead");
    for params in [1usize, 4, 16] {
        let mut engine = Engine::cpu(EngineConfig {
            devices: 1,
            streams_per_device: 1,
            ..Default::default()
        })
        .expect("engine");
        let r = routine(&mut engine, params);
        g.bench_function(format!("engine_schedule/{params}_params"), |b| {
            b.iter_custom(|iters| run(&mut engine, &r, iters))
        });
        if params == 4 {
            // The same routine after a million completed operations.
            run(&mut engine, &r, 1_000_000);
            g.bench_function("engine_schedule/4_params_after_1M_completed", |b| {
                b.iter_custom(|iters| run(&mut engine, &r, iters))
            });
        }
    }
    g.bench_function("direct_call", |b| {
        let f = |x: &mut [f32]| x[0] += 1.0;
        let mut v = vec![0.0f32; 4];
        b.iter(|| f(std::hint::black_box(&mut v)))
    });
    g.finish();
}
