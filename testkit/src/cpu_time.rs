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

/// Whose CPU time: the threads of the runtime and of the program that calls it, or the
/// others (a driver's: lavapipe runs the device's work on CPU threads of the process).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuSplit {
    /// The main thread and the runtime's threads (`tributary-*`, the actors' `actix-*`).
    pub runtime: Duration,
    /// Every other thread of the process.
    pub other: Duration,
}

/// [`process_cpu_time`] split by thread name into [`CpuSplit`]; `None` where it cannot be
/// read. Threads that exited are not counted.
pub fn process_cpu_split() -> Option<CpuSplit> {
    let main = std::process::id().to_string();
    let mut split = CpuSplit::default();
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let task = task.ok()?;
        let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        let on_cpu = Duration::from_nanos(stat.split_whitespace().next()?.parse().ok()?);
        let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let ours = task.file_name().to_str() == Some(main.as_str())
            || name.starts_with("tributary")
            || name.starts_with("actix");
        if ours {
            split.runtime += on_cpu;
        } else {
            split.other += on_cpu;
        }
    }
    Some(split)
}
