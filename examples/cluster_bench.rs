//! Cross-rank all-reduce bandwidth of a tributary cluster beside `MPI_Allreduce` on
//! buffers of the same size, in the same run (feature `mpi`).
//!
//! Every rank runs this program (`mpirun -np R`); rank 0 prints. For each size it times,
//! on the same ranks: `MPI_Allreduce` (sum, out of place, f32) on plain vectors, run on the
//! cluster's network stream through `Cluster::with_mpi`; then the cluster's hierarchical
//! all-reduce of one node over this rank's `--devices` contexts with each cross-rank
//! algorithm (`direct`, `ring`, `mpi` = `MPI_Iallreduce`), issued `iters` times back to
//! back and waited for at the end (the training loop's shape), the ring again replayed
//! from a capture of it (`Cluster::capture`), and the `auto` algorithm in place: context 0
//! on the network stream (`Cluster::network_context`), so the network routine reduces its
//! buffer itself. It prints the median time
//! per all-reduce over `--reps` repetitions, the bus bandwidth `2 (R-1)/R · bytes / time`
//! and the ratio to `MPI_Allreduce`.
//!
//! ```sh
//! cargo build --release --features mpi --example cluster_bench
//! mpirun -np 2 target/release/examples/cluster_bench                 # 2 ranks x 1 device
//! mpirun -np 2 target/release/examples/cluster_bench --devices 2     # hierarchical 2 x 2
//! mpirun -np 4 target/release/examples/cluster_bench                 # flat 4 x 1
//! mpirun -np 2 target/release/examples/cluster_bench --pingpong      # send/recv round trips
//! mpirun -np 2 target/release/examples/cluster_bench --exchange      # sendrecv halo exchanges
//! mpirun -np 2 target/release/examples/cluster_bench --barrier       # Cluster::barrier
//! ```
//!
//! `--barrier` times `Cluster::barrier` beside `MPI_Barrier` on the network stream: hot
//! (back to back) and idle (each after a 2 ms sleep, every thread of the rank parked), the
//! time of the barrier call alone, median of `--reps` runs of 200 (idle: 50).
//!
//! `--exchange` times halo exchanges between partner ranks (0 and 1, 2 and 3, ...), each
//! sending a node of `--sizes` bytes and receiving the other's in one `Cluster::sendrecv`,
//! `iters` of them issued back to back and waited for at the end, beside `MPI_Sendrecv` of
//! the same bytes on the network stream, from a context on a compute stream and in place.
//!
//! `--pingpong` times instead round trips of a node of `--sizes` bytes between ranks 0 and 1
//! (`Cluster::send` then `Cluster::recv` on rank 0, the reverse on rank 1, `iters` of them
//! issued back to back and waited for at the end) beside `MPI_Send`/`MPI_Recv` of the same
//! bytes on the network stream, from a context on a compute stream and in place (the node
//! in a context on the network stream).
//!
//! Both point-to-point modes also time the same calls on raw MPI with the cluster's header
//! protocol written by hand ("MPI with headers", `examples/cluster/header_wire.rs`: each
//! side of a transfer sends its header, the sender's with the data, and checks the other's).
//! Its ratio to the plain calls is the protocol's price; the last column, the replayed
//! calls' time over it, is the runtime's.

#[path = "common/mod.rs"]
mod common;
#[path = "cluster/header_wire.rs"]
mod header_wire;

use std::{process::ExitCode, sync::Arc, time::Instant};

use clap::Parser;
use header_wire::{HeaderWire, Part};
use tributary::protocol::Context;
use tributary::{
    collective::{ReduceOp, Strategy},
    kernels::{Access, RoutineSpec},
    DType, MemoryMode, TensorNode,
};
use tributary_actors::cluster::{
    mpi_crate::ffi, Cluster, ClusterCapture, ClusterTicket, CrossRankAlgorithm,
};

#[derive(Parser, Debug)]
#[command(about = "Cross-rank all-reduce bandwidth beside MPI_Allreduce (run under mpirun)")]
struct Args {
    /// CPU devices per rank (contexts reduced inside the rank before the cross-rank step).
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// Sizes in bytes (f32 elements x 4).
    #[arg(long, value_delimiter = ',', default_values_t = [4096usize, 65536, 1 << 20, 16 << 20])]
    sizes: Vec<usize>,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Largest total bytes moved per timed repetition (sets the iterations per size).
    #[arg(long, default_value_t = 64 << 20)]
    budget: usize,
    /// Time send/recv round trips between ranks 0 and 1 instead of all-reduces.
    #[arg(long)]
    pingpong: bool,
    /// Time only the all-reduces in place (issued and replayed), beside `MPI_Allreduce`.
    #[arg(long)]
    in_place_only: bool,
    /// Calls per captured step in the "replayed, steps of K" columns: all-reduces of as many
    /// distinct nodes (a training step's gradient buckets), or round trips, or exchanges;
    /// the time is reported per call.
    #[arg(long, default_value_t = 8)]
    step_calls: usize,
    /// Time halo exchanges instead: ranks 0 and 1 (2 and 3, ...) each send a node of
    /// `--sizes` bytes to the other and receive the other's, `Cluster::sendrecv` beside
    /// `MPI_Sendrecv`.
    #[arg(long)]
    exchange: bool,
    /// Time `Cluster::barrier` beside `MPI_Barrier`, hot and idle.
    #[arg(long)]
    barrier: bool,
}

fn main() -> ExitCode {
    common::init_logging();
    common::exit_code(run(Args::parse()))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Seconds per `MPI_Allreduce` of `n` f32, on the network stream.
fn mpi_allreduce(cluster: &Cluster, n: usize, iters: usize) -> Result<f64, tributary::Error> {
    cluster.with_mpi(move |comm| {
        let send = vec![1f32; n];
        let mut recv = vec![0f32; n];
        // SAFETY: both buffers hold `n` f32 and live through the blocking calls; the
        // communicator is the cluster's, used on the network stream (`with_mpi`).
        unsafe {
            ffi::MPI_Barrier(comm.raw());
            let t = Instant::now();
            for _ in 0..iters {
                ffi::MPI_Allreduce(
                    send.as_ptr().cast(),
                    recv.as_mut_ptr().cast(),
                    n as i32,
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_SUM,
                    comm.raw(),
                );
            }
            t.elapsed().as_secs_f64() / iters as f64
        }
    })
}

/// Seconds per round trip of `n` f32 between ranks 0 and 1 (`MPI_Send` then `MPI_Recv` on
/// rank 0, the reverse on rank 1), on the network stream.
fn mpi_pingpong(cluster: &Cluster, n: usize, iters: usize) -> Result<f64, tributary::Error> {
    cluster.with_mpi(move |comm| {
        let mut buf = vec![1f32; n];
        let (ptr, count) = (buf.as_mut_ptr().cast(), n as i32);
        // SAFETY: `buf` holds `n` f32 and lives through the blocking calls; the communicator
        // is the cluster's, used on the network stream (`with_mpi`).
        unsafe {
            ffi::MPI_Barrier(comm.raw());
            let t = Instant::now();
            for _ in 0..iters {
                match comm.rank() {
                    0 => {
                        ffi::MPI_Send(ptr, count, ffi::RSMPI_FLOAT, 1, 7, comm.raw());
                        ffi::MPI_Recv(
                            ptr,
                            count,
                            ffi::RSMPI_FLOAT,
                            1,
                            7,
                            comm.raw(),
                            ffi::RSMPI_STATUS_IGNORE,
                        );
                    }
                    1 => {
                        ffi::MPI_Recv(
                            ptr,
                            count,
                            ffi::RSMPI_FLOAT,
                            0,
                            7,
                            comm.raw(),
                            ffi::RSMPI_STATUS_IGNORE,
                        );
                        ffi::MPI_Send(ptr, count, ffi::RSMPI_FLOAT, 0, 7, comm.raw());
                    }
                    _ => {}
                }
            }
            t.elapsed().as_secs_f64() / iters as f64
        }
    })
}

/// Seconds per call of `bytes` from the root context, `iters` calls issued back to back or,
/// with calls per captured step (not 0), replayed in steps of that many.
type TimedCalls = fn(
    &Cluster,
    &Args,
    usize,
    tributary_actors::ContextHandle,
    usize,
    usize,
) -> Result<f64, Box<dyn std::error::Error>>;

/// For each of `--sizes`: the median of `baseline` (raw MPI, seconds per call for `n` f32
/// and `iters` calls) and of `with_headers` (the same calls on raw MPI with the cluster's
/// header protocol written by hand, [`HeaderWire`]), then `timed` (`bytes`, the root
/// context, `iters`, calls per captured step or 0 to issue each call) from a context on a
/// compute stream, in place on the network stream, and in place replayed in steps of
/// `--step-calls`; rank 0 prints them with their ratios to the baseline, and the replayed
/// calls' ratio to `with_headers`.
fn point_to_point(
    cluster: &Cluster,
    args: &Args,
    title: &str,
    [mpi, tributary]: [&str; 2],
    [baseline, with_headers]: [Baseline; 2],
    timed: TimedCalls,
) -> Result<(), Box<dyn std::error::Error>> {
    let rank = cluster.rank();
    if rank == 0 {
        println!("{title}; median of {} repetitions", args.reps);
        println!(
            "{:>10} {:>20} {:>22} {:>8} {:>22} {:>8} {:>22} {:>8} {:>22} {:>8} {:>13}",
            "bytes",
            mpi,
            "MPI with headers",
            "ratio",
            tributary,
            "ratio",
            "in place",
            "ratio",
            format!("replayed, steps of {}", args.step_calls),
            "ratio",
            "to headers"
        );
    }
    for &bytes in &args.sizes {
        let n = (bytes / 4).max(1);
        let iters = (args.budget / bytes.max(1)).clamp(3, 1000);
        let base = median(
            (0..args.reps)
                .map(|_| baseline(cluster, n, iters))
                .collect::<Result<_, _>>()?,
        );
        let headers = median(
            (0..args.reps)
                .map(|_| with_headers(cluster, n, iters))
                .collect::<Result<_, _>>()?,
        );
        let mut times = Vec::new();
        for (root, step_calls) in [
            (cluster.context(0, 0)?, 0),
            (cluster.network_context()?, 0),
            (cluster.network_context()?, args.step_calls.max(1)),
        ] {
            times.push(timed(cluster, args, bytes, root, iters, step_calls)?);
        }
        if rank == 0 {
            println!(
                "{bytes:>10} {:>17.1} us {:>19.1} us {:>7.2}x {:>19.1} us {:>7.2}x {:>19.1} us {:>7.2}x {:>19.1} us {:>7.2}x {:>12.2}x",
                base * 1e6,
                headers * 1e6,
                headers / base,
                times[0] * 1e6,
                times[0] / base,
                times[1] * 1e6,
                times[1] / base,
                times[2] * 1e6,
                times[2] / base,
                times[2] / headers
            );
        }
    }
    Ok(())
}

/// Seconds per call of `n` f32 and `iters` calls, on raw MPI.
type Baseline = fn(&Cluster, usize, usize) -> Result<f64, tributary::Error>;

/// [`mpi_pingpong`] with the cluster's header protocol ([`HeaderWire`]): a round trip is a
/// transfer from rank 0 to rank 1 and one back, each a header exchange carrying the data,
/// which the receiver copies into its buffer.
fn mpi_pingpong_with_headers(
    cluster: &Cluster,
    n: usize,
    iters: usize,
) -> Result<f64, tributary::Error> {
    cluster
        .with_mpi(move |comm| {
            let mut wire = HeaderWire::new(1, 4 * n);
            let mut data = vec![1u8; 4 * n];
            let rank = comm.rank();
            // SAFETY: the communicator is the cluster's, used on the network stream, and
            // ranks 0 and 1 run matching calls.
            unsafe {
                ffi::MPI_Barrier(comm.raw());
                let t = Instant::now();
                if rank < 2 {
                    for i in 0..iters as u64 {
                        for (call, sender) in [(2 * i, 0), (2 * i + 1, 1)] {
                            let part = Part {
                                peer: 1 - rank as i32,
                                tag: 7,
                                send: (rank == sender).then_some(&data[..]),
                            };
                            wire.call(comm.raw(), call, &[part])?;
                            if rank != sender {
                                data.copy_from_slice(wire.received(0));
                            }
                        }
                    }
                }
                Ok(t.elapsed().as_secs_f64() / iters as f64)
            }
        })?
        .map_err(tributary::Error::Internal)
}

/// [`mpi_exchange`] with the cluster's header protocol ([`HeaderWire`]): an exchange is
/// two transfers posted at once, the lower rank's first (DESIGN.md §9, "One order per
/// pair").
fn mpi_exchange_with_headers(
    cluster: &Cluster,
    n: usize,
    iters: usize,
) -> Result<f64, tributary::Error> {
    let peer = partner(cluster);
    cluster
        .with_mpi(move |comm| {
            let mut wire = HeaderWire::new(2, 4 * n);
            let (own, mut halo) = (vec![1u8; 4 * n], vec![0u8; 4 * n]);
            let rank = comm.rank();
            // SAFETY: the communicator is the cluster's, used on the network stream, and
            // partner ranks run matching calls.
            unsafe {
                ffi::MPI_Barrier(comm.raw());
                let t = Instant::now();
                if let Some(peer) = peer {
                    for i in 0..iters as u64 {
                        let mine = || Some(&own[..]);
                        let parts = [8, 9].map(|tag| {
                            let sends = (tag == 8) == (rank < peer);
                            Part {
                                peer: peer as i32,
                                tag,
                                send: if sends { mine() } else { None },
                            }
                        });
                        wire.call(comm.raw(), i, &parts)?;
                        let received = if rank < peer { 1 } else { 0 };
                        halo.copy_from_slice(wire.received(received));
                    }
                }
                Ok(t.elapsed().as_secs_f64() / iters as f64)
            }
        })?
        .map_err(tributary::Error::Internal)
}

/// The partner of this rank in the exchanges (ranks 0 and 1, 2 and 3, ...), if it has one.
fn partner(cluster: &Cluster) -> Option<usize> {
    let peer = cluster.rank() ^ 1;
    (peer < cluster.size()).then_some(peer)
}

/// Seconds per exchange of `n` f32 with the partner rank by `MPI_Sendrecv` (what a careful
/// engineer writes for a halo exchange: one blocking call, both directions at once), on the
/// network stream.
fn mpi_exchange(cluster: &Cluster, n: usize, iters: usize) -> Result<f64, tributary::Error> {
    let peer = partner(cluster);
    cluster.with_mpi(move |comm| {
        let (send, mut recv) = (vec![1f32; n], vec![0f32; n]);
        let count = n as i32;
        // SAFETY: `send` and `recv` hold `n` f32 each and live through the blocking calls;
        // the communicator is the cluster's, used on the network stream (`with_mpi`).
        unsafe {
            ffi::MPI_Barrier(comm.raw());
            let t = Instant::now();
            if let Some(peer) = peer {
                for _ in 0..iters {
                    ffi::MPI_Sendrecv(
                        send.as_ptr().cast(),
                        count,
                        ffi::RSMPI_FLOAT,
                        peer as i32,
                        7,
                        recv.as_mut_ptr().cast(),
                        count,
                        ffi::RSMPI_FLOAT,
                        peer as i32,
                        7,
                        comm.raw(),
                        ffi::RSMPI_STATUS_IGNORE,
                    );
                }
            }
            t.elapsed().as_secs_f64() / iters as f64
        }
    })
}

/// The median time of a sendrecv of `bytes` with the partner rank, the nodes in a child of
/// `root`: this rank's `h{bytes}.{rank}` sent, the partner's received (a node is named
/// after the rank that owns it).
fn time_exchange(
    cluster: &Cluster,
    args: &Args,
    bytes: usize,
    root: tributary_actors::ContextHandle,
    iters: usize,
    step_calls: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let n = (bytes / 4).max(1);
    let owned_by = |r: usize| {
        TensorNode::new(format!("h{bytes}.{r}"), DType::F32, [n]).with_mode(MemoryMode::on_device())
    };
    let own = owned_by(cluster.rank())?;
    let ctx = ones(&root, &own)?;
    let Some(peer) = partner(cluster) else {
        let t = per_call(cluster, args.reps, iters, || Ok(None))?;
        cluster.finalize(&ctx)?;
        return Ok(t);
    };
    let halo = owned_by(peer)?;
    let ctx = ones(&ctx, &halo)?;
    let p = ctx.protocol_context();
    let t = time_calls(cluster, args, iters, step_calls, |c| {
        c.sendrecv(&own, peer, &halo, peer, p)
    })?;
    cluster.finalize(&ctx)?;
    Ok(t)
}

/// The calls a point-to-point benchmark makes, to the cluster or to a capture of it.
trait PointCalls {
    fn send(&mut self, node: &TensorNode, ctx: &Context, to: usize) -> CallResult;
    fn recv(&mut self, node: &TensorNode, ctx: &Context, from: usize) -> CallResult;
    fn sendrecv(
        &mut self,
        send: &TensorNode,
        to: usize,
        recv: &TensorNode,
        from: usize,
        ctx: &Context,
    ) -> CallResult;
}

type CallResult = tributary::Result<ClusterTicket>;

/// `PointCalls` for `$for`, each call its inherent method of `$owner`.
macro_rules! point_calls {
    ($for:ty => $owner:ident) => {
        impl PointCalls for $for {
            fn send(&mut self, node: &TensorNode, ctx: &Context, to: usize) -> CallResult {
                $owner::send(self, node, ctx, to)
            }
            fn recv(&mut self, node: &TensorNode, ctx: &Context, from: usize) -> CallResult {
                $owner::recv(self, node, ctx, from)
            }
            fn sendrecv(
                &mut self,
                send: &TensorNode,
                to: usize,
                recv: &TensorNode,
                from: usize,
                ctx: &Context,
            ) -> CallResult {
                $owner::sendrecv(self, send, to, recv, from, ctx)
            }
        }
    };
}

point_calls!(&Cluster => Cluster);
point_calls!(ClusterCapture<'_, '_> => ClusterCapture);

/// Seconds per `call` (which returns the ticket of its last operation), warmed up once:
/// `iters` calls issued back to back (`step_calls` 0), or `step_calls` of them captured as
/// one step and replayed for `iters` calls' worth, the time divided by the calls.
fn time_calls(
    cluster: &Cluster,
    args: &Args,
    iters: usize,
    step_calls: usize,
    call: impl Fn(&mut dyn PointCalls) -> CallResult,
) -> tributary::Result<f64> {
    call(&mut &*cluster)?.wait()?;
    if step_calls == 0 {
        return per_call(cluster, args.reps, iters, || {
            Ok(Some(call(&mut &*cluster)?))
        });
    }
    let step = cluster.capture(|c| (0..step_calls).try_for_each(|_| call(c).map(drop)))?;
    let replays = iters.div_ceil(step_calls);
    let t = per_call(cluster, args.reps, replays, || {
        Ok(Some(cluster.replay(&step)?))
    })?;
    Ok(t / step_calls as f64)
}

/// A child of `root` in which `node` (f32) holds ones, written by a routine.
fn ones(
    root: &tributary_actors::ContextHandle,
    node: &TensorNode,
) -> tributary::Result<tributary_actors::ContextHandle> {
    let r = root.link(RoutineSpec::custom(
        "init",
        vec![(node.clone(), Access::Write)],
        None,
        |a| {
            a.output::<f32>(0)?.fill(1.0);
            Ok(())
        },
    )?)?;
    r.schedule()?;
    Ok(r.context())
}

/// The median time of a send/recv round trip of `bytes` (node `x{bytes}`, f32) between
/// ranks 0 and 1, the node in a child of `root`.
fn time_pingpong(
    cluster: &Cluster,
    args: &Args,
    bytes: usize,
    root: tributary_actors::ContextHandle,
    iters: usize,
    step_calls: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let rank = cluster.rank();
    let node = &TensorNode::new(format!("x{bytes}"), DType::F32, [(bytes / 4).max(1)])
        .with_mode(MemoryMode::on_device())?;
    let ctx = ones(&root, node)?;
    let p = ctx.protocol_context();
    let t = if rank < 2 && cluster.size() >= 2 {
        let peer = 1 - rank;
        time_calls(cluster, args, iters, step_calls, |c| {
            if rank == 0 {
                c.send(node, p, peer)?;
                c.recv(node, p, peer)
            } else {
                c.recv(node, p, peer)?;
                c.send(node, p, peer)
            }
        })?
    } else {
        per_call(cluster, args.reps, iters, || Ok(None))?
    };
    cluster.finalize(&ctx)?;
    Ok(t)
}

/// Seconds per all-reduce of `--step-calls` nodes of `bytes` each (a training step's
/// gradient buckets), in place (the first replica on the network stream), captured as one
/// step of one all-reduce per node and replayed: the median over `--reps` of `iters`
/// all-reduces' worth of replays, divided by the all-reduces.
fn time_step_reduces(
    cluster: &Cluster,
    args: &Args,
    bytes: usize,
    iters: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let k = args.step_calls.max(1);
    let n = (bytes / 4).max(1);
    let mut nodes = Vec::new();
    for j in 0..k {
        nodes.push(
            TensorNode::new(format!("g{bytes}.{j}"), DType::F32, [n])
                .with_mode(MemoryMode::on_device())?,
        );
    }
    let mut replicas = Vec::new();
    for d in 0..args.devices {
        let mut ctx = if d == 0 {
            cluster.network_context()?
        } else {
            cluster.context(d, 0)?
        };
        for node in &nodes {
            ctx = ones(&ctx, node)?;
        }
        replicas.push(ctx);
    }
    let plans = nodes
        .iter()
        .map(|node| {
            cluster.all_reduce_plan(
                std::slice::from_ref(node),
                &replicas,
                ReduceOp::Mean,
                Strategy::Tree,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    // Warm-up: buffers allocated, pages touched.
    for plan in &plans {
        plan.run()?.wait()?;
    }
    let step = cluster.capture(|c| plans.iter().try_for_each(|p| c.all_reduce(p).map(drop)))?;
    let steps = iters.div_ceil(k);
    let t = per_call(cluster, args.reps, steps, || {
        Ok(Some(cluster.replay(&step)?))
    })?;
    for plan in plans {
        plan.finalize()?;
    }
    for ctx in replicas {
        ctx.finalize()?;
    }
    Ok(t / k as f64)
}

/// The median over `reps` repetitions (every rank starting together) of the time per call
/// of `issue`, called `iters` times back to back with only the last call's ticket waited
/// for.
fn per_call(
    cluster: &Cluster,
    reps: usize,
    iters: usize,
    mut issue: impl FnMut() -> tributary::Result<Option<ClusterTicket>>,
) -> tributary::Result<f64> {
    let mut times = Vec::new();
    for _ in 0..reps {
        cluster.barrier()?;
        let t = Instant::now();
        let mut last = None;
        for _ in 0..iters {
            last = issue()?;
        }
        if let Some(l) = last {
            l.wait()?;
        }
        times.push(t.elapsed().as_secs_f64() / iters as f64);
    }
    Ok(median(times))
}

/// The sleep before each barrier of the idle runs: long enough for every thread of the
/// rank to park.
const IDLE: std::time::Duration = std::time::Duration::from_millis(2);

/// Seconds per `MPI_Barrier` on the network stream, `iters` of them, each after a sleep of
/// [`IDLE`] if `idle` (only the barrier timed).
fn mpi_barrier(cluster: &Cluster, iters: usize, idle: bool) -> Result<f64, tributary::Error> {
    cluster.with_mpi(move |comm| {
        let mut total = 0.0;
        // SAFETY: the communicator is the cluster's, used on the network stream
        // (`with_mpi`), and every rank makes the same calls.
        unsafe {
            ffi::MPI_Barrier(comm.raw());
            for _ in 0..iters {
                if idle {
                    std::thread::sleep(IDLE);
                }
                let t = Instant::now();
                ffi::MPI_Barrier(comm.raw());
                total += t.elapsed().as_secs_f64();
            }
        }
        total / iters as f64
    })
}

/// Seconds per [`Cluster::barrier`], `iters` of them, each after a sleep of [`IDLE`] if
/// `idle` (only the barrier timed).
fn cluster_barrier(cluster: &Cluster, iters: usize, idle: bool) -> tributary::Result<f64> {
    cluster.barrier()?;
    let mut total = 0.0;
    for _ in 0..iters {
        if idle {
            std::thread::sleep(IDLE);
        }
        let t = Instant::now();
        cluster.barrier()?;
        total += t.elapsed().as_secs_f64();
    }
    Ok(total / iters as f64)
}

/// `--barrier`: `Cluster::barrier` beside `MPI_Barrier`, hot and idle, medians of `--reps`.
fn barriers(cluster: &Cluster, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    if cluster.rank() == 0 {
        println!(
            "{} ranks; barrier time in µs, median of {} runs (hot: 200 back to back; idle: 50, \
             each after a {} ms sleep)",
            cluster.size(),
            args.reps,
            IDLE.as_millis()
        );
        println!("| | MPI_Barrier | Cluster::barrier | ratio |");
        println!("|---|---:|---:|---:|");
    }
    for (name, idle, iters) in [("hot", false, 200), ("idle", true, 50)] {
        let (mut raw, mut ours) = (Vec::new(), Vec::new());
        for _ in 0..args.reps.max(1) {
            raw.push(mpi_barrier(cluster, iters, idle)?);
            ours.push(cluster_barrier(cluster, iters, idle)?);
        }
        let (raw, ours) = (median(raw) * 1e6, median(ours) * 1e6);
        if cluster.rank() == 0 {
            println!(
                "| {name} | {raw:.2} | {ours:.2} | {:.1}x |",
                ours / raw.max(f64::MIN_POSITIVE)
            );
        }
    }
    Ok(())
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let cluster = Arc::new(Cluster::builder().cpu_devices(args.devices).spawn()?);
    if args.barrier {
        barriers(&cluster, &args)?;
        cluster.shutdown()?;
        return Ok(());
    }
    if args.pingpong {
        point_to_point(
            &cluster,
            &args,
            "round trips between ranks 0 and 1 (Cluster::send, then Cluster::recv)",
            ["MPI_Send/MPI_Recv", "send/recv"],
            [mpi_pingpong, mpi_pingpong_with_headers],
            time_pingpong,
        )?;
        cluster.shutdown()?;
        return Ok(());
    }
    if args.exchange {
        point_to_point(
            &cluster,
            &args,
            "halo exchanges between partner ranks (0 and 1, ...; Cluster::sendrecv)",
            ["MPI_Sendrecv", "sendrecv"],
            [mpi_exchange, mpi_exchange_with_headers],
            time_exchange,
        )?;
        cluster.shutdown()?;
        return Ok(());
    }
    let (rank, ranks) = (cluster.rank(), cluster.size());
    if rank == 0 {
        println!(
            "{ranks} ranks x {} CPU devices; median of {} repetitions; bus bandwidth = 2(R-1)/R x bytes / time",
            args.devices, args.reps
        );
        println!(
            "{:>10} {:>14} {:>10} {:>22} {:>22} {:>22} {:>22} {:>22} {:>22} {:>22}",
            "bytes",
            "MPI_Allreduce",
            "GB/s",
            "direct (ratio)",
            "ring (ratio)",
            "mpi (ratio)",
            "ring replayed (ratio)",
            "auto in place (ratio)",
            "in place replayed",
            format!("replayed, steps of {}", args.step_calls)
        );
    }
    let bus = |bytes: usize, secs: f64| {
        2.0 * (ranks - 1) as f64 / ranks as f64 * bytes as f64 / secs / 1e9
    };
    for &bytes in &args.sizes {
        let n = (bytes / 4).max(1);
        let iters = (args.budget / bytes.max(1)).clamp(3, 2000);
        let node = TensorNode::new(format!("g{bytes}"), DType::F32, [n])
            .with_mode(MemoryMode::on_device())?;
        let init = |root: tributary_actors::ContextHandle| ones(&root, &node);
        let mut contexts = Vec::new();
        // The same replicas with the first on the network stream (the all-reduce in place).
        let mut in_place = Vec::new();
        for d in 0..args.devices {
            contexts.push(init(cluster.context(d, 0)?)?);
            in_place.push(if d == 0 {
                init(cluster.network_context()?)?
            } else {
                contexts[d].clone()
            });
        }
        let baseline = median(
            (0..args.reps)
                .map(|_| mpi_allreduce(&cluster, n, iters))
                .collect::<Result<_, _>>()?,
        );
        let mut cells = Vec::new();
        for (algorithm, replayed, replicas) in [
            (CrossRankAlgorithm::Direct, false, &contexts),
            (CrossRankAlgorithm::Ring, false, &contexts),
            (CrossRankAlgorithm::Mpi, false, &contexts),
            (CrossRankAlgorithm::Ring, true, &contexts),
            (CrossRankAlgorithm::Auto, false, &in_place),
            (CrossRankAlgorithm::Auto, true, &in_place),
        ] {
            if args.in_place_only && !std::ptr::eq(replicas, &in_place) {
                cells.push(format!("{:>22}", "-"));
                continue;
            }
            let plan = cluster
                .all_reduce_plan(
                    std::slice::from_ref(&node),
                    replicas,
                    ReduceOp::Mean,
                    Strategy::Tree,
                )?
                .with_algorithm(algorithm);
            // Warm-up: buffers allocated, pages touched.
            plan.run()?.wait()?;
            // Replayed: the all-reduce captured once (`Cluster::capture`), then replayed.
            let step = if replayed {
                Some(cluster.capture(|c| c.all_reduce(&plan).map(drop))?)
            } else {
                None
            };
            let t = per_call(&cluster, args.reps, iters, || {
                Ok(Some(match &step {
                    Some(step) => cluster.replay(step)?,
                    None => plan.run()?,
                }))
            })?;
            plan.finalize()?;
            cells.push(format!(
                "{:>7.2} GB/s ({:.2}x)",
                bus(bytes, t),
                baseline / t
            ));
        }
        let t = time_step_reduces(&cluster, &args, bytes, iters)?;
        cells.push(format!(
            "{:>7.2} GB/s ({:.2}x)",
            bus(bytes, t),
            baseline / t
        ));
        if rank == 0 {
            println!(
                "{bytes:>10} {:>11.1} us {:>10.2} {:>22} {:>22} {:>22} {:>22} {:>22} {:>22} {:>22}",
                baseline * 1e6,
                bus(bytes, baseline),
                cells[0],
                cells[1],
                cells[2],
                cells[3],
                cells[4],
                cells[5],
                cells[6]
            );
        }
        for ctx in contexts.into_iter().chain(in_place.into_iter().take(1)) {
            ctx.finalize()?;
        }
    }
    cluster.shutdown()?;
    Ok(())
}
