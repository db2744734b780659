//! The CPU backend: virtual devices whose streams share a pool of worker threads.
//!
//! Each pool is one [`AlignedBuffer`] in a per-device map behind a mutex. A plan, or a
//! program's operation, resolves its bindings when it runs and holds their pools as `Arc`s
//! until it returns, so releasing a pool never frees memory under running work. Streams
//! are tasks of the worker pool in `cpu/pool.rs`, run as `cpu/stream.rs` describes; [`CpuConfig`] sets them up. All CPU devices share host memory,
//! so any device can stream any other device's buffer in place. See DESIGN.md §5, "CPU" and
//! "The CPU worker model".
//!
//! The `// SAFETY:` comments below name three facts that make the raw pointers sound:
//!
//! - *resolved*: a `Region` is bounds-checked against its allocation when the work that
//!   uses it runs and holds an `Arc` to it until that work returns, so every pointer is in
//!   bounds of live memory;
//! - *protocol-made*: a [`Plan`] comes from the protocol or from the `unsafe`
//!   [`Plan::from_parts`], so its dependencies order it after every conflicting use and its
//!   writable bindings do not alias;
//! - *own timeline*: `submit` takes only plans of its own timeline, see
//!   [`Plan::check_queue`]. The caller of the `unsafe` [`Backend::start_stream`] promises
//!   that one protocol instance issues those plans and owns their pools, and that nothing
//!   else completes the timeline. So a completed dependency is a finished operation.
//!
//! The pool's queue, locks and threads and each stream's scheduling word come from
//! [`crate::sync`], so the loom models of `loom_tests/queue.rs` check this very code.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    sync::Arc,
    time::Instant,
};

use crate::{
    backend::{Backend, StreamQueue},
    error::{DeviceError, Error, Failure, Result},
    event::Timeline,
    ids::{DeviceId, PoolId, StreamId},
    kernels::{run_cpu, ArgView, Kernel, KernelArgs},
    memory::AlignedBuffer,
    protocol::{ArgBinding, GlobalLoc, Plan, PlanLabel, StreamProgram, Work},
    sync::{Arc as SyncArc, Mutex},
    trace::{Recorder, TraceKind, TraceRecord},
};

mod config;
mod pool;
mod stream;

pub use config::{CpuConfig, MAX_SPIN_US, MAX_WORKERS};
use pool::WorkerPool;
use smallvec::SmallVec;
use stream::{Item, StreamTask};

/// The pools of one device. Looked up for every binding of every plan submitted (on the
/// submitting thread: an actor's, or the engine's owner), so hashed cheaply.
type PoolMap = crate::ids::IdMap<PoolId, Arc<AlignedBuffer>>;

struct Shared {
    devices: Vec<DeviceId>,
    pools: Vec<Mutex<PoolMap>>,
    config: CpuConfig,
    /// The worker pool shared by the streams not dedicated a thread; started with the
    /// first stream, stopped when the last one shuts down (`cpu/pool.rs`).
    workers: Mutex<Option<Arc<WorkerPool>>>,
}

impl Shared {
    fn pools_of(&self, device: DeviceId) -> Option<&Mutex<PoolMap>> {
        let i = self.devices.iter().position(|&d| d == device)?;
        self.pools.get(i)
    }

    /// Resolves a location to its pool memory and checks the byte range.
    fn resolve(&self, g: GlobalLoc, bytes: u64) -> std::result::Result<Region, String> {
        Resolver::new(self).resolve(g, bytes)
    }

    /// Resolves and runs a plan's or a program operation's work where it lies (`bindings`:
    /// a program operation's index values, if it runs a kernel): each parameter's pool is
    /// looked up, held, and viewed straight into the kernel's arguments, on the worker.
    /// No resolved copy of the work is built and moved per operation: such copies were
    /// nearly half of a replayed routine's time (BENCHMARKS.md, "A plan or a program's
    /// operation runs where it lies").
    fn run_work(
        &self,
        work: &Work,
        bindings: Option<&crate::kernels::Bindings>,
    ) -> std::result::Result<(), String> {
        match work {
            Work::Run {
                kernel,
                args,
                merge,
                bindings: own,
                ..
            } => {
                // Held until the kernel returns: releasing a pool never frees memory under
                // it ("resolved", module docs).
                let mut resolver = Resolver::new(self);
                let mut regions = SmallVec::<[Region; 4]>::new();
                for b in args.iter() {
                    regions.push(resolver.resolve(b.loc, b.bytes)?);
                }
                let merge_region = match merge {
                    Some(b) => Some((resolver.resolve(b.loc, b.bytes)?, b)),
                    None => None,
                };
                // The pools' lock is not held while the kernel runs.
                drop(resolver);
                let views = args.iter().zip(&regions).map(|(b, r)| view_of(r, b));
                let merge = merge_region.as_ref().map(|(r, b)| view_of(r, b));
                let bindings = bindings.unwrap_or(own).clone();
                // SAFETY: resolved (every view points into a live pool within bounds,
                // aligned to at least the element size; `regions` and `merge_region` hold
                // the pools until the end of this arm, after the kernel returned);
                // protocol-made (the writable bindings of the plan do not alias any other
                // binding); own timeline (every other use of a buffer this operation
                // writes, and every writer of one it reads, has finished).
                let mut kargs = unsafe { KernelArgs::with_merge(merge, bindings) };
                // SAFETY: as above, for every parameter view.
                unsafe { kargs.extend_views(views) };
                run_cpu(kernel, &kargs, self.config.kernel_mode)
            }
            Work::Copy { src, dst, bytes } => {
                // Both resolved under one acquisition, released before the copy.
                let mut resolver = Resolver::new(self);
                let (from, to) = (
                    resolver.resolve(*src, *bytes)?,
                    resolver.resolve(*dst, *bytes)?,
                );
                drop(resolver);
                copy_region(&from, &to)
            }
            Work::FromHost { host, dst, bytes } => copy_region(
                &Region::host(host.clone(), *bytes)?,
                &self.resolve(*dst, *bytes)?,
            ),
            Work::ToHost { src, host, bytes } => copy_region(
                &self.resolve(*src, *bytes)?,
                &Region::host(host.clone(), *bytes)?,
            ),
            Work::Memset { dst, bytes } => {
                zero_region(&self.resolve(*dst, *bytes)?);
                Ok(())
            }
            Work::Marker => Ok(()),
        }
    }
}

/// Resolves the locations of one operation, holding the lock of a device's pools from one
/// location to the next (an operation's buffers are normally on one device: one acquisition
/// per operation, not one per buffer). Dropped before the operation runs.
struct Resolver<'a> {
    shared: &'a Shared,
    held: Option<(DeviceId, crate::sync::MutexGuard<'a, PoolMap>)>,
}

impl<'a> Resolver<'a> {
    fn new(shared: &'a Shared) -> Resolver<'a> {
        Resolver { shared, held: None }
    }

    /// [`Shared::resolve`] of `g`, under the lock held since the last location if it was
    /// on the same device.
    fn resolve(&mut self, g: GlobalLoc, bytes: u64) -> std::result::Result<Region, String> {
        let map = match &mut self.held {
            Some((device, map)) if *device == g.device => map,
            held => {
                // The last device's lock is released before the next one is taken.
                *held = None;
                let pools = self
                    .shared
                    .pools_of(g.device)
                    .ok_or_else(|| format!("unknown device {}", g.device))?;
                &mut held.insert((g.device, pools.lock())).1
            }
        };
        let buf = map
            .get(&g.loc.pool)
            .ok_or_else(|| format!("pool {} does not exist on {}", g.loc.pool, g.device))?
            .clone();
        let end = g.loc.offset.checked_add(bytes);
        if end.is_none_or(|e| e > buf.len() as u64) {
            return Err(format!(
                "range {}+{} outside pool of {} bytes",
                g.loc,
                bytes,
                buf.len()
            ));
        }
        Ok(Region {
            buf,
            offset: g.loc.offset as usize,
            bytes: bytes as usize,
        })
    }
}

/// A byte range of a pool (or host array), resolved when the work that uses it runs.
struct Region {
    buf: Arc<AlignedBuffer>,
    offset: usize,
    bytes: usize,
}

impl Region {
    /// A whole host array, which must be exactly `bytes` long: a transfer of another size
    /// would be truncated or overrun, so it is a bug to report.
    fn host(buf: Arc<AlignedBuffer>, bytes: u64) -> std::result::Result<Region, String> {
        super::check_host_array(buf.len(), bytes)?;
        Ok(Region {
            buf,
            offset: 0,
            bytes: bytes as usize,
        })
    }

    fn ptr(&self) -> *mut u8 {
        // SAFETY (resolved): `resolve`/`host` checked offset + bytes <= len, so the offset
        // stays inside (or one past the end of) the allocation, which `buf` keeps alive.
        unsafe { self.buf.as_ptr().add(self.offset) }
    }
}

/// A submitted plan as its stream keeps it until it runs: its work is resolved then, as a
/// program's operation is ([`Shared::run_work`]).
struct Submitted {
    seq: u64,
    deps: crate::protocol::Deps,
    work: Work,
}

/// The CPU backend: `n` virtual devices sharing the host's memory.
#[derive(Clone)]
pub struct CpuBackend {
    shared: Arc<Shared>,
    recorder: Option<Arc<Recorder>>,
}

impl CpuBackend {
    /// A backend with `devices` virtual devices numbered from `first`, its streams on a
    /// pool of one worker per available core that spin 50 µs before parking
    /// ([`CpuConfig::default`]).
    pub fn new(first: DeviceId, devices: usize) -> CpuBackend {
        CpuBackend::build(first, devices, CpuConfig::default())
    }

    /// A backend with `devices` virtual devices numbered from `first`, its streams run as
    /// `config` says. A configuration it cannot use is [`Error::InvalidConfig`] naming the
    /// setting ([`CpuConfig::validate`]).
    ///
    /// ```
    /// use tributary::{backend::cpu::{CpuBackend, CpuConfig}, DeviceId, Error};
    /// let two_workers = CpuBackend::with_config(DeviceId(0), 1, CpuConfig::default().with_workers(2))?;
    /// assert_eq!(two_workers.config().worker_count(), 2);
    /// let err = CpuBackend::with_config(DeviceId(0), 1, CpuConfig::default().with_workers(100_000));
    /// assert!(matches!(err, Err(Error::InvalidConfig { .. })));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn with_config(first: DeviceId, devices: usize, config: CpuConfig) -> Result<CpuBackend> {
        let backend = CpuBackend::build(first, devices, config);
        backend.shared.config.validate(&backend.shared.devices)?;
        Ok(backend)
    }

    fn build(first: DeviceId, devices: usize, config: CpuConfig) -> CpuBackend {
        CpuBackend {
            shared: Arc::new(Shared {
                devices: (0..devices as u32).map(|i| DeviceId(first.0 + i)).collect(),
                pools: (0..devices)
                    .map(|_| Mutex::new(PoolMap::default()))
                    .collect(),
                config,
                workers: Mutex::new(None),
            }),
            recorder: None,
        }
    }

    /// How the backend runs its streams.
    pub fn config(&self) -> &CpuConfig {
        &self.shared.config
    }

    /// The pool a new stream runs on, with the stream attached: a pool of its own for a
    /// dedicated stream, otherwise the shared one (started if none is running).
    fn pool_for(&self, stream: StreamId) -> Result<Arc<WorkerPool>, DeviceError> {
        let config = &self.shared.config;
        if config.is_dedicated(stream) {
            return WorkerPool::start(&format!("tributary-{stream}"), 1, config.spin());
        }
        let mut current = self.shared.workers.lock();
        if let Some(pool) = current.as_ref() {
            if pool.attach() {
                return Ok(pool.clone());
            }
        }
        let pool = WorkerPool::start("tributary-cpu", config.worker_count(), config.spin())?;
        *current = Some(pool.clone());
        Ok(pool)
    }

    /// Records every operation and wait of the streams started from now on.
    pub fn with_recorder(mut self, recorder: Arc<Recorder>) -> CpuBackend {
        self.recorder = Some(recorder);
        self
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn devices(&self) -> Vec<DeviceId> {
        self.shared.devices.clone()
    }

    fn create_pool(
        &self,
        device: DeviceId,
        pool: PoolId,
        bytes: u64,
        align: u64,
    ) -> Result<(), DeviceError> {
        let pools = self
            .shared
            .pools_of(device)
            .ok_or_else(|| DeviceError::Unexpected(format!("unknown device {device}")))?;
        let len =
            usize::try_from(bytes).map_err(|_| DeviceError::OutOfMemory { requested: bytes })?;
        if pools.lock().contains_key(&pool) {
            return Err(crate::backend::pool_exists(device, pool));
        }
        let buf = Arc::new(AlignedBuffer::new(len, align.max(1) as usize)?);
        use std::collections::hash_map::Entry;
        match pools.lock().entry(pool) {
            Entry::Occupied(_) => Err(crate::backend::pool_exists(device, pool)),
            Entry::Vacant(v) => {
                v.insert(buf);
                Ok(())
            }
        }
    }

    fn release_pool(&self, device: DeviceId, pool: PoolId) {
        if let Some(pools) = self.shared.pools_of(device) {
            pools.lock().remove(&pool);
        }
    }

    unsafe fn start_stream(
        &self,
        stream: StreamId,
        timeline: SyncArc<Timeline>,
    ) -> Result<Box<dyn StreamQueue>, DeviceError> {
        let pool = self.pool_for(stream)?;
        let task = StreamTask::new(
            stream,
            timeline.clone(),
            pool.clone(),
            self.shared.clone(),
            self.recorder.clone(),
        );
        Ok(Box::new(CpuStream {
            stream,
            timeline,
            task,
            pool: Mutex::new(Some(pool)),
        }))
    }

    fn can_stream(&self, src: DeviceId, dst: DeviceId) -> bool {
        self.shared.devices.contains(&src) && self.shared.devices.contains(&dst)
    }

    fn device_info(&self, device: DeviceId) -> Result<super::DeviceInfo, DeviceError> {
        let index = self
            .shared
            .devices
            .iter()
            .position(|d| *d == device)
            .ok_or_else(|| DeviceError::Unexpected(format!("unknown device {device}")))?;
        Ok(
            super::DeviceInfo::new(device, "cpu", format!("CPU virtual device {index}"))
                .with_memory_bytes(host_memory_bytes())
                .with_dtypes(crate::node::DType::ALL),
        )
    }

    fn check_routine(&self, device: DeviceId, spec: &crate::kernels::RoutineSpec) -> Result<()> {
        let routine = spec.name.as_str();
        match &spec.kernel {
            Kernel::Shader(_) => Err(super::unsupported_kernel(
                routine,
                device,
                "cpu",
                crate::kernels::SHADER_ON_CPU,
            )),
            Kernel::Cuda(_) => Err(super::unsupported_kernel(
                routine,
                device,
                "cpu",
                crate::kernels::CUDA_ON_CPU,
            )),
            Kernel::Builtin(_) | Kernel::Cpu(_) => Ok(()),
        }
    }
}

/// One CPU stream: a task of the worker pool (`cpu/stream.rs`) and its attachment to
/// the pool.
///
/// `submit` never waits for the work.
pub struct CpuStream {
    stream: StreamId,
    timeline: SyncArc<Timeline>,
    task: Arc<StreamTask>,
    /// The pool the stream is attached to, until it shuts down.
    pool: Mutex<Option<Arc<WorkerPool>>>,
}

impl StreamQueue for CpuStream {
    fn submit(&self, plan: Plan) -> Result<()> {
        plan.check_queue(self.stream, &self.timeline)?;
        let seq = plan.event.seq();
        // Built in the call, which is inlined: the plan's parts are copied once, into the
        // stream's queue (each named step was a copy of about 450 bytes).
        let item = Item::Plan(Submitted {
            seq,
            deps: plan.deps,
            work: plan.work,
        });
        let Some(Item::Plan(item)) = self.task.push(item) else {
            return Ok(());
        };
        let failure = Arc::new(Failure {
            stream: self.stream,
            seq,
            operation: item.work.plan_label().to_string(),
            message: "stream is shut down".into(),
        });
        // Nobody will ever run it: fail its event so that no waiter hangs, once its
        // dependencies and the stream's earlier operations are decided
        // (`protocol/unsubmitted.rs`): failing it at once while earlier operations were
        // still queued would advance the timeline past them, so they would look complete
        // before they ran (found by `loom_tests/queue.rs`, `submit_vs_shutdown`).
        if !mutant!("dead_submit") {
            crate::protocol::fail_when_ready(
                self.timeline.clone(),
                seq,
                item.deps.into_iter().map(|dep| dep.event().clone()),
                failure,
            );
        }
        Err(Error::ShutDown(format!("stream {}", self.stream)))
    }

    fn runs_programs(&self) -> bool {
        true
    }

    fn submit_program(&self, program: StreamProgram) -> Result<()> {
        program.check_queue(self.stream, &self.timeline)?;
        if program.is_empty() {
            return Ok(());
        }
        let Some(Item::StreamProgram(program)) = self.task.push(Item::StreamProgram(program))
        else {
            return Ok(());
        };
        // Nobody will run it: its events fail once their dependencies and the stream's
        // earlier operations are decided, as an unsubmitted plan's (see `submit`).
        if !mutant!("dead_submit") {
            program.fail_unsubmitted("stream is shut down");
        }
        Err(Error::ShutDown(format!("stream {}", self.stream)))
    }

    fn shutdown_within(&self, timeout: std::time::Duration) -> bool {
        self.shutdown_until(Instant::now().checked_add(timeout))
    }

    fn shutdown(&self) {
        self.shutdown_until(None);
    }
}

impl CpuStream {
    /// Stops accepting work, waits (until `deadline`, if any) for what was accepted to
    /// complete, then leaves the pool (the last stream stops it and joins its workers).
    /// `false` if work was still running at the deadline.
    fn shutdown_until(&self, deadline: Option<Instant>) -> bool {
        // After `close` nothing more is accepted, so `last` is final.
        let last = self.task.close();
        let drained = last == 0
            || match deadline {
                // Returns when `last` is decided: completed, failed, or the stream died.
                None => {
                    let _ = self.timeline.wait(last);
                    true
                }
                Some(deadline) => {
                    self.timeline.wait_deadline(last, deadline).is_ok()
                        || self.timeline.is_done(last)
                }
            };
        let left = match self.pool.lock().take() {
            Some(pool) => pool.detach(deadline),
            None => true,
        };
        // Otherwise work still runs (or waits): it keeps its memory alive, and finishes or
        // not on its own.
        drained && left
    }
}

impl Drop for CpuStream {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One operation whose dependencies are all decided, as [`complete`] runs it: a submitted
/// plan, or an operation of a program.
struct Ready<'a> {
    label: &'a PlanLabel,
    seq: u64,
    deps: &'a [crate::protocol::Dep],
}

/// Runs one operation whose dependencies are all decided: fails it with `failed` (the root
/// cause of a failed data dependency) without running it, or runs its work (`run`:
/// [`Shared::run_work`], or the reason it cannot) under `catch_unwind` and completes its
/// event (rule 6). `bytes` sizes it for the trace, asked only when one is recorded.
///
/// Never inlined: its two callers in `cpu/stream.rs` would each carry its locals in the
/// frame that also waits for dependencies.
#[inline(never)]
fn complete(
    stream: StreamId,
    timeline: &Timeline,
    op: Ready<'_>,
    bytes: impl FnOnce() -> u64,
    run: impl FnOnce() -> std::result::Result<(), String>,
    failed: Option<Arc<Failure>>,
    recorder: Option<&Recorder>,
) {
    let span = tracing::debug_span!("run", stream = %stream, seq = op.seq, op = %op.label);
    let _enter = span.enter();
    if let Some(root) = failed {
        tracing::debug!(stream = %stream, seq = op.seq, cause = %root, "dependency failed");
        timeline.fail(op.seq, root);
        return;
    }
    let fail = |message: String| {
        Arc::new(Failure {
            stream,
            seq: op.seq,
            operation: op.label.to_string(),
            message,
        })
    };
    // Timed and sized only for the trace.
    let start = recorder.map(|_| (Instant::now(), bytes()));
    let after = recorder.map(|_| crate::trace::cross_stream(stream, op.deps));
    let outcome = catch_unwind(AssertUnwindSafe(run));
    if let (Some(rec), Some((start, bytes))) = (recorder, start) {
        // Recorded before the event completes, so waiters always end after it.
        rec.record(TraceRecord {
            kind: TraceKind::Work,
            name: op.label.to_string(),
            stream,
            seq: op.seq,
            start_ns: rec.ns(start),
            end_ns: rec.ns(Instant::now()),
            bytes,
            waited_for: None,
            after: after.unwrap_or_default(),
            ok: matches!(outcome, Ok(Ok(()))),
        });
    }
    match outcome {
        Ok(Ok(())) => timeline.signal(op.seq),
        Ok(Err(message)) => timeline.fail(op.seq, fail(message)),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            timeline.fail(op.seq, fail(format!("kernel panicked: {message}")));
        }
    }
}

/// A kernel's view of `region`, bound as `binding`.
fn view_of(region: &Region, binding: &ArgBinding) -> ArgView {
    ArgView {
        ptr: region.ptr(),
        bytes: region.bytes,
        dtype: binding.dtype,
        shape: binding.shape.clone(),
        access: binding.access,
    }
}

/// Copies `src` into `dst`, which must be as long.
fn copy_region(src: &Region, dst: &Region) -> std::result::Result<(), String> {
    if src.bytes != dst.bytes {
        return Err(size_mismatch(src.bytes as u64, dst.bytes as u64));
    }
    // SAFETY: resolved: both ranges, of `src.bytes` bytes each, are in bounds of live
    // allocations; `ptr::copy` tolerates overlap. Protocol-made and own timeline: the
    // awaited dependencies were the writers of `src` and every use of `dst`, all finished,
    // and later ones wait for this work.
    unsafe { std::ptr::copy(src.ptr(), dst.ptr(), src.bytes) };
    Ok(())
}

/// Zeroes `dst`.
fn zero_region(dst: &Region) {
    // SAFETY: resolved (in-bounds range of a live allocation); protocol-made and own
    // timeline: every other use of `dst` finished before and waits after.
    unsafe { std::ptr::write_bytes(dst.ptr(), 0, dst.bytes) };
}

/// The error of a copy whose source and destination differ in size.
fn size_mismatch(src: u64, dst: u64) -> String {
    format!("size mismatch: copy from {src} bytes into {dst} bytes (not truncated)")
}

/// The host's physical memory (Linux: `MemTotal` of `/proc/meminfo`), `None` elsewhere.
fn host_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
