//! An idle `System` uses (almost) no CPU: its workers and waiters spin for a few tens of
//! microseconds after their last operation, then park.
//!
//! Not in a suite (`tests/<suite>/main.rs`): alone in its own test binary, because it
//! measures the CPU time of the whole process (`tributary_testkit::cpu_time`), which any
//! other test running in the same process would add to.

use std::time::{Duration, Instant};

use tributary::{kernels, DType, MemoryMode, TensorNode};
use tributary_actors::{StreamConfig, System};
use tributary_testkit::cpu_time;

/// CPU used by the process while this thread sleeps for `wall`.
fn cpu_while_sleeping(wall: Duration) -> Option<Duration> {
    let before = cpu_time::process_cpu_time()?;
    std::thread::sleep(wall);
    Some(cpu_time::process_cpu_time()?.saturating_sub(before))
}

#[test]
fn an_idle_system_uses_far_less_than_one_core() {
    let Some(start_cpu) = cpu_time::process_cpu_time() else {
        println!("skipping: no /proc/self/task/*/schedstat on this machine");
        return;
    };
    // The measurement itself must see CPU being used: spin until it counts 50 ms (on a
    // loaded machine this takes longer in wall time, never forever).
    let deadline = Instant::now() + Duration::from_secs(60);
    while cpu_time::process_cpu_time()
        .is_some_and(|now| now.saturating_sub(start_cpu) < Duration::from_millis(50))
    {
        assert!(
            Instant::now() < deadline,
            "the process CPU time never moved"
        );
        std::hint::black_box((0..1000u64).sum::<u64>());
    }

    let sys = System::builder()
        .cpu_devices(4)
        .streams(StreamConfig::MostParallelStreams(2))
        .spawn()
        .expect("spawn");
    let x = TensorNode::new("x", DType::F32, [1])
        .with_mode(MemoryMode::on_device())
        .expect("node");
    for device in 0..4 {
        for stream in 0..2 {
            let r = sys
                .context(device, stream)
                .expect("context")
                .link(kernels::fill(&x, 1.0).expect("spec"))
                .expect("link");
            r.schedule().expect("schedule").wait().expect("wait");
        }
    }
    // Far past every spin window (50 µs).
    std::thread::sleep(Duration::from_millis(20));
    let wall = Duration::from_secs(1);
    let used = cpu_while_sleeping(wall).expect("schedstat readable above");
    sys.shutdown().expect("shutdown");
    println!("an idle System (4 devices x 2 streams) used {used:?} of CPU in {wall:?}");
    // A worker that spun forever would use a whole core (1 s); idle it uses microseconds.
    // A quarter of a core leaves room for any timer or housekeeping.
    assert!(
        used < wall / 4,
        "an idle System used {used:?} of CPU in {wall:?}"
    );
}
