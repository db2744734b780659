//! Runs a test body on every rank of an MPI job launched from `cargo test` (the cluster
//! suite, `tests/cluster/`).
//!
//! A cluster test is an ordinary `#[test]`: run by the harness, it launches
//! `mpirun -np N <this test binary> --exact <test path>` for each rank count it asks for (one at
//! a time, whatever the harness's threads), with `TRIBUTARY_CLUSTER_RANK_TEST=<test>` set;
//! in those processes the same test finds the variable, starts a [`Cluster`] and runs its
//! body as one rank. The launch passes when `mpirun` exits successfully and every rank
//! that should finish printed `rank R of N: ok`; a job still running after
//! `TRIBUTARY_CLUSTER_TIMEOUT` seconds (default 300) is killed and fails the test.
//!
//! Without the `mpi` feature or without `mpirun` the test prints
//! `skipping MPI (<test>): <reason>` and passes, unless `TRIBUTARY_REQUIRE_MPI=1` (set by
//! `.ci/run`), which makes that a failure.

use std::{
    io::Read,
    process::{Command, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

#[cfg(feature = "mpi")]
pub use tributary_actors::cluster::{Cluster, ClusterConfig};

/// The variable naming the test a rank process runs.
pub const RANK_TEST: &str = "TRIBUTARY_CLUSTER_RANK_TEST";

/// One MPI launch of a test.
#[derive(Clone, Debug)]
pub struct Launch {
    /// Ranks.
    pub ranks: usize,
    /// Extra `mpirun` arguments (e.g. `--enable-recovery` for a rank that dies).
    pub mpirun_args: Vec<String>,
    /// How many ranks must print their `ok` line (all, unless some are meant to die).
    pub finishing: usize,
}

impl Launch {
    /// `ranks` ranks, all finishing.
    pub fn ranks(ranks: usize) -> Launch {
        Launch {
            ranks,
            mpirun_args: Vec::new(),
            finishing: ranks,
        }
    }
}

static ONE_JOB_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Set by a body whose cluster lost a rank: its shutdown may then end in the fault
/// (`MPI_Finalize` waited for the dead rank past the deadline).
static A_RANK_IS_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Called by a body that saw a rank become unreachable (see [`A_RANK_IS_GONE`]).
pub fn a_rank_is_gone() {
    A_RANK_IS_GONE.store(true, std::sync::atomic::Ordering::SeqCst);
}

fn log(line: &str) {
    eprintln!("{line}");
}

/// Whether this process is a rank of `test`'s job.
pub fn is_rank_of(test: &str) -> bool {
    std::env::var(RANK_TEST).is_ok_and(|t| t == test)
}

/// Why MPI tests cannot run here, if they cannot.
fn unavailable() -> Option<String> {
    if !cfg!(feature = "mpi") {
        return Some(
            "built without the `mpi` feature (cargo test --features mpi; needs Open MPI and \
             libclang)"
                .into(),
        );
    }
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!("`mpirun --version` failed: {}", o.status)),
        Err(e) => Some(format!("mpirun not found: {e}")),
    }
}

/// Launches `test` under `mpirun` for each launch; the harness side of a cluster test.
pub fn launch(test: &str, launches: &[Launch]) {
    if let Some(reason) = unavailable() {
        if std::env::var("TRIBUTARY_REQUIRE_MPI").is_ok_and(|v| v == "1") {
            panic!("MPI test {test} cannot run and TRIBUTARY_REQUIRE_MPI=1: {reason}");
        }
        log(&format!("skipping MPI ({test}): {reason}"));
        return;
    }
    let _one = ONE_JOB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().expect("the test binary's path");
    let timeout = std::env::var("TRIBUTARY_CLUSTER_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(300), Duration::from_secs);
    for l in launches {
        let mut cmd = Command::new("mpirun");
        cmd.args(["--allow-run-as-root", "--oversubscribe", "-np"])
            .arg(l.ranks.to_string())
            .args(&l.mpirun_args)
            .arg(&exe)
            .args(["--exact", test, "--nocapture", "--test-threads", "1"])
            .env(RANK_TEST, test)
            .env("OMPI_MCA_pml", "ob1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let started = Instant::now();
        let mut child = cmd.spawn().expect("mpirun starts");
        let mut out = child.stdout.take().expect("stdout");
        let mut err = child.stderr.take().expect("stderr");
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let status = loop {
            if let Some(status) = child.try_wait().expect("mpirun status") {
                break Some(status);
            }
            if started.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stdout = reader.join().unwrap_or_default();
        let stderr = err_reader.join().unwrap_or_default();
        let oks = (0..l.ranks)
            .filter(|r| stdout.contains(&format!("rank {r} of {}: ok", l.ranks)))
            .count();
        let report = format!(
            "--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- {} ranks, {:.1} s",
            l.ranks,
            started.elapsed().as_secs_f64()
        );
        match status {
            None => panic!(
                "MPI test {test} on {} ranks hung past {timeout:?}\n{report}",
                l.ranks
            ),
            Some(s) if !s.success() => {
                panic!("MPI test {test} on {} ranks failed: {s}\n{report}", l.ranks)
            }
            Some(_) if oks < l.finishing => panic!(
                "MPI test {test} on {} ranks: {oks} ranks finished, {} expected\n{report}",
                l.ranks, l.finishing
            ),
            Some(_) => log(&format!(
                "MPI test {test}: {} ranks passed in {:.1} s",
                l.ranks,
                started.elapsed().as_secs_f64()
            )),
        }
    }
}

/// Runs `body` as this process's rank (inside a launch): starts the cluster from
/// `config`, runs the body, shuts down, and prints the `ok` line the harness looks for.
#[cfg(feature = "mpi")]
pub fn run_rank(config: ClusterConfig, body: impl FnOnce(&std::sync::Arc<Cluster>)) {
    let cluster = std::sync::Arc::new(
        Cluster::builder()
            .config(config)
            .spawn()
            .expect("cluster starts"),
    );
    let (rank, size) = (cluster.rank(), cluster.size());
    body(&cluster);
    let started = std::time::Instant::now();
    match cluster.shutdown() {
        Ok(_) => {}
        // MPI_Finalize waited for the dead rank: bounded by the deadline, and the fault
        // names the rank the body saw go.
        Err(tributary::Error::RankUnreachable {
            rank: gone, waited, ..
        }) if A_RANK_IS_GONE.load(std::sync::atomic::Ordering::SeqCst) => {
            assert_eq!(gone, size - 1, "the fault names the rank that went");
            assert!(
                started.elapsed() < waited + Duration::from_secs(20),
                "shutdown took {:?}",
                started.elapsed()
            );
            println!("rank {rank} of {size}: shutdown bounded by the deadline ({gone} is gone)");
        }
        Err(e) => panic!("rank {rank}: the cluster does not shut down: {e:?}"),
    }
    println!("rank {rank} of {size}: ok");
}

/// The test harness's name of the test `path` (a `module_path!()` and the function's name):
/// the path without its first component, the test crate (`cluster::cluster_faults::t` is
/// the test `cluster_faults::t`, what `--exact` selects).
pub fn test_name(path: &str) -> &str {
    path.split_once("::").map_or(path, |(_, rest)| rest)
}

/// A cluster test: `#[test] fn name()` that launches itself under `mpirun` with the given
/// launches and, in each rank, runs `body(&Cluster)` on a cluster of `config`. The rank
/// processes run the test by its full path in the test binary (`module::name`).
#[macro_export]
macro_rules! cluster_test {
    ($name:ident, [$($launch:expr),* $(,)?], $config:expr, $body:expr) => {
        #[test]
        fn $name() {
            let test =
                $crate::cluster::test_name(concat!(module_path!(), "::", stringify!($name)));
            if $crate::cluster::is_rank_of(test) {
                #[cfg(feature = "mpi")]
                $crate::cluster::run_rank($config, $body);
                return;
            }
            $crate::cluster::launch(test, &[$($launch),*]);
        }
    };
}
