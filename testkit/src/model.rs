//! The core of the data-parallel training example (`examples/data_parallel`), shared with
//! its tests (the system suite's `data_parallel` and `trace`, the cluster suite's
//! `cluster_collectives`).
//!
//! A two-layer MLP (`x W1 + b1 -> relu -> W2 + b2 -> softmax cross-entropy`) trained on a
//! synthetic data set of Gaussian blobs. The batch is split into one shard per device;
//! each device computes the gradients of its shard (scaled by 1/batch, so their *sum* is
//! the full-batch gradient), the gradients are all-reduced with op `Sum`, and every device
//! applies the same SGD step. Nothing here waits for work except reading the loss.

use tributary::{
    collective::{ReduceOp, Strategy, Transfer},
    kernels,
    protocol::Context,
    DType, HostedKind, MemoryMode, Result, Step, TensorNode,
};
#[cfg(feature = "mpi")]
use tributary_actors::cluster::{Cluster, ClusterAllReduce, ClusterStep};
use tributary_actors::{AllReducePlan, RoutineHandle, System};

/// Sizes and hyper-parameters.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// Input features.
    pub dim: usize,
    /// Hidden units.
    pub hidden: usize,
    /// Classes.
    pub classes: usize,
    /// Samples in the (full) batch.
    pub samples: usize,
    /// Learning rate.
    pub lr: f64,
    /// Seed of the data and the initial weights.
    pub seed: u64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            dim: 8,
            hidden: 32,
            classes: 4,
            samples: 512,
            lr: 0.5,
            seed: 7,
        }
    }
}

/// A tiny deterministic generator (SplitMix64), so the example needs no dependency.
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u = self.uniform().max(1e-7);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f32::consts::PI * v).cos()
    }
}

/// The data set: inputs `[samples, dim]`, one-hot labels `[samples, classes]`.
pub struct Data {
    /// Inputs, row-major.
    pub x: Vec<f32>,
    /// One-hot labels, row-major.
    pub y: Vec<f32>,
    /// Class of each sample.
    pub labels: Vec<usize>,
}

/// Gaussian blobs: class `c` is centred at a random point, spread 0.6.
pub fn make_data(cfg: &ModelConfig) -> Data {
    let mut rng = Rng::new(cfg.seed);
    let centres: Vec<Vec<f32>> = (0..cfg.classes)
        .map(|_| (0..cfg.dim).map(|_| 2.0 * rng.normal()).collect())
        .collect();
    let mut x = Vec::with_capacity(cfg.samples * cfg.dim);
    let mut y = vec![0.0; cfg.samples * cfg.classes];
    let mut labels = Vec::with_capacity(cfg.samples);
    for i in 0..cfg.samples {
        let c = (rng.next_u64() % cfg.classes as u64) as usize;
        labels.push(c);
        y[i * cfg.classes + c] = 1.0;
        for &centre in &centres[c] {
            x.push(centre + 0.6 * rng.normal());
        }
    }
    Data { x, y, labels }
}

/// Parameter values on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// `[dim, hidden]`.
    pub w1: Vec<f32>,
    /// `[hidden]`.
    pub b1: Vec<f32>,
    /// `[hidden, classes]`.
    pub w2: Vec<f32>,
    /// `[classes]`.
    pub b2: Vec<f32>,
}

impl Params {
    /// A digest of every parameter's bits in three 20-bit-or-so parts, each exact in an
    /// `f64`: summed across ranks (`Cluster::sum_host`), the parts are the number of ranks
    /// times this rank's exactly when every rank holds the same bits.
    pub fn digest_parts(&self) -> [f64; 3] {
        let digest = self
            .w1
            .iter()
            .chain(&self.b1)
            .chain(&self.w2)
            .chain(&self.b2)
            .fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
                (h ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3)
            });
        [
            (digest >> 40) as f64,
            ((digest >> 20) & 0xfffff) as f64,
            (digest & 0xfffff) as f64,
        ]
    }
}

/// Small random initial weights, zero biases.
pub fn init_params(cfg: &ModelConfig) -> Params {
    let mut rng = Rng::new(cfg.seed ^ 0xdead_beef);
    let s1 = (1.0 / cfg.dim as f32).sqrt();
    let s2 = (1.0 / cfg.hidden as f32).sqrt();
    Params {
        w1: (0..cfg.dim * cfg.hidden)
            .map(|_| s1 * rng.normal())
            .collect(),
        b1: vec![0.0; cfg.hidden],
        w2: (0..cfg.hidden * cfg.classes)
            .map(|_| s2 * rng.normal())
            .collect(),
        b2: vec![0.0; cfg.classes],
    }
}

/// The parameter nodes, shared by every device.
struct Nodes {
    params: [TensorNode; 4],
}

fn f32_node(label: &str, shape: &[usize], mode: MemoryMode) -> Result<TensorNode> {
    TensorNode::new(label, DType::F32, shape.to_vec()).with_mode(mode)
}

/// One device's share of the work: its shard and its linked routines.
struct Replica {
    /// Context holding everything (params, grads, activations, shard).
    ctx: Context,
    /// Forward and backward routines, in order.
    routines: Vec<RoutineHandle>,
    /// SGD steps (after the all-reduce).
    sgd: Vec<RoutineHandle>,
    loss: TensorNode,
    rows: usize,
}

/// How the replicas' gradients are summed.
/// A captured training step ([`DataParallel::capture_step`]).
pub enum TrainingStep {
    /// Over the devices of one system.
    Local(Step),
    /// Over the devices of every rank of a cluster.
    #[cfg(feature = "mpi")]
    Cluster(ClusterStep),
}

enum Reducer {
    /// Over the devices of one system.
    Local(AllReducePlan),
    /// Over this rank's devices and every other rank's (hierarchical), and the cluster
    /// that sums the loss across ranks.
    #[cfg(feature = "mpi")]
    Cluster(ClusterAllReduce, std::sync::Arc<Cluster>),
}

/// Data-parallel training of the MLP over every device of a system (one stream each), or
/// over every device of every rank of a cluster.
pub struct DataParallel {
    sys: System,
    cfg: ModelConfig,
    nodes: Nodes,
    replicas: Vec<Replica>,
    reduce: Reducer,
}

impl DataParallel {
    /// Places the model on `devices` devices of `sys` (stream 0 of each), one shard each.
    pub fn new(
        sys: &System,
        cfg: &ModelConfig,
        devices: usize,
        data: &Data,
        init: &Params,
        strategy: Strategy,
    ) -> Result<DataParallel> {
        Self::sharded(
            sys,
            cfg,
            devices,
            0,
            devices,
            data,
            init,
            |grads, contexts| {
                let plan = AllReducePlan::new(
                    sys,
                    grads,
                    contexts,
                    ReduceOp::Sum,
                    strategy,
                    Transfer::Auto,
                )?;
                Ok(Reducer::Local(plan))
            },
        )
    }

    /// Places the model on every device of this rank of `cluster`: the batch is split into
    /// one shard per device of every rank (rank-major), and gradients are all-reduced
    /// across all of them (inside the rank with `strategy`, then across ranks).
    #[cfg(feature = "mpi")]
    pub fn on_cluster(
        cluster: std::sync::Arc<Cluster>,
        cfg: &ModelConfig,
        data: &Data,
        init: &Params,
        strategy: Strategy,
    ) -> Result<DataParallel> {
        let per_rank = cluster.devices_per_rank().to_vec();
        let first = per_rank[..cluster.rank()].iter().sum();
        let total = per_rank.iter().sum();
        let devices = per_rank[cluster.rank()];
        let sys = cluster.system().clone();
        Self::sharded(
            &sys,
            cfg,
            devices,
            first,
            total,
            data,
            init,
            |grads, contexts| {
                let plan = cluster.all_reduce_plan(grads, contexts, ReduceOp::Sum, strategy)?;
                Ok(Reducer::Cluster(plan, cluster.clone()))
            },
        )
    }

    /// Places shards `first..first + devices` of `total` on the devices of `sys`.
    #[allow(clippy::too_many_arguments)]
    fn sharded(
        sys: &System,
        cfg: &ModelConfig,
        devices: usize,
        first: usize,
        total: usize,
        data: &Data,
        init: &Params,
        reducer: impl FnOnce(&[TensorNode], &[Context]) -> Result<Reducer>,
    ) -> Result<DataParallel> {
        let (d, h, c) = (cfg.dim, cfg.hidden, cfg.classes);
        let hosted =
            MemoryMode::Hosted(HostedKind::ChangedOnDevices(tributary::Sharing::PerStream));
        let params = [
            f32_node("w1", &[d, h], hosted)?,
            f32_node("b1", &[h], hosted)?,
            f32_node("w2", &[h, c], hosted)?,
            f32_node("b2", &[c], hosted)?,
        ];
        let dev = MemoryMode::on_device();
        let grads = [
            f32_node("dw1", &[d, h], dev)?,
            f32_node("db1", &[h], dev)?,
            f32_node("dw2", &[h, c], dev)?,
            f32_node("db2", &[c], dev)?,
        ];
        let values = [&init.w1, &init.b1, &init.w2, &init.b2];
        let scale = 1.0 / cfg.samples as f64;
        let mut replicas = Vec::new();
        let rows_of = |i: usize| cfg.samples / total + usize::from(i < cfg.samples % total);
        let mut start: usize = (0..first).map(rows_of).sum();
        for device in 0..devices {
            let i = first + device;
            let rows = rows_of(i);
            let shard = start..start + rows;
            start += rows;
            let konst = MemoryMode::Hosted(HostedKind::Constant);
            let x = f32_node(&format!("x{i}"), &[rows, d], konst)?;
            let y = f32_node(&format!("y{i}"), &[rows, c], konst)?;
            let z1 = f32_node(&format!("z1_{i}"), &[rows, h], dev)?;
            let a1 = f32_node(&format!("a1_{i}"), &[rows, h], dev)?;
            let z2 = f32_node(&format!("z2_{i}"), &[rows, c], dev)?;
            let dz2 = f32_node(&format!("dz2_{i}"), &[rows, c], dev)?;
            let da1 = f32_node(&format!("da1_{i}"), &[rows, h], dev)?;
            let dz1 = f32_node(&format!("dz1_{i}"), &[rows, h], dev)?;
            let loss = f32_node(&format!("loss{i}"), &[1], dev)?;
            let mut ctx = sys.context(device, 0)?;
            for (p, v) in params.iter().zip(values) {
                ctx = ctx.init_from_host(p, v)?;
            }
            ctx = ctx.init_from_host(&x, &data.x[shard.start * d..shard.end * d])?;
            ctx = ctx.init_from_host(&y, &data.y[shard.start * c..shard.end * c])?;
            let [w1, b1, w2, b2] = &params;
            let [dw1, db1, dw2, db2] = &grads;
            let specs = vec![
                kernels::matmul(&z1, &x, w1)?,
                kernels::add_row_bias(&z1, b1)?,
                kernels::relu(&a1, &z1)?,
                kernels::matmul(&z2, &a1, w2)?,
                kernels::add_row_bias(&z2, b2)?,
                kernels::softmax_xent(&loss, &dz2, &z2, &y, scale)?,
                kernels::matmul_tn(dw2, &a1, &dz2)?,
                kernels::sum_rows(db2, &dz2)?,
                kernels::matmul_nt(&da1, &dz2, w2)?,
                kernels::relu_backward(&dz1, &da1, &z1)?,
                kernels::matmul_tn(dw1, &x, &dz1)?,
                kernels::sum_rows(db1, &dz1)?,
            ];
            let mut routines = Vec::new();
            for spec in specs {
                let r = ctx.link(spec)?;
                ctx = r.context();
                routines.push(r);
            }
            let mut sgd = Vec::new();
            for (p, g) in params.iter().zip(&grads) {
                sgd.push(ctx.link(kernels::sgd_step(p, g, cfg.lr)?)?);
            }
            replicas.push(Replica {
                ctx: ctx.protocol_context().clone(),
                routines,
                sgd,
                loss,
                rows,
            });
        }
        let contexts: Vec<Context> = replicas.iter().map(|r| r.ctx.clone()).collect();
        let reduce = reducer(&grads, &contexts)?;
        Ok(DataParallel {
            sys: sys.clone(),
            cfg: cfg.clone(),
            nodes: Nodes { params },
            replicas,
            reduce,
        })
    }

    /// One training step: forward and backward on every shard, all-reduce, SGD everywhere.
    /// Issues everything and returns without waiting.
    pub fn step(&self) -> Result<()> {
        for r in &self.replicas {
            for routine in &r.routines {
                routine.schedule()?;
            }
        }
        match &self.reduce {
            Reducer::Local(plan) => {
                plan.run()?;
            }
            #[cfg(feature = "mpi")]
            Reducer::Cluster(plan, _) => {
                plan.run()?;
            }
        }
        for r in &self.replicas {
            for s in &r.sgd {
                s.schedule()?;
            }
        }
        Ok(())
    }

    /// Captures one training step ([`System::capture`], or [`Cluster::capture`] across
    /// ranks): runs it, as [`DataParallel::step`] does, and returns it to
    /// [`DataParallel::replay`].
    pub fn capture_step(&self) -> Result<TrainingStep> {
        let forward: Vec<_> = self
            .replicas
            .iter()
            .flat_map(|r| r.routines.iter().map(|h| h.routine().clone()))
            .collect();
        let sgd: Vec<_> = self
            .replicas
            .iter()
            .flat_map(|r| r.sgd.iter().map(|h| h.routine().clone()))
            .collect();
        match &self.reduce {
            Reducer::Local(plan) => Ok(TrainingStep::Local(self.sys.capture(|c| {
                for routine in &forward {
                    c.schedule(routine)?;
                }
                c.all_reduce(plan)?;
                for s in &sgd {
                    c.schedule(s)?;
                }
                Ok(())
            })?)),
            #[cfg(feature = "mpi")]
            Reducer::Cluster(plan, cluster) => Ok(TrainingStep::Cluster(cluster.capture(|c| {
                for routine in &forward {
                    c.schedule(routine)?;
                }
                c.all_reduce(plan)?;
                for s in &sgd {
                    c.schedule(s)?;
                }
                Ok(())
            })?)),
        }
    }

    /// One training step as a replay of `step` (one operation per device); waits for it,
    /// so that a replay something invalidated is an error here.
    pub fn replay(&self, step: &TrainingStep) -> Result<()> {
        match (step, &self.reduce) {
            (TrainingStep::Local(step), _) => {
                for ticket in self.sys.replay(step)? {
                    ticket.wait()?;
                }
                Ok(())
            }
            #[cfg(feature = "mpi")]
            (TrainingStep::Cluster(step), Reducer::Cluster(_, cluster)) => {
                cluster.replay(step)?.wait()
            }
            #[cfg(feature = "mpi")]
            (TrainingStep::Cluster(_), Reducer::Local(_)) => Err(tributary::Error::InvalidConfig {
                setting: "replay".into(),
                value: "a step captured on a cluster".into(),
                reason: "this training runs on one system".into(),
            }),
        }
    }

    /// Mean loss over the full batch of the last step (waits for it).
    pub fn loss(&self) -> Result<f32> {
        let mut total = 0.0;
        for r in &self.replicas {
            total += self.sys.read::<f32>(&r.ctx, &r.loss)?[0];
        }
        #[cfg(feature = "mpi")]
        if let Reducer::Cluster(_, cluster) = &self.reduce {
            // Every rank's shards: the same sum, bitwise, on every rank.
            total = cluster.sum_host(&[f64::from(total)])?[0] as f32;
        }
        Ok(total / self.cfg.samples as f32)
    }

    /// The parameters as held by replica `i` (waits for the last step).
    pub fn params(&self, i: usize) -> Result<Params> {
        let ctx = &self.replicas[i].ctx;
        let [w1, b1, w2, b2] = &self.nodes.params;
        Ok(Params {
            w1: self.sys.read(ctx, w1)?,
            b1: self.sys.read(ctx, b1)?,
            w2: self.sys.read(ctx, w2)?,
            b2: self.sys.read(ctx, b2)?,
        })
    }

    /// Number of replicas.
    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    /// The cluster the model runs on, if it does.
    #[cfg(feature = "mpi")]
    pub fn cluster(&self) -> Option<&Cluster> {
        match &self.reduce {
            Reducer::Cluster(_, c) => Some(c),
            Reducer::Local(_) => None,
        }
    }

    /// Rows of each shard.
    pub fn shard_rows(&self) -> Vec<usize> {
        self.replicas.iter().map(|r| r.rows).collect()
    }
}

/// Accuracy of `params` on `data`, computed on the host.
pub fn accuracy(cfg: &ModelConfig, params: &Params, data: &Data) -> f32 {
    let (d, h, c) = (cfg.dim, cfg.hidden, cfg.classes);
    let mut correct = 0;
    for i in 0..cfg.samples {
        let x = &data.x[i * d..(i + 1) * d];
        let hidden: Vec<f32> = (0..h)
            .map(|j| {
                let z: f32 =
                    params.b1[j] + (0..d).map(|k| x[k] * params.w1[k * h + j]).sum::<f32>();
                z.max(0.0)
            })
            .collect();
        let best = (0..c)
            .map(|j| {
                params.b2[j]
                    + (0..h)
                        .map(|k| hidden[k] * params.w2[k * c + j])
                        .sum::<f32>()
            })
            .enumerate()
            .fold(
                (0, f32::MIN),
                |(bi, bv), (j, v)| if v > bv { (j, v) } else { (bi, bv) },
            )
            .0;
        correct += usize::from(best == data.labels[i]);
    }
    correct as f32 / cfg.samples as f32
}
