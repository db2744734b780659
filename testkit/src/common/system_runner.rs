//! Programs on the actor system (`tributary_actors::System`).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use tributary::backend::{Backend, BackendKind};
use tributary::{
    protocol::{Context, Routine},
    EventStatus, MergeBufferUse, NodeId, TensorNode,
};
use tributary_actors::{StreamConfig, System, Ticket};

use super::{
    engine_runner::{
        config, create_nodes, device_memory, exact_cpu, exact_cpu_backend, kernel_spec, probe_of,
    },
    graph::{GraphRecorder, GraphReport, RecordingBackend},
    program::*,
    steps::{resolve_calls, Call, Handles},
};

type MakeKind = Box<dyn FnMut(&Setup) -> BackendKind>;
type MakeBackend = Box<dyn FnMut(&Setup) -> tributary::Result<Arc<dyn Backend>>>;

enum Make {
    /// The system creates the backend of this kind.
    Kind(MakeKind),
    /// A backend made here, wrapped in a [`RecordingBackend`] to check the dependency graph.
    Recording(MakeBackend),
}

/// Runs programs on fresh actor systems.
pub struct SystemRunner {
    name: String,
    make: Make,
    /// Systems spawned with the automatic replay on.
    auto_replay: bool,
    /// The recorder of the last run, when recording.
    recorder: Option<Arc<GraphRecorder>>,
}

impl SystemRunner {
    /// Actor systems on CPU devices, whose dependency graph is checked.
    pub fn cpu() -> SystemRunner {
        SystemRunner::recording("system(cpu)", |setup| exact_cpu_backend(setup.devices))
    }

    /// Actor systems on the backend `backend` picks for a setup (e.g. Vulkan with the
    /// setup's number of logical devices).
    pub fn with(name: &str, backend: impl FnMut(&Setup) -> BackendKind + 'static) -> SystemRunner {
        SystemRunner {
            name: name.into(),
            make: Make::Kind(Box::new(backend)),
            auto_replay: false,
            recorder: None,
        }
    }

    /// Actor systems on the backend `make` creates for a setup, whose dependency graph is
    /// recorded and checked after each run ([`ProgramRunner::graph`]).
    pub fn recording(
        name: &str,
        make: impl FnMut(&Setup) -> tributary::Result<Arc<dyn Backend>> + 'static,
    ) -> SystemRunner {
        SystemRunner {
            name: name.into(),
            make: Make::Recording(Box::new(make)),
            auto_replay: false,
            recorder: None,
        }
    }

    /// This runner with the systems' automatic replay on (`SystemBuilder::auto_replay`);
    /// what it replayed is added to the calling thread's [`auto_replayed`].
    pub fn with_auto_replay(mut self) -> SystemRunner {
        self.auto_replay = true;
        self.name = format!("{} with automatic replay", self.name);
        self
    }
}

thread_local! {
    /// What the automatic replay did in the systems this thread ran: (calls replayed,
    /// periods recognised).
    static AUTO_REPLAYED: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// Calls the automatic replay replayed, and periods it recognised, over every system the
/// calling thread ran (a test runs on its own thread: a test of the automatic replay
/// checks that the first is not zero).
pub fn auto_replayed() -> (u64, u64) {
    AUTO_REPLAYED.with(|c| c.get())
}

impl ProgramRunner for SystemRunner {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn start(&mut self, setup: &Setup) -> Result<Box<dyn Executor>, String> {
        self.recorder = None;
        let builder = System::builder()
            .cpu_devices(setup.devices)
            .cpu(exact_cpu())
            .streams(StreamConfig::MostParallelStreams(setup.streams))
            .pools(config(setup).pools)
            .auto_replay(self.auto_replay);
        let builder = match &mut self.make {
            Make::Kind(kind) => builder.backend(kind(setup)),
            Make::Recording(make) => {
                let backend = make(setup).map_err(|e| describe(&e))?;
                if super::graph::enabled() {
                    let recorder = GraphRecorder::new();
                    self.recorder = Some(recorder.clone());
                    builder.backend_instance(Arc::new(RecordingBackend::new(backend, recorder)))
                } else {
                    builder.backend_instance(backend)
                }
            }
        };
        let sys = builder.spawn().map_err(|e| describe(&e))?;
        let mut exec = SystemExecutor::new(sys, setup)?;
        exec.recorder = self.recorder.clone();
        Ok(Box::new(exec))
    }

    fn graph(&self) -> Option<GraphReport> {
        self.recorder.as_ref().map(|r| r.check())
    }
}

/// One actor system executing a program's operations.
pub struct SystemExecutor {
    sys: System,
    setup: Setup,
    nodes: Vec<TensorNode>,
    index: HashMap<NodeId, usize>,
    ctxs: Vec<(Context, bool)>,
    routines: Vec<Routine>,
    tickets: Vec<Ticket>,
    events: Vec<tributary::Event>,
    recorder: Option<Arc<GraphRecorder>>,
    /// The backend's name, which picks the user kernels' language.
    backend: String,
}

fn err(e: tributary::Error) -> String {
    describe(&e)
}

impl SystemExecutor {
    fn new(sys: System, setup: &Setup) -> Result<SystemExecutor, String> {
        let (nodes, index) = create_nodes(setup)?;
        let backend = sys.device_info(0).map_err(err)?.backend;
        Ok(SystemExecutor {
            backend,
            sys,
            setup: setup.clone(),
            nodes,
            index,
            ctxs: Vec::new(),
            routines: Vec::new(),
            tickets: Vec::new(),
            events: Vec::new(),
            recorder: None,
        })
    }

    fn context(&self, c: C) -> Result<Context, String> {
        self.ctxs
            .get(c.0)
            .map(|(ctx, _)| ctx.clone())
            .ok_or_else(|| format!("Unknown: no context c{}", c.0))
    }

    fn routine(&self, r: R) -> Result<Routine, String> {
        self.routines
            .get(r.0)
            .cloned()
            .ok_or_else(|| format!("Unknown: no routine r{}", r.0))
    }

    fn read(&self, c: C, n: N) -> Result<Values, String> {
        let ctx = self.context(c)?;
        let node = &self.nodes[n.0];
        Ok(match self.setup.nodes[n.0].dtype {
            Dt::F32 => Values::f32s(&self.sys.read::<f32>(&ctx, node).map_err(err)?),
            Dt::I32 => Values::I32(self.sys.read::<i32>(&ctx, node).map_err(err)?),
        })
    }

    fn host_read(&self, n: N) -> Result<Values, String> {
        let node = &self.nodes[n.0];
        Ok(match self.setup.nodes[n.0].dtype {
            Dt::F32 => Values::f32s(&self.sys.host_read::<f32>(node).map_err(err)?),
            Dt::I32 => Values::I32(self.sys.host_read::<i32>(node).map_err(err)?),
        })
    }

    /// Waits for all work; a refused ticket or a failed operation is an error.
    fn sync(&mut self) -> Result<(), String> {
        self.sys.sync().map_err(err)?;
        for t in self.tickets.drain(..) {
            self.events.push(t.event().map_err(err)?);
        }
        for e in self.events.drain(..) {
            if let EventStatus::Failed(f) = e.status() {
                return Err(format!("Failed: event {e}: {f}"));
            }
        }
        Ok(())
    }

    fn live(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.ctxs.len()).filter(|&i| self.ctxs[i].1)
    }

    fn checkpoint(&mut self) -> OpResult {
        self.sync()?;
        let mut buffers = Vec::new();
        for i in self.live().collect::<Vec<_>>() {
            let mut ns: Vec<usize> = self.ctxs[i]
                .0
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
        for i in self.live().collect::<Vec<_>>().into_iter().rev() {
            self.sys.finalize(&self.ctxs[i].0).map_err(err)?;
            self.ctxs[i].1 = false;
        }
        self.sync()?;
        let tables = self.sys.table_sizes().map_err(err)?;
        let memory = self.sys.memory_stats().map_err(err)?;
        Ok(Obs::Memory(device_memory(&memory, &tables)))
    }
}

/// Replays of captured steps (`Op::Step`) actor systems ran, over every program of the
/// process: `SYSTEM_REPLAYED` planned, `SYSTEM_REPLAYS_INVALIDATED` refused as invalidated
/// (then issued call by call). A test of captured steps checks that the first is not zero.
pub static SYSTEM_REPLAYED: AtomicU64 = AtomicU64::new(0);
/// See [`SYSTEM_REPLAYED`].
pub static SYSTEM_REPLAYS_INVALIDATED: AtomicU64 = AtomicU64::new(0);

impl SystemExecutor {
    /// Captures `ops` (schedules and copies) as a step on the system, then replays it
    /// `replays` times; a replay refused as invalidated issues the calls instead.
    fn step(&mut self, ops: &[Op], replays: u32) -> OpResult {
        let calls = resolve_calls(ops, self)?;
        let mut tickets = Vec::new();
        let step = self.sys.capture(|c| {
            for call in &calls {
                let t = match call {
                    Call::Schedule(r, None) => Some(c.schedule(r)?),
                    Call::Schedule(r, Some(t)) => Some(c.schedule_with(r, &[(Kernel::INDEX, *t)])?),
                    Call::Copy(n, s, d, m) => c.device_to_device(n, s, d, m.clone())?,
                };
                tickets.extend(t);
            }
            Ok(())
        });
        self.tickets.extend(tickets);
        let step = step.map_err(err)?;
        for _ in 0..replays {
            let tickets = self.sys.replay(&step).map_err(err)?;
            // All or nothing: every ticket of a replay has the same fate.
            match tickets.first().map(Ticket::event) {
                Some(Err(tributary::Error::ReplayInvalidated { .. })) => {
                    SYSTEM_REPLAYS_INVALIDATED.fetch_add(1, Ordering::Relaxed);
                    for t in &tickets {
                        if !matches!(t.event(), Err(tributary::Error::ReplayInvalidated { .. })) {
                            return Err(format!(
                                "Unknown: a replay refused on one device, not on another: {:?}",
                                t.event()
                            ));
                        }
                    }
                    for op in ops {
                        self.apply(op)?;
                    }
                }
                _ => {
                    SYSTEM_REPLAYED.fetch_add(1, Ordering::Relaxed);
                    self.tickets.extend(tickets);
                }
            }
        }
        Ok(Obs::Done)
    }
}

impl Handles for SystemExecutor {
    fn node_of(&self, n: N) -> TensorNode {
        self.nodes[n.0].clone()
    }

    fn context_of(&self, c: C) -> Result<Context, String> {
        self.context(c)
    }

    fn routine_of(&self, r: R) -> Result<Routine, String> {
        self.routine(r)
    }
}

impl Executor for SystemExecutor {
    fn begin_op(&mut self, index: usize) {
        if let Some(r) = &self.recorder {
            r.begin_op(index);
        }
    }

    fn apply(&mut self, op: &Op) -> OpResult {
        match op {
            Op::Root { device, stream } => {
                let ctx = self.sys.context(*device, *stream).map_err(err)?;
                self.ctxs.push((ctx.protocol_context().clone(), true));
                Ok(Obs::Done)
            }
            Op::Link { ctx, kernel } => {
                let spec = kernel_spec(&self.nodes, kernel, &self.backend).map_err(err)?;
                let r = self.sys.link(&self.context(*ctx)?, spec).map_err(err)?;
                self.ctxs.push((r.routine().context().clone(), true));
                self.routines.push(r.routine().clone());
                Ok(Obs::Done)
            }
            Op::Schedule { routine } => {
                let t = self.sys.schedule(&self.routine(*routine)?).map_err(err)?;
                self.tickets.push(t);
                Ok(Obs::Done)
            }
            Op::ScheduleWith { routine, t } => {
                let ticket = self
                    .sys
                    .schedule_with(&self.routine(*routine)?, &[(Kernel::INDEX, *t)])
                    .map_err(err)?;
                self.tickets.push(ticket);
                Ok(Obs::Done)
            }
            Op::InitFromHost { ctx, node, data } => {
                let ctx = self.context(*ctx)?;
                let (n, numel) = (&self.nodes[node.0], self.setup.nodes[node.0].numel());
                let child = match self.setup.nodes[node.0].dtype {
                    Dt::F32 => self.sys.init_from_host(&ctx, n, &data.f32s(numel)),
                    Dt::I32 => self.sys.init_from_host(&ctx, n, &data.i32s(numel)),
                }
                .map_err(err)?;
                self.ctxs.push((child.protocol_context().clone(), true));
                Ok(Obs::Done)
            }
            Op::FromHost { ctx, node } => {
                let t = self
                    .sys
                    .from_host(&self.context(*ctx)?, &self.nodes[node.0])
                    .map_err(err)?;
                self.tickets.push(t);
                Ok(Obs::Done)
            }
            Op::ToHost { ctx, node } => {
                let t = self
                    .sys
                    .to_host(&self.context(*ctx)?, &self.nodes[node.0])
                    .map_err(err)?;
                self.tickets.push(t);
                Ok(Obs::Done)
            }
            Op::DeviceToDevice {
                node,
                src,
                dst,
                mode,
            } => {
                let (src, dst) = (self.context(*src)?, self.context(*dst)?);
                let mode = match mode {
                    D2d::No => MergeBufferUse::No,
                    D2d::Copy => MergeBufferUse::Copy,
                    D2d::StreamingFor(r) => MergeBufferUse::StreamingFor(self.routine(*r)?),
                };
                match self
                    .sys
                    .device_to_device(&self.nodes[node.0], &src, &dst, mode)
                    .map_err(err)?
                {
                    Some(t) => {
                        // A refusal comes through the ticket, as the engine's call returns it.
                        self.events.push(t.event().map_err(err)?);
                        Ok(Obs::Done)
                    }
                    None => Ok(Obs::NoOp),
                }
            }
            Op::HostRead { node } => self.host_read(*node).map(Obs::Values),
            Op::HostWrite { node, data } => {
                let (n, numel) = (&self.nodes[node.0], self.setup.nodes[node.0].numel());
                match self.setup.nodes[node.0].dtype {
                    Dt::F32 => self.sys.host_write(n, &data.f32s(numel)),
                    Dt::I32 => self.sys.host_write(n, &data.i32s(numel)),
                }
                .map_err(err)?;
                Ok(Obs::Done)
            }
            Op::Read { ctx, node } => self.read(*ctx, *node).map(Obs::Values),
            Op::Finalize { ctx } => {
                self.sys.finalize(&self.context(*ctx)?).map_err(err)?;
                self.ctxs[ctx.0].1 = false;
                Ok(Obs::Done)
            }
            Op::Sync => self.sync().map(|_| Obs::Done),
            Op::Checkpoint => self.checkpoint(),
            Op::Teardown => self.teardown(),
            Op::Step { ops, replays } => self.step(ops, *replays),
        }
    }

    fn probe(&self) -> Option<Probe> {
        let tables = self.sys.table_sizes().ok()?;
        let memory = self.sys.memory_stats().ok()?;
        // The system does not report the events held by host arrays.
        Some(probe_of(&memory, &tables, 0))
    }
}

impl Drop for SystemExecutor {
    fn drop(&mut self) {
        let stats = self.sys.replay_stats();
        AUTO_REPLAYED.with(|c| {
            let (calls, periods) = c.get();
            c.set((calls + stats.calls_replayed, periods + stats.periods));
        });
        let _ = self.sys.shutdown();
    }
}
