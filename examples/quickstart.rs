//! Quickstart: a host application spawns 2 CPU devices with 2 streams each, links built-in
//! kernels, runs dependent routines across streams and devices, merges a gradient through
//! a merge buffer, and reads the results on the host. No barrier is written by hand.
//!
//! Run with `cargo run --release --example quickstart` (`RUST_LOG=debug` shows the
//! runtime's spans).

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use tributary::{kernels, DType, MemoryMode, MergeBufferUse, Result};
use tributary_actors::{StreamConfig, System};

/// No options: `--help` says what the example does.
#[derive(Parser, Debug)]
#[command(about = "Dependent routines across streams and devices, a merge, host reads")]
struct Args {}

fn main() -> Result<()> {
    let Args {} = Args::parse();
    common::init_logging();
    const N: usize = 1024;
    // Spawn the device system from plain synchronous code: 2 CPU devices x 2 streams.
    let sys = System::builder()
        .cpu_devices(2)
        .streams(StreamConfig::MostParallelStreams(2))
        .spawn()?;

    let w = sys
        .node("w", DType::F32, [N])
        .with_mode(MemoryMode::hosted_changed_on_devices())?;
    let g = sys
        .node("g", DType::F32, [N])
        .with_mode(MemoryMode::on_device())?;

    let (d0, d1) = (sys.device(0), sys.device(1));
    let ctx0 = d0
        .stream(0)
        .context()?
        .init_from_host(&w, &vec![1.0f32; N])?;
    let ctx1 = d1
        .stream(1)
        .context()?
        .init_from_host(&w, &vec![1.0f32; N])?;

    // Link built-in kernels into contexts; each link returns a routine in a child context.
    let grad0 = ctx0.link(kernels::scale(&g, &w, 0.5)?)?; // g = 0.5 * w on device 0
    let grad1 = ctx1.link(kernels::scale(&g, &w, 0.25)?)?; // g = 0.25 * w on device 1
    let merge = grad0.context().link(kernels::add_merge(&g)?)?; // g += merge buffer
    let step = merge.context().link(kernels::sgd_step(&w, &g, 0.1)?)?; // w -= 0.1 * g

    grad0.schedule()?; // returns a ticket at once
    grad1.schedule()?;
    sys.device_to_device(&g, &grad1.context(), &merge.context(), MergeBufferUse::Copy)?;
    merge.schedule()?; // waits for the copy by itself, which waited for grad1
    let done = step.schedule()?;
    done.wait()?; // or `.wait_async().await` in async code

    let g_host: Vec<f32> = merge.context().read(&g)?; // 0.75 everywhere
    let w_host: Vec<f32> = sys.host_read(&w)?; // lazily transferred from device 0
    println!("g = {:?} ...", &g_host[..4]);
    println!("w = {:?} ...", &w_host[..4]);
    assert!(g_host.iter().all(|&x| x == 0.75));
    assert!(w_host.iter().all(|&x| (x - 0.925).abs() < 1e-6));
    print!("{}", sys.memory_report()?);
    let report = sys.shutdown()?;
    println!(
        "shut down in {:?}, abandoned: {:?}",
        report.took, report.abandoned
    );
    Ok(())
}
