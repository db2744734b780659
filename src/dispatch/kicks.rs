//! Waking a device's consumer without a message: a flag and the consumer task's waker.
//!
//! A device actor is told to drain its inbox whenever a post finds it idle and cannot
//! decide in its place (DESIGN.md §4, "Who decides"). An actix message would box its
//! envelope on every such wake-up, the last allocation on the path of a `System` call in
//! steady state (`tests/allocations.rs`). With [`Kicks`] the actor polls for wake-ups as a
//! stream it added to its context once: [`Kicks::kick`] sets a flag and wakes the actor's
//! task, which allocates nothing, and kicks that arrive before the actor polls again make
//! one wake-up.
//!
//! The handshake is an atomic waker's: [`Kicks::poll_kicked`] registers the task's waker
//! under the lock and only then takes the flag; a kick sets the flag and, unless it was
//! already set, then wakes what is registered (read under the lock, woken outside it).
//! Either the poll's take sees the flag or the kick finds the registered waker, and a kick
//! that finds the flag set leaves the wake-up to the one that set it: no kick is lost (loom
//! model `actors::a_kick_racing_a_poll_is_never_lost`, mutant `kick_lost`).

use std::task::{Context, Poll, Waker};

use crate::sync::{
    atomic::{AtomicBool, Ordering},
    Mutex,
};

/// A consumer's wake-ups (see the module documentation). Shared behind an `Arc` by the
/// consumer that polls and the inbox whose waker kicks.
#[derive(Debug)]
pub struct Kicks {
    kicked: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Default for Kicks {
    fn default() -> Kicks {
        Kicks::new()
    }
}

impl Kicks {
    /// No kick yet.
    pub fn new() -> Kicks {
        Kicks {
            kicked: AtomicBool::new(false),
            waker: Mutex::new(None),
        }
    }

    /// Makes the next poll ready (coalesced with kicks not yet polled) and wakes the
    /// registered task. A kick that finds the flag already set does nothing more: the kick
    /// that set it wakes the task (or the task has yet to poll), and that poll takes the
    /// flag after this kick's work was posted. The waker is woken outside the lock, so a
    /// poll never waits for a wake-up's system call.
    pub fn kick(&self) {
        // A read-modify-write, as the take is: every kick and take on the flag is in one
        // order, which loom models exactly (a plain store racing a take is modelled with
        // their order left open, and a later take could read before the store).
        if self.kicked.swap(true, Ordering::AcqRel) {
            return;
        }
        let waker = self.waker.lock().clone();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Takes a kick without registering a waker: whether one came since the last poll or
    /// take. For a consumer that looks between other work (the device actor between its
    /// messages, which actix handles before its streams).
    pub fn take(&self) -> bool {
        self.kicked.swap(false, Ordering::AcqRel)
    }

    /// Ready once per batch of kicks; pending otherwise, `cx`'s waker then woken by the
    /// next kick.
    pub fn poll_kicked(&self, cx: &mut Context<'_>) -> Poll<()> {
        if mutant!("kick_lost") && self.kicked.swap(false, Ordering::AcqRel) {
            // The shape with the flag taken before the waker is registered.
            return Poll::Ready(());
        }
        {
            let mut waker = self.waker.lock();
            // The task's waker rarely changes: keep the registered one when it would wake
            // the same task (no clone).
            if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *waker = Some(cx.waker().clone());
            }
        }
        // Taken after registering (see the module documentation).
        if !mutant!("kick_lost") && self.kicked.swap(false, Ordering::AcqRel) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::task::Wake;

    use super::*;

    /// Counts its wakes.
    struct Counter(AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn woken(c: &Counter) -> usize {
        c.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[test]
    fn a_kick_wakes_the_registered_task_and_kicks_coalesce() {
        let counter = Arc::new(Counter(AtomicUsize::new(0)));
        let waker = Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        let kicks = Kicks::new();
        assert_eq!(kicks.poll_kicked(&mut cx), Poll::Pending);
        kicks.kick();
        kicks.kick();
        assert_eq!(
            woken(&counter),
            1,
            "the first kick wakes the registered task, the second finds the flag set"
        );
        // Two kicks before the poll: one wake-up, then nothing until the next kick.
        assert_eq!(kicks.poll_kicked(&mut cx), Poll::Ready(()));
        assert_eq!(kicks.poll_kicked(&mut cx), Poll::Pending);
        kicks.kick();
        assert_eq!(kicks.poll_kicked(&mut cx), Poll::Ready(()));
    }

    #[test]
    fn a_kick_before_the_first_poll_is_kept() {
        let waker = Waker::from(Arc::new(Counter(AtomicUsize::new(0))));
        let kicks = Kicks::new();
        kicks.kick();
        assert_eq!(
            kicks.poll_kicked(&mut Context::from_waker(&waker)),
            Poll::Ready(())
        );
    }
}
