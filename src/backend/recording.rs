//! Timeline recording of the GPU streams of Vulkan and CUDA, for [`crate::trace`]. The submit
//! thread notes when it starts an operation and records the waits it does on the host. The
//! completion thread, when it sees the operation complete, records its work and the waits the
//! GPU did on other streams of the device. [`crate::trace`] says what the timestamps mean on
//! a GPU.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    error::Result,
    event::Event,
    ids::StreamId,
    protocol::Dep,
    trace::{Recorder, TraceKind, TraceRecord},
};

/// How long the completion thread waits for the producer of a dependency to be *seen*
/// complete (it is complete on the GPU already: the operation waited for it). Past it the
/// wait is not drawn; the operation is recorded all the same.
const PRODUCER_SEEN_WITHIN: Duration = Duration::from_secs(5);

/// What the completion thread needs to record one operation.
pub(super) struct OpTrace {
    label: String,
    seq: u64,
    /// When the submit thread took it from the queue.
    arrived: Instant,
    /// When the submit thread started recording (or running) it.
    started: Instant,
    /// Its dependencies on other streams.
    deps: Vec<Event>,
    bytes: u64,
}

/// One stream's recording: nothing when the backend records no timeline.
#[derive(Clone)]
pub(super) struct StreamTrace {
    recorder: Option<Arc<Recorder>>,
    stream: StreamId,
}

impl StreamTrace {
    pub(super) fn new(recorder: Option<Arc<Recorder>>, stream: StreamId) -> StreamTrace {
        StreamTrace { recorder, stream }
    }

    /// Submit thread: [`StreamTrace::start`] for an operation of a replay's program (its
    /// label made only when a timeline is recorded).
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
    pub(super) fn start_op(
        &self,
        op: crate::protocol::StreamProgramOp<'_>,
        arrived: Instant,
    ) -> Option<OpTrace> {
        self.recorder.as_ref()?;
        let work = op.work();
        self.start(op.seq(), &work.label(), op.deps(), work.bytes(), arrived)
    }

    /// Submit thread: waits on the host for `dep` (an event of another device), recording
    /// the wait when it blocks.
    pub(super) fn host_wait(&self, dep: &Dep, label: &str, seq: u64) -> Result<()> {
        let Some(rec) = self.recorder.as_deref().filter(|_| !dep.event.is_done()) else {
            return dep.event.wait();
        };
        let since = Instant::now();
        let outcome = dep.event.wait();
        rec.record(TraceRecord {
            kind: TraceKind::Wait,
            name: label.to_string(),
            stream: self.stream,
            seq,
            start_ns: rec.ns(since),
            end_ns: rec.ns(Instant::now()),
            bytes: 0,
            waited_for: Some((dep.event.stream(), dep.event.seq())),
            after: Vec::new(),
            ok: outcome.is_ok(),
        });
        outcome
    }

    /// Submit thread: operation `seq`, taken from the queue at `arrived`, starts now
    /// (`None` when not recording).
    pub(super) fn start(
        &self,
        seq: u64,
        label: &str,
        deps: &[Dep],
        bytes: u64,
        arrived: Instant,
    ) -> Option<OpTrace> {
        self.recorder.as_ref()?;
        let mut deps: Vec<Event> = deps
            .iter()
            .filter(|d| d.event.stream() != self.stream)
            .map(|d| d.event.clone())
            .collect();
        deps.sort_unstable_by_key(|e| (e.stream(), e.seq()));
        deps.dedup_by_key(|e| (e.stream(), e.seq()));
        Some(OpTrace {
            label: label.to_string(),
            seq,
            arrived,
            started: Instant::now(),
            deps,
            bytes,
        })
    }

    /// The completion thread's side.
    pub(super) fn completions(&self) -> CompletionTrace {
        CompletionTrace {
            trace: self.clone(),
            previous_end: 0,
        }
    }
}

/// The completion thread's recording: remembers when it saw the previous operation end.
pub(super) struct CompletionTrace {
    trace: StreamTrace,
    previous_end: u64,
}

impl CompletionTrace {
    /// Records `op`, just seen complete (before its event is signalled, so that whoever
    /// sees the event done finds the record).
    pub(super) fn completed(&mut self, op: OpTrace, ok: bool) {
        let Some(rec) = self.trace.recorder.as_deref() else {
            return;
        };
        let stream = self.trace.stream;
        // The stream was ready for `op` once the submit thread had it and its predecessor
        // was done; from then on it waited for the streams `op` depends on (for their submit
        // threads to submit, then for the GPU). Waits on other devices happened on the
        // submit thread, which recorded them.
        let ready = rec.ns(op.arrived).max(self.previous_end);
        let mut start = rec.ns(op.started).max(self.previous_end);
        for dep in &op.deps {
            // Done on the GPU already; its completion thread records it before signalling.
            let seen = dep.wait_timeout(PRODUCER_SEEN_WITHIN);
            let Some(end) = rec.work_end(dep.stream(), dep.seq()) else {
                continue;
            };
            if end > ready && dep.stream().device == stream.device {
                rec.record(TraceRecord {
                    kind: TraceKind::Wait,
                    name: op.label.clone(),
                    stream,
                    seq: op.seq,
                    start_ns: ready,
                    end_ns: end,
                    bytes: 0,
                    waited_for: Some((dep.stream(), dep.seq())),
                    after: Vec::new(),
                    ok: seen.is_ok(),
                });
            }
            start = start.max(end);
        }
        let end = rec.ns(Instant::now()).max(start);
        let after = op.deps.iter().map(|e| (e.stream(), e.seq())).collect();
        rec.record(TraceRecord {
            kind: TraceKind::Work,
            name: op.label,
            stream,
            seq: op.seq,
            start_ns: start,
            end_ns: end,
            bytes: op.bytes,
            waited_for: None,
            after,
            ok,
        });
        self.previous_end = end;
    }
}
