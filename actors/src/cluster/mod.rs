//! A cluster of systems across processes on MPI, behind the feature `mpi`.
//!
//! Data-parallel training outgrows one machine. This module lets a tributary program span
//! several processes, on one machine or many, with the same promise as one [`System`]:
//! program order is the specification, and no barrier is written by hand.
//!
//! Each MPI rank runs a [`Cluster`]: a [`System`] over its local CPU devices plus a *network
//! stream*, the last stream of device 0. Network operations are routines on that stream,
//! ordered like any other work, so compute overlaps communication. Only that stream's worker
//! calls MPI, and it polls against a deadline, so a dead rank is an error, not a hang.
//!
//! Every rank must issue the same cluster operations in the same order, from one host
//! thread. Otherwise every rank gets [`Error::CollectiveMismatch`]. A rank that exited, died
//! or stopped issuing is [`Error::RankUnreachable`] on the others, within
//! [`ClusterConfig::deadline`]. Either fault stops the cluster; the local [`System`] keeps
//! serving local work. A failed input fails only its operation, on the other ranks with
//! [`Error::RankInputFailed`].
//!
//! After a rank fault, [`Cluster::shutdown`] waits for `MPI_Finalize` at most the deadline,
//! then returns the fault. DESIGN.md §9 explains the design and its costs.
//!
//! ```no_run
//! use tributary::{collective::{ReduceOp, Strategy}, kernels, DType, MemoryMode};
//! use tributary_actors::cluster::Cluster;
//! // mpirun -np 2 <this program>: every rank runs the same code.
//! let cluster = Cluster::builder().cpu_devices(2).spawn()?;
//! let g = cluster.system().node("g", DType::F32, [1024]).with_mode(MemoryMode::on_device())?;
//! let mut replicas = Vec::new();
//! for d in 0..2 {
//!     let r = cluster.context(d, 0)?.link(kernels::fill(&g, cluster.rank() as f64)?)?;
//!     r.schedule()?;
//!     replicas.push(r.context());
//! }
//! let plan = cluster.all_reduce_plan(&[g.clone()], &replicas, ReduceOp::Sum, Strategy::Tree)?;
//! plan.run()?.wait()?; // 2 ranks x 2 devices: 0 + 0 + 1 + 1
//! assert_eq!(replicas[1].read::<f32>(&g)?, vec![2.0; 1024]);
//! cluster.shutdown()?;
//! # Ok::<(), tributary::Error>(())
//! ```

mod config;
pub(crate) mod header;
mod mpi;
mod network;
mod plan;
mod reduce;
mod step;

/// The unit tests' random numbers: a xorshift generator from `seed` (deterministic, so a
/// failure replays).
#[cfg(test)]
fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc, Mutex,
};

pub use ::mpi as mpi_crate;
pub use config::{ClusterBuilder, ClusterConfig};
pub use header::CrossRankAlgorithm;
pub use plan::{ClusterAllReduce, ClusterBucketedAllReduce, ClusterTicket};
pub use step::{ClusterCapture, ClusterStep};
use tributary::{
    backend::Backend,
    ids::IdMap,
    kernels::{Access, RoutineSpec},
    protocol::Context,
    ContextId, DType, DeviceId, Error, MemoryMode, MergeBufferUse, NodeId, Result, TensorNode,
};

use crate::{ContextHandle, RoutineHandle, System, Ticket};
use header::{OpDesc, OpKind};
use network::{Network, ReplayTickets};
use plan::{noting, SystemCalls};
use smallvec::SmallVec;

/// This rank's part of a cluster: its [`System`], its network stream and MPI.
///
/// Created once per process ([`Cluster::builder`]); MPI is initialised by it and finalised
/// by [`Cluster::shutdown`] (or its drop).
pub struct Cluster {
    sys: System,
    /// The backend the system runs on, kept until after `MPI_Finalize` (module docs).
    backend: Arc<dyn Backend>,
    net: Arc<Network>,
    devices: Vec<usize>,
    compute_streams: usize,
    net_root: ContextHandle,
    token: TensorNode,
    shut_down: AtomicBool,
    /// Serialises issuing network operations (sequence numbers follow issue order); holds
    /// the tickets the last replays' network operations read their events from.
    issuing: Mutex<ReplayTickets>,
    /// Transfer routines linked once and kept for the next transfer of the same node
    /// between the same context and rank, until the cluster shuts down (linking and
    /// finalizing per call cost two round trips to the device actor each). Looked up at
    /// every transfer call: hashed by `IdHasher` (the keys are the runtime's ids; SipHash
    /// was about 700 instructions of an exchange call), each shared, not copied out.
    transfers: Mutex<IdMap<TransferKey, Arc<KeptTransfer>>>,
    /// The barrier's routine and description, linked at the first [`Cluster::barrier`] and
    /// kept until the cluster shuts down, as the transfer routines are: linking and
    /// finalizing it per barrier cost about 20 µs of the host's time a barrier.
    barrier: Mutex<Option<(RoutineHandle, OpDesc)>>,
}

/// A kept transfer routine and the descriptions of the transfers it runs (one, or a
/// sendrecv's two in issue order), cloned onto the issue queue at every call without
/// allocating.
struct KeptTransfer {
    routine: RoutineHandle,
    descs: SmallVec<[OpDesc; 4]>,
}

/// What a kept transfer routine moves: a node, from or into a context, to or from a rank;
/// or, for an exchange, its transfers as the call lists them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct TransferKey {
    /// Context ids are unique per device only.
    context: (DeviceId, ContextId),
    moves: Moves,
}

/// The transfers of a kept routine: `(node, peer, sent)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Moves {
    /// A `send` (`true`) or `recv` routine.
    One(NodeId, usize, bool),
    /// An exchange's routine (a sendrecv's, or more).
    Exchange(SmallVec<[(NodeId, usize, bool); 4]>),
}

/// One transfer of a [`Cluster::exchange`].
#[derive(Clone, Copy, Debug)]
pub enum Exchange<'a> {
    /// Send this node to this rank.
    Send(&'a TensorNode, usize),
    /// Receive this node from this rank.
    Recv(&'a TensorNode, usize),
}

impl Exchange<'_> {
    fn node(&self) -> &TensorNode {
        match self {
            Exchange::Send(n, _) | Exchange::Recv(n, _) => n,
        }
    }

    fn peer(&self) -> usize {
        match self {
            Exchange::Send(_, p) | Exchange::Recv(_, p) => *p,
        }
    }

    fn sends(&self) -> bool {
        matches!(self, Exchange::Send(..))
    }
}

/// The most transfers one exchange runs (each takes two message slots of the network
/// stream's, 67 KiB each, while it runs).
pub const EXCHANGE_MAX_TRANSFERS: usize = 16;

/// Which side of a transfer a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transfer {
    Send,
    Recv,
}

/// What [`Cluster::with_mpi`] gives the code it runs on the network stream.
pub struct RawComm {
    comm: ::mpi::ffi::MPI_Comm,
    rank: usize,
    size: usize,
}

impl RawComm {
    /// The cluster's communicator (a duplicate of `MPI_COMM_WORLD`, errors returned).
    pub fn raw(&self) -> ::mpi::ffi::MPI_Comm {
        self.comm
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl Cluster {
    /// A builder (CPU devices per rank, compute streams, deadline, algorithm).
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.net.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.net.size()
    }

    /// How many devices each rank runs (index = rank).
    pub fn devices_per_rank(&self) -> &[usize] {
        &self.devices
    }

    /// This rank's system.
    pub fn system(&self) -> &System {
        &self.sys
    }

    /// The stream index of the network stream (on device 0); compute streams are below it.
    pub fn network_stream(&self) -> usize {
        self.compute_streams
    }

    /// A root context on the network stream (device 0, stream [`Cluster::network_stream`]).
    ///
    /// Work linked under it runs on the network stream, in issue order with the cluster's
    /// network operations, and cluster operations on its nodes run *in place*: an
    /// all-reduce whose first context is here reduces that context's buffer itself (no copy
    /// to the network stream's buffer and back), a `send` reads and a `recv` writes the
    /// context's buffer, and nothing is handed between streams (DESIGN.md §9, "In place on
    /// the network stream"). The price: that work does not overlap communication. For
    /// small, latency-bound steps (a small all-reduce, a halo exchange); a large model's
    /// compute belongs on compute streams.
    pub fn network_context(&self) -> Result<ContextHandle> {
        self.sys.context(0, self.compute_streams)
    }

    /// Finalizes `ctx` and the transfer routines the cluster keeps under it.
    ///
    /// A `send` or `recv` in place links its routine into the caller's context (once per
    /// node, context and rank, kept for the next transfer), so such a context has children
    /// of the cluster's and [`crate::System::finalize`] refuses it (`still has live child
    /// contexts`); this finalizes those first. Any other context is finalized as the
    /// system does.
    pub fn finalize(&self, ctx: &Context) -> Result<()> {
        // Only a context on the network stream has the cluster's routines under it.
        let kept: Vec<Arc<KeptTransfer>> = if self.on_network_stream(ctx) {
            let mut transfers = self.transfers.lock().unwrap_or_else(|e| e.into_inner());
            let under: Vec<TransferKey> = transfers
                .keys()
                .filter(|k| k.context == (ctx.device(), ctx.id()))
                .cloned()
                .collect();
            under.iter().filter_map(|k| transfers.remove(k)).collect()
        } else {
            Vec::new()
        };
        for k in kept {
            self.sys.finalize(k.routine.protocol_context())?;
        }
        self.sys.finalize(ctx)
    }

    /// Whether `ctx` runs on the network stream (its cluster operations run in place).
    pub(crate) fn on_network_stream(&self, ctx: &Context) -> bool {
        ctx.stream() == self.net_root.protocol_context().stream()
    }

    /// A root context on compute stream `stream` of local device `device`
    /// ([`Error::NoSuchStream`] for the network stream or beyond:
    /// [`Cluster::network_context`] gives that one).
    pub fn context(&self, device: usize, stream: usize) -> Result<ContextHandle> {
        if stream >= self.compute_streams {
            return Err(Error::NoSuchStream {
                device: tributary::DeviceId(device as u32),
                index: stream,
                count: self.compute_streams,
            });
        }
        self.sys.context(device, stream)
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.size() {
            return Err(Error::NoSuchRank {
                rank,
                size: self.size(),
            });
        }
        if rank == self.rank() {
            return Err(Error::InvalidRoutine {
                routine: "cluster transfer".into(),
                reason: format!("rank {rank} is this rank: a transfer needs another rank"),
            });
        }
        Ok(())
    }

    /// Sends the value of `node` in `ctx` to rank `to`, which issues the matching
    /// [`Cluster::recv`]. Returns at once; the ticket completes when the data left. From a
    /// context on the network stream ([`Cluster::network_context`]) the send reads the
    /// context's buffer in place (finalize that context with [`Cluster::finalize`]).
    pub fn send(&self, node: &TensorNode, ctx: &Context, to: usize) -> Result<ClusterTicket> {
        self.transfer_on(&mut &self.sys, Transfer::Send, node, ctx, to, None)
    }

    /// Receives `node` from rank `from` (its [`Cluster::send`]) into `ctx`, which must
    /// hold the node. Returns at once; reads of the node in `ctx` wait for the data. Into a
    /// context on the network stream ([`Cluster::network_context`]) the data lands in the
    /// context's buffer itself, no copy from the network stream's (finalize that context
    /// with [`Cluster::finalize`]).
    pub fn recv(&self, node: &TensorNode, ctx: &Context, from: usize) -> Result<ClusterTicket> {
        self.transfer_on(&mut &self.sys, Transfer::Recv, node, ctx, from, None)
    }

    /// A send or receive of `node` in `ctx` with rank `peer`, its system calls made
    /// through `sys` (the system, or a capture; `spans` then gets the positions of the
    /// network routine's call). Queued on the issue queue, then scheduled: in place (the
    /// routine linked into `ctx`, on the network stream), or through the network stream's
    /// own context (a send streams from `ctx`, a receive is copied back into it).
    pub(crate) fn transfer_on(
        &self,
        sys: &mut impl SystemCalls,
        transfer: Transfer,
        node: &TensorNode,
        ctx: &Context,
        peer: usize,
        spans: Option<&mut plan::Spans>,
    ) -> Result<ClusterTicket> {
        self.check_rank(peer)?;
        if !ctx.contains(node) {
            return Err(Error::NodeNotInContext {
                node: node.to_string(),
                context: ctx.id(),
            });
        }
        let send = transfer == Transfer::Send;
        let key = TransferKey {
            context: (ctx.device(), ctx.id()),
            moves: Moves::One(node.id(), peer, send),
        };
        let in_place = self.on_network_stream(ctx);
        let into = if in_place {
            ctx
        } else {
            self.net_root.protocol_context()
        };
        let spec = || match (send, in_place) {
            (true, true) => plan::send_in_place_spec(&self.net, &self.token, node),
            (true, false) => plan::send_spec(&self.net, &self.token, node),
            (false, _) => plan::recv_spec(&self.net, node),
        };
        let descs = || {
            smallvec::smallvec![if send {
                transfer_desc(node, self.rank(), peer)
            } else {
                transfer_desc(node, peer, self.rank())
            }]
        };
        let kept = self.transfer_routine(key, into, spec, descs)?;
        let routine = &kept.routine;
        let desc =
            kept.descs.first().cloned().ok_or_else(|| {
                Error::Internal("a kept transfer routine with no transfer".into())
            })?;
        let _issuing = self.issuing.lock().unwrap_or_else(|e| e.into_inner());
        let issued = self.net.issue(desc, 0);
        let scheduled = noting(sys, spans, |sys| {
            if send && !in_place {
                sys.device_to_device(
                    node,
                    ctx,
                    routine.protocol_context(),
                    MergeBufferUse::StreamingFor(routine.routine().clone()),
                )
            } else {
                sys.schedule(routine.routine()).map(Some)
            }
        });
        let ticket = match scheduled {
            Ok(Some(t)) => t,
            Ok(None) => {
                self.net.retract(&issued);
                return Err(Error::Internal("a transfer planned nothing".into()));
            }
            Err(e) => {
                self.net.retract(&issued);
                return Err(e);
            }
        };
        issued.set_scheduled(ticket.clone());
        if send || in_place {
            return Ok(ClusterTicket::new([issued], [ticket]));
        }
        let copy =
            sys.device_to_device(node, routine.protocol_context(), ctx, MergeBufferUse::No)?;
        Ok(ClusterTicket::new([issued], copy))
    }

    /// Sends the value of `send` in `ctx` to rank `to` and receives `recv` from rank `from`
    /// into `ctx`, as one network operation: both transfers' messages are posted at once
    /// (`MPI_Sendrecv`), so a sendrecv costs one exchange's latency where a
    /// [`Cluster::send`] then a [`Cluster::recv`] cost two, and a ring of them (every rank
    /// sending to the next and receiving from the previous) cannot wait on itself as
    /// blocking sends would. The peers match it with their own sendrecv or with a
    /// [`Cluster::recv`] and a [`Cluster::send`]: it is the two transfers, issued in the
    /// order both ranks of a pair share — the one from the lower rank first (DESIGN.md §9,
    /// "Sendrecv and exchange"). In place on the network stream when `ctx` is there
    /// ([`Cluster::network_context`]); otherwise `send` is copied to the network stream
    /// and `recv` back. `send` and `recv` must be different nodes; as for `send` and
    /// `recv`, a transfer moves a node of one label (the SPMD contract), so the node a rank
    /// receives bears the label of the node its peer sends.
    ///
    /// ```no_run
    /// use tributary::{kernels, DType, MemoryMode};
    /// use tributary_actors::cluster::Cluster;
    /// // mpirun -np 2 <this program>: a halo exchange between the two ranks; each node is
    /// // named after the rank that owns it.
    /// let cluster = Cluster::builder().cpu_devices(1).spawn()?;
    /// let (rank, peer) = (cluster.rank(), 1 - cluster.rank());
    /// let node = |r: usize| cluster.system().node(&format!("x{r}"), DType::F32, [16]).with_mode(MemoryMode::on_device());
    /// let (own, halo) = (node(rank)?, node(peer)?);
    /// let ctx = cluster.network_context()?;
    /// let fill = ctx.link(kernels::fill(&own, rank as f64)?)?;
    /// fill.schedule()?;
    /// let fill_halo = fill.context().link(kernels::fill(&halo, 0.0)?)?;
    /// fill_halo.schedule()?;
    /// let ctx = fill_halo.context();
    /// cluster.sendrecv(&own, peer, &halo, peer, &ctx)?.wait()?;
    /// assert_eq!(ctx.read::<f32>(&halo)?, vec![peer as f32; 16]);
    /// cluster.finalize(&ctx)?;
    /// cluster.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn sendrecv(
        &self,
        send: &TensorNode,
        to: usize,
        recv: &TensorNode,
        from: usize,
        ctx: &Context,
    ) -> Result<ClusterTicket> {
        let parts = [Exchange::Send(send, to), Exchange::Recv(recv, from)];
        self.exchange_on(&mut &self.sys, ctx, &parts, None)
    }

    /// Runs `parts` (sends of nodes of `ctx` to ranks, receives of nodes into `ctx` from
    /// ranks) as one network operation, every transfer's messages posted at once: a
    /// [`Cluster::sendrecv`] with any number of transfers, e.g. a stencil's halo exchange
    /// with both neighbours (`MPI_Isend`/`MPI_Irecv` of every boundary and one
    /// `MPI_Waitall`). Each is the transfer a `send` or `recv` would be, so the peers match
    /// them with exchanges of their own or with `send`s and `recv`s. Between two ranks, both
    /// issue their transfers in the order the pair shares, whatever order `parts` lists
    /// them in: those from the lower rank first, each group by node label (the two sides of
    /// a transfer name its node alike; DESIGN.md §9, "Sendrecv and exchange"); a peer using
    /// `send` and `recv` issues them in that order. A node may be sent to several ranks; a
    /// received node is received once and not sent by the same exchange. At most
    /// [`EXCHANGE_MAX_TRANSFERS`] transfers.
    pub fn exchange(&self, ctx: &Context, parts: &[Exchange<'_>]) -> Result<ClusterTicket> {
        self.exchange_on(&mut &self.sys, ctx, parts, None)
    }

    /// [`Cluster::exchange`], its system calls made through `sys` (the system, or a
    /// capture; `spans` then gets the positions of the routine's call, once per transfer).
    pub(crate) fn exchange_on(
        &self,
        sys: &mut impl SystemCalls,
        ctx: &Context,
        parts: &[Exchange<'_>],
        spans: Option<&mut plan::Spans>,
    ) -> Result<ClusterTicket> {
        let refuse = |reason: String| Error::InvalidRoutine {
            routine: "cluster exchange".into(),
            reason,
        };
        if parts.is_empty() || parts.len() > EXCHANGE_MAX_TRANSFERS {
            return Err(refuse(format!(
                "{} transfers: an exchange runs 1 to {EXCHANGE_MAX_TRANSFERS}",
                parts.len()
            )));
        }
        for (i, part) in parts.iter().enumerate() {
            self.check_rank(part.peer())?;
            let node = part.node();
            if !ctx.contains(node) {
                return Err(Error::NodeNotInContext {
                    node: node.to_string(),
                    context: ctx.id(),
                });
            }
            let clash = parts[..i]
                .iter()
                .any(|p| p.node().id() == node.id() && (!p.sends() || !part.sends()));
            if clash {
                return Err(refuse(format!(
                    "{node} is both sent and received, or received twice: an exchange \
                     receives a node once and sends none it receives (a receive would \
                     overwrite what a send reads)"
                )));
            }
        }
        let rank = self.rank();
        let in_place = self.on_network_stream(ctx);
        let net_ctx = if in_place {
            ctx
        } else {
            self.net_root.protocol_context()
        };
        let key = TransferKey {
            context: (ctx.device(), ctx.id()),
            moves: Moves::Exchange(
                parts
                    .iter()
                    .map(|p| (p.node().id(), p.peer(), p.sends()))
                    .collect(),
            ),
        };
        // Issue order: by peer; between two ranks the transfers from the lower rank first
        // (the mutant: this rank's sends first, whatever the peer does), then by label,
        // which both sides of a transfer share (not the order each side lists them in).
        let order = || {
            let key = |i: usize| {
                let p = &parts[i];
                let from_lower = if mutant!("cluster_sendrecv_order") {
                    p.sends()
                } else {
                    p.sends() == (rank < p.peer())
                };
                (p.peer(), !from_lower, p.node().label())
            };
            let mut order: SmallVec<[usize; 4]> = (0..parts.len()).collect();
            order.sort_by(|&a, &b| key(a).cmp(&key(b)));
            order
        };
        let spec = || plan::exchange_spec(&self.net, parts, &order(), in_place);
        let descs = || {
            order()
                .iter()
                .map(|&i| match parts[i] {
                    Exchange::Send(node, to) => transfer_desc(node, rank, to),
                    Exchange::Recv(node, from) => transfer_desc(node, from, rank),
                })
                .collect()
        };
        let kept = self.transfer_routine(key, net_ctx, spec, descs)?;
        let (routine, descs) = (&kept.routine, &kept.descs);
        let _issuing = self.issuing.lock().unwrap_or_else(|e| e.into_inner());
        if !in_place {
            for (i, part) in parts.iter().enumerate() {
                let first_send = parts[..i].iter().all(|p| p.node().id() != part.node().id());
                if part.sends() && first_send {
                    let into = routine.protocol_context();
                    sys.device_to_device(part.node(), ctx, into, MergeBufferUse::No)?;
                }
            }
        }
        let issued = self.net.issue_group(descs);
        let mut spans = spans;
        let scheduled = noting(sys, spans.as_deref_mut(), |sys| {
            sys.schedule(routine.routine())
        });
        let ticket = match scheduled {
            Ok(t) => t,
            Err(e) => {
                self.net.retract_all(&issued);
                return Err(e);
            }
        };
        // One routine runs every transfer: each is found at its call's positions.
        if let Some(spans) = spans {
            if let Some(&last) = spans.last() {
                spans.extend(std::iter::repeat_n(last, issued.len() - 1));
            }
        }
        for op in &issued {
            op.set_scheduled(ticket.clone());
        }
        let mut tickets: SmallVec<[Ticket; 4]> = smallvec::smallvec![ticket];
        if !in_place {
            for part in parts.iter().filter(|p| !p.sends()) {
                let from = routine.protocol_context();
                tickets.extend(sys.device_to_device(part.node(), from, ctx, MergeBufferUse::No)?);
            }
        }
        Ok(ClusterTicket::new(issued, tickets))
    }

    /// The transfer routine kept under `key`, linked into `into` (the network stream's
    /// root context, or the caller's context on the network stream) from `spec` the
    /// first time, with the descriptions `descs` gives then.
    fn transfer_routine(
        &self,
        key: TransferKey,
        into: &Context,
        spec: impl FnOnce() -> Result<RoutineSpec>,
        descs: impl FnOnce() -> SmallVec<[OpDesc; 4]>,
    ) -> Result<Arc<KeptTransfer>> {
        let mut kept = self.transfers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = kept.get(&key) {
            return Ok(k.clone());
        }
        let routine = self.sys.link(into, spec()?)?;
        let k = Arc::new(KeptTransfer {
            routine,
            descs: descs(),
        });
        kept.insert(key, k.clone());
        Ok(k)
    }

    /// Issues a header-only network operation on the token and waits for it: every rank
    /// reached this point (or the typed error says which did not).
    pub fn barrier(&self) -> Result<()> {
        let (routine, desc) = {
            let mut kept = self.barrier.lock().unwrap_or_else(|e| e.into_inner());
            match &*kept {
                Some(k) => k.clone(),
                None => {
                    let desc = token_desc(OpKind::Barrier, "barrier");
                    let spec = self.token_spec(&desc, |net, guard, op| net.barrier(guard, op))?;
                    let k = (self.net_root.link(spec)?, desc);
                    *kept = Some(k.clone());
                    k
                }
            }
        };
        self.issue_token_op(&routine, desc, 0)
    }

    /// Sums `values` across ranks (every rank passes as many; a mismatch is an error) and
    /// returns the sums, in rank order on every rank (so bitwise the same everywhere): for
    /// metrics such as a loss.
    pub fn sum_host(&self, values: &[f64]) -> Result<Vec<f64>> {
        let input: Vec<f64> = values.to_vec();
        let out = Arc::new(Mutex::new(vec![0f64; values.len()]));
        let desc = OpDesc::new(
            OpKind::AllReduce,
            "cluster.sum_host",
            &[values.len()],
            DType::F64,
        )
        .reducing(tributary::collective::ReduceOp::Sum);
        let sink = out.clone();
        self.run_token_op(desc, 1, move |net, guard, op| {
            let mut o = sink.lock().unwrap_or_else(|e| e.into_inner());
            net.all_reduce(
                guard,
                op,
                bytemuck::cast_slice(&input),
                bytemuck::cast_slice_mut(&mut o),
            )
        })?;
        let v = out.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Ok(v)
    }

    /// Links a routine writing the token whose kernel runs `body` as network operation
    /// `desc`, issues it, waits for it and finalizes it.
    fn run_token_op(&self, desc: OpDesc, contributions: usize, body: impl TokenBody) -> Result<()> {
        let spec = self.token_spec(&desc, body)?;
        let routine = self.net_root.link(spec)?;
        let waited = self.issue_token_op(&routine, desc, contributions);
        self.sys.finalize(routine.protocol_context())?;
        waited
    }

    /// A routine writing the token whose kernel runs `body` as the network operation at
    /// the front of the issue queue (`desc`'s, once issued).
    fn token_spec(&self, desc: &OpDesc, body: impl TokenBody) -> Result<RoutineSpec> {
        let net = self.net.clone();
        RoutineSpec::custom(
            format!("cluster.{}", desc.label),
            vec![(self.token.clone(), Access::Write)],
            None,
            move |args| {
                net.execute(|net, guard, op| body(net, guard, op))?;
                args.output_bytes(0)?.fill(1);
                Ok(())
            },
        )
    }

    /// Issues network operation `desc`, schedules `routine` (a [`Cluster::token_spec`]
    /// routine) to run it, and waits for it.
    fn issue_token_op(
        &self,
        routine: &RoutineHandle,
        desc: OpDesc,
        contributions: usize,
    ) -> Result<()> {
        let ticket = {
            let _issuing = self.issuing.lock().unwrap_or_else(|e| e.into_inner());
            let issued = self.net.issue(desc, contributions);
            match routine.schedule() {
                Ok(t) => {
                    issued.set_scheduled(t);
                    ClusterTicket::new([issued], [])
                }
                Err(e) => {
                    self.net.retract(&issued);
                    return Err(e);
                }
            }
        };
        ticket.wait()
    }

    /// Runs `f` on the network stream, in program order with the cluster's network
    /// operations, with the cluster's communicator; returns its result. For MPI code of
    /// the application's own (every rank must run the same MPI calls in it); `f` must
    /// leave no request pending.
    pub fn with_mpi<R: Send + 'static>(
        &self,
        f: impl FnOnce(&RawComm) -> R + Send + 'static,
    ) -> Result<R> {
        type Slot<R> = (Option<Box<dyn FnOnce(&RawComm) -> R + Send>>, Option<R>);
        let slot: Arc<Mutex<Slot<R>>> = Arc::new(Mutex::new((Some(Box::new(f)), None)));
        let inner = slot.clone();
        let desc = token_desc(OpKind::Raw, "with_mpi");
        self.run_token_op(desc, 0, move |net, _guard, _op| {
            let mut s = inner.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(f) = s.0.take() {
                let comm = RawComm {
                    comm: net.mpi().raw(),
                    rank: net.rank(),
                    size: net.size(),
                };
                s.1 = Some(f(&comm));
            }
            Ok(())
        })?;
        let value = slot.lock().unwrap_or_else(|e| e.into_inner()).1.take();
        value.ok_or_else(|| Error::Internal("with_mpi: the code did not run".into()))
    }

    /// Waits for the network stream, tells the other ranks about operations whose input
    /// failed last, ends MPI, then shuts the system down. Every rank calls it.
    ///
    /// On a cluster a rank fault stopped, `MPI_Finalize` is waited for at most the
    /// deadline, then the fault ([`Error::RankUnreachable`]) is returned (module docs); the
    /// local system is shut down either way.
    pub fn shutdown(&self) -> Result<crate::ShutdownReport> {
        if self.shut_down.swap(true, Ordering::AcqRel) {
            return Err(Error::ShutDown("the cluster is already shut down".into()));
        }
        // The network stream's operations end by themselves (each within its deadline).
        let drained = self.sys.await_stream(0, self.compute_streams);
        self.net.flush_and_close();
        // The pools live until MPI_Finalize returned (module docs), however long that is.
        let finalized = self.net.finalize(Box::new(self.backend.clone()));
        let report = self.sys.shutdown();
        match (drained, report, finalized) {
            (_, Err(e), _) => Err(e),
            (_, Ok(_), Err(fault)) => Err(fault),
            (_, Ok(r), Ok(())) => Ok(r),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.shut_down.load(Ordering::Acquire) {
            let _ = self.shutdown();
        }
    }
}

/// What a token routine's kernel runs ([`Cluster::token_spec`]): the network operation at
/// the front of the issue queue, on the network stream's worker.
trait TokenBody:
    Fn(&Network, &mut network::ExecGuard<'_>, &network::Issued) -> Result<()> + Send + Sync + 'static
{
}

impl<F> TokenBody for F where
    F: Fn(&Network, &mut network::ExecGuard<'_>, &network::Issued) -> Result<()>
        + Send
        + Sync
        + 'static
{
}

pub(crate) fn transfer_desc(node: &TensorNode, from: usize, to: usize) -> OpDesc {
    OpDesc::new(
        OpKind::Transfer,
        node.label(),
        node.shape().dims(),
        node.dtype(),
    )
    .routed(from, to)
}

/// The description of a network operation `kind` that moves no node of its own (a
/// barrier, the application's MPI code): its routine writes the token.
fn token_desc(kind: OpKind, label: &str) -> OpDesc {
    OpDesc::new(kind, label, &[1], DType::U8)
}

/// The mode of the 1-byte token nodes network routines write (they must write something).
fn token_mode() -> MemoryMode {
    MemoryMode::on_device()
}
