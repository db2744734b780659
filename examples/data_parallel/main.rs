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
//! RUST_LOG=debug cargo run --example data_parallel -- --epochs 1   # the runtime's spans
//! ```

#[path = "../common/mod.rs"]
mod common;
mod model;

use std::{error::Error, process::ExitCode, time::Instant};

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tributary::collective::Strategy;
use tributary_actors::{StreamConfig, System};

use common::BackendArg;

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
}

fn main() -> ExitCode {
    common::init_logging();
    common::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<(), Box<dyn Error>> {
    let strategy = match args.strategy {
        StrategyArg::Star => Strategy::Star,
        StrategyArg::Tree => Strategy::Tree,
        StrategyArg::Ring => Strategy::Ring,
    };
    let backend = args
        .backend
        .kind(Some(args.devices))
        .map_err(|why| format!("backend {} is unavailable: {why}", args.backend.name()))?;
    let cfg = model::ModelConfig::default();
    let sys = System::builder()
        .cpu_devices(args.devices)
        .backend(backend)
        .streams(StreamConfig::OnlyDevicesParallel)
        .record_timeline(args.trace.is_some())
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
    for epoch in 0..args.epochs {
        dp.step()?;
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
    let params = dp.params(0)?;
    for i in 1..dp.replicas() {
        if dp.params(i)? != params {
            return Err(format!("replica {i}'s parameters differ from replica 0's").into());
        }
    }
    let (first, last) = (first.unwrap_or(f32::NAN), dp.loss()?);
    println!(
        "loss {first:.4} -> {last:.4}, accuracy {:.1}%, {:.1} ms per epoch; replicas identical",
        100.0 * model::accuracy(&cfg, &params, &data),
        elapsed.as_secs_f64() * 1e3 / args.epochs.max(1) as f64
    );
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
