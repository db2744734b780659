//! Random programs on the engine, compared bitwise with the sequential reference
//! (DESIGN.md §1: any program behaves as if its operations ran one after another).
//!
//! `TRIBUTARY_PROPTEST_CASES` sets the number of programs (split over the two tests);
//! `TRIBUTARY_PROPTEST_SEED` (a number) replays a run. A failure prints the shrunk program
//! with the first operation whose result differs.

mod common;

use std::{sync::Arc, time::Duration, time::Instant};

use common::{
    engine_runner::EngineRunner,
    env_count,
    generator::{arb_program, resolve, AbsProgram, Profile},
    program::{compare, ProgramRunner},
    reference::ReferenceRunner,
    watchdog::Watchdog,
};
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

/// Programs per CI run, in total.
const DEFAULT_CASES: u64 = 2000;

fn check(abs: &AbsProgram) -> Result<(), TestCaseError> {
    let program = Arc::new(resolve(abs));
    let expected = ReferenceRunner.run(&program);
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
    let got = EngineRunner::cpu().run(&program);
    compare(&program, &expected, &got).map_err(TestCaseError::fail)
}

fn run(name: &str, profile: Profile, share: u64) {
    let cases = env_count("TRIBUTARY_PROPTEST_CASES", DEFAULT_CASES).div_ceil(share);
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
    match runner.run(&arb_program(profile), |abs| check(&abs)) {
        Ok(()) => eprintln!("{name}: {cases} programs in {:.1?}", start.elapsed()),
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
        },
        2,
    );
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
        },
        2,
    );
}
