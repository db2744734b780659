//! Schedule-to-completion latency of one empty routine on an idle system (alone, behind a
//! cross-stream dependency, behind a cross-device dependency), beside a raw two-thread
//! handoff over crossbeam channels.

use std::time::{Duration, Instant};

use criterion::Criterion;
use tributary::{kernels, DType, MemoryMode, MergeBufferUse, Sharing, TensorNode};
use tributary_actors::{StreamConfig, System};

fn node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [1])
        .with_mode(mode)
        .expect("mode")
}

/// Registers this module's benchmarks.
pub fn bench(c: &mut Criterion) {
    let sys = System::builder()
        .cpu_devices(2)
        .streams(StreamConfig::MostParallelStreams(2))
        .spawn()
        .expect("spawn");
    let mut g = c.benchmark_group("latency");

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
    g.bench_function("raw_handoff_parked", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                std::thread::sleep(Duration::from_micros(200));
                let start = Instant::now();
                let _ = tx.send(1.0);
                let _ = back_rx.recv();
                total += start.elapsed();
            }
            total
        })
    });
    g.finish();
    drop(tx);
    let _ = worker.join();
    let _ = sys.shutdown();
}
