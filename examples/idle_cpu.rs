//! CPU used by an idle `System`: 4 CPU devices × 2 streams, warmed up (one routine run on
//! every stream, so every thread has started and worked), then 5 s with nothing scheduled.
//! The baseline, measured the same way in the same process before the `System` exists, is
//! the process doing nothing for the same time.
//!
//! ```text
//! cargo run --release --example idle_cpu -- --seconds 5
//! ```
//!
//! Process CPU time is the sum of the threads' `/proc/self/task/*/schedstat` (Linux;
//! `tributary_testkit::cpu_time`).

use std::time::{Duration, Instant};

use clap::Parser;
use tributary::{kernels, DType, MemoryMode, TensorNode};
use tributary_actors::{StreamConfig, System};
use tributary_testkit::cpu_time;

#[derive(Parser, Debug)]
#[command(about = "CPU used by an idle System (4 devices x 2 streams)")]
struct Args {
    /// How long to measure each state, in seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// CPU devices.
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Streams per device.
    #[arg(long, default_value_t = 2)]
    streams: usize,
}

/// CPU time used over `wall` of sleeping on this thread, as a fraction of one core.
fn measure(wall: Duration) -> Result<(Duration, f64), String> {
    let before = cpu_time::process_cpu_time().ok_or("no /proc/self/task/*/schedstat")?;
    let start = Instant::now();
    std::thread::sleep(wall);
    let elapsed = start.elapsed();
    let used = cpu_time::process_cpu_time()
        .ok_or("no /proc/self/task/*/schedstat")?
        .saturating_sub(before);
    Ok((used, used.as_secs_f64() / elapsed.as_secs_f64()))
}

fn run(args: &Args) -> Result<(), String> {
    let wall = Duration::from_secs_f64(args.seconds);
    let (base_used, base_share) = measure(wall)?;
    let sys = System::builder()
        .cpu_devices(args.devices)
        .streams(StreamConfig::MostParallelStreams(args.streams))
        .spawn()
        .map_err(|e| e.to_string())?;
    let x = TensorNode::new("x", DType::F32, [1])
        .with_mode(MemoryMode::on_device())
        .map_err(|e| e.to_string())?;
    for device in 0..args.devices {
        for stream in 0..args.streams {
            let ctx = sys.context(device, stream).map_err(|e| e.to_string())?;
            let r = ctx
                .link(kernels::fill(&x, 1.0).map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
            r.schedule()
                .and_then(|t| t.wait())
                .map_err(|e| e.to_string())?;
        }
    }
    // Past every spin window (50 µs) by far.
    std::thread::sleep(Duration::from_millis(10));
    let (used, share) = measure(wall)?;
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    sys.shutdown().map_err(|e| e.to_string())?;
    println!(
        "idle System, {} devices x {} streams, {:.1} s: {:.3} ms of CPU = {:.3}% of one core \
         ({threads} threads in the process)",
        args.devices,
        args.streams,
        args.seconds,
        used.as_secs_f64() * 1e3,
        share * 100.0
    );
    println!(
        "baseline (the same process before the System, sleeping): {:.3} ms = {:.3}% of one core",
        base_used.as_secs_f64() * 1e3,
        base_share * 100.0
    );
    Ok(())
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("idle_cpu: {e}");
        std::process::exit(1);
    }
}
