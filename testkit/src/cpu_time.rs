//! The CPU time this process has used, for measurements of idle CPU (the `idle_cpu`
//! example and `tests/idle_cpu.rs`).
//!
//! Linux only: the sum over the process's threads of the first field of
//! `/proc/self/task/<tid>/schedstat` (nanoseconds on a CPU; sched-stats in the kernel's
//! documentation), which counts every running thread to the nanosecond; threads that
//! already exited are not counted, which an idle measurement does not need.

use std::time::Duration;

/// CPU time used so far by the threads of this process that are alive, or `None` where
/// `/proc/self/task/*/schedstat` cannot be read (not Linux, or no `CONFIG_SCHED_INFO`).
pub fn process_cpu_time() -> Option<Duration> {
    let mut total_ns: u64 = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path().join("schedstat");
        // A thread may exit between the listing and the read: it no longer counts.
        let Ok(stat) = std::fs::read_to_string(path) else {
            continue;
        };
        let on_cpu: u64 = stat.split_whitespace().next()?.parse().ok()?;
        total_ns = total_ns.saturating_add(on_cpu);
    }
    Some(Duration::from_nanos(total_ns))
}
