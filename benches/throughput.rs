//! Schedule throughput of tiny routines through the full actor path, on 1 and 4 streams
//! and over devices x streams from 1x1 to 8x4, beside a raw crossbeam worker thread
//! running the same closures.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use criterion::{Criterion, Throughput};
use tributary::{kernels, DType, MemoryMode, TensorNode};
use tributary_actors::{RoutineHandle, StreamConfig, System};

/// `devices x streams` tiny routines (fill of one element), one per stream.
fn setup(devices: usize, streams: usize) -> (System, Vec<RoutineHandle>) {
    let sys = System::builder()
        .cpu_devices(devices)
        .streams(StreamConfig::MostParallelStreams(streams))
        .mailbox_capacity(1 << 16)
        .spawn()
        .expect("spawn");
    let mut routines = Vec::new();
    for d in 0..devices {
        for s in 0..streams {
            let x = TensorNode::new("x", DType::F32, [1])
                .with_mode(MemoryMode::on_device())
                .expect("mode");
            let ctx = sys.context(d, s).expect("ctx");
            routines.push(
                ctx.link(kernels::fill(&x, 1.0).expect("spec"))
                    .expect("link"),
            );
        }
    }
    (sys, routines)
}

/// Schedules `iters` routines round-robin over `routines` and waits for all of them.
fn run(routines: &[RoutineHandle], iters: u64) -> Duration {
    let start = Instant::now();
    let mut last = Vec::with_capacity(routines.len());
    for i in 0..iters {
        let t = routines[(i as usize) % routines.len()]
            .schedule()
            .expect("schedule");
        if i + routines.len() as u64 >= iters {
            last.push(t);
        }
    }
    for t in last {
        t.wait().expect("wait");
    }
    start.elapsed()
}

/// The raw baseline: one crossbeam-fed worker thread per stream running the same work
/// (fill one element) and publishing completion through an atomic counter.
fn raw(workers: usize, iters: u64) -> Duration {
    type Job = Box<dyn FnOnce() + Send>;
    let done = Arc::new(AtomicU64::new(0));
    let mut txs = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..workers {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        txs.push(tx);
        handles.push(std::thread::spawn(move || {
            while let Ok(job) = rx.recv() {
                job();
            }
        }));
    }
    let cells: Vec<Arc<std::sync::Mutex<f32>>> = (0..workers)
        .map(|_| Arc::new(std::sync::Mutex::new(0.0)))
        .collect();
    let start = Instant::now();
    for i in 0..iters {
        let w = (i as usize) % workers;
        let (cell, done) = (cells[w].clone(), done.clone());
        let _ = txs[w].send(Box::new(move || {
            *cell.lock().unwrap_or_else(|p| p.into_inner()) = 1.0;
            done.fetch_add(1, Ordering::Release);
        }));
    }
    while done.load(Ordering::Acquire) < iters {
        std::hint::spin_loop();
    }
    let elapsed = start.elapsed();
    drop(txs);
    for h in handles {
        let _ = h.join();
    }
    elapsed
}

/// Registers this module's benchmarks.
pub fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("throughput");
    g.throughput(Throughput::Elements(1));
    for streams in [1, 4] {
        let (sys, routines) = setup(1, streams);
        g.bench_function(format!("actor_path/1x{streams}"), |b| {
            b.iter_custom(|iters| run(&routines, iters))
        });
        g.bench_function(format!("raw_crossbeam/{streams}"), |b| {
            b.iter_custom(|iters| raw(streams, iters))
        });
        let _ = sys.shutdown();
    }
    g.finish();

    let mut g = c.benchmark_group("scaling");
    g.throughput(Throughput::Elements(1));
    for (devices, streams) in [(1, 1), (2, 2), (4, 4), (8, 4)] {
        let (sys, routines) = setup(devices, streams);
        g.bench_function(format!("actor_path/{devices}x{streams}"), |b| {
            b.iter_custom(|iters| run(&routines, iters))
        });
        g.bench_function(format!("raw_crossbeam/{}", devices * streams), |b| {
            b.iter_custom(|iters| raw(devices * streams, iters))
        });
        let _ = sys.shutdown();
    }
    g.finish();
}
