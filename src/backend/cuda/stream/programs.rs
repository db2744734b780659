//! A replay's program on a CUDA stream: CUDA graphs captured once and launched again. See
//! DESIGN.md §5, "CUDA" and §4, "Compiled replays".
//!
//! Issuing an operation lowers its work, looks up its function, enqueues its launch and
//! records an event after it. A replayed step runs the same templates over the same pools
//! every time, so consecutive operations of a program that wait for no other stream form a
//! *batch*, and the first replay of a batch captures its launches, memsets and copies into
//! a CUDA graph (stream capture, thread-local mode: nothing but stream work inside it; every
//! module is loaded before the capture begins) and instantiates it. The executable graph is
//! kept by (step, first template, length) with, per operation, the pools (weakly), offsets
//! and sizes it was captured over and its index values; a later replay whose batch resolves
//! to the same ones launches it (one `cuGraphLaunch` for the whole batch), after the batch's
//! waits for other streams, then records one event, which every operation of the batch is
//! decided and completed by.
//!
//! A replay with other regions or values (Task Bench's replays carry a new timestep, a new
//! kernel parameter, every time) captures the batch again into a new graph and gives the
//! kept executable graph its parameters in place (`cuGraphExecUpdate`); only when the driver
//! refuses the update (the topology changed) is the new graph instantiated. Instantiating
//! costs far more than capturing, and capturing and instantiating on every replay is what
//! an H100 run showed before this. A batch of one operation runs as a plan: as a graph it
//! launches no faster.
//!
//! What is not plain device work takes the plan path, one operation at a time, with a
//! plan's semantics: host transfers, staged or peer copies, operations failing without
//! running, operations whose data dependency failed or lies on another device or a stopped
//! stream, a lost device; so does a batch whose capture failed (and that batch's key from
//! then on). The replay tests that cover it (`tests/engine/replay_backends.rs`, the
//! data-parallel replay, the random programs on CUDA) skip without a GPU and run in
//! `scripts/gpu-check.sh`; `CudaConfig::replay_graphs = false` runs every replay as plans.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Weak},
    time::Instant,
};

use cudarc::driver::{result, sys, CudaContext, CudaModule, DriverError};
use smallvec::SmallVec;

use super::{driver_error, Completion, Decision, Job, Keep, Submitted, Submitter, Watch};
use crate::{
    backend::{
        cuda::{
            events::SharedEvent,
            launch::lower,
            memory::{CopyRoute, DevicePool, Region},
        },
        gpu_stream,
        recording::OpTrace,
    },
    error::Failure,
    event::EventStatus,
    kernels::Bindings,
    protocol::{DepKind, DeviceStep, StreamProgram, StreamProgramOp},
    sync::Arc as SyncArc,
};

/// Graphs a stream keeps at most; past it (after a sweep) a batch runs as plans.
const KEPT: usize = 1024;

/// Programs run between two sweeps of the graphs of dropped steps.
const SWEEP_EVERY: u32 = 1024;

/// A batch's identity: its step's address, its first template, its length.
type GraphKey = (usize, u32, u32);

/// The graphs a stream captured for replays.
#[derive(Default)]
pub(super) struct Graphs {
    kept: HashMap<GraphKey, Captured>,
    /// Batches whose capture failed: they run as plans.
    refused: HashSet<GraphKey>,
    since_sweep: u32,
}

/// A captured graph, not instantiated: the parameters a kept executable graph is updated
/// with, or what a new one is instantiated from. Destroyed when dropped.
struct CapturedGraph {
    graph: sys::CUgraph,
    ctx: Arc<CudaContext>,
}

impl CapturedGraph {
    /// Instantiates it.
    fn instantiate(&self) -> Result<GraphExec, DriverError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `graph` is a live graph this value owns (ended capture, not destroyed);
        // the executable graph made from it is independent of it and owned by the result.
        let exec =
            unsafe { result::graph::instantiate(self.graph, sys::CUgraphInstantiate_flags(0)) }?;
        Ok(GraphExec {
            exec,
            ctx: self.ctx.clone(),
        })
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: owned by this value, destroyed once; an executable graph instantiated from
        // it or updated with it does not refer to it afterwards.
        let _ = unsafe { result::graph::destroy(self.graph) };
    }
}

/// An executable graph as the submit thread keeps it: instantiated once, given the
/// parameters of later captures of its batch in place while the driver accepts them.
struct GraphExec {
    exec: sys::CUgraphExec,
    ctx: Arc<CudaContext>,
}

impl GraphExec {
    /// Enqueues one launch of it on `stream` (of its context).
    fn launch(&self, stream: &cudarc::driver::CudaStream) -> Result<(), DriverError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `exec` is live (owned by this value) and was made in the stream's context;
        // what its nodes use is held by the batch that launches it until it completed.
        unsafe { result::graph::launch(self.exec, stream.cu_stream()) }
    }

    /// Gives it the parameters of `graph` (a new capture of the same batch) in place
    /// (`cuGraphExecUpdate`); `false` when the driver refuses (the topology changed, or any
    /// error): the caller instantiates `graph` instead.
    fn update(&self, graph: &CapturedGraph) -> bool {
        if self.ctx.bind_to_thread().is_err() {
            return false;
        }
        let mut info = sys::CUgraphExecUpdateResultInfo {
            result: sys::CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR,
            errorNode: std::ptr::null_mut(),
            errorFromNode: std::ptr::null_mut(),
        };
        // SAFETY: both handles are live and of this context, `info` outlives the call. An
        // update takes effect at the next launch: launches enqueued before it run with the
        // parameters they were launched with (their batches hold what those name). Only
        // this stream's submit thread touches the executable graph, so no launch of it runs
        // concurrently with the call.
        let r = unsafe { sys::cuGraphExecUpdate_v2(self.exec, graph.graph, &mut info) };
        r == sys::CUresult::CUDA_SUCCESS
            && info.result == sys::CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_SUCCESS
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: owned by this value and destroyed once, never launched after; one still
        // in flight is freed by CUDA once its launches completed.
        let _ = unsafe { result::graph::exec_destroy(self.exec) };
    }
}

// SAFETY: a graph and an executable graph must not be used from two threads at once. These
// are created, updated, launched and dropped by the submit thread of their stream only
// (they live in the thread's `Submitter`, which is moved to the thread before any graph
// exists); moving them between threads is allowed.
unsafe impl Send for CapturedGraph {}
// SAFETY: as for `CapturedGraph`.
unsafe impl Send for GraphExec {}

/// What one operation of a graph was captured over: its regions (pool weakly, offset,
/// bytes) and its index values.
type CapturedOp = (
    SmallVec<[(Weak<DevicePool>, u64, u64); 4]>,
    Option<Bindings>,
);

/// One batch's graph and what it was captured over.
struct Captured {
    /// The step: while it is held (weakly), no other step takes its address.
    step: Weak<DeviceStep>,
    exec: GraphExec,
    /// Per operation, its regions in [`gpu_stream::device_locations`] order (pool weakly,
    /// offset, bytes) and its index values.
    ops: Vec<CapturedOp>,
    /// The modules its kernel nodes run functions of.
    modules: Vec<Arc<CudaModule>>,
}

impl Captured {
    /// Whether it runs `batch`'s operations over the same regions with the same values.
    fn matches(&self, program: &StreamProgram, batch: &Batch) -> bool {
        self.ops.len() == batch.ops.len()
            && self
                .ops
                .iter()
                .zip(&batch.ops)
                .all(|((regions, values), op)| {
                    let now = program.op(op.index).and_then(|o| o.bindings());
                    regions.len() == op.regions.len()
                        && regions
                            .iter()
                            .zip(&op.regions)
                            .all(|((p, offset, bytes), r)| {
                                std::ptr::eq(p.as_ptr(), Arc::as_ptr(&r.pool))
                                    && *offset == r.offset
                                    && *bytes == r.bytes
                            })
                        && match (values, now) {
                            (Some(a), Some(b)) => a.same_values(b),
                            (None, None) => true,
                            _ => false,
                        }
                })
    }
}

/// One operation of a batch.
struct BatchOp {
    /// Its index in the program.
    index: usize,
    seq: u64,
    /// Its locations, resolved (held until the batch completes).
    regions: SmallVec<[Region; 4]>,
    trace: Option<OpTrace>,
}

/// Consecutive operations of a program that run as one graph.
#[derive(Default)]
struct Batch {
    ops: SmallVec<[BatchOp; 16]>,
    /// Events of other streams of the device to wait for first.
    waits: SmallVec<[SharedEvent; 4]>,
}

/// Why an operation takes the plan path (kept for the debug log).
type Slow = gpu_stream::AsPlan;

/// How a batch ended.
enum Flushed {
    /// Launched, decided and handed to the watcher.
    Launched,
    /// Not launched: its operations are to run as plans.
    AsPlans,
    /// The device is lost: its operations failed.
    Lost,
}

impl Submitter {
    /// Runs `program`: its operations in order, batched into graphs where they can be, one
    /// by one as plans where they cannot.
    pub(super) fn run_program(&mut self, program: StreamProgram) {
        let arrived = Instant::now();
        self.graphs.since_sweep += 1;
        if self.graphs.since_sweep >= SWEEP_EVERY {
            self.sweep();
        }
        let mut batch = Batch::default();
        let mut batching = self.backend.config.replay_graphs && self.gpu.lost().is_none();
        for (i, op) in program.ops().enumerate() {
            if batching {
                match self.batch_op(&program, i, op, &mut batch, arrived) {
                    Ok(()) => continue,
                    Err(why) => tracing::trace!(seq = op.seq(), why, "replayed as a plan"),
                }
            }
            batching &= !matches!(self.flush(&program, &mut batch), Flushed::Lost);
            self.process(self.plan_of(op));
        }
        self.flush(&program, &mut batch);
    }

    /// `op` as a plan (what the plan path takes).
    fn plan_of(&self, op: StreamProgramOp<'_>) -> Submitted {
        let backend = &self.backend;
        Submitted::of_op(op, |work| {
            Job::lower(
                work,
                |loc, bytes| backend.resolve(loc, bytes),
                |src, dst| {
                    backend.route(src, dst).ok_or_else(|| {
                        format!(
                            "a copy between {src} and {dst}, not both CUDA devices of this backend"
                        )
                    })
                },
            )
        })
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
        let regions = gpu_stream::device_regions(
            op,
            self.last,
            |loc, bytes| self.backend.resolve(loc, bytes),
            |r| self.local(r),
        )?;
        let waits = self.device_waits(program, op, batch)?;
        if !waits.is_empty() && !batch.ops.is_empty() {
            // Only the first operation of a batch waits for other streams. A batch that ran
            // as plans (one operation, or refused) decided its operations all the same.
            if matches!(self.flush(program, batch), Flushed::Lost) {
                return Err("the device is lost");
            }
        }
        batch.waits.extend(waits);
        let trace = self.trace.start_op(op, arrived);
        batch.ops.push(BatchOp {
            index: i,
            seq: op.seq(),
            regions,
            trace,
        });
        Ok(())
    }

    /// The events of other streams of this device `op` waits for; `Err` where a plan's
    /// semantics need more (a failed data dependency, another device, a stopped stream).
    /// Flushes `batch` before waiting for another stream to decide a number.
    fn device_waits(
        &mut self,
        program: &StreamProgram,
        op: StreamProgramOp<'_>,
        batch: &mut Batch,
    ) -> Result<SmallVec<[SharedEvent; 4]>, Slow> {
        let mut waits = SmallVec::new();
        for dep in op.deps() {
            let (event, data) = (&dep.event, dep.kind == DepKind::Data);
            let failed = match event.status() {
                EventStatus::Done => continue,
                EventStatus::Failed(_) => true,
                EventStatus::Pending if SyncArc::ptr_eq(event.timeline(), &self.me.timeline) => {
                    // This stream's: ordered by the stream. A number decided already may
                    // have failed; a later one is in this batch, which does not fail.
                    event.seq() <= self.last
                        && match self.me.decision(event.seq()) {
                            Decision::Recorded { failure, .. } => failure.is_some(),
                            Decision::Failed(_) => true,
                            Decision::Completed | Decision::Gone => {
                                matches!(event.status(), EventStatus::Failed(_))
                            }
                        }
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
                            // decide: it may be waiting for this one (as a graph or as
                            // plans, the batch's operations are decided after the flush).
                            if matches!(self.flush(program, batch), Flushed::Lost) {
                                return Err("the device is lost");
                            }
                            stream.decision(event.seq())
                        }
                    };
                    match decision {
                        Decision::Recorded { event, failure } => {
                            waits.push(event);
                            failure.is_some()
                        }
                        Decision::Failed(_) => true,
                        Decision::Completed => matches!(event.status(), EventStatus::Failed(_)),
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

    /// Runs `batch` (its graph, captured first if needed) and decides and completes its
    /// operations; empties it. A batch that cannot be launched runs as plans, here.
    fn flush(&mut self, program: &StreamProgram, batch: &mut Batch) -> Flushed {
        let Some(first) = batch.ops.first() else {
            return Flushed::Launched;
        };
        let template = program.op(first.index).map_or(u32::MAX, |op| op.template());
        let key = (
            Arc::as_ptr(program.step()) as usize,
            template,
            batch.ops.len() as u32,
        );
        let mut keep: Vec<Keep> = Vec::new();
        let flushed = self.launch_batch(program, batch, key, &mut keep);
        let ops = std::mem::take(&mut batch.ops);
        batch.waits.clear();
        match flushed {
            Ok(()) => {}
            Err(Flushed::AsPlans) => {
                for op in ops {
                    if let Some(o) = program.op(op.index) {
                        self.process(self.plan_of(o));
                    }
                }
                return Flushed::AsPlans;
            }
            Err(_) => {
                self.fail_lost(program, ops, keep);
                return Flushed::Lost;
            }
        }
        let recorded = self
            .gpu
            .events
            .acquire()
            .and_then(|ev| ev.record(&self.stream).map(|()| ev).map_err(driver_error));
        let event = match recorded {
            Ok(ev) => Arc::new(ev),
            Err(e) => {
                self.gpu.mark_lost(&format!("cuEventRecord: {e}"));
                self.fail_lost(program, ops, keep);
                return Flushed::Lost;
            }
        };
        let n = ops.len();
        for (k, op) in ops.into_iter().enumerate() {
            self.last = op.seq;
            self.me.decide(
                op.seq,
                Decision::Recorded {
                    event: event.clone(),
                    failure: None,
                },
            );
            let mut held: Vec<Keep> = op.regions.into_iter().map(|r| Keep::Pool(r.pool)).collect();
            if k + 1 == n {
                held.append(&mut keep);
            }
            self.send(Watch {
                event: Some(event.clone()),
                complete: Some(Completion {
                    seq: op.seq,
                    outcome: Ok(()),
                    label: label_of(program, op.index),
                    trace: op.trace,
                }),
                keep: held,
                ..Watch::default()
            });
        }
        Flushed::Launched
    }

    /// Enqueues the batch's waits, then launches its graph (capturing it first unless a
    /// kept one matches); what the launch uses goes to `keep`. `Err(Flushed::AsPlans)`:
    /// nothing of the batch was launched; `Err(Flushed::Lost)`: the device is lost.
    fn launch_batch(
        &mut self,
        program: &StreamProgram,
        batch: &Batch,
        key: GraphKey,
        keep: &mut Vec<Keep>,
    ) -> Result<(), Flushed> {
        // One operation launches no faster as a graph than as a plan.
        if batch.ops.len() < 2 || self.graphs.refused.contains(&key) {
            return Err(Flushed::AsPlans);
        }
        let hit = self
            .graphs
            .kept
            .get(&key)
            .is_some_and(|c| c.matches(program, batch));
        if !hit {
            self.capture(program, batch, key)?;
        }
        let Some(captured) = self.graphs.kept.get(&key) else {
            return Err(Flushed::AsPlans);
        };
        for event in &batch.waits {
            if let Err(e) = self.stream.wait(event) {
                self.gpu
                    .mark_lost(&format!("cuStreamWaitEvent: {}", driver_error(e)));
                return Err(Flushed::Lost);
            }
            keep.push(Keep::Event(event.clone()));
        }
        keep.extend(captured.modules.iter().cloned().map(Keep::Module));
        if let Err(e) = captured.exec.launch(&self.stream) {
            self.gpu
                .mark_lost(&format!("cuGraphLaunch: {}", driver_error(e)));
            return Err(Flushed::Lost);
        }
        Ok(())
    }

    /// Captures `batch` into a graph and keeps its executable graph under `key`: the one
    /// kept there already, updated in place with the new capture's parameters, where the
    /// driver accepts that; a new instantiation otherwise. `Err(Flushed::AsPlans)` when it
    /// cannot be captured (the key then runs as plans).
    fn capture(
        &mut self,
        program: &StreamProgram,
        batch: &Batch,
        key: GraphKey,
    ) -> Result<(), Flushed> {
        let refuse = |s: &mut Submitter, why: String| {
            tracing::debug!(%why, "a replay's batch runs as plans");
            s.graphs.refused.insert(key);
            s.graphs.kept.remove(&key);
            Flushed::AsPlans
        };
        // Everything that is not stream work happens before the capture: lowering, module
        // loads, function lookups.
        let mut jobs = Vec::with_capacity(batch.ops.len());
        let mut modules: Vec<Arc<CudaModule>> = Vec::new();
        for op in &batch.ops {
            let Some(o) = program.op(op.index) else {
                return Err(refuse(self, "an operation outside its program".into()));
            };
            let job = match self.plan_of(o).job {
                Ok(job) => job,
                Err(why) => return Err(refuse(self, why)),
            };
            match &job {
                Job::Run {
                    kernel,
                    args,
                    merge,
                    bindings,
                } => {
                    let launches = match lower(kernel, args, merge.as_ref(), bindings, &self.gpu) {
                        Ok(l) => l,
                        Err(why) => return Err(refuse(self, why)),
                    };
                    for l in &launches {
                        match self.function(&l.program, &l.entry_point) {
                            Ok((module, _)) => modules.push(module),
                            Err(why) => return Err(refuse(self, why)),
                        }
                    }
                }
                Job::Copy {
                    route: CopyRoute::Direct,
                    ..
                }
                | Job::Memset { .. }
                | Job::Marker => {}
                _ => return Err(refuse(self, "not device work".into())),
            }
            jobs.push(job);
        }
        if let Err(why) = self.bind() {
            return Err(refuse(self, why));
        }
        if let Err(e) = self
            .stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        {
            return Err(refuse(
                self,
                format!("cuStreamBeginCapture: {}", driver_error(e)),
            ));
        }
        // What the captured work uses is held by the graph's batches (their regions and
        // modules); this list only collects it.
        let mut captured_keep = Vec::new();
        let enqueued = jobs
            .iter()
            .try_for_each(|job| self.execute(job, &mut captured_keep));
        // Ends the capture whatever happened inside it (an error invalidates it).
        let ended = self.end_capture();
        let graph = match (enqueued, ended) {
            (Ok(()), Ok(Some(graph))) => graph,
            (Err(why), _) => return Err(refuse(self, why)),
            (Ok(()), Ok(None)) => return Err(refuse(self, "an empty capture".into())),
            (Ok(()), Err(e)) => {
                return Err(refuse(
                    self,
                    format!("cuStreamEndCapture: {}", driver_error(e)),
                ))
            }
        };
        if !self.graphs.kept.contains_key(&key) && self.graphs.kept.len() >= KEPT {
            self.sweep();
            if self.graphs.kept.len() >= KEPT {
                return Err(Flushed::AsPlans);
            }
        }
        // The kept executable graph takes the new parameters if the driver lets it; a new
        // one is instantiated otherwise. A graph replaced here may still run: its exec is
        // freed once it completed (CUDA frees an in-flight graph exec asynchronously), and
        // its batches hold its pools and modules until then.
        let exec = match self.graphs.kept.remove(&key) {
            Some(kept) if kept.exec.update(&graph) => kept.exec,
            _ => match graph.instantiate() {
                Ok(exec) => exec,
                Err(e) => {
                    return Err(refuse(
                        self,
                        format!("cuGraphInstantiate: {}", driver_error(e)),
                    ))
                }
            },
        };
        drop(graph);
        modules.dedup_by(|a, b| Arc::ptr_eq(a, b));
        let ops = batch
            .ops
            .iter()
            .map(|op| {
                (
                    op.regions
                        .iter()
                        .map(|r| (Arc::downgrade(&r.pool), r.offset, r.bytes))
                        .collect(),
                    program.op(op.index).and_then(|o| o.bindings()).cloned(),
                )
            })
            .collect();
        self.graphs.kept.insert(
            key,
            Captured {
                step: Arc::downgrade(program.step()),
                exec,
                ops,
                modules,
            },
        );
        Ok(())
    }

    /// Ends the stream's capture (begun on this thread): the graph captured, if any.
    fn end_capture(&self) -> Result<Option<CapturedGraph>, DriverError> {
        // An error binding shows in ending the capture too.
        let _ = self.gpu.ctx.bind_to_thread();
        // SAFETY: the stream is this submitter's, alive, and capturing in thread-local mode
        // (begun on this thread); the graph returned is owned by the result.
        let graph = unsafe { result::stream::end_capture(self.stream.cu_stream()) }?;
        Ok((!graph.is_null()).then(|| CapturedGraph {
            graph,
            ctx: self.gpu.ctx.clone(),
        }))
    }

    /// Fails the operations of a batch on a lost device, in order.
    fn fail_lost(
        &mut self,
        program: &StreamProgram,
        ops: SmallVec<[BatchOp; 16]>,
        keep: Vec<Keep>,
    ) {
        let cause = self.gpu.lost().unwrap_or_else(|| "unknown".into());
        let mut keep = Some(keep);
        for op in ops {
            self.last = op.seq;
            let f = Arc::new(Failure {
                stream: self.me.id,
                seq: op.seq,
                operation: label_of(program, op.index),
                message: format!("device lost: {cause}"),
            });
            self.me.decide(op.seq, Decision::Failed(f.clone()));
            self.send(Watch {
                complete: Some(Completion {
                    seq: op.seq,
                    outcome: Err(f),
                    label: label_of(program, op.index),
                    trace: op.trace,
                }),
                keep: keep.take().unwrap_or_default(),
                ..Watch::default()
            });
        }
    }

    /// Forgets the graphs of dropped steps.
    fn sweep(&mut self) {
        self.graphs.since_sweep = 0;
        self.graphs.kept.retain(|_, c| c.step.strong_count() > 0);
        self.graphs.refused.clear();
    }
}

/// The label of operation `index` of `program`.
fn label_of(program: &StreamProgram, index: usize) -> String {
    program
        .op(index)
        .map(|op| op.work().label())
        .unwrap_or_default()
}
