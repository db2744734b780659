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
