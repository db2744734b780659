//! A device actor's turn: its [`DeviceCore`] behind a lock, run by the actor's thread when
//! its inbox kicks it, or by the host thread whose post found the inbox idle.
//!
//! # Why decide on the posting thread
//!
//! A device actor on actix sleeps between operations (its arbiter parks on a futex). A
//! host call into an idle inbox used to pay that thread's wake-up before anything was
//! decided: on the 2-core machine of `BENCHMARKS.md` about 20 µs of a 21 µs hot
//! schedule-to-completion, where the engine alone, deciding on the calling thread, takes
//! under 2 µs. Waking a thread to run code that needs nothing but exclusive access to the
//! device's state buys nothing; what the actor model needs is that exclusivity — one
//! decider at a time, in inbox order — not a particular thread.
//!
//! So the device's state lives in a [`DeviceTurn`]: whoever holds its lock decides, in
//! inbox order, what is queued. The actor's thread takes it when kicked
//! ([`DeviceTurn::run_kicked`]). A post that found the inbox idle takes it too
//! ([`DeviceTurn::run_here`]), decides one batch — its own operation and whatever was
//! queued with it — and hands anything posted after that to the actor with a kick, so a
//! host thread is never kept deciding for others. If the device has [`BURST`] operations
//! or more in flight the caller is in a burst (it posts without waiting): the post kicks
//! the actor instead, which then decides in parallel with the caller's next posts, one
//! wake-up for the whole batch (the throughput of a burst needs the pipeline; the latency
//! of a call into an idle device needs no wake-up). Operations still enter the inbox first
//! and are decided in its order: which thread decides changes nothing in what is decided
//! (`loom_tests/actors.rs` runs the cross-actor models both ways).
//!
//! # Why nothing is left behind, and nobody waits long
//!
//! The inbox's `scheduled` flag says a drain is owed; it is cleared only under the inbox
//! lock when the queue is empty ([`Inbox::finish`]), by whoever holds the turn, and set by
//! the post that finds it clear. That post then takes the turn and drains, or (actor-thread
//! mode) kicks the actor, which does. A batch ends with `finish`: if something was posted
//! during the batch, the flag stays set and the posting thread kicks the actor for it (the
//! mutant `inline_no_handoff`, which drops that kick, strands the operation of a second
//! host thread that posted while the first decided: loom reports the deadlock,
//! `actors::inline_posts_race_the_actor`). A blocked batch (a copy's destination waiting
//! for the source's verdict) keeps the flag set and the verdict kicks the actor — unless
//! the post that found it idle found other devices idle too and decides them all in rounds
//! ([`crate::dispatch::inbox`]): then the verdict's kick is noted for that thread, which
//! decides the batch again once the source's round gave it.
//!
//! A poster that set the flag finds the turn free except in the instant between another
//! holder's `finish` and its unlock, during a sweep the actor had already started, or
//! while the actor shuts down; the actor's sweeps ([`DeviceTurn::try_core`]) skip when the
//! turn is held rather than make a poster wait.

use super::{
    device::{DeviceCore, Progress},
    inbox::{Inbox, Ran},
    messages::DeviceOp,
};
use crate::sync::{Arc, Mutex, MutexGuard};

/// Operations in flight on a device from which a post hands its decision to the actor
/// (see [`DeviceTurn::run_here`]).
pub const BURST: u64 = 16;

/// A device's decision state, and the inbox whose operations it decides; see the module
/// documentation.
pub struct DeviceTurn {
    core: Mutex<DeviceCore>,
    inbox: Arc<Inbox<DeviceOp>>,
}

impl DeviceTurn {
    /// The turn of the device whose inbox is `inbox`, deciding with `core`.
    pub fn new(core: DeviceCore, inbox: Arc<Inbox<DeviceOp>>) -> std::sync::Arc<DeviceTurn> {
        std::sync::Arc::new(DeviceTurn {
            core: Mutex::new(core),
            inbox,
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
    /// (a copy, then its reader) keeps fewer in flight and stays on the caller.
    pub fn run_here(&self) -> Ran {
        let mut core = self.core.lock();
        if core.work_in_flight() >= BURST {
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
