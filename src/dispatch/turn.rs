//! A device actor's turn: its [`DeviceCore`] behind a lock. The actor's thread runs it when
//! kicked, and so does the host thread whose post found the inbox idle.
//!
//! Deciding needs exclusive access to the device's state, not a particular thread. Waking a
//! sleeping actor took about 20 µs of a 21 µs hot schedule-to-completion on the 2-core
//! machine of `BENCHMARKS.md`; the engine alone takes under 2 µs. So whoever holds the
//! [`DeviceTurn`] lock decides what is queued, in inbox order. The actor takes it when kicked,
//! through [`DeviceTurn::run_kicked`]. A post that found the inbox idle takes it through
//! [`DeviceTurn::run_here`], decides one batch, and kicks the actor for anything posted later.
//! With [`BURST`] or more operations in flight, the post kicks the actor instead, unless
//! the process may use one CPU only (an MPI rank bound to a core): there the actor could
//! decide only once the poster left the core, so the hand-off would buy no parallelism and
//! cost a context switch per batch ([`burst_for_cpus`]). See DESIGN.md §4, "Who decides".
//!
//! A batch ends with [`Inbox::finish`]. If something was posted meanwhile, the inbox's
//! `scheduled` flag stays set and the actor is kicked for it. The mutant `inline_no_handoff`
//! drops that kick; loom reports the stranded operation in
//! `actors::inline_posts_race_the_actor`. A poster finds the turn held only between another
//! holder's `finish` and its unlock, during a sweep the actor had started, or while the actor
//! shuts down. The actor's sweeps, [`DeviceTurn::try_core`], skip when the turn is held
//! rather than make a poster wait.

use super::{
    device::{DeviceCore, Progress},
    inbox::{Inbox, Ran},
    messages::DeviceOp,
};
use crate::sync::{Arc, Mutex, MutexGuard};

/// Operations in flight on a device from which a post hands its decision to the actor
/// (see [`DeviceTurn::run_here`]), in a process that may use more than one CPU.
pub const BURST: u64 = 16;

/// The operations in flight from which a post hands its decision to the actor, in a process
/// allowed `cpus` CPUs: [`BURST`], or never (`None`) on one CPU, where the actor's thread
/// shares the poster's core.
///
/// On MPI ranks bound to one core each, Task Bench's replayed steps across two ranks reach
/// a METG(50%) about 15% lower without the hand-off (BENCHMARKS.md, "One CPU, no hand-off
/// to the device actor").
pub fn burst_for_cpus(cpus: usize) -> Option<u64> {
    (cpus > 1).then_some(BURST)
}

/// A device's decision state, and the inbox whose operations it decides; see the module
/// documentation.
pub struct DeviceTurn {
    core: Mutex<DeviceCore>,
    inbox: Arc<Inbox<DeviceOp>>,
    /// [`burst_for_cpus`] of this process.
    burst: Option<u64>,
}

impl DeviceTurn {
    /// The turn of the device whose inbox is `inbox`, deciding with `core`.
    pub fn new(core: DeviceCore, inbox: Arc<Inbox<DeviceOp>>) -> std::sync::Arc<DeviceTurn> {
        std::sync::Arc::new(DeviceTurn {
            core: Mutex::new(core),
            inbox,
            burst: burst_for_cpus(crate::sync::spin::process_cpus()),
        })
    }

    /// The device's inbox.
    pub fn inbox(&self) -> &Arc<Inbox<DeviceOp>> {
        &self.inbox
    }

    /// Lets posts that find the inbox idle decide on their own thread
    /// ([`DeviceTurn::run_here`]) instead of kicking the actor. The inbox holds the turn
    /// weakly (no cycle through the inbox): once the actor and its turn are gone, there is
    /// nobody left to decide or to kick.
    pub fn decide_on_posting_threads(self: &std::sync::Arc<Self>) {
        let turn = std::sync::Arc::downgrade(self);
        self.inbox
            .set_runner(std::sync::Arc::new(move || match turn.upgrade() {
                Some(turn) => turn.run_here(),
                None => Ran::Idle,
            }));
    }

    /// The actor's side: waits for the turn, then decides until the inbox is idle or
    /// blocked. Call it whenever the inbox kicks.
    pub fn run_kicked(&self) -> Progress {
        self.core.lock().run(&self.inbox)
    }

    /// A posting thread's side, after its post found the inbox idle (it set `scheduled`):
    /// takes the turn and decides one batch here. [`Ran::Handoff`] asks the caller to
    /// kick the actor for what is left (anything posted meanwhile); [`Ran::Blocked`] says
    /// the batch waits for another device, whose answer kicks the inbox.
    ///
    /// A device with [`BURST`] operations or more in flight is in the middle of a burst:
    /// the caller posts without waiting, and will post again at once. Then the actor
    /// decides, in parallel with the caller's next posts (one wake-up for a whole batch),
    /// instead of the caller deciding one operation after the other. A dependency chain
    /// (a copy, then its reader) keeps fewer in flight and stays on the caller. A process
    /// allowed one CPU has no parallel to gain: its posts always decide here
    /// ([`burst_for_cpus`]).
    pub fn run_here(&self) -> Ran {
        let mut core = self.core.lock();
        if self
            .burst
            .is_some_and(|burst| core.work_in_flight() >= burst)
        {
            return Ran::Handoff;
        }
        let progress = core.run_once(&self.inbox);
        drop(core);
        match progress {
            Progress::Idle => Ran::Idle,
            Progress::Blocked => Ran::Blocked,
            Progress::More if mutant!("inline_no_handoff") => Ran::Idle,
            Progress::More => Ran::Handoff,
        }
    }

    /// Exclusive access to the core (waits for the turn), for what the actor does besides
    /// deciding that must happen: shutdown, poisoning.
    pub fn core(&self) -> MutexGuard<'_, DeviceCore> {
        self.core.lock()
    }

    /// The core if nobody holds the turn, for what may be skipped (sweeps: the next
    /// completion or issue sweeps again).
    pub fn try_core(&self) -> Option<MutexGuard<'_, DeviceCore>> {
        self.core.try_lock()
    }
}

impl std::fmt::Debug for DeviceTurn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTurn")
            .field("device", &self.inbox.device())
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;

    #[test]
    fn one_cpu_never_hands_a_burst_to_the_actor() {
        assert_eq!(burst_for_cpus(1), None);
        assert_eq!(burst_for_cpus(0), None);
        assert_eq!(burst_for_cpus(2), Some(BURST));
        assert_eq!(burst_for_cpus(64), Some(BURST));
    }
}
