//! Programs on the engine (`tributary::Engine`).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use tributary::{
    backend::{
        cpu::{CpuBackend, CpuConfig},
        Backend,
    },
    kernels::{self, RoutineSpec},
    memory::{PoolKind, PoolStats},
    protocol::{Context, Routine, TableSizes},
    DType, DeviceId, Engine, EngineConfig, Event, EventStatus, MergeBufferUse, NodeId, TensorNode,
};

use super::{
    graph::{GraphRecorder, GraphReport, RecordingBackend},
    program::*,
    steps::{resolve_calls, Call, Handles},
};

/// The longest any single wait of a program may take before the run counts as hung.
pub const WAIT: Duration = Duration::from_secs(30);

/// The CPU configuration of every program run: the exact kernel mode, whose sums are in
/// the reference's order (the default fast mode's matmuls are not, DESIGN.md §5).
pub fn exact_cpu() -> CpuConfig {
    CpuConfig::default().with_kernel_mode(kernels::KernelMode::Exact)
}

/// A CPU backend of `devices` devices in [`exact_cpu`]'s mode.
pub fn exact_cpu_backend(devices: usize) -> tributary::Result<Arc<dyn Backend>> {
    Ok(Arc::new(CpuBackend::with_config(
        DeviceId(0),
        devices,
        exact_cpu(),
    )?))
}

/// The CPU engine configuration for `setup`.
pub fn config(setup: &Setup) -> EngineConfig {
    EngineConfig {
        cpu: exact_cpu(),
        devices: setup.devices,
        streams_per_device: setup.streams,
        pools: tributary::memory::PoolConfig {
            pool_bytes: setup.pool_bytes,
            ..Default::default()
        },
    }
}

/// The setup's nodes, and each node's handle by id.
pub fn create_nodes(setup: &Setup) -> Result<(Vec<TensorNode>, HashMap<NodeId, usize>), String> {
    let mut nodes = Vec::new();
    let mut index = HashMap::new();
    for (i, d) in setup.nodes.iter().enumerate() {
        let dtype = match d.dtype {
            Dt::F32 => DType::F32,
            Dt::I32 => DType::I32,
        };
        let make = if d.zeroed {
            TensorNode::new_zeroed
        } else {
            TensorNode::new
        };
        let node = make(format!("n{i}"), dtype, d.dims.clone())
            .with_mode(d.mode.memory_mode())
            .map_err(err)?;
        index.insert(node.id(), i);
        nodes.push(node);
    }
    Ok((nodes, index))
}

/// The spec of `kernel` over `nodes` for a backend named `backend` (`cpu`, `vulkan`,
/// `cuda`): the built-ins, and [`Kernel::FillIndex`] as that backend's user kernel.
pub fn kernel_spec(
    nodes: &[TensorNode],
    kernel: &Kernel,
    backend: &str,
) -> tributary::Result<RoutineSpec> {
    let n = |x: N| &nodes[x.0];
    match *kernel {
        Kernel::FillIndex { dst } => crate::support::fill_index(n(dst), backend, Kernel::INDEX),
        Kernel::Fill { dst, value } => kernels::fill(n(dst), value),
        Kernel::Copy { dst, src } => kernels::copy(n(dst), n(src)),
        Kernel::AddInto { dst, src } => kernels::add_into(n(dst), n(src)),
        Kernel::AddMerge { dst } => kernels::add_merge(n(dst)),
        Kernel::Scale { dst, src, alpha } => kernels::scale(n(dst), n(src), alpha),
        Kernel::Axpy { y, x, alpha } => kernels::axpy(n(y), n(x), alpha),
        Kernel::Matmul { c, a, b } => kernels::matmul(n(c), n(a), n(b)),
        Kernel::SumRows { dst, src } => kernels::sum_rows(n(dst), n(src)),
    }
}

/// Per device, what a teardown observes: general allocations and their bytes, contexts.
pub fn device_memory(stats: &[PoolStats], tables: &[TableSizes]) -> Vec<DeviceMemory> {
    stats
        .iter()
        .zip(tables)
        .map(|(m, t)| DeviceMemory {
            allocations: m.allocations,
            live_bytes: m
                .per_pool
                .iter()
                .filter(|p| p.kind == PoolKind::General)
                .map(|p| p.live_bytes)
                .sum(),
            contexts: t.contexts,
        })
        .collect()
}

/// Table and memory sizes summed over devices (`host_events`: events held by host arrays).
pub fn probe_of(stats: &[PoolStats], tables: &[TableSizes], host_events: usize) -> Probe {
    let mut p = Probe {
        events: host_events,
        ..Probe::default()
    };
    for t in tables {
        p.events += t.events;
        p.buffers += t.buffers;
        p.contexts += t.contexts;
    }
    for m in stats {
        p.live_bytes += m.live_bytes;
        p.reserved_bytes += m.reserved_bytes;
        p.pending_bytes += m.pending_free_bytes;
    }
    p
}

type MakeEngine = Box<dyn FnMut(&Setup) -> tributary::Result<Engine>>;
type MakeBackend = Box<dyn FnMut(&Setup) -> tributary::Result<Arc<dyn Backend>>>;

enum Make {
    Engine(MakeEngine),
    /// A backend, wrapped in a [`RecordingBackend`] to check the dependency graph.
    Recording(MakeBackend),
}

/// Runs programs on fresh engines.
pub struct EngineRunner {
    name: String,
    make: Make,
    /// The recorder of the last run, when recording.
    recorder: Option<Arc<GraphRecorder>>,
}

impl EngineRunner {
    /// Engines on the CPU backend with the setup's pool size.
    pub fn cpu() -> EngineRunner {
        EngineRunner::with("engine(cpu)", |s| Engine::cpu(config(s)))
    }

    /// Engines made by `make` (a fault-injecting backend, other pool settings).
    pub fn with(
        name: &str,
        make: impl FnMut(&Setup) -> tributary::Result<Engine> + 'static,
    ) -> EngineRunner {
        EngineRunner {
            name: name.into(),
            make: Make::Engine(Box::new(make)),
            recorder: None,
        }
    }

    /// Engines on the backend `make` creates for a setup (with the setup's streams and
    /// pools), whose dependency graph is recorded and checked after each run
    /// ([`ProgramRunner::graph`]).
    pub fn recording(
        name: &str,
        make: impl FnMut(&Setup) -> tributary::Result<Arc<dyn Backend>> + 'static,
    ) -> EngineRunner {
        EngineRunner {
            name: name.into(),
            make: Make::Recording(Box::new(make)),
            recorder: None,
        }
    }

    /// CPU engines whose dependency graph is checked.
    pub fn recording_cpu() -> EngineRunner {
        EngineRunner::recording("engine(cpu)", |s| exact_cpu_backend(s.devices))
    }
}

impl ProgramRunner for EngineRunner {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn start(&mut self, setup: &Setup) -> Result<Box<dyn Executor>, String> {
        self.recorder = None;
        let engine = match &mut self.make {
            Make::Engine(make) => make(setup),
            Make::Recording(make) if !super::graph::enabled() => make(setup).and_then(|backend| {
                Engine::with_backend(backend, setup.streams, config(setup).pools)
            }),
            Make::Recording(make) => {
                let recorder = GraphRecorder::new();
                self.recorder = Some(recorder.clone());
                make(setup).and_then(|backend| {
                    let backend = RecordingBackend::new(backend, recorder);
                    Engine::with_backend(Arc::new(backend), setup.streams, config(setup).pools)
                })
            }
        }
        .map_err(|e| describe(&e))?;
        let mut exec = EngineExecutor::new(engine, setup)?;
        exec.recorder = self.recorder.clone();
        Ok(Box::new(exec))
    }

    fn graph(&self) -> Option<GraphReport> {
        self.recorder.as_ref().map(|r| r.check())
    }
}

/// One engine executing a program's operations.
pub struct EngineExecutor {
    /// The engine.
    pub engine: Engine,
    setup: Setup,
    nodes: Vec<TensorNode>,
    index: HashMap<NodeId, usize>,
    ctxs: Vec<Context>,
    routines: Vec<Routine>,
    events: Vec<Event>,
    recorder: Option<Arc<GraphRecorder>>,
}

/// Replays of captured steps (`Op::Step`) the engine ran, over every program of the
/// process: `REPLAYED` planned, `REPLAYS_INVALIDATED` refused as invalidated (then issued
/// call by call). A test of captured steps checks that the first is not zero.
pub static REPLAYED: AtomicU64 = AtomicU64::new(0);
/// See [`REPLAYED`].
pub static REPLAYS_INVALIDATED: AtomicU64 = AtomicU64::new(0);

fn err(e: tributary::Error) -> String {
    describe(&e)
}

impl EngineExecutor {
    /// Creates the setup's nodes for `engine`.
    pub fn new(engine: Engine, setup: &Setup) -> Result<EngineExecutor, String> {
        let (nodes, index) = create_nodes(setup)?;
        Ok(EngineExecutor {
            engine,
            setup: setup.clone(),
            nodes,
            index,
            ctxs: Vec::new(),
            routines: Vec::new(),
            events: Vec::new(),
            recorder: None,
        })
    }

    /// The engine's node for handle `n`.
    pub fn node(&self, n: N) -> &TensorNode {
        &self.nodes[n.0]
    }

    /// The engine's context for handle `c`.
    pub fn context(&self, c: C) -> Result<&Context, String> {
        self.ctxs
            .get(c.0)
            .ok_or_else(|| format!("Unknown: no context c{}", c.0))
    }

    fn routine(&self, r: R) -> Result<&Routine, String> {
        self.routines
            .get(r.0)
            .ok_or_else(|| format!("Unknown: no routine r{}", r.0))
    }

    fn read(&mut self, c: C, n: N) -> Result<Values, String> {
        let ctx = self.context(c)?.clone();
        let node = self.nodes[n.0].clone();
        Ok(match self.setup.nodes[n.0].dtype {
            Dt::F32 => Values::f32s(&self.engine.read::<f32>(&ctx, &node).map_err(err)?),
            Dt::I32 => Values::I32(self.engine.read::<i32>(&ctx, &node).map_err(err)?),
        })
    }

    fn host_read(&mut self, n: N) -> Result<Values, String> {
        let node = self.nodes[n.0].clone();
        Ok(match self.setup.nodes[n.0].dtype {
            Dt::F32 => Values::f32s(&self.engine.host_read::<f32>(&node).map_err(err)?),
            Dt::I32 => Values::I32(self.engine.host_read::<i32>(&node).map_err(err)?),
        })
    }

    /// Waits for all work (bounded by [`WAIT`]); any failed operation since the last sync
    /// is an error.
    pub fn sync(&mut self) -> Result<(), String> {
        self.engine.sync_all_timeout(WAIT).map_err(err)?;
        for e in self.events.drain(..) {
            if let EventStatus::Failed(f) = e.status() {
                return Err(format!("Failed: event {e}: {f}"));
            }
        }
        Ok(())
    }

    fn track(&mut self, e: Event) {
        self.events.push(e);
    }

    fn checkpoint(&mut self) -> OpResult {
        self.sync()?;
        let mut buffers = Vec::new();
        for i in 0..self.ctxs.len() {
            if !self.engine.is_live(&self.ctxs[i]) {
                continue;
            }
            let mut ns: Vec<usize> = self.ctxs[i]
                .nodes()
                .map(|n| self.index.get(&n.id()).copied().unwrap_or(usize::MAX))
                .collect();
            ns.sort_unstable();
            for n in ns {
                if n == usize::MAX {
                    return Err("Unknown: a context holds a node of no program".into());
                }
                buffers.push((C(i), N(n), self.read(C(i), N(n))?));
            }
        }
        let mut host = Vec::new();
        for n in 0..self.nodes.len() {
            if self.setup.nodes[n].mode.is_hosted() {
                host.push((N(n), self.host_read(N(n))?));
            }
        }
        Ok(Obs::Checkpoint { buffers, host })
    }

    fn teardown(&mut self) -> OpResult {
        for i in (0..self.ctxs.len()).rev() {
            if self.engine.is_live(&self.ctxs[i]) {
                let ctx = self.ctxs[i].clone();
                self.engine.finalize(&ctx).map_err(err)?;
            }
        }
        self.sync()?;
        let (tables, _) = self.engine.table_sizes();
        Ok(Obs::Memory(device_memory(
            &self.engine.memory_stats(),
            &tables,
        )))
    }
}

impl EngineExecutor {
    /// A captured step: `ops` issued through [`Engine::capture`], then [`Engine::replay`]
    /// `replays` times. A replay refused as invalidated (it plans nothing) is followed by
    /// the step's calls issued one by one, as a user re-capturing would, and counted.
    fn step(&mut self, ops: &[Op], replays: u32) -> OpResult {
        let calls = resolve_calls(ops, self)?;
        let mut events = Vec::new();
        let step = self.engine.capture(|c| {
            for call in &calls {
                let e = match call {
                    Call::Schedule(r, None) => Some(c.schedule(r)?),
                    Call::Schedule(r, Some(t)) => Some(c.schedule_with(r, &[(Kernel::INDEX, *t)])?),
                    Call::Copy(n, s, d, m) => c.device_to_device(n, s, d, m.clone())?,
                };
                events.extend(e);
            }
            Ok(())
        });
        for e in events {
            self.track(e);
        }
        let step = step.map_err(err)?;
        for _ in 0..replays {
            match self.engine.replay(&step) {
                Ok(events) => {
                    REPLAYED.fetch_add(1, Ordering::Relaxed);
                    for e in events {
                        self.track(e);
                    }
                }
                Err(tributary::Error::ReplayInvalidated { .. }) => {
                    REPLAYS_INVALIDATED.fetch_add(1, Ordering::Relaxed);
                    for op in ops {
                        self.apply(op)?;
                    }
                }
                Err(e) => return Err(err(e)),
            }
        }
        Ok(Obs::Done)
    }
}

impl Handles for EngineExecutor {
    fn node_of(&self, n: N) -> TensorNode {
        self.nodes[n.0].clone()
    }

    fn context_of(&self, c: C) -> Result<Context, String> {
        self.context(c).cloned()
    }

    fn routine_of(&self, r: R) -> Result<Routine, String> {
        self.routine(r).cloned()
    }
}

impl Executor for EngineExecutor {
    fn begin_op(&mut self, index: usize) {
        if std::env::var_os("TRIBUTARY_TRACE_OPS").is_some() {
            eprintln!("op {index}");
        }
        if let Some(r) = &self.recorder {
            r.begin_op(index);
        }
    }

    fn apply(&mut self, op: &Op) -> OpResult {
        match op {
            Op::Root { device, stream } => {
                let ctx = self.engine.context(*device, *stream).map_err(err)?;
                self.ctxs.push(ctx);
                Ok(Obs::Done)
            }
            Op::Link { ctx, kernel } => {
                let spec =
                    kernel_spec(&self.nodes, kernel, self.engine.backend_name()).map_err(err)?;
                let ctx = self.context(*ctx)?.clone();
                let routine = self.engine.link(&ctx, spec).map_err(err)?;
                self.ctxs.push(routine.context().clone());
                self.routines.push(routine);
                Ok(Obs::Done)
            }
            Op::Schedule { routine } => {
                let r = self.routine(*routine)?.clone();
                let e = self.engine.schedule(&r).map_err(err)?;
                self.track(e);
                Ok(Obs::Done)
            }
            Op::ScheduleWith { routine, t } => {
                let r = self.routine(*routine)?.clone();
                let e = self
                    .engine
                    .schedule_with(&r, &[(Kernel::INDEX, *t)])
                    .map_err(err)?;
                self.track(e);
                Ok(Obs::Done)
            }
            Op::InitFromHost { ctx, node, data } => {
                let ctx = self.context(*ctx)?.clone();
                let (n, numel) = (self.nodes[node.0].clone(), self.setup.nodes[node.0].numel());
                let child = match self.setup.nodes[node.0].dtype {
                    Dt::F32 => self.engine.init_from_host(&ctx, &n, &data.f32s(numel)),
                    Dt::I32 => self.engine.init_from_host(&ctx, &n, &data.i32s(numel)),
                }
                .map_err(err)?;
                self.ctxs.push(child);
                Ok(Obs::Done)
            }
            Op::FromHost { ctx, node } => {
                let ctx = self.context(*ctx)?.clone();
                let e = self
                    .engine
                    .from_host(&ctx, &self.nodes[node.0])
                    .map_err(err)?;
                self.track(e);
                Ok(Obs::Done)
            }
            Op::ToHost { ctx, node } => {
                let ctx = self.context(*ctx)?.clone();
                let e = self
                    .engine
                    .to_host(&ctx, &self.nodes[node.0])
                    .map_err(err)?;
                self.track(e);
                Ok(Obs::Done)
            }
            Op::DeviceToDevice {
                node,
                src,
                dst,
                mode,
            } => {
                let (src, dst) = (self.context(*src)?.clone(), self.context(*dst)?.clone());
                let mode = match mode {
                    D2d::No => MergeBufferUse::No,
                    D2d::Copy => MergeBufferUse::Copy,
                    D2d::StreamingFor(r) => MergeBufferUse::StreamingFor(self.routine(*r)?.clone()),
                };
                let node = self.nodes[node.0].clone();
                match self
                    .engine
                    .device_to_device(&node, &src, &dst, mode)
                    .map_err(err)?
                {
                    Some(e) => {
                        self.track(e);
                        Ok(Obs::Done)
                    }
                    None => Ok(Obs::NoOp),
                }
            }
            Op::HostRead { node } => self.host_read(*node).map(Obs::Values),
            Op::HostWrite { node, data } => {
                let (n, numel) = (self.nodes[node.0].clone(), self.setup.nodes[node.0].numel());
                match self.setup.nodes[node.0].dtype {
                    Dt::F32 => self.engine.host_write(&n, &data.f32s(numel)),
                    Dt::I32 => self.engine.host_write(&n, &data.i32s(numel)),
                }
                .map_err(err)?;
                Ok(Obs::Done)
            }
            Op::Read { ctx, node } => self.read(*ctx, *node).map(Obs::Values),
            Op::Finalize { ctx } => {
                let ctx = self.context(*ctx)?.clone();
                self.engine.finalize(&ctx).map_err(err)?;
                Ok(Obs::Done)
            }
            Op::Sync => self.sync().map(|_| Obs::Done),
            Op::Checkpoint => self.checkpoint(),
            Op::Teardown => self.teardown(),
            Op::Step { ops, replays } => self.step(ops, *replays),
        }
    }

    fn probe(&self) -> Option<Probe> {
        let (tables, host_events) = self.engine.table_sizes();
        Some(probe_of(&self.engine.memory_stats(), &tables, host_events))
    }
}
