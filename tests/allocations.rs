//! Issuing and replaying allocate nothing in steady state (DESIGN.md §4, "Issuing without
//! allocation"): an `Engine` schedule, its dependencies and its run on the CPU backend, a
//! `System` schedule whose call finds its device idle, copies between devices, and replays
//! of a captured step (on one device, with the captured index values and with new ones;
//! across two devices, with a copy between them; steps captured anew, on the lists their
//! device's earlier steps gave back), each through the `Engine` and through `System`.
//!
//! Not in a suite (`tests/<suite>/main.rs`): alone in its own test binary, because its
//! global allocator counts the allocations of every thread of the process, which any other
//! test running in the same process would add to.
//!
//! One test runs the checks in turn. Each runs the same burst once to warm up, then counts
//! it again (up to [`COUNTED_RUNS`] times, see [`steady_run`]). What a counted burst may still
//! allocate does not grow with the burst: a sync ending it, and the lists that grow past
//! what the bursts before needed when this one finds the workers slower (a stream's queue, a
//! timeline's waiters). Each doubles its capacity, so it grows at most log2(BURST) times,
//! whatever the timing: [`ALLOWANCE`] counts eight such lists. Before this was built, the
//! same bursts made 3 to 5 allocations per routine.

use tributary::{
    kernels::{Access, RoutineSpec},
    DType, Engine, EngineConfig, MemoryMode, MergeBufferUse, Sharing, StreamLasts, TensorNode,
};
use tributary_actors::{StreamConfig, System};
use tributary_testkit::alloc_count::{allocations_after_warm_up, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Routines per burst.
const BURST: u64 = 2_000;

/// Fails unless `used` is within [`ALLOWANCE`], naming what made them.
fn assert_within_allowance(used: u64, what: std::fmt::Arguments<'_>) {
    assert!(
        used <= ALLOWANCE,
        "{used} allocations for {what} (at most {ALLOWANCE})"
    );
}

/// Replays per burst of a replay check: one allocation per replay would be ten times what
/// the check allows.
const REPLAYS: u64 = 1_000;

/// Allocations a burst may make that do not grow with it (see the module docs): eight
/// lists, each doubling at most log2(BURST) + 1 times. 96 for 2,000 routines.
const ALLOWANCE: u64 = 8 * (BURST.ilog2() as u64 + 1);

/// The checks, one after the other: the counter sees every thread, so nothing else may
/// run while one of them counts (a `System` is shut down before the next check).
#[test]
fn issuing_allocates_nothing_in_steady_state() {
    the_counter_counts_what_a_burst_allocates();
    engine_schedules_with_dependencies_allocate_nothing();
    engine_replays_allocate_nothing();
    engine_replays_of_steps_captured_anew_allocate_nothing();
    engine_replays_with_new_index_values_allocate_nothing();
    system_schedules_that_find_their_device_idle_allocate_nothing();
    system_replays_allocate_nothing();
    system_replays_of_steps_captured_anew_allocate_nothing();
    system_replays_with_new_index_values_allocate_nothing();
    engine_copies_and_replays_across_devices_allocate_nothing();
    system_copies_and_replays_across_devices_allocate_nothing();
}

/// Replays a check lets run ahead of their completion.
///
/// A replay's lists (a program's, its events) come back to its device when it completes, and
/// the next replays take them: a burst needs as many as it has replays in flight. How many
/// that is depends on how far the host runs ahead of the workers, which differs between
/// two bursts, so a check that let the whole burst run ahead would count lists the first
/// burst never needed at once (CI saw 393 where a quiet machine sees 263). Waiting every
/// [`IN_FLIGHT`] replays bounds that, as a pipeline of bounded depth (a training loop's)
/// does; what still differs between bursts, [`steady_run`] says.
const IN_FLIGHT: u64 = 16;

/// Waits with `wait` (for the last operations of the replay just made) after every
/// [`IN_FLIGHT`]-th replay (`i` counts from 0).
fn in_flight_at_most(
    i: u64,
    wait: impl FnOnce() -> tributary::Result<()>,
) -> tributary::Result<()> {
    if i % IN_FLIGHT == IN_FLIGHT - 1 {
        wait()?;
    }
    Ok(())
}

/// What a replay returns per stream, to wait for.
trait Last {
    fn wait_for(&self) -> tributary::Result<()>;
}

impl Last for tributary::Event {
    fn wait_for(&self) -> tributary::Result<()> {
        self.wait()
    }
}

impl Last for tributary_actors::Ticket {
    fn wait_for(&self) -> tributary::Result<()> {
        self.wait()
    }
}

/// Allocations of a burst of [`REPLAYS`] calls of `replay` on `on` (an `Engine` or a
/// `&System`) in steady state ([`steady_run`]), at most [`IN_FLIGHT`] of them in flight,
/// each burst ended by `sync`.
fn replays_allocate<S, L: Last>(
    on: &mut S,
    mut replay: impl FnMut(&mut S) -> tributary::Result<StreamLasts<L>>,
    mut sync: impl FnMut(&mut S) -> tributary::Result<()>,
) -> u64 {
    steady_run(|| {
        for i in 0..REPLAYS {
            let lasts = replay(on)?;
            in_flight_at_most(i, || lasts.iter().try_for_each(Last::wait_for))?;
        }
        sync(on)
    })
}

/// A system of `devices` CPU devices with one stream each.
fn system(devices: usize) -> System {
    System::builder()
        .cpu_devices(devices)
        .streams(StreamConfig::MostParallelStreams(1))
        .spawn()
        .unwrap()
}

/// Counted runs a check may take after its warm-up (see [`steady_run`]).
const COUNTED_RUNS: usize = 4;

/// Allocations `run` makes in steady state: it runs once to warm up, then runs counted until
/// a run is within [`ALLOWANCE`], at most [`COUNTED_RUNS`] times; the fewest counted.
///
/// Why not the second run alone: what a run borrows from a pool (one-shot cells, replay
/// part boxes, index value lists) goes back to it and is handed out again, so a pool holds
/// as many as were ever in flight at once. How many that is depends on how far the host
/// ran ahead of the devices and on when a device's actor dropped a decided batch, so a run
/// can pass the peak of the runs before it and allocate the difference, once: with two
/// busy loops beside it, about one second run in ten counted 75-112 (traced: new pool
/// cells of copies and schedules; a pool grows only at a new peak). An allocation per
/// operation is made in every run, a thousand or more each time, so the least of a few
/// runs tells them apart.
fn steady_run(run: impl FnMut() -> tributary::Result<()>) -> u64 {
    let counted = allocations_after_warm_up(run, COUNTED_RUNS, ALLOWANCE).unwrap();
    println!("{counted:?} allocations");
    counted.into_iter().min().unwrap_or(0)
}

fn node(name: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(name, DType::I32, [1])
        .with_mode(mode)
        .unwrap()
}

/// A CPU closure: `Write` of one `i32` (the producer), or read one and write another.
fn spec(params: Vec<(TensorNode, Access)>) -> RoutineSpec {
    let out = params.len() - 1;
    RoutineSpec::custom("step", params, None, move |a| {
        a.output::<i32>(out).map_err(|e| e.to_string())?[0] = 1;
        Ok(())
    })
    .unwrap()
}

/// A CPU closure writing the value of its index `t`.
fn indexed() -> RoutineSpec {
    RoutineSpec::custom(
        "indexed",
        vec![(node("y", MemoryMode::on_device()), Access::Write)],
        None,
        |a| {
            let t = a.index("t")?;
            a.output::<i32>(0).map_err(|e| e.to_string())?[0] = t as i32;
            Ok(())
        },
    )
    .unwrap()
    .with_index("t")
    .unwrap()
}

fn the_counter_counts_what_a_burst_allocates() {
    // The harness can fail: a burst that allocates once per routine is seen.
    let used = steady_run(|| {
        for i in 0..BURST {
            std::hint::black_box(Box::new(i));
        }
        Ok(())
    });
    assert!(
        used >= BURST,
        "{used} allocations counted for {BURST} boxes"
    );
}

fn engine_schedules_with_dependencies_allocate_nothing() {
    let mut e = Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: 2,
        ..EngineConfig::default()
    })
    .unwrap();
    let y = node("y", MemoryMode::OnDevice(Sharing::SharedCrossStreams));
    let z = node("z", MemoryMode::on_device());
    // Stream 0 writes y; stream 1 reads it and writes z: every schedule waits for the
    // other stream (read after write, and write after read), so every plan has a
    // dependency list.
    let (s0, s1) = (e.context(0, 0).unwrap(), e.context(0, 1).unwrap());
    let write = e.link(&s0, spec(vec![(y.clone(), Access::Write)])).unwrap();
    let read = e
        .link(&s1, spec(vec![(y, Access::Read), (z, Access::Write)]))
        .unwrap();
    let used = steady_run(|| {
        for _ in 0..BURST / 2 {
            e.schedule(&write)?;
            e.schedule(&read)?;
        }
        e.sync_all()
    });
    assert_within_allowance(used, format_args!("{BURST} schedules and their runs"));
}

/// An engine of one CPU device with one stream, and a routine there that writes `y`.
fn engine_writing_y() -> (Engine, tributary::protocol::Routine) {
    let mut e = Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: 1,
        ..EngineConfig::default()
    })
    .unwrap();
    let root = e.context(0, 0).unwrap();
    let r = e
        .link(
            &root,
            spec(vec![(node("y", MemoryMode::on_device()), Access::Write)]),
        )
        .unwrap();
    (e, r)
}

/// A step of `calls` schedules of `r`, captured on `e`.
fn capture_writes(e: &mut Engine, r: &tributary::protocol::Routine, calls: u64) -> tributary::Step {
    e.capture(|c| {
        for _ in 0..calls {
            c.schedule(r)?;
        }
        Ok(())
    })
    .unwrap()
}

fn engine_replays_allocate_nothing() {
    let (mut e, r) = engine_writing_y();
    const STEP: u64 = 8;
    let step = capture_writes(&mut e, &r, STEP);
    let replays = REPLAYS;
    let used = replays_allocate(&mut e, |e| e.replay(&step), |e| e.sync_all());
    assert_within_allowance(used, format_args!("{replays} replays of {STEP} routines"));
}

/// Steps each counted burst replays, every one captured before and never replayed yet
/// (see [`engine_replays_of_steps_captured_anew_allocate_nothing`]).
const NEW_STEPS: u64 = 50;

/// Steps of [`NEW_STEPS`] each, one list per burst of [`steady_run`] (its warm-up and every
/// counted run): `capture` makes each (capturing allocates; only replays are counted).
fn new_steps<S>(mut capture: impl FnMut() -> S) -> std::vec::IntoIter<Vec<S>> {
    (0..=COUNTED_RUNS)
        .map(|_| (0..NEW_STEPS).map(|_| capture()).collect())
        .collect::<Vec<Vec<S>>>()
        .into_iter()
}

/// Allocations of a burst of [`REPLAYS`] replays (`replay` on `on`) of the next list of
/// `bursts`, [`REPLAYS`] / [`NEW_STEPS`] of each of its steps, in steady state
/// ([`steady_run`]: one list for its warm-up, one per counted run), at most [`IN_FLIGHT`]
/// in flight, each burst ended by `sync`.
fn new_steps_replays_allocate<S, St, L: Last>(
    on: &mut S,
    mut bursts: std::vec::IntoIter<Vec<St>>,
    mut replay: impl FnMut(&mut S, &St) -> tributary::Result<StreamLasts<L>>,
    mut sync: impl FnMut(&mut S) -> tributary::Result<()>,
) -> u64 {
    steady_run(|| {
        let steps = bursts.next().expect("a list of steps per burst");
        let mut i = 0;
        for step in &steps {
            for _ in 0..REPLAYS / NEW_STEPS {
                let lasts = replay(on, step)?;
                in_flight_at_most(i, || lasts.iter().try_for_each(Last::wait_for))?;
                i += 1;
            }
        }
        sync(on)
    })
}

/// A step captured anew (a loop that captures its step once per epoch, a benchmark run
/// that captures its own) replays on the lists its device's earlier steps gave back: each
/// burst replays [`NEW_STEPS`] steps that were never replayed, [`REPLAYS`] in all. A step
/// that kept lists of its own would allocate its first replays' (a program's and an event
/// list, at least two per step: more than the allowance).
fn engine_replays_of_steps_captured_anew_allocate_nothing() {
    let (mut e, r) = engine_writing_y();
    const STEP: u64 = 4;
    let bursts = new_steps(|| capture_writes(&mut e, &r, STEP));
    let used = new_steps_replays_allocate(&mut e, bursts, |e, s| e.replay(s), |e| e.sync_all());
    assert_within_allowance(
        used,
        format_args!(
            "{REPLAYS} replays of {NEW_STEPS} steps of {STEP} routines never replayed before"
        ),
    );
}

fn system_schedules_that_find_their_device_idle_allocate_nothing() {
    let sys = system(1);
    let ctx = sys.context(0, 0).unwrap();
    let r = ctx
        .link(spec(vec![(
            node("y", MemoryMode::on_device()),
            Access::Write,
        )]))
        .unwrap();
    let routine = r.routine().clone();
    // Each call waits for the previous routine, so it finds the device idle and decides on
    // the calling thread: no wake-up of the device's actor (whose message actix boxes).
    let used = steady_run(|| {
        for _ in 0..BURST {
            sys.schedule(&routine)?.wait()?;
        }
        Ok(())
    });
    sys.shutdown().unwrap();
    assert_within_allowance(used, format_args!("{BURST} schedules through System"));
}

/// `Engine::replay_with`: the new index values travel in each stream's program, whose list
/// of them its step keeps for the next replay.
fn engine_replays_with_new_index_values_allocate_nothing() {
    let mut e = Engine::cpu(EngineConfig {
        devices: 1,
        streams_per_device: 1,
        ..EngineConfig::default()
    })
    .unwrap();
    let root = e.context(0, 0).unwrap();
    let r = e.link(&root, indexed()).unwrap();
    const STEP: u64 = 8;
    let step = e
        .capture(|c| {
            for _ in 0..STEP {
                c.schedule_with(&r, &[("t", 0)])?;
            }
            Ok(())
        })
        .unwrap();
    let mut values = step.bindings();
    let replays = REPLAYS;
    let used = replays_allocate(
        &mut e,
        |e| {
            values.shift("t", 1)?;
            e.replay_with(&step, &values)
        },
        |e| e.sync_all(),
    );
    assert_within_allowance(
        used,
        format_args!("{replays} replays of {STEP} routines with new index values"),
    );
}

/// A system of one CPU device with one stream, and a routine there that writes `y`.
fn system_writing_y() -> (System, tributary_actors::RoutineHandle) {
    let sys = system(1);
    let ctx = sys.context(0, 0).unwrap();
    let r = ctx
        .link(spec(vec![(
            node("y", MemoryMode::on_device()),
            Access::Write,
        )]))
        .unwrap();
    (sys, r)
}

/// A step of `calls` schedules of `r`, captured on `sys`.
fn system_capture_writes(
    sys: &System,
    r: &tributary_actors::RoutineHandle,
    calls: u64,
) -> tributary::Step {
    sys.capture(|c| {
        for _ in 0..calls {
            c.schedule(r.routine())?;
        }
        Ok(())
    })
    .unwrap()
}

/// A `System` replay on one device: its part travels in a pooled box, its tickets come
/// back inline, its event lists are its device's.
fn system_replays_allocate_nothing() {
    let (sys, r) = system_writing_y();
    const STEP: u64 = 32;
    let step = system_capture_writes(&sys, &r, STEP);
    let replays = REPLAYS;
    let used = replays_allocate(&mut &sys, |s| s.replay(&step), |s| s.sync());
    sys.shutdown().unwrap();
    assert_within_allowance(
        used,
        format_args!("{replays} replays of {STEP} routines through System"),
    );
}

/// [`engine_replays_of_steps_captured_anew_allocate_nothing`] through `System`.
fn system_replays_of_steps_captured_anew_allocate_nothing() {
    let (sys, r) = system_writing_y();
    const STEP: u64 = 4;
    let bursts = new_steps(|| system_capture_writes(&sys, &r, STEP));
    let used = new_steps_replays_allocate(&mut &sys, bursts, |s, st| s.replay(st), |s| s.sync());
    sys.shutdown().unwrap();
    assert_within_allowance(
        used,
        format_args!(
            "{REPLAYS} replays of {NEW_STEPS} steps of {STEP} routines never replayed before, \
             through System"
        ),
    );
}

/// `System::replay_with`: the values travel in a list the step keeps and refills once no
/// part holds it.
fn system_replays_with_new_index_values_allocate_nothing() {
    let sys = system(1);
    let r = sys.context(0, 0).unwrap().link(indexed()).unwrap();
    let routine = r.routine().clone();
    const STEP: u64 = 8;
    let step = sys
        .capture(|c| {
            for _ in 0..STEP {
                c.schedule_with(&routine, &[("t", 0)])?;
            }
            Ok(())
        })
        .unwrap();
    let mut values = step.bindings();
    let replays = REPLAYS;
    let used = replays_allocate(
        &mut &sys,
        |s| {
            values.shift("t", 1)?;
            s.replay_with(&step, &values)
        },
        |s| s.sync(),
    );
    sys.shutdown().unwrap();
    assert_within_allowance(
        used,
        format_args!(
            "{replays} replays of {STEP} routines with new index values \
         through System"
        ),
    );
}

/// Device 0 writes `x`, then `x` is copied to device 1: every copy waits for the write on
/// another device, and the next write for the copy's read.
fn copy_specs() -> (TensorNode, RoutineSpec, RoutineSpec) {
    let x = node("x", MemoryMode::OnDevice(Sharing::SharedCrossStreams));
    let write = spec(vec![(x.clone(), Access::Write)]);
    let read =
        RoutineSpec::custom("read", vec![(x.clone(), Access::Read)], None, |_| Ok(())).unwrap();
    (x, write, read)
}

/// `Engine::device_to_device` after a write on the source device (the copy's plans, its
/// dependencies on the other device and its run), then replays of a step holding the same
/// write and copy.
fn engine_copies_and_replays_across_devices_allocate_nothing() {
    let mut e = Engine::cpu(EngineConfig {
        devices: 2,
        streams_per_device: 1,
        ..EngineConfig::default()
    })
    .unwrap();
    let (x, write, read) = copy_specs();
    let (d0, d1) = (e.context(0, 0).unwrap(), e.context(1, 0).unwrap());
    let write = e.link(&d0, write).unwrap();
    let read = e.link(&d1, read).unwrap();
    let (src, dst) = (write.context().clone(), read.context().clone());
    let copies = BURST / 2;
    let used = steady_run(|| {
        for i in 0..copies {
            e.schedule(&write)?;
            let copied = e.device_to_device(&x, &src, &dst, MergeBufferUse::No)?;
            in_flight_at_most(i, || copied.map_or(Ok(()), |c| c.wait()))?;
        }
        e.sync_all()
    });
    assert_within_allowance(
        used,
        format_args!("{copies} writes and copies between devices"),
    );
    let step = e
        .capture(|c| {
            c.schedule(&write)?;
            c.device_to_device(&x, &src, &dst, MergeBufferUse::No)?;
            Ok(())
        })
        .unwrap();
    let replays = REPLAYS;
    let used = replays_allocate(&mut e, |e| e.replay(&step), |e| e.sync_all());
    assert_within_allowance(used, format_args!("{replays} replays across two devices"));
}

/// `System::device_to_device` after a write on the source device (its two halves posted
/// at once, the source's verdict to the destination in a pooled cell, the reader the source
/// records a deferred event whose cell goes back to its pool), then replays of a step
/// holding the same write and copy (the parts' checks and the copy's answer pooled cells,
/// the edge lists inline).
fn system_copies_and_replays_across_devices_allocate_nothing() {
    let sys = system(2);
    let (x, write, read) = copy_specs();
    let write = sys.context(0, 0).unwrap().link(write).unwrap();
    let read = sys.context(1, 0).unwrap().link(read).unwrap();
    let (src, dst) = (write.context().clone(), read.context().clone());
    let write = write.routine().clone();
    let copies = BURST / 2;
    let used = steady_run(|| {
        for i in 0..copies {
            sys.schedule(&write)?;
            let copied = sys.device_to_device(&x, &src, &dst, MergeBufferUse::No)?;
            in_flight_at_most(i, || copied.map_or(Ok(()), |c| c.wait()))?;
        }
        sys.sync()
    });
    assert_within_allowance(
        used,
        format_args!("{copies} writes and copies between devices through System"),
    );
    let step = sys
        .capture(|c| {
            c.schedule(&write)?;
            c.device_to_device(&x, &src, &dst, MergeBufferUse::No)?;
            Ok(())
        })
        .unwrap();
    let replays = REPLAYS;
    let used = replays_allocate(&mut &sys, |s| s.replay(&step), |s| s.sync());
    sys.shutdown().unwrap();
    assert_within_allowance(
        used,
        format_args!("{replays} replays across two devices through System"),
    );
}
