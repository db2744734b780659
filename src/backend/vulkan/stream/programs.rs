//! A replay's program on a Vulkan stream: command buffers recorded once and resubmitted. See
//! DESIGN.md §5, "Vulkan" and §4, "Compiled replays".
//!
//! Issuing an operation lowers its work (pipeline and SPIR-V lookups by key, push constants,
//! descriptor writes), records a command buffer and submits it alone. A replayed step runs
//! the same templates over the same buffers every time, so the first replay records each
//! operation's command buffer for reuse ([`Usage::Replayed`]: simultaneous use, a leading
//! barrier) and keeps it by (step, template); later replays resolve the operation's
//! locations, check that they name the same buffers at the same offsets and that its index
//! values are the ones pushed, and resubmit it. Consecutive operations that wait for no
//! other stream go out as one batch: one `vkQueueSubmit` that waits for the stream's
//! previous value and for the other streams' values the first operation needs, runs the
//! command buffers in order and signals the last operation's number (which completes the
//! ones before it: the timeline is monotonic).
//!
//! What is not on this device's queue, or not plainly runnable, takes the plan path one
//! operation at a time, with exactly a plan's semantics: host transfers and copies between
//! devices, operations failing without running, operations whose data dependency failed or
//! lies on another device or a stopped stream, a lost device. A recording names its buffers
//! weakly: a released pool is freed at once, and a recording over it no longer matches (a
//! new buffer cannot take the address of one a recording still names). Recordings of
//! dropped steps are swept, their command buffers reset once their last batch completed.

use std::{
    collections::HashMap,
    sync::{Arc, Weak},
    time::Instant,
};

use ash::vk;
use smallvec::SmallVec;

use super::{Decision, Job, Keep, StreamShared, Submitted, Submitter, Usage};
use crate::{
    backend::{
        gpu_stream,
        recording::OpTrace,
        vulkan::{
            device::ReplayCounters,
            memory::{Buffer, Region},
        },
    },
    error::Failure,
    event::EventStatus,
    kernels::Bindings,
    protocol::{DepKind, DeviceStep, StreamProgram, StreamProgramOp},
    sync::Arc as SyncArc,
};

/// Recordings a stream keeps at most; past it (after a sweep) an operation is recorded for
/// its batch only.
const KEPT: usize = 4096;

/// Programs run between two sweeps of the recordings of dropped steps.
const SWEEP_EVERY: u32 = 1024;

/// The command buffers a stream recorded for replays, by (step address, template).
#[derive(Default)]
pub(super) struct Recordings {
    kept: HashMap<(usize, u32), Recording>,
    since_sweep: u32,
}

impl Recordings {
    /// Forgets every recording (the command pool, which frees their buffers, is gone).
    pub(super) fn clear(&mut self) {
        self.kept.clear();
    }
}

/// One operation's command buffer, as recorded for a step's replays.
struct Recording {
    /// The step: while it is held (weakly), no other step takes its address.
    step: Weak<DeviceStep>,
    /// `None`: nothing to run (a marker, no elements, no bytes).
    cb: Option<vk::CommandBuffer>,
    /// The regions recorded over, in [`gpu_stream::device_locations`] order: buffer
    /// (weakly), offset, bytes.
    regions: SmallVec<[(Weak<Buffer>, u64, u64); 4]>,
    /// The index values pushed (kernels only).
    values: Option<Bindings>,
    /// What `cb` uses besides the regions: its pipelines, and buffers its lowering made
    /// (a reduction's scratch), which nothing else holds.
    held: SmallVec<[Keep; 2]>,
    /// The last sequence number whose batch ran `cb`: it may be reset once the stream's
    /// semaphore reached it.
    used: u64,
}

impl Recording {
    /// Whether it runs an operation over `regions` with `values`.
    fn matches(&self, regions: &[Region], values: Option<&Bindings>) -> bool {
        self.regions.len() == regions.len()
            && self
                .regions
                .iter()
                .zip(regions)
                .all(|((b, offset, bytes), r)| {
                    std::ptr::eq(b.as_ptr(), Arc::as_ptr(&r.buffer))
                        && *offset == r.offset
                        && *bytes == r.bytes
                })
            && match (&self.values, values) {
                // Mutant: a recording resubmitted with the index values it pushed.
                (Some(a), Some(b)) => a.same_values(b) || mutant!("vulkan_stale_recording"),
                (None, None) => true,
                _ => false,
            }
    }
}

/// Operations of a program gathered into one batch.
#[derive(Default)]
struct Batch {
    /// The command buffers to run, in order.
    cbs: SmallVec<[vk::CommandBuffer; 16]>,
    /// Those recorded for this batch only, freed once it completed.
    once: SmallVec<[vk::CommandBuffer; 2]>,
    /// Values of other streams of the device to wait for first.
    waits: DeviceWaits,
    /// Per operation: its index in the program, its number, its timeline record.
    ops: SmallVec<[(usize, u64, Option<OpTrace>); 16]>,
    keep: Vec<Keep>,
}

/// Why an operation takes the plan path (kept for the debug log).
type Slow = gpu_stream::AsPlan;

/// Values of other streams of the device to wait for.
type DeviceWaits = SmallVec<[(Arc<StreamShared>, u64); 4]>;

impl Submitter {
    /// Runs `program`: its operations in order, batched from recordings where they can be,
    /// one by one as plans where they cannot.
    pub(super) fn run_program(&mut self, program: StreamProgram) {
        let arrived = Instant::now();
        self.recordings.since_sweep += 1;
        if self.recordings.since_sweep >= SWEEP_EVERY {
            self.sweep();
        }
        let mut batch = Batch::default();
        let mut batching = self.gpu.core.lost().is_none();
        for (i, op) in program.ops().enumerate() {
            if batching {
                match self.batch_op(&program, i, op, &mut batch, arrived) {
                    Ok(()) => continue,
                    Err(why) => tracing::trace!(seq = op.seq(), why, "replayed as a plan"),
                }
            }
            batching &= self.flush(&program, &mut batch);
            ReplayCounters::count(&self.backend.replays.as_plans);
            let backend = &self.backend;
            self.process(Submitted::of_op(op, |work| {
                Job::lower(
                    work,
                    |loc, bytes| backend.resolve(loc, bytes),
                    |_, _| Ok(()),
                )
            }));
        }
        self.flush(&program, &mut batch);
    }

    /// Adds operation `i` of `program` to `batch` (flushing what the batch held first where
    /// the operation waits for another stream), or says why it takes the plan path.
    fn batch_op(
        &mut self,
        program: &StreamProgram,
        i: usize,
        op: StreamProgramOp<'_>,
        batch: &mut Batch,
        arrived: Instant,
    ) -> Result<(), Slow> {
        let core = self.gpu.core.clone();
        let mut regions = gpu_stream::device_regions(
            op,
            self.last,
            |loc, bytes| self.backend.resolve(loc, bytes),
            |r: &Region| r.on_device(&core),
        )?;
        let waits = self.device_waits(program, op, batch)?;
        if !waits.is_empty() && !batch.ops.is_empty() {
            // Only the first operation of a batch waits for other streams.
            self.flush(program, batch);
        }
        let key = (Arc::as_ptr(program.step()) as usize, op.template());
        let values = op.bindings();
        let cb = match self.recordings.kept.get_mut(&key) {
            Some(r) if r.matches(&regions, values) => {
                r.used = op.seq();
                ReplayCounters::count(&self.backend.replays.resubmitted);
                batch
                    .keep
                    .extend(regions.drain(..).map(|r| Keep::Buffer(r.buffer)));
                batch.keep.extend(r.held.iter().cloned());
                r.cb
            }
            _ => self.record_op(program, op, key, &regions, batch)?,
        };
        batch.waits.extend(waits);
        batch.cbs.extend(cb);
        let trace = self.trace.start_op(op, arrived);
        batch.ops.push((i, op.seq(), trace));
        Ok(())
    }

    /// The waits of `op` on other streams of this device, as semaphore values; `Err` where
    /// a plan's semantics need more (a failed data dependency, another device, a stopped
    /// stream). Flushes `batch` before waiting for another stream to decide a number.
    fn device_waits(
        &mut self,
        program: &StreamProgram,
        op: StreamProgramOp<'_>,
        batch: &mut Batch,
    ) -> Result<DeviceWaits, Slow> {
        let mut waits = SmallVec::new();
        for dep in op.deps() {
            let (event, data) = (&dep.event, dep.kind == DepKind::Data);
            let failed = match event.status() {
                EventStatus::Done => continue,
                EventStatus::Failed(_) => true,
                EventStatus::Pending if SyncArc::ptr_eq(event.timeline(), &self.me.timeline) => {
                    // This stream's: ordered by the queue. A number decided already may
                    // have failed; a later one is in this batch, which does not fail.
                    event.seq() <= self.last
                        && matches!(self.me.decision(event.seq()), Decision::Failed(_))
                }
                EventStatus::Pending => {
                    let stream = self
                        .gpu
                        .stream_of(event.timeline())
                        .ok_or("waits for another device")?;
                    let decision = match stream.decided_now(event.seq()) {
                        Some(d) => d,
                        None => {
                            // Decide what this stream holds before waiting for another to
                            // decide: it may be waiting for this one.
                            self.flush(program, batch);
                            stream.decision(event.seq())
                        }
                    };
                    match decision {
                        Decision::Submitted => {
                            waits.push((stream, event.seq()));
                            false
                        }
                        Decision::Failed(_) => true,
                        Decision::Gone => return Err("waits for a stopped stream"),
                    }
                }
            };
            if failed && data {
                return Err("a data dependency failed");
            }
        }
        Ok(waits)
    }

    /// Records `op` for replays and keeps it under `key` (replacing what was kept there);
    /// adds what it uses to `batch`.
    fn record_op(
        &mut self,
        program: &StreamProgram,
        op: StreamProgramOp<'_>,
        key: (usize, u32),
        regions: &[Region],
        batch: &mut Batch,
    ) -> Result<Option<vk::CommandBuffer>, Slow> {
        let backend = self.backend.clone();
        let job = Job::lower(
            &op.to_work(),
            |loc, bytes| backend.resolve(loc, bytes),
            |_, _| Ok(()),
        )
        .map_err(|_| "does not lower")?;
        let mut keep = Vec::new();
        let cb = self
            .record_job(&job, &mut keep, Usage::Replayed)
            .map_err(|_| "does not record")?;
        let held = keep
            .iter()
            .filter(|k| match k {
                // Mutant: a recording holds none of the buffers its lowering made.
                Keep::Buffer(_) if mutant!("vulkan_unheld_scratch") => false,
                Keep::Buffer(b) => !regions.iter().any(|r| Arc::ptr_eq(&r.buffer, b)),
                _ => true,
            })
            .cloned()
            .collect();
        batch.keep.append(&mut keep);
        ReplayCounters::count(&self.backend.replays.recorded);
        let recording = Recording {
            step: Arc::downgrade(program.step()),
            cb,
            regions: regions
                .iter()
                .map(|r| (Arc::downgrade(&r.buffer), r.offset, r.bytes))
                .collect(),
            values: op.bindings().cloned(),
            held,
            used: op.seq(),
        };
        if !self.recordings.kept.contains_key(&key) && self.recordings.kept.len() >= KEPT {
            self.sweep();
        }
        if self.recordings.kept.contains_key(&key) || self.recordings.kept.len() < KEPT {
            if let Some(old) = self.recordings.kept.insert(key, recording) {
                self.retire(old);
            }
        } else {
            batch.once.extend(cb);
        }
        Ok(cb)
    }

    /// Forgets the recordings of dropped steps.
    fn sweep(&mut self) {
        self.recordings.since_sweep = 0;
        let dead: Vec<(usize, u32)> = self
            .recordings
            .kept
            .iter()
            .filter(|(_, r)| r.step.strong_count() == 0)
            .map(|(k, _)| *k)
            .collect();
        for key in dead {
            if let Some(r) = self.recordings.kept.remove(&key) {
                self.retire(r);
            }
        }
    }

    /// Frees `r`'s command buffer once the last batch that ran it completed.
    fn retire(&mut self, r: Recording) {
        if let Some(cb) = r.cb {
            // `reclaim` frees it once the semaphore reached `used` (an entry behind a later
            // one waits for that one too: later, never earlier).
            self.in_flight.push_back((r.used, cb));
        }
    }

    /// Submits `batch` as one batch and decides and reports its operations; empties it.
    /// `false` when the submission failed (the device is lost: its operations failed).
    fn flush(&mut self, program: &StreamProgram, batch: &mut Batch) -> bool {
        let Some(&(_, last, _)) = batch.ops.last() else {
            return true;
        };
        let sem_waits: SmallVec<[(vk::Semaphore, u64); 4]> =
            batch.waits.iter().map(|(s, v)| (s.semaphore, *v)).collect();
        batch
            .keep
            .extend(batch.waits.drain(..).map(|(s, _)| Keep::Stream(s)));
        let submitted = self.submit_batch(&batch.cbs, &sem_waits, last);
        batch.cbs.clear();
        let n = batch.ops.len();
        match submitted {
            Ok(()) => {
                for cb in batch.once.drain(..) {
                    self.in_flight.push_back((last, cb));
                }
                self.last = last;
                self.me.decide(last, None);
                for (k, (_, seq, trace)) in batch.ops.drain(..).enumerate() {
                    // The batch's last report holds what the batch uses.
                    let keep = if k + 1 == n {
                        std::mem::take(&mut batch.keep)
                    } else {
                        Vec::new()
                    };
                    self.report(seq, Ok(()), true, keep, trace);
                }
                true
            }
            Err(e) => {
                self.gpu.core.mark_lost(&e.to_string());
                self.free.extend(batch.once.drain(..));
                for (i, seq, _) in batch.ops.drain(..) {
                    let operation = program.op(i).map(|op| op.work().label());
                    let f = Arc::new(Failure {
                        stream: self.me.id,
                        seq,
                        operation: operation.unwrap_or_default(),
                        message: format!("cannot submit: {e}"),
                    });
                    self.me.decide(seq, Some(f.clone()));
                    self.report(seq, Err(f), false, std::mem::take(&mut batch.keep), None);
                }
                false
            }
        }
    }
}
