//! What a routine costs issued and replayed, beside a careful hand-written worker: wall time
//! and CPU time (every thread of the process) per routine, on one device and stream.
//!
//! ```sh
//! cargo run --release --example replay_cost              # 200,000 routines, 5 runs a row
//! cargo run --release --example replay_cost -- 1000000 9
//! cargo run --release --example replay_cost -- --step 4          # steps of 4 routines
//! cargo run --release --example replay_cost -- --vulkan 20000 5
//! cargo run --release --example replay_cost -- --cuda 20000 5     # where a GPU is
//! ```
//!
//! A routine is a CPU closure writing one `i32`, back to back on one stream; a replay
//! issues a captured step of 64 of them (`--step K`: of K; a small step shows what a
//! replay costs whole, as a Task Bench timestep's few routines pay it). With `--vulkan` (`--cuda`) the device is a Vulkan
//! (CUDA) device and a routine the built-in `scale_in_place` of 64 `f32` (one compute
//! dispatch, one kernel launch); the CPU time then includes the driver's threads (lavapipe
//! runs the dispatches on CPU threads of the process), and there is no hand-written
//! baseline row. The baseline is what a user would write instead:
//! one persistent worker thread fed through a bounded crossbeam channel of indices (nothing
//! allocated per routine), spinning on the channel as the runtime's workers spin, and a
//! completion counter the host spins on. Each row runs `runs` times after a warm-up run;
//! the median of the wall times and of the CPU times is printed, and the ratio of the wall
//! time to the baseline's. The last row issues the same plain calls as the issuing row to a
//! system with its automatic replay on (`SystemBuilder::auto_replay`).

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tributary::{
    backend::{
        cuda::{CudaBackend, CudaConfig},
        vulkan::{VulkanBackend, VulkanConfig},
        Backend,
    },
    kernels::{self, Access, RoutineSpec},
    memory::PoolConfig,
    protocol::Routine,
    DType, DeviceId, Engine, EngineConfig, MemoryMode, TensorNode,
};
use tributary_actors::{StreamConfig, System};
use tributary_testkit::cpu_time::process_cpu_split;

/// Routines a captured step holds, unless `--step` says otherwise.
const STEP: u64 = 64;

/// The routine (a CPU closure writing one `i32`, or on a GPU `y *= 1` over 64 `f32`), and
/// on a GPU the fill that initialises `y` first.
fn specs(gpu: bool) -> tributary::Result<(Option<RoutineSpec>, RoutineSpec)> {
    if gpu {
        let y = TensorNode::new("y", DType::F32, [64]).with_mode(MemoryMode::on_device())?;
        return Ok((
            Some(kernels::fill(&y, 1.0)?),
            kernels::scale_in_place(&y, 1.0)?,
        ));
    }
    let y = TensorNode::new("y", DType::I32, [1]).with_mode(MemoryMode::on_device())?;
    let write = RoutineSpec::custom("write", vec![(y, Access::Write)], None, |a| {
        a.output::<i32>(0).map_err(|e| e.to_string())?[0] = 1;
        Ok(())
    })?;
    Ok((None, write))
}

/// Where the routines run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Device {
    Cpu,
    Vulkan,
    Cuda,
}

/// One device of a GPU backend (`Arc<dyn Backend>` for the engine and the system alike).
fn gpu_backend(device: Device) -> tributary::Result<Arc<dyn Backend>> {
    Ok(match device {
        Device::Cuda => Arc::new(CudaBackend::new(DeviceId(0), CudaConfig::with_devices(1))?),
        _ => Arc::new(VulkanBackend::new(
            DeviceId(0),
            VulkanConfig::with_devices(1),
        )?),
    })
}

/// Medians per routine in ns: wall time, CPU time of every thread, CPU time of the main
/// thread and the runtime's (the rest is the driver's, on Vulkan).
#[derive(Clone, Copy)]
struct Cost {
    wall: f64,
    cpu: f64,
    runtime_cpu: f64,
}

/// The medians of `runs` runs of `run(n)`, after a warm-up.
fn measure(
    n: u64,
    runs: usize,
    mut run: impl FnMut(u64) -> tributary::Result<()>,
) -> tributary::Result<Cost> {
    run(n)?;
    let (mut walls, mut cpus, mut runtime_cpus) = (Vec::new(), Vec::new(), Vec::new());
    let per = |d: Duration| d.as_nanos() as f64 / n as f64;
    for _ in 0..runs {
        let cpu0 = process_cpu_split().unwrap_or_default();
        let start = Instant::now();
        run(n)?;
        let wall = start.elapsed();
        let cpu1 = process_cpu_split().unwrap_or_default();
        let runtime = cpu1.runtime.saturating_sub(cpu0.runtime);
        walls.push(per(wall));
        cpus.push(per(runtime + cpu1.other.saturating_sub(cpu0.other)));
        runtime_cpus.push(per(runtime));
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok(Cost {
        wall: median(walls),
        cpu: median(cpus),
        runtime_cpu: median(runtime_cpus),
    })
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

/// A system of one device of `device`'s kind, one stream, its automatic replay on if `auto`,
/// and the measured routine linked there (after its initialising fill on a GPU).
fn system_routine(device: Device, auto: bool) -> tributary::Result<(System, Routine)> {
    let mut builder = System::builder()
        .cpu_devices(1)
        .streams(StreamConfig::MostParallelStreams(1))
        .mailbox_capacity(1 << 16)
        .auto_replay(auto);
    if device != Device::Cpu {
        builder = builder.backend_instance(gpu_backend(device)?);
    }
    let sys = builder.spawn()?;
    let mut ctx = sys.context(0, 0)?;
    let (init, spec) = specs(device != Device::Cpu)?;
    if let Some(init) = init {
        let init = ctx.link(init)?;
        init.schedule()?;
        ctx = init.context();
    }
    let routine = ctx.link(spec)?.routine().clone();
    Ok((sys, routine))
}

fn main() -> tributary::Result<()> {
    let mut args = std::env::args().skip(1).peekable();
    let device = match args
        .next_if(|a| a == "--vulkan" || a == "--cuda")
        .as_deref()
    {
        Some("--vulkan") => Device::Vulkan,
        Some(_) => Device::Cuda,
        None => Device::Cpu,
    };
    let gpu = device != Device::Cpu;
    let step_len = match args.next_if(|a| a == "--step") {
        None => STEP,
        Some(_) => match args.next().map(|a| a.parse::<u64>()) {
            Some(Ok(k)) if k > 0 => k,
            other => {
                return Err(tributary::Error::InvalidConfig {
                    setting: "--step".into(),
                    value: format!("{other:?}"),
                    reason: "a positive count of routines per captured step".into(),
                })
            }
        },
    };
    let first = args.next();
    if matches!(first.as_deref(), Some("--help" | "-h")) {
        println!(
            "usage: replay_cost [--vulkan|--cuda] [--step K] [ROUTINES [RUNS]]  (default 200000 routines, 5 runs \
             a row)"
        );
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
    let n = parse(first, 200_000, "ROUTINES")?.max(step_len) / step_len * step_len;
    let runs = parse(args.next(), 5, "RUNS")?.max(1) as usize;

    let baseline = if gpu {
        None
    } else {
        let worker = Worker::start();
        Some(measure(n, runs, |k| worker.run(k))?)
    };

    let mut e = if gpu {
        Engine::with_backend(gpu_backend(device)?, 1, PoolConfig::default())?
    } else {
        Engine::cpu(EngineConfig {
            devices: 1,
            streams_per_device: 1,
            ..EngineConfig::default()
        })?
    };
    let mut ctx = e.context(0, 0)?;
    let (init, spec) = specs(gpu)?;
    if let Some(init) = init {
        let init = e.link(&ctx, init)?;
        e.schedule(&init)?;
        ctx = init.context().clone();
    }
    let r = e.link(&ctx, spec)?;
    let engine_issuing = measure(n, runs, |k| {
        for _ in 0..k {
            e.schedule(&r)?;
        }
        e.sync_all()
    })?;
    let step = e.capture(|c| {
        for _ in 0..step_len {
            c.schedule(&r)?;
        }
        Ok(())
    })?;
    let engine_replaying = measure(n, runs, |k| {
        for _ in 0..k / step_len {
            e.replay(&step)?;
        }
        e.sync_all()
    })?;
    drop(e);

    let (sys, routine) = system_routine(device, false)?;
    let system_issuing = measure(n, runs, |k| {
        for _ in 0..k {
            sys.schedule(&routine)?;
        }
        sys.sync()
    })?;
    let step = sys.capture(|c| {
        for _ in 0..step_len {
            c.schedule(&routine)?;
        }
        Ok(())
    })?;
    let system_replaying = measure(n, runs, |k| {
        for _ in 0..k / step_len {
            sys.replay(&step)?;
        }
        sys.sync()
    })?;
    sys.shutdown()?;

    // The same plain calls to a system whose automatic replay recognises them (a period of
    // one call, learned as `MIN_PERIOD` of them) and replays them without a capture call.
    let (auto, routine) = system_routine(device, true)?;
    let system_auto = measure(n, runs, |k| {
        for _ in 0..k {
            auto.schedule(&routine)?;
        }
        auto.sync()
    })?;
    let auto_stats = auto.replay_stats();
    auto.shutdown()?;

    let device = match device {
        Device::Cpu => "1 CPU device",
        Device::Vulkan => "1 Vulkan device",
        Device::Cuda => "1 CUDA device",
    };
    println!(
        "per routine, {n} routines a run, median of {runs} runs ({device}, 1 stream; replays \
         of a captured step of {step_len})"
    );
    match baseline {
        Some(baseline) => {
            println!("| runner | wall ns | CPU ns (all threads) | wall / baseline |");
            println!("|---|---:|---:|---:|");
            let row = |name: &str, c: Cost| {
                println!(
                    "| {name} | {:.0} | {:.0} | {:.2}x |",
                    c.wall,
                    c.cpu,
                    c.wall / baseline.wall.max(f64::MIN_POSITIVE)
                );
            };
            row("hand-written worker (baseline)", baseline);
            row("`Engine`, issuing", engine_issuing);
            row("`Engine`, replaying", engine_replaying);
            row("`System`, issuing", system_issuing);
            row("`System`, replaying", system_replaying);
            row("`System`, automatic replay", system_auto);
        }
        None => {
            println!(
                "| runner | wall ns | CPU ns (all threads) | CPU ns (host and runtime threads) \
                 | host and runtime CPU / issuing's |"
            );
            println!("|---|---:|---:|---:|---:|");
            let row = |name: &str, c: Cost, issuing: Cost| {
                println!(
                    "| {name} | {:.0} | {:.0} | {:.0} | {:.2} |",
                    c.wall,
                    c.cpu,
                    c.runtime_cpu,
                    c.runtime_cpu / issuing.runtime_cpu.max(f64::MIN_POSITIVE)
                );
            };
            row("`Engine`, issuing", engine_issuing, engine_issuing);
            row("`Engine`, replaying", engine_replaying, engine_issuing);
            row("`System`, issuing", system_issuing, system_issuing);
            row("`System`, replaying", system_replaying, system_issuing);
            row("`System`, automatic replay", system_auto, system_issuing);
        }
    }
    println!(
        "automatic replay: {} calls, {} replayed in {} replays, {} periods learned",
        auto_stats.calls, auto_stats.calls_replayed, auto_stats.replays, auto_stats.periods
    );
    Ok(())
}
