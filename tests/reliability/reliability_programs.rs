//! Random programs on the engine and the actor system, on the CPU, Vulkan and CUDA, compared
//! bitwise with the sequential reference (DESIGN.md §1: any program behaves as if its
//! operations ran one after another).
//!
//! `TRIBUTARY_PROPTEST_CASES` sets the number of CPU programs (split over the tests: 40%
//! small, 40% large, 10% with stalled streams on the engine, 5% + 5% on the actor system,
//! 20% with captured and replayed steps on the engine, and 10% with repeated windows on
//! the actor system with its automatic replay on);
//! Vulkan, where it runs, adds 50% on the engine and 5% on the actor system (lavapipe in
//! CI, where `TRIBUTARY_REQUIRE_VULKAN=1` makes a skip a failure), and CUDA the same where
//! a GPU is (`TRIBUTARY_REQUIRE_CUDA=1` in `scripts/gpu-check.sh`);
//! `TRIBUTARY_PROPTEST_SEED` (a number) replays a run. A failure prints the shrunk program
//! with the first operation whose result differs; `TRIBUTARY_TRACE_OPS=1` prints each
//! operation's index as the engine runner starts it (to find the one a hang is in).

use common::{
    engine_runner::{EngineRunner, REPLAYED, REPLAYS_INVALIDATED},
    env_count,
    generator::{arb_program, resolve, resolve_for, AbsProgram, Profile},
    graph::GraphTotals,
    program::*,
    reference::{ReferenceRunner, Streaming},
    steps::{with_captured_steps, with_repeated_windows},
    system_runner::{auto_replayed, SystemRunner, SYSTEM_REPLAYED, SYSTEM_REPLAYS_INVALIDATED},
    watchdog::Watchdog,
};
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};
use tributary::{
    backend::{
        cpu::{CpuBackend, CpuConfig},
        cuda::{CudaBackend, CudaConfig},
        fault::{Fault, FaultBackend, FaultRule, FaultRules, Target},
        vulkan::{VulkanBackend, VulkanConfig},
    },
    DeviceId, Engine, StreamId,
};
use tributary_testkit::{common, support};

/// CPU programs per CI run, in total (about 30 s in a debug build on 2 cores; the 2,200
/// Vulkan programs this adds take about 90 s on lavapipe).
const DEFAULT_CASES: u64 = 4000;

fn check(abs: &AbsProgram) -> Result<(), TestCaseError> {
    check_on(abs, &mut EngineRunner::recording_cpu())
}

/// The engine with some streams stalled: a plan of a stalled stream starts only 0.2 ms
/// after its submission, which shuffles the interleavings the plain runs see. Half the
/// programs run on a CPU pool of one worker (every stream whose plan waits must give the
/// worker back), a quarter with workers that never spin (every wait parks).
fn check_stalled(abs: &AbsProgram) -> Result<(), TestCaseError> {
    let cpu = common::engine_runner::exact_cpu()
        .with_workers(1 + abs.ops.len() % 2)
        .with_spin(if abs.ops.len() % 4 < 2 {
            Duration::ZERO
        } else {
            CpuConfig::default().spin()
        });
    let stalled: Vec<(usize, usize)> = (0..abs.devices)
        .flat_map(|d| (0..abs.streams).map(move |s| (d, s)))
        .filter(|&(d, s)| (d * 7 + s * 3 + abs.ops.len()) % 3 == 0)
        .collect();
    let mut runner = EngineRunner::recording("engine(cpu, stalls)", move |setup| {
        let rules = FaultRules::default();
        for &(device, index) in &stalled {
            rules.add(FaultRule::always(
                Target::work().stream(StreamId {
                    device: DeviceId(device as u32),
                    index: index as u32,
                }),
                Fault::Delay(Duration::from_micros(200)),
            ));
        }
        let cpu = CpuBackend::with_config(DeviceId(0), setup.devices, cpu.clone())?;
        Ok(Arc::new(FaultBackend::new(Arc::new(cpu), rules)))
    });
    check_on(abs, &mut runner)
}

/// The same programs on the actor system.
fn check_system(abs: &AbsProgram) -> Result<(), TestCaseError> {
    check_on(abs, &mut SystemRunner::cpu())
}

/// The Vulkan configuration for a program's setup: one logical device per program device.
fn vulkan_for(setup: &Setup, staging: bool) -> VulkanConfig {
    VulkanConfig {
        devices: Some(setup.devices),
        force_staging: staging,
        ..VulkanConfig::default()
    }
}

/// The engine on Vulkan (lavapipe in CI): a fresh backend with the program's devices,
/// host transfers and cross-device copies through staging buffers (`staging`) or directly
/// through the pool memory where it is mapped and coherent.
fn check_vulkan(abs: &AbsProgram, staging: bool) -> Result<(), TestCaseError> {
    let mut runner = EngineRunner::recording("engine(vulkan)", move |setup| {
        Ok(Arc::new(VulkanBackend::new(
            DeviceId(0),
            vulkan_for(setup, staging),
        )?))
    });
    check_against(abs, vulkan_reference(), &mut runner)
}

/// What Vulkan computes: the CPU's values, but no streaming across logical devices.
fn vulkan_reference() -> ReferenceRunner {
    ReferenceRunner::streaming(Streaming::SameDevice)
}

/// The actor system on Vulkan.
fn check_system_vulkan(abs: &AbsProgram) -> Result<(), TestCaseError> {
    let staging = abs.ops.len() % 2 == 0;
    let mut runner = SystemRunner::recording("system(vulkan)", move |setup| {
        Ok(Arc::new(VulkanBackend::new(
            DeviceId(0),
            vulkan_for(setup, staging),
        )?))
    });
    check_against(abs, vulkan_reference(), &mut runner)
}

fn check_on(abs: &AbsProgram, runner: &mut dyn ProgramRunner) -> Result<(), TestCaseError> {
    check_against(abs, ReferenceRunner::default(), runner)
}

/// Checks `runner` against `reference` (which knows what the backend can stream).
fn check_against(
    abs: &AbsProgram,
    reference: ReferenceRunner,
    runner: &mut dyn ProgramRunner,
) -> Result<(), TestCaseError> {
    let program = resolve_for(abs, reference.streaming);
    check_program(program, reference, runner)
}

/// Checks `runner` against `reference` on a resolved program.
fn check_program(
    program: Program,
    mut reference: ReferenceRunner,
    runner: &mut dyn ProgramRunner,
) -> Result<(), TestCaseError> {
    let program = Arc::new(program);
    let expected = reference.run(&program);
    if let Some((i, e)) = expected
        .results
        .iter()
        .enumerate()
        .find(|(_, r)| r.is_err())
    {
        return Err(TestCaseError::fail(format!(
            "the reference refused operation {i} of a resolved program ({e:?}):\n{}",
            program.marked(Some(i))
        )));
    }
    let shown = program.clone();
    let _watchdog = Watchdog::arm(Duration::from_secs(300), move || shown.to_string());
    let got = runner.run(&program);
    // The graph first: a missing edge explains a wrong value, and is a bug even when the
    // values came out right.
    check_graph(&program, runner)?;
    compare(&program, &expected, &got).map_err(TestCaseError::fail)
}

thread_local! {
    /// The graph checks of the current test (each test runs on its own thread).
    static GRAPH: std::cell::RefCell<GraphTotals> = std::cell::RefCell::default();
}

/// Fails the program if the run's dependency graph misses a required ordering (for runners
/// that record one), printing the program with the later operation marked and every
/// missing edge, or if a pool release was placed past the issue clock (where plans made
/// later could come before it); adds the counts to the test's totals.
fn check_graph(program: &Program, runner: &dyn ProgramRunner) -> Result<(), TestCaseError> {
    let Some(report) = runner.graph() else {
        return Ok(());
    };
    GRAPH.with(|g| g.borrow_mut().add(&report));
    if !report.misplaced.is_empty() {
        return Err(TestCaseError::fail(format!(
            "{}: pool releases placed past the issue clock\n{}\n\n{}",
            runner.name(),
            report.misplaced.join("\n"),
            program.marked(None)
        )));
    }
    let Some(first) = report.missing.first() else {
        return Ok(());
    };
    let edges: Vec<String> = report.missing.iter().map(|m| m.to_string()).collect();
    Err(TestCaseError::fail(format!(
        "{}: {} of {} required orderings are not implied by the emitted dependency graph\n{}\n\n{}",
        runner.name(),
        report.missing.len(),
        report.required,
        edges.join("\n"),
        program.marked(Some(first.after_op))
    )))
}

fn run(
    name: &str,
    profile: Profile,
    percent: u64,
    check: fn(&AbsProgram) -> Result<(), TestCaseError>,
) {
    let cases = (env_count("TRIBUTARY_PROPTEST_CASES", DEFAULT_CASES) * percent).div_ceil(100);
    let seed = env_count("TRIBUTARY_PROPTEST_SEED", rand_seed());
    let config = Config {
        cases: cases as u32,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    };
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8..16].copy_from_slice(&(name.len() as u64).to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &bytes);
    let mut runner = TestRunner::new_with_rng(config, rng);
    let start = Instant::now();
    eprintln!("{name}: {cases} programs, TRIBUTARY_PROPTEST_SEED={seed}");
    GRAPH.with(|g| *g.borrow_mut() = GraphTotals::default());
    match runner.run(&arb_program(profile), |abs| check(&abs)) {
        Ok(()) => {
            eprintln!("{name}: {cases} programs in {:.1?}", start.elapsed());
            let totals = GRAPH.with(|g| *g.borrow());
            if totals.programs > 0 {
                eprintln!("{name}: {totals}");
            }
        }
        Err(TestError::Fail(reason, _)) => {
            panic!("{name} (TRIBUTARY_PROPTEST_SEED={seed}): minimal failing program:\n{reason}")
        }
        Err(e) => panic!("{name} (TRIBUTARY_PROPTEST_SEED={seed}): {e}"),
    }
}

fn rand_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Short programs on few devices: the common case, many of them.
#[test]
fn small_programs_match_the_reference() {
    run(
        "small",
        Profile {
            max_devices: 2,
            max_streams: 2,
            max_nodes: 4,
            max_ops: 60,
            hosted: true,
        },
        40,
        check,
    );
}

/// Captured steps (issue 18): programs on the engine whose windows of schedules and
/// copies are captured once and replayed 1 to 3 times (`common::steps`), against the
/// reference issuing the calls again; the dependency graph of every replayed plan is
/// checked as any other's. Fails if no replay was planned at all (every one refused as
/// invalidated would test nothing).
#[test]
fn captured_steps_match_the_reference() {
    run_steps("steps", 20, check_steps, (&REPLAYED, &REPLAYS_INVALIDATED));
}

fn check_steps(abs: &AbsProgram) -> Result<(), TestCaseError> {
    check_program(
        stepped(abs),
        ReferenceRunner::default(),
        &mut EngineRunner::recording_cpu(),
    )
}

/// Captured steps on the actor system: the programs of `captured_steps_match_the_reference`,
/// captured with `System::capture` and replayed with `System::replay` (one operation per
/// device per replay), against the reference issuing the calls again; dependency graphs
/// checked. Fails if no replay was planned at all.
#[test]
fn system_captured_steps_match_the_reference() {
    run_steps(
        "system-steps",
        10,
        check_system_steps,
        (&SYSTEM_REPLAYED, &SYSTEM_REPLAYS_INVALIDATED),
    );
}

fn check_system_steps(abs: &AbsProgram) -> Result<(), TestCaseError> {
    check_program(
        stepped(abs),
        ReferenceRunner::default(),
        &mut SystemRunner::cpu(),
    )
}

/// Runs `check` on `percent` of the cases over the captured-step programs' profile, then
/// fails unless the runner's counters (`replayed`, `invalidated`) show a replay planned.
fn run_steps(
    name: &str,
    percent: u64,
    check: fn(&AbsProgram) -> Result<(), TestCaseError>,
    (replayed, invalidated): (&AtomicU64, &AtomicU64),
) {
    run(
        name,
        Profile {
            max_devices: 3,
            max_streams: 2,
            max_nodes: 5,
            max_ops: 80,
            hosted: true,
        },
        percent,
        check,
    );
    let (replayed, invalidated) = (
        replayed.load(Ordering::Relaxed),
        invalidated.load(Ordering::Relaxed),
    );
    eprintln!("{name}: {replayed} replays planned, {invalidated} refused as invalidated");
    assert!(replayed > 0, "{name}: no captured step was replayed");
}

/// The automatic replay (issue 31): programs whose windows of schedules and copies are
/// repeated 4 to 7 times as plain calls, between calls that do not repeat (reads, host
/// writes, finalizes, syncs inside a repetition), on actor systems with the automatic
/// replay on, against the reference; dependency graphs checked. Fails if no call was
/// replayed at all.
#[test]
fn system_auto_replay_matches_the_reference() {
    run("system-auto", STEPS_PROFILE, 10, check_system_auto);
    let (calls, periods) = auto_replayed();
    eprintln!("system-auto: {periods} periods recognised, {calls} calls replayed");
    assert!(calls > 0, "the automatic replay replayed nothing");
}

fn check_system_auto(abs: &AbsProgram) -> Result<(), TestCaseError> {
    let program = resolve_for(abs, ReferenceRunner::default().streaming);
    check_program(
        with_repeated_windows(&program, &ReferenceRunner::default),
        ReferenceRunner::default(),
        &mut SystemRunner::cpu().with_auto_replay(),
    )
}

/// The profile of the programs with captured or repeated windows.
const STEPS_PROFILE: Profile = Profile {
    max_devices: 3,
    max_streams: 2,
    max_nodes: 5,
    max_ops: 80,
    hosted: true,
};

/// `abs` resolved for the CPU reference, its windows captured and replayed.
fn stepped(abs: &AbsProgram) -> Program {
    let program = resolve_for(abs, ReferenceRunner::default().streaming);
    with_captured_steps(&program, &ReferenceRunner::default)
}

/// Up to 200 operations over up to 4 devices x 3 streams.
#[test]
fn large_programs_match_the_reference() {
    run(
        "large",
        Profile {
            max_devices: 4,
            max_streams: 3,
            max_nodes: 8,
            max_ops: 200,
            hosted: true,
        },
        40,
        check,
    );
}

/// Programs on the actor system (`tributary-actors`): the same generator and reference,
/// all memory modes, up to 4 devices x 3 streams (`TRIBUTARY_SYSTEM_DEVICES` lowers the
/// device bound).
///
/// On several devices these programs found that the shared host table followed the order
/// in which device actors processed their messages; host-table updates now carry
/// program-order stamps and host-array transfers (also those of coordinator-scheduled
/// consumers) are fenced across devices.
#[test]
fn system_programs_match_the_reference() {
    run(
        "system",
        Profile {
            max_devices: env_count("TRIBUTARY_SYSTEM_DEVICES", 4).clamp(1, 4) as usize,
            max_streams: 3,
            max_nodes: 6,
            max_ops: 150,
            hosted: true,
        },
        5,
        check_system,
    );
}

/// Device-only programs on the actor system, up to 4 devices x 3 streams.
#[test]
fn system_device_programs_match_the_reference() {
    run(
        "system-devices",
        Profile {
            max_devices: 4,
            max_streams: 3,
            max_nodes: 6,
            max_ops: 150,
            hosted: false,
        },
        5,
        check_system,
    );
}

/// Whether the Vulkan programs run here; when not, the reason is printed (and the test
/// fails instead under `TRIBUTARY_REQUIRE_VULKAN=1`).
fn vulkan_runs_here(test: &str) -> bool {
    support::vulkan_config(support::Kind::Vulkan, 4, test).is_some()
}

/// Programs of the Vulkan tests: up to 4 logical devices x 3 streams, all memory modes.
const VULKAN_PROFILE: Profile = Profile {
    max_devices: 4,
    max_streams: 3,
    max_nodes: 6,
    max_ops: 150,
    hosted: true,
};

/// The engine on Vulkan, up to 4 logical devices x 3 streams, host transfers through
/// staging buffers as on a discrete GPU. Kernels are the CPU's bit for bit
/// (`backend_conformance`), so the comparison stays bitwise.
///
/// This and the next test were one, alternating the two kinds of transfer by the program's
/// length. Apart, a shrunk failure keeps its kind of transfer, and the two halves (the
/// suite's longest test, ~75 s each in a debug build on lavapipe) run on both of the test
/// harness's threads instead of one.
#[test]
fn vulkan_programs_with_staged_transfers_match_the_reference() {
    if vulkan_runs_here("vulkan_programs_with_staged_transfers_match_the_reference") {
        run("vulkan-staged", VULKAN_PROFILE, 25, |abs| {
            check_vulkan(abs, true)
        });
    }
}

/// The same, host transfers and cross-device copies directly through the pool memory where
/// it is mapped and coherent (lavapipe's memory is host-visible and coherent).
#[test]
fn vulkan_programs_with_mapped_transfers_match_the_reference() {
    if vulkan_runs_here("vulkan_programs_with_mapped_transfers_match_the_reference") {
        run("vulkan-mapped", VULKAN_PROFILE, 25, |abs| {
            check_vulkan(abs, false)
        });
    }
}

/// The actor system on Vulkan.
#[test]
fn vulkan_system_programs_match_the_reference() {
    if vulkan_runs_here("vulkan_system_programs_match_the_reference") {
        run("vulkan-system", VULKAN_PROFILE, 5, check_system_vulkan);
    }
}

/// Captured steps on Vulkan (issue 18): programs whose windows of schedules and copies are
/// captured and replayed, on the engine and on the actor system (index values as push
/// constants), against the reference issuing the calls again; dependency graphs checked.
#[test]
fn vulkan_captured_steps_match_the_reference() {
    if vulkan_runs_here("vulkan_captured_steps_match_the_reference") {
        run(
            "vulkan-steps",
            Profile {
                max_devices: 3,
                max_streams: 2,
                max_nodes: 5,
                max_ops: 80,
                hosted: true,
            },
            5,
            check_vulkan_steps,
        );
        let (engine, system) = (
            REPLAYED.load(Ordering::Relaxed),
            SYSTEM_REPLAYED.load(Ordering::Relaxed),
        );
        eprintln!("vulkan steps: {engine} engine and {system} system replays planned");
        assert!(engine > 0 && system > 0, "no captured step was replayed");
    }
}

/// The automatic replay on Vulkan: the programs of `system_auto_replay_matches_the_reference`
/// on actor systems over lavapipe (index values as push constants of the recorded
/// programs), against the reference; dependency graphs checked.
#[test]
fn vulkan_system_auto_replay_matches_the_reference() {
    if vulkan_runs_here("vulkan_system_auto_replay_matches_the_reference") {
        run("vulkan-auto", STEPS_PROFILE, 3, check_vulkan_auto);
        let (calls, _) = auto_replayed();
        eprintln!("vulkan-auto: {calls} calls replayed");
        assert!(calls > 0, "the automatic replay replayed nothing");
    }
}

fn check_vulkan_auto(abs: &AbsProgram) -> Result<(), TestCaseError> {
    let program = resolve_for(abs, vulkan_reference().streaming);
    let staging = abs.ops.len() % 2 == 0;
    check_program(
        with_repeated_windows(&program, &vulkan_reference),
        vulkan_reference(),
        &mut SystemRunner::recording("system(vulkan)", move |setup| {
            Ok(Arc::new(VulkanBackend::new(
                DeviceId(0),
                vulkan_for(setup, staging),
            )?))
        })
        .with_auto_replay(),
    )
}

fn check_vulkan_steps(abs: &AbsProgram) -> Result<(), TestCaseError> {
    let program = resolve_for(abs, vulkan_reference().streaming);
    let stepped = with_captured_steps(&program, &vulkan_reference);
    let backend = |setup: &Setup| -> tributary::Result<Arc<dyn tributary::backend::Backend>> {
        Ok(Arc::new(VulkanBackend::new(
            DeviceId(0),
            vulkan_for(setup, false),
        )?))
    };
    check_program(
        stepped.clone(),
        vulkan_reference(),
        &mut EngineRunner::recording("engine(vulkan)", backend),
    )?;
    check_program(
        stepped,
        vulkan_reference(),
        &mut SystemRunner::recording("system(vulkan)", backend),
    )
}

/// The CUDA configuration for a program's setup: one logical device per program device
/// (round-robin over the GPUs, sharing a context per GPU as the tests are configured to),
/// every other program with copies across devices staged.
fn cuda_for(setup: &Setup, staging: bool) -> CudaConfig {
    CudaConfig {
        force_staging: staging,
        ..support::cuda_configured(setup.devices)
    }
}

/// What CUDA computes: the CPU's values, streaming across devices only where the backend
/// can (peer access, or a shared context).
fn cuda_reference() -> ReferenceRunner {
    if support::Kind::Cuda.streams_across_devices() {
        ReferenceRunner::default()
    } else {
        ReferenceRunner::streaming(Streaming::SameDevice)
    }
}

/// The engine on CUDA.
fn check_cuda(abs: &AbsProgram) -> Result<(), TestCaseError> {
    let staging = abs.ops.len() % 2 == 1;
    let mut runner = EngineRunner::recording("engine(cuda)", move |setup| {
        Ok(Arc::new(CudaBackend::new(
            DeviceId(0),
            cuda_for(setup, staging),
        )?))
    });
    check_against(abs, cuda_reference(), &mut runner)
}

/// The actor system on CUDA.
fn check_system_cuda(abs: &AbsProgram) -> Result<(), TestCaseError> {
    let staging = abs.ops.len() % 2 == 0;
    let mut runner = SystemRunner::recording("system(cuda)", move |setup| {
        Ok(Arc::new(CudaBackend::new(
            DeviceId(0),
            cuda_for(setup, staging),
        )?))
    });
    check_against(abs, cuda_reference(), &mut runner)
}

/// The engine on CUDA where a GPU is, with the Vulkan tests' profile.
#[test]
fn cuda_programs_match_the_reference() {
    if support::cuda_config(4, "cuda_programs_match_the_reference").is_some() {
        run("cuda", VULKAN_PROFILE, 50, check_cuda);
    }
}

/// The actor system on CUDA where a GPU is.
#[test]
fn cuda_system_programs_match_the_reference() {
    if support::cuda_config(4, "cuda_system_programs_match_the_reference").is_some() {
        run("cuda-system", VULKAN_PROFILE, 5, check_system_cuda);
    }
}

/// Mid-sized programs with some streams stalled.
#[test]
fn stalled_programs_match_the_reference() {
    run(
        "stalled",
        Profile {
            max_devices: 3,
            max_streams: 3,
            max_nodes: 6,
            max_ops: 100,
            hosted: true,
        },
        10,
        check_stalled,
    );
}

fn f32_node(dims: &[usize], mode: Mode) -> NodeDecl {
    NodeDecl {
        dtype: Dt::F32,
        dims: dims.to_vec(),
        mode,
        zeroed: true,
    }
}

/// Programs that once failed on the engine, shrunk, kept as regression tests.
fn known_programs() -> Vec<(&'static str, Program)> {
    let mut known = Vec::new();

    // Nodes whose size is not a multiple of the pool alignment (64 bytes): kernels got
    // views of the rounded allocation size and refused them; transfers and reads of
    // 4000-byte host arrays asked for 4032 bytes.
    let (h, i, g) = (N(0), N(1), N(2));
    let mut b = Builder::new(
        2,
        1,
        vec![
            f32_node(&[1000], Mode::Hosted(Share::Unset)),
            NodeDecl {
                dtype: Dt::I32,
                dims: vec![3],
                mode: Mode::OnDevice(Share::Unset),
                zeroed: true,
            },
            f32_node(&[10, 100], Mode::OnDevice(Share::Unset)),
        ],
    );
    let c0 = b.root(0, 0);
    let c1 = b.init(c0, h, Data::Fractions(1));
    let (fill, c2) = b.link(c1, Kernel::Fill { dst: i, value: 5.0 });
    let (copy, c3) = b.link(c2, Kernel::Copy { dst: g, src: h });
    b.schedule(fill).schedule(copy);
    b.op(Op::Read { ctx: c3, node: g });
    b.op(Op::Read { ctx: c3, node: i });
    let d1 = b.root(1, 0);
    let (merge, c5) = b.link(d1, Kernel::AddMerge { dst: g });
    b.d2d(g, c3, c5, D2d::Copy).schedule(merge);
    b.d2d(g, c3, c5, D2d::StreamingFor(merge));
    b.op(Op::Read { ctx: c5, node: g });
    b.op(Op::ToHost { ctx: c1, node: h });
    b.op(Op::HostRead { node: h });
    b.op(Op::Checkpoint).op(Op::Teardown);
    known.push(("odd sizes", b.build()));

    // A fresh buffer of a hosted node claimed to hold host version 0 (zeros), but a
    // transfer to the host had changed the array without a version change: the merge
    // read 0 + 0.1 instead of 0.1 + 0.1.
    let w = N(0);
    let mut b = Builder::new(1, 1, vec![f32_node(&[4], Mode::Hosted(Share::Unset))]);
    let c0 = b.root(0, 0);
    let (fill, c1) = b.link(c0, Kernel::Fill { dst: w, value: 0.1 });
    b.schedule(fill).op(Op::ToHost { ctx: c1, node: w });
    let (merge, c2) = b.link(c0, Kernel::AddMerge { dst: w });
    b.d2d(w, c1, c2, D2d::StreamingFor(merge));
    b.op(Op::Read { ctx: c2, node: w });
    b.op(Op::Teardown);
    known.push((
        "fresh hosted buffer after a transfer to the host",
        b.build(),
    ));

    // A copy from a buffer that lags a host write counted as the newest device value, so
    // the next host read transferred it over the host write (the write was lost).
    let w = N(0);
    let mut b = Builder::new(2, 1, vec![f32_node(&[4], Mode::Hosted(Share::Unset))]);
    let (c0, c1) = (b.root(0, 0), b.root(1, 0));
    let (one, c2) = b.link(c0, Kernel::Fill { dst: w, value: 1.0 });
    let (two, c3) = b.link(c1, Kernel::Fill { dst: w, value: 2.0 });
    b.schedule(one).schedule(two);
    b.op(Op::HostWrite {
        node: w,
        data: Data::Ints(3),
    });
    b.d2d(w, c2, c3, D2d::No);
    b.op(Op::HostRead { node: w });
    b.op(Op::Read { ctx: c3, node: w });
    b.op(Op::Teardown);
    known.push(("copy from a buffer that lags a host write", b.build()));

    // Copies and reads of buffers that lag a host write read the stale device bytes: a
    // `read`, a merge-buffer `Copy`, a `StreamingFor` consumer, a copy into a buffer.
    let w = N(0);
    let mut b = Builder::new(2, 1, vec![f32_node(&[4], Mode::Hosted(Share::PerStream))]);
    let (c0, c1) = (b.root(0, 0), b.root(1, 0));
    let (one, c2) = b.link(c0, Kernel::Fill { dst: w, value: 1.0 });
    let (fill, c3) = b.link(c1, Kernel::Fill { dst: w, value: 0.0 });
    let (merge, c4) = b.link(c3, Kernel::AddMerge { dst: w });
    b.schedule(one).schedule(fill).op(Op::Sync);
    b.op(Op::HostWrite {
        node: w,
        data: Data::Ints(11),
    });
    b.op(Op::Read { ctx: c2, node: w });
    b.d2d(w, c2, c4, D2d::Copy).schedule(merge);
    b.op(Op::Read { ctx: c4, node: w });
    b.op(Op::HostWrite {
        node: w,
        data: Data::Ints(11),
    });
    b.d2d(w, c2, c4, D2d::StreamingFor(merge));
    b.op(Op::Read { ctx: c4, node: w });
    b.op(Op::HostWrite {
        node: w,
        data: Data::Ints(11),
    });
    b.d2d(w, c2, c4, D2d::No);
    b.op(Op::Read { ctx: c4, node: w });
    b.op(Op::Teardown);
    known.push((
        "copies and reads of buffers that lag a host write",
        b.build(),
    ));

    // Per-schedule bindings: one routine scheduled with two values around a reader of its
    // output; the reader sees the first value, the buffer ends with the second (f32 and
    // i32), every value a snapshot of its own schedule.
    let (a, r, i) = (N(0), N(1), N(2));
    let mut b = Builder::new(
        1,
        2,
        vec![
            f32_node(&[64], Mode::OnDevice(Share::Shared)),
            f32_node(&[64], Mode::OnDevice(Share::Unset)),
            NodeDecl {
                dtype: Dt::I32,
                dims: vec![3],
                mode: Mode::OnDevice(Share::Unset),
                zeroed: false,
            },
        ],
    );
    let (c0, c1) = (b.root(0, 0), b.root(0, 1));
    let (stamp, c2) = b.link(c0, Kernel::FillIndex { dst: a });
    let (copy, c3) = b.link(c1, Kernel::Copy { dst: r, src: a });
    let (stamp_i, c4) = b.link(c2, Kernel::FillIndex { dst: i });
    b.schedule_with(stamp, 3)
        .schedule(copy)
        .schedule_with(stamp, -4)
        .schedule_with(stamp_i, -7)
        .schedule_with(stamp_i, i64::from(i32::MAX));
    b.op(Op::Read { ctx: c3, node: r });
    b.op(Op::Read { ctx: c2, node: a });
    b.op(Op::Read { ctx: c4, node: i });
    b.op(Op::Checkpoint).op(Op::Teardown);
    known.push(("a routine scheduled with two values", b.build()));
    known
}

#[test]
fn known_programs_match_the_reference() {
    for (name, program) in known_programs() {
        let expected = ReferenceRunner::default().run(&program);
        if let Some(i) = expected.results.iter().position(|r| r.is_err()) {
            panic!(
                "{name}: the reference refused operation {i}: {:?}",
                expected.results[i]
            );
        }
        let got = EngineRunner::cpu().run(&program);
        if let Err(diff) = compare(&program, &expected, &got) {
            panic!("{name}: {diff}");
        }
        let got = SystemRunner::cpu().run(&program);
        if let Err(diff) = compare(&program, &expected, &got) {
            panic!("{name} (system): {diff}");
        }
    }
    // The second program's value, spelled out.
    let (_, program) = &known_programs()[1];
    let out = ReferenceRunner::default().run(program);
    let read = &out.results[program.ops.len() - 2];
    assert_eq!(read, &Ok(Obs::Values(Values::f32s(&[0.1f32 + 0.1; 4]))));
    // The third's: the host keeps its write, and so does the copy: its source lagged the
    // write, so it was uploaded before the copy read it.
    let (_, program) = &known_programs()[2];
    let out = ReferenceRunner::default().run(program);
    let n = program.ops.len();
    let written = Values::f32s(&Data::Ints(3).f32s(4));
    assert_eq!(out.results[n - 3], Ok(Obs::Values(written.clone())));
    assert_eq!(out.results[n - 2], Ok(Obs::Values(written)));
    // The fourth's: every copy and read after a host write of h sees h, never the stale
    // 1s: h (read), h + h (merge copy; the consumer's own buffer lagged too, so it was
    // uploaded), h + h (streamed), h (copy into a buffer).
    let (_, program) = &known_programs()[3];
    let out = ReferenceRunner::default().run(program);
    let values: Vec<_> = out
        .results
        .iter()
        .filter_map(|r| match r {
            Ok(Obs::Values(v)) => Some(v.clone()),
            _ => None,
        })
        .collect();
    let h = |k: f32| {
        let v: Vec<f32> = Data::Ints(11).f32s(4).iter().map(|x| k * x).collect();
        Values::f32s(&v)
    };
    assert_eq!(values, vec![h(1.0), h(2.0), h(2.0), h(1.0)]);
}

/// The generator covers stale reads: host writes followed by reads of the buffers they made
/// lag and by copies from them in all three modes, on backends that stream across devices
/// and on those that stream only within one (Vulkan).
#[test]
fn generated_programs_read_and_copy_lagging_buffers_in_every_mode() {
    use common::reference::Reference;
    use proptest::strategy::{Strategy, ValueTree};
    let profile = Profile {
        max_devices: 2,
        max_streams: 2,
        max_nodes: 4,
        max_ops: 60,
        hosted: true,
    };
    for streaming in [Streaming::AnyDevice, Streaming::SameDevice] {
        let mut runner = TestRunner::new_with_rng(
            Config::default(),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
        );
        let mut counts = [0usize; 4];
        for _ in 0..300 {
            let abs = arb_program(profile)
                .new_tree(&mut runner)
                .expect("program")
                .current();
            let program = resolve_for(&abs, streaming);
            let mut reference = Reference::with_streaming(&program.setup, streaming);
            for op in &program.ops {
                reference.apply(op).expect("a resolved program is valid");
            }
            for (c, n) in counts.iter_mut().zip(reference.lagging_reads) {
                *c += n;
            }
        }
        eprintln!(
            "{streaming:?}: lagging reads, No, Copy, StreamingFor in 300 programs: {counts:?}"
        );
        assert!(
            counts.iter().all(|&c| c > 0),
            "{streaming:?}: lagging reads, No, Copy, StreamingFor: {counts:?}"
        );
    }
}

/// The generator schedules routines with bindings, and the same routine with several
/// values in one program (so a run that saw another schedule's value would show).
#[test]
fn generated_programs_schedule_routines_with_several_values() {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::strategy::{Strategy, ValueTree};
    let profile = Profile {
        max_devices: 2,
        max_streams: 2,
        max_nodes: 4,
        max_ops: 60,
        hosted: true,
    };
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[9; 32]),
    );
    let (mut with, mut several) = (0, 0);
    for _ in 0..300 {
        let abs = arb_program(profile)
            .new_tree(&mut runner)
            .expect("program")
            .current();
        let program = resolve(&abs);
        let mut values: BTreeMap<R, BTreeSet<i64>> = BTreeMap::new();
        for op in &program.ops {
            if let Op::ScheduleWith { routine, t } = op {
                with += 1;
                values.entry(*routine).or_default().insert(*t);
            }
        }
        several += values.values().filter(|v| v.len() > 1).count();
    }
    eprintln!("300 programs: {with} schedules with a value, {several} routines with several");
    assert!(with > 0 && several > 0, "{with} {several}");
}

/// A raw device read is not a `read`: it shows the stale bytes of a buffer that lags a host
/// write, where `read` shows the host's value (which a routine would upload first).
#[test]
fn read_device_raw_shows_the_stale_buffer() {
    use tributary::{kernels, EngineConfig, HostedKind, MemoryMode, Sharing};
    let mut e = Engine::cpu(EngineConfig::default()).expect("engine");
    let w = tributary::TensorNode::new("w", tributary::DType::F32, vec![4])
        .with_mode(MemoryMode::Hosted(HostedKind::ChangedOnDevices(
            Sharing::Unset,
        )))
        .expect("mode");
    let root = e.context(0, 0).expect("context");
    let fill = e
        .link(&root, kernels::fill(&w, 1.0).expect("spec"))
        .expect("link");
    e.schedule(&fill).expect("schedule");
    e.host_write(&w, &[3.0f32; 4]).expect("host write");
    let ctx = fill.context();
    assert_eq!(e.read::<f32>(ctx, &w).expect("read"), vec![3.0; 4]);
    assert_eq!(
        e.read_device_raw::<f32>(ctx, &w).expect("raw"),
        vec![1.0; 4]
    );
    // Reading changed nothing: the buffer still lags, a routine still uploads.
    assert_eq!(
        e.read_device_raw::<f32>(ctx, &w).expect("raw"),
        vec![1.0; 4]
    );
    let sys = tributary_actors::System::builder().spawn().expect("system");
    let root = sys.context(0, 0).expect("context");
    let fill = root
        .link(kernels::fill(&w, 1.0).expect("spec"))
        .expect("link");
    fill.schedule().expect("schedule").wait().expect("fill");
    sys.host_write(&w, &[3.0f32; 4]).expect("host write");
    let ctx = fill.context();
    assert_eq!(ctx.read::<f32>(&w).expect("read"), vec![3.0; 4]);
    assert_eq!(ctx.read_device_raw::<f32>(&w).expect("raw"), vec![1.0; 4]);
    sys.shutdown().expect("shutdown");
}
