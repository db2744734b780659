//! Step capture and replay on the actor system (issue 18): a replay is one operation per
//! device, computes what issuing the captured calls computes, takes new index values, and
//! is refused as a whole — every ticket failing with `ReplayInvalidated`, nothing issued on
//! any device — when something invalidated the captured decisions. (Random programs with
//! captured steps on the system: `tests/reliability/reliability_programs.rs`,
//! `system_captured_steps_match_the_reference`.)

use support::{add_index, node, N};
use tributary::{
    kernels, Error, Invalidation, MemoryMode, MergeBufferUse, Step, StreamLasts, TensorNode,
};
use tributary_actors::{RoutineHandle, System, Ticket};
use tributary_testkit::support;

fn system(devices: usize) -> System {
    System::builder()
        .cpu_devices(devices)
        .spawn()
        .expect("CPU system")
}

/// A routine filling `x` with `value` in a new context of `device`'s stream 0.
fn fill_on(sys: &System, device: usize, x: &TensorNode, value: f64) -> RoutineHandle {
    sys.context(device, 0)
        .unwrap()
        .link(kernels::fill(x, value).unwrap())
        .unwrap()
}

fn capture_schedule(sys: &System, routine: &RoutineHandle) -> Step {
    sys.capture(|c| c.schedule(routine.routine()).map(drop))
        .expect("capture")
}

/// The invalidation every ticket of a refused replay carries (all the same kind).
fn invalidation(tickets: StreamLasts<Ticket>) -> Invalidation {
    assert!(!tickets.is_empty(), "a replay returns a ticket per stream");
    let mut kinds = tickets.into_iter().map(|t| match t.wait() {
        Err(Error::ReplayInvalidated { why, .. }) => why,
        other => panic!("expected ReplayInvalidated, got {other:?}"),
    });
    let first = kinds.next().expect("one ticket");
    for other in kinds {
        assert_eq!(
            std::mem::discriminant(&other),
            std::mem::discriminant(&first),
            "every part of a refused replay is refused alike"
        );
    }
    first
}

/// A two-device step (double `x` on device 0, copy it into device 1's context, add 1
/// there) replayed computes what issuing the calls again computes; one ticket per stream.
#[test]
fn replays_compute_what_issuing_the_calls_computes() {
    let sys = system(2);
    let x = node("x", MemoryMode::on_device());
    let fill = fill_on(&sys, 0, &x, 1.0);
    let double = fill
        .context()
        .link(kernels::scale_in_place(&x, 2.0).unwrap())
        .unwrap();
    let init = fill_on(&sys, 1, &x, 0.0);
    let bump = init.context().link(add_index(&x)).unwrap();
    fill.schedule().unwrap();
    init.schedule().unwrap();
    let step = sys
        .capture(|c| {
            c.schedule(double.routine())?;
            c.device_to_device(
                &x,
                double.protocol_context(),
                bump.protocol_context(),
                MergeBufferUse::No,
            )?;
            c.schedule_with(bump.routine(), &[("t", 1)])?;
            Ok(())
        })
        .unwrap();
    assert_eq!(bump.context().read::<f32>(&x).unwrap(), vec![3.0; N]);
    assert_eq!(step.devices().len(), 2, "one part per device");
    assert_eq!(step.operations(), 3);
    for k in 1..=4u32 {
        let tickets = sys.replay(&step).unwrap();
        assert_eq!(tickets.len(), 2, "the last operation of each stream");
        for t in &tickets {
            t.wait().unwrap();
        }
        let doubled = 2f32.powi(k as i32 + 1);
        assert_eq!(double.context().read::<f32>(&x).unwrap(), vec![doubled; N]);
        assert_eq!(
            bump.context().read::<f32>(&x).unwrap(),
            vec![doubled + 1.0; N]
        );
    }
    sys.shutdown().unwrap();
}

/// `replay_with` gives the captured schedules new values; another shape is refused on the
/// calling thread, before anything is posted.
#[test]
fn replay_with_takes_new_index_values_and_refuses_another_shape() {
    let sys = system(1);
    let x = node("x", MemoryMode::on_device());
    let fill = fill_on(&sys, 0, &x, 0.0);
    let add = fill.context().link(add_index(&x)).unwrap();
    fill.schedule().unwrap();
    let step = sys
        .capture(|c| c.schedule_with(add.routine(), &[("t", 1)]).map(drop))
        .unwrap();
    let mut values = step.bindings();
    let mut total = 1.0;
    for t in [10, 100, -5] {
        values.set_all("t", t).unwrap();
        sys.replay_with(&step, &values).unwrap();
        total += t as f32;
        assert_eq!(add.context().read::<f32>(&x).unwrap(), vec![total; N]);
    }
    let other = capture_schedule(&sys, &fill);
    match sys.replay_with(&step, &other.bindings()) {
        Err(Error::ReplayInvalidated {
            why: Invalidation::BindingShape { .. },
            ..
        }) => {}
        other => panic!("expected BindingShape, got {other:?}"),
    }
    assert_eq!(add.context().read::<f32>(&x).unwrap(), vec![0.0; N]);
    sys.shutdown().unwrap();
}

/// All or nothing across devices: a two-device step whose device-1 context was finalized
/// is refused on both devices, device 0 issuing nothing (mutant `replay_barrier`, where
/// each part goes on its own check, doubles x there). The system goes on serving.
#[test]
fn a_replay_invalidated_on_one_device_issues_nothing_on_the_others() {
    let sys = system(2);
    let x = node("x", MemoryMode::on_device());
    let y = node("y", MemoryMode::on_device());
    let fill = fill_on(&sys, 0, &x, 1.0);
    let double = fill
        .context()
        .link(kernels::scale_in_place(&x, 2.0).unwrap())
        .unwrap();
    let fill_y = fill_on(&sys, 1, &y, 5.0);
    fill.schedule().unwrap();
    let step = sys
        .capture(|c| {
            c.schedule(double.routine())?;
            c.schedule(fill_y.routine())?;
            Ok(())
        })
        .unwrap();
    assert_eq!(double.context().read::<f32>(&x).unwrap(), vec![2.0; N]);
    let gone = fill_y.protocol_context().id();
    sys.finalize(fill_y.protocol_context()).unwrap();
    match invalidation(sys.replay(&step).unwrap()) {
        Invalidation::ContextFinalized { context, .. } => assert_eq!(context, gone),
        other => panic!("expected ContextFinalized, got {other:?}"),
    }
    sys.sync().unwrap();
    assert_eq!(
        double.context().read::<f32>(&x).unwrap(),
        vec![2.0; N],
        "device 0 issued its part of a refused replay"
    );
    let again = capture_schedule(&sys, &double);
    for t in sys.replay(&again).unwrap() {
        t.wait().unwrap();
    }
    assert_eq!(double.context().read::<f32>(&x).unwrap(), vec![8.0; N]);
    sys.shutdown().unwrap();
}

/// A host write to a hosted node the step reads invalidates it, naming the node; a new
/// capture uploads and replays.
#[test]
fn a_host_write_to_a_node_the_step_reads_invalidates_it() {
    let sys = system(1);
    let w = node("w", MemoryMode::hosted_changed_on_devices());
    let y = node("y", MemoryMode::on_device());
    let cw = sys
        .context(0, 0)
        .unwrap()
        .init_from_host(&w, &[1.0f32; N])
        .unwrap();
    let copy = cw.link(kernels::copy(&y, &w).unwrap()).unwrap();
    let step = capture_schedule(&sys, &copy);
    for t in sys.replay(&step).unwrap() {
        t.wait().unwrap();
    }
    assert_eq!(copy.context().read::<f32>(&y).unwrap(), vec![1.0; N]);
    sys.host_write(&w, &[7.0f32; N]).unwrap();
    match invalidation(sys.replay(&step).unwrap()) {
        Invalidation::HostWritten { node, .. } => assert!(node.starts_with('w'), "{node}"),
        other => panic!("expected HostWritten, got {other:?}"),
    }
    assert_eq!(copy.context().read::<f32>(&y).unwrap(), vec![1.0; N]);
    let again = capture_schedule(&sys, &copy);
    sys.replay(&again).unwrap();
    assert_eq!(copy.context().read::<f32>(&y).unwrap(), vec![7.0; N]);
    sys.shutdown().unwrap();
}

/// A step captured on one system is refused by another, on the calling thread when the
/// other has fewer devices, by its devices otherwise.
#[test]
fn a_step_of_another_system_is_refused() {
    let (a, b) = (system(1), system(1));
    let x = node("x", MemoryMode::on_device());
    let fill = a
        .context(0, 0)
        .unwrap()
        .link(kernels::fill(&x, 1.0).unwrap())
        .unwrap();
    let step = capture_schedule(&a, &fill);
    let why = invalidation(b.replay(&step).unwrap());
    assert!(matches!(why, Invalidation::Foreign { .. }), "got {why:?}");
    for t in a.replay(&step).unwrap() {
        t.wait().unwrap();
    }
    a.shutdown().unwrap();
    b.shutdown().unwrap();
}

/// A recorded call the device refuses fails the capture with that call's error.
#[test]
fn a_refused_call_fails_the_capture() {
    let sys = system(2);
    let x = node("x", MemoryMode::on_device());
    let fill = fill_on(&sys, 0, &x, 1.0);
    let other = sys.context(1, 0).unwrap();
    let read_x = other
        .link(kernels::scale_in_place(&x, 2.0).unwrap())
        .unwrap();
    fill.schedule().unwrap();
    // Device 1's x was never written: reading it is refused (no silent zeros).
    let r = sys.capture(|c| c.schedule(read_x.routine()).map(drop));
    assert!(
        matches!(r, Err(Error::UninitialisedRead { .. })),
        "got {r:?}"
    );
    sys.shutdown().unwrap();
}
