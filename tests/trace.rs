//! Stream timelines: the Chrome trace a system writes is valid JSON in the trace event
//! format and consistent (every wait ends after the event it waited for completed).

#[path = "../examples/data_parallel/model.rs"]
mod model;

use tributary::collective::Strategy;
use tributary_actors::{StreamConfig, System};

#[test]
fn data_parallel_training_writes_a_valid_consistent_trace() {
    let cfg = model::ModelConfig::default();
    let data = model::make_data(&cfg);
    let init = model::init_params(&cfg);
    let sys = System::builder()
        .cpu_devices(3)
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

    let path = std::env::temp_dir().join(format!("tributary-trace-{}.json", std::process::id()));
    rec.write_chrome_trace(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let json: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let events = json["traceEvents"].as_array().expect("traceEvents array");
    let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert!(complete.len() > 50, "only {} events", complete.len());
    for e in &complete {
        assert!(
            e["name"].is_string() && e["pid"].is_u64() && e["tid"].is_u64(),
            "{e}"
        );
        assert!(e["ts"].as_f64().is_some_and(|t| t >= 0.0), "{e}");
        assert!(e["dur"].as_f64().is_some_and(|d| d >= 0.0), "{e}");
    }
    // All three devices ran work, and cross-device waits were recorded and named.
    let pids: std::collections::BTreeSet<u64> =
        complete.iter().filter_map(|e| e["pid"].as_u64()).collect();
    assert_eq!(pids.len(), 3, "{pids:?}");
    let waits: Vec<_> = complete.iter().filter(|e| e["cat"] == "wait").collect();
    assert!(!waits.is_empty(), "no waits recorded");
    assert!(waits.iter().all(|w| w["args"]["waited_for"].is_string()));
    // The check itself can fail: a wait that ends before its event is reported.
    let bad = tributary::trace::Recorder::new();
    let s = tributary::StreamId {
        device: tributary::DeviceId(0),
        index: 0,
    };
    let t = tributary::StreamId {
        device: tributary::DeviceId(0),
        index: 1,
    };
    use tributary::trace::{TraceKind, TraceRecord};
    bad.record(TraceRecord {
        kind: TraceKind::Work,
        name: "w".into(),
        stream: s,
        seq: 1,
        start_ns: 0,
        end_ns: 100,
        bytes: 0,
        waited_for: None,
        ok: true,
    });
    bad.record(TraceRecord {
        kind: TraceKind::Wait,
        name: "r".into(),
        stream: t,
        seq: 1,
        start_ns: 0,
        end_ns: 50,
        bytes: 0,
        waited_for: Some((s, 1)),
        ok: true,
    });
    assert!(bad.check().is_err());
    sys.shutdown().unwrap();
}
