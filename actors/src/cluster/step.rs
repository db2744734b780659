//! Cross-rank steps captured once and replayed (DESIGN.md §9, "Captured cluster steps").
//!
//! A training step that spans ranks is the step users repeat most, so it is the one a
//! replay should save the most on. [`Cluster::capture`] runs the step's calls for real
//! through a [`SystemCapture`] (the rank's compute, and each cluster all-reduce: its reduce
//! inside the rank, its network routines, its copies back), noting the network operations
//! in issue order. [`Cluster::replay`] puts the same network operations on the issue queue
//! (the sequence numbers and headers every rank checks against the others, as issuing
//! would) and replays the system step: the network stream's part of a replay runs the
//! step's network routines in order under consecutive sequence numbers, so the last one's
//! ticket names every one of them. The network routines run exactly as when issued (the
//! same header exchange, the same faults); every rank must replay the same steps in the
//! same order as it would issue them.

use tributary::{protocol::Routine, replay::Step, Error, Result};

use super::{
    header::OpDesc,
    network::EntryTicket,
    plan::{ClusterAllReduce, ClusterTicket},
    Cluster,
};
use crate::{SystemCapture, Ticket};

/// The calls of a cluster step being captured ([`Cluster::capture`]): each runs for real,
/// as the method of the same name, and is recorded.
pub struct ClusterCapture<'a, 's> {
    cluster: &'a Cluster,
    calls: &'a mut SystemCapture<'s>,
    network: Vec<(OpDesc, usize)>,
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
        let ticket = plan.run_on(self.calls)?;
        self.network.extend(plan.network_ops());
        Ok(ticket)
    }

    /// The system capture underneath, for the other recorded calls of this rank
    /// (schedules with index values, copies between this rank's devices, all-reduces
    /// inside the rank).
    pub fn system(&mut self) -> &mut SystemCapture<'s> {
        self.calls
    }
}

/// A step captured on a cluster ([`Cluster::capture`]), to [`Cluster::replay`].
pub struct ClusterStep {
    step: Step,
    /// Its network operations in issue order, with this rank's contributions.
    network: Vec<(OpDesc, usize)>,
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
        let mut network = Vec::new();
        let step = self.sys.capture(|c| {
            let mut capture = ClusterCapture {
                cluster: self,
                calls: c,
                network: Vec::new(),
            };
            let r = calls(&mut capture);
            network = capture.network;
            r
        })?;
        let device = self.net_root.protocol_context().device();
        let stream = self.compute_streams;
        let mut network_ticket = None;
        let mut on_network = 0;
        let mut k = 0;
        for d in step.devices() {
            for s in d.streams() {
                if d.device() == device && s == stream {
                    network_ticket = Some(k);
                    on_network = d.stream_operations(s);
                }
                k += 1;
            }
        }
        if on_network != network.len() {
            return Err(Error::InvalidRoutine {
                routine: "cluster capture".into(),
                reason: format!(
                    "the step runs {on_network} operations on the network stream, of which \
                     {} are the captured all-reduces' (network calls made outside the \
                     capture are not replayed)",
                    network.len()
                ),
            });
        }
        Ok(ClusterStep {
            step,
            network,
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
        let _issuing = self.issuing.lock().unwrap_or_else(|e| e.into_inner());
        let issued: Vec<_> = step
            .network
            .iter()
            // Mutant: a replay that does not queue its network operations again.
            .filter(|_| !mutant!("cluster_replay_unqueued"))
            .map(|(desc, contributions)| self.net.issue(desc.clone(), *contributions))
            .collect();
        let tickets = match self.sys.replay(&step.step) {
            Ok(t) => t,
            Err(e) => {
                for op in issued.iter().rev() {
                    self.net.retract(op);
                }
                return Err(e);
            }
        };
        if let Some(last) = step.network_ticket.and_then(|k| tickets.get(k)) {
            let n = issued.len();
            for (i, op) in issued.iter().enumerate() {
                let _ = op.event.set(EntryTicket::Replayed {
                    last: last.clone(),
                    back: (n - 1 - i) as u64,
                });
            }
        }
        Ok(ClusterTicket::new(issued, tickets.into_vec()))
    }
}
