//! Step capture and replay on the engine (issue 18): a replay computes what issuing the
//! captured calls again computes, takes new index values, and refuses — with a typed
//! error naming what changed, and nothing planned — whatever would make the captured
//! decisions stale. (The random programs of `tests/reliability/reliability_programs.rs`
//! compare thousands of
//! replayed steps with the sequential reference and check their dependency graphs.)

use support::{add_index, node, N};
use tributary::{
    kernels, protocol::Routine, Engine, EngineConfig, Error, Invalidation, MemoryMode,
    MergeBufferUse, Step,
};
use tributary_testkit::support;

fn engine() -> Engine {
    Engine::cpu(EngineConfig::default()).expect("CPU engine")
}

/// A step of one schedule of `routine`.
fn capture_schedule(e: &mut Engine, routine: &Routine) -> Step {
    e.capture(|c| {
        c.schedule(routine)?;
        Ok(())
    })
    .expect("capture")
}

fn invalidation(r: tributary::Result<tributary::StreamLasts<tributary::Event>>) -> Invalidation {
    match r {
        Err(Error::ReplayInvalidated { why, .. }) => why,
        other => panic!("expected ReplayInvalidated, got {other:?}"),
    }
}

/// A two-device step (double `x` on device 0, copy it into device 1's `y` context, add 1
/// there) replayed with `replay` computes what issuing the calls again computes.
#[test]
fn replays_compute_what_issuing_the_calls_computes() {
    let mut e = engine();
    let x = node("x", MemoryMode::on_device());
    let (c0, c1) = (e.context(0, 0).unwrap(), e.context(1, 0).unwrap());
    let fill = e.link(&c0, kernels::fill(&x, 1.0).unwrap()).unwrap();
    let double = e
        .link(fill.context(), kernels::scale_in_place(&x, 2.0).unwrap())
        .unwrap();
    let init = e.link(&c1, kernels::fill(&x, 0.0).unwrap()).unwrap();
    let bump = e.link(init.context(), add_index(&x)).unwrap();
    e.schedule(&fill).unwrap();
    e.schedule(&init).unwrap();
    let step = e
        .capture(|c| {
            c.schedule(&double)?;
            c.device_to_device(&x, double.context(), bump.context(), MergeBufferUse::No)?;
            c.schedule_with(&bump, &[("t", 1)])?;
            Ok(())
        })
        .unwrap();
    assert_eq!(e.read::<f32>(bump.context(), &x).unwrap(), vec![3.0; N]);
    for k in 1..=4u32 {
        let events = e.replay(&step).unwrap();
        assert!(
            !events.is_empty(),
            "a replay returns its streams' last events"
        );
        // Device 0 holds 2^(k+1); device 1 its copy plus 1.
        let doubled = 2f32.powi(k as i32 + 1);
        assert_eq!(
            e.read::<f32>(double.context(), &x).unwrap(),
            vec![doubled; N]
        );
        assert_eq!(
            e.read::<f32>(bump.context(), &x).unwrap(),
            vec![doubled + 1.0; N]
        );
    }
    assert_eq!(
        step.operations(),
        3,
        "the schedule, the copy (planned by its destination), the add"
    );
}

/// `replay_with` gives the captured schedules new index values; values of another shape
/// are refused as `BindingShape` before anything is planned.
#[test]
fn replay_with_takes_new_index_values_and_refuses_another_shape() {
    let mut e = engine();
    let x = node("x", MemoryMode::on_device());
    let c0 = e.context(0, 0).unwrap();
    let fill = e.link(&c0, kernels::fill(&x, 0.0).unwrap()).unwrap();
    let add = e.link(fill.context(), add_index(&x)).unwrap();
    e.schedule(&fill).unwrap();
    let step = e
        .capture(|c| {
            c.schedule_with(&add, &[("t", 1)])?;
            Ok(())
        })
        .unwrap();
    let mut values = step.bindings();
    assert_eq!(values.len(), 1);
    let mut total = 1.0;
    for t in [10, 100, -5] {
        values.set_all("t", t).unwrap();
        e.replay_with(&step, &values).unwrap();
        total += t as f32;
        assert_eq!(e.read::<f32>(add.context(), &x).unwrap(), vec![total; N]);
    }
    assert_eq!(values.shift("t", 1).unwrap(), 1);
    e.replay_with(&step, &values).unwrap();
    total += -4.0;
    assert_eq!(e.read::<f32>(add.context(), &x).unwrap(), vec![total; N]);
    // Another step's values (no schedule with indices) do not fit.
    let other = capture_schedule(&mut e, &fill);
    let why = invalidation(e.replay_with(&step, &other.bindings()));
    assert!(
        matches!(why, Invalidation::BindingShape { .. }),
        "got {why:?}"
    );
    // `fill` was replayed by nothing: x is as `other`'s capture left it (0), and the
    // refused replay planned nothing.
    assert_eq!(e.read::<f32>(add.context(), &x).unwrap(), vec![0.0; N]);
}

/// Finalizing a context the step uses invalidates it, naming the context; nothing is
/// planned, the engine goes on serving, and a new capture replays.
#[test]
fn a_finalized_context_invalidates_the_step() {
    let mut e = engine();
    let x = node("x", MemoryMode::on_device());
    let y = node("y", MemoryMode::on_device());
    let c0 = e.context(0, 0).unwrap();
    let fill_x = e.link(&c0, kernels::fill(&x, 2.0).unwrap()).unwrap();
    let fill_y = e.link(&c0, kernels::fill(&y, 5.0).unwrap()).unwrap();
    e.schedule(&fill_x).unwrap();
    let step = capture_schedule(&mut e, &fill_y);
    let gone = fill_y.context().id();
    e.finalize(fill_y.context()).unwrap();
    match invalidation(e.replay(&step)) {
        Invalidation::ContextFinalized { context, .. } => assert_eq!(context, gone),
        other => panic!("expected ContextFinalized, got {other:?}"),
    }
    // The engine still serves, and a step over live contexts replays.
    let again = capture_schedule(&mut e, &fill_x);
    e.replay(&again).unwrap();
    assert_eq!(e.read::<f32>(fill_x.context(), &x).unwrap(), vec![2.0; N]);
}

/// A host write to a hosted node the step reads before writing it makes the device buffer
/// lag: issued directly, the step would upload it first, which the captured plans do not.
/// The replay is refused, naming the node and both versions; a new capture uploads.
#[test]
fn a_host_write_to_a_node_the_step_reads_invalidates_it() {
    let mut e = engine();
    let w = node("w", MemoryMode::hosted_changed_on_devices());
    let y = node("y", MemoryMode::on_device());
    let c0 = e.context(0, 0).unwrap();
    let cw = e.init_from_host(&c0, &w, &[1.0f32; N]).unwrap();
    let copy = e.link(&cw, kernels::copy(&y, &w).unwrap()).unwrap();
    let step = capture_schedule(&mut e, &copy);
    e.replay(&step).unwrap();
    assert_eq!(e.read::<f32>(copy.context(), &y).unwrap(), vec![1.0; N]);
    e.host_write(&w, &[7.0f32; N]).unwrap();
    match invalidation(e.replay(&step)) {
        Invalidation::HostWritten {
            node,
            buffer_version,
            host_version,
            ..
        } => {
            assert!(node.starts_with('w'), "names the node: {node}");
            assert!(
                buffer_version < Some(host_version),
                "{buffer_version:?} vs {host_version}"
            );
        }
        other => panic!("expected HostWritten, got {other:?}"),
    }
    // Nothing was planned: y still holds the old copy.
    assert_eq!(e.read::<f32>(copy.context(), &y).unwrap(), vec![1.0; N]);
    let again = capture_schedule(&mut e, &copy);
    e.replay(&again).unwrap();
    assert_eq!(e.read::<f32>(copy.context(), &y).unwrap(), vec![7.0; N]);
}

/// A step captured on one engine is refused by another (its buffers are not there).
#[test]
fn a_step_of_another_engine_is_refused() {
    let (mut a, mut b) = (engine(), engine());
    let x = node("x", MemoryMode::on_device());
    let c0 = a.context(0, 0).unwrap();
    let fill = a.link(&c0, kernels::fill(&x, 1.0).unwrap()).unwrap();
    let step = capture_schedule(&mut a, &fill);
    let why = invalidation(b.replay(&step));
    assert!(matches!(why, Invalidation::Foreign { .. }), "got {why:?}");
    a.replay(&step).unwrap();
}

/// A step whose routine reads a stream's merge buffer is refused once the buffer holds
/// another node than the step was captured with.
#[test]
fn a_merge_buffer_holding_another_node_invalidates_the_step() {
    let mut e = engine();
    let x = node("x", MemoryMode::on_device());
    let z = node("z", MemoryMode::on_device());
    let acc = node("acc", MemoryMode::on_device());
    let (c0, c1) = (e.context(0, 0).unwrap(), e.context(1, 0).unwrap());
    let fill_x = e.link(&c0, kernels::fill(&x, 3.0).unwrap()).unwrap();
    let fill_z = e
        .link(fill_x.context(), kernels::fill(&z, 4.0).unwrap())
        .unwrap();
    let zero = e.link(&c1, kernels::fill(&acc, 0.0).unwrap()).unwrap();
    let merge = e
        .link(zero.context(), kernels::add_merge(&acc).unwrap())
        .unwrap();
    e.schedule(&fill_x).unwrap();
    e.schedule(&fill_z).unwrap();
    e.schedule(&zero).unwrap();
    // Before the step, the merge buffer of device 1's stream 0 gets `acc`'s copy of x.
    e.device_to_device(&acc, zero.context(), merge.context(), MergeBufferUse::Copy)
        .unwrap();
    let step = capture_schedule(&mut e, &merge);
    e.replay(&step).unwrap();
    // Now another node goes into that merge buffer.
    e.device_to_device(&z, fill_z.context(), merge.context(), MergeBufferUse::Copy)
        .unwrap();
    let why = invalidation(e.replay(&step));
    assert!(
        matches!(why, Invalidation::MergeBufferChanged { .. }),
        "got {why:?}"
    );
}

/// The pools the engine releases after a replay are placed (for the dependency-graph
/// checker of the random programs) after the plans made since, not at the end of the
/// replay's stamps: placed there, the plans that used a released pool came after its
/// release in program order, and the checker never asked whether they had completed.
#[test]
fn pool_releases_after_a_replay_are_placed_after_the_plans_made_since() {
    use std::sync::Arc;
    use tributary::{
        backend::cpu::CpuBackend, memory::PoolConfig, protocol::issue_clock, DType, DeviceId,
        TensorNode,
    };
    use tributary_testkit::common::graph::{GraphRecorder, RecordingBackend};

    let recorder = GraphRecorder::new();
    let backend =
        RecordingBackend::new(Arc::new(CpuBackend::new(DeviceId(0), 1)), recorder.clone());
    let pools = PoolConfig {
        pool_bytes: 256,
        ..PoolConfig::default()
    };
    let mut e = Engine::with_backend(Arc::new(backend), 1, pools).unwrap();
    let x = node("x", MemoryMode::on_device());
    let c0 = e.context(0, 0).unwrap();
    let fill = e.link(&c0, kernels::fill(&x, 1.0).unwrap()).unwrap();
    let step = capture_schedule(&mut e, &fill);
    e.replay(&step).unwrap();
    e.sync_all().unwrap();
    let after = issue_clock();
    // Two contexts with a pool each (a node larger than a pool gets its own), finalized
    // while their memsets may still run: once they complete, one of the two empty pools is
    // released (the other is kept as a spare).
    let mut contexts = Vec::new();
    for name in ["y", "z"] {
        let n = TensorNode::new(name, DType::F32, [1024]);
        let r = e.link(&c0, kernels::fill(&n, 2.0).unwrap()).unwrap();
        contexts.push(r.context().clone());
    }
    for c in &contexts {
        e.finalize(c).unwrap();
    }
    e.sync_all().unwrap();
    let releases = recorder.releases();
    assert!(!releases.is_empty(), "an empty pool is released");
    for (device, pool, placed) in releases {
        assert!(
            placed >= after,
            "{device} {pool:?}, released after the plans made from {after} on, is placed at \
             {placed}"
        );
    }
}
