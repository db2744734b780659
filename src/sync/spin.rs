//! Bounded busy-waiting: spin for a short window before parking a thread.
//!
//! Parking a thread and waking it costs 10-20 µs, far more than a small operation; see
//! DESIGN.md §4, "Who decides". So a waiter that expects its condition soon polls it for a
//! short, bounded window first. A completion in that window costs neither side a system call.
//! After the window the waiter parks, so an idle system uses no CPU.
//!
//! [`SpinWait::spin`] waits a little between polls: a few `pause` instructions through
//! [`super::hint::spin_loop`], doubling up to 64, then `yield_now`. On a machine with more
//! runnable threads than cores, the yield hands the core to the thread the spinner waits for.
//!
//! A process allowed one CPU (an MPI rank bound to a core, a container of one CPU) never
//! spins: the thread it waits for can run only once the spinner leaves the core, so a
//! window only delays it, and two spinners on one core hand it back and forth by
//! `sched_yield` (a third of a rank's samples in a cross-stream round trip, BENCHMARKS.md,
//! "One CPU, no spinning"). How many CPUs the process may use is read once
//! ([`std::thread::available_parallelism`], which follows the affinity mask and the cgroup
//! quota).
//!
//! Under `tributary_loom` there is no clock, and a replayed execution must not depend on time.
//! A non-zero window is one round, and the round does not yield. loom runs a yielding thread
//! only once the others are blocked, which would hide the waiter that gives up and parks. The
//! caller's second poll is a point where loom may switch threads, so a model explores both.

use std::time::Duration;
#[cfg(not(tributary_loom))]
use std::time::Instant;

/// Rounds of `pause` instructions (1, 2, 4, … 64 of them) before each round yields.
#[cfg(not(tributary_loom))]
const PAUSE_ROUNDS: u32 = 6;

/// A spin window: call [`spin`](SpinWait::spin) between polls of a condition until it
/// returns `false`, then park.
#[derive(Debug)]
pub struct SpinWait {
    #[cfg(not(tributary_loom))]
    deadline: Option<Instant>,
    #[cfg(not(tributary_loom))]
    rounds: u32,
    #[cfg(tributary_loom)]
    open: bool,
}

impl SpinWait {
    /// A window of `window` from now (zero, or a process allowed one CPU: no spinning at
    /// all).
    pub fn new(window: Duration) -> SpinWait {
        #[cfg(not(tributary_loom))]
        return SpinWait::on_cpus(window, process_cpus());
        #[cfg(tributary_loom)]
        return SpinWait {
            open: !window.is_zero(),
        };
    }

    /// A window of `window` from now in a process allowed `cpus` CPUs.
    #[cfg(not(tributary_loom))]
    fn on_cpus(window: Duration, cpus: usize) -> SpinWait {
        SpinWait {
            deadline: if window.is_zero() || cpus <= 1 {
                None
            } else {
                Instant::now().checked_add(window)
            },
            rounds: 0,
        }
    }

    /// Waits a little; `true` while the window is open (poll the condition again), `false`
    /// once it has passed (park).
    pub fn spin(&mut self) -> bool {
        #[cfg(not(tributary_loom))]
        {
            let Some(deadline) = self.deadline else {
                return false;
            };
            if self.rounds < PAUSE_ROUNDS {
                for _ in 0..(1u32 << self.rounds) {
                    super::hint::spin_loop();
                }
                self.rounds += 1;
            } else {
                super::thread::yield_now();
            }
            Instant::now() < deadline
        }
        #[cfg(tributary_loom)]
        {
            std::mem::replace(&mut self.open, false)
        }
    }
}

/// The CPUs this process may run on, read once. A process allowed one CPU neither spins
/// (above) nor hands a burst of posts to a device actor (`dispatch::turn`): in both cases
/// the thread it would wait on can run only once the calling thread leaves the core.
///
/// Under `tributary_loom`: unbounded, so a model takes the paths of a machine with cores to
/// spare (`SpinWait` does not read it there, and no model has a burst in flight).
#[cfg(not(tributary_loom))]
pub fn process_cpus() -> usize {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// See the documentation of the non-loom build.
#[cfg(tributary_loom)]
pub fn process_cpus() -> usize {
    usize::MAX
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_zero_window_never_spins() {
        let mut spin = SpinWait::new(Duration::ZERO);
        assert!(!spin.spin());
        assert!(!spin.spin());
    }

    #[test]
    fn a_window_closes_after_its_duration() {
        let start = Instant::now();
        let mut spin = SpinWait::on_cpus(Duration::from_millis(2), 2);
        let mut rounds = 0u64;
        while spin.spin() {
            rounds += 1;
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the window never closed"
            );
        }
        assert!(start.elapsed() >= Duration::from_millis(2));
        assert!(rounds > 0, "a 2 ms window allows at least one round");
        assert!(!spin.spin(), "a closed window stays closed");
    }

    #[test]
    fn one_cpu_never_spins_and_two_do() {
        // Long enough that no preemption closes it before the first round ends.
        let window = Duration::from_secs(10);
        assert!(
            !SpinWait::on_cpus(window, 1).spin(),
            "one CPU: park at once"
        );
        assert!(!SpinWait::on_cpus(window, 0).spin());
        assert!(
            SpinWait::on_cpus(window, 2).spin(),
            "two CPUs: the window is open"
        );
        assert_eq!(
            SpinWait::new(window).spin(),
            process_cpus() > 1,
            "`new` follows the CPUs the process may use"
        );
    }

    #[test]
    fn an_unrepresentable_window_does_not_spin() {
        // `Instant + Duration::MAX` overflows: treated as no window rather than forever.
        let mut spin = SpinWait::new(Duration::MAX);
        assert!(!spin.spin());
    }
}
