//! Vulkan streams: a submit thread and a completion thread around one timeline semaphore. The
//! scheme is in DESIGN.md §5, "Vulkan".
//!
//! The `// SAFETY:` comments below name these facts, which the types enforce:
//!
//! - *protocol-made*: a [`Plan`] comes from the protocol or from the `unsafe`
//!   [`Plan::from_parts`], so its dependencies order it after every conflicting use and its
//!   writable bindings do not alias;
//! - *own timeline*: `submit` takes only plans of this stream's timeline, see
//!   [`Plan::check_queue`]. The caller of the `unsafe`
//!   [`crate::backend::Backend::start_stream`] promises that nothing else completes it. An
//!   event completes only after its work, host work included, so a completed dependency is
//!   finished work;
//! - *kept*: whatever a batch uses is held in its `Keep`s until the completion thread sees
//!   the batch done, and leaked if it never can.

mod programs;

use std::{collections::VecDeque, sync::Arc, time::Instant};

use ash::vk;
use crossbeam_channel::{Receiver, Sender};

use super::{
    conv::map_oom_and_lost,
    device::{Gpu, Shared},
    instance::{host_visibility_barrier, LogicalDevice},
    kernels::{Lowered, Lowering, Pipeline},
    memory::{same_size, Buffer, Region},
};
use crate::{
    backend::{
        gpu_stream::{self, BackendNames, Decided, Decisions, Sent, SubmitChannel},
        recording::{CompletionTrace, OpTrace, StreamTrace},
    },
    error::{DeviceError, Error, Failure},
    event::Timeline,
    ids::StreamId,
    memory::AlignedBuffer,
    protocol::{StreamProgram, Work},
    sync::Arc as SyncArc,
};

/// What every stream of a device can see of one stream: its semaphore and its decisions.
pub(super) struct StreamShared {
    pub(super) id: StreamId,
    pub(super) timeline: SyncArc<Timeline>,
    pub(super) semaphore: vk::Semaphore,
    core: Arc<LogicalDevice>,
    /// What the submit thread decided: the root causes of failed numbers not yet completed.
    decided: Decisions<Arc<Failure>>,
}

/// What a stream decided for one of its sequence numbers.
enum Decision {
    /// Its batch is submitted: waiting for the semaphore value is enough.
    Submitted,
    /// It failed (its semaphore value is still signalled, by an empty batch).
    Failed(Arc<Failure>),
    /// The stream stopped before deciding: only its timeline can say.
    Gone,
}

impl From<Decided<Arc<Failure>>> for Decision {
    fn from(d: Decided<Arc<Failure>>) -> Decision {
        match d {
            Decided::Yes(Some(f)) => Decision::Failed(f),
            Decided::Yes(None) => Decision::Submitted,
            Decided::Gone => Decision::Gone,
        }
    }
}

impl StreamShared {
    pub(super) fn new(
        core: Arc<LogicalDevice>,
        id: StreamId,
        timeline: SyncArc<Timeline>,
    ) -> std::result::Result<StreamShared, DeviceError> {
        let mut ty = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let info = vk::SemaphoreCreateInfo::default().push_next(&mut ty);
        // SAFETY: valid device (timeline semaphores enabled at creation); the chained
        // struct lives across the call.
        let semaphore = unsafe { core.device.create_semaphore(&info, None) }
            .map_err(|r| map_oom_and_lost("vkCreateSemaphore", 0, r))?;
        Ok(StreamShared {
            id,
            timeline,
            semaphore,
            core,
            decided: Decisions::new(),
        })
    }

    /// Publishes the decision for `seq` (and everything before it).
    fn decide(&self, seq: u64, failure: Option<Arc<Failure>>) {
        self.decided.decide(seq, failure);
        // Failures of completed operations are on the timeline now.
        self.decided.forget_upto(self.timeline.completed());
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

    /// The semaphore's current value.
    fn value(&self) -> std::result::Result<u64, DeviceError> {
        // SAFETY: the semaphore belongs to this device and lives as long as `self`.
        unsafe { self.core.device.get_semaphore_counter_value(self.semaphore) }.map_err(|r| {
            self.core
                .fail(map_oom_and_lost("vkGetSemaphoreCounterValue", 0, r))
        })
    }
}

impl Drop for StreamShared {
    fn drop(&mut self) {
        // SAFETY: kept: a batch of another stream that waits on this semaphore holds an
        // `Arc` to it (`Keep::Stream`) until its completion is observed; this stream's own
        // batches are observed by the completion thread, which holds an `Arc` meanwhile and
        // leaks one if it cannot observe them. So no pending queue operation refers to it.
        unsafe { self.core.device.destroy_semaphore(self.semaphore, None) };
    }
}

/// Waits on the host until every `(semaphore, value)` is reached, for at most the device
/// timeout ([`LogicalDevice::wait_semaphores`]); past it the device is lost.
fn host_wait(
    core: &LogicalDevice,
    waits: &[(vk::Semaphore, u64)],
    what: impl FnOnce() -> String,
) -> std::result::Result<(), DeviceError> {
    if waits.is_empty() {
        return Ok(());
    }
    core.wait_semaphores(waits, &what())
}

/// A plan resolved to buffers at submission.
type Job = gpu_stream::Job<Region>;

type Submitted = gpu_stream::Submitted<Job>;

/// This backend's name in failures, and its stream threads' prefix.
const VULKAN_NAMES: BackendNames = BackendNames {
    backend: "Vulkan",
    threads: "vk",
};

/// Things a batch uses, kept alive until its completion is observed.
#[derive(Clone)]
enum Keep {
    Buffer(#[allow(dead_code)] Arc<Buffer>),
    Pipeline(#[allow(dead_code)] Arc<Pipeline>),
    Stream(#[allow(dead_code)] Arc<StreamShared>),
    Host(#[allow(dead_code)] Arc<AlignedBuffer>),
}

/// A decided sequence number on its way to the completion thread.
struct Pending {
    seq: u64,
    outcome: std::result::Result<(), Arc<Failure>>,
    /// Whether a batch signalling `seq` was submitted (false only on a lost device).
    signalled: bool,
    /// For the timeline, when one is recorded and the operation ran.
    trace: Option<OpTrace>,
    _keep: Vec<Keep>,
}

/// One Vulkan stream: the sending side of its submit thread, and both threads.
pub(super) struct VulkanStream {
    backend: Arc<Shared>,
    channel: SubmitChannel<Job, StreamProgram>,
}

impl VulkanStream {
    pub(super) fn start(
        backend: Arc<Shared>,
        gpu: Arc<Gpu>,
        shared: Arc<StreamShared>,
        trace: StreamTrace,
    ) -> std::result::Result<VulkanStream, DeviceError> {
        let d = &gpu.core.device;
        let pool_info = vk::CommandPoolCreateInfo::default()
            .queue_family_index(gpu.core.physical.queue_family)
            .flags(
                vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER
                    | vk::CommandPoolCreateFlags::TRANSIENT,
            );
        // SAFETY: valid device and create info.
        let pool = unsafe { d.create_command_pool(&pool_info, None) }
            .map_err(|r| map_oom_and_lost("vkCreateCommandPool", 0, r))?;
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<Pending>();
        let submitter = Submitter {
            backend: backend.clone(),
            gpu,
            spirv: backend.spirv.clone(),
            me: shared.clone(),
            pool,
            free: Vec::new(),
            in_flight: VecDeque::new(),
            last: 0,
            done: done_tx,
            host_scratch: Vec::new(),
            trace: trace.clone(),
            recordings: programs::Recordings::default(),
        };
        let completer = shared.clone();
        // If the submit thread cannot start, the submitter (and its command pool and
        // completion sender) is dropped with its closure: the completion thread ends by
        // itself.
        let channel = SubmitChannel::start(
            shared.timeline.clone(),
            VULKAN_NAMES,
            move |rx| submitter.run(rx),
            move || completion_loop(completer, done_rx, trace),
        )?;
        Ok(VulkanStream { backend, channel })
    }

    fn resolve(&self, work: &Work) -> std::result::Result<Job, String> {
        let b = &self.backend;
        Job::lower(work, |loc, bytes| b.resolve(loc, bytes), |_, _| Ok(()))
    }
}

gpu_stream::stream_queue_over_channel!(VulkanStream, programs);

/// The submit thread's state.
struct Submitter {
    backend: Arc<Shared>,
    gpu: Arc<Gpu>,
    spirv: Arc<super::kernels::SpirvCache>,
    me: Arc<StreamShared>,
    pool: vk::CommandPool,
    free: Vec<vk::CommandBuffer>,
    in_flight: VecDeque<(u64, vk::CommandBuffer)>,
    /// The last value this stream signalled (or submitted a signal of).
    last: u64,
    done: Sender<Pending>,
    /// Host memory for staged cross-device copies, kept between them.
    host_scratch: Vec<u8>,
    trace: StreamTrace,
    /// Command buffers recorded for replays, kept for the next ones.
    recordings: programs::Recordings,
}

/// How the dependencies of one plan are to be waited for (semaphore waits on other
/// streams of this device).
type Waits = gpu_stream::Waits<(Arc<StreamShared>, u64)>;

impl Submitter {
    fn run(mut self, rx: Receiver<Sent<Job, StreamProgram>>) {
        let _close = CloseOnExit(self.me.clone());
        while let Ok(sent) = rx.recv() {
            match sent {
                Sent::Plan(item) => {
                    let span = tracing::debug_span!("vk", stream = %self.me.id, seq = item.seq, op = %item.label);
                    let _e = span.enter();
                    self.process(item);
                }
                Sent::Program(program) => {
                    let span = tracing::debug_span!("vk", stream = %self.me.id, seq = program.first_seq(), ops = program.len());
                    let _e = span.enter();
                    self.run_program(program);
                }
            }
        }
        self.drain();
    }

    /// Waits for every batch of this stream, then frees the command pool.
    fn drain(&mut self) {
        let core = self.gpu.core.clone();
        if self.last > 0 {
            let id = self.me.id;
            let last = self.last;
            if host_wait(&core, &[(self.me.semaphore, last)], || {
                format!("the last batch of stream {id} (value {last}) at shutdown")
            })
            .is_err()
            {
                // The device may still execute command buffers of the pool: never free it.
                core.leak(self.pool, "a stream's command pool");
                self.free.clear();
                self.in_flight.clear();
                self.recordings.clear();
                return;
            }
        }
        // SAFETY: every command buffer of the pool has completed (waited above, within the
        // deadline); the pool is used by this thread only.
        unsafe { core.device.destroy_command_pool(self.pool, None) };
        self.free.clear();
        self.in_flight.clear();
        self.recordings.clear();
    }

    fn failure(&self, item: &Submitted, message: String) -> Arc<Failure> {
        item.failure(self.me.id, message)
    }

    /// Sorts the dependencies: same-device ones become semaphore waits (after their
    /// stream decided them), the others are waited for here, on the host.
    fn classify(&self, item: &Submitted) -> Waits {
        Waits::classify(&item.deps, |dep| {
            let local = self.gpu.stream_of(dep.event.timeline());
            match local.as_ref().map(|s| (s, s.decision(dep.event.seq()))) {
                Some((s, Decision::Submitted)) => (Some((s.clone(), dep.event.seq())), None),
                Some((s, Decision::Failed(f))) => (Some((s.clone(), dep.event.seq())), Some(f)),
                Some((_, Decision::Gone)) | None => {
                    // Another device or backend (or a dead stream): wait on the host.
                    match self.trace.host_wait(dep, &item.label, item.seq) {
                        Err(Error::Failed(f)) => (None, Some(f)),
                        _ => (None, None),
                    }
                }
            }
        })
    }

    fn process(&mut self, item: Submitted) {
        let arrived = Instant::now();
        if item.seq <= self.last {
            let f = self.failure(
                &item,
                format!("sequence number {} after {}", item.seq, self.last),
            );
            tracing::warn!(%f, "out-of-order plan");
            self.report(item.seq, Err(f), false, Vec::new(), None);
            return;
        }
        let waits = self.classify(&item);
        let mut keep: Vec<Keep> = waits
            .gpu
            .iter()
            .map(|(s, _)| Keep::Stream(s.clone()))
            .collect();
        if let Some(cause) = self.gpu.core.lost() {
            let f = self.failure(&item, format!("device lost: {cause}"));
            // Published like every decision: later plans of the device wait for it.
            self.me.decide(item.seq, Some(f.clone()));
            self.report(item.seq, Err(f), false, keep, None);
            return;
        }
        let sem_waits: Vec<(vk::Semaphore, u64)> =
            waits.gpu.iter().map(|(s, v)| (s.semaphore, *v)).collect();
        let trace = match (&waits.failed, &item.job) {
            (None, Ok(_)) => {
                self.trace
                    .start(item.seq, &item.label, &item.deps, item.bytes, arrived)
            }
            _ => None,
        };
        let outcome: std::result::Result<Option<vk::CommandBuffer>, Arc<Failure>> =
            match (&waits.failed, &item.job) {
                (Some(root), _) => Err(root.clone()),
                (None, Err(msg)) => Err(self.failure(&item, msg.clone())),
                (None, Ok(job)) => self
                    .execute(job, &sem_waits, &mut keep)
                    .map_err(|m| self.failure(&item, m)),
            };
        let (cb, result) = match outcome {
            Ok(cb) => (cb, Ok(())),
            Err(f) => (None, Err(f)),
        };
        match self.submit_batch(cb.as_slice(), &sem_waits, item.seq) {
            Ok(()) => {
                if let Some(cb) = cb {
                    self.in_flight.push_back((item.seq, cb));
                }
                self.last = item.seq;
                self.me.decide(item.seq, result.as_ref().err().cloned());
                self.report(item.seq, result, true, keep, trace);
            }
            Err(e) => {
                let f = self.failure(&item, format!("cannot submit: {e}"));
                self.gpu.core.mark_lost(&e.to_string());
                if let Some(cb) = cb {
                    self.free.push(cb);
                }
                self.me.decide(item.seq, Some(f.clone()));
                self.report(item.seq, Err(f), false, keep, None);
            }
        }
    }

    fn report(
        &self,
        seq: u64,
        outcome: std::result::Result<(), Arc<Failure>>,
        signalled: bool,
        keep: Vec<Keep>,
        trace: Option<OpTrace>,
    ) {
        let _ = self.done.send(Pending {
            seq,
            outcome,
            signalled,
            trace,
            _keep: keep,
        });
    }

    /// Runs or records the job. `Ok(Some(cb))`: a recorded command buffer to submit;
    /// `Ok(None)`: nothing to submit but the signal (host work done, or no work).
    fn execute(
        &mut self,
        job: &Job,
        sem_waits: &[(vk::Semaphore, u64)],
        keep: &mut Vec<Keep>,
    ) -> std::result::Result<Option<vk::CommandBuffer>, String> {
        if !self.runs_on_device(job) {
            // Host work: every dependency and this stream's previous work must be done.
            let mut all = sem_waits.to_vec();
            if self.last > 0 {
                all.push((self.me.semaphore, self.last));
            }
            let id = self.me.id;
            host_wait(&self.gpu.core, &all, || {
                format!("the dependencies of a host transfer on stream {id}")
            })
            .map_err(|e| e.to_string())?;
            self.host_job(job).map_err(|e| e.to_string())?;
            match job {
                Job::FromHost { host, .. } | Job::ToHost { host, .. } => {
                    keep.push(Keep::Host(host.clone()))
                }
                _ => {}
            }
            return Ok(None);
        }
        self.record_job(job, keep, Usage::Once)
    }

    /// Whether `job` runs on this device's queue (a kernel, a marker, a memset, a copy
    /// within the device): what [`Submitter::record_job`] takes; the rest is host work.
    fn runs_on_device(&self, job: &Job) -> bool {
        let core = &self.gpu.core;
        match job {
            Job::Copy { src, dst, .. } => src.on_device(core) && dst.on_device(core),
            Job::FromHost { .. } | Job::ToHost { .. } => false,
            Job::Run { .. } | Job::Memset { .. } | Job::Marker => true,
        }
    }

    /// Records a job that runs on this device's queue ([`Submitter::runs_on_device`]) for
    /// `usage`, and adds what its command buffer uses to `keep`. `Ok(None)`: nothing to run.
    fn record_job(
        &mut self,
        job: &Job,
        keep: &mut Vec<Keep>,
        usage: Usage,
    ) -> std::result::Result<Option<vk::CommandBuffer>, String> {
        let core = self.gpu.core.clone();
        let local = |r: &Region| r.on_device(&core);
        match job {
            Job::Marker => Ok(None),
            Job::Run {
                kernel,
                args,
                merge,
                bindings,
            } => {
                gpu_stream::check_local(args, local)?;
                if merge.as_ref().is_some_and(|m| !local(&m.region)) {
                    return Err(
                        "the merge source lives on another device (streaming across Vulkan \
                         devices is not supported)"
                            .into(),
                    );
                }
                let lowered = Lowering {
                    core: &core,
                    pipelines: &self.gpu.pipelines,
                    spirv: &self.spirv,
                }
                .lower(kernel, args, merge.as_ref(), bindings)?;
                for a in args.iter().chain(merge.iter()) {
                    keep.push(Keep::Buffer(a.region.buffer.clone()));
                }
                if let Lowered::Nothing = lowered {
                    return Ok(None);
                }
                self.record(usage, |cb| match &lowered {
                    Lowered::Nothing => {}
                    Lowered::Copy(src, dst, bytes) => copy_cmd(&core, cb, src, dst, *bytes),
                    Lowered::Dispatches(ds) => {
                        for (i, d) in ds.iter().enumerate() {
                            if i > 0 {
                                compute_barrier(&core, cb);
                            }
                            // SAFETY: `cb` is recording on this device; the pipeline and
                            // the bound buffers are kept alive in `keep` until completion.
                            unsafe { d.pipeline.record(cb, &d.bindings, &d.push, d.groups) };
                        }
                    }
                })
                .map(Some)
                .inspect(|_| {
                    if let Lowered::Dispatches(ds) = &lowered {
                        for d in ds {
                            keep.push(Keep::Pipeline(d.pipeline.clone()));
                            keep.extend(d.bindings.iter().map(|b| Keep::Buffer(b.buffer.clone())));
                        }
                    }
                })
            }
            Job::Copy {
                src, dst, bytes, ..
            } => {
                if !(local(src) && local(dst)) {
                    return Err("a copy between devices is host work".into());
                }
                keep.push(Keep::Buffer(src.buffer.clone()));
                keep.push(Keep::Buffer(dst.buffer.clone()));
                same_size(src.bytes, *bytes).map_err(|e| e.to_string())?;
                let n = same_size(*bytes, dst.bytes).map_err(|e| e.to_string())?;
                if n == 0 {
                    return Ok(None);
                }
                self.record(usage, |cb| copy_cmd(&core, cb, src, dst, n))
                    .map(Some)
            }
            Job::Memset { dst, bytes } => {
                if !local(dst) {
                    return Err("memset of a buffer of another device".into());
                }
                keep.push(Keep::Buffer(dst.buffer.clone()));
                if *bytes == 0 {
                    return Ok(None);
                }
                if dst.offset % 4 != 0 {
                    return Err(format!(
                        "memset at offset {}, not a multiple of 4 (pool alignment too small)",
                        dst.offset
                    ));
                }
                // vkCmdFillBuffer works on whole words: round up (buffers start at offsets
                // aligned to at least 16, so the padding of the last word is no one else's).
                let size = bytes
                    .next_multiple_of(4)
                    .min(dst.buffer.size() - dst.offset);
                let (buf, off) = (dst.buffer.handle(), dst.offset);
                self.record(usage, |cb| {
                    // SAFETY: recording; offset is a multiple of 4 (pool alignment), size a
                    // multiple of 4 within the buffer.
                    unsafe { core.device.cmd_fill_buffer(cb, buf, off, size, 0) }
                })
                .map(Some)
            }
            Job::FromHost { .. } | Job::ToHost { .. } => Err("host work is not recorded".into()),
        }
    }

    fn host_job(&mut self, job: &Job) -> std::result::Result<(), DeviceError> {
        match job {
            Job::FromHost { host, dst, bytes } => {
                // SAFETY: protocol-made and own timeline: the dependencies just waited for
                // include every device writer of the host array, finished; the host writes
                // it only through `HostTable::commit_write`, which refuses while this
                // transfer (a recorded use) has not completed.
                let data = unsafe { host.bytes(0, *bytes as usize) }
                    .map_err(|e| DeviceError::Unexpected(e.to_string()))?;
                dst.write_from_host(data)
            }
            Job::ToHost { src, host, bytes } => {
                // SAFETY: protocol-made and own timeline: every other device use of the host
                // array finished (waited for just above) or waits for this transfer; the
                // host reads or writes it only through `HostTable`, which refuses while
                // this transfer (a recorded write) has not completed.
                let out = unsafe { host.bytes_mut(0, *bytes as usize) }
                    .map_err(|e| DeviceError::Unexpected(e.to_string()))?;
                src.read_to_host(out)
            }
            Job::Copy {
                src, dst, bytes, ..
            } => src.copy_across(dst, *bytes, &mut self.host_scratch),
            _ => Ok(()),
        }
    }

    /// A command buffer recorded by `f` for `usage`, ended with the host-visibility barrier.
    fn record(
        &mut self,
        usage: Usage,
        f: impl FnOnce(vk::CommandBuffer),
    ) -> std::result::Result<vk::CommandBuffer, String> {
        let core = self.gpu.core.clone();
        let d = &core.device;
        self.reclaim();
        let cb = match self.free.pop() {
            Some(cb) => cb,
            None => {
                let info = vk::CommandBufferAllocateInfo::default()
                    .command_pool(self.pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(1);
                // SAFETY: our pool, used by this thread only.
                let cbs = unsafe { d.allocate_command_buffers(&info) }
                    .map_err(|r| format!("vkAllocateCommandBuffers: {r}"))?;
                cbs.first().copied().ok_or("no command buffer allocated")?
            }
        };
        let flags = match usage {
            Usage::Once => vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT,
            Usage::Replayed => vk::CommandBufferUsageFlags::SIMULTANEOUS_USE,
        };
        let begin = vk::CommandBufferBeginInfo::default().flags(flags);
        // SAFETY: `cb` is not in use (fresh, or reclaimed after its batch completed); our
        // pool allows resetting individual buffers, which `begin` does implicitly.
        if let Err(r) = unsafe { d.begin_command_buffer(cb, &begin) } {
            self.free.push(cb);
            return Err(format!("vkBeginCommandBuffer: {r}"));
        }
        if usage == Usage::Replayed {
            // Submitted after other command buffers in one batch, with no semaphore wait
            // between them: order it after everything submitted before.
            full_barrier(d, cb);
        }
        f(cb);
        host_visibility_barrier(d, cb);
        // SAFETY: recording began above.
        if let Err(r) = unsafe { d.end_command_buffer(cb) } {
            self.free.push(cb);
            return Err(format!("vkEndCommandBuffer: {r}"));
        }
        Ok(cb)
    }

    /// Moves the command buffers of completed batches back to the free list.
    fn reclaim(&mut self) {
        let Some(&(first, _)) = self.in_flight.front() else {
            return;
        };
        let Ok(value) = self.me.value() else {
            return;
        };
        if value < first {
            return;
        }
        while let Some(&(seq, cb)) = self.in_flight.front() {
            if seq > value {
                break;
            }
            self.in_flight.pop_front();
            self.free.push(cb);
        }
    }

    /// Submits one batch: waits for the stream's previous value and `waits`, runs `cbs` in
    /// order, signals `seq`.
    fn submit_batch(
        &self,
        cbs: &[vk::CommandBuffer],
        waits: &[(vk::Semaphore, u64)],
        seq: u64,
    ) -> std::result::Result<(), DeviceError> {
        let core = &self.gpu.core;
        let mut sems = Vec::with_capacity(waits.len() + 1);
        let mut vals = Vec::with_capacity(waits.len() + 1);
        if self.last > 0 {
            sems.push(self.me.semaphore);
            vals.push(self.last);
        }
        for &(s, v) in waits {
            if s != self.me.semaphore && v > 0 {
                sems.push(s);
                vals.push(v);
            }
        }
        let stages = vec![vk::PipelineStageFlags::ALL_COMMANDS; sems.len()];
        let signal = [self.me.semaphore];
        let signal_vals = [seq];
        let mut timeline = vk::TimelineSemaphoreSubmitInfo::default()
            .wait_semaphore_values(&vals)
            .signal_semaphore_values(&signal_vals);
        let submit = [vk::SubmitInfo::default()
            .wait_semaphores(&sems)
            .wait_dst_stage_mask(&stages)
            .command_buffers(cbs)
            .signal_semaphores(&signal)
            .push_next(&mut timeline)];
        let queue = core.queue();
        // SAFETY: the queue is externally synchronised by its mutex; the command buffers are
        // fully recorded, and pending elsewhere only if recorded for simultaneous use
        // (`Usage::Replayed`); the semaphores are timeline semaphores
        // of this device kept alive (by `Keep`) until the batch completes; the signalled
        // value exceeds every value signalled or pending on our semaphore (the batch waits
        // for `last < seq` first).
        unsafe { core.device.queue_submit(*queue, &submit, vk::Fence::null()) }
            .map_err(|r| core.fail(map_oom_and_lost("vkQueueSubmit", 0, r)))
    }
}

/// What a command buffer is recorded for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Usage {
    /// One plan's batch: submitted once, after a semaphore wait on the stream's previous
    /// batch.
    Once,
    /// An operation of a replayed step: resubmitted by every replay, possibly while an
    /// earlier submission is pending, beside other operations in one batch. It starts with
    /// a barrier on everything submitted before it.
    Replayed,
}

/// Orders what `cb` records after every command submitted to the queue before it: their
/// writes are visible to its reads and writes.
fn full_barrier(d: &ash::Device, cb: vk::CommandBuffer) {
    let barrier = [vk::MemoryBarrier::default()
        .src_access_mask(vk::AccessFlags::MEMORY_WRITE)
        .dst_access_mask(vk::AccessFlags::MEMORY_READ | vk::AccessFlags::MEMORY_WRITE)];
    // SAFETY: `cb` is recording on this device (the caller's contract, see `record`).
    unsafe {
        d.cmd_pipeline_barrier(
            cb,
            vk::PipelineStageFlags::ALL_COMMANDS,
            vk::PipelineStageFlags::ALL_COMMANDS,
            vk::DependencyFlags::empty(),
            &barrier,
            &[],
            &[],
        )
    };
}

/// Makes the writes of earlier dispatches of `cb` visible to later ones.
fn compute_barrier(core: &LogicalDevice, cb: vk::CommandBuffer) {
    let barrier = [vk::MemoryBarrier::default()
        .src_access_mask(vk::AccessFlags::SHADER_WRITE)
        .dst_access_mask(vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE)];
    // SAFETY: `cb` is recording on this device.
    unsafe {
        core.device.cmd_pipeline_barrier(
            cb,
            vk::PipelineStageFlags::COMPUTE_SHADER,
            vk::PipelineStageFlags::COMPUTE_SHADER,
            vk::DependencyFlags::empty(),
            &barrier,
            &[],
            &[],
        )
    };
}

/// Records a copy of `bytes` bytes, which both regions hold (checked by the callers: a
/// `Work::Copy` above, `Lowering::copy` for copy kernels, both of exactly `bytes`).
fn copy_cmd(core: &LogicalDevice, cb: vk::CommandBuffer, src: &Region, dst: &Region, bytes: u64) {
    debug_assert!(bytes <= src.bytes && bytes <= dst.bytes);
    let region = [vk::BufferCopy {
        src_offset: src.offset,
        dst_offset: dst.offset,
        size: bytes,
    }];
    // SAFETY: `cb` is recording on this device; kept: both buffers are held until the
    // batch is observed complete; the ranges were checked against the buffers at
    // resolution; protocol-made: the source and destination bindings do not overlap.
    unsafe {
        core.device
            .cmd_copy_buffer(cb, src.buffer.handle(), dst.buffer.handle(), &region)
    };
}

/// Publishes "no more decisions" when the submit thread ends, however it ends.
struct CloseOnExit(Arc<StreamShared>);

impl Drop for CloseOnExit {
    fn drop(&mut self) {
        gpu_stream::poison_if_panicking(&self.0.timeline, self.0.id, VULKAN_NAMES.backend);
        self.0.close();
    }
}

/// Completes the timeline in order as the semaphore advances.
///
/// Once a wait fails (the device timed out or is lost, see [`LogicalDevice::wait_semaphores`])
/// every operation still to come is failed in order, the ones whose work was submitted
/// with the loss as root cause, and what their batches use is leaked (the device might
/// still use it), with the semaphore: nothing is freed under the device.
fn completion_loop(me: Arc<StreamShared>, rx: Receiver<Pending>, trace: StreamTrace) {
    let mut trace = trace.completions();
    let mut queue: VecDeque<Pending> = VecDeque::new();
    let mut lost: Option<Arc<Failure>> = None;
    loop {
        if queue.is_empty() {
            match rx.recv() {
                Ok(p) => queue.push_back(p),
                Err(_) => return,
            }
        }
        while let Ok(p) = rx.try_recv() {
            queue.push_back(p);
        }
        if let Some(cause) = &lost {
            for p in queue.drain(..) {
                complete_lost(&me, p, cause, &mut trace);
            }
            continue;
        }
        let Some(front) = queue.front() else {
            continue;
        };
        if front.signalled {
            let (id, seq) = (me.id, front.seq);
            if let Err(e) = host_wait(&me.core, &[(me.semaphore, seq)], || {
                format!("operation {seq} of stream {id}")
            }) {
                lost = Some(Arc::new(Failure {
                    stream: me.id,
                    seq,
                    operation: "device".into(),
                    message: e.to_string(),
                }));
                // Pending batches may still wait on or signal the semaphore.
                me.core.leak(me.clone(), "a stream's timeline semaphore");
                continue;
            }
        }
        let value = me.value().unwrap_or(0);
        while let Some(p) = queue.front() {
            if p.signalled && p.seq > value {
                break;
            }
            let Some(p) = queue.pop_front() else {
                break;
            };
            if let Some(op) = p.trace {
                trace.completed(op, p.outcome.is_ok());
            }
            match p.outcome {
                Ok(()) => me.timeline.signal(p.seq),
                Err(f) => me.timeline.fail(p.seq, f),
            }
        }
    }
}

/// Completes `p` on a device that stopped answering: fails it (with its own root cause if
/// it had one, else with the loss) after leaking what its batch, if submitted, uses.
fn complete_lost(
    me: &Arc<StreamShared>,
    p: Pending,
    lost: &Arc<Failure>,
    trace: &mut CompletionTrace,
) {
    if let Some(op) = p.trace {
        trace.completed(op, false);
    }
    let failure = match p.outcome {
        Err(f) => f,
        Ok(()) => lost.clone(),
    };
    if p.signalled {
        me.core.leak(p._keep, "the resources of a pending batch");
    }
    me.timeline.fail(p.seq, failure);
}
