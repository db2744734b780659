//! Schedule-to-completion latency of one small routine, beside a raw two-thread handoff
//! over crossbeam channels measured the same way:
//!
//! - `engine_hot` / `system_hot`: through `Engine` and through `System` (one CPU device,
//!   one stream), back to back, so the workers and the waiting host thread are spinning;
//!   `raw_handoff` hands a job to a persistent worker thread and waits for the reply;
//! - `engine_idle` / `system_idle` / `raw_handoff_idle`: the same, each operation after a
//!   sleep of [`IDLE_GAP`] (longer than every spin window, so every thread has parked);
//! - `system_hot_actor_thread` / `system_idle_actor_thread`: `System` with
//!   `decide_on_posting_thread(false)`, every decision on the device actor's thread (the
//!   shape before it: a wake-up of the actor per call into an idle device);
//! - `system_hot_auto_replay` / `system_idle_auto_replay`: `System` with its automatic replay
//!   on: the one call repeats, so it is learned and its segments replayed, but each wait
//!   on a held call issues it (a segment's first call: one in `MIN_PERIOD`), the others
//!   are issued as they come;
//! - `actor_path/*`: through `System` on 2 devices × 2 streams: alone, behind a
//!   cross-stream dependency, behind a cross-device copy, behind a copy against device
//!   order (from device 1 to device 0: the destination's half blocks on the source's
//!   verdict), and a whole 4 KiB all-reduce over the two devices; the `*_idle` ones after
//!   the same sleep as above (compare them with `raw_handoff_idle`).

use std::time::{Duration, Instant};

use criterion::{BenchmarkGroup, Criterion};
use tributary::{
    collective::{ReduceOp, Strategy, Transfer},
    kernels, DType, Engine, EngineConfig, MemoryMode, MergeBufferUse, Sharing, TensorNode,
};
use tributary_actors::{AllReducePlan, StreamConfig, System};

/// The pause before each operation of an `*_idle` measurement: far longer than the spin
/// windows (50 µs for the CPU workers and for a waiting host thread; crossbeam's are
/// shorter), so that every thread involved is parked when the operation starts.
const IDLE_GAP: Duration = Duration::from_micros(500);

/// Times `op` `iters` times, each after `IDLE_GAP` of sleep (the sleep is not timed).
fn idle(iters: u64, mut op: impl FnMut()) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        std::thread::sleep(IDLE_GAP);
        let start = Instant::now();
        op();
        total += start.elapsed();
    }
    total
}

/// `engine_hot`, `engine_idle`: one `fill` of one element through an `Engine` on one CPU
/// device with one stream, from `schedule` to the return of the event's `wait`.
fn engine(g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    let mut engine = Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: 1,
        ..EngineConfig::default()
    })
    .expect("engine");
    let x = node("x", MemoryMode::on_device());
    let ctx = engine.context(0, 0).expect("ctx");
    let r = engine
        .link(&ctx, kernels::fill(&x, 1.0).expect("spec"))
        .expect("link");
    g.bench_function("engine_hot", |b| {
        b.iter(|| engine.schedule(&r).expect("schedule").wait().expect("wait"))
    });
    g.bench_function("engine_idle", |b| {
        b.iter_custom(|iters| {
            idle(iters, || {
                engine.schedule(&r).expect("schedule").wait().expect("wait")
            })
        })
    });
}

/// `system_hot`, `system_idle`: the same routine through a `System` on one CPU device
/// with one stream, from `schedule` to the return of the ticket's `wait`; with the
/// `_actor_thread` suffix when decisions are not made on the posting thread.
fn system(
    g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    on_posting_thread: bool,
    auto_replay: bool,
) {
    let suffix = match (on_posting_thread, auto_replay) {
        (_, true) => "_auto_replay",
        (true, false) => "",
        (false, false) => "_actor_thread",
    };
    let sys = System::builder()
        .cpu_devices(1)
        .streams(StreamConfig::OnlyDevicesParallel)
        .decide_on_posting_thread(on_posting_thread)
        .auto_replay(auto_replay)
        .spawn()
        .expect("spawn");
    let x = node("x", MemoryMode::on_device());
    let r = sys
        .context(0, 0)
        .expect("ctx")
        .link(kernels::fill(&x, 1.0).expect("spec"))
        .expect("link");
    g.bench_function(format!("system_hot{suffix}"), |b| {
        b.iter(|| r.schedule().expect("schedule").wait().expect("wait"))
    });
    g.bench_function(format!("system_idle{suffix}"), |b| {
        b.iter_custom(|iters| {
            idle(iters, || {
                r.schedule().expect("schedule").wait().expect("wait")
            })
        })
    });
    let _ = sys.shutdown();
}

fn node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [1])
        .with_mode(mode)
        .expect("mode")
}

/// Registers this module's benchmarks.
pub fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("latency");
    engine(&mut g);
    system(&mut g, true, false);
    system(&mut g, false, false);
    system(&mut g, true, true);
    let sys = System::builder()
        .cpu_devices(2)
        .streams(StreamConfig::MostParallelStreams(2))
        .spawn()
        .expect("spawn");

    // One routine, alone.
    let x = node("x", MemoryMode::on_device());
    let a = sys.context(0, 0).expect("ctx");
    let r = a.link(kernels::fill(&x, 1.0).expect("spec")).expect("link");
    g.bench_function("actor_path/single", |b| {
        b.iter(|| r.schedule().expect("schedule").wait().expect("wait"))
    });

    // Cross-stream: a writer on stream 0, a reader of the shared node on stream 1.
    let s = node("s", MemoryMode::OnDevice(Sharing::SharedCrossStreams));
    let y = node("y", MemoryMode::on_device());
    let w = a.link(kernels::fill(&s, 1.0).expect("spec")).expect("link");
    let rd = sys
        .context(0, 1)
        .expect("ctx")
        .link(kernels::copy(&y, &s).expect("spec"))
        .expect("link");
    g.bench_function("actor_path/cross_stream", |b| {
        b.iter(|| {
            w.schedule().expect("schedule");
            rd.schedule().expect("schedule").wait().expect("wait")
        })
    });
    g.bench_function("actor_path/cross_stream_idle", |b| {
        b.iter_custom(|iters| {
            idle(iters, || {
                w.schedule().expect("schedule");
                rd.schedule().expect("schedule").wait().expect("wait");
            })
        })
    });

    // Cross-device: a writer on device 0, a copy to device 1, a reader there.
    let z = node("z", MemoryMode::on_device());
    let w0 = a.link(kernels::fill(&z, 1.0).expect("spec")).expect("link");
    let c1 = sys.context(1, 0).expect("ctx");
    let z1 = c1
        .link(kernels::fill(&z, 0.0).expect("spec"))
        .expect("link");
    let y1 = node("y1", MemoryMode::on_device());
    let r1 = z1
        .context()
        .link(kernels::copy(&y1, &z).expect("spec"))
        .expect("link");
    g.bench_function("actor_path/cross_device", |b| {
        b.iter(|| {
            w0.schedule().expect("schedule");
            sys.device_to_device(&z, &w0.context(), &z1.context(), MergeBufferUse::No)
                .expect("copy");
            r1.schedule().expect("schedule").wait().expect("wait")
        })
    });
    g.bench_function("actor_path/cross_device_idle", |b| {
        b.iter_custom(|iters| {
            idle(iters, || {
                w0.schedule().expect("schedule");
                sys.device_to_device(&z, &w0.context(), &z1.context(), MergeBufferUse::No)
                    .expect("copy");
                r1.schedule().expect("schedule").wait().expect("wait");
            })
        })
    });

    // The same copy against device order (device 1 to device 0): the destination's half
    // is reached before the source's verdict, so it blocks; the post decides it again in
    // its next round (no wake-up of device 0's actor).
    let v = node("v", MemoryMode::on_device());
    let w1 = z1
        .context()
        .link(kernels::fill(&v, 1.0).expect("spec"))
        .expect("link");
    let v0 = a.link(kernels::fill(&v, 0.0).expect("spec")).expect("link");
    let y0 = node("y0", MemoryMode::on_device());
    let r0 = v0
        .context()
        .link(kernels::copy(&y0, &v).expect("spec"))
        .expect("link");
    let against_order = || {
        w1.schedule().expect("schedule");
        sys.device_to_device(&v, &w1.context(), &v0.context(), MergeBufferUse::No)
            .expect("copy");
        r0.schedule().expect("schedule").wait().expect("wait")
    };
    g.bench_function("actor_path/copy_against_device_order", |b| {
        b.iter(against_order)
    });
    g.bench_function("actor_path/copy_against_device_order_idle", |b| {
        b.iter_custom(|iters| idle(iters, &against_order))
    });

    // An all-reduce of one 4 KiB node over the two devices (tree: one merge into device
    // 0, one copy back), every step in one post; until every final event is done.
    let g4 = TensorNode::new("g4", DType::F32, [1024])
        .with_mode(MemoryMode::on_device())
        .expect("mode");
    let replicas: Vec<_> = [0, 1]
        .into_iter()
        .map(|d| {
            let r = sys
                .context(d, 0)
                .expect("ctx")
                .link(kernels::fill(&g4, 1.0).expect("spec"))
                .expect("link");
            r.schedule().expect("schedule");
            r
        })
        .collect();
    let plan = AllReducePlan::new(
        &sys,
        std::slice::from_ref(&g4),
        &replicas,
        ReduceOp::Sum,
        Strategy::Tree,
        Transfer::Auto,
    )
    .expect("plan");
    let all_reduce = || {
        for t in plan.run().expect("all-reduce") {
            t.wait().expect("wait");
        }
    };
    g.bench_function("actor_path/all_reduce_4KiB", |b| b.iter(all_reduce));
    g.bench_function("actor_path/all_reduce_4KiB_idle", |b| {
        b.iter_custom(|iters| idle(iters, all_reduce))
    });

    // Raw baseline: hand a job to a worker thread and wait for its reply.
    let (tx, rx) = crossbeam_channel::bounded::<f32>(1);
    let (back_tx, back_rx) = crossbeam_channel::bounded::<f32>(1);
    let worker = std::thread::spawn(move || {
        while let Ok(v) = rx.recv() {
            if back_tx.send(v + 1.0).is_err() {
                break;
            }
        }
    });
    g.bench_function("raw_handoff", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let _ = tx.send(1.0);
                let _ = back_rx.recv();
            }
            start.elapsed()
        })
    });
    // A parked (futex) handoff: what an idle worker costs to wake.
    g.bench_function("raw_handoff_idle", |b| {
        b.iter_custom(|iters| {
            idle(iters, || {
                let _ = tx.send(1.0);
                let _ = back_rx.recv();
            })
        })
    });
    g.finish();
    drop(tx);
    let _ = worker.join();
    let _ = sys.shutdown();
}
