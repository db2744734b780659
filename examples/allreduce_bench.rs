//! All-reduce bus bandwidth of each strategy on a backend's devices, beside the baselines a
//! user would write instead, measured in the same run: host memcpy, a single-threaded loop
//! over plain `Vec<f32>`s (sum into one, copy back), and a tree reduction over persistent
//! worker threads (no thread spawned per call).
//!
//! ```sh
//! cargo run --release --example allreduce_bench               # 4 KiB .. 64 MiB, n = 2, 4, 8
//! cargo run --release --example allreduce_bench -- --quick    # a few sizes, n = 2, 4
//! cargo run --release --example allreduce_bench -- --quick --backend vulkan
//! ```
//!
//! Bus bandwidth = algbw * 2(n-1)/n with algbw = bytes / time (NCCL's convention), so
//! figures are comparable across n. Each figure is the median of several runs.

#[path = "common/mod.rs"]
mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use tributary::{
    collective::{ReduceOp, Strategy, Transfer},
    kernels,
    protocol::Context,
    DType, MemoryMode, TensorNode,
};
use tributary_actors::{AllReducePlan, StreamConfig, System};

use clap::Parser;
use common::BackendArg;

#[derive(Parser, Debug)]
#[command(about = "All-reduce bus bandwidth of each strategy beside memcpy and threads")]
struct Args {
    /// A few sizes (up to 16 MiB) on 2 and 4 devices.
    #[arg(long)]
    quick: bool,
    /// Backend the devices run on.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    /// Device counts to measure (default 2,3,4,6,8; with --quick 2,4).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Timed runs per measurement (after a warm-up): enough that the median of a small size
/// is not one scheduler hiccup on a shared 2-core machine (each run of 1 MiB or less takes
/// well under a millisecond).
fn reps_for(bytes: usize) -> usize {
    match bytes {
        b if b <= 1 << 20 => 201,
        b if b <= 16 << 20 => 15,
        _ => 5,
    }
}

fn busbw(bytes: usize, n: usize, secs: f64) -> f64 {
    bytes as f64 / secs * 2.0 * (n as f64 - 1.0) / n as f64 / 1e9
}

/// Baseline 1: one memcpy of `bytes` (GB/s).
fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let times = (0..reps_for(bytes))
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    bytes as f64 / median(times) / 1e9
}

/// Baseline 2: what a user writes on one thread: sum every vector into the first, then copy
/// it back to the others (bus bandwidth like the strategies).
fn loop_busbw(bytes: usize, n: usize) -> f64 {
    let len = bytes / 4;
    let mut bufs: Vec<Vec<f32>> = (0..n).map(|i| vec![i as f32; len]).collect();
    let mut times = Vec::new();
    for _ in 0..reps_for(bytes) + 1 {
        let t = Instant::now();
        let (first, rest) = bufs.split_at_mut(1);
        for other in rest.iter() {
            first[0].iter_mut().zip(other).for_each(|(d, x)| *d += x);
        }
        for other in rest.iter_mut() {
            other.copy_from_slice(&first[0]);
        }
        times.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&bufs);
    }
    times.remove(0); // warm-up
    busbw(bytes, n, median(times))
}

type Job = Box<dyn FnOnce() + Send>;

/// Persistent worker threads fed by channels (no thread spawned per call): the pool a
/// user writes for a threaded tree reduction.
struct Workers {
    jobs: Vec<crossbeam_channel::Sender<Job>>,
    done: crossbeam_channel::Receiver<()>,
    done_tx: crossbeam_channel::Sender<()>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Workers {
    fn new(n: usize) -> Workers {
        let (done_tx, done) = crossbeam_channel::unbounded();
        let mut jobs = Vec::new();
        let mut handles = Vec::new();
        for _ in 0..n {
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            jobs.push(tx);
            handles.push(std::thread::spawn(move || {
                while let Ok(job) = rx.recv() {
                    job();
                }
            }));
        }
        Workers {
            jobs,
            done,
            done_tx,
            handles,
        }
    }

    /// Runs every job on its own worker and waits for all of them.
    fn run_all(&self, jobs: Vec<Job>) {
        let count = jobs.len();
        for (i, job) in jobs.into_iter().enumerate() {
            let done = self.done_tx.clone();
            let _ = self.jobs[i % self.jobs.len()].send(Box::new(move || {
                job();
                let _ = done.send(());
            }));
        }
        for _ in 0..count {
            let _ = self.done.recv();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.jobs.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// Baseline 3: a tree reduction over `n` vectors on persistent worker threads (one job per
/// pair per level), then a tree broadcast; bus bandwidth like the strategies.
fn worker_tree_busbw(workers: &Workers, bytes: usize, n: usize) -> f64 {
    use std::sync::{Arc, Mutex};
    let len = bytes / 4;
    let bufs: Arc<Vec<Mutex<Vec<f32>>>> =
        Arc::new((0..n).map(|i| Mutex::new(vec![i as f32; len])).collect());
    let mut times = Vec::new();
    for _ in 0..reps_for(bytes) + 1 {
        let t = Instant::now();
        let mut m = n;
        while m > 1 {
            let h = m.div_ceil(2);
            let jobs: Vec<Job> = (0..m - h)
                .map(|i| {
                    let bufs = bufs.clone();
                    Box::new(move || {
                        let src = bufs[h + i].lock().unwrap_or_else(|p| p.into_inner());
                        let mut dst = bufs[i].lock().unwrap_or_else(|p| p.into_inner());
                        dst.iter_mut().zip(src.iter()).for_each(|(d, x)| *d += x);
                    }) as Job
                })
                .collect();
            workers.run_all(jobs);
            m = h;
        }
        let mut have = 1;
        while have < n {
            let count = have.min(n - have);
            let jobs: Vec<Job> = (0..count)
                .map(|i| {
                    let bufs = bufs.clone();
                    Box::new(move || {
                        let src = bufs[i].lock().unwrap_or_else(|p| p.into_inner());
                        let mut dst = bufs[have + i].lock().unwrap_or_else(|p| p.into_inner());
                        dst.copy_from_slice(&src);
                    }) as Job
                })
                .collect();
            workers.run_all(jobs);
            have += count;
        }
        times.push(t.elapsed().as_secs_f64());
    }
    times.remove(0); // warm-up
    busbw(bytes, n, median(times))
}

/// The strategy's bus bandwidth: `n` devices, one context each, the data split into `n`
/// chunk nodes (so the ring is balanced; star and tree move the same chunks).
fn strategy_busbw(
    sys: &System,
    n: usize,
    bytes: usize,
    strategy: Strategy,
) -> tributary::Result<f64> {
    let chunk = (bytes / 4).div_ceil(n);
    let nodes: Vec<TensorNode> = (0..n)
        .map(|c| {
            TensorNode::new(format!("chunk{c}"), DType::F32, [chunk])
                .with_mode(MemoryMode::on_device())
        })
        .collect::<tributary::Result<_>>()?;
    let mut contexts: Vec<Context> = Vec::new();
    let mut fills = Vec::new();
    for i in 0..n {
        let mut ctx = sys.context(i, 0)?;
        for node in &nodes {
            let r = ctx.link(kernels::fill(node, 1.0)?)?;
            ctx = r.context();
            fills.push(r);
        }
        contexts.push(ctx.protocol_context().clone());
    }
    for f in &fills {
        f.schedule()?;
    }
    let plan = AllReducePlan::new(
        sys,
        &nodes,
        &contexts,
        ReduceOp::Sum,
        strategy,
        Transfer::Auto,
    )?;
    // Warm-up (first touch of the pages), then timed runs.
    for e in plan.run()? {
        e.wait()?;
    }
    let mut times = Vec::new();
    for _ in 0..reps_for(bytes) {
        let t = Instant::now();
        for e in plan.run()? {
            e.wait()?;
        }
        times.push(t.elapsed().as_secs_f64());
    }
    plan.finalize()?;
    for f in fills.iter().rev() {
        sys.finalize(f.protocol_context())?;
    }
    Ok(busbw(chunk * 4 * n, n, median(times)))
}

fn main() -> ExitCode {
    common::init_logging();
    common::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let sizes: Vec<usize> = if args.quick {
        vec![4 << 10, 1 << 20, 16 << 20]
    } else {
        vec![4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
    };
    let ns: Vec<usize> = match (args.devices.is_empty(), args.quick) {
        (false, _) => args.devices.clone(),
        (true, true) => vec![2, 4],
        (true, false) => vec![2, 4, 8],
    };
    println!(
        "all-reduce on {} devices, baselines on the host\n",
        args.backend.name()
    );
    println!(
        "| n | size | memcpy GB/s | loop busbw | worker tree busbw | star busbw | tree busbw | ring busbw | best / best baseline |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let started = Instant::now();
    for &n in &ns {
        let backend = args
            .backend
            .kind(Some(n))
            .map_err(|why| format!("backend {} is unavailable: {why}", args.backend.name()))?;
        let sys = System::builder()
            .cpu_devices(n)
            .backend(backend)
            .streams(StreamConfig::OnlyDevicesParallel)
            .spawn()
            .map_err(|e| format!("cannot start {n} {} devices: {e}", args.backend.name()))?;
        let workers = Workers::new(n.div_ceil(2));
        for &bytes in &sizes {
            let mem = memcpy_gbps(bytes);
            let lp = loop_busbw(bytes, n);
            let tree = worker_tree_busbw(&workers, bytes, n);
            let base = lp.max(tree);
            let mut row = Vec::new();
            for s in Strategy::ALL {
                row.push(strategy_busbw(&sys, n, bytes, s)?);
            }
            let best = row.iter().cloned().fold(0.0, f64::max);
            println!(
                "| {n} | {} | {mem:.2} | {lp:.2} | {tree:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                human(bytes),
                row[0],
                row[1],
                row[2],
                best / base
            );
        }
        sys.shutdown_within(Duration::from_secs(30))?;
    }
    eprintln!("total {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}
