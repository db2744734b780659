//! A model executor for the protocol: the real `DeviceState`s and `HostTable`, driven in
//! program order by the model's main thread exactly as `Engine` drives them, with every
//! stream a loom thread and every byte of device or host memory a loom `UnsafeCell`.
//!
//! - **Memory.** Every device pool and every host array is a row of `Words`, one loom cell
//!   per 4-byte element (the models use one- and two-element `f32` nodes and compute on
//!   integers). Kernels read their inputs with `with` and write their outputs with
//!   `with_mut`, so two accesses that the protocol failed to order are a loom causality
//!   failure, whatever values they carry. Creating a pool zeroes fresh cells; releasing
//!   one *writes* every cell (freeing memory is a write), so a pool released under a
//!   reader is caught too.
//! - **Streams.** One loom thread per stream, fed through `tributary::sync::channel` (a
//!   shim `Mutex`+`Condvar` queue under loom). A stream runs each plan exactly as the CPU
//!   backend's `run_item` does: `protocol::await_deps`, then the work, then
//!   `Timeline::signal`, or `Timeline::fail` with the root cause.
//! - **Bindings are resolved on the main thread at submission** (as the CPU backend
//!   does), so the model adds no synchronisation between streams: the only edges between
//!   stream threads are the events the protocol told them to wait for, plus what the main
//!   thread itself observed (a completed event it pruned) before submitting.
//! - **Determinism.** loom replays each interleaving, so the main thread must issue the
//!   same operations every time: no `sweep` and no table-wide prune (they iterate hash
//!   maps), and model state is kept in ordered maps.

use std::{collections::BTreeMap, sync::Arc as StdArc};

use tributary::{
    error::Result,
    event::Event,
    kernels::{Access, Builtin, Kernel, RoutineSpec},
    memory::{AlignedBuffer, PoolConfig, PoolMemory, PoolOp},
    protocol::{await_deps, Context, Dep, DeviceState, GlobalLoc, HostTable, Plan, Routine, Work},
    sync::{
        channel::{self, Sender},
        thread::{self, JoinHandle},
        Arc, UnsafeCell,
    },
    DType, DeviceId, Error, Failure, MemoryMode, MergeBufferUse, PoolId, StreamId, TensorNode,
    Timeline,
};

/// Bytes per modelled element (`f32`).
const WORD: u64 = 4;

/// The routine name the model executor fails (a "kernel that panics").
pub const FAILING_KERNEL: &str = "boom";

/// One-element `f32` node with `mode`.
pub fn node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [1])
        .with_mode(mode)
        .unwrap()
}

/// A custom routine writing `dst` that always fails when it runs.
pub fn boom(dst: &TensorNode) -> RoutineSpec {
    RoutineSpec::custom(
        FAILING_KERNEL,
        vec![(dst.clone(), Access::Write)],
        None,
        |_| Err("the model executor runs this routine, not this closure".into()),
    )
    .unwrap()
}

/// A row of modelled memory.
pub(crate) struct Words {
    cells: Vec<UnsafeCell<i64>>,
}

// SAFETY: streams and the main thread share rows; every access goes through loom's
// `with`/`with_mut`, and ordering them is exactly what the protocol under test must do
// (loom reports any pair it failed to order). The cells only hold `i64`s.
unsafe impl Sync for Words {}
// SAFETY: as above.
unsafe impl Send for Words {}

impl Words {
    fn zeroed(bytes: u64) -> StdArc<Words> {
        let n = (bytes / WORD).max(1) as usize;
        StdArc::new(Words {
            cells: (0..n).map(|_| UnsafeCell::new(0)).collect(),
        })
    }
}

/// Elements `start..start + len` of a row.
#[derive(Clone)]
pub(crate) struct Region {
    words: StdArc<Words>,
    start: usize,
    len: usize,
}

impl Region {
    fn cells(&self) -> &[UnsafeCell<i64>] {
        &self.words.cells[self.start..self.start + self.len]
    }

    pub(crate) fn read(&self) -> Vec<i64> {
        self.cells()
            .iter()
            // SAFETY: a plain read of an `i64`; loom reports it if a write to the same
            // cell is not ordered with it (the protocol's job).
            .map(|c| c.with(|p| unsafe { *p }))
            .collect()
    }

    pub(crate) fn write(&self, values: &[i64]) {
        assert_eq!(values.len(), self.len, "model bug: region size");
        for (c, &v) in self.cells().iter().zip(values) {
            // SAFETY: a plain write of an `i64`; loom reports it if any other access to
            // the same cell is not ordered with it.
            c.with_mut(|p| unsafe { *p = v });
        }
    }
}

/// What a stream does for one plan, with every binding resolved.
pub(crate) enum Op {
    Builtin {
        builtin: Builtin,
        args: Vec<Region>,
        merge: Option<Region>,
    },
    Copy {
        src: Region,
        dst: Region,
    },
    Memset {
        dst: Region,
    },
    Fail,
    Marker,
}

impl Op {
    fn execute(&self) -> std::result::Result<(), String> {
        match self {
            Op::Builtin {
                builtin,
                args,
                merge,
            } => {
                let out: Vec<i64> = match builtin {
                    Builtin::Fill { value } => vec![*value as i64; args[0].len],
                    Builtin::Copy => args[1].read(),
                    Builtin::AddInto => {
                        let src = args[1].read();
                        let dst = args[0].read();
                        dst.iter().zip(&src).map(|(d, s)| d + s).collect()
                    }
                    Builtin::AddMerge => {
                        let Some(merge) = merge else {
                            return Err("add_merge without a merge buffer".into());
                        };
                        let m = merge.read();
                        let dst = args[0].read();
                        dst.iter().zip(&m).map(|(d, s)| d + s).collect()
                    }
                    Builtin::Scale { alpha } => {
                        args[1].read().iter().map(|s| *alpha as i64 * s).collect()
                    }
                    Builtin::ScaleInPlace { alpha } => {
                        args[0].read().iter().map(|s| *alpha as i64 * s).collect()
                    }
                    other => panic!("model bug: {} is not modelled", other.name()),
                };
                args[0].write(&out);
                Ok(())
            }
            Op::Copy { src, dst } => {
                dst.write(&src.read());
                Ok(())
            }
            Op::Memset { dst } => {
                dst.write(&vec![0; dst.len]);
                Ok(())
            }
            Op::Fail => Err("kernel exploded".into()),
            Op::Marker => Ok(()),
        }
    }
}

pub(crate) struct Job {
    pub(crate) stream: StreamId,
    /// The timeline of `stream`, which this executor completes.
    pub(crate) timeline: Arc<Timeline>,
    pub(crate) event: Event,
    pub(crate) deps: Vec<Dep>,
    pub(crate) label: String,
    pub(crate) op: Op,
}

/// What a stream does with a plan: the executor rule every backend applies
/// (`src/backend/cpu.rs`, `run_item`).
pub(crate) fn run_job(job: Job) {
    let seq = job.event.seq();
    let timeline: &Timeline = &job.timeline;
    if let Err(root) = await_deps(&job.deps) {
        timeline.fail(seq, root);
        return;
    }
    match job.op.execute() {
        Ok(()) => timeline.signal(seq),
        Err(message) => timeline.fail(
            seq,
            StdArc::new(Failure {
                stream: job.stream,
                seq,
                operation: job.label,
                message,
            }),
        ),
    }
}

/// The world's [`PoolMemory`]: records what a device asks for (every creation succeeds);
/// the world creates and frees the memory words before its next submission.
pub(crate) struct PoolLog {
    device: DeviceId,
    log: StdArc<std::sync::Mutex<Vec<(DeviceId, PoolOp)>>>,
}

impl PoolLog {
    /// The log of `device`, writing into `log`.
    pub(crate) fn new(
        device: DeviceId,
        log: StdArc<std::sync::Mutex<Vec<(DeviceId, PoolOp)>>>,
    ) -> PoolLog {
        PoolLog { device, log }
    }

    pub(crate) fn shared() -> StdArc<std::sync::Mutex<Vec<(DeviceId, PoolOp)>>> {
        StdArc::new(std::sync::Mutex::new(Vec::new()))
    }

    fn push(&self, op: PoolOp) {
        self.log.lock().unwrap().push((self.device, op));
    }
}

impl PoolMemory for PoolLog {
    fn create_pool(&mut self, pool: PoolId, bytes: u64, align: u64) -> Result<()> {
        self.push(PoolOp::Create { pool, bytes, align });
        Ok(())
    }

    fn release_pool(&mut self, pool: PoolId) {
        self.push(PoolOp::Release { pool });
    }
}

/// Devices, host arrays and streams of one model run.
pub struct World {
    devices: Vec<DeviceState>,
    host: HostTable,
    queues: Vec<Vec<Sender<Job>>>,
    /// `timelines[d][i]`: the timeline of stream `i` of device `d`, completed by its worker.
    timelines: Vec<Vec<Arc<Timeline>>>,
    workers: Vec<JoinHandle<()>>,
    memory: Memory,
}

/// The modelled memory of a world: pools and host arrays as rows of loom cells, and what
/// turns a plan's work into an executor [`Op`] on them.
pub(crate) struct Memory {
    pools: BTreeMap<(DeviceId, PoolId), StdArc<Words>>,
    /// Pool operations the devices asked for, carried out before the next submission.
    pool_log: StdArc<std::sync::Mutex<Vec<(DeviceId, PoolOp)>>>,
    /// Host arrays, kept alive so that their addresses identify them.
    host_words: Vec<(StdArc<AlignedBuffer>, StdArc<Words>)>,
}

impl Memory {
    /// Empty memory, applying the pool operations logged in `pool_log`.
    pub(crate) fn new(pool_log: StdArc<std::sync::Mutex<Vec<(DeviceId, PoolOp)>>>) -> Memory {
        Memory {
            pools: BTreeMap::new(),
            pool_log,
            host_words: Vec::new(),
        }
    }

    pub(crate) fn apply_pool_ops(&mut self) {
        let ops = std::mem::take(&mut *self.pool_log.lock().unwrap());
        {
            for (device, op) in ops {
                match op {
                    PoolOp::Create { pool, bytes, .. } => {
                        self.pools.insert((device, pool), Words::zeroed(bytes));
                    }
                    PoolOp::Release { pool } => {
                        let words = self.pools.remove(&(device, pool)).unwrap();
                        // Freeing memory is a write: it must come after every use.
                        let all = Region {
                            len: words.cells.len(),
                            words,
                            start: 0,
                        };
                        all.write(&vec![-1; all.len]);
                    }
                }
            }
        }
    }

    pub(crate) fn region(&self, loc: GlobalLoc, bytes: u64) -> Region {
        let words = self
            .pools
            .get(&(loc.device, loc.loc.pool))
            .unwrap_or_else(|| panic!("plan refers to {loc}, whose pool does not exist"))
            .clone();
        assert_eq!(loc.loc.offset % WORD, 0);
        let start = (loc.loc.offset / WORD) as usize;
        let len = (bytes / WORD) as usize;
        assert!(
            start + len <= words.cells.len(),
            "{loc}+{bytes} out of its pool"
        );
        Region { words, start, len }
    }

    pub(crate) fn host_region(&mut self, array: &StdArc<AlignedBuffer>, bytes: u64) -> Region {
        let words = match self
            .host_words
            .iter()
            .find(|(a, _)| StdArc::ptr_eq(a, array))
        {
            Some((_, w)) => w.clone(),
            None => {
                let w = Words::zeroed(array.len() as u64);
                self.host_words.push((array.clone(), w.clone()));
                w
            }
        };
        let len = (bytes / WORD) as usize;
        assert!(len <= words.cells.len());
        Region {
            words,
            start: 0,
            len,
        }
    }

    pub(crate) fn resolve(&mut self, work: &Work) -> Op {
        match work {
            Work::Run {
                name,
                kernel,
                args,
                merge,
                ..
            } => match kernel {
                Kernel::Builtin(b) => Op::Builtin {
                    builtin: b.clone(),
                    args: args
                        .iter()
                        .map(|a| self.region(a.loc(), a.bytes()))
                        .collect(),
                    merge: merge.as_ref().map(|m| self.region(m.loc(), m.bytes())),
                },
                Kernel::Cpu(_) if &**name == FAILING_KERNEL => Op::Fail,
                Kernel::Cpu(_) => panic!("model bug: custom kernel {name} is not modelled"),
                Kernel::Shader(_) => panic!("model bug: shader kernel {name} is not modelled"),
                Kernel::Cuda(_) => panic!("model bug: CUDA kernel {name} is not modelled"),
            },
            Work::Copy {
                src, dst, bytes, ..
            } => Op::Copy {
                src: self.region(*src, *bytes),
                dst: self.region(*dst, *bytes),
            },
            Work::FromHost {
                host, dst, bytes, ..
            } => Op::Copy {
                src: self.host_region(host, *bytes),
                dst: self.region(*dst, *bytes),
            },
            Work::ToHost {
                src, host, bytes, ..
            } => Op::Copy {
                src: self.region(*src, *bytes),
                dst: self.host_region(host, *bytes),
            },
            Work::Memset { dst, bytes, .. } => Op::Memset {
                dst: self.region(*dst, *bytes),
            },
            Work::Marker => Op::Marker,
        }
    }
}

impl World {
    /// `streams[d]` streams on device `d`, one loom thread each, and tiny pools (32-byte
    /// slabs, 4-byte alignment) so that freed ranges are reused at once.
    pub fn new(streams: &[usize]) -> World {
        let pools = PoolConfig {
            pool_bytes: 32,
            min_alignment: WORD,
            limit_bytes: None,
            release_empty_pools: true,
        };
        let mut devices = Vec::new();
        let mut queues = Vec::new();
        let mut workers = Vec::new();
        let pool_log = PoolLog::shared();
        let mut all_timelines = Vec::new();
        for (d, &n) in streams.iter().enumerate() {
            let device = DeviceId(d as u32);
            let timelines: Vec<_> = (0..n as u32)
                .map(|index| Timeline::new(StreamId { device, index }))
                .collect();
            let mut qs = Vec::new();
            for _ in 0..n {
                let (tx, rx) = channel::unbounded::<Job>();
                workers.push(thread::spawn(move || {
                    while let Ok(job) = rx.recv() {
                        run_job(job);
                    }
                }));
                qs.push(tx);
            }
            let memory = PoolLog::new(device, pool_log.clone());
            all_timelines.push(timelines.clone());
            devices.push(DeviceState::new(
                device,
                timelines,
                pools.clone(),
                Box::new(memory),
            ));
            queues.push(qs);
        }
        World {
            devices,
            host: HostTable::default(),
            queues,
            timelines: all_timelines,
            workers,
            memory: Memory::new(pool_log),
        }
    }

    /// Ends the set-up of a model and opens its explored window: waits until every
    /// operation issued so far has completed (so set-up work is ordered before the window
    /// and its events are pruned as the window's plans are made), then tells loom to
    /// explore interleavings from here. Models run with `expect_explicit_explore`: the
    /// set-up runs in one interleaving only (loom still checks its accesses).
    pub fn begin_window(&mut self) {
        for d in &self.devices {
            for e in d.last_events() {
                let _ = e.wait();
            }
        }
        loom::explore();
    }

    /// Closes the explored window: what follows (the final reads and value checks) runs
    /// in one interleaving per explored prefix, still with every access checked.
    pub fn end_window(&mut self) {
        loom::stop_exploring();
    }

    /// Closes every queue, lets the streams drain and joins them.
    pub fn shutdown(mut self) {
        self.queues.clear();
        for w in self.workers.drain(..) {
            w.join().unwrap();
        }
    }

    fn dev(&mut self, device: DeviceId) -> &mut DeviceState {
        &mut self.devices[device.0 as usize]
    }

    // ----------------------------------------------------------------------------------
    // The executor side: pool operations, binding resolution, submission.
    // ----------------------------------------------------------------------------------

    /// As `Engine::submit`, each plan to its stream; the pool operations the devices asked
    /// for since the last submission are carried out first (the engine's backend carries
    /// them out when asked; here their memory words are made lazily, in the same order).
    fn submit(&mut self, plans: impl IntoIterator<Item = Plan>) -> Option<Event> {
        self.memory.apply_pool_ops();
        let mut last = None;
        for plan in plans {
            let op = self.memory.resolve(plan.work());
            let stream = plan.stream();
            let (device, index) = (stream.device.0 as usize, stream.index as usize);
            let job = Job {
                stream,
                timeline: self.timelines[device][index].clone(),
                event: plan.event().clone(),
                deps: plan.deps().to_vec(),
                label: plan.work().label(),
                op,
            };
            if self.queues[device][index].send(job).is_err() {
                panic!("stream {stream} is gone");
            }
            last = Some(plan.event().clone());
        }
        last
    }

    // ----------------------------------------------------------------------------------
    // The operations, composed from `DeviceState` calls exactly as `Engine` composes them.
    // ----------------------------------------------------------------------------------

    /// `Engine::context`.
    pub fn context(&mut self, device: u32, stream: usize) -> Context {
        self.dev(DeviceId(device)).root_context(stream).unwrap()
    }

    /// `Engine::link`.
    pub fn link(&mut self, ctx: &Context, spec: RoutineSpec) -> Routine {
        let (routine, plans) = self.dev(ctx.device()).link(ctx, spec).unwrap();
        self.submit(plans);
        routine
    }

    /// `Engine::schedule`.
    pub fn schedule(&mut self, routine: &Routine) -> Result<Event> {
        self.host.next_order();
        let device = routine.context().device();
        let i = device.0 as usize;
        let plans = self.devices[i].schedule(routine, &mut self.host)?;
        Ok(self.submit(plans).unwrap())
    }

    /// `Engine::init_from_host` (the node must already be hosted).
    pub fn init_from_host(&mut self, ctx: &Context, node: &TensorNode, data: &[i64]) -> Context {
        self.host.next_order();
        assert!(node.mode().is_hosted());
        self.host_write(node, data);
        let i = ctx.device().0 as usize;
        let (child, mut plans) = self.devices[i].add_array(ctx, node).unwrap();
        plans.push(
            self.devices[i]
                .from_host(&child, node, &mut self.host)
                .unwrap(),
        );
        self.submit(plans);
        child
    }

    /// `Engine::from_host` (named `upload` here: clippy reserves `from_*` for
    /// constructors).
    pub fn upload(&mut self, ctx: &Context, node: &TensorNode) -> Event {
        self.host.next_order();
        let i = ctx.device().0 as usize;
        let plan = self.devices[i]
            .from_host(ctx, node, &mut self.host)
            .unwrap();
        self.submit([plan]).unwrap()
    }

    /// `Engine::device_to_device` (every device can stream every other's memory, as on
    /// the CPU backend).
    pub fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Event>> {
        self.host.next_order();
        let (si, di) = (src.device().0 as usize, dst.device().0 as usize);
        let planned = tributary::protocol::device_to_device(
            &mut self.devices,
            si,
            di,
            node,
            src,
            dst,
            mode,
            true,
            &mut self.host,
        )?;
        if let Some(upload) = planned.upload {
            self.submit([upload]);
        }
        let plans = planned.destination?;
        if plans.is_empty() {
            return Ok(None);
        }
        Ok(self.submit(plans))
    }

    /// `Engine::host_read`: transfer the newest device value first if the host array is
    /// older, wait for every pending transfer into the array, then read it.
    pub fn host_read(&mut self, node: &TensorNode) -> Result<Vec<i64>> {
        self.host.next_order();
        let newer = self.host.record(node)?.newer_on_device();
        if let Some(copy) = newer {
            let i = copy.loc.device.0 as usize;
            let plan =
                self.devices[i].plan_to_host(copy.stream, node, copy.loc.loc, &mut self.host)?;
            self.submit([plan]);
        }
        for e in self.host.pending_writes(node)? {
            e.wait()?;
        }
        let array = self.host.record(node)?.array().clone();
        let bytes = node.size_in_bytes()?;
        Ok(self.memory.host_region(&array, bytes).read())
    }

    /// `Engine::host_write`: wait for every pending device use of the host array, write
    /// it, commit (every device copy now lags).
    pub fn host_write(&mut self, node: &TensorNode, data: &[i64]) {
        self.host.next_order();
        for e in self.host.begin_write(node).unwrap() {
            // Order only: a failed transfer still must not overlap our write.
            let _ = e.wait();
        }
        let array = self.host.record(node).unwrap().array().clone();
        let bytes = node.size_in_bytes().unwrap();
        self.memory.host_region(&array, bytes).write(data);
        let raw: Vec<u8> = data
            .iter()
            .flat_map(|&v| (v as f32).to_ne_bytes())
            .collect();
        self.host.commit_write(node, &raw).unwrap();
    }

    /// `Engine::read`: copy the buffer of `node` in `ctx` out (after its last write) and
    /// read the copy.
    pub fn read(&mut self, ctx: &Context, node: &TensorNode) -> Result<Vec<i64>> {
        let bytes = node.size_in_bytes()?;
        let into = StdArc::new(AlignedBuffer::new(bytes as usize, 64)?);
        let i = ctx.device().0 as usize;
        let plan = self.devices[i].read_into(ctx, node, into.clone())?;
        let event = self.submit([plan]).unwrap();
        event.wait()?;
        Ok(self.memory.host_region(&into, bytes).read())
    }

    /// `Engine::finalize`.
    pub fn finalize(&mut self, ctx: &Context) {
        self.host.next_order();
        let i = ctx.device().0 as usize;
        let plans = self.devices[i].finalize(ctx, &mut self.host).unwrap();
        self.submit(plans);
    }

    /// Whether `err` is a merge-buffer mismatch.
    pub fn is_mismatch(r: &Result<Event>) -> bool {
        matches!(r, Err(Error::MergeBufferMismatch { .. }))
    }
}
