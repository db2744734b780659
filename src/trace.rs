//! Stream timelines: an optional recorder of every operation and wait, exported in the
//! Chrome trace / Perfetto JSON format.
//!
//! Backends record, per stream, when each operation's work ran and when the stream waited
//! for an event of another stream (and which). Loaded in a trace viewer
//! (`chrome://tracing`, <https://ui.perfetto.dev>), devices are processes and streams are
//! threads, so parallel streams and the waits between them are visible at a glance.
//! When no recorder is installed the cost is one branch per operation.

use std::{
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use serde::Serialize;

use crate::ids::StreamId;

/// What a record describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum TraceKind {
    /// An operation's work (routine, copy, transfer, memset).
    Work,
    /// A stream blocked on another stream's event before an operation.
    Wait,
}

/// One interval on one stream.
#[derive(Clone, Debug, Serialize)]
pub struct TraceRecord {
    /// Work or wait.
    pub kind: TraceKind,
    /// Routine name or operation label.
    pub name: String,
    /// The stream.
    pub stream: StreamId,
    /// The operation's sequence number on `stream`.
    pub seq: u64,
    /// Start, in nanoseconds since the recorder was created.
    pub start_ns: u64,
    /// End, in nanoseconds since the recorder was created.
    pub end_ns: u64,
    /// Bytes the work touched (0 for waits).
    pub bytes: u64,
    /// For a wait: the event waited for.
    pub waited_for: Option<(StreamId, u64)>,
    /// Whether the work succeeded (a wait: whether the awaited event succeeded).
    pub ok: bool,
}

/// Collects [`TraceRecord`]s from every stream.
#[derive(Debug)]
pub struct Recorder {
    origin: Instant,
    records: Mutex<Vec<TraceRecord>>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            origin: Instant::now(),
            records: Mutex::new(Vec::new()),
        }
    }
}

impl Recorder {
    /// A recorder whose clock starts now.
    pub fn new() -> Recorder {
        Recorder::default()
    }

    /// Nanoseconds since the recorder was created.
    pub fn ns(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.origin).as_nanos() as u64
    }

    /// Adds a record.
    pub fn record(&self, r: TraceRecord) {
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(r);
    }

    /// A copy of every record so far.
    pub fn records(&self) -> Vec<TraceRecord> {
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Checks that the timeline is consistent: every record ends after it starts, and every
    /// wait ends no earlier than the end of the work it waited for (when that work was
    /// recorded). Returns the first violation.
    pub fn check(&self) -> Result<(), String> {
        let records = self.records();
        let mut work_end = std::collections::HashMap::new();
        for r in &records {
            if r.end_ns < r.start_ns {
                return Err(format!("{} on {} ends before it starts", r.name, r.stream));
            }
            if r.kind == TraceKind::Work {
                work_end.insert((r.stream, r.seq), r.end_ns);
            }
        }
        for r in records.iter().filter(|r| r.kind == TraceKind::Wait) {
            if let Some(target) = r.waited_for {
                if let Some(&end) = work_end.get(&target) {
                    if r.end_ns < end {
                        return Err(format!(
                            "{}#{} stopped waiting for {}#{} at {} ns, before it ended at {} ns",
                            r.stream, r.seq, target.0, target.1, r.end_ns, end
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The timeline in the Chrome trace event format (a JSON object with `traceEvents`).
    pub fn chrome_trace(&self) -> serde_json::Value {
        let records = self.records();
        let mut events = Vec::with_capacity(records.len() + 8);
        let mut named = std::collections::BTreeSet::new();
        for r in &records {
            if named.insert(r.stream) {
                events.push(serde_json::json!({
                    "name": "process_name", "ph": "M", "pid": r.stream.device.0,
                    "args": { "name": format!("device {}", r.stream.device.0) }
                }));
                events.push(serde_json::json!({
                    "name": "thread_name", "ph": "M", "pid": r.stream.device.0, "tid": r.stream.index,
                    "args": { "name": format!("stream {}", r.stream) }
                }));
            }
            let mut args = serde_json::json!({ "seq": r.seq, "bytes": r.bytes, "ok": r.ok });
            if let Some((s, seq)) = r.waited_for {
                args["waited_for"] = serde_json::json!(format!("{s}#{seq}"));
            }
            events.push(serde_json::json!({
                "name": if r.kind == TraceKind::Wait { format!("wait {}", r.name) } else { r.name.clone() },
                "cat": if r.kind == TraceKind::Wait { "wait" } else { "work" },
                "ph": "X",
                "pid": r.stream.device.0,
                "tid": r.stream.index,
                "ts": r.start_ns as f64 / 1e3,
                "dur": (r.end_ns - r.start_ns) as f64 / 1e3,
                "args": args,
            }));
        }
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ns" })
    }

    /// Writes [`Recorder::chrome_trace`] to `path`.
    pub fn write_chrome_trace(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        let text = serde_json::to_vec(&self.chrome_trace()).map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }

    /// Total recorded work time per stream (for utilisation figures).
    pub fn busy(&self) -> Vec<(StreamId, Duration)> {
        let mut map = std::collections::BTreeMap::new();
        for r in self.records() {
            if r.kind == TraceKind::Work {
                *map.entry(r.stream).or_insert(0u64) += r.end_ns - r.start_ns;
            }
        }
        map.into_iter()
            .map(|(s, ns)| (s, Duration::from_nanos(ns)))
            .collect()
    }
}
