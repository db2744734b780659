//! A model executor for the actor layer: the real `Dispatcher` (the host side and the
//! coordinator's routing) and the real `DeviceCore`s (the device actors' decisions), with
//! the inboxes as shim-locked queues, device actors as model threads, and streams as
//! `world.rs`'s model executor over loom-cell memory.
//!
//! - **Host threads** are the model's main thread and any it spawns; they call the
//!   dispatcher exactly as `System` does (one atomic post per call).
//! - **Device actors** run `DeviceCore::run` whenever their inbox kicks: one model thread
//!   per device ([`Actors::PerDevice`]), or one thread for every device
//!   ([`Actors::Shared`], alternating which device it serves first, for models that need
//!   a second host thread within loom's five threads). Actors on one arbiter are a real
//!   deployment too. With [`Actors::SharedInline`], a post that finds a device idle
//!   decides on the posting thread when it can take the device's turn, as `System` does by
//!   default (`tributary::dispatch::DeviceTurn`).
//! - **Streams** run each plan as a backend does (`world::run_job`): wait for the
//!   dependencies, run the work on loom cells, signal or fail the timeline. Bindings are
//!   resolved when the device's core submits the plan (on the actor thread), as the CPU
//!   backend resolves them in `submit`.
//! - **Host arrays**: the dispatcher's host reads and writes touch the real host arrays;
//!   a `HostArrayObserver` mirrors each access onto the array's loom cells, under the host
//!   table's lock, so loom checks them against the devices' transfers.

use std::sync::{Arc as StdArc, Mutex as StdMutex};

use tributary::{
    dispatch::{
        self, answer, messages::DeviceOp, messages::Query, messages::ReadValue, AllReduceCall,
        DeviceCore, DeviceSlot, DeviceTurn, Dispatcher, Inbox, PlanSink, Progress,
    },
    kernels::RoutineSpec,
    memory::{AlignedBuffer, PoolConfig},
    pending::PendingEvent,
    protocol::{Context, DeviceState, HostArrayObserver, HostTable, Plans, Routine},
    sync::{
        channel::{self, Sender},
        thread::{self, JoinHandle},
        Arc, Condvar, Mutex,
    },
    DeviceId, MergeBufferUse, Result, StreamId, TensorNode, Timeline,
};

use crate::world::{run_job, Job, Memory, PoolLog};

/// How device actors are mapped to model threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Actors {
    /// One thread per device.
    #[allow(dead_code)]
    PerDevice,
    /// One thread for every device.
    Shared,
    /// One thread for every device, and a post that finds a device idle decides on the
    /// posting thread when nobody holds the device's turn (`DeviceTurn`, the actor
    /// system's default): host threads and the actor thread race for the turns.
    SharedInline,
}

/// Kicks of the inboxes an actor thread serves, and the request to stop.
struct Signal {
    state: Mutex<(bool, bool)>,
    cond: Condvar,
}

impl Signal {
    fn new() -> Arc<Signal> {
        Arc::new(Signal {
            state: Mutex::new((false, false)),
            cond: Condvar::new(),
        })
    }

    fn kick(&self) {
        self.state.lock().0 = true;
        self.cond.notify_all();
    }

    fn stop(&self) {
        self.state.lock().1 = true;
        self.cond.notify_all();
    }

    /// Waits for a kick; `false` once asked to stop with nothing kicked.
    fn wait(&self) -> bool {
        let mut s = self.state.lock();
        loop {
            if s.0 {
                s.0 = false;
                return true;
            }
            if s.1 {
                return false;
            }
            s = self.cond.wait(s);
        }
    }
}

/// Hands a device's plans to its model streams.
struct ModelSink {
    memory: StdArc<StdMutex<Memory>>,
    queues: Vec<Sender<Job>>,
    timelines: Vec<Arc<Timeline>>,
}

impl PlanSink for ModelSink {
    fn submit(&mut self, plans: &mut Plans) {
        let mut memory = self.memory.lock().unwrap();
        memory.apply_pool_ops();
        for plan in plans.drain(..) {
            let op = memory.resolve(plan.work());
            let i = plan.stream().index as usize;
            let job = Job {
                stream: plan.stream(),
                timeline: self.timelines[i].clone(),
                event: plan.event().clone(),
                deps: plan.deps().to_vec(),
                label: plan.work().label(),
                op,
            };
            assert!(self.queues[i].send(job).is_ok(), "a model stream is gone");
        }
    }
}

/// Mirrors host-side accesses of host arrays onto their loom cells (see the module docs).
struct HostCells {
    memory: StdArc<StdMutex<Memory>>,
    /// What the last host-side read saw in the cells.
    last_read: StdMutex<Vec<i64>>,
}

impl HostArrayObserver for HostCells {
    fn wrote(&self, array: &StdArc<AlignedBuffer>, data: &[u8]) {
        let values: Vec<i64> = data
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect();
        let mut memory = self.memory.lock().unwrap();
        memory.host_region(array, data.len() as u64).write(&values);
    }

    fn read(&self, array: &StdArc<AlignedBuffer>, bytes: usize) {
        let mut memory = self.memory.lock().unwrap();
        let values = memory.host_region(array, bytes as u64).read();
        *self.last_read.lock().unwrap() = values;
    }
}

/// Devices, their actors and streams, and the dispatcher of one model run.
pub struct ActorWorld {
    dispatcher: StdArc<Dispatcher>,
    memory: StdArc<StdMutex<Memory>>,
    host_cells: StdArc<HostCells>,
    signals: Vec<Arc<Signal>>,
    actors: Vec<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
}

impl ActorWorld {
    /// `streams[d]` streams on device `d`, each a model thread, device actors on threads
    /// as `actors` says, and tiny pools (as `World::new`).
    pub fn new(streams: &[usize], actors: Actors) -> ActorWorld {
        ActorWorld::build(streams, actors, false)
    }

    /// [`ActorWorld::new`] with the dispatcher's automatic replay on.
    pub fn with_auto_replay(streams: &[usize], actors: Actors) -> ActorWorld {
        ActorWorld::build(streams, actors, true)
    }

    fn build(streams: &[usize], actors: Actors, auto_replay: bool) -> ActorWorld {
        let pools = PoolConfig {
            pool_bytes: 32,
            min_alignment: 4,
            limit_bytes: None,
            release_empty_pools: true,
        };
        let pool_log = PoolLog::shared();
        let memory = StdArc::new(StdMutex::new(Memory::new(pool_log.clone())));
        let host = Arc::new(Mutex::new(HostTable::default()));
        let host_cells = StdArc::new(HostCells {
            memory: memory.clone(),
            last_read: StdMutex::new(Vec::new()),
        });
        host.lock().observe(host_cells.clone());
        let mut slots = Vec::new();
        let mut cores = Vec::new();
        let mut workers = Vec::new();
        for (d, &n) in streams.iter().enumerate() {
            let device = DeviceId(d as u32);
            let timelines: Vec<_> = (0..n as u32)
                .map(|index| Timeline::new(StreamId { device, index }))
                .collect();
            let mut queues = Vec::new();
            for _ in 0..n {
                let (tx, rx) = channel::unbounded::<Job>();
                workers.push(thread::spawn(move || {
                    while let Ok(job) = rx.recv() {
                        run_job(job);
                    }
                }));
                queues.push(tx);
            }
            let state = DeviceState::new(
                device,
                timelines.clone(),
                pools.clone(),
                Box::new(PoolLog::new(device, pool_log.clone())),
            );
            let sink = ModelSink {
                memory: memory.clone(),
                queues,
                timelines: timelines.clone(),
            };
            let inbox = Inbox::new(device, 64);
            cores.push((
                DeviceCore::new(state, host.clone(), None, Box::new(sink)),
                inbox.clone(),
            ));
            slots.push(DeviceSlot {
                id: device,
                inbox,
                timelines,
            });
        }
        let dispatcher = StdArc::new(
            Dispatcher::new(slots, StdArc::new(|_, _| true), host)
                .with_auto_replay(auto_replay, None),
        );
        let turns: Vec<StdArc<DeviceTurn>> = cores
            .into_iter()
            .map(|(core, inbox)| DeviceTurn::new(core, inbox))
            .collect();
        let groups: Vec<Vec<StdArc<DeviceTurn>>> = match actors {
            Actors::PerDevice => turns.into_iter().map(|t| vec![t]).collect(),
            Actors::Shared => vec![turns],
            Actors::SharedInline => {
                for t in &turns {
                    t.decide_on_posting_threads();
                }
                vec![turns]
            }
        };
        let mut signals = Vec::new();
        let mut actor_threads = Vec::new();
        for group in groups {
            let signal = Signal::new();
            for turn in &group {
                let s = signal.clone();
                turn.inbox()
                    .set_waker(std::sync::Arc::new(move || s.kick()));
            }
            let s = signal.clone();
            actor_threads.push(thread::spawn(move || {
                let mut first = 0;
                while s.wait() {
                    let n = group.len();
                    for k in 0..n {
                        let _: Progress = group[(first + k) % n].run_kicked();
                    }
                    first = (first + 1) % n;
                }
            }));
            signals.push(signal);
        }
        ActorWorld {
            dispatcher,
            memory,
            host_cells,
            signals,
            actors: actor_threads,
            workers,
        }
    }

    /// The dispatcher (for host threads the model spawns).
    pub fn dispatcher(&self) -> StdArc<Dispatcher> {
        self.dispatcher.clone()
    }

    /// Waits until every operation issued so far completed, then lets loom explore from
    /// here (see `World::begin_window`).
    pub fn begin_window(&mut self) {
        self.quiesce();
        loom::explore();
    }

    /// Closes the explored window.
    pub fn end_window(&mut self) {
        loom::stop_exploring();
    }

    /// Waits for every operation decided so far on every device.
    pub fn quiesce(&self) {
        for d in 0..self.dispatcher.device_count() {
            let events =
                dispatch::block_on(answer(self.dispatcher.query(d, Query::LastEvents).unwrap()))
                    .unwrap();
            for e in events {
                let _ = e.wait();
            }
        }
    }

    /// Stops the actors (once idle) and the streams, and joins them.
    pub fn shutdown(mut self) {
        for s in &self.signals {
            s.stop();
        }
        for a in self.actors.drain(..) {
            a.join().unwrap();
        }
        // The cores (and their senders) were dropped with the actor threads' state.
        for w in self.workers.drain(..) {
            w.join().unwrap();
        }
    }

    /// `System::context`.
    pub fn context(&self, device: usize, stream: usize) -> Context {
        dispatch::block_on(answer(self.dispatcher.new_context(device, stream).unwrap())).unwrap()
    }

    /// `System::link`.
    pub fn link(&self, ctx: &Context, spec: RoutineSpec) -> Routine {
        dispatch::block_on(answer(self.dispatcher.link(ctx, spec).unwrap())).unwrap()
    }

    /// `System::init_from_host` (the node must already be hosted).
    pub fn init_from_host(&self, ctx: &Context, node: &TensorNode, data: &[i64]) -> Context {
        host_write(&self.dispatcher, node, data);
        dispatch::block_on(answer(self.dispatcher.init_from_host(ctx, node).unwrap())).unwrap()
    }

    /// The value of `node`'s buffer in `ctx`, after its last write.
    pub fn read(&self, ctx: &Context, node: &TensorNode) -> Vec<i64> {
        self.reader().read(ctx, node)
    }

    /// A reader of device buffers for host threads the model spawns ([`DeviceReader::read`]).
    pub fn reader(&self) -> DeviceReader {
        DeviceReader {
            dispatcher: self.dispatcher.clone(),
            memory: self.memory.clone(),
        }
    }

    /// `System::host_write`.
    pub fn host_write(&self, node: &TensorNode, data: &[i64]) {
        host_write(&self.dispatcher, node, data);
    }

    /// A host reader for host threads the model spawns (`HostReader::read`).
    pub fn host_reader(&self) -> HostReader {
        HostReader {
            dispatcher: self.dispatcher.clone(),
            cells: self.host_cells.clone(),
        }
    }
}

/// Reads device buffers as `ActorWorld::read` does, from any model thread.
#[derive(Clone)]
pub struct DeviceReader {
    dispatcher: StdArc<Dispatcher>,
    memory: StdArc<StdMutex<Memory>>,
}

impl DeviceReader {
    /// The value of `node`'s buffer in `ctx`, after its last write (a call of its own).
    pub fn read(&self, ctx: &Context, node: &TensorNode) -> Vec<i64> {
        let bytes = node.size_in_bytes().unwrap();
        let into = StdArc::new(AlignedBuffer::new(bytes as usize, 64).unwrap());
        let d = self.dispatcher.index_of(ctx.device()).unwrap();
        let value = dispatch::block_on(answer(
            self.dispatcher
                .request(d, |reply| DeviceOp::Read {
                    ctx: ctx.clone(),
                    node: node.clone(),
                    into: into.clone(),
                    raw: true,
                    reply,
                })
                .unwrap(),
        ))
        .unwrap();
        let ReadValue::Device(event) = value else {
            panic!("a raw read answered with the host array")
        };
        event.wait().unwrap();
        self.memory.lock().unwrap().host_region(&into, bytes).read()
    }
}

/// `System::schedule` with the automatic replay (on when the world was made so): the
/// routine's ticket, held or issued.
pub fn auto_schedule(d: &StdArc<Dispatcher>, routine: &Routine) -> dispatch::Issued {
    d.auto_schedule(routine, tributary::kernels::Bindings::none())
        .unwrap()
}

/// Waits for a ticket of the automatic replay (issuing what it holds if it must).
pub fn wait_issued(issued: &dispatch::Issued) -> Result<()> {
    match issued {
        dispatch::Issued::Now(p) => wait(p),
        dispatch::Issued::Held(h) => wait(&h.pending()?),
    }
}

/// `System::schedule`: the routine's pending event.
pub fn schedule(d: &Dispatcher, routine: &Routine) -> PendingEvent {
    d.schedule(routine, tributary::kernels::Bindings::none())
        .unwrap()
}

/// `System::device_to_device`.
pub fn device_to_device(
    d: &Dispatcher,
    node: &TensorNode,
    src: &Context,
    dst: &Context,
    mode: MergeBufferUse,
) -> Option<PendingEvent> {
    d.device_to_device(node, src, dst, mode).unwrap()
}

/// `System::to_host`.
pub fn to_host(d: &Dispatcher, ctx: &Context, node: &TensorNode) -> PendingEvent {
    d.transfer(ctx, node, false).unwrap()
}

/// `AllReducePlan::run`.
pub fn all_reduce(d: &Dispatcher, call: &AllReduceCall) -> Vec<PendingEvent> {
    d.all_reduce(call).unwrap()
}

/// `System::host_write`.
pub fn host_write(d: &Dispatcher, node: &TensorNode, data: &[i64]) {
    let bytes: Vec<u8> = data
        .iter()
        .flat_map(|&v| (v as f32).to_ne_bytes())
        .collect();
    dispatch::block_on(d.host_write(node, &bytes)).unwrap();
}

/// `System::host_read` from any host thread.
pub struct HostReader {
    dispatcher: StdArc<Dispatcher>,
    cells: StdArc<HostCells>,
}

impl HostReader {
    /// The values the host read saw.
    pub fn read(&self, node: &TensorNode) -> Vec<i64> {
        host_read(&self.dispatcher, &self.cells, node)
    }
}

fn host_read(d: &Dispatcher, cells: &HostCells, node: &TensorNode) -> Vec<i64> {
    dispatch::block_on(d.host_read(node)).unwrap();
    cells.last_read.lock().unwrap().clone()
}

/// Waits for a pending event's operation (planned, then complete).
pub fn wait(p: &PendingEvent) -> Result<()> {
    p.event().wait()
}

/// `System::capture` of one copy: the step (the copy runs for real, and is waited for).
pub fn capture_copy(
    d: &Dispatcher,
    node: &TensorNode,
    src: &Context,
    dst: &Context,
) -> tributary::Step {
    let mut c = dispatch::StepCapture::new(d);
    let copied = c
        .device_to_device(node, src, dst, MergeBufferUse::No)
        .unwrap()
        .expect("a copy between two buffers");
    for fence in c.fences().unwrap() {
        dispatch::block_on(answer(fence)).unwrap();
    }
    wait(&copied).unwrap();
    c.finish().unwrap()
}

/// `System::replay`: the last event of every stream of the step.
pub fn replay(d: &Dispatcher, step: &tributary::Step) -> Vec<PendingEvent> {
    d.replay(step, None).unwrap().into_vec()
}
