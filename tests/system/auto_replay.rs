//! The automatic replay through `System` (issue 31, DESIGN.md §4 "Automatic replay"): a
//! period of calls seen three times is learned (as a multiple of at least `MIN_PERIOD`
//! calls), captured the next time and replayed from the time after, computing what issuing
//! computes; a call that breaks the period, a wait on a held ticket,
//! an invalidating call or another thread gives the held calls back to issuing. (Random
//! programs with repeated windows: `tests/reliability/reliability_programs.rs`,
//! `system_auto_replay_matches_the_reference`.)

use std::thread;

use support::{add_index, node, N};
use tributary::{dispatch::auto::MIN_PERIOD, kernels, MemoryMode, MergeBufferUse, TensorNode};
use tributary_actors::{ReplayStats, RoutineHandle, System, Ticket};
use tributary_testkit::support;

fn system(devices: usize, auto: bool) -> System {
    System::builder()
        .cpu_devices(devices)
        .auto_replay(auto)
        .spawn()
        .expect("CPU system")
}

/// `x`, filled with 1 then doubled: a period of two calls.
struct Pair {
    x: TensorNode,
    fill: RoutineHandle,
    double: RoutineHandle,
}

impl Pair {
    fn new(sys: &System) -> Pair {
        let x = node("x", MemoryMode::on_device());
        let fill = link_on(sys, 0, kernels::fill(&x, 1.0).unwrap());
        let double = fill
            .context()
            .link(kernels::scale_in_place(&x, 2.0).unwrap())
            .unwrap();
        Pair { x, fill, double }
    }
}

/// Hosted `h` (its host array `value` at first) copied into `y`, then `y` doubled.
struct Hosted {
    h: TensorNode,
    y: TensorNode,
    copy: RoutineHandle,
    double: RoutineHandle,
}

impl Hosted {
    fn new(sys: &System, value: f32) -> Hosted {
        let h = node("h", MemoryMode::hosted_changed_on_devices());
        let y = node("y", MemoryMode::on_device());
        let held = sys
            .context(0, 0)
            .unwrap()
            .init_from_host(&h, &[value; N])
            .unwrap();
        let copy = held.link(kernels::copy(&y, &h).unwrap()).unwrap();
        let double = copy
            .context()
            .link(kernels::scale_in_place(&y, 2.0).unwrap())
            .unwrap();
        Hosted { h, y, copy, double }
    }
}

/// `spec` linked into a new context of `device`'s stream 0.
fn link_on(sys: &System, device: usize, spec: tributary::kernels::RoutineSpec) -> RoutineHandle {
    sys.context(device, 0).unwrap().link(spec).unwrap()
}

/// `times` periods of `fill` then `double`.
fn run_pairs(fill: &RoutineHandle, double: &RoutineHandle, times: usize) {
    for _ in 0..times {
        fill.schedule().unwrap();
        double.schedule().unwrap();
    }
}

fn wait_all(tickets: &mut Vec<Ticket>) {
    for t in tickets.drain(..) {
        t.wait().expect("every call runs");
    }
}

/// A timestep across two devices: add `t` to `x` on device 0, copy `x` to device 1, add
/// `t` there too. Returns the final values on both devices and the replay statistics.
fn timesteps(auto: bool, steps: i64) -> (Vec<f32>, Vec<f32>, ReplayStats) {
    let sys = system(2, auto);
    let x = node("x", MemoryMode::on_device());
    let zero0 = link_on(&sys, 0, kernels::fill(&x, 0.0).unwrap());
    let zero1 = link_on(&sys, 1, kernels::fill(&x, 0.0).unwrap());
    let add0 = zero0.context().link(add_index(&x)).unwrap();
    let add1 = zero1.context().link(add_index(&x)).unwrap();
    zero0.schedule().unwrap();
    zero1.schedule().unwrap();
    let mut tickets = Vec::new();
    for t in 0..steps {
        tickets.push(add0.schedule_with(&[("t", t)]).unwrap());
        tickets.extend(
            sys.device_to_device(
                &x,
                add0.protocol_context(),
                add1.protocol_context(),
                MergeBufferUse::No,
            )
            .unwrap(),
        );
        tickets.push(add1.schedule_with(&[("t", t)]).unwrap());
    }
    wait_all(&mut tickets);
    let out = (
        add0.context().read::<f32>(&x).unwrap(),
        add1.context().read::<f32>(&x).unwrap(),
        sys.replay_stats(),
    );
    sys.shutdown().unwrap();
    out
}

/// Eighty timesteps of three calls: the period (three calls) is recognised after the third
/// timestep and learned as its multiple of at least `MIN_PERIOD` calls (22 timesteps),
/// captured in the next 22, replayed in each full 22 after; the 11 left over are held, and
/// issued when their tickets are waited on. The values are issuing's, with new
/// index values every replay.
#[test]
fn repeated_timesteps_are_replayed_and_compute_what_issuing_computes() {
    let (steps, n) = (80i64, 3u64);
    let (x0, x1, stats) = timesteps(true, steps);
    let (y0, y1, off) = timesteps(false, steps);
    assert_eq!(
        (x0.clone(), x1.clone()),
        (y0, y1),
        "issuing and replaying agree"
    );
    // x0 after step t is sum(0..=t); x1 is x0 after the copy plus t.
    let sum: f32 = (0..steps).map(|t| t as f32).sum();
    assert_eq!(x0, vec![sum; N]);
    assert_eq!(x1, vec![sum + (steps - 1) as f32; N]);
    assert_eq!(off, ReplayStats::default(), "the automatic replay was off");
    let learned = MIN_PERIOD.div_ceil(n as usize) as u64; // timesteps in the learned period
    let after = steps as u64 - 3 - learned; // timesteps after the capture
    assert_eq!(stats.periods, 1, "{stats:?}");
    assert_eq!(stats.steps, 1, "{stats:?}");
    assert_eq!(stats.replays, after / learned, "{stats:?}");
    assert_eq!(
        stats.calls_replayed,
        after / learned * learned * n,
        "{stats:?}"
    );
    assert_eq!(stats.fallbacks.waited, after % learned * n, "{stats:?}");
    assert_eq!(stats.fallbacks.interrupted, 0, "{stats:?}");
}

/// A period with a host write in it (write `h`, copy it into `y`, double `y`) is never
/// replayed: the write could make a captured step stale (a step reading `h` would have no
/// upload). Mutant `auto_stale` (an invalidating call keeps the period) replays it, and the
/// device refuses the replay.
#[test]
fn a_host_write_inside_the_period_ends_the_replays() {
    let sys = system(1, true);
    let Hosted { h, y, copy, double } = Hosted::new(&sys, 0.0);
    let mut tickets = Vec::new();
    for t in 0..10 {
        sys.host_write(&h, &[t as f32; N]).unwrap();
        tickets.push(copy.schedule().unwrap());
        tickets.push(double.schedule().unwrap());
    }
    wait_all(&mut tickets);
    assert_eq!(double.context().read::<f32>(&y).unwrap(), vec![18.0; N]);
    let stats = sys.replay_stats();
    assert_eq!(stats.periods, 0, "{stats:?}");
    assert_eq!(stats.replays, 0, "{stats:?}");
    sys.shutdown().unwrap();
}

/// A finalize in the middle of a replayed period makes it forget the period; it is learned
/// again, and replayed again, from the calls after it.
#[test]
fn an_invalidating_call_between_periods_is_followed_by_learning_again() {
    let sys = system(1, true);
    let x = node("x", MemoryMode::on_device());
    let ctx = sys.context(0, 0).unwrap();
    let add = ctx.link(add_index(&x)).unwrap();
    let zero = add.context().link(kernels::fill(&x, 0.0).unwrap()).unwrap();
    let other = sys.context(0, 0).unwrap();
    zero.schedule().unwrap();
    let mut tickets = Vec::new();
    // Periods of two calls, learned as MIN_PERIOD / 2 of them: three to recognise, one
    // learned period captured, one replayed.
    let enough = 3 + MIN_PERIOD as i64;
    for t in 0..enough {
        tickets.push(add.schedule_with(&[("t", t)]).unwrap());
        tickets.push(add.schedule_with(&[("t", 1)]).unwrap());
    }
    let before = sys.replay_stats();
    sys.finalize(other.protocol_context()).unwrap();
    for t in enough..2 * enough {
        tickets.push(add.schedule_with(&[("t", t)]).unwrap());
        tickets.push(add.schedule_with(&[("t", 1)]).unwrap());
    }
    wait_all(&mut tickets);
    let stats = sys.replay_stats();
    let want: f32 = (0..2 * enough).map(|t| t as f32 + 1.0).sum();
    assert_eq!(add.context().read::<f32>(&x).unwrap(), vec![want; N]);
    assert_eq!((before.periods, before.replays), (1, 1), "{before:?}");
    assert_eq!(stats.fallbacks.invalidated, 1, "{stats:?}");
    assert_eq!(stats.periods, 2, "{stats:?}");
    assert!(stats.replays > before.replays, "{stats:?}");
    sys.shutdown().unwrap();
}

/// A wait on the ticket of a held call issues the held calls (it would never complete
/// otherwise); the rest of the segment is issued, and the next one replayed again.
#[test]
fn a_wait_on_a_held_ticket_issues_the_held_calls() {
    let sys = system(1, true);
    let Pair { x, fill, double } = Pair::new(&sys);
    // Periods of two calls, learned as `pairs` of them.
    let pairs = MIN_PERIOD / 2;
    run_pairs(&fill, &double, 3 + 2 * pairs);
    let replays = sys.replay_stats().replays;
    assert_eq!(
        replays, 1,
        "the learned period after the captured one was replayed"
    );
    let held = fill.schedule().unwrap();
    held.wait().expect("a held call completes once waited on");
    assert_eq!(sys.replay_stats().fallbacks.waited, 1);
    double.schedule().unwrap();
    run_pairs(&fill, &double, pairs - 1);
    assert_eq!(
        sys.replay_stats().replays,
        replays,
        "the segment was issued"
    );
    run_pairs(&fill, &double, pairs);
    assert_eq!(sys.replay_stats().replays, replays + 1);
    assert_eq!(double.context().read::<f32>(&x).unwrap(), vec![2.0; N]);
    sys.shutdown().unwrap();
}

/// Each of four host threads runs its own periodic loop on its own node: their calls
/// interleave in the system's one stream of calls, so periods form and break at random;
/// every thread's result is what its own calls compute.
#[test]
fn host_threads_interleaving_periods_compute_their_own_results() {
    let sys = system(2, true);
    let results: Vec<(RoutineHandle, TensorNode, f32)> = thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|k| {
                let sys = &sys;
                s.spawn(move || {
                    let x = node(&format!("x{k}"), MemoryMode::on_device());
                    let ctx = sys.context(k % 2, 0).unwrap();
                    let zero = ctx.link(kernels::fill(&x, 0.0).unwrap()).unwrap();
                    let add = zero.context().link(add_index(&x)).unwrap();
                    zero.schedule().unwrap();
                    let mut tickets = Vec::new();
                    for t in 0..40 {
                        tickets.push(add.schedule_with(&[("t", t + k as i64)]).unwrap());
                    }
                    wait_all(&mut tickets);
                    let want: f32 = (0..40).map(|t| (t + k) as f32).sum();
                    (add, x, want)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (add, x, want) in results {
        assert_eq!(add.context().read::<f32>(&x).unwrap(), vec![want; N]);
    }
    sys.shutdown().unwrap();
}

/// The timeline marks each replay on a host lane ("replayed N calls of step S"), from its
/// first held call to its post, and the Chrome trace shows them.
#[test]
fn the_timeline_marks_each_replay() {
    let sys = System::builder()
        .cpu_devices(1)
        .auto_replay(true)
        .record_timeline(true)
        .spawn()
        .unwrap();
    let x = node("x", MemoryMode::on_device());
    let fill = link_on(&sys, 0, kernels::fill(&x, 1.0).unwrap());
    for _ in 0..3 + 3 * MIN_PERIOD {
        fill.schedule().unwrap();
    }
    sys.sync().unwrap();
    let stats = sys.replay_stats();
    let rec = sys.timeline().expect("a timeline");
    let marks = rec.marks();
    assert_eq!(marks.len() as u64, stats.replays, "{stats:?}");
    assert_eq!(stats.replays, 2, "{stats:?}");
    for m in &marks {
        assert!(
            m.name
                .starts_with(&format!("replayed {MIN_PERIOD} calls of step ")),
            "{}",
            m.name
        );
        assert!(m.end_ns >= m.start_ns);
    }
    let trace = rec.chrome_trace().to_string();
    assert!(trace.contains("\"automatic replay\""), "{trace}");
    sys.shutdown().unwrap();
}

/// `System::issue_held` issues what is held (for a host about to block elsewhere), and a
/// shutdown does too: the held calls run and their tickets complete.
#[test]
fn issue_held_and_shutdown_issue_the_held_calls() {
    let sys = system(1, true);
    let Pair { fill, double, .. } = Pair::new(&sys);
    let pairs = MIN_PERIOD / 2;
    run_pairs(&fill, &double, 3 + pairs);
    // The next learned period is replayed: its calls are held until its last.
    fill.schedule().unwrap();
    let held = double.schedule().unwrap();
    assert_eq!(sys.replay_stats().fallbacks.interrupted, 0);
    sys.issue_held();
    let stats = sys.replay_stats();
    assert_eq!(stats.fallbacks.interrupted, 2, "{stats:?}");
    assert_eq!(sys.replay_stats().fallbacks.waited, 0);
    held.wait().unwrap();
    assert_eq!(sys.replay_stats().fallbacks.waited, 0, "issued already");
    // The rest of this learned period is issued; the next one is held again.
    run_pairs(&fill, &double, pairs - 1);
    fill.schedule().unwrap();
    let last = double.schedule().unwrap();
    sys.shutdown().unwrap();
    last.wait()
        .expect("a shutdown issues the held calls, and they run");
    assert_eq!(sys.replay_stats().fallbacks.interrupted, 4);
}

/// One host thread writes a hosted node over and over while another runs a periodic loop
/// reading it (copied into `y`, doubled) and a third reads it back: the automatic replay
/// posts held calls that touch the node under its own lock, and the host write and read
/// hold the node's lock while they post. Neither may wait for the other's lock (the
/// automatic replay is told before a node's lock is taken): every thread finishes, and the
/// final values are the last write's.
#[test]
fn host_writes_and_reads_beside_replayed_calls_on_the_same_node_finish() {
    let sys = system(1, true);
    let Hosted { h, y, copy, double } = Hosted::new(&sys, 1.0);
    let rounds = 300;
    thread::scope(|s| {
        s.spawn(|| {
            for t in 0..rounds {
                sys.host_write(&h, &[(t % 7) as f32; N]).unwrap();
            }
        });
        s.spawn(|| {
            for _ in 0..rounds {
                assert_eq!(sys.host_read::<f32>(&h).unwrap().len(), N);
            }
        });
        let mut tickets = Vec::new();
        for _ in 0..rounds {
            tickets.push(copy.schedule().unwrap());
            tickets.push(double.schedule().unwrap());
        }
        wait_all(&mut tickets);
    });
    copy.schedule().unwrap();
    double.schedule().unwrap();
    let last = ((rounds - 1) % 7) as f32;
    assert_eq!(
        double.context().read::<f32>(&y).unwrap(),
        vec![2.0 * last; N]
    );
    sys.shutdown().unwrap();
}
