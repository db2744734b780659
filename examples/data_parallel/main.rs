//! Data-parallel training: a small MLP on a synthetic data set, trained over N devices.
//!
//! Each device computes the gradients of its shard, the gradients are all-reduced through
//! merge buffers (strategy `star`, `tree` or `ring`), and every device applies the same
//! SGD step. Shows a progress bar and the loss per epoch; exits with an error when the
//! loss did not fall or the replicas' parameters differ.
//!
//! ```sh
//! cargo run --release --example data_parallel -- --devices 4 --epochs 30 --strategy ring
//! cargo run --release --example data_parallel -- --backend vulkan --devices 2
//! cargo run --release --example data_parallel -- --epochs 5 --trace dp.trace.json
//! cargo run --release --example data_parallel -- --replay   # capture step 1, replay the rest
//! cargo run --release --example data_parallel -- --auto-replay   # the system finds the step
//! cargo run --release --example data_parallel -- --dim 256 --hidden 1024 --samples 4096 \
//!     --cpu-kernels exact   # a larger model; the matmuls in the GPU backends' order
//! RUST_LOG=debug cargo run --example data_parallel -- --epochs 1   # the runtime's spans
//! # across MPI ranks: R ranks x D devices, one shard each (feature `mpi`)
//! cargo build --release --features mpi --example data_parallel
//! mpirun -np 2 target/release/examples/data_parallel --mpi --devices 2
//! ```

#[path = "../common/mod.rs"]
mod common;

use std::{error::Error, process::ExitCode, time::Instant};

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tributary::{backend::cpu::CpuConfig, collective::Strategy, kernels::KernelMode};
use tributary_actors::{StreamConfig, System};
use tributary_testkit::model;

use common::BackendArg;

/// How the CPU built-ins order their sums (`CpuConfig::kernel_mode`).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum KernelsArg {
    /// Matmuls on blocked kernels (`matrixmultiply`).
    Fast,
    /// The summation order the GPU backends reproduce bit for bit.
    Exact,
}

/// How the gradients are all-reduced.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum StrategyArg {
    /// Everything to device 0, then back.
    Star,
    /// Pairwise reduction levels, then a broadcast.
    Tree,
    /// Reduce-scatter and all-gather around a ring.
    Ring,
}

#[derive(Parser, Debug)]
#[command(about = "Trains a small MLP data-parallel over several devices")]
struct Args {
    /// Devices (one data shard each).
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Training steps over the full batch.
    #[arg(long, default_value_t = 40)]
    epochs: u64,
    /// All-reduce strategy.
    #[arg(long, value_enum, default_value = "ring")]
    strategy: StrategyArg,
    /// Backend the devices run on.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    /// Record a timeline: write it as a Chrome/Perfetto trace to FILE.json and print
    /// where each stream's time went.
    #[arg(long, value_name = "FILE.json")]
    trace: Option<String>,
    /// Capture the first step and replay it every later step (`System::capture` /
    /// `System::replay`: one operation per device per step, no dependency inference).
    #[arg(long)]
    replay: bool,
    /// Issue every step as plain calls to a system whose automatic replay is on
    /// (`SystemBuilder::auto_replay`): it recognises the repeated step and replays it.
    #[arg(long)]
    auto_replay: bool,
    /// Input features of the MLP.
    #[arg(long, default_value_t = 8)]
    dim: usize,
    /// Hidden units of the MLP.
    #[arg(long, default_value_t = 32)]
    hidden: usize,
    /// Samples in the full batch (split over the replicas).
    #[arg(long, default_value_t = 512)]
    samples: usize,
    /// How CPU devices run the built-in kernels.
    #[arg(long, value_enum, default_value = "fast")]
    cpu_kernels: KernelsArg,
    /// Run as one rank of an MPI job (`mpirun -np R ...`): R x `--devices` replicas, one
    /// shard each, gradients all-reduced inside each rank and across ranks (CPU devices;
    /// needs the `mpi` feature).
    #[arg(long)]
    mpi: bool,
}

fn main() -> ExitCode {
    common::init_logging();
    common::exit_code(run(Args::parse()))
}

impl Args {
    fn model(&self) -> model::ModelConfig {
        model::ModelConfig {
            dim: self.dim,
            hidden: self.hidden,
            samples: self.samples,
            ..model::ModelConfig::default()
        }
    }

    fn kernel_mode(&self) -> KernelMode {
        match self.cpu_kernels {
            KernelsArg::Fast => KernelMode::Fast,
            KernelsArg::Exact => KernelMode::Exact,
        }
    }
}

fn run(args: Args) -> Result<(), Box<dyn Error>> {
    for (name, value) in [
        ("--dim", args.dim),
        ("--hidden", args.hidden),
        ("--samples", args.samples),
    ] {
        if value == 0 {
            return Err(format!("{name} 0: the model needs at least 1").into());
        }
    }
    let strategy = match args.strategy {
        StrategyArg::Star => Strategy::Star,
        StrategyArg::Tree => Strategy::Tree,
        StrategyArg::Ring => Strategy::Ring,
    };
    if args.mpi {
        return run_mpi(&args, strategy);
    }
    let backend = args
        .backend
        .kind(Some(args.devices))
        .map_err(|why| format!("backend {} is unavailable: {why}", args.backend.name()))?;
    let cfg = args.model();
    let sys = System::builder()
        .cpu_devices(args.devices)
        .cpu(CpuConfig::default().with_kernel_mode(args.kernel_mode()))
        .backend(backend)
        .streams(StreamConfig::OnlyDevicesParallel)
        .record_timeline(args.trace.is_some())
        .auto_replay(args.auto_replay)
        .spawn()
        .map_err(|e| format!("cannot start {} devices: {e}", args.backend.name()))?;
    let data = model::make_data(&cfg);
    let init = model::init_params(&cfg);
    let dp = model::DataParallel::new(&sys, &cfg, args.devices, &data, &init, strategy)?;
    let device = sys.device_info(0)?;
    println!(
        "training a {}-{}-{} MLP on {} samples over {} {} devices ({}; shards {:?}), all-reduce {:?}",
        cfg.dim,
        cfg.hidden,
        cfg.classes,
        cfg.samples,
        args.devices,
        device.backend,
        device.name,
        dp.shard_rows(),
        strategy
    );
    let bar = ProgressBar::new(args.epochs);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} epochs  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let mut first = None;
    let mut after_first = None;
    let mut captured = None;
    for epoch in 0..args.epochs {
        if epoch == 1 {
            after_first = Some(sys.fence_stats());
        }
        match &captured {
            Some(step) => dp.replay(step)?,
            None if args.replay => captured = Some(dp.capture_step()?),
            None => dp.step()?,
        }
        let loss = dp.loss()?;
        first.get_or_insert(loss);
        bar.set_message(format!("loss {loss:.4}"));
        bar.inc(1);
        if epoch % 10 == 0 || epoch + 1 == args.epochs {
            bar.println(format!("epoch {epoch:>3}: loss {loss:.4}"));
        }
    }
    bar.finish();
    let elapsed = start.elapsed();
    // Host-array order costs nothing in steady state: every replica reads its hosted
    // parameters and writes its own buffers (DESIGN.md §4).
    if let Some(before) = after_first {
        let now = sys.fence_stats();
        let (gates, waited) = (now.gates - before.gates, now.waited - before.waited);
        println!(
            "host-array fences in {} steps after the first: {gates} gates, {waited} waited for",
            args.epochs - 1
        );
        if gates + waited > 0 {
            return Err("steps after the first paid host-array fences".into());
        }
    }
    let params = dp.params(0)?;
    for i in 1..dp.replicas() {
        if dp.params(i)? != params {
            return Err(format!("replica {i}'s parameters differ from replica 0's").into());
        }
    }
    let (first, last) = (first.unwrap_or(f32::NAN), dp.loss()?);
    println!(
        "loss {first:.4} -> {last:.4}, accuracy {:.1}%, {:.2} ms per epoch{}; replicas identical",
        100.0 * model::accuracy(&cfg, &params, &data),
        elapsed.as_secs_f64() * 1e3 / args.epochs.max(1) as f64,
        if captured.is_some() {
            " (steps replayed)"
        } else {
            ""
        }
    );
    if args.auto_replay {
        let s = sys.replay_stats();
        println!(
            "automatic replay: {} calls, {} replayed in {} replays of {} captured steps, \
             {} periods learned, {} held calls issued by a barrier",
            s.calls, s.calls_replayed, s.replays, s.steps, s.periods, s.fallbacks.interrupted
        );
    }
    print!("{}", sys.memory_report()?);
    if let (Some(path), Some(rec)) = (&args.trace, sys.timeline()) {
        rec.write_chrome_trace(path)
            .map_err(|e| format!("trace file {path}: {e}"))?;
        println!(
            "wrote a timeline of {} records to {path} (open it in ui.perfetto.dev)",
            rec.records().len()
        );
        print!("{}", rec.summary());
    }
    sys.shutdown()?;
    // A step's loss is that of the parameters before its update: it falls from step 2 on.
    if args.epochs >= 2 && !(last.is_finite() && last < first) {
        return Err(format!("the loss did not fall ({first} -> {last})").into());
    }
    Ok(())
}

/// One rank of the data-parallel training across MPI ranks.
#[cfg(feature = "mpi")]
fn run_mpi(args: &Args, strategy: Strategy) -> Result<(), Box<dyn Error>> {
    use std::sync::Arc;
    use tributary_actors::cluster::Cluster;
    if args.backend != BackendArg::Cpu || args.trace.is_some() {
        return Err(
            "--mpi runs on CPU devices without --trace (the GPU path is designed in \
                    DESIGN.md §9, not built)"
                .into(),
        );
    }
    let cluster = Arc::new(
        Cluster::builder()
            .cpu_devices(args.devices)
            .kernel_mode(args.kernel_mode())
            .spawn()?,
    );
    let (rank, ranks) = (cluster.rank(), cluster.size());
    let cfg = args.model();
    let data = model::make_data(&cfg);
    let init = model::init_params(&cfg);
    let dp = model::DataParallel::on_cluster(cluster.clone(), &cfg, &data, &init, strategy)?;
    let replicas: usize = cluster.devices_per_rank().iter().sum();
    if rank == 0 {
        println!(
            "training a {}-{}-{} MLP on {} samples over {ranks} ranks x {:?} CPU devices \
             ({replicas} replicas), all-reduce {:?} inside each rank",
            cfg.dim,
            cfg.hidden,
            cfg.classes,
            cfg.samples,
            cluster.devices_per_rank(),
            strategy
        );
    }
    let start = Instant::now();
    let mut first = None;
    let mut captured = None;
    for epoch in 0..args.epochs {
        // With --replay: the first step captured on every rank, every later one replayed
        // (the all-reduce across ranks included).
        match &captured {
            Some(step) => dp.replay(step)?,
            None if args.replay => captured = Some(dp.capture_step()?),
            None => dp.step()?,
        }
        let loss = dp.loss()?;
        first.get_or_insert(loss);
        if rank == 0 && (epoch % 10 == 0 || epoch + 1 == args.epochs) {
            println!("epoch {epoch:>3}: loss {loss:.4}");
        }
    }
    let elapsed = start.elapsed();
    let params = dp.params(0)?;
    for i in 1..dp.replicas() {
        if dp.params(i)? != params {
            return Err(
                format!("rank {rank}: replica {i}'s parameters differ from replica 0's").into(),
            );
        }
    }
    // Bitwise the same on every rank: a digest of the bits, summed across ranks, is the
    // number of ranks times this rank's (20-bit parts, exact in f64).
    let parts = params.digest_parts();
    let sums = cluster.sum_host(&parts)?;
    if sums != parts.iter().map(|p| p * ranks as f64).collect::<Vec<_>>() {
        return Err(format!("rank {rank}: the ranks' parameters differ").into());
    }
    let (first, last) = (first.unwrap_or(f32::NAN), dp.loss()?);
    if rank == 0 {
        println!(
            "loss {first:.4} -> {last:.4}, accuracy {:.1}%, {:.1} ms per epoch{}; {replicas} \
             replicas identical on {ranks} ranks",
            100.0 * model::accuracy(&cfg, &params, &data),
            elapsed.as_secs_f64() * 1e3 / args.epochs.max(1) as f64,
            if captured.is_some() {
                " (steps replayed)"
            } else {
                ""
            }
        );
    }
    drop(dp);
    cluster.shutdown()?;
    if args.epochs >= 2 && !(last.is_finite() && last < first) {
        return Err(format!("the loss did not fall ({first} -> {last})").into());
    }
    Ok(())
}

/// Without the `mpi` feature, `--mpi` says how to get it.
#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &Args, _: Strategy) -> Result<(), Box<dyn Error>> {
    Err(
        "--mpi needs the `mpi` feature: cargo build --release --features mpi --example \
         data_parallel, then mpirun -np R target/release/examples/data_parallel --mpi"
            .into(),
    )
}
