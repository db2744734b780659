//! The CPU backend's worker pool seen from the public API: a stream with a thread of its
//! own may block without starving the pool, one worker serves streams that wait for each
//! other, and the configuration is checked and reaches the backend from `EngineConfig` and
//! `SystemConfig` (DESIGN.md §5, "The CPU worker model").

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use tributary::{
    backend::cpu::CpuConfig,
    kernels::{self, Access, RoutineSpec},
    DType, DeviceId, Engine, EngineConfig, Error, MemoryMode, Sharing, StreamId, TensorNode,
};
use tributary_actors::{System, SystemConfig};

fn node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [1])
        .with_mode(mode)
        .expect("mode")
}

fn engine(streams: usize, cpu: CpuConfig) -> Engine {
    Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: streams,
        cpu,
        ..EngineConfig::default()
    })
    .expect("engine")
}

/// A kernel that blocks until another stream's kernel runs (as a network stream's
/// operation waits on a communication thread), on a stream with a thread of its own: the
/// pool's only worker stays free for the other stream. Were the blocking stream on the
/// shared worker, the other kernel could never run and the blocked one would give up.
#[test]
fn a_blocking_kernel_on_a_dedicated_stream_leaves_the_pool_free() {
    let dedicated = StreamId {
        device: DeviceId(0),
        index: 1,
    };
    let mut e = engine(
        2,
        CpuConfig::default()
            .with_workers(1)
            .with_dedicated_stream(dedicated),
    );
    let released = Arc::new(AtomicBool::new(false));
    let threads = Arc::new(Mutex::new(Vec::new()));
    let (a, b) = (
        node("a", MemoryMode::on_device()),
        node("b", MemoryMode::on_device()),
    );
    let (flag, names) = (released.clone(), threads.clone());
    let blocking = RoutineSpec::custom("blocking", vec![(a, Access::Write)], None, move |_| {
        names
            .lock()
            .unwrap()
            .push(("blocking", std::thread::current().name().map(String::from)));
        // Generous: the release comes in microseconds unless the pool is starved.
        let deadline = Instant::now() + Duration::from_secs(60);
        // SeqCst: test code; the flag is the only shared state.
        while !flag.load(Ordering::SeqCst) {
            if Instant::now() > deadline {
                return Err("never released: the other stream could not run".into());
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    })
    .expect("spec");
    let (flag, names) = (released.clone(), threads.clone());
    let release = RoutineSpec::custom("release", vec![(b, Access::Write)], None, move |_| {
        names
            .lock()
            .unwrap()
            .push(("release", std::thread::current().name().map(String::from)));
        // SeqCst: test code.
        flag.store(true, Ordering::SeqCst);
        Ok(())
    })
    .expect("spec");
    let c1 = e.context(0, 1).expect("context");
    let c0 = e.context(0, 0).expect("context");
    let blocking = e.link(&c1, blocking).expect("link");
    let release = e.link(&c0, release).expect("link");
    let blocked = e.schedule(&blocking).expect("schedule");
    let released_event = e.schedule(&release).expect("schedule");
    released_event.wait().expect("the releasing kernel ran");
    blocked.wait().expect("the blocking kernel was released");
    let mut names = threads.lock().unwrap().clone();
    names.sort();
    assert_eq!(
        names,
        vec![
            ("blocking", Some("tributary-d0s1-0".to_string())),
            ("release", Some("tributary-cpu-0".to_string())),
        ],
        "the dedicated stream runs on its own thread, the other on the shared pool"
    );
}

/// One worker, no spinning, two streams, each read on stream 1 waiting for the write on
/// stream 0 before it: every read sees its own write (the waiting stream parks and gives
/// the worker back to the writer).
#[test]
fn one_worker_serves_streams_that_wait_for_each_other() {
    let mut e = engine(
        2,
        CpuConfig::default()
            .with_workers(1)
            .with_spin(Duration::ZERO),
    );
    let x = node("x", MemoryMode::OnDevice(Sharing::SharedCrossStreams));
    let y = node("y", MemoryMode::on_device());
    let c0 = e.context(0, 0).expect("context");
    let c1 = e.context(0, 1).expect("context");
    let writes: Vec<_> = (0..4)
        .map(|i| {
            e.link(&c0, kernels::fill(&x, i as f64).expect("spec"))
                .expect("link")
        })
        .collect();
    let copy = e
        .link(&c1, kernels::copy(&y, &x).expect("spec"))
        .expect("link");
    for round in 0..200 {
        let value = round % 4;
        e.schedule(&writes[value]).expect("schedule");
        e.schedule(&copy).expect("schedule");
        let seen: Vec<f32> = e.read(copy.context(), &y).expect("read");
        assert_eq!(seen, vec![value as f32], "round {round}");
    }
}

/// Bad values are typed errors naming the setting; TOML `[cpu]` reaches the backend.
#[test]
fn cpu_configuration_is_checked_and_reaches_the_backend() {
    let err = Engine::cpu(EngineConfig {
        cpu: CpuConfig::default().with_workers(1_000_000),
        ..EngineConfig::default()
    })
    .err()
    .expect("refused");
    assert!(
        matches!(&err, Error::InvalidConfig { setting, value, .. }
            if setting == "cpu.workers" && value == "1000000"),
        "{err}"
    );

    let config = SystemConfig::from_toml_str(
        "cpu_devices = 1\n[cpu]\nworkers = 1\nspin_us = 0\ndedicated_streams = [{ device = 0, index = 1 }]",
    )
    .expect("parse");
    assert_eq!(
        config.cpu,
        CpuConfig::default()
            .with_workers(1)
            .with_spin(Duration::ZERO)
            .with_dedicated_stream(StreamId {
                device: DeviceId(0),
                index: 1
            })
    );
    let sys = System::from_config(config).expect("spawn");
    let x = node("x", MemoryMode::on_device());
    for stream in 0..2 {
        let threads = Arc::new(Mutex::new(None));
        let seen = threads.clone();
        let spec =
            RoutineSpec::custom("where", vec![(x.clone(), Access::Write)], None, move |_| {
                *seen.lock().unwrap() = std::thread::current().name().map(String::from);
                Ok(())
            })
            .expect("spec");
        let r = sys
            .context(0, stream)
            .expect("context")
            .link(spec)
            .expect("link");
        r.schedule().expect("schedule").wait().expect("wait");
        let expected = ["tributary-cpu-0", "tributary-d0s1-0"][stream];
        assert_eq!(threads.lock().unwrap().as_deref(), Some(expected));
    }
    sys.shutdown().expect("shutdown");

    assert!(matches!(
        SystemConfig::from_toml_str("[cpu]\nthreads = 2"),
        Err(Error::ConfigParse { .. })
    ));
    let mut too_long = SystemConfig::default();
    too_long.cpu = CpuConfig::default().with_spin(Duration::from_secs(1));
    assert!(matches!(
        System::from_config(too_long),
        Err(Error::InvalidConfig { setting, .. }) if setting == "cpu.spin_us"
    ));
}
