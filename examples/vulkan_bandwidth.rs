//! Vulkan transfer bandwidth through the engine, beside host `memcpy` measured in the same
//! run: host upload (`from_host`), download (`to_host`), same-device copy (two streams of
//! one device, `vkCmdCopyBuffer`) and cross-device copy (two logical devices, through the
//! host), each timed from the call to the completion of its event. Then the same with host
//! access to pool memory switched off (`force_staging`: every transfer stages through a
//! separate host-visible buffer, as on a discrete GPU).
//!
//! Run with `cargo run --release --example vulkan_bandwidth` (feature `vulkan`, on by default
//! for examples through the dev-dependency). Options: `--sizes 1,16,64` (MiB), `--reps 9`.
//! Prints a Markdown table (median of the repetitions, GB/s = 10^9 bytes per second).

#[path = "common/mod.rs"]
mod common;

use std::{
    hint::black_box,
    sync::Arc,
    time::{Duration, Instant},
};

use clap::Parser;
use tributary::{
    backend::vulkan::{VulkanBackend, VulkanConfig},
    kernels,
    memory::PoolConfig,
    DType, DeviceId, Engine, HostedKind, MemoryMode, MergeBufferUse, Result, Sharing, TensorNode,
};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Times `f` `reps` times (after one warm-up call); the median.
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    f()?;
    let mut ts = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        ts.push(t.elapsed());
    }
    Ok(median(ts))
}

struct Row {
    what: &'static str,
    mib: usize,
    t: Duration,
}

fn memcpy_rows(sizes: &[usize], reps: usize) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &mib in sizes {
        let bytes = mib << 20;
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        let t = time(reps, || {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
            Ok(())
        })?;
        rows.push(Row {
            what: "host memcpy",
            mib,
            t,
        });
    }
    Ok(rows)
}

fn vulkan_rows(sizes: &[usize], reps: usize, staging: bool) -> Result<Vec<Row>> {
    let backend = VulkanBackend::new(
        DeviceId(0),
        VulkanConfig {
            devices: Some(2),
            force_staging: staging,
            ..VulkanConfig::default()
        },
    )?;
    let pools = PoolConfig {
        pool_bytes: 256 << 20,
        ..PoolConfig::default()
    };
    let mut e = Engine::with_backend(Arc::new(backend), 2, pools)?;
    let mut rows = Vec::new();
    let tag = |s: &'static str, t: &'static str| if staging { t } else { s };
    for &mib in sizes {
        let n = (mib << 20) / 4;
        let h = TensorNode::new("h", DType::F32, [n]).with_mode(MemoryMode::Hosted(
            HostedKind::ChangedOnDevices(Sharing::Unset),
        ))?;
        let c00 = e.context(0, 0)?;
        let c00 = e.init_from_host(&c00, &h, &vec![1.5f32; n])?;
        e.sync_all()?;
        let t = time(reps, || e.from_host(&c00, &h)?.wait())?;
        rows.push(Row {
            what: tag("upload (from_host)", "upload (from_host), staged"),
            mib,
            t,
        });
        let t = time(reps, || e.to_host(&c00, &h)?.wait())?;
        rows.push(Row {
            what: tag("download (to_host)", "download (to_host), staged"),
            mib,
            t,
        });
        // Destinations holding their own buffer of `g`: stream 1 of device 0, and device 1.
        let g = TensorNode::new("g", DType::F32, [n]).with_mode(MemoryMode::on_device())?;
        let src = e.link(&c00, kernels::fill(&g, 2.0)?)?;
        e.schedule(&src)?;
        let c01 = e.context(0, 1)?;
        let same = e.link(&c01, kernels::fill(&g, 0.0)?)?;
        e.schedule(&same)?;
        let c10 = e.context(1, 0)?;
        let other = e.link(&c10, kernels::fill(&g, 0.0)?)?;
        e.schedule(&other)?;
        e.sync_all()?;
        let copy = |e: &mut Engine, dst: &tributary::protocol::Context| -> Result<()> {
            match e.device_to_device(&g, src.context(), dst, MergeBufferUse::No)? {
                Some(ev) => ev.wait(),
                None => Err(tributary::Error::Internal(
                    "a copy between two buffers moved nothing".into(),
                )),
            }
        };
        if !staging {
            let t = time(reps, || copy(&mut e, same.context()))?;
            rows.push(Row {
                what: "same-device copy (vkCmdCopyBuffer)",
                mib,
                t,
            });
        }
        let t = time(reps, || copy(&mut e, other.context()))?;
        rows.push(Row {
            what: tag(
                "cross-device copy (one host memcpy)",
                "cross-device copy, staged (download + upload)",
            ),
            mib,
            t,
        });
        let got: Vec<f32> = e.read(other.context(), &g)?;
        assert!(got.iter().all(|&x| x == 2.0), "the copies moved the data");
        for ctx in [other.context(), same.context(), src.context(), &c00] {
            e.finalize(ctx)?;
        }
        e.sync_all()?;
    }
    Ok(rows)
}

#[derive(Parser, Debug)]
#[command(about = "Vulkan transfer bandwidth beside host memcpy")]
struct Args {
    /// Transfer sizes, MiB.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    sizes: Vec<usize>,
    /// Repetitions per figure (the median counts).
    #[arg(long, default_value_t = 9)]
    reps: usize,
}

fn main() -> std::process::ExitCode {
    common::init_logging();
    common::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<()> {
    let (sizes, reps) = (args.sizes, args.reps.max(1));
    let info = match tributary::backend::vulkan::probe() {
        Ok(info) => info,
        Err(e) => {
            println!("Vulkan unavailable: {e}");
            return Ok(());
        }
    };
    println!(
        "Vulkan {} on {}; 2 logical devices x 2 streams; median of {reps}\n",
        info.api_version,
        info.devices.join(", ")
    );
    let mut rows = memcpy_rows(&sizes, reps)?;
    rows.extend(vulkan_rows(&sizes, reps, false)?);
    rows.extend(vulkan_rows(&sizes, reps, true)?);
    println!("| transfer | size | time | bandwidth |");
    println!("|---|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} MiB | {:.3} ms | {:.2} GB/s |",
            r.what,
            r.mib,
            r.t.as_secs_f64() * 1e3,
            gbps(r.mib << 20, r.t)
        );
    }
    Ok(())
}
