//! Heap allocations per scheduled routine in steady state, counted by a global allocator:
//! `Engine` and `System`, issuing and replaying a captured step, on one CPU device with one
//! stream, and on two devices with a copy between them (issue 30's target: none). A
//! user-written loop over the same closures allocates nothing, which is the baseline.
//!
//! ```sh
//! cargo run --release --example allocations            # 20,000 routines per row
//! cargo run --release --example allocations -- 200000
//! ```
//!
//! Each row warms up first (pools, caches, table growth), then counts `alloc`,
//! `alloc_zeroed` and `realloc` calls on every thread of the process (the CPU workers and
//! the actors' threads included) over `n` routines and their completion (`sync`), and
//! divides by `n`. A routine is a CPU closure writing one `i32`.

use tributary::{
    kernels::{Access, RoutineSpec},
    protocol::Routine,
    DType, Engine, EngineConfig, MemoryMode, MergeBufferUse, Sharing, TensorNode,
};
use tributary_actors::{StreamConfig, System};
use tributary_testkit::alloc_count::{allocations_of_second_run, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations per routine of `run(n)` after a first `run(n)` warmed up (the same burst,
/// so that queues and pools have grown to what it needs).
fn per_routine(
    n: u64,
    mut run: impl FnMut(u64) -> tributary::Result<()>,
) -> tributary::Result<f64> {
    Ok(allocations_of_second_run(|| run(n))? as f64 / n as f64)
}

fn spec() -> tributary::Result<RoutineSpec> {
    let y = TensorNode::new("y", DType::I32, [1]).with_mode(MemoryMode::on_device())?;
    RoutineSpec::custom("write", vec![(y, Access::Write)], None, |a| {
        a.output::<i32>(0).map_err(|e| e.to_string())?[0] = 1;
        Ok(())
    })
}

/// Routines a captured step holds (a replay issues them all).
const STEP: u64 = 8;

fn engine_rows(n: u64) -> tributary::Result<(f64, f64)> {
    let mut e = Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: 1,
        ..EngineConfig::default()
    })?;
    let ctx = e.context(0, 0)?;
    let r: Routine = e.link(&ctx, spec()?)?;
    let issuing = per_routine(n, |k| {
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
    let replaying = per_routine(n, |k| {
        for _ in 0..k / STEP {
            e.replay(&step)?;
        }
        e.sync_all()
    })?;
    Ok((issuing, replaying))
}

fn system_rows(n: u64) -> tributary::Result<(f64, f64)> {
    let sys = System::builder()
        .cpu_devices(1)
        .streams(StreamConfig::MostParallelStreams(1))
        .spawn()?;
    let ctx = sys.context(0, 0)?;
    let r = ctx.link(spec()?)?;
    let routine = r.routine().clone();
    let issuing = per_routine(n, |k| {
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
    let replaying = per_routine(n, |k| {
        for _ in 0..k / STEP {
            sys.replay(&step)?;
        }
        sys.sync()
    })?;
    sys.shutdown()?;
    Ok((issuing, replaying))
}

/// Two devices: a write of `x` on device 0, then a copy of `x` to device 1 (each copy waits
/// for the write on the other device). Per operation (a write or a copy), issuing and
/// replaying a captured step of [`STEP`] pairs.
fn system_copy_rows(n: u64) -> tributary::Result<(f64, f64)> {
    let sys = System::builder()
        .cpu_devices(2)
        .streams(StreamConfig::MostParallelStreams(1))
        .spawn()?;
    let x = TensorNode::new("x", DType::I32, [1])
        .with_mode(MemoryMode::OnDevice(Sharing::SharedCrossStreams))?;
    let write = RoutineSpec::custom("write", vec![(x.clone(), Access::Write)], None, |a| {
        a.output::<i32>(0).map_err(|e| e.to_string())?[0] = 1;
        Ok(())
    })?;
    let read = RoutineSpec::custom("read", vec![(x.clone(), Access::Read)], None, |_| Ok(()))?;
    let write = sys.context(0, 0)?.link(write)?;
    let read = sys.context(1, 0)?.link(read)?;
    let (src, dst) = (write.context().clone(), read.context().clone());
    let write = write.routine().clone();
    let issuing = per_routine(n, |k| {
        for _ in 0..k / 2 {
            sys.schedule(&write)?;
            sys.device_to_device(&x, &src, &dst, MergeBufferUse::No)?;
        }
        sys.sync()
    })?;
    let step = sys.capture(|c| {
        for _ in 0..STEP / 2 {
            c.schedule(&write)?;
            c.device_to_device(&x, &src, &dst, MergeBufferUse::No)?;
        }
        Ok(())
    })?;
    let replaying = per_routine(n, |k| {
        for _ in 0..k / STEP {
            sys.replay(&step)?;
        }
        sys.sync()
    })?;
    sys.shutdown()?;
    Ok((issuing, replaying))
}

fn main() -> tributary::Result<()> {
    let arg = std::env::args().nth(1);
    if matches!(arg.as_deref(), Some("--help" | "-h")) {
        println!("usage: allocations [ROUTINES]  (default 20000: routines counted per row)");
        return Ok(());
    }
    let n: u64 = match arg {
        None => 20_000,
        Some(a) => a.parse().map_err(|_| tributary::Error::InvalidConfig {
            setting: "ROUTINES".into(),
            value: a.clone(),
            reason: "a count of routines".into(),
        })?,
    }
    .max(STEP);
    // The baseline: the same closure's work in a plain loop.
    let mut y = [0i32; 1];
    let baseline = per_routine(n, |k| {
        for _ in 0..k {
            y[0] = std::hint::black_box(1);
        }
        Ok(())
    })?;
    let (engine_issuing, engine_replaying) = engine_rows(n)?;
    let (system_issuing, system_replaying) = system_rows(n)?;
    let (copy_issuing, copy_replaying) = system_copy_rows(n)?;
    println!(
        "heap allocations per routine, steady state, {n} routines per row (CPU devices, 1 stream each)"
    );
    println!("| runner | issuing | replaying a captured step of {STEP} |");
    println!("|---|---:|---:|");
    println!("| plain loop (baseline) | {baseline:.2} | - |");
    println!("| `Engine` | {engine_issuing:.2} | {engine_replaying:.2} |");
    println!("| `System` | {system_issuing:.2} | {system_replaying:.2} |");
    println!(
        "| `System`, 2 devices: writes and copies between them | {copy_issuing:.2} | \
         {copy_replaying:.2} |"
    );
    Ok(())
}
