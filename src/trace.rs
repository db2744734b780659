//! Stream timelines: an optional recorder of every operation and wait. It exports the Chrome
//! trace / Perfetto JSON format and sums up each stream's time. DESIGN.md §6, "Timelines",
//! says what each backend's spans mean.
//!
//! Backends record, per stream, when each operation ran, which operations of other streams it
//! was ordered after, and when it waited for another stream. All times are host clock
//! readings, taken with [`Instant`], in nanoseconds since the recorder was created. In a
//! viewer such as `chrome://tracing` or <https://ui.perfetto.dev>, devices are processes and
//! streams are threads. Each cross-stream dependency is a flow arrow from its producer to the
//! wait it released. [`Recorder::summary`] splits each stream's time into busy, waiting and
//! idle. Without a recorder the cost is one branch per operation.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
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
    /// For work: the operations of other streams it was ordered after (its cross-stream
    /// dependencies as the protocol emitted them; empty for waits).
    pub after: Vec<(StreamId, u64)>,
    /// Whether the work succeeded (a wait: whether the awaited event succeeded).
    pub ok: bool,
}

/// A span of the host's own work, beside the streams' records: the automatic replay marks
/// each replay of calls it held this way (DESIGN.md §4, "Automatic replay").
#[derive(Clone, Debug, Serialize)]
pub struct HostMark {
    /// What happened ("replayed 32 calls of step 7").
    pub name: String,
    /// Start, in nanoseconds since the recorder was created (the first held call).
    pub start_ns: u64,
    /// End, in nanoseconds since the recorder was created (the replay posted).
    pub end_ns: u64,
}

/// The process id host marks take in a Chrome trace (devices take their ids).
pub const HOST_TRACE_PID: u64 = 1 << 20;

/// The records and an index of when each operation's work ended.
#[derive(Debug, Default)]
struct Records {
    all: Vec<TraceRecord>,
    work_end: HashMap<(StreamId, u64), u64>,
    marks: Vec<HostMark>,
}

/// Collects [`TraceRecord`]s from every stream.
#[derive(Debug)]
pub struct Recorder {
    origin: Instant,
    records: Mutex<Records>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            origin: Instant::now(),
            records: Mutex::new(Records::default()),
        }
    }
}

/// One dependency drawn as a flow arrow: from the producer's work record to the
/// consumer's wait record (or work record, when it did not wait). Indices into the
/// records.
struct Flow {
    producer: usize,
    target: usize,
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

    fn lock(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a record.
    pub fn record(&self, r: TraceRecord) {
        let mut records = self.lock();
        if r.kind == TraceKind::Work {
            records.work_end.insert((r.stream, r.seq), r.end_ns);
        }
        records.all.push(r);
    }

    /// Adds a mark of the host's work.
    pub fn mark(&self, m: HostMark) {
        self.lock().marks.push(m);
    }

    /// A copy of every host mark so far.
    pub fn marks(&self) -> Vec<HostMark> {
        self.lock().marks.clone()
    }

    /// When the work of operation `seq` of `stream` ended, if it was recorded.
    pub fn work_end(&self, stream: StreamId, seq: u64) -> Option<u64> {
        self.lock().work_end.get(&(stream, seq)).copied()
    }

    /// A copy of every record so far.
    pub fn records(&self) -> Vec<TraceRecord> {
        self.lock().all.clone()
    }

    /// Checks that the timeline is consistent: every record ends after it starts, and every
    /// wait ends (and every operation starts) no earlier than the end of the work it
    /// waited for / was ordered after (when that work was recorded). Returns the first
    /// violation.
    pub fn check(&self) -> Result<(), String> {
        let records = self.records();
        let mut work_end = HashMap::new();
        for r in &records {
            if r.end_ns < r.start_ns {
                return Err(format!("{} on {} ends before it starts", r.name, r.stream));
            }
            if r.kind == TraceKind::Work {
                work_end.insert((r.stream, r.seq), r.end_ns);
            }
        }
        for r in &records {
            let (at, what, deps) = match r.kind {
                TraceKind::Wait => (r.end_ns, "stopped waiting for", r.waited_for.as_slice()),
                TraceKind::Work => (r.start_ns, "started after", r.after.as_slice()),
            };
            for target in deps {
                if let Some(&end) = work_end.get(target) {
                    if at < end {
                        return Err(format!(
                            "{}#{} {what} {}#{} at {at} ns, before it ended at {end} ns",
                            r.stream, r.seq, target.0, target.1
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Every cross-stream dependency whose producer's work was recorded, once: from the
    /// producer to the consumer's wait for it, or to the consumer's work when it did not
    /// wait (the producer was done before the consumer needed it).
    fn flows(records: &[TraceRecord]) -> Vec<Flow> {
        let mut work = HashMap::new();
        let mut waits = HashMap::new();
        for (i, r) in records.iter().enumerate() {
            match (r.kind, r.waited_for) {
                (TraceKind::Work, _) => {
                    work.insert((r.stream, r.seq), i);
                }
                (TraceKind::Wait, Some(dep)) => {
                    waits.insert((r.stream, r.seq, dep), i);
                }
                (TraceKind::Wait, None) => {}
            }
        }
        // (consumer stream, consumer seq, producer): ordered, so flow ids are stable.
        let mut edges = BTreeSet::new();
        for r in records {
            let deps = match r.kind {
                TraceKind::Work => r.after.clone(),
                TraceKind::Wait => r.waited_for.into_iter().collect(),
            };
            for dep in deps.into_iter().filter(|d| d.0 != r.stream) {
                edges.insert((r.stream, r.seq, dep));
            }
        }
        edges
            .into_iter()
            .filter_map(|(stream, seq, dep)| {
                let producer = *work.get(&dep)?;
                let target = waits
                    .get(&(stream, seq, dep))
                    .or_else(|| work.get(&(stream, seq)))?;
                Some(Flow {
                    producer,
                    target: *target,
                })
            })
            .collect()
    }

    /// The timeline in the Chrome trace event format (a JSON object with `traceEvents`).
    ///
    /// Operations and waits are complete events (`ph: "X"`, category `work` or `wait`).
    /// Each cross-stream dependency is a flow (`ph: "s"` on the producer's work, `ph: "f"`
    /// with `bp: "e"` on the wait it released or on the consumer's work; category
    /// `dependency`, one `id` per edge); the complete events name their flows in
    /// `args.flows_out` (producer) and `args.flows_in` (consumer).
    pub fn chrome_trace(&self) -> serde_json::Value {
        let records = self.records();
        let flows = Self::flows(&records);
        let mut flows_out: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut flows_in: HashMap<usize, Vec<usize>> = HashMap::new();
        for (id, f) in flows.iter().enumerate() {
            flows_out.entry(f.producer).or_default().push(id + 1);
            flows_in.entry(f.target).or_default().push(id + 1);
        }
        let mut events = Vec::with_capacity(records.len() + 2 * flows.len() + 8);
        let mut named = BTreeSet::new();
        for (i, r) in records.iter().enumerate() {
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
            if !r.after.is_empty() {
                let after: Vec<String> = r.after.iter().map(|(s, n)| format!("{s}#{n}")).collect();
                args["after"] = serde_json::json!(after);
            }
            if let Some(ids) = flows_out.get(&i) {
                args["flows_out"] = serde_json::json!(ids);
            }
            if let Some(ids) = flows_in.get(&i) {
                args["flows_in"] = serde_json::json!(ids);
            }
            events.push(serde_json::json!({
                "name": if r.kind == TraceKind::Wait { format!("wait {}", r.name) } else { r.name.clone() },
                "cat": if r.kind == TraceKind::Wait { "wait" } else { "work" },
                "ph": "X",
                "pid": r.stream.device.0,
                "tid": r.stream.index,
                "ts": us(r.start_ns),
                "dur": us(r.end_ns - r.start_ns),
                "args": args,
            }));
        }
        let marks = self.marks();
        if !marks.is_empty() {
            events.push(serde_json::json!({
                "name": "process_name", "ph": "M", "pid": HOST_TRACE_PID,
                "args": { "name": "host" }
            }));
            events.push(serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": HOST_TRACE_PID, "tid": 0,
                "args": { "name": "automatic replay" }
            }));
        }
        for m in &marks {
            events.push(serde_json::json!({
                "name": m.name, "cat": "automatic replay", "ph": "X",
                "pid": HOST_TRACE_PID, "tid": 0,
                "ts": us(m.start_ns), "dur": us(m.end_ns.saturating_sub(m.start_ns)),
            }));
        }
        for (id, f) in flows.iter().enumerate() {
            let (p, t) = (&records[f.producer], &records[f.target]);
            // Flow ends bind to the slice enclosing their timestamp: take one strictly
            // inside it. The arrow leaves the producer as it ends and reaches a wait as it
            // ends (the release) or an operation as it starts.
            let target_at = match t.kind {
                TraceKind::Wait => t.end_ns,
                TraceKind::Work => t.start_ns,
            };
            for (ph, r, at) in [("s", p, p.end_ns), ("f", t, target_at)] {
                events.push(serde_json::json!({
                    "name": "dependency", "cat": "dependency", "ph": ph, "bp": "e",
                    "id": id + 1,
                    "pid": r.stream.device.0,
                    "tid": r.stream.index,
                    "ts": us(inside(r, at)),
                }));
            }
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
        self.summary()
            .streams
            .into_iter()
            .map(|s| (s.stream, s.busy))
            .collect()
    }

    /// Busy, waiting and idle time of every stream over the recorded window.
    pub fn summary(&self) -> Summary {
        let records = self.records();
        let window = (
            records.iter().map(|r| r.start_ns).min().unwrap_or(0),
            records.iter().map(|r| r.end_ns).max().unwrap_or(0),
        );
        let mut per_stream: BTreeMap<StreamId, Vec<&TraceRecord>> = BTreeMap::new();
        for r in &records {
            per_stream.entry(r.stream).or_default().push(r);
        }
        let streams = per_stream
            .into_iter()
            .map(|(stream, rs)| {
                let span = |kind| -> Vec<(u64, u64)> {
                    rs.iter()
                        .filter(|r| r.kind == kind)
                        .map(|r| (r.start_ns, r.end_ns))
                        .collect()
                };
                let (work, waits) = (union(span(TraceKind::Work)), span(TraceKind::Wait));
                let active = union(work.iter().copied().chain(waits.iter().copied()).collect());
                let busy = length(&work);
                let mut on: BTreeMap<StreamId, Vec<(u64, u64)>> = BTreeMap::new();
                for r in rs.iter().filter(|r| r.kind == TraceKind::Wait) {
                    if let Some((producer, _)) = r.waited_for {
                        on.entry(producer).or_default().push((r.start_ns, r.end_ns));
                    }
                }
                let gaps = gaps(&active, window);
                StreamSummary {
                    stream,
                    busy: Duration::from_nanos(busy),
                    waiting: Duration::from_nanos(length(&active) - busy),
                    waiting_on: on
                        .into_iter()
                        .map(|(s, mut v)| {
                            // Not counting time the stream was running work meanwhile.
                            v.extend_from_slice(&work);
                            (s, Duration::from_nanos(length(&union(v)) - busy))
                        })
                        .collect(),
                    idle: Duration::from_nanos(gaps.iter().map(|g| g.1 - g.0).sum()),
                    idle_gaps: gaps.len(),
                    longest_gap: Duration::from_nanos(
                        gaps.iter().map(|g| g.1 - g.0).max().unwrap_or(0),
                    ),
                }
            })
            .collect();
        Summary {
            window: Duration::from_nanos(window.1 - window.0),
            streams,
        }
    }
}

/// The dependencies of an operation of `stream` on other streams, for
/// [`TraceRecord::after`] (deduplicated, in order).
pub(crate) fn cross_stream(
    stream: StreamId,
    deps: &[crate::protocol::Dep],
) -> Vec<(StreamId, u64)> {
    let mut out: Vec<(StreamId, u64)> = deps
        .iter()
        .map(|d| (d.event.stream(), d.event.seq()))
        .filter(|d| d.0 != stream)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Nanoseconds as the trace format's microseconds.
fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

/// `at`, moved strictly inside `r`'s interval when it is at least 2 ns long.
fn inside(r: &TraceRecord, at: u64) -> u64 {
    if r.end_ns - r.start_ns >= 2 {
        at.clamp(r.start_ns + 1, r.end_ns - 1)
    } else {
        r.start_ns
    }
}

/// The union of intervals, sorted and disjoint.
fn union(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Total length of disjoint intervals.
fn length(v: &[(u64, u64)]) -> u64 {
    v.iter().map(|(s, e)| e - s).sum()
}

/// The non-empty parts of `window` that the sorted disjoint intervals `v` leave uncovered.
fn gaps(v: &[(u64, u64)], window: (u64, u64)) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = window.0;
    for &(s, e) in v {
        if s > at {
            out.push((at, s));
        }
        at = at.max(e);
    }
    if window.1 > at {
        out.push((at, window.1));
    }
    out
}

/// Where one stream's time went, over the whole recorded window ([`Recorder::summary`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamSummary {
    /// The stream.
    pub stream: StreamId,
    /// Time running work.
    pub busy: Duration,
    /// Time waiting for other streams and not running work.
    pub waiting: Duration,
    /// Time waiting and not running work, per stream waited for (waits on several streams
    /// may overlap).
    pub waiting_on: Vec<(StreamId, Duration)>,
    /// Time neither working nor waiting: nothing was submitted to the stream.
    pub idle: Duration,
    /// Number of idle intervals (including before the stream's first record and after its
    /// last one, when the window extends past them).
    pub idle_gaps: usize,
    /// The longest idle interval.
    pub longest_gap: Duration,
}

/// Per-stream summary of a timeline: [`Recorder::summary`]. `Display` prints a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// From the first record's start to the last record's end.
    pub window: Duration,
    /// One entry per stream that recorded anything, in stream order.
    pub streams: Vec<StreamSummary>,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let pct = |d: Duration| 100.0 * d.as_secs_f64() / self.window.as_secs_f64().max(1e-12);
        writeln!(f, "timeline of {:.3} ms:", ms(self.window))?;
        writeln!(
            f,
            "{:<8} {:>7} {:>7} {:>7} {:>5} {:>10}  waiting on",
            "stream", "busy", "waiting", "idle", "gaps", "longest"
        )?;
        for s in &self.streams {
            let on: Vec<String> = s
                .waiting_on
                .iter()
                .map(|(t, d)| format!("{t} {:.3} ms", ms(*d)))
                .collect();
            writeln!(
                f,
                "{:<8} {:>6.1}% {:>6.1}% {:>6.1}% {:>5} {:>7.3} ms  {}",
                s.stream.to_string(),
                pct(s.busy),
                pct(s.waiting),
                pct(s.idle),
                s.idle_gaps,
                ms(s.longest_gap),
                if on.is_empty() {
                    "-".to_string()
                } else {
                    on.join(", ")
                }
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::DeviceId;

    fn stream(device: u32, index: u32) -> StreamId {
        StreamId {
            device: DeviceId(device),
            index: index as _,
        }
    }

    fn rec(kind: TraceKind, s: StreamId, seq: u64, span: (u64, u64)) -> TraceRecord {
        TraceRecord {
            kind,
            name: format!("op{seq}"),
            stream: s,
            seq,
            start_ns: span.0,
            end_ns: span.1,
            bytes: 0,
            waited_for: None,
            after: Vec::new(),
            ok: true,
        }
    }

    /// Stream a: work 0..100. Stream b: work 0..20, waits for a#1 20..100, work 100..150
    /// (after a#1), idle to 200, work 200..210 (after a#1, no wait).
    fn example() -> Recorder {
        let (a, b) = (stream(0, 0), stream(1, 0));
        let r = Recorder::new();
        r.record(rec(TraceKind::Work, a, 1, (0, 100)));
        r.record(rec(TraceKind::Work, b, 1, (0, 20)));
        r.record(TraceRecord {
            waited_for: Some((a, 1)),
            ..rec(TraceKind::Wait, b, 2, (20, 100))
        });
        r.record(TraceRecord {
            after: vec![(a, 1)],
            ..rec(TraceKind::Work, b, 2, (100, 150))
        });
        r.record(TraceRecord {
            after: vec![(a, 1)],
            ..rec(TraceKind::Work, b, 3, (200, 210))
        });
        r
    }

    #[test]
    fn summary_splits_each_stream_into_busy_waiting_and_idle() {
        let (a, b) = (stream(0, 0), stream(1, 0));
        let s = example().summary();
        assert_eq!(s.window, Duration::from_nanos(210));
        let ns = Duration::from_nanos;
        assert_eq!(
            s.streams,
            vec![
                StreamSummary {
                    stream: a,
                    busy: ns(100),
                    waiting: ns(0),
                    waiting_on: vec![],
                    idle: ns(110),
                    idle_gaps: 1,
                    longest_gap: ns(110),
                },
                StreamSummary {
                    stream: b,
                    busy: ns(80),
                    waiting: ns(80),
                    waiting_on: vec![(a, ns(80))],
                    idle: ns(50),
                    idle_gaps: 1,
                    longest_gap: ns(50),
                },
            ]
        );
        let text = s.to_string();
        assert!(text.contains("d1s0"), "{text}");
        assert!(text.contains("d0s0 0.000 ms"), "{text}");
    }

    #[test]
    fn each_dependency_is_one_flow_to_the_wait_it_released_or_the_operation() {
        let r = example();
        let records = r.records();
        let flows = Recorder::flows(&records);
        let pairs: Vec<(usize, usize)> = flows.iter().map(|f| (f.producer, f.target)).collect();
        // b#2 waited (record 2), b#3 did not (record 4); both from a#1 (record 0).
        assert_eq!(pairs, vec![(0, 2), (0, 4)]);
        let json = r.chrome_trace();
        let events = json["traceEvents"].as_array().expect("events");
        let ends: Vec<_> = events.iter().filter(|e| e["ph"] == "f").collect();
        assert_eq!(ends.len(), 2);
        // The wait's flow ends inside it, just before its end (the release).
        assert_eq!(ends[0]["ts"], serde_json::json!(0.099));
        assert_eq!(ends[0]["bp"], "e");
        assert!(r.check().is_ok());
    }

    #[test]
    fn check_reports_an_operation_that_starts_before_its_dependency_ended() {
        let r = example();
        r.record(TraceRecord {
            after: vec![(stream(0, 0), 1)],
            ..rec(TraceKind::Work, stream(1, 0), 4, (50, 60))
        });
        let err = r.check().expect_err("b#4 started at 50, a#1 ended at 100");
        assert!(err.contains("d1s0#4 started after d0s0#1"), "{err}");
    }
}
