//! CUDA streams: a submit thread enqueues work on a non-blocking CUDA stream and records one
//! pooled event per sequence number. A watcher thread completes the timeline as those events
//! complete. The scheme is in DESIGN.md §5, "CUDA".
//!
//! Host transfers through the staging ring follow three rules. A full ring makes the submit
//! thread wait for its oldest slot. An upload fills its slot only after all its
//! dependencies completed, because an earlier download may still write the host array. A
//! download completes only after the watcher copied its slot into the host array.
//!
//! The `unsafe` code here rests on the promises of [`Plan`] and
//! [`crate::backend::Backend::start_stream`]: each plan's dependencies order it after every
//! conflicting use, its writable bindings do not alias, and nothing else completes this
//! stream's timeline. See DESIGN.md §5, "Soundness: the types carry the protocol's promise".

mod programs;

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use crossbeam_channel::{Receiver, Sender};
use cudarc::{
    driver::{result, sys, CudaFunction, CudaModule, CudaStream},
    nvrtc::Ptx,
};

use super::{
    device::{Gpu, LoadedProgram, Shared},
    events::SharedEvent,
    instance::{driver_error, lock},
    kernels::{nvrtc, Program},
    launch::{lower, DeviceLaunch, ParamCell},
    memory::{CopyRoute, DevicePool, PinnedMemory, Region, StagingRing},
};
use crate::{
    backend::{
        gpu_stream::{self, BackendNames, Decided, Decisions, SubmitChannel},
        recording::{CompletionTrace, OpTrace, StreamTrace},
    },
    error::{DeviceError, Error, Failure},
    event::{EventStatus, Timeline},
    ids::StreamId,
    memory::AlignedBuffer,
    protocol::{Dep, StreamProgram, Work},
    sync::Arc as SyncArc,
    trace::Recorder,
};

// ---------------------------------------------------------------------------------------
// What streams of one device see of each other.

/// What every stream of a device can see of one stream: its decisions.
pub(super) struct StreamShared {
    pub(super) id: StreamId,
    pub(super) timeline: SyncArc<Timeline>,
    decided: Decisions<Decision>,
}

/// What a stream decided for one of its sequence numbers.
#[derive(Clone)]
enum Decision {
    /// Its event is recorded (after its work, or after the waits of a failed plan), and
    /// `failure` is set when it fails.
    Recorded {
        event: SharedEvent,
        failure: Option<Arc<Failure>>,
    },
    /// It failed and no event was recorded (the device is lost).
    Failed(Arc<Failure>),
    /// It completed already: its timeline says how.
    Completed,
    /// The stream stopped before deciding: only its timeline can say.
    Gone,
}

impl StreamShared {
    pub(super) fn new(id: StreamId, timeline: SyncArc<Timeline>) -> StreamShared {
        StreamShared {
            id,
            timeline,
            decided: Decisions::new(),
        }
    }

    /// Publishes the decision for `seq` (and everything before it).
    fn decide(&self, seq: u64, decision: Decision) {
        self.decided.decide(seq, Some(decision));
    }

    /// Forgets the decisions up to `seq`: their timeline is complete.
    fn completed(&self, seq: u64) {
        self.decided.forget_upto(seq);
    }

    fn close(&self) {
        self.decided.close();
    }

    /// Waits until `seq` is decided.
    fn decision(&self, seq: u64) -> Decision {
        Decision::from(self.decided.wait(seq))
    }

    /// The decision for `seq` if it is made, without waiting.
    fn decided_now(&self, seq: u64) -> Option<Decision> {
        self.decided.peek(seq).map(Decision::from)
    }
}

impl From<Decided<Decision>> for Decision {
    fn from(d: Decided<Decision>) -> Decision {
        match d {
            Decided::Yes(d) => d.unwrap_or(Decision::Completed),
            Decided::Gone => Decision::Gone,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The stream.

/// A plan resolved to regions at submission (a copy with its route).
type Job = gpu_stream::Job<Region, CopyRoute>;

type Submitted = gpu_stream::Submitted<Job>;

/// This backend's name in failures, and its stream threads' prefix.
const CUDA_NAMES: BackendNames = BackendNames {
    backend: "CUDA",
    threads: "cuda",
};

impl Job {
    /// Whether the submit thread touches host memory the dependencies may write, so that
    /// every dependency must have completed on the host first.
    fn needs_host_waits(&self) -> bool {
        matches!(
            self,
            Job::FromHost { .. }
                | Job::Copy {
                    route: CopyRoute::Staged,
                    ..
                }
        )
    }
}

/// Things work uses, kept alive until its completion is observed.
enum Keep {
    Pool(#[allow(dead_code)] Arc<DevicePool>),
    Event(#[allow(dead_code)] SharedEvent),
    Module(#[allow(dead_code)] Arc<CudaModule>),
    Host(#[allow(dead_code)] Arc<AlignedBuffer>),
}

/// A device-to-host slot to copy into the host array once its copy completed.
struct CopyOut {
    memory: Arc<PinnedMemory>,
    slot_offset: usize,
    host: Arc<AlignedBuffer>,
    host_offset: usize,
    len: usize,
}

/// The completion of a sequence number.
struct Completion {
    seq: u64,
    outcome: std::result::Result<(), Arc<Failure>>,
    label: String,
    /// What the timeline records of it (`None` when nothing is recorded).
    trace: Option<OpTrace>,
}

/// One item for the watcher, handled in order: wait for `event`, copy out, release the
/// staging slots, complete.
#[derive(Default)]
struct Watch {
    event: Option<SharedEvent>,
    copy_out: Option<CopyOut>,
    release_slots_upto: Option<u64>,
    complete: Option<Completion>,
    keep: Vec<Keep>,
}

/// One CUDA stream: the sending side of its submit thread, and both threads.
pub(super) struct CudaStreamQueue {
    backend: Arc<Shared>,
    channel: SubmitChannel<Job, StreamProgram>,
}

impl CudaStreamQueue {
    pub(super) fn start(
        backend: Arc<Shared>,
        gpu: Arc<Gpu>,
        shared: Arc<StreamShared>,
        recorder: Option<Arc<Recorder>>,
    ) -> std::result::Result<CudaStreamQueue, DeviceError> {
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| DeviceError::Unexpected(format!("cuStreamCreate: {}", driver_error(e))))?;
        let capacity = usize::try_from(backend.config.staging_bytes.max(1)).unwrap_or(usize::MAX);
        let ring = Arc::new(StagingRing::new(gpu.ctx.clone(), capacity));
        let (watch_tx, watch_rx) = crossbeam_channel::unbounded::<Watch>();
        let trace = StreamTrace::new(recorder, shared.id);
        let submitter = Submitter {
            backend: backend.clone(),
            gpu: gpu.clone(),
            me: shared.clone(),
            stream,
            ring: ring.clone(),
            watcher: watch_tx,
            last: 0,
            trace: trace.clone(),
            graphs: programs::Graphs::default(),
        };
        let watcher = Watcher {
            me: shared.clone(),
            gpu,
            ring,
            trace: trace.completions(),
            copy_failure: None,
        };
        let window = Duration::from_micros(backend.config.spin_us);
        let stop_deadline = backend.stop_deadline.clone();
        // If the submit thread cannot start, the submitter (and its sender to the watcher)
        // is dropped with its closure: the watcher ends by itself.
        let channel = SubmitChannel::start(
            shared.timeline.clone(),
            CUDA_NAMES,
            move |rx| submitter.run(rx),
            move || watcher.run(watch_rx, window),
        )?
        .recording_stops_in(stop_deadline);
        Ok(CudaStreamQueue { backend, channel })
    }

    fn resolve(&self, work: &Work) -> std::result::Result<Job, String> {
        let b = &self.backend;
        Job::lower(
            work,
            |loc, bytes| b.resolve(loc, bytes),
            |src, dst| {
                b.route(src, dst).ok_or_else(|| {
                    format!("a copy between {src} and {dst}, not both CUDA devices of this backend")
                })
            },
        )
    }
}

gpu_stream::stream_queue_over_channel!(CudaStreamQueue, programs);

/// The submit thread's state.
struct Submitter {
    backend: Arc<Shared>,
    gpu: Arc<Gpu>,
    me: Arc<StreamShared>,
    stream: Arc<CudaStream>,
    ring: Arc<StagingRing>,
    watcher: Sender<Watch>,
    /// The last sequence number handled.
    last: u64,
    trace: StreamTrace,
    /// Graphs captured for replays, kept for the next ones.
    graphs: programs::Graphs,
}

/// How the dependencies of one plan are to be waited for (events of other streams of
/// this device to wait for on the GPU).
type Waits = gpu_stream::Waits<SharedEvent>;

impl Submitter {
    fn run(mut self, rx: Receiver<gpu_stream::Sent<Job, StreamProgram>>) {
        let _close = CloseOnExit(self.me.clone());
        let window = Duration::from_micros(self.backend.config.spin_us);
        while let Ok(sent) = gpu_stream::recv_spinning(&rx, window) {
            match sent {
                gpu_stream::Sent::Plan(item) => {
                    let span = tracing::debug_span!("cuda", stream = %self.me.id, seq = item.seq, op = %item.label);
                    let _e = span.enter();
                    self.process(item);
                }
                gpu_stream::Sent::Program(program) => {
                    let span = tracing::debug_span!("cuda", stream = %self.me.id, seq = program.first_seq(), ops = program.len());
                    let _e = span.enter();
                    self.run_program(program);
                }
            }
        }
    }

    fn failure(&self, item: &Submitted, message: String) -> Arc<Failure> {
        item.failure(self.me.id, message)
    }

    /// Waits on the host for `dep`, recording the wait; the failure it ended with, if any.
    fn host_wait(&self, item: &Submitted, dep: &Dep) -> Option<Arc<Failure>> {
        match self.trace.host_wait(dep, &item.label, item.seq) {
            Err(Error::Failed(f)) => Some(f),
            _ => None,
        }
    }

    /// Sorts the dependencies: those on other streams of this device become event waits
    /// (after their stream decided them) unless `on_host`; the others are waited for here.
    fn classify(&self, item: &Submitted, on_host: bool) -> Waits {
        Waits::classify(&item.deps, |dep| {
            let local = if on_host {
                None
            } else {
                self.gpu.stream_of(dep.event.timeline())
            };
            // A failure the decision or the timeline tells of.
            let failed = |d: Decision| match d {
                Decision::Recorded { failure, .. } => failure,
                Decision::Failed(f) => Some(f),
                Decision::Completed | Decision::Gone => match dep.event.status() {
                    EventStatus::Failed(f) => Some(f),
                    _ => None,
                },
            };
            match &local {
                // This stream's own earlier work is before this plan already: nothing to
                // wait for, but a failure of it is this plan's too (its event is recorded
                // and pending, so only the decision says so).
                Some(s) if Arc::ptr_eq(s, &self.me) => (None, failed(s.decision(dep.event.seq()))),
                Some(s) => match s.decision(dep.event.seq()) {
                    Decision::Recorded { event, failure } => (Some(event), failure),
                    Decision::Gone => (None, self.host_wait(item, dep)),
                    d => (None, failed(d)),
                },
                None => (None, self.host_wait(item, dep)),
            }
        })
    }

    fn send(&self, watch: Watch) {
        // The watcher lives until this sender is dropped, unless it panicked (then the
        // timeline is poisoned already).
        let _ = self.watcher.send(watch);
    }

    fn process(&mut self, item: Submitted) {
        let arrived = Instant::now();
        let complete = |item: &Submitted, outcome, trace| Completion {
            seq: item.seq,
            outcome,
            label: item.label.clone(),
            trace,
        };
        if item.seq <= self.last {
            let f = self.failure(
                &item,
                format!("sequence number {} after {}", item.seq, self.last),
            );
            tracing::warn!(%f, "out-of-order plan");
            self.send(Watch {
                complete: Some(complete(&item, Err(f), None)),
                ..Watch::default()
            });
            return;
        }
        self.last = item.seq;
        let on_host = item.job.as_ref().is_ok_and(Job::needs_host_waits);
        let waits = self.classify(&item, on_host);
        let mut op = self
            .trace
            .start(item.seq, &item.label, &item.deps, item.bytes, arrived);
        let mut keep: Vec<Keep> = Vec::new();
        let mut outcome: std::result::Result<(), Arc<Failure>> = Ok(());
        if let Some(cause) = self.gpu.lost() {
            outcome = Err(self.failure(&item, format!("device lost: {cause}")));
        }
        for event in waits.gpu {
            if outcome.is_ok() {
                if let Err(e) = self.stream.wait(&event) {
                    let cause = self
                        .gpu
                        .mark_lost(&format!("cuStreamWaitEvent: {}", driver_error(e)));
                    outcome = Err(self.failure(&item, cause));
                }
            }
            keep.push(Keep::Event(event));
        }
        if outcome.is_ok() {
            outcome = match (&waits.failed, &item.job) {
                (Some(root), _) => Err(root.clone()),
                (None, Err(msg)) => Err(self.failure(&item, msg.clone())),
                (None, Ok(job)) => self
                    .execute(job, &mut keep)
                    .map_err(|m| self.failure(&item, m)),
            };
        }
        let recorded = self
            .gpu
            .events
            .acquire()
            .and_then(|ev| ev.record(&self.stream).map(|()| ev).map_err(driver_error));
        match recorded {
            Ok(event) => {
                let event = Arc::new(event);
                self.me.decide(
                    item.seq,
                    Decision::Recorded {
                        event: event.clone(),
                        failure: outcome.as_ref().err().cloned(),
                    },
                );
                self.send(Watch {
                    event: Some(event),
                    complete: Some(complete(&item, outcome, op.take())),
                    keep,
                    ..Watch::default()
                });
            }
            Err(e) => {
                let cause = self.gpu.mark_lost(&format!("cuEventRecord: {e}"));
                let f = match outcome {
                    Err(f) => f,
                    Ok(()) => self.failure(&item, format!("device lost: {cause}")),
                };
                self.me.decide(item.seq, Decision::Failed(f.clone()));
                self.send(Watch {
                    complete: Some(complete(&item, Err(f), op.take())),
                    keep,
                    ..Watch::default()
                });
            }
        }
    }

    /// Whether `r` is memory of this stream's device.
    fn local(&self, r: &Region) -> bool {
        r.pool.context().cu_ctx() == self.gpu.ctx.cu_ctx()
    }

    /// Makes this stream's context current on this thread.
    fn bind(&self) -> std::result::Result<(), String> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| format!("cuCtxSetCurrent: {}", driver_error(e)))
    }

    /// Enqueues the job's work on the stream (after the event waits already enqueued).
    fn execute(&mut self, job: &Job, keep: &mut Vec<Keep>) -> std::result::Result<(), String> {
        self.bind()?;
        let cu_stream = self.stream.cu_stream();
        match job {
            Job::Marker => Ok(()),
            Job::Memset { dst, bytes } => {
                if !self.local(dst) {
                    return Err("memset of a buffer of another device".into());
                }
                keep.push(Keep::Pool(dst.pool.clone()));
                if *bytes == 0 {
                    return Ok(());
                }
                // SAFETY: `dst` is a checked range of a live pool of this context, kept
                // alive until the work completes; the stream belongs to this context.
                unsafe { result::memset_d8_async(dst.ptr(), 0, *bytes as usize, cu_stream) }
                    .map_err(|e| format!("cuMemsetD8Async: {}", driver_error(e)))
            }
            Job::Copy {
                src,
                dst,
                route,
                bytes,
            } => {
                keep.push(Keep::Pool(src.pool.clone()));
                keep.push(Keep::Pool(dst.pool.clone()));
                let n = (*bytes).min(src.bytes).min(dst.bytes) as usize;
                if n == 0 {
                    return Ok(());
                }
                match route {
                    // SAFETY: both ranges are checked and their pools kept alive until the
                    // work completes; one context addresses both; distinct nodes never
                    // overlap.
                    CopyRoute::Direct => {
                        unsafe { result::memcpy_dtod_async(dst.ptr(), src.ptr(), n, cu_stream) }
                            .map_err(|e| format!("cuMemcpyDtoDAsync: {}", driver_error(e)))
                    }
                    // SAFETY: as above, each pointer in its own (live) context.
                    CopyRoute::Peer => unsafe {
                        result::memcpy_peer_async(
                            dst.pool.context().cu_ctx(),
                            dst.ptr(),
                            src.pool.context().cu_ctx(),
                            src.ptr(),
                            n,
                            cu_stream,
                        )
                    }
                    .map_err(|e| format!("cuMemcpyPeerAsync: {}", driver_error(e))),
                    CopyRoute::Staged => self.staged_copy(src, dst, *bytes),
                }
            }
            Job::FromHost { host, dst, bytes } => {
                if !self.local(dst) {
                    return Err("a host transfer into another device's buffer".into());
                }
                keep.push(Keep::Pool(dst.pool.clone()));
                self.upload(host, dst, *bytes)
            }
            Job::ToHost { src, host, bytes } => {
                if !self.local(src) {
                    return Err("a host transfer out of another device's buffer".into());
                }
                keep.push(Keep::Pool(src.pool.clone()));
                keep.push(Keep::Host(host.clone()));
                self.download(src, host, *bytes)
            }
            Job::Run {
                kernel,
                args,
                merge,
                bindings,
            } => {
                gpu_stream::check_local(args, |r| self.local(r))?;
                if let Some(m) = merge {
                    let addressable = self.local(&m.region)
                        || self
                            .backend
                            .route_facts(m.binding.loc.device, self.gpu.id)
                            .is_some_and(super::memory::can_address);
                    if !addressable {
                        return Err(format!(
                            "the merge source lives on {}, which {} cannot address (no peer \
                             access)",
                            m.binding.loc.device, self.gpu.id
                        ));
                    }
                }
                for a in args.iter().chain(merge.iter()) {
                    keep.push(Keep::Pool(a.region.pool.clone()));
                }
                for launch in lower(kernel, args, merge.as_ref(), bindings, &self.gpu)? {
                    self.launch(&launch, keep)?;
                }
                Ok(())
            }
        }
    }

    /// Records a pooled event after the work enqueued so far, for the watcher.
    fn chunk_event(&self) -> std::result::Result<SharedEvent, String> {
        let ev = self.gpu.events.acquire()?;
        ev.record(&self.stream)
            .map_err(|e| format!("cuEventRecord: {}", driver_error(e)))?;
        Ok(Arc::new(ev))
    }

    /// Host array → staging slots → device, slot by slot.
    fn upload(
        &self,
        host: &AlignedBuffer,
        dst: &Region,
        bytes: u64,
    ) -> std::result::Result<(), String> {
        let total = bytes as usize;
        let chunk = self.ring.chunk();
        let mut at = 0usize;
        while at < total {
            let len = chunk.min(total - at);
            let (slot, memory) = self.ring.take(len)?;
            let staging = memory
                .at(slot.offset, len)
                .ok_or("a staging slot outside the ring")?;
            // SAFETY: every dependency completed on the host (uploads wait for them there),
            // so nobody writes the host array now; `at + len <= bytes <= host.len()`.
            let data = unsafe { host.bytes(at, len) }.map_err(|e| e.to_string())?;
            // SAFETY: the slot is this transfer's alone until the watcher releases it, which
            // it does only after the copy below completed; `len` bytes fit (checked by `at`).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), staging, len) };
            self.bind()?;
            // SAFETY: `staging` is pinned memory that stays untouched until the chunk's event
            // completed (see above); the destination range is checked and its pool kept alive.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst.ptr_at(at as u64),
                    staging.cast_const().cast(),
                    len,
                    self.stream.cu_stream(),
                )
            }
            .result()
            .map_err(|e| format!("cuMemcpyHtoDAsync: {}", driver_error(e)))?;
            let event = self.chunk_event()?;
            self.send(Watch {
                event: Some(event),
                release_slots_upto: Some(slot.ticket),
                keep: vec![],
                ..Watch::default()
            });
            at += len;
        }
        Ok(())
    }

    /// Device → staging slots → host array (the watcher copies each slot out once its copy
    /// completed, before the plan completes).
    fn download(
        &self,
        src: &Region,
        host: &Arc<AlignedBuffer>,
        bytes: u64,
    ) -> std::result::Result<(), String> {
        let total = bytes as usize;
        let chunk = self.ring.chunk();
        let mut at = 0usize;
        while at < total {
            let len = chunk.min(total - at);
            let (slot, memory) = self.ring.take(len)?;
            let staging = memory
                .at(slot.offset, len)
                .ok_or("a staging slot outside the ring")?;
            self.bind()?;
            // SAFETY: the slot is this transfer's alone until the watcher released it, after
            // the chunk's event completed and it copied the slot out; the source range is
            // checked and its pool kept alive.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    staging.cast(),
                    src.ptr_at(at as u64),
                    len,
                    self.stream.cu_stream(),
                )
            }
            .result()
            .map_err(|e| format!("cuMemcpyDtoHAsync: {}", driver_error(e)))?;
            let event = self.chunk_event()?;
            self.send(Watch {
                event: Some(event),
                copy_out: Some(CopyOut {
                    memory,
                    slot_offset: slot.offset,
                    host: host.clone(),
                    host_offset: at,
                    len,
                }),
                release_slots_upto: Some(slot.ticket),
                ..Watch::default()
            });
            at += len;
        }
        Ok(())
    }

    /// A copy between contexts without peer access: download from the source and upload
    /// to the destination through staging slots, synchronously, after this stream's
    /// earlier work (every dependency completed on the host already).
    fn staged_copy(
        &self,
        src: &Region,
        dst: &Region,
        bytes: u64,
    ) -> std::result::Result<(), String> {
        self.stream
            .synchronize()
            .map_err(|e| format!("cuStreamSynchronize: {}", driver_error(e)))?;
        let total = bytes as usize;
        let chunk = self.ring.chunk();
        let mut at = 0usize;
        while at < total {
            let len = chunk.min(total - at);
            let (slot, memory) = self.ring.take(len)?;
            let staging = memory
                .at(slot.offset, len)
                .ok_or("a staging slot outside the ring")?;
            let off = at as u64;
            src.pool
                .context()
                .bind_to_thread()
                .map_err(|e| format!("cuCtxSetCurrent: {}", driver_error(e)))?;
            // SAFETY: a synchronous copy into a slot this thread alone uses until the watcher
            // releases it (after this function returned); the source range is checked, its
            // pool alive, its context current, its writers complete.
            unsafe { sys::cuMemcpyDtoH_v2(staging.cast(), src.ptr_at(off), len) }
                .result()
                .map_err(|e| format!("cuMemcpyDtoH: {}", driver_error(e)))?;
            dst.pool
                .context()
                .bind_to_thread()
                .map_err(|e| format!("cuCtxSetCurrent: {}", driver_error(e)))?;
            // SAFETY: synchronous from pinned memory (it returns once the data is on the
            // device); the destination range is checked, its pool alive, its context
            // current, and this stream's earlier work on it complete (synchronised above).
            unsafe { sys::cuMemcpyHtoD_v2(dst.ptr_at(off), staging.cast_const().cast(), len) }
                .result()
                .map_err(|e| format!("cuMemcpyHtoD: {}", driver_error(e)))?;
            self.send(Watch {
                release_slots_upto: Some(slot.ticket),
                ..Watch::default()
            });
            at += len;
        }
        self.bind()
    }

    /// The entry point `entry` of a program, compiled and loaded on first use (once per
    /// device; the module is kept for the device's lifetime).
    fn function(
        &self,
        program: &Program,
        entry: &str,
    ) -> std::result::Result<(Arc<CudaModule>, CudaFunction), String> {
        if entry.is_empty() || entry.contains('\0') {
            return Err(format!(
                "entry point {entry:?} is empty or contains a NUL byte"
            ));
        }
        let mut modules = lock(&self.gpu.modules);
        if !modules.contains_key(program) {
            let module = self.load(program)?;
            modules.insert(
                program.clone(),
                LoadedProgram {
                    module,
                    functions: HashMap::new(),
                },
            );
        }
        let loaded = modules
            .get_mut(program)
            .ok_or("a loaded program vanished")?;
        if let Some(f) = loaded.functions.get(entry) {
            return Ok((loaded.module.clone(), f.clone()));
        }
        let f = loaded
            .module
            .load_function(entry)
            .map_err(|e| format!("no entry point {entry}: {}", driver_error(e)))?;
        loaded.functions.insert(entry.to_string(), f.clone());
        Ok((loaded.module.clone(), f))
    }

    /// Compiles (CUDA C, with NVRTC for this device's `compute_XY`) and loads a program.
    fn load(&self, program: &Program) -> std::result::Result<Arc<CudaModule>, String> {
        let ptx = match (program.cuda_c(), program.ptx()) {
            (_, Some(text)) => {
                if text.contains('\0') {
                    return Err("the PTX contains a NUL byte".into());
                }
                Ptx::from_src(text.to_string())
            }
            (Some(source), None) => {
                let (major, minor) = self.gpu.limits.compute_capability;
                let arch = nvrtc::virtual_arch_for(major.max(0) as u32, minor.max(0) as u32)?;
                let options = program.nvrtc_options();
                Ptx::from_src(nvrtc::compile_to_ptx(
                    &source,
                    &program.name(),
                    &arch,
                    options,
                )?)
            }
            (None, None) => return Err("a program with neither CUDA C nor PTX".into()),
        };
        self.gpu
            .ctx
            .load_module(ptx)
            .map_err(|e| format!("cuModuleLoadData: {}", driver_error(e)))
    }

    /// Launches one kernel on the stream: the adapter every kernel goes through.
    fn launch(&self, l: &DeviceLaunch, keep: &mut Vec<Keep>) -> std::result::Result<(), String> {
        let (module, function) = self.function(&l.program, &l.entry_point)?;
        let mut cells: Vec<ParamCell> = l.params.iter().copied().map(ParamCell::of).collect();
        let mut addresses: Vec<*mut std::ffi::c_void> =
            cells.iter_mut().map(ParamCell::address).collect();
        self.bind()?;
        // SAFETY: the function comes from a module of this context kept alive (below) until
        // the launch completes; `addresses` points at `cells`, one value of the entry
        // point's parameter type each (the launch description's contract), which outlive
        // the call (the driver copies them); pointer parameters are checked ranges of
        // pools kept alive until completion.
        unsafe {
            result::launch_kernel(
                function.cu_function(),
                (l.grid[0], l.grid[1], l.grid[2]),
                (l.block[0], l.block[1], l.block[2]),
                l.shared_mem_bytes,
                self.stream.cu_stream(),
                &mut addresses,
            )
        }
        .map_err(|e| format!("cuLaunchKernel {}: {}", l.entry_point, driver_error(e)))?;
        keep.push(Keep::Module(module));
        Ok(())
    }
}

/// Publishes "no more decisions" when the submit thread ends, however it ends.
struct CloseOnExit(Arc<StreamShared>);

impl Drop for CloseOnExit {
    fn drop(&mut self) {
        gpu_stream::poison_if_panicking(&self.0.timeline, self.0.id, CUDA_NAMES.backend);
        self.0.close();
    }
}

/// The watcher thread's state.
struct Watcher {
    me: Arc<StreamShared>,
    gpu: Arc<Gpu>,
    ring: Arc<StagingRing>,
    trace: CompletionTrace,
    /// Why copying a staging slot into its host array failed, for the plan it belongs to
    /// (the next completion).
    copy_failure: Option<String>,
}

impl Watcher {
    fn run(mut self, rx: Receiver<Watch>, window: Duration) {
        let _close = CloseRingOnExit(self.ring.clone());
        while let Ok(w) = gpu_stream::recv_spinning(&rx, window) {
            self.handle(w);
        }
    }

    fn handle(&mut self, w: Watch) {
        let waited = match &w.event {
            Some(event) => event.synchronize().map_err(|e| {
                self.gpu
                    .mark_lost(&format!("CUDA error: {}", driver_error(e)))
            }),
            None => Ok(()),
        };
        if let (Ok(()), Some(out)) = (&waited, &w.copy_out) {
            // SAFETY: the copy into the slot completed (event synchronised above), the slot
            // is not released yet, and the protocol made this transfer wait for every other
            // use of the host array, which nobody reads before the plan completes (below,
            // later in this thread).
            let host = unsafe { out.host.bytes_mut(out.host_offset, out.len) };
            match (out.memory.at(out.slot_offset, out.len), host) {
                (Some(staging), Ok(dst)) => {
                    // SAFETY: `staging` holds `len` bytes (checked by `at`), `dst` too.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            staging.cast_const(),
                            dst.as_mut_ptr(),
                            out.len,
                        )
                    };
                }
                (None, _) => {
                    self.copy_failure
                        .get_or_insert_with(|| "a staging slot outside the ring".into());
                }
                (_, Err(e)) => {
                    self.copy_failure.get_or_insert_with(|| e.to_string());
                }
            }
        }
        if let Some(ticket) = w.release_slots_upto {
            self.ring.release_upto(ticket);
        }
        let Some(c) = w.complete else {
            return;
        };
        let lost = self.gpu.lost();
        let copy_failure = self.copy_failure.take();
        let outcome = match (c.outcome, waited, lost) {
            (Err(f), _, _) => Err(f),
            (Ok(()), Ok(()), None) if copy_failure.is_some() => Err(Arc::new(Failure {
                stream: self.me.id,
                seq: c.seq,
                operation: c.label.clone(),
                message: format!(
                    "copying out of the staging ring: {}",
                    copy_failure.unwrap_or_default()
                ),
            })),
            (Ok(()), Err(cause), _) | (Ok(()), Ok(()), Some(cause)) => Err(Arc::new(Failure {
                stream: self.me.id,
                seq: c.seq,
                operation: c.label.clone(),
                message: format!("device lost: {cause}"),
            })),
            (Ok(()), Ok(()), None) => Ok(()),
        };
        if let Some(op) = c.trace {
            // Recorded before the event completes, so waiters always end after it.
            self.trace.completed(op, outcome.is_ok());
        }
        match outcome {
            Ok(()) => self.me.timeline.signal(c.seq),
            Err(f) => self.me.timeline.fail(c.seq, f),
        }
        self.me.completed(c.seq);
        drop(w.keep);
    }
}

/// Tells the ring nothing will be released any more when the watcher ends, however it ends.
struct CloseRingOnExit(Arc<StagingRing>);

impl Drop for CloseRingOnExit {
    fn drop(&mut self) {
        self.0.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_are_published_and_forgotten_once_complete() {
        let tl = Timeline::new(StreamId {
            device: crate::DeviceId(0),
            index: 0,
        });
        let s = Arc::new(StreamShared::new(tl.stream(), tl));
        let f = Arc::new(Failure {
            stream: s.id,
            seq: 1,
            operation: "op".into(),
            message: "boom".into(),
        });
        s.decide(1, Decision::Failed(f));
        assert!(matches!(s.decision(1), Decision::Failed(x) if x.message == "boom"));
        s.completed(1);
        assert!(matches!(s.decision(1), Decision::Completed));
        // A waiter for an undecided number is released by the decision.
        let s2 = s.clone();
        let waiter = std::thread::spawn(move || matches!(s2.decision(2), Decision::Gone));
        s.close();
        assert!(waiter.join().expect("waiter"));
    }
}
