//! Task Bench's `stencil_1d` across MPI ranks (feature `mpi`): METG(50%) of a tributary
//! cluster beside the same graph written directly on MPI, in the same `mpirun`.
//!
//! Every rank runs this program (`mpirun -np R`); rank 0 prints. The graph has `width`
//! columns split into R contiguous blocks, one per rank (one rank per core); task `(t, i)`
//! reads the outputs of `(t - 1, i - 1)`, `(t - 1, i)` and `(t - 1, i + 1)`, checks them and
//! runs Task Bench's `compute_bound` kernel (`examples/taskbench/kernel.rs`). A task whose
//! neighbour lives on another rank needs that rank's output of the previous timestep:
//!
//! - `mpi`: what a careful engineer writes on rsmpi's raw MPI: one thread per rank, each
//!   timestep `MPI_Isend`/`MPI_Irecv` of the boundary outputs with both neighbours and one
//!   `MPI_Waitall`, then the rank's tasks in order, nothing allocated in the loop. It runs
//!   on the cluster's network stream (`Cluster::with_mpi`), in the same processes.
//! - `mpi with headers`: the same program with the cluster's header protocol written by hand
//!   (`examples/cluster/header_wire.rs`): each timestep's transfers with a neighbour are
//!   header exchanges carrying the data, checked before the data is used, as the cluster
//!   checks every transfer (DESIGN.md §9). What it adds to `mpi` is the protocol's price;
//!   what the tributary runners add to it is the runtime's (the last column of the table).
//! - `cluster`: the tributary program a user writes: a CPU routine per column and parity on
//!   one compute stream, one `Cluster::exchange` of the boundary outputs with the
//!   neighbours each timestep (every send and receive at once, as the `mpi` runner's
//!   `MPI_Isend`/`MPI_Irecv` and `MPI_Waitall`), everything issued at once and waited for
//!   at the end; the runtime orders the tasks after the transfers by itself.
//! - `in place`: the same program with its context on the network stream
//!   (`Cluster::network_context`): the tasks and the transfers run on one stream, the
//!   transfers reading and writing the tasks' buffers in place, nothing handed between
//!   streams (as the `mpi` runner's one thread does).
//! - `in place replayed`: the same, with two timesteps (`--replay-timesteps K`: K) captured
//!   once (`Cluster::capture`: the tasks and exchanges) and replayed for every later run of
//!   as many, the timestep index shifted (`Cluster::replay_with`).
//!
//! For each granularity (`compute_bound` iterations, halved from `--max-iterations` until
//! efficiency falls under a quarter) it times `--steps` timesteps, barrier to barrier, and
//! takes the best of `--samples`. METG(50%) follows Task Bench (`examples/taskbench/metg.rs`):
//! efficiency is FLOP/s over the session's peak, granularity is wall × ranks ÷ tasks.
//!
//! ```sh
//! cargo build --release --features mpi --example cluster_taskbench
//! mpirun -np 2 target/release/examples/cluster_taskbench --width 2
//! mpirun -np 2 target/release/examples/cluster_taskbench --width 8
//! ```

#[path = "common/mod.rs"]
mod common;
#[path = "cluster/header_wire.rs"]
mod header_wire;
#[allow(dead_code)] // the single-process benchmark's helpers beside the ones used here
#[path = "taskbench/kernel.rs"]
mod kernel;
#[path = "taskbench/metg.rs"]
mod metg;

use std::{process::ExitCode, sync::Arc, time::Instant};

use clap::Parser;
use header_wire::{HeaderWire, Part};
use tributary::protocol::Context;
use tributary::{
    kernels::{Access, RoutineSpec},
    DType, MemoryMode, TensorNode,
};
use tributary_actors::{
    cluster::{mpi_crate::ffi, Cluster, ClusterCapture, Exchange, RawComm},
    ContextHandle, RoutineHandle,
};

use kernel::{check_input, compute_bound, flops_per_task, output, Checks};
use metg::{metg, Point};

#[derive(Parser, Debug)]
#[command(about = "Task Bench stencil_1d across MPI ranks (run under mpirun)")]
struct Args {
    /// Columns of the graph (split into contiguous blocks, one per rank).
    #[arg(long, default_value_t = 2)]
    width: usize,
    /// Timesteps per run.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// The coarsest granularity (`compute_bound` iterations).
    #[arg(long, default_value_t = 1 << 14)]
    max_iterations: u64,
    /// Runs per granularity (the best is kept).
    #[arg(long, default_value_t = 3)]
    samples: usize,
    /// Only these tributary runners (comma separated: cluster, "in place", "in place
    /// replayed"; any other name, such as `none`, for none).
    #[arg(long, value_delimiter = ',')]
    runners: Vec<String>,
    /// Only these baselines (comma separated: mpi, "mpi with headers"; `none` for neither);
    /// both by default. A ratio needs the baseline it divides by.
    #[arg(long, value_delimiter = ',')]
    baselines: Vec<String>,
    /// Timesteps per captured step of the `in place replayed` runner (even: a step must
    /// end with the buffers of the parity it began with). More timesteps per replay spread
    /// a replay's fixed cost over more of them (BENCHMARKS.md).
    #[arg(long, default_value_t = 2)]
    replay_timesteps: usize,
}

fn main() -> ExitCode {
    common::init_logging();
    common::exit_code(run(Args::parse()))
}

/// The columns `lo..hi` of `rank`.
fn block(width: usize, ranks: usize, rank: usize) -> (usize, usize) {
    (rank * width / ranks, (rank + 1) * width / ranks)
}

/// The columns task `(t, i)` reads (none at `t = 0`).
fn deps(width: usize, t: usize, i: usize) -> Vec<usize> {
    if t == 0 {
        return Vec::new();
    }
    (i.saturating_sub(1)..(i + 2).min(width)).collect()
}

/// Seconds for `steps` timesteps of the graph on raw MPI, barrier to barrier: one thread
/// per rank, each timestep the boundary outputs exchanged with both neighbours, then the
/// rank's tasks in order, nothing allocated in the loop. `with_headers`: the exchange is
/// the cluster's header protocol written by hand ([`exchange_with_headers`]); otherwise
/// plain `MPI_Isend`/`MPI_Irecv` and one `MPI_Waitall` ([`exchange_plain`]).
fn mpi_run(
    cluster: &Cluster,
    width: usize,
    steps: usize,
    iterations: u64,
    checks: Arc<Checks>,
    with_headers: bool,
) -> tributary::Result<f64> {
    let secs = cluster.with_mpi(move |comm: &RawComm| {
        let (rank, ranks) = (comm.rank(), comm.size());
        let cols = block(width, ranks, rank);
        let (lo, hi) = cols;
        // Outputs of the previous and the current timestep, columns lo - 1 ..= hi (the two
        // ghosts at the ends).
        let mut prev = vec![[0f64; 2]; hi - lo + 2];
        let mut cur = prev.clone();
        let (mut inputs, mut sink) = (0u64, 0u64);
        let mut wire = HeaderWire::new(4, 16);
        // SAFETY: the communicator is the cluster's, used on the network stream
        // (`with_mpi`), and every neighbour runs the matching calls.
        unsafe {
            ffi::MPI_Barrier(comm.raw());
            let t_start = Instant::now();
            for t in 0..steps {
                if t > 0 {
                    let (rank, ranks) = (rank as i32, ranks as i32);
                    if with_headers {
                        exchange_with_headers(
                            comm.raw(),
                            &mut wire,
                            t,
                            (rank, ranks),
                            cols,
                            &mut prev,
                        )?;
                    } else {
                        exchange_plain(comm.raw(), (rank, ranks), cols, &mut prev);
                    }
                }
                for i in lo..hi {
                    for j in deps(width, t, i) {
                        if check_input(t, i, j, &prev[j + 1 - lo]).is_ok() {
                            inputs += 1;
                        }
                    }
                    sink += compute_bound(iterations).to_bits() & 1;
                    cur[i + 1 - lo] = output(t, i);
                }
                std::mem::swap(&mut prev, &mut cur);
            }
            ffi::MPI_Barrier(comm.raw());
            checks.add(inputs, sink);
            Ok(t_start.elapsed().as_secs_f64())
        }
    })?;
    secs.map_err(tributary::Error::Internal)
}

/// The `mpi` runner's exchange: `MPI_Irecv`/`MPI_Isend` of the boundary outputs in `prev`
/// (this rank's columns `lo..hi` at `1..=hi - lo`, the ghosts at both ends) with both
/// neighbours, then one `MPI_Waitall`.
///
/// # Safety
///
/// `comm` is the cluster's communicator on the network stream, and the neighbours run the
/// matching calls.
unsafe fn exchange_plain(
    comm: ffi::MPI_Comm,
    (rank, ranks): (i32, i32),
    (lo, hi): (usize, usize),
    prev: &mut [[f64; 2]],
) {
    // SAFETY: reading an MPI constant the library initialised (MPI is running).
    let mut requests = [unsafe { ffi::RSMPI_REQUEST_NULL }; 4];
    let mut n = 0;
    let p = prev.as_mut_ptr();
    let mut exchange = |peer: i32, send: usize, recv: usize| {
        // SAFETY: `send` and `recv` index `prev` (at most `hi - lo + 1`), whose elements
        // stay put until the `MPI_Waitall` below; `comm` is as this function requires.
        unsafe {
            ffi::MPI_Irecv(
                p.add(recv).cast(),
                2,
                ffi::RSMPI_DOUBLE,
                peer,
                3,
                comm,
                &mut requests[n],
            );
            ffi::MPI_Isend(
                p.add(send).cast(),
                2,
                ffi::RSMPI_DOUBLE,
                peer,
                3,
                comm,
                &mut requests[n + 1],
            );
        }
        n += 2;
    };
    if rank > 0 {
        exchange(rank - 1, 1, 0);
    }
    if rank + 1 < ranks {
        exchange(rank + 1, hi - lo, hi - lo + 1);
    }
    // SAFETY: the `n` requests are live and their buffers untouched until this returns.
    unsafe { ffi::MPI_Waitall(n as i32, requests.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE) };
}

/// The `mpi with headers` runner's exchange of timestep `t`: with each neighbour, the two
/// transfers of the boundary outputs (the lower rank's first, DESIGN.md §9 "One order per
/// pair") as one call of header exchanges carrying the data ([`HeaderWire`]), every part
/// posted at once and waited for together; the received outputs are copied into the
/// ghosts of `prev` (laid out as for [`exchange_plain`]). What a careful engineer writes
/// who wants the cluster's check of every transfer without a runtime.
///
/// # Safety
///
/// As for [`exchange_plain`].
unsafe fn exchange_with_headers(
    comm: ffi::MPI_Comm,
    wire: &mut HeaderWire,
    t: usize,
    (rank, ranks): (i32, i32),
    (lo, hi): (usize, usize),
    prev: &mut [[f64; 2]],
) -> Result<(), String> {
    let bytes_of = |v: &[f64; 2]| {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&v[0].to_le_bytes());
        b[8..].copy_from_slice(&v[1].to_le_bytes());
        b
    };
    let (low, high) = (bytes_of(&prev[1]), bytes_of(&prev[hi - lo]));
    // On the stack: nothing allocated per timestep. `ghosts`: (part, ghost it lands in) per
    // transfer this rank receives.
    let none = |tag| Part {
        peer: 0,
        tag,
        send: None,
    };
    let mut parts = [none(8), none(9), none(8), none(9)];
    let (mut n, mut ghosts, mut received) = (0, [(0, 0); 2], 0);
    if rank > 0 {
        parts[n] = Part {
            peer: rank - 1,
            tag: 8,
            send: None,
        };
        parts[n + 1] = Part {
            peer: rank - 1,
            tag: 9,
            send: Some(&low),
        };
        ghosts[received] = (n, 0);
        (n, received) = (n + 2, received + 1);
    }
    if rank + 1 < ranks {
        parts[n] = Part {
            peer: rank + 1,
            tag: 8,
            send: Some(&high),
        };
        parts[n + 1] = Part {
            peer: rank + 1,
            tag: 9,
            send: None,
        };
        ghosts[received] = (n + 1, hi - lo + 1);
        (n, received) = (n + 2, received + 1);
    }
    // SAFETY: as this function requires.
    unsafe { wire.call(comm, t as u64, &parts[..n])? };
    for &(part, ghost) in &ghosts[..received] {
        let b = wire.received(part);
        let (mut x, mut y) = ([0u8; 8], [0u8; 8]);
        x.copy_from_slice(&b[..8]);
        y.copy_from_slice(&b[8..16]);
        prev[ghost] = [f64::from_le_bytes(x), f64::from_le_bytes(y)];
    }
    Ok(())
}

/// A tributary cluster running the graph: a routine per local column and parity (and for
/// the first timestep), the boundary outputs moved by one `exchange` per timestep.
struct ClusterGraph {
    ctx: ContextHandle,
    first: Vec<RoutineHandle>,
    /// `tasks[p][k]`: column `lo + k` at a timestep of parity `p` (`t ≥ 1`).
    tasks: [Vec<RoutineHandle>; 2],
    /// `out[p][k]`: the output of column `lo + k` at parity `p`.
    out: [Vec<TensorNode>; 2],
    /// `(peer, own boundary column, the ghost of the peer's)` per neighbour, by parity.
    ghosts: [Vec<(usize, usize, TensorNode)>; 2],
    lo: usize,
}

impl ClusterGraph {
    fn link(
        cluster: &Cluster,
        width: usize,
        iterations: u64,
        checks: &Arc<Checks>,
        in_place: bool,
    ) -> tributary::Result<ClusterGraph> {
        let (rank, ranks) = (cluster.rank(), cluster.size());
        let (lo, hi) = block(width, ranks, rank);
        let node = |name: String| {
            TensorNode::new(name, DType::F64, [2]).with_mode(MemoryMode::on_device())
        };
        let mut out: [Vec<TensorNode>; 2] = [Vec::new(), Vec::new()];
        for (p, o) in out.iter_mut().enumerate() {
            for i in lo..hi {
                o.push(node(format!("out{p}.{i}"))?);
            }
        }
        let mut ghosts: [Vec<(usize, usize, TensorNode)>; 2] = [Vec::new(), Vec::new()];
        for (p, g) in ghosts.iter_mut().enumerate() {
            if rank > 0 {
                g.push((rank - 1, lo, node(format!("out{p}.{}", lo - 1))?));
            }
            if rank + 1 < ranks {
                g.push((rank + 1, hi - 1, node(format!("out{p}.{hi}"))?));
            }
        }
        // The node holding column j's output at parity p, seen from this rank.
        let of = |p: usize, j: usize| -> tributary::Result<TensorNode> {
            if (lo..hi).contains(&j) {
                return Ok(out[p][j - lo].clone());
            }
            // A transfer's two sides name the node alike: the ghost of column j is
            // labelled as the output it receives.
            let label = format!("out{p}.{j}");
            ghosts[p]
                .iter()
                .find(|(_, _, g)| g.label() == label)
                .map(|(_, _, g)| g.clone())
                .ok_or_else(|| tributary::Error::Internal(format!("no {label} on rank {rank}")))
        };
        let spec = |t0: usize, p: usize, i: usize| -> tributary::Result<RoutineSpec> {
            let d = deps(width, t0, i);
            let mut params = vec![(out[p][i - lo].clone(), Access::Write)];
            for &j in &d {
                params.push((of(1 - p, j)?, Access::Read));
            }
            let checks = checks.clone();
            RoutineSpec::custom(format!("task{i}.{p}"), params, None, move |args| {
                let t = args.index("t")? as usize;
                for (k, &j) in d.iter().enumerate() {
                    check_input(t, i, j, args.input::<f64>(1 + k)?)?;
                }
                let value = compute_bound(iterations);
                args.output::<f64>(0)?.copy_from_slice(&output(t, i));
                checks.record(d.len(), value);
                Ok(())
            })?
            .with_index("t")
        };
        let mut ctx = if in_place {
            cluster.network_context()?
        } else {
            cluster.context(0, 0)?
        };
        let mut link = |spec: RoutineSpec| -> tributary::Result<RoutineHandle> {
            let r = ctx.link(spec)?;
            ctx = r.context();
            Ok(r)
        };
        let mut first = Vec::new();
        for i in lo..hi {
            first.push(link(spec(0, 0, i)?)?);
        }
        let mut tasks: [Vec<RoutineHandle>; 2] = [Vec::new(), Vec::new()];
        for p in [1, 0] {
            for i in lo..hi {
                tasks[p].push(link(spec(1, p, i)?)?);
            }
        }
        Ok(ClusterGraph {
            ctx,
            first,
            tasks,
            out,
            ghosts,
            lo,
        })
    }

    /// Issues `steps` timesteps and waits for them; seconds, barrier to barrier. With
    /// `replay: Some(k)` (`k` even), timesteps 1 to `k` are captured as one step and every
    /// later run of `k` is a replay of it (the timesteps left over at the end are issued).
    fn run(
        &self,
        cluster: &Cluster,
        steps: usize,
        replay: Option<usize>,
    ) -> tributary::Result<f64> {
        cluster.barrier()?;
        let start = Instant::now();
        for r in &self.first {
            r.schedule_with(&[("t", 0)])?;
        }
        let mut t = 1;
        if let Some(k) = replay.filter(|&k| steps > k) {
            let step = cluster.capture(|c| (1..=k).try_for_each(|t| self.timestep(c, t)))?;
            let mut values = step.step().bindings();
            t = k + 1;
            while t + k <= steps {
                values.shift("t", k as i64)?;
                cluster.replay_with(&step, &values)?;
                t += k;
            }
        }
        let mut calls = cluster;
        while t < steps {
            self.timestep(&mut calls, t)?;
            t += 1;
        }
        cluster.system().sync()?;
        cluster.barrier()?;
        Ok(start.elapsed().as_secs_f64())
    }

    /// Timestep `t ≥ 1`'s calls: the outputs of `t - 1` cross to the neighbours in one
    /// `exchange` (every boundary sent and received at once, as `MPI_Isend`/`MPI_Irecv`
    /// and one `MPI_Waitall`), then the rank's tasks.
    fn timestep(&self, calls: &mut impl Calls, t: usize) -> tributary::Result<()> {
        let p = t % 2;
        let ctx = self.ctx.protocol_context();
        // Inline (two neighbours, a send and a receive each): the loop allocates nothing of
        // its own, as the raw-MPI runners do not.
        let mut parts: smallvec::SmallVec<[Exchange<'_>; 4]> = smallvec::SmallVec::new();
        for (peer, column, ghost) in &self.ghosts[1 - p] {
            parts.push(Exchange::Send(&self.out[1 - p][column - self.lo], *peer));
            parts.push(Exchange::Recv(ghost, *peer));
        }
        if !parts.is_empty() {
            calls.exchange(&parts, ctx)?;
        }
        for r in &self.tasks[p] {
            calls.schedule_t(r, t as i64)?;
        }
        Ok(())
    }

    /// Finalizes the graph's context and the transfer routines the cluster keeps under it.
    fn finalize(self, cluster: &Cluster) -> tributary::Result<()> {
        cluster.finalize(self.ctx.protocol_context())
    }
}

/// Where a timestep's calls go: the cluster, or a capture of it.
trait Calls {
    /// Runs `parts` as one exchange.
    fn exchange(&mut self, parts: &[Exchange<'_>], ctx: &Context) -> tributary::Result<()>;
    fn schedule_t(&mut self, routine: &RoutineHandle, t: i64) -> tributary::Result<()>;
}

impl Calls for &Cluster {
    fn exchange(&mut self, parts: &[Exchange<'_>], ctx: &Context) -> tributary::Result<()> {
        Cluster::exchange(self, ctx, parts).map(drop)
    }
    fn schedule_t(&mut self, routine: &RoutineHandle, t: i64) -> tributary::Result<()> {
        routine.schedule_with(&[("t", t)]).map(drop)
    }
}

impl Calls for ClusterCapture<'_, '_> {
    fn exchange(&mut self, parts: &[Exchange<'_>], ctx: &Context) -> tributary::Result<()> {
        ClusterCapture::exchange(self, ctx, parts).map(drop)
    }
    fn schedule_t(&mut self, routine: &RoutineHandle, t: i64) -> tributary::Result<()> {
        self.system()
            .schedule_with(routine.routine(), &[("t", t)])
            .map(drop)
    }
}

/// The runners, the baseline first.
const RUNNERS: [&str; 5] = [
    "mpi",
    "mpi with headers",
    "cluster",
    "in place",
    "in place replayed",
];

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let cluster = Arc::new(Cluster::builder().cpu_devices(1).spawn()?);
    let (rank, ranks) = (cluster.rank(), cluster.size());
    if args.width < ranks {
        return Err(format!(
            "--width {} is fewer columns than the {ranks} ranks",
            args.width
        )
        .into());
    }
    if args.replay_timesteps < 2 || args.replay_timesteps % 2 != 0 {
        return Err(format!(
            "--replay-timesteps {} is not an even number of at least 2",
            args.replay_timesteps
        )
        .into());
    }
    let (lo, hi) = block(args.width, ranks, rank);
    let expected_inputs: u64 = (0..args.steps)
        .map(|t| {
            (lo..hi)
                .map(|i| deps(args.width, t, i).len() as u64)
                .sum::<u64>()
        })
        .sum();
    let tasks = (args.width * args.steps) as f64;
    let checks = Arc::new(Checks::default());
    // (runner, iterations, seconds)
    let mut runs: Vec<(&str, u64, f64)> = Vec::new();
    for runner in RUNNERS {
        let baseline = runner.starts_with("mpi");
        let chosen = if baseline {
            &args.baselines
        } else {
            &args.runners
        };
        if !chosen.is_empty() && !chosen.iter().any(|r| r == runner) {
            continue;
        }
        let mut iterations = args.max_iterations.max(1);
        loop {
            let graph = if baseline {
                None
            } else {
                Some(ClusterGraph::link(
                    &cluster,
                    args.width,
                    iterations,
                    &checks,
                    runner.starts_with("in place"),
                )?)
            };
            let mut best = f64::INFINITY;
            for _ in 0..args.samples.max(1) {
                checks.reset();
                let secs = match &graph {
                    Some(g) => g.run(
                        &cluster,
                        args.steps,
                        runner
                            .ends_with("replayed")
                            .then_some(args.replay_timesteps),
                    )?,
                    None => mpi_run(
                        &cluster,
                        args.width,
                        args.steps,
                        iterations,
                        checks.clone(),
                        runner == "mpi with headers",
                    )?,
                };
                if checks.inputs() != expected_inputs {
                    return Err(format!(
                        "rank {rank}, {runner}: {} inputs checked, {expected_inputs} expected",
                        checks.inputs()
                    )
                    .into());
                }
                best = best.min(secs);
            }
            if let Some(g) = graph {
                g.finalize(&cluster)?;
            }
            // Every rank takes the mean of the ranks' times (barrier to barrier, so nearly
            // equal), so all decide alike when to stop.
            let best = cluster.sum_host(&[best])?[0] / ranks as f64;
            runs.push((runner, iterations, best));
            let efficiency_floor = {
                let flops = tasks * flops_per_task(iterations) / best;
                let peak = runs
                    .iter()
                    .map(|&(_, it, s)| tasks * flops_per_task(it) / s)
                    .fold(0.0, f64::max);
                flops / peak
            };
            if iterations <= 1 || efficiency_floor < 0.25 {
                break;
            }
            iterations /= 2;
        }
    }
    let peak = runs
        .iter()
        .map(|&(_, it, s)| tasks * flops_per_task(it) / s)
        .fold(0.0, f64::max);
    if rank == 0 {
        println!(
            "stencil_1d, width {}, {} timesteps, {ranks} ranks (one core each); best of {} \
             runs per granularity; replays of {} timesteps",
            args.width, args.steps, args.samples, args.replay_timesteps
        );
        let mut metgs = Vec::new();
        for runner in RUNNERS
            .into_iter()
            .filter(|r| runs.iter().any(|x| x.0 == *r))
        {
            let points: Vec<Point> = runs
                .iter()
                .filter(|r| r.0 == runner)
                .map(|&(_, it, s)| Point {
                    flops: tasks * flops_per_task(it) / s,
                    granularity_us: s * 1e6 * ranks as f64 / tasks,
                })
                .collect();
            for p in &points {
                println!(
                    "  {runner:>8}: granularity {:>9.2} us, efficiency {:>5.1}%",
                    p.granularity_us,
                    100.0 * p.flops / peak
                );
            }
            metgs.push((runner, metg(&points, peak, 0.5)));
        }
        println!("| runner | METG(50%) | ratio to MPI | ratio to MPI with headers |");
        println!("|---|---:|---:|---:|");
        let metg_of = |name: &str| metgs.iter().find(|m| m.0 == name).and_then(|m| m.1);
        let (base, headers) = (metg_of("mpi"), metg_of("mpi with headers"));
        let ratio =
            |m: f64, b: Option<f64>| b.map_or("-".to_string(), |b| format!("{:.1}x", m / b));
        for (runner, m) in metgs {
            match m {
                Some(m) => println!(
                    "| {runner} | {m:.2} us | {} | {} |",
                    ratio(m, base),
                    ratio(m, headers)
                ),
                None => println!("| {runner} | never 50% efficient | - | - |"),
            }
        }
    }
    cluster.shutdown()?;
    Ok(())
}
