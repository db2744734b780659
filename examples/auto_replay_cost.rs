//! What the automatic replay costs a program that never repeats itself, and what its
//! bookkeeping costs alone (issue 31's budgets: at most 5% more per call than with the
//! feature off, at most 50 ns of bookkeeping per call).
//!
//! ```sh
//! cargo run --release --example auto_replay_cost              # 200,000 calls, 7 runs each
//! cargo run --release --example auto_replay_cost -- 1000000 9
//! ```
//!
//! The program: schedules of 64 routines (CPU closures writing one `i32` each) in a
//! pseudo-random order, on one device and stream, then a sync; no sequence of them repeats
//! three times in a row. The same program runs on a system with the automatic replay off
//! and on one with it on, alternating, a warm-up run first; the medians of the wall times
//! per call and their ratio are printed. The bookkeeping row times the recogniser alone
//! (`Recognizer::push`) over the program's stream of 64 fingerprints, the median of the
//! same runs.

use std::time::Instant;

use tributary::{
    dispatch::auto::Recognizer,
    kernels::{Access, RoutineSpec},
    protocol::Routine,
    DType, MemoryMode, TensorNode,
};
use tributary_actors::{StreamConfig, System};

/// Routines the program picks from.
const ROUTINES: usize = 64;

/// The pseudo-random order of the program's calls (the same in every run and system).
fn order(n: u64) -> impl Iterator<Item = usize> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..n).map(move |_| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize % ROUTINES
    })
}

fn system(auto: bool) -> tributary::Result<(System, Vec<Routine>)> {
    let sys = System::builder()
        .cpu_devices(1)
        .streams(StreamConfig::MostParallelStreams(1))
        .mailbox_capacity(1 << 16)
        .auto_replay(auto)
        .spawn()?;
    let ctx = sys.context(0, 0)?;
    let mut routines = Vec::new();
    for k in 0..ROUTINES {
        let y =
            TensorNode::new(format!("y{k}"), DType::I32, [1]).with_mode(MemoryMode::on_device())?;
        let spec = RoutineSpec::custom(format!("write{k}"), vec![(y, Access::Write)], None, |a| {
            a.output::<i32>(0).map_err(|e| e.to_string())?[0] = 1;
            Ok(())
        })?;
        routines.push(ctx.link(spec)?.routine().clone());
    }
    Ok((sys, routines))
}

/// Wall time per call of one run of the program on `sys`.
fn run(sys: &System, routines: &[Routine], n: u64) -> tributary::Result<f64> {
    let start = Instant::now();
    for k in order(n) {
        sys.schedule(&routines[k])?;
    }
    sys.sync()?;
    Ok(start.elapsed().as_nanos() as f64 / n as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> tributary::Result<()> {
    let mut args = std::env::args().skip(1);
    let n: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let runs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(7);
    let (off, off_routines) = system(false)?;
    let (on, on_routines) = system(true)?;
    run(&off, &off_routines, n)?;
    run(&on, &on_routines, n)?;
    let (mut walls_off, mut walls_on, mut book) = (Vec::new(), Vec::new(), Vec::new());
    let fps: Vec<u64> = order(n).map(|k| (k as u64 + 1) * 2).collect();
    for _ in 0..runs {
        walls_off.push(run(&off, &off_routines, n)?);
        walls_on.push(run(&on, &on_routines, n)?);
        let mut r = Recognizer::new();
        let start = Instant::now();
        let mut found = 0usize;
        for &fp in &fps {
            found += usize::from(std::hint::black_box(r.push(fp)).is_some());
        }
        book.push(start.elapsed().as_nanos() as f64 / n as f64);
        std::hint::black_box(found);
    }
    let stats = on.replay_stats();
    off.shutdown()?;
    on.shutdown()?;
    let (off, on, book) = (median(walls_off), median(walls_on), median(book));
    println!(
        "per call, {n} calls of {ROUTINES} routines in a pseudo-random order a run, median of \
         {runs} runs (1 CPU device, 1 stream)"
    );
    println!("| runner | wall ns per call | / automatic replay off |");
    println!("|---|---:|---:|");
    println!("| `System`, automatic replay off | {off:.0} | 1.00x |");
    println!(
        "| `System`, automatic replay on | {on:.0} | {:.3}x |",
        on / off.max(f64::MIN_POSITIVE)
    );
    println!("| recogniser alone (`Recognizer::push`) | {book:.1} | |");
    println!(
        "automatic replay: {} calls, {} periods learned, {} calls replayed, {} mismatches",
        stats.calls, stats.periods, stats.calls_replayed, stats.fallbacks.mismatch
    );
    Ok(())
}
