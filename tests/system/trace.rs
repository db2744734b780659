//! Stream timelines: the Chrome trace a system writes is valid JSON in the trace event
//! format, consistent (every wait ends after the event it waited for completed), and draws
//! every cross-stream dependency as a flow arrow from the operation that produced it to the
//! wait it released (or to the consumer's operation when it did not have to wait), on every
//! backend.
//!
//! Nothing here depends on timing: which dependencies the protocol emits depends on whether
//! the producer was still pending when the consumer was planned, so the test that asserts
//! particular arrows holds its producer on a gate until the consumers are planned; the
//! other checks hold for whatever the run recorded.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{mpsc, Mutex},
    time::Duration,
};

use serde_json::Value;
use support::{all, backend_kind, node, shared, slow_fill_on, Kind};
use tributary::{
    collective::Strategy,
    kernels::{self, Access, RoutineSpec},
    trace::Recorder,
    MemoryMode, MergeBufferUse,
};
use tributary_actors::{StreamConfig, System};
use tributary_testkit::{for_each_backend, model, support};

for_each_backend!(
    data_parallel_training_writes_a_valid_consistent_trace,
    streams_of_one_device_record_their_work_and_waits_consistently,
);

/// A slow writer on stream 0 and a reader on stream 1 of one device: on Vulkan the reader
/// waits on the GPU (a semaphore), which the completion thread records.
fn streams_of_one_device_record_their_work_and_waits_consistently(kind: Kind) {
    let test = "streams_of_one_device_record_their_work_and_waits_consistently";
    let Some(backend) = backend_kind(kind, 1, test) else {
        return;
    };
    let sys = System::builder()
        .cpu_devices(1)
        .backend(backend)
        .streams(StreamConfig::MostParallelStreams(2))
        .record_timeline(true)
        .spawn()
        .unwrap();
    let x = node("x", shared());
    let y = node("y", MemoryMode::on_device());
    let w = sys
        .context(0, 0)
        .unwrap()
        .link(slow_fill_on(kind, &x, 3.0))
        .unwrap();
    let r = sys
        .context(0, 1)
        .unwrap()
        .link(kernels::copy(&y, &x).unwrap())
        .unwrap();
    w.schedule().unwrap();
    r.schedule().unwrap();
    assert!(all(&r.context().read::<f32>(&y).unwrap(), 3.0));
    sys.sync().unwrap();
    let rec = sys.timeline().expect("recording was asked for");
    rec.check().expect("consistent timeline");
    let json = written_trace(&rec);
    let names: BTreeSet<String> = complete_events(&json)
        .iter()
        .filter(|e| e["cat"] == "work")
        .map(|e| {
            format!(
                "d{}s{} {}",
                e["pid"],
                e["tid"],
                e["name"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert!(names.contains("d0s0 slow_fill"), "{names:?}");
    assert!(
        names.iter().any(|n| n.starts_with("d0s1 copy")),
        "{names:?}"
    );
    check_flows(&json);
    check_summary(&rec);
    sys.shutdown().unwrap();
}

fn data_parallel_training_writes_a_valid_consistent_trace(kind: Kind) {
    let test = "data_parallel_training_writes_a_valid_consistent_trace";
    let Some(backend) = backend_kind(kind, 3, test) else {
        return;
    };
    let cfg = model::ModelConfig::default();
    let data = model::make_data(&cfg);
    let init = model::init_params(&cfg);
    let sys = System::builder()
        .cpu_devices(3)
        .backend(backend)
        .streams(StreamConfig::OnlyDevicesParallel)
        .record_timeline(true)
        .spawn()
        .unwrap();
    let dp = model::DataParallel::new(&sys, &cfg, 3, &data, &init, Strategy::Ring).unwrap();
    for _ in 0..3 {
        dp.step().unwrap();
    }
    dp.loss().unwrap();
    sys.sync().unwrap();
    let rec = sys.timeline().expect("recording was asked for");
    rec.check().expect("consistent timeline");

    let json = written_trace(&rec);
    let complete = complete_events(&json);
    assert!(complete.len() > 50, "only {} events", complete.len());
    // All three devices ran work.
    let pids: BTreeSet<u64> = complete.iter().filter_map(|e| e["pid"].as_u64()).collect();
    assert_eq!(pids.len(), 3, "{pids:?}");
    check_flows(&json);
    check_summary(&rec);
    sys.shutdown().unwrap();
}

/// A producer that cannot finish before the test releases it: so its consumers, planned
/// before the release, depend on it for sure (the protocol drops dependencies on finished
/// work). One consumer on the other stream of its device, one on another device.
#[test]
fn gated_producer_draws_arrows_to_its_consumers_on_other_streams_and_devices() {
    let sys = System::builder()
        .cpu_devices(2)
        .streams(StreamConfig::MostParallelStreams(2))
        .record_timeline(true)
        .spawn()
        .unwrap();
    let x = node("x", shared());
    let y = node("y", MemoryMode::on_device());
    let (open, gate) = mpsc::channel::<()>();
    let gate = Mutex::new(gate);
    let producer = RoutineSpec::custom("gated_fill", vec![(x.clone(), Access::Write)], None, {
        move |a| {
            // Bounded, so a broken test fails instead of hanging.
            gate.lock()
                .map_err(|e| e.to_string())?
                .recv_timeout(Duration::from_secs(60))
                .map_err(|e| format!("the gate was never opened: {e}"))?;
            a.output::<f32>(0).map_err(|e| e.to_string())?.fill(7.0);
            Ok(())
        }
    })
    .unwrap();
    let w = sys.context(0, 0).unwrap().link(producer).unwrap();
    let r = sys
        .context(0, 1)
        .unwrap()
        .link(kernels::copy(&y, &x).unwrap())
        .unwrap();
    let z = node("z", MemoryMode::on_device());
    let c = sys
        .context(1, 0)
        .unwrap()
        .link(kernels::copy(&z, &x).unwrap())
        .unwrap();
    w.schedule().unwrap();
    // Planned (its event assigned) while the producer is held.
    r.schedule().unwrap().event().unwrap();
    // Returns once both devices have planned the copy.
    sys.device_to_device(
        &x,
        w.protocol_context(),
        c.protocol_context(),
        MergeBufferUse::No,
    )
    .unwrap();
    c.schedule().unwrap().event().unwrap();
    open.send(()).unwrap();
    assert!(all(&r.context().read::<f32>(&y).unwrap(), 7.0));
    assert!(all(&c.context().read::<f32>(&z).unwrap(), 7.0));
    sys.sync().unwrap();

    let rec = sys.timeline().expect("recording was asked for");
    rec.check().expect("consistent timeline");
    let json = written_trace(&rec);
    let flows = check_flows(&json);
    // (producer pid, tid) -> (consumer pid, tid) of every arrow.
    let arrows: BTreeSet<((u64, u64), (u64, u64))> = flows.iter().map(|f| (f.from, f.to)).collect();
    assert!(
        arrows.contains(&((0, 0), (0, 1))),
        "no arrow from d0s0 to d0s1: {arrows:?}"
    );
    assert!(
        arrows.iter().any(|(from, to)| from.0 == 0 && to.0 == 1),
        "no arrow from device 0 to device 1: {arrows:?}"
    );
    let gated = flows
        .iter()
        .find(|f| f.from == (0, 0) && f.to == (0, 1))
        .map(|f| f.producer_name.clone());
    assert_eq!(gated.as_deref(), Some("gated_fill"));
    check_summary(&rec);
    sys.shutdown().unwrap();
}

/// Writes the trace to a file and parses it back.
fn written_trace(rec: &Recorder) -> Value {
    let path = std::env::temp_dir().join(format!(
        "tributary-trace-{}-{:?}.json",
        std::process::id(),
        std::thread::current().id()
    ));
    rec.write_chrome_trace(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    serde_json::from_str(&text).expect("valid JSON")
}

fn complete_events(json: &Value) -> Vec<&Value> {
    let events = json["traceEvents"].as_array().expect("traceEvents array");
    let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    for e in &complete {
        assert!(
            e["name"].is_string() && e["pid"].is_u64() && e["tid"].is_u64(),
            "{e}"
        );
        assert!(e["ts"].as_f64().is_some_and(|t| t >= 0.0), "{e}");
        assert!(e["dur"].as_f64().is_some_and(|d| d >= 0.0), "{e}");
        assert!(e["cat"] == "work" || e["cat"] == "wait", "{e}");
        if e["cat"] == "wait" {
            assert!(e["args"]["waited_for"].is_string(), "{e}");
        }
    }
    complete
}

/// Trace microseconds back to the recorder's nanoseconds.
fn ns(v: &Value) -> u64 {
    (v.as_f64().expect("a number") * 1e3).round() as u64
}

/// `d{pid}s{tid}#{seq}`, how the trace names an operation.
fn op_name(e: &Value) -> String {
    format!("d{}s{}#{}", e["pid"], e["tid"], e["args"]["seq"])
}

/// Whether flow event `f` lies on complete event `x`'s track, inside its interval.
fn encloses(x: &Value, f: &Value) -> bool {
    let (start, at) = (ns(&x["ts"]), ns(&f["ts"]));
    x["pid"] == f["pid"] && x["tid"] == f["tid"] && start <= at && at <= start + ns(&x["dur"])
}

fn ids(x: &Value, key: &str) -> Vec<u64> {
    x["args"][key]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// One checked arrow.
struct Flow {
    from: (u64, u64),
    to: (u64, u64),
    producer_name: String,
}

/// Every flow starts on its producer's work and ends on the consumer's wait it released
/// or on the consumer's operation; each cross-stream dependency whose producer was
/// recorded is exactly one flow. Returns the flows.
fn check_flows(json: &Value) -> Vec<Flow> {
    let events = json["traceEvents"].as_array().expect("traceEvents array");
    let complete = complete_events(json);
    let mut starts = HashMap::new();
    let mut finishes = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] == "s" || e["ph"] == "f") {
        assert_eq!(e["cat"], "dependency", "{e}");
        assert_eq!(e["bp"], "e", "{e}");
        let id = e["id"].as_u64().expect("flow id");
        let side = if e["ph"] == "s" {
            &mut starts
        } else {
            &mut finishes
        };
        assert!(side.insert(id, e).is_none(), "flow id {id} used twice: {e}");
    }
    assert_eq!(
        starts.keys().collect::<BTreeSet<_>>(),
        finishes.keys().collect::<BTreeSet<_>>(),
        "every flow has one start and one finish"
    );
    let work: HashMap<String, &Value> = complete
        .iter()
        .filter(|e| e["cat"] == "work")
        .map(|e| (op_name(e), *e))
        .collect();
    let mut flows = Vec::new();
    for (id, s) in &starts {
        let f = finishes[id];
        // The producer: the work record that lists this flow and encloses its start.
        let producers: Vec<&&Value> = complete
            .iter()
            .filter(|x| ids(x, "flows_out").contains(id))
            .collect();
        assert_eq!(producers.len(), 1, "flow {id}: {producers:?}");
        let p = producers[0];
        assert_eq!(p["cat"], "work", "flow {id} starts on {p}");
        assert!(
            encloses(p, s),
            "flow {id} start {s} outside its producer {p}"
        );
        // The consumer: a wait for exactly that producer, or an operation ordered after it.
        let targets: Vec<&&Value> = complete
            .iter()
            .filter(|x| ids(x, "flows_in").contains(id))
            .collect();
        assert_eq!(targets.len(), 1, "flow {id}: {targets:?}");
        let t = targets[0];
        assert!(
            encloses(t, f),
            "flow {id} finish {f} outside its target {t}"
        );
        let producer = op_name(p);
        let producer_end = ns(&p["ts"]) + ns(&p["dur"]);
        if t["cat"] == "wait" {
            assert_eq!(t["args"]["waited_for"], producer.as_str(), "flow {id}: {t}");
            let released = ns(&t["ts"]) + ns(&t["dur"]);
            assert!(
                released + 1 >= producer_end,
                "flow {id}: {t} ends before {p}"
            );
        } else {
            let after: Vec<&str> = t["args"]["after"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            assert!(
                after.contains(&producer.as_str()),
                "flow {id}: {t} not after {p}"
            );
            assert!(
                ns(&t["ts"]) + 1 >= producer_end,
                "flow {id}: {t} starts before {p}"
            );
        }
        flows.push(Flow {
            from: (
                p["pid"].as_u64().unwrap_or(0),
                p["tid"].as_u64().unwrap_or(0),
            ),
            to: (
                t["pid"].as_u64().unwrap_or(0),
                t["tid"].as_u64().unwrap_or(0),
            ),
            producer_name: p["name"].as_str().unwrap_or_default().to_string(),
        });
    }
    // Every cross-stream dependency on recorded work is drawn, once.
    let mut edges = BTreeSet::new();
    for e in &complete {
        let consumer = op_name(e);
        let deps: Vec<String> = if e["cat"] == "wait" {
            vec![e["args"]["waited_for"].as_str().unwrap_or_default().into()]
        } else {
            e["args"]["after"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default()
        };
        for dep in deps.into_iter().filter(|d| work.contains_key(d)) {
            edges.insert((consumer.clone(), dep));
        }
    }
    assert_eq!(
        flows.len(),
        edges.len(),
        "one flow per dependency: {edges:?}"
    );
    flows
}

/// Each stream's busy, waiting and idle time add up to the window.
fn check_summary(rec: &Recorder) {
    let summary = rec.summary();
    let streams: BTreeSet<_> = rec.records().iter().map(|r| r.stream).collect();
    assert_eq!(summary.streams.len(), streams.len());
    for s in &summary.streams {
        assert_eq!(s.busy + s.waiting + s.idle, summary.window, "{s:?}");
        assert!(s.busy > Duration::ZERO, "{s:?}");
    }
    let text = summary.to_string();
    assert!(text.lines().count() == streams.len() + 2, "{text}");
}
