//! What a routine costs issued and replayed, beside a careful hand-written worker: wall time
//! and CPU time (every thread of the process) per routine, on one CPU device and stream.
//!
//! ```sh
//! cargo run --release --example replay_cost              # 200,000 routines, 5 runs a row
//! cargo run --release --example replay_cost -- 1000000 9
//! ```
//!
//! A routine is a CPU closure writing one `i32`, back to back on one stream; a replay
//! issues a captured step of 64 of them. The baseline is what a user would write instead:
//! one persistent worker thread fed through a bounded crossbeam channel of indices (nothing
//! allocated per routine), spinning on the channel as the runtime's workers spin, and a
//! completion counter the host spins on. Each row runs `runs` times after a warm-up run;
//! the median of the wall times and of the CPU times is printed, and the ratio of the wall
//! time to the baseline's.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tributary::{
    kernels::{Access, RoutineSpec},
    DType, Engine, EngineConfig, MemoryMode, TensorNode,
};
use tributary_actors::{StreamConfig, System};
use tributary_testkit::cpu_time::process_cpu_time;

/// Routines a captured step holds.
const STEP: u64 = 64;

fn spec() -> tributary::Result<RoutineSpec> {
    let y = TensorNode::new("y", DType::I32, [1]).with_mode(MemoryMode::on_device())?;
    RoutineSpec::custom("write", vec![(y, Access::Write)], None, |a| {
        a.output::<i32>(0).map_err(|e| e.to_string())?[0] = 1;
        Ok(())
    })
}

/// One measured run: wall time and process CPU time.
type Sample = (Duration, Duration);

/// Medians (wall, CPU) per routine in ns over `runs` runs of `run(n)`, after a warm-up.
fn measure(
    n: u64,
    runs: usize,
    mut run: impl FnMut(u64) -> tributary::Result<()>,
) -> tributary::Result<(f64, f64)> {
    run(n)?;
    let mut samples: Vec<Sample> = Vec::new();
    for _ in 0..runs {
        let cpu0 = process_cpu_time().unwrap_or_default();
        let start = Instant::now();
        run(n)?;
        let wall = start.elapsed();
        let cpu = process_cpu_time().unwrap_or_default().saturating_sub(cpu0);
        samples.push((wall, cpu));
    }
    let per = |d: Duration| d.as_nanos() as f64 / n as f64;
    let mut walls: Vec<f64> = samples.iter().map(|s| per(s.0)).collect();
    let mut cpus: Vec<f64> = samples.iter().map(|s| per(s.1)).collect();
    walls.sort_by(f64::total_cmp);
    cpus.sort_by(f64::total_cmp);
    Ok((walls[walls.len() / 2], cpus[cpus.len() / 2]))
}

/// The baseline's worker: it takes routine indices from a bounded channel, spinning on it,
/// writes the cell and counts the routine done.
struct Worker {
    tx: crossbeam_channel::Sender<u64>,
    done: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    fn start() -> Worker {
        let (tx, rx) = crossbeam_channel::bounded::<u64>(1 << 16);
        let done = Arc::new(AtomicU64::new(0));
        let counter = done.clone();
        let thread = std::thread::spawn(move || {
            let mut cell = [0i32; 1];
            loop {
                match rx.try_recv() {
                    Ok(i) => {
                        cell[0] = std::hint::black_box(i as i32 | 1);
                        counter.fetch_add(1, Ordering::Release);
                    }
                    Err(crossbeam_channel::TryRecvError::Empty) => std::hint::spin_loop(),
                    Err(crossbeam_channel::TryRecvError::Disconnected) => break,
                }
            }
            std::hint::black_box(cell);
        });
        Worker {
            tx,
            done,
            thread: Some(thread),
        }
    }

    fn run(&self, n: u64) -> tributary::Result<()> {
        let target = self.done.load(Ordering::Acquire) + n;
        for i in 0..n {
            let _ = self.tx.send(i);
        }
        while self.done.load(Ordering::Acquire) < target {
            std::hint::spin_loop();
        }
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let (tx, _) = crossbeam_channel::bounded(1);
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn main() -> tributary::Result<()> {
    let mut args = std::env::args().skip(1);
    let first = args.next();
    if matches!(first.as_deref(), Some("--help" | "-h")) {
        println!("usage: replay_cost [ROUTINES [RUNS]]  (default 200000 routines, 5 runs a row)");
        return Ok(());
    }
    let parse = |a: Option<String>, default: u64, what: &str| -> tributary::Result<u64> {
        match a {
            None => Ok(default),
            Some(a) => a.parse().map_err(|_| tributary::Error::InvalidConfig {
                setting: what.into(),
                value: a.clone(),
                reason: "a positive count".into(),
            }),
        }
    };
    let n = parse(first, 200_000, "ROUTINES")?.max(STEP) / STEP * STEP;
    let runs = parse(args.next(), 5, "RUNS")?.max(1) as usize;

    let worker = Worker::start();
    let baseline = measure(n, runs, |k| worker.run(k))?;
    drop(worker);

    let mut e = Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: 1,
        ..EngineConfig::default()
    })?;
    let ctx = e.context(0, 0)?;
    let r = e.link(&ctx, spec()?)?;
    let engine_issuing = measure(n, runs, |k| {
        for _ in 0..k {
            e.schedule(&r)?;
        }
        e.sync_all()
    })?;
    let step = e.capture(|c| {
        for _ in 0..STEP {
            c.schedule(&r)?;
        }
        Ok(())
    })?;
    let engine_replaying = measure(n, runs, |k| {
        for _ in 0..k / STEP {
            e.replay(&step)?;
        }
        e.sync_all()
    })?;
    drop(e);

    let sys = System::builder()
        .cpu_devices(1)
        .streams(StreamConfig::MostParallelStreams(1))
        .mailbox_capacity(1 << 16)
        .spawn()?;
    let ctx = sys.context(0, 0)?;
    let routine = ctx.link(spec()?)?.routine().clone();
    let system_issuing = measure(n, runs, |k| {
        for _ in 0..k {
            sys.schedule(&routine)?;
        }
        sys.sync()
    })?;
    let step = sys.capture(|c| {
        for _ in 0..STEP {
            c.schedule(&routine)?;
        }
        Ok(())
    })?;
    let system_replaying = measure(n, runs, |k| {
        for _ in 0..k / STEP {
            sys.replay(&step)?;
        }
        sys.sync()
    })?;
    sys.shutdown()?;

    println!(
        "per routine, {n} routines a run, median of {runs} runs (1 CPU device, 1 stream; \
         replays of a captured step of {STEP})"
    );
    println!("| runner | wall ns | CPU ns (all threads) | wall / baseline |");
    println!("|---|---:|---:|---:|");
    let row = |name: &str, (wall, cpu): (f64, f64)| {
        println!(
            "| {name} | {wall:.0} | {cpu:.0} | {:.2}x |",
            wall / baseline.0.max(f64::MIN_POSITIVE)
        );
    };
    row("hand-written worker (baseline)", baseline);
    row("`Engine`, issuing", engine_issuing);
    row("`Engine`, replaying", engine_replaying);
    row("`System`, issuing", system_issuing);
    row("`System`, replaying", system_replaying);
    Ok(())
}
