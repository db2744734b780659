//! Task Bench on tributary: METG(50%) of `Engine`, `System` and `System` on two devices,
//! beside hand-written threads measured in the same run.
//!
//! Task Bench (Slaughter et al., SC'20) runs the same task graphs on every runtime and
//! reports METG(50%): the smallest task granularity at which the runtime still delivers
//! half the machine's peak FLOP/s. See `graph.rs` (patterns), `kernel.rs` (the
//! `compute_bound` kernel and the checks), `baseline.rs` (the threads), `runners.rs`
//! (tributary) and `metg.rs` (the METG rule). Every consumer checks every input it reads, in
//! every run.
//!
//! `cargo run --release --example taskbench` measures `stencil_1d` at widths 2, 8 and
//! 4 × cores; `-- --quick` checks every pattern on every system (results, not times), as CI
//! does.
//!
//! On a CUDA GPU (`--features cuda`, `cuda.rs`): `-- --runners
//! cuda-streams,system-cuda,system-cuda-replay --widths 2,8` measures hand-written cudarc
//! streams and `System` on one CUDA device side by side; a CUDA sweep counts a column's
//! stream as a core and has its own peak, per stream.

mod baseline;
#[path = "../common/mod.rs"]
mod common;
#[cfg(feature = "cuda")]
mod cuda;
mod graph;
mod kernel;
mod metg;
mod runners;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use tributary::backend::cpu::CpuConfig;

use clap::{Parser, ValueEnum};

use graph::{Graph, Pattern};
use kernel::{flops_per_task, Checks};
use metg::{metg, Point};
use runners::Issue;

/// Which implementation runs the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Runner {
    /// Hand-written: one persistent thread per core, atomic step counters.
    Threads,
    /// `tributary::Engine`, 1 CPU device, one stream per column.
    Engine,
    /// `Engine` replaying a captured period of timesteps (`Engine::replay_with`).
    EngineReplay,
    /// `tributary_actors::System`, 1 CPU device, one stream per column.
    System,
    /// `System` replaying a captured period of timesteps (`System::replay_with`).
    SystemReplay,
    /// `System` issuing plain calls with its automatic replay on (no capture call).
    SystemAuto,
    /// `System` on 2 CPU devices, cross-device inputs by `device_to_device`.
    System2,
    /// `System` on 2 CPU devices replaying a captured period, its copies included.
    System2Replay,
    /// `System` on 2 CPU devices issuing plain calls with its automatic replay on.
    System2Auto,
    /// Hand-written cudarc: one CUDA stream per column, events between them (`--features
    /// cuda`, a GPU).
    CudaStreams,
    /// `System` on 1 CUDA device, one stream per column.
    SystemCuda,
    /// `System` on 1 CUDA device replaying a captured period.
    SystemCudaReplay,
}

impl Runner {
    fn name(self) -> &'static str {
        match self {
            Runner::Threads => "hand-written threads",
            Runner::Engine => "Engine, 1 device",
            Runner::EngineReplay => "Engine, replaying a captured step",
            Runner::System => "System, 1 device",
            Runner::SystemReplay => "System, replaying a captured step",
            Runner::SystemAuto => "System, automatic replay",
            Runner::System2 => "System, 2 devices",
            Runner::System2Replay => "System, 2 devices, replaying",
            Runner::System2Auto => "System, 2 devices, automatic replay",
            Runner::CudaStreams => "hand-written CUDA streams",
            Runner::SystemCuda => "System, 1 CUDA device",
            Runner::SystemCudaReplay => "System, 1 CUDA device, replaying",
        }
    }

    /// Whether it runs on a CUDA GPU (its sweeps count a stream as a core).
    fn is_cuda(self) -> bool {
        matches!(
            self,
            Runner::CudaStreams | Runner::SystemCuda | Runner::SystemCudaReplay
        )
    }

    /// The hand-written runner its ratios are taken to.
    fn baseline(self) -> Runner {
        if self.is_cuda() {
            Runner::CudaStreams
        } else {
            Runner::Threads
        }
    }
}

/// The CUDA runners (feature `cuda`): the hand-written side's state is made once per
/// process, on first use.
#[cfg(feature = "cuda")]
mod gpu {
    use std::{sync::OnceLock, time::Duration};

    use super::{cuda, Graph, Runner};

    /// Widest graph (and most inputs of a task) the hand-written side is made for.
    pub const MAX_WIDTH: usize = 64;

    fn raw() -> Result<&'static cuda::RawGpu, String> {
        static RAW: OnceLock<Result<cuda::RawGpu, String>> = OnceLock::new();
        // cudarc panics where there is no driver: ask the backend's probe first.
        RAW.get_or_init(|| {
            tributary::backend::cuda::probe().map_err(|e| format!("CUDA is unavailable: {e}"))?;
            cuda::RawGpu::new(MAX_WIDTH, MAX_WIDTH)
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    pub fn run(runner: Runner, graph: Graph, iterations: u64) -> Result<Duration, String> {
        if graph.width > MAX_WIDTH {
            return Err(format!("CUDA runners take widths up to {MAX_WIDTH}"));
        }
        match runner {
            Runner::CudaStreams => raw()?.run(graph, iterations),
            Runner::SystemCuda => cuda::system(graph, iterations, false),
            Runner::SystemCudaReplay => cuda::system(graph, iterations, true),
            _ => Err(format!("{runner:?} is not a CUDA runner")),
        }
    }

    pub fn seconds_per_iteration() -> Result<f64, String> {
        Ok(cuda::kernel_seconds(raw()?, 4096)? / 4096.0)
    }
}

#[cfg(not(feature = "cuda"))]
mod gpu {
    use std::time::Duration;

    use super::{Graph, Runner};

    const WHY: &str = "the CUDA runners need `--features cuda`";

    pub fn run(_: Runner, _: Graph, _: u64) -> Result<Duration, String> {
        Err(WHY.into())
    }

    pub fn seconds_per_iteration() -> Result<f64, String> {
        Err(WHY.into())
    }
}

#[derive(Parser, Debug)]
#[command(about = "Task Bench's METG(50%) on tributary beside hand-written threads")]
struct Args {
    /// Check every pattern on every runner with small graphs (results, not times).
    #[arg(long)]
    quick: bool,
    /// Dependence pattern to measure.
    #[arg(long, value_enum, default_value = "stencil1d")]
    pattern: Pattern,
    /// Graph widths (columns); default 2, 8 and 4 × cores.
    #[arg(long, value_delimiter = ',')]
    widths: Vec<usize>,
    /// Runners to measure.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "threads,engine,engine-replay,system,system-replay,system2,system2-replay"
    )]
    runners: Vec<Runner>,
    /// Columns a `nearest` / `spread` task reads.
    #[arg(long, default_value_t = 3)]
    radix: usize,
    /// Timesteps a `spread` pattern takes to repeat.
    #[arg(long, default_value_t = 3)]
    period: usize,
    /// Largest kernel iteration count of the sweep (it halves down to 1).
    #[arg(long, default_value_t = 1 << 15)]
    max_iterations: u64,
    /// Target wall time of one run, milliseconds (sets the timesteps, 16..=`max-steps`).
    #[arg(long, default_value_t = 200)]
    budget_ms: u64,
    /// Most timesteps of one run (raise it with `budget-ms` for a run long enough to
    /// profile at small granularities).
    #[arg(long, default_value_t = 1000)]
    max_steps: usize,
    /// Runs per point (the median wall time counts).
    #[arg(long, default_value_t = 1)]
    samples: usize,
    /// Cores the granularity is computed for (default: all available).
    #[arg(long)]
    cores: Option<usize>,
    /// The CPU workers' spin window in µs (`CpuConfig::spin_us`; default: the backend's).
    #[arg(long)]
    spin_us: Option<u64>,
    /// Print every point of every sweep.
    #[arg(long)]
    verbose: bool,
}

impl Args {
    /// The CPU backend's configuration of the tributary runners.
    fn cpu(&self) -> CpuConfig {
        let cpu = CpuConfig::default();
        match self.spin_us {
            Some(us) => cpu.with_spin(Duration::from_micros(us)),
            None => cpu,
        }
    }
}

fn run(
    runner: Runner,
    pool: &baseline::Pool,
    graph: Graph,
    iterations: u64,
    cpu: &CpuConfig,
    checks: &Arc<Checks>,
) -> Result<f64, String> {
    checks.reset();
    let wall = match runner {
        Runner::Threads => {
            let start = Instant::now();
            baseline::run(pool, graph, iterations, checks)?;
            start.elapsed()
        }
        Runner::Engine => {
            runners::engine(graph, iterations, cpu, checks).map_err(|e| e.to_string())?
        }
        Runner::EngineReplay => {
            runners::engine_replay(graph, iterations, cpu, checks).map_err(|e| e.to_string())?
        }
        Runner::System => runners::system(graph, 1, iterations, cpu, checks, Issue::Calls)
            .map_err(|e| e.to_string())?,
        Runner::SystemReplay => runners::system(graph, 1, iterations, cpu, checks, Issue::Replay)
            .map_err(|e| e.to_string())?,
        Runner::SystemAuto => runners::system(graph, 1, iterations, cpu, checks, Issue::Auto)
            .map_err(|e| e.to_string())?,
        Runner::System2 => runners::system(graph, 2, iterations, cpu, checks, Issue::Calls)
            .map_err(|e| e.to_string())?,
        Runner::System2Replay => runners::system(graph, 2, iterations, cpu, checks, Issue::Replay)
            .map_err(|e| e.to_string())?,
        Runner::System2Auto => runners::system(graph, 2, iterations, cpu, checks, Issue::Auto)
            .map_err(|e| e.to_string())?,
        // The GPU checks its inputs itself (`cuda.rs`): a wrong one fails the run.
        Runner::CudaStreams | Runner::SystemCuda | Runner::SystemCudaReplay => {
            return gpu::run(runner, graph, iterations).map(|d| d.as_secs_f64())
        }
    };
    let (want, got) = (graph.inputs(), checks.inputs());
    if got != want {
        return Err(format!(
            "{}: {got} inputs checked, the graph has {want}",
            runner.name()
        ));
    }
    Ok(wall.as_secs_f64())
}

/// Every pattern on every runner, widths 2 and 8: exits non-zero on any wrong input.
fn quick(args: &Args, pool: &baseline::Pool) -> Result<(), String> {
    let checks = Arc::new(Checks::default());
    let cpu = args.cpu();
    let (mut runs, mut inputs) = (0, 0);
    for pattern in Pattern::ALL {
        for width in [2, 8] {
            let graph = Graph {
                pattern,
                width,
                // Enough for every pattern's period to be captured and replayed once
                // (`spread` with period 3 has 6 phases) by `EngineReplay`.
                steps: 13,
                radix: args.radix,
                period: args.period,
            };
            for &runner in &args.runners {
                run(runner, pool, graph, 3, &cpu, &checks).map_err(|e| {
                    format!("{} on {} width {width}: {e}", runner.name(), pattern.name())
                })?;
                runs += 1;
                inputs += graph.inputs();
            }
        }
    }
    println!("taskbench quick: {runs} runs, {inputs} inputs checked, 0 wrong");
    Ok(())
}

/// Seconds one task's kernel takes at `iterations` on one core (measured).
fn kernel_seconds(iterations: u64) -> f64 {
    let reps = 20;
    let start = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(kernel::compute_bound(std::hint::black_box(iterations)));
    }
    start.elapsed().as_secs_f64() / reps as f64
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let args = Args::parse();
    common::init_logging();
    let cores = args
        .cores
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let pool = baseline::Pool::new(cores);
    if args.quick {
        if let Err(e) = quick(&args, &pool) {
            eprintln!("taskbench quick: {e}");
            std::process::exit(1);
        }
        return;
    }
    if let Err(e) = measure(&args, cores, &pool) {
        eprintln!("taskbench: {e}");
        std::process::exit(1);
    }
}

fn measure(args: &Args, cores: usize, pool: &baseline::Pool) -> Result<(), String> {
    let widths = if args.widths.is_empty() {
        let mut w = vec![2, 8, 4 * cores];
        w.dedup();
        w
    } else {
        args.widths.clone()
    };
    let checks = Arc::new(Checks::default());
    let cpu = args.cpu();
    let per_iteration = kernel_seconds(4096) / 4096.0;
    println!(
        "Task Bench {} on {cores} cores; compute_bound {:.2} ns per iteration ({:.2} GFLOP/s per core)",
        args.pattern.name(),
        per_iteration * 1e9,
        flops_per_task(4096) / kernel_seconds(4096) / 1e9
    );
    let gpu_per_iteration = if args.runners.iter().any(|r| r.is_cuda()) {
        let s = gpu::seconds_per_iteration()?;
        println!(
            "CUDA runners: a column's stream counts as a core; compute_bound on one 64-thread block {:.2} ns per iteration",
            s * 1e9
        );
        s
    } else {
        f64::NAN
    };
    let mut sweeps: Vec<(usize, Runner, Vec<Point>)> = Vec::new();
    // The best FLOP/s of the session: [CPU runners, CUDA runners].
    let mut peaks = [0f64; 2];
    for &width in &widths {
        for &runner in &args.runners {
            let (cores, per_iteration) = if runner.is_cuda() {
                (width, gpu_per_iteration)
            } else {
                (cores, per_iteration)
            };
            let peak = &mut peaks[usize::from(runner.is_cuda())];
            let mut points = Vec::new();
            let mut iterations = args.max_iterations;
            let mut below = 0;
            while iterations >= 1 {
                let task = per_iteration * iterations as f64 + 1e-6;
                let steps = ((args.budget_ms as f64 * 1e-3 * cores as f64) / (width as f64 * task))
                    .clamp(16.0, args.max_steps.max(16) as f64)
                    as usize;
                let graph = Graph {
                    pattern: args.pattern,
                    width,
                    steps,
                    radix: args.radix,
                    period: args.period,
                };
                let walls = (0..args.samples.max(1))
                    .map(|_| run(runner, pool, graph, iterations, &cpu, &checks))
                    .collect::<Result<Vec<_>, _>>()?;
                let wall = median(walls);
                let tasks = graph.tasks() as f64;
                // A CUDA sweep's FLOP/s are per stream: a graph of width 2 keeps 2 blocks
                // busy, so its efficiency is against 2 streams' worth of the peak.
                let per = if runner.is_cuda() { width as f64 } else { 1.0 };
                let point = Point {
                    flops: tasks * flops_per_task(iterations) / wall / per,
                    granularity_us: wall * cores as f64 / tasks * 1e6,
                };
                *peak = peak.max(point.flops);
                if args.verbose {
                    println!(
                        "  {:<22} width {width:>3} iterations {iterations:>6} steps {steps:>4}: {:>9.2} µs/task, {:>6.2} GFLOP/s, {:>5.1}% of peak so far",
                        runner.name(),
                        point.granularity_us,
                        point.flops / 1e9,
                        100.0 * point.flops / *peak
                    );
                }
                points.push(point);
                // Once well below half of the peak, finer grains only get worse.
                below = if point.flops < 0.25 * *peak {
                    below + 1
                } else {
                    0
                };
                if below >= 2 {
                    break;
                }
                iterations /= 2;
            }
            sweeps.push((width, runner, points));
        }
    }
    println!();
    println!(
        "METG(50%), µs (peak {:.2} GFLOP/s CPU, {:.2} GFLOP/s per CUDA stream: the best run of the session)",
        peaks[0] / 1e9,
        peaks[1] / 1e9
    );
    println!(
        "| runner | {} |",
        widths
            .iter()
            .map(|w| format!("width {w}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|{}", "---|".repeat(widths.len()));
    for &runner in &args.runners {
        let cells: Vec<String> = widths
            .iter()
            .map(|&w| {
                let m = |r: Runner| {
                    sweeps
                        .iter()
                        .find(|(sw, sr, _)| *sw == w && *sr == r)
                        .and_then(|(_, _, pts)| metg(pts, peaks[usize::from(r.is_cuda())], 0.5))
                };
                match (m(runner), m(runner.baseline())) {
                    (Some(v), Some(base)) if runner != runner.baseline() => {
                        format!("{v:.2} ({:.1}×)", v / base)
                    }
                    (Some(v), _) => format!("{v:.2}"),
                    (None, _) => "never 50%".to_string(),
                }
            })
            .collect();
        println!("| {} | {} |", runner.name(), cells.join(" | "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quick mode as a test, so `cargo test` checks the port on every run.
    #[test]
    fn every_pattern_on_every_runner_reads_what_it_should() {
        let args = Args::parse_from(["taskbench", "--quick"]);
        let pool = baseline::Pool::new(2);
        quick(&args, &pool).unwrap();
    }
}
