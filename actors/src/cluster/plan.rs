//! Hierarchical all-reduce across ranks, its bucketed form, and the network routines.
//!
//! An all-reduce has three steps. It reduces inside the rank through merge buffers into
//! context 0, combines across ranks in the network routine, then copies the result into every
//! context of the rank. Each step waits only for what it reads and overwrites, so independent
//! work overlaps. When context 0 is on the network stream, the network routine is linked
//! into it and reduces its buffer in place: no copy to the network stream and back. See
//! DESIGN.md §9, "Collectives" and "In place on the network stream".

use std::sync::Arc;

use smallvec::SmallVec;
use tributary::{
    backend::Backend,
    collective::{self, AllReduceStep, ReduceOp, Strategy},
    kernels::{self, Access, RoutineSpec},
    protocol::{Context, Routine},
    Error, MergeBufferUse, Result, StreamLasts, TensorNode,
};

use super::{
    header::{CrossRankAlgorithm, OpDesc, OpKind},
    network::{check_dtype, Issued, IssuedGroup, Network, View},
    Cluster, Exchange,
};
use crate::{
    collective::{check_replicas, Buckets},
    RoutineHandle, System, Ticket,
};

/// The network routine of a cross-rank all-reduce of `node`: reads the merge buffer (the
/// rank's sum, in place), writes `node` in its own context.
pub(crate) fn all_reduce_spec(net: &Arc<Network>, node: &TensorNode) -> Result<RoutineSpec> {
    let net = net.clone();
    RoutineSpec::custom(
        format!("cluster.all_reduce({})", node.label()),
        vec![(node.clone(), Access::Write)],
        Some(node.clone()),
        move |args| {
            let views = args
                .merge_bytes()
                .and_then(|input| Ok((input, args.output_bytes(0)?)));
            net.execute_on(views, |net, guard, op, (input, output)| {
                net.all_reduce(guard, op, input, output)
            })
        },
    )
}

/// The network routine of an all-reduce of `node` in place, linked into a context on the
/// network stream: reads and writes that context's buffer.
pub(crate) fn all_reduce_in_place_spec(
    net: &Arc<Network>,
    node: &TensorNode,
) -> Result<RoutineSpec> {
    let net = net.clone();
    RoutineSpec::custom(
        format!("cluster.all_reduce_in_place({})", node.label()),
        vec![(node.clone(), Access::ReadWrite)],
        None,
        move |args| {
            net.execute_on(args.output_bytes(0), |net, guard, op, data| {
                net.all_reduce_in_place(guard, op, data)
            })
        },
    )
}

/// The network routine of a send of `node` from a context on the network stream: reads
/// the context's buffer as a parameter.
pub(crate) fn send_in_place_spec(
    net: &Arc<Network>,
    token: &TensorNode,
    node: &TensorNode,
) -> Result<RoutineSpec> {
    let net = net.clone();
    RoutineSpec::custom(
        format!("cluster.send_in_place({})", node.label()),
        vec![(node.clone(), Access::Read), (token.clone(), Access::Write)],
        None,
        move |args| {
            net.execute_on(args.input_bytes(0), |net, guard, op, input| {
                net.send(guard, op, input)
            })?;
            args.output_bytes(1)?.fill(1);
            Ok(())
        },
    )
}

/// The network routine of a send of `node` (read in place as the merge buffer).
pub(crate) fn send_spec(
    net: &Arc<Network>,
    token: &TensorNode,
    node: &TensorNode,
) -> Result<RoutineSpec> {
    let net = net.clone();
    RoutineSpec::custom(
        format!("cluster.send({})", node.label()),
        vec![(token.clone(), Access::Write)],
        Some(node.clone()),
        move |args| {
            net.execute_on(args.merge_bytes(), |net, guard, op, input| {
                net.send(guard, op, input)
            })?;
            args.output_bytes(0)?.fill(1);
            Ok(())
        },
    )
}

/// The network routine of a receive into `node` (in its own context).
pub(crate) fn recv_spec(net: &Arc<Network>, node: &TensorNode) -> Result<RoutineSpec> {
    let net = net.clone();
    RoutineSpec::custom(
        format!("cluster.recv({})", node.label()),
        vec![(node.clone(), Access::Write)],
        None,
        move |args| {
            net.execute_on(args.output_bytes(0), |net, guard, op, output| {
                net.recv(guard, op, output)
            })
        },
    )
}

/// The network routine of an exchange (a sendrecv's, or more): reads the nodes it sends
/// and writes those it receives, all in the context it is linked into (the caller's on the
/// network stream, or the network stream's root). `order` lists `parts` in issue order,
/// which the kernel hands its views in.
pub(crate) fn exchange_spec(
    net: &Arc<Network>,
    parts: &[Exchange<'_>],
    order: &[usize],
    in_place: bool,
) -> Result<RoutineSpec> {
    let net = net.clone();
    // One parameter per node (a node sent to several ranks is read once).
    let mut params: Vec<(TensorNode, Access)> = Vec::new();
    let mut views: SmallVec<[(usize, bool); 4]> = SmallVec::new();
    for &i in order {
        let part = parts
            .get(i)
            .ok_or_else(|| Error::Internal("an exchange's order past its parts".into()))?;
        let (node, sends) = match *part {
            Exchange::Send(n, _) => (n, true),
            Exchange::Recv(n, _) => (n, false),
        };
        let arg = match params.iter().position(|(n, _)| n.id() == node.id()) {
            Some(arg) => arg,
            None => {
                let access = if sends { Access::Read } else { Access::Write };
                params.push((node.clone(), access));
                params.len() - 1
            }
        };
        views.push((arg, sends));
    }
    let labels: Vec<&str> = params.iter().map(|(n, _)| n.label()).collect();
    let name = if in_place {
        "exchange_in_place"
    } else {
        "exchange"
    };
    RoutineSpec::custom(
        format!("cluster.{name}({})", labels.join(", ")),
        params,
        None,
        move |args| {
            // Extended in place, not collected and moved (a few hundred bytes).
            let mut kernel_views: SmallVec<[View<'_>; 4]> = SmallVec::new();
            kernel_views.extend(views.iter().map(|&(arg, sends)| {
                if sends {
                    View::Send(args.input_bytes(arg))
                } else {
                    View::Recv(args.output_bytes(arg))
                }
            }));
            net.execute_group(|net, guard, ops, results| {
                net.exchange(guard, ops, &mut kernel_views, results)
            })
        },
    )
}

/// Where a cluster operation's system calls go: the system, or a capture that issues and
/// records them ([`crate::SystemCapture`]).
pub(crate) trait SystemCalls {
    fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Ticket>>;

    fn schedule(&mut self, routine: &Routine) -> Result<Ticket>;

    /// The step position the next call takes, when capturing (`None` when issuing): a
    /// captured step finds its network routines on the network stream by it.
    fn position(&self) -> Option<u32>;
}

/// The step positions a network routine's call took (from, to), noted while capturing.
pub(crate) type Spans = Vec<(u32, u32)>;

/// Runs `call` (the call that schedules one network routine), noting the positions it took
/// in `spans` when capturing.
pub(crate) fn noting<S: SystemCalls, T>(
    sys: &mut S,
    spans: Option<&mut Spans>,
    call: impl FnOnce(&mut S) -> Result<T>,
) -> Result<T> {
    let before = sys.position();
    let result = call(sys)?;
    if let (Some(spans), Some(from), Some(to)) = (spans, before, sys.position()) {
        spans.push((from, to));
    }
    Ok(result)
}

impl SystemCalls for &System {
    fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Ticket>> {
        System::device_to_device(self, node, src, dst, mode)
    }

    fn schedule(&mut self, routine: &Routine) -> Result<Ticket> {
        System::schedule(self, routine)
    }

    fn position(&self) -> Option<u32> {
        None
    }
}

impl SystemCalls for crate::SystemCapture<'_> {
    fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Ticket>> {
        crate::SystemCapture::device_to_device(self, node, src, dst, mode)
    }

    fn schedule(&mut self, routine: &Routine) -> Result<Ticket> {
        crate::SystemCapture::schedule(self, routine)
    }

    fn position(&self) -> Option<u32> {
        Some(crate::SystemCapture::position(self))
    }
}

/// What a cluster operation returns at once, before any device decided it: its network
/// operations and the tickets of its last writes. [`ClusterTicket::wait`] gives the network
/// operations' typed errors.
pub struct ClusterTicket {
    ops: SmallVec<[Arc<Issued>; 4]>,
    /// A replay's lasts as it returned them (moved in, not collected again).
    tickets: StreamLasts<Ticket>,
}

impl ClusterTicket {
    /// Inline up to four operations (a replayed halo-exchange step's two sendrecvs) and four
    /// tickets: a call allocates no ticket of its own.
    pub(crate) fn new(
        ops: impl IntoIterator<Item = Arc<Issued>>,
        tickets: impl IntoIterator<Item = Ticket>,
    ) -> ClusterTicket {
        ClusterTicket::from_parts(ops.into_iter().collect(), tickets.into_iter().collect())
    }

    /// [`ClusterTicket::new`] keeping `ops` as they are (a replay's many operations are
    /// not copied into a second vector).
    pub(crate) fn from_parts(ops: IssuedGroup, tickets: StreamLasts<Ticket>) -> ClusterTicket {
        ClusterTicket { ops, tickets }
    }

    /// Its network operations, in issue order.
    pub(crate) fn network_ops(&self) -> &[Arc<Issued>] {
        &self.ops
    }

    pub(crate) fn with_ticket(mut self, t: Ticket) -> ClusterTicket {
        self.tickets.push(t);
        self
    }

    /// Waits for the operation. A failed network operation returns its typed error
    /// (`RankUnreachable`, `CollectiveMismatch`, `RankInputFailed`, ...); a failed local
    /// step returns its `Error::Failed`.
    ///
    /// Of a sendrecv, whose two transfers fail together when either does (one routine runs
    /// both), the typed error of the transfer that failed.
    pub fn wait(&self) -> Result<()> {
        // First the last network operation: the network stream runs them in issue order,
        // so once it is decided every earlier one is, and the loop below reads their
        // outcomes without blocking. Waited for one by one, each would park and wake this
        // thread again: on a rank bound to one core, every wake-up takes the core from the
        // network stream's worker (up to one per operation of a replayed step; the result
        // is read again below, in issue order).
        if let Some(last) = self.ops.last().and_then(|op| op.ticket()) {
            let _ = last.wait();
        }
        let mut untyped = None;
        for op in &self.ops {
            let r = match op.ticket() {
                Some(t) => t.wait(),
                None => Err(Error::Internal(
                    "a network operation was never scheduled".into(),
                )),
            };
            match op.outcome(r) {
                Err(e) if op.error.get().is_some() => return Err(e),
                Err(e) => untyped = untyped.or(Some(e)),
                Ok(()) => {}
            }
        }
        if let Some(e) = untyped {
            return Err(e);
        }
        for t in &self.tickets {
            t.wait()?;
        }
        Ok(())
    }

    /// The tickets of the operation's last writes (every context's copy of the result).
    pub fn tickets(&self) -> &[Ticket] {
        &self.tickets
    }
}

/// A linked hierarchical all-reduce of some nodes over this rank's contexts and every
/// other rank's, ready to run every training step ([`Cluster::all_reduce_plan`]).
pub struct ClusterAllReduce {
    sys: System,
    net: Arc<Network>,
    nodes: Vec<TensorNode>,
    contexts: Vec<Context>,
    /// The intra-rank reduce steps (`AllReduceStep::Reduce` only), with their transfer mode.
    reduce: Vec<(AllReduceStep, bool)>,
    /// `merge[ctx][node]`: the merge routine of a reduce destination.
    merge: Vec<Vec<Option<Routine>>>,
    network: Vec<(RoutineHandle, OpDesc)>,
    /// Context 0 is on the network stream: the network routines are linked into it and
    /// reduce its buffers in place.
    in_place: bool,
}

impl ClusterAllReduce {
    pub(crate) fn new(
        cluster: &Cluster,
        nodes: &[TensorNode],
        contexts: Vec<Context>,
        op: ReduceOp,
        strategy: Strategy,
    ) -> Result<ClusterAllReduce> {
        let sys = &cluster.sys;
        check_replicas("cluster all_reduce", nodes, &contexts)?;
        for node in nodes {
            check_dtype(node.dtype(), "cluster all_reduce")?;
        }
        let (d, k) = (contexts.len(), nodes.len());
        // The reduce half of a Star or Tree plan leaves the sum in context 0 (a Ring would
        // scatter it).
        let intra = if strategy == Strategy::Star {
            Strategy::Star
        } else {
            Strategy::Tree
        };
        let backend: &Arc<dyn Backend> = &cluster.backend;
        let reduce: Vec<(AllReduceStep, bool)> = collective::plan(d, k, intra, ReduceOp::Sum)
            .into_iter()
            .filter_map(|s| match s {
                AllReduceStep::Reduce { src, dst, .. } => Some((
                    s,
                    backend.can_stream(contexts[src].device(), contexts[dst].device()),
                )),
                _ => None,
            })
            .collect();
        let mut merge = vec![vec![None; k]; d];
        for (step, _) in &reduce {
            if let AllReduceStep::Reduce { chunk, dst, .. } = *step {
                if merge[dst][chunk].is_none() {
                    let r = sys.link(&contexts[dst], kernels::add_merge(&nodes[chunk])?)?;
                    merge[dst][chunk] = Some(r.routine().clone());
                }
            }
        }
        let in_place = cluster.on_network_stream(&contexts[0]);
        let mut network = Vec::with_capacity(k);
        for node in nodes {
            let r = if in_place {
                sys.link(&contexts[0], all_reduce_in_place_spec(&cluster.net, node)?)?
            } else {
                cluster
                    .net_root
                    .link(all_reduce_spec(&cluster.net, node)?)?
            };
            let desc = OpDesc::new(
                OpKind::AllReduce,
                node.label(),
                node.shape().dims(),
                node.dtype(),
            )
            .reducing(op);
            network.push((r, desc));
        }
        Ok(ClusterAllReduce {
            sys: sys.clone(),
            net: cluster.net.clone(),
            nodes: nodes.to_vec(),
            contexts,
            reduce,
            merge,
            network,
            in_place,
        })
    }

    /// Issues the all-reduce: the reduce inside the rank, the network routines, the
    /// broadcast. Returns once everything is issued; reads of the nodes wait by themselves.
    pub fn run(&self) -> Result<ClusterTicket> {
        self.run_on(&mut &self.sys, None)
    }

    /// Whether `cluster` made this plan.
    pub(crate) fn belongs_to(&self, cluster: &Cluster) -> bool {
        Arc::ptr_eq(&self.net, &cluster.net)
    }

    /// The network operations a run issues, in order, with this rank's contributions.
    pub(crate) fn network_ops(&self) -> impl Iterator<Item = (OpDesc, usize)> + '_ {
        self.network
            .iter()
            .map(|(_, desc)| (desc.clone(), self.contexts.len()))
    }

    /// [`ClusterAllReduce::run`], its system calls made through `sys` (the system, or a
    /// capture that records them; `spans` then gets the positions of each network
    /// routine's call).
    pub(crate) fn run_on(
        &self,
        sys: &mut impl SystemCalls,
        mut spans: Option<&mut Spans>,
    ) -> Result<ClusterTicket> {
        for (step, streaming) in &self.reduce {
            let AllReduceStep::Reduce { chunk, src, dst } = *step else {
                continue;
            };
            let routine = self.merge[dst][chunk]
                .clone()
                .ok_or_else(|| Error::Internal("a reduce step without its merge routine".into()))?;
            let node = &self.nodes[chunk];
            if *streaming {
                sys.device_to_device(
                    node,
                    &self.contexts[src],
                    &self.contexts[dst],
                    MergeBufferUse::StreamingFor(routine),
                )?;
            } else {
                sys.device_to_device(
                    node,
                    &self.contexts[src],
                    &self.contexts[dst],
                    MergeBufferUse::Copy,
                )?;
                sys.schedule(&routine)?;
            }
        }
        let mut ops = SmallVec::<[Arc<Issued>; 4]>::new();
        let mut tickets = SmallVec::<[Ticket; 4]>::new();
        for (node, (routine, desc)) in self.nodes.iter().zip(&self.network) {
            let issued = self.net.issue(desc.clone(), self.contexts.len());
            let scheduled = noting(sys, spans.as_deref_mut(), |sys| {
                if self.in_place {
                    sys.schedule(routine.routine()).map(Some)
                } else {
                    sys.device_to_device(
                        node,
                        &self.contexts[0],
                        routine.protocol_context(),
                        MergeBufferUse::StreamingFor(routine.routine().clone()),
                    )
                }
            });
            let ticket = match scheduled {
                Ok(Some(t)) => t,
                Ok(None) => {
                    self.net.retract(&issued);
                    return Err(Error::Internal("a cross-rank step planned nothing".into()));
                }
                Err(e) => {
                    self.net.retract(&issued);
                    return Err(e);
                }
            };
            issued.set_scheduled(ticket);
            ops.push(issued);
            // In place, context 0 holds the result already (its routine's context shares
            // its buffer): the copies go to the others.
            let skip = usize::from(self.in_place);
            for ctx in &self.contexts[skip..] {
                if let Some(t) =
                    sys.device_to_device(node, routine.protocol_context(), ctx, MergeBufferUse::No)?
                {
                    tickets.push(t);
                }
            }
        }
        Ok(ClusterTicket::new(ops, tickets))
    }

    /// Uses `algorithm` across ranks instead of the cluster's
    /// ([`ClusterConfig::algorithm`](crate::cluster::ClusterConfig::algorithm)); every rank
    /// must choose the same (the header carries it).
    pub fn with_algorithm(mut self, algorithm: CrossRankAlgorithm) -> ClusterAllReduce {
        for (_, desc) in &mut self.network {
            desc.algorithm = Some(algorithm);
        }
        self
    }

    /// Finalizes the routines' contexts (the network buffers are freed).
    pub fn finalize(self) -> Result<()> {
        for r in self.merge.iter().flatten().flatten() {
            self.sys.finalize(r.context())?;
        }
        for (r, _) in &self.network {
            self.sys.finalize(r.protocol_context())?;
        }
        Ok(())
    }
}

/// Gradients packed into buckets, all-reduced across ranks per bucket, and unpacked: the
/// bucketing of `BucketedAllReduce` around [`ClusterAllReduce`].
pub struct ClusterBucketedAllReduce {
    sys: System,
    buckets: Buckets,
    reduce: ClusterAllReduce,
}

impl ClusterBucketedAllReduce {
    pub(crate) fn new(
        cluster: &Cluster,
        grads: &[TensorNode],
        contexts: Vec<Context>,
        op: ReduceOp,
        strategy: Strategy,
        bucket_bytes: u64,
    ) -> Result<ClusterBucketedAllReduce> {
        let sys = &cluster.sys;
        // Labels name the bucket and its first gradient, so that every rank agrees on them.
        let label = |b: usize, group: &[usize]| {
            let first = group.first().map_or("", |&i| grads[i].label());
            format!("bucket{b}.{first}")
        };
        let buckets = Buckets::link(
            sys,
            "cluster bucketed all_reduce",
            grads,
            contexts,
            bucket_bytes,
            label,
        )?;
        let reduce = ClusterAllReduce::new(
            cluster,
            &buckets.nodes,
            buckets.holders.clone(),
            op,
            strategy,
        )?;
        Ok(ClusterBucketedAllReduce {
            sys: sys.clone(),
            buckets,
            reduce,
        })
    }

    /// Number of buckets (the same on every rank).
    pub fn bucket_count(&self) -> usize {
        self.buckets.nodes.len()
    }

    /// This rank's contexts holding the buckets, descendants of the given ones.
    pub fn contexts(&self) -> &[Context] {
        &self.buckets.holders
    }

    /// Packs, all-reduces across ranks and unpacks; returns once everything is issued.
    pub fn run(&self) -> Result<ClusterTicket> {
        self.buckets.pack(&self.sys)?;
        let ticket = self.reduce.run()?;
        let tickets = self.buckets.unpack(&self.sys)?;
        Ok(tickets.into_iter().fold(ticket, |t, x| t.with_ticket(x)))
    }

    /// Finalizes every context the plan linked (innermost first).
    pub fn finalize(self) -> Result<()> {
        let ClusterBucketedAllReduce {
            sys,
            buckets,
            reduce,
        } = self;
        buckets.finalize(&sys, || reduce.finalize())
    }
}

impl Cluster {
    /// Links a hierarchical all-reduce of `nodes` over this rank's `contexts` (one per
    /// replica, each holding every node in a buffer of its own) and every other rank's:
    /// reduce inside the rank (`strategy`: `Star`, or `Tree` for `Tree` and `Ring`), all-
    /// reduce across ranks on the network stream, broadcast inside the rank. A `Mean`
    /// divides by the number of contexts of all ranks together.
    pub fn all_reduce_plan<C: AsRef<Context>>(
        &self,
        nodes: &[TensorNode],
        contexts: impl IntoIterator<Item = C>,
        op: ReduceOp,
        strategy: Strategy,
    ) -> Result<ClusterAllReduce> {
        let contexts = contexts.into_iter().map(|c| c.as_ref().clone()).collect();
        ClusterAllReduce::new(self, nodes, contexts, op, strategy)
    }

    /// One hierarchical all-reduce ([`Cluster::all_reduce_plan`], run, waited for, its
    /// routines finalized).
    pub fn all_reduce<C: AsRef<Context>>(
        &self,
        nodes: &[TensorNode],
        contexts: impl IntoIterator<Item = C>,
        op: ReduceOp,
        strategy: Strategy,
    ) -> Result<()> {
        let plan = self.all_reduce_plan(nodes, contexts, op, strategy)?;
        let waited = plan.run().and_then(|t| t.wait());
        plan.finalize()?;
        waited
    }

    /// A bucketed hierarchical all-reduce of `grads` (same dtype) in buckets of at most
    /// `bucket_bytes` bytes.
    pub fn bucketed_all_reduce<C: AsRef<Context>>(
        &self,
        grads: &[TensorNode],
        contexts: impl IntoIterator<Item = C>,
        op: ReduceOp,
        strategy: Strategy,
        bucket_bytes: u64,
    ) -> Result<ClusterBucketedAllReduce> {
        let contexts = contexts.into_iter().map(|c| c.as_ref().clone()).collect();
        ClusterBucketedAllReduce::new(self, grads, contexts, op, strategy, bucket_bytes)
    }
}
