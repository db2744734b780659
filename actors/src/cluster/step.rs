//! Cross-rank steps captured once and replayed (DESIGN.md §9, "Captured cluster steps").
//!
//! A training step that spans ranks is the step users repeat most, so it is the one a
//! replay should save the most on. [`Cluster::capture`] runs the step's calls for real
//! through a [`SystemCapture`] (the rank's compute, each cluster all-reduce: its reduce
//! inside the rank, its network routines, its copies back, and sends and receives), noting
//! the network operations in issue order and the step positions each one's call took.
//! [`Cluster::replay`] puts the same network operations on the issue queue (the sequence
//! numbers and headers every rank checks against the others, as issuing would) and replays
//! the system step: the network stream's part of a replay runs its operations in order
//! under consecutive sequence numbers, so each network operation's event is a known number
//! of operations before that part's last ticket, found at capture from the positions
//! (other work may run on the network stream too: work in place). The network routines
//! run exactly as when issued (the same header exchange, the same faults); every rank must
//! replay the same steps in the same order as it would issue them.

use tributary::{
    protocol::Routine,
    replay::{Step, StepBindings},
    Error, Result, TensorNode,
};

use super::{
    header::OpDesc,
    plan::{ClusterAllReduce, ClusterTicket, Spans},
    Cluster, Exchange, Transfer,
};
use crate::{SystemCapture, Ticket};
use tributary::protocol::Context;

/// The calls of a cluster step being captured ([`Cluster::capture`]): each runs for real,
/// as the method of the same name, and is recorded.
pub struct ClusterCapture<'a, 's> {
    cluster: &'a Cluster,
    calls: &'a mut SystemCapture<'s>,
    network: Vec<NetworkOp>,
    /// The step positions each network routine's call took, in issue order.
    spans: Spans,
}

impl<'s> ClusterCapture<'_, 's> {
    /// [`crate::System::schedule`] of a routine of this rank, recorded.
    pub fn schedule(&mut self, routine: &Routine) -> Result<Ticket> {
        self.calls.schedule(routine)
    }

    /// [`ClusterAllReduce::run`], recorded: the reduce inside the rank, the network
    /// routines (replayed with the same header checks), the copies back.
    pub fn all_reduce(&mut self, plan: &ClusterAllReduce) -> Result<ClusterTicket> {
        if !plan.belongs_to(self.cluster) {
            return Err(Error::InvalidRoutine {
                routine: "cluster all_reduce".into(),
                reason: "the plan was made by another cluster".into(),
            });
        }
        let ticket = plan.run_on(self.calls, Some(&mut self.spans))?;
        self.network
            .extend(plan.network_ops().map(|(desc, contributions)| NetworkOp {
                desc,
                contributions,
                fused: false,
            }));
        Ok(ticket)
    }

    /// [`Cluster::send`], recorded (in place from a context on the network stream).
    pub fn send(&mut self, node: &TensorNode, ctx: &Context, to: usize) -> Result<ClusterTicket> {
        self.transfer(Transfer::Send, node, ctx, to)
    }

    /// [`Cluster::recv`], recorded (in place into a context on the network stream).
    pub fn recv(&mut self, node: &TensorNode, ctx: &Context, from: usize) -> Result<ClusterTicket> {
        self.transfer(Transfer::Recv, node, ctx, from)
    }

    fn transfer(
        &mut self,
        transfer: Transfer,
        node: &TensorNode,
        ctx: &Context,
        peer: usize,
    ) -> Result<ClusterTicket> {
        let ticket = self.cluster.transfer_on(
            self.calls,
            transfer,
            node,
            ctx,
            peer,
            Some(&mut self.spans),
        )?;
        self.note(&ticket);
        Ok(ticket)
    }

    /// [`Cluster::sendrecv`], recorded (both transfers, replayed as one routine's).
    pub fn sendrecv(
        &mut self,
        send: &TensorNode,
        to: usize,
        recv: &TensorNode,
        from: usize,
        ctx: &Context,
    ) -> Result<ClusterTicket> {
        self.exchange(ctx, &[Exchange::Send(send, to), Exchange::Recv(recv, from)])
    }

    /// [`Cluster::exchange`], recorded (every transfer, replayed as one routine's).
    pub fn exchange(&mut self, ctx: &Context, parts: &[Exchange<'_>]) -> Result<ClusterTicket> {
        let spans = Some(&mut self.spans);
        let ticket = self.cluster.exchange_on(self.calls, ctx, parts, spans)?;
        self.note(&ticket);
        Ok(ticket)
    }

    /// Notes the network operations a transfer call queued, in its order (a sendrecv's
    /// first carries `fused`).
    fn note(&mut self, ticket: &ClusterTicket) {
        for op in ticket.network_ops() {
            self.network.push(NetworkOp {
                desc: op.desc.clone(),
                contributions: 0,
                fused: op.fused,
            });
        }
    }

    /// The cluster being captured.
    pub fn cluster(&self) -> &Cluster {
        self.cluster
    }

    /// The system capture underneath, for the other recorded calls of this rank
    /// (schedules with index values, copies between this rank's devices, all-reduces
    /// inside the rank).
    pub fn system(&mut self) -> &mut SystemCapture<'s> {
        self.calls
    }
}

/// A network operation of a captured step, as a replay issues it again.
struct NetworkOp {
    desc: OpDesc,
    /// This rank's contributions (an all-reduce's contexts).
    contributions: usize,
    /// The first of a sendrecv's two transfers ([`super::network::Issued::fused`]).
    fused: bool,
}

/// A step captured on a cluster ([`Cluster::capture`]), to [`Cluster::replay`].
pub struct ClusterStep {
    step: Step,
    /// Its network operations in issue order.
    network: Vec<NetworkOp>,
    /// For each network operation, how many of the network stream's operations in a
    /// replay run after it (other work may run on the network stream too).
    backs: Vec<u64>,
    /// Where the network stream's ticket is among a replay's tickets (when it has network
    /// operations).
    network_ticket: Option<usize>,
}

impl ClusterStep {
    /// The system step underneath.
    pub fn step(&self) -> &Step {
        &self.step
    }

    /// How many network operations a replay runs.
    pub fn network_operations(&self) -> usize {
        self.network.len()
    }
}

impl Cluster {
    /// Captures a step of this rank's part of a cluster program: runs `calls` for real
    /// (through the [`ClusterCapture`] it is given) while the devices record what they
    /// decide and the cluster its network operations; returns the [`ClusterStep`] to
    /// [`Cluster::replay`]. Every rank captures its part of the same step, as it would
    /// issue it.
    ///
    /// ```no_run
    /// use tributary::{collective::{ReduceOp, Strategy}, kernels, DType, MemoryMode};
    /// use tributary_actors::cluster::Cluster;
    /// // mpirun -np 2 <this program>
    /// let cluster = Cluster::builder().cpu_devices(1).spawn()?;
    /// let g = cluster.system().node("g", DType::F32, [256]).with_mode(MemoryMode::on_device())?;
    /// let fill = cluster.context(0, 0)?.link(kernels::fill(&g, 1.0)?)?;
    /// let plan = cluster.all_reduce_plan(&[g.clone()], &[fill.context()], ReduceOp::Sum, Strategy::Tree)?;
    /// let step = cluster.capture(|c| {
    ///     c.schedule(fill.routine())?;
    ///     c.all_reduce(&plan)?;
    ///     Ok(())
    /// })?;
    /// for _ in 0..10 {
    ///     cluster.replay(&step)?.wait()?; // the fill and the all-reduce across ranks
    /// }
    /// assert_eq!(fill.context().read::<f32>(&g)?, vec![2.0; 256]);
    /// cluster.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn capture(
        &self,
        calls: impl FnOnce(&mut ClusterCapture<'_, '_>) -> Result<()>,
    ) -> Result<ClusterStep> {
        let (mut network, mut spans) = (Vec::new(), Vec::new());
        let step = self.sys.capture(|c| {
            let mut capture = ClusterCapture {
                cluster: self,
                calls: c,
                network: Vec::new(),
                spans: Vec::new(),
            };
            let r = calls(&mut capture);
            (network, spans) = (capture.network, capture.spans);
            r
        })?;
        let device = self.net_root.protocol_context().device();
        let stream = self.compute_streams;
        let mut network_ticket = None;
        let mut positions = Vec::new();
        let mut k = 0;
        for d in step.devices() {
            for s in d.streams() {
                if d.device() == device && s == stream {
                    network_ticket = Some(k);
                    positions = d.stream_positions(s).collect();
                }
                k += 1;
            }
        }
        let refuse = |why: String| Error::InvalidRoutine {
            routine: "cluster capture".into(),
            reason: why,
        };
        if spans.len() != network.len() {
            return Err(refuse(format!(
                "{} network operations noted, {} calls: a cluster call inside the capture \
                 failed and the step went on",
                network.len(),
                spans.len()
            )));
        }
        // Each network routine is the one operation of the network stream's lane whose
        // position its call took; a replay runs that lane in order under consecutive
        // sequence numbers, so its event is `back` before the lane's last.
        let mut backs = Vec::with_capacity(spans.len());
        for (i, &(from, to)) in spans.iter().enumerate() {
            if mutant!("cluster_replay_positions") {
                // As if only network operations ran on the lane.
                backs.push((spans.len() - 1 - i) as u64);
                continue;
            }
            let mut on_lane = positions
                .iter()
                .enumerate()
                .filter(|(_, &p)| (from..to).contains(&p));
            match (on_lane.next(), on_lane.next()) {
                (Some((ordinal, _)), None) => {
                    backs.push((positions.len() - 1 - ordinal) as u64);
                }
                _ => {
                    return Err(refuse(format!(
                        "network operation {i} ({}) is not one operation of the network \
                         stream's part of the step",
                        network[i].desc.describe()
                    )))
                }
            }
        }
        Ok(ClusterStep {
            step,
            network,
            backs,
            network_ticket,
        })
    }

    /// Replays `step`: issues its network operations again (every rank replays the same
    /// steps in the same order, as it would issue them), and replays its system step.
    /// Returns at once; [`ClusterTicket::wait`] gives the network operations' typed
    /// errors, as issuing would. A step something invalidated since is refused by its
    /// devices (the tickets fail with [`tributary::Error::ReplayInvalidated`]); its network
    /// operations then fail on every rank, as operations whose input failed.
    pub fn replay(&self, step: &ClusterStep) -> Result<ClusterTicket> {
        self.replay_step(step, None)
    }

    /// [`Cluster::replay`] with other values of the step's routines' indices
    /// ([`StepBindings`]: start from [`Step::bindings`] of [`ClusterStep::step`], e.g.
    /// shift a timestep index by the step's length each replay), as
    /// [`System::replay_with`](crate::System::replay_with) does.
    pub fn replay_with(&self, step: &ClusterStep, values: &StepBindings) -> Result<ClusterTicket> {
        self.replay_step(step, Some(values))
    }

    fn replay_step(
        &self,
        step: &ClusterStep,
        values: Option<&StepBindings>,
    ) -> Result<ClusterTicket> {
        let mut issuing = self.issuing.lock().unwrap_or_else(|e| e.into_inner());
        // Every operation of this replay reads its event from this one ticket, set below.
        let last = issuing.next();
        let issued = self.net.issue_all(
            step.network
                .iter()
                .enumerate()
                // Mutant: a replay that does not queue its network operations again.
                .filter(|_| !mutant!("cluster_replay_unqueued"))
                .map(|(i, op)| {
                    let replayed = step.backs.get(i).map(|&back| (last.clone(), back));
                    (&op.desc, op.contributions, op.fused, replayed)
                }),
        );
        let replayed = match values {
            Some(v) => self.sys.replay_with(&step.step, v),
            None => self.sys.replay(&step.step),
        };
        let tickets = match replayed {
            Ok(t) => t,
            Err(e) => {
                self.net.retract_all(&issued);
                return Err(e);
            }
        };
        if mutant!("cluster_ticket_unset_runs") {
            // The mutant's race made certain: the host preempted between posting the replay
            // and storing its tickets (on a rank bound to one core, whether the woken
            // network stream takes the core first is up to the scheduler), so the kernels
            // run while the tickets are unset, as `Network::front` must allow for.
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if let Some(t) = step.network_ticket.and_then(|k| tickets.get(k)) {
            let _ = last.set(t.clone());
        }
        Ok(ClusterTicket::from_parts(issued, tickets))
    }
}
