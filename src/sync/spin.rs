//! Bounded busy-waiting: spin for a short window before parking a thread.
//!
//! Parking a thread on a futex and waking it costs about 20 µs on this kind of machine
//! (`stack-notes.md`), far more than a small operation. A waiter that expects its condition
//! soon (a worker that just finished a plan and expects the next one, a host thread waiting
//! for an operation another core is running) therefore polls the condition for a short,
//! **bounded** window first, so that a completion in that window costs neither side a
//! system call, and parks only when the window has passed, so that an idle system uses no
//! CPU a few hundred microseconds after its last operation.
//!
//! [`SpinWait::spin`] waits a little between polls: a few `pause` instructions
//! ([`super::hint::spin_loop`]), doubling up to 64, then `yield_now`, so that on a machine
//! with more runnable threads than cores (two cores, a host thread, an actor thread and
//! the workers) a spinner hands its core to the thread that will make the progress it
//! waits for.
//!
//! Under `tributary_loom` there is no clock: a non-zero window is exactly one round, and
//! every execution of a model takes the same steps (loom replays executions, so they must
//! not depend on real time). The round does not yield: loom runs a yielding thread only
//! once the others are blocked, so a yield would let every signaller finish first and
//! hide the waiter that gives up spinning and parks; the caller's second poll of its
//! condition is a point where loom may switch threads, which explores both a waiter that
//! sees the condition while spinning and one that goes on to park.

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
    /// A window of `window` from now (zero: no spinning at all).
    pub fn new(window: Duration) -> SpinWait {
        #[cfg(not(tributary_loom))]
        return SpinWait {
            deadline: if window.is_zero() {
                None
            } else {
                Instant::now().checked_add(window)
            },
            rounds: 0,
        };
        #[cfg(tributary_loom)]
        return SpinWait {
            open: !window.is_zero(),
        };
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
        let mut spin = SpinWait::new(Duration::from_millis(2));
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
    fn an_unrepresentable_window_does_not_spin() {
        // `Instant + Duration::MAX` overflows: treated as no window rather than forever.
        let mut spin = SpinWait::new(Duration::MAX);
        assert!(!spin.spin());
    }
}
