//! A device's mailbox: a FIFO of operations that host threads post and one consumer drains
//! in batches.
//!
//! The actor framework's mailbox lacks two things. First, a call that touches several
//! devices must enter all their inboxes at one point of one shared order, or two threads'
//! copies can tear, as in issue 16. [`post_atomically`] gives this with strict two-phase
//! locking in device order. Second, a post wakes the consumer only when it was idle, so one
//! wake-up carries many operations. See DESIGN.md §4, "Inboxes: one order shared by every
//! device, and batches".
//!
//! The `scheduled` flag says a drain is owed. The post that finds it clear sets it, then
//! kicks the consumer or, with a runner set by [`Inbox::set_runner`], decides in its place.
//! Only the drainer clears it, in [`Inbox::finish`], under the lock, with the queue empty. So
//! a post either sets the flag or is seen by the drainer before the flag clears: no operation
//! is left behind. A consumer blocked on another device keeps the flag set, and whoever
//! unblocks it kicks it again through [`Inbox::kick`].
//!
//! A post that finds several devices idle may decide them in rounds on its own thread.
//! Meanwhile a kick to their inboxes is noted, not sent, and `undrive` passes it on when the
//! thread stops. See DESIGN.md §4, "Who decides".
//!
//! A post to a full inbox waits for room. It holds no other inbox's lock while it waits,
//! because the consumer may need another device to progress first.

use std::collections::VecDeque;
use std::fmt;

use smallvec::SmallVec;

use crate::{
    ids::DeviceId,
    sync::{Arc, Condvar, Mutex, MutexGuard},
};

/// What a kick does: for an actor, send it the message that makes it drain; for a model
/// thread, nothing (it waits on [`Inbox::wait_kicked`]).
pub type Waker = std::sync::Arc<dyn Fn() + Send + Sync>;

/// What a post that found the consumer idle runs on its own thread in the consumer's place
/// ([`Inbox::set_runner`]): it decides one batch and says how that ended.
pub type Runner = std::sync::Arc<dyn Fn() -> Ran + Send + Sync>;

/// How a [`Runner`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ran {
    /// Everything was decided; the consumer is idle again.
    Idle,
    /// An operation waits for another device; whoever answers it kicks the inbox.
    Blocked,
    /// The runner did not decide everything (the device is in a burst, or more was posted
    /// meanwhile): the consumer must be kicked to go on.
    Handoff,
}

/// At most this many rounds of a multi-device post decided on the posting thread
/// ([`post_atomically`]) before what is still blocked is handed to the consumers. Each
/// round after the first needs an answer that the previous round produced; an all-reduce's
/// chain of steps (2(n-1) per chunk) ends well before. The bound keeps a thread from
/// deciding for others forever while they keep posting; a longer chain (many buckets in
/// one post) goes on on the actors past it, as every blocked batch did before rounds.
const MAX_DRIVE_ROUNDS: usize = 64;

/// The locked part of an [`Inbox`].
pub struct InboxState<T> {
    queue: VecDeque<T>,
    /// The consumer owes a drain: set by the post that found it idle, cleared by
    /// [`Inbox::finish`] when the queue is empty.
    scheduled: bool,
    /// Kicked since the consumer last waited ([`Inbox::wait_kicked`]).
    kicked: bool,
    /// Set by [`Inbox::close`]: posts are refused.
    closed: bool,
    /// Posting threads deciding this inbox's batches in rounds ([`post_atomically`]): while
    /// non-zero, a kick is not sent to the consumer but noted in `absorbed`, for the
    /// driving thread to decide again or to pass on when it stops.
    driven: u32,
    /// A kick arrived while `driven`.
    absorbed: bool,
    /// Posters waiting for room ([`Inbox::drain_into`] signals only if there are any).
    room_waiters: u32,
}

/// A device's mailbox; see the module documentation.
pub struct Inbox<T> {
    device: DeviceId,
    capacity: usize,
    state: Mutex<InboxState<T>>,
    /// Signalled when the consumer drained (room for a waiting poster).
    room: Condvar,
    /// Signalled on every kick (for consumers that wait on the inbox itself).
    work: Condvar,
    /// Set once, before the consumer needs kicking, and only read after: plain data, not
    /// synchronisation (a post that kicks before it is set is made up for by the consumer
    /// draining once it starts).
    waker: std::sync::OnceLock<Waker>,
    /// What a post from outside the consumer does when it found the consumer idle, if
    /// not a kick: decide on the posting thread ([`crate::dispatch::DeviceTurn`]). Set
    /// once, like `waker`.
    runner: std::sync::OnceLock<Runner>,
}

/// Why a post was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The inbox was closed (its device shut down).
    Closed(DeviceId),
}

impl<T> Inbox<T> {
    /// An empty inbox of `device` holding at most `capacity` operations (at least one).
    pub fn new(device: DeviceId, capacity: usize) -> Arc<Inbox<T>> {
        Arc::new(Inbox {
            device,
            capacity: capacity.max(1),
            state: Mutex::new(InboxState {
                queue: VecDeque::new(),
                scheduled: false,
                kicked: false,
                closed: false,
                driven: 0,
                absorbed: false,
                room_waiters: 0,
            }),
            room: Condvar::new(),
            work: Condvar::new(),
            waker: std::sync::OnceLock::new(),
            runner: std::sync::OnceLock::new(),
        })
    }

    /// The device whose inbox this is.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Sets what a kick does, once (when the consumer exists); later calls are ignored.
    pub fn set_waker(&self, waker: Waker) {
        let _ = self.waker.set(waker);
    }

    /// Sets what a post that found the consumer idle does instead of a kick, once (later
    /// calls are ignored): `runner` decides what is queued and says how that ended; a
    /// [`Ran::Handoff`] is followed by a kick (see
    /// [`crate::dispatch::DeviceTurn::run_here`]). Posts from consumers
    /// ([`Inbox::post_internal`]) and waits for room always kick.
    pub fn set_runner(&self, runner: Runner) {
        let _ = self.runner.set(runner);
    }

    /// A post found the consumer idle and owes it a drain: run it here if a runner is
    /// set, else kick it.
    fn wake_idle(&self) {
        match self.runner.get() {
            Some(run) => {
                if run() == Ran::Handoff {
                    self.kick();
                }
            }
            None => self.kick(),
        }
    }

    /// Starts deciding this inbox in rounds on the posting thread: kicks are noted, not
    /// sent, until [`Inbox::undrive`].
    fn drive(&self) {
        self.state.lock().driven += 1;
    }

    /// Whether a kick was noted since the last look (and forgets it).
    fn take_absorbed(&self) -> bool {
        std::mem::take(&mut self.state.lock().absorbed) && !mutant!("drive_lost_kick")
    }

    /// Stops deciding this inbox on the posting thread; kicks the consumer if `handoff`
    /// or if a kick was noted and not yet looked at, so none is lost.
    fn undrive(&self, handoff: bool) {
        let absorbed = {
            let mut s = self.state.lock();
            s.driven = s.driven.saturating_sub(1);
            std::mem::take(&mut s.absorbed) && !mutant!("drive_lost_kick")
        };
        if handoff || absorbed {
            self.kick();
        }
    }

    /// Posts one operation; see [`post_atomically`].
    pub fn post(&self, op: T) -> Result<(), Refused> {
        let mut op = Some(op);
        self.post_with(|push| {
            if let Some(op) = op.take() {
                push(op);
            }
        })
    }

    /// [`post_atomically`] to this inbox alone, without allocating: `fill` runs under the
    /// lock (once, on the successful attempt) and pushes the operations.
    pub fn post_with(&self, fill: impl FnOnce(&mut dyn FnMut(T))) -> Result<(), Refused> {
        let mut s = self.state.lock();
        loop {
            if s.closed {
                return Err(Refused::Closed(self.device));
            }
            if s.queue.len() < self.capacity {
                break;
            }
            drop(s);
            // See `post_atomically`: a consumer waiting for another device keeps its queue
            // until kicked.
            self.kick();
            s = self.wait_for_room(self.state.lock());
        }
        let queue = &mut s.queue;
        fill(&mut |op| queue.push_back(op));
        let kick = !s.scheduled && !s.queue.is_empty();
        if kick {
            s.scheduled = true;
        }
        drop(s);
        if kick {
            self.wake_idle();
        }
        Ok(())
    }

    /// Posts one operation from a consumer (a device core telling another device
    /// something): never waits for room, since a consumer must not block on another one.
    /// Dropped if the inbox is closed (its device stopped: nothing left to tell).
    pub fn post_internal(&self, op: T) {
        let kick = {
            let mut s = self.state.lock();
            if s.closed {
                return;
            }
            s.queue.push_back(op);
            !std::mem::replace(&mut s.scheduled, true)
        };
        if kick {
            self.kick();
        }
    }

    /// Wakes the consumer: calls its waker if it has one, else signals
    /// [`Inbox::wait_kicked`].
    ///
    /// While a posting thread decides the inbox in rounds ([`post_atomically`]), the kick
    /// is only noted: that thread decides again or passes it on.
    pub fn kick(&self) {
        {
            let mut s = self.state.lock();
            if s.driven > 0 {
                s.absorbed = true;
                return;
            }
            if self.waker.get().is_none() {
                s.kicked = true;
                self.work.notify_all();
                return;
            }
        }
        if let Some(w) = self.waker.get() {
            w();
        }
    }

    /// Consumer side: moves every queued operation to the back of `into`.
    pub fn drain_into(&self, into: &mut VecDeque<T>) {
        let mut s = self.state.lock();
        if into.is_empty() {
            std::mem::swap(&mut s.queue, into);
        } else {
            into.extend(s.queue.drain(..));
        }
        // Only a poster waiting for room needs the signal (a notify is a system call even
        // with nobody waiting, and this runs once per decided batch).
        if s.room_waiters > 0 {
            self.room.notify_all();
        }
    }

    /// Waits, holding `s`, until the inbox has room or is closed.
    fn wait_for_room<'a>(
        &'a self,
        mut s: MutexGuard<'a, InboxState<T>>,
    ) -> MutexGuard<'a, InboxState<T>> {
        while !s.closed && s.queue.len() >= self.capacity {
            s.room_waiters += 1;
            s = self.room.wait(s);
            s.room_waiters -= 1;
        }
        s
    }

    /// Consumer side: the consumer ran out of work. Returns `true` (and stops owing a
    /// drain) if nothing was posted meanwhile; `false` if it must drain again.
    pub fn finish(&self) -> bool {
        let mut s = self.state.lock();
        if s.queue.is_empty() {
            s.scheduled = false;
            true
        } else {
            false
        }
    }

    /// Consumer side, for consumers that own a thread: blocks until kicked (returns at
    /// once if kicked since the last call).
    pub fn wait_kicked(&self) {
        let mut s = self.state.lock();
        while !s.kicked {
            s = self.work.wait(s);
        }
        s.kicked = false;
    }

    /// Refuses later posts ([`Refused::Closed`]); returns what was still queued.
    pub fn close(&self) -> VecDeque<T> {
        let mut s = self.state.lock();
        s.closed = true;
        self.room.notify_all();
        std::mem::take(&mut s.queue)
    }

    /// Number of queued operations (not yet drained).
    pub fn len(&self) -> usize {
        self.state.lock().queue.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> fmt::Debug for Inbox<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("device", &self.device)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// Posts to several inboxes as one atomic step: `fill(i, push)` is called once per inbox
/// `inboxes[i]`, with every inbox locked, and pushes that inbox's operations in order.
/// `inboxes` must be sorted by device and free of duplicates (the lock order that makes
/// concurrent multi-device posts deadlock-free); the caller (the dispatcher) guarantees it.
///
/// If an inbox is full, every lock is released, the call waits for that inbox to drain,
/// and starts over (`fill` is called again only for the successful attempt). Consumers
/// that were idle are kicked (or run here, see [`Inbox::set_runner`]) after the locks are
/// released, in device order.
pub fn post_atomically<T>(
    inboxes: &[&Inbox<T>],
    mut fill: impl FnMut(usize, &mut dyn FnMut(T)),
) -> Result<(), Refused> {
    debug_assert!(
        inboxes.windows(2).all(|w| w[0].device < w[1].device),
        "inboxes must be sorted by device, without duplicates"
    );
    loop {
        // Inline up to four inboxes: a post allocates nothing (DESIGN.md §4, "Issuing
        // without allocation").
        let mut guards: SmallVec<[MutexGuard<'_, InboxState<T>>; 4]> = SmallVec::new();
        let mut full = None;
        for (i, inbox) in inboxes.iter().enumerate() {
            let g = inbox.state.lock();
            if g.closed {
                return Err(Refused::Closed(inbox.device));
            }
            if g.queue.len() >= inbox.capacity {
                full = Some(i);
                break;
            }
            guards.push(g);
        }
        if let Some(i) = full {
            drop(guards);
            let inbox = inboxes[i];
            // A consumer waiting for another device keeps its queue until kicked: kick it,
            // so that it moves the queue into its own backlog and makes room.
            inbox.kick();
            drop(inbox.wait_for_room(inbox.state.lock()));
            continue;
        }
        let mut kick = Indices::new();
        for (i, g) in guards.iter_mut().enumerate() {
            let queue = &mut g.queue;
            fill(i, &mut |op| queue.push_back(op));
            if !g.scheduled && !g.queue.is_empty() {
                g.scheduled = true;
                kick.push(i);
            }
        }
        drop(guards);
        match kick.as_slice() {
            [] => {}
            [i] => inboxes[*i].wake_idle(),
            _ => decide_in_rounds(inboxes, kick),
        }
        return Ok(());
    }
}

/// Indices into a post's inboxes, inline up to four.
type Indices = SmallVec<[usize; 4]>;

/// The consumers of `idle` (indices into `inboxes`, each found idle by the post that
/// called this, which owes it a drain) decided on this thread, in rounds: a device whose
/// batch waits for another device's answer (a copy's destination before its source, an
/// all-reduce's later steps) is decided again once an earlier round answered it, instead
/// of its consumer being woken by the answer. An all-reduce or a copy against device order
/// thus needs no consumer wake-up at all when its devices were idle.
///
/// Correct whoever decides: each round decides each inbox in its own order, holding its
/// turn ([`crate::dispatch::DeviceTurn`]); kicks noted meanwhile are either acted on by the
/// next round or passed to the consumer by [`Inbox::undrive`] (mutant `drive_lost_kick`,
/// which forgets them, strands the blocked device: `actors::copy_against_device_order`).
fn decide_in_rounds<T>(inboxes: &[&Inbox<T>], idle: Indices) {
    let mut active = Indices::new();
    for i in idle {
        if inboxes[i].runner.get().is_some() {
            inboxes[i].drive();
            active.push(i);
        } else {
            inboxes[i].kick();
        }
    }
    // Blocked devices stay driven while others run: their answer may come from those.
    let mut blocked = Indices::new();
    for _ in 0..MAX_DRIVE_ROUNDS {
        for i in active.drain(..) {
            let ran = inboxes[i].runner.get().map_or(Ran::Handoff, |run| run());
            match ran {
                Ran::Blocked => blocked.push(i),
                Ran::Idle => inboxes[i].undrive(false),
                Ran::Handoff => inboxes[i].undrive(true),
            }
        }
        // The next round: the blocked devices that were answered meanwhile.
        blocked.retain(|i| {
            let answered = inboxes[*i].take_absorbed();
            if answered {
                active.push(*i);
            }
            !answered
        });
        active.sort_unstable();
        if active.is_empty() {
            break;
        }
    }
    // Nobody left to answer them here (or the bound was reached): the consumers go on.
    for &i in &blocked {
        inboxes[i].undrive(false);
    }
    for &i in &active {
        inboxes[i].undrive(true);
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;

    #[test]
    fn only_the_post_that_finds_the_consumer_idle_kicks_it() {
        let inbox = Inbox::<u32>::new(DeviceId(0), 8);
        let kicks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let k = kicks.clone();
        inbox.set_waker(std::sync::Arc::new(move || {
            k.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
        inbox.post(1).unwrap();
        inbox.post(2).unwrap();
        assert_eq!(kicks.load(std::sync::atomic::Ordering::SeqCst), 1);
        let mut got = VecDeque::new();
        inbox.drain_into(&mut got);
        inbox.post(3).unwrap(); // still scheduled: no kick
        assert!(!inbox.finish(), "3 arrived while draining");
        inbox.drain_into(&mut got);
        assert!(inbox.finish());
        assert_eq!(got, [1, 2, 3]);
        inbox.post(4).unwrap();
        assert_eq!(kicks.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn atomic_posts_keep_one_order_on_every_inbox() {
        let a = Inbox::<(usize, u32)>::new(DeviceId(0), 1024);
        let b = Inbox::<(usize, u32)>::new(DeviceId(1), 1024);
        std::thread::scope(|s| {
            for t in 0..4 {
                let (a, b) = (&*a, &*b);
                s.spawn(move || {
                    for k in 0..200 {
                        post_atomically(&[a, b], |_, push| push((t, k))).unwrap();
                    }
                });
            }
        });
        let (mut qa, mut qb) = (VecDeque::new(), VecDeque::new());
        a.drain_into(&mut qa);
        b.drain_into(&mut qb);
        assert_eq!(qa, qb, "the two inboxes saw the posts in different orders");
        assert_eq!(qa.len(), 800);
    }

    /// Two inboxes whose runners act like a copy against device order: device 0's batch
    /// blocks until device 1's batch answers it (kicks inbox 0). Counts device 0's runs
    /// and both consumers' (actors') kicks.
    struct AgainstOrder {
        a: Arc<Inbox<u32>>,
        b: Arc<Inbox<u32>>,
        answered: std::sync::Arc<std::sync::atomic::AtomicBool>,
        a_runs: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        actor_kicks: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    }

    fn against_order(b_answers: bool) -> AgainstOrder {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
        let (a, b) = (
            Inbox::<u32>::new(DeviceId(0), 8),
            Inbox::<u32>::new(DeviceId(1), 8),
        );
        let answered = std::sync::Arc::new(AtomicBool::new(false));
        let a_runs = std::sync::Arc::new(AtomicUsize::new(0));
        let actor_kicks = std::sync::Arc::new(AtomicUsize::new(0));
        for inbox in [&a, &b] {
            let k = actor_kicks.clone();
            inbox.set_waker(std::sync::Arc::new(move || {
                k.fetch_add(1, SeqCst);
            }));
        }
        let (inbox, done, runs) = (a.clone(), answered.clone(), a_runs.clone());
        a.set_runner(std::sync::Arc::new(move || {
            runs.fetch_add(1, SeqCst);
            inbox.drain_into(&mut VecDeque::new());
            if !done.load(SeqCst) {
                return Ran::Blocked;
            }
            inbox.finish();
            Ran::Idle
        }));
        let (inbox, other, done) = (b.clone(), a.clone(), answered.clone());
        b.set_runner(std::sync::Arc::new(move || {
            inbox.drain_into(&mut VecDeque::new());
            if b_answers {
                done.store(true, SeqCst);
                other.kick();
            }
            inbox.finish();
            Ran::Idle
        }));
        AgainstOrder {
            a,
            b,
            answered,
            a_runs,
            actor_kicks,
        }
    }

    #[test]
    fn a_post_to_several_idle_devices_decides_them_in_rounds_without_waking_an_actor() {
        use std::sync::atomic::Ordering::SeqCst;
        let t = against_order(true);
        post_atomically(&[&*t.a, &*t.b], |_, push| push(1)).unwrap();
        assert_eq!(
            t.a_runs.load(SeqCst),
            2,
            "device 0 decided again once answered"
        );
        assert_eq!(t.actor_kicks.load(SeqCst), 0, "no actor was woken");
        // Both are idle again: the next such post runs them again, still without an actor.
        t.answered.store(false, SeqCst);
        post_atomically(&[&*t.a, &*t.b], |_, push| push(2)).unwrap();
        assert_eq!(t.a_runs.load(SeqCst), 4);
        assert_eq!(t.actor_kicks.load(SeqCst), 0);
    }

    #[test]
    fn a_device_left_blocked_by_the_rounds_gets_its_answer_through_its_actor() {
        use std::sync::atomic::Ordering::SeqCst;
        let t = against_order(false);
        post_atomically(&[&*t.a, &*t.b], |_, push| push(1)).unwrap();
        assert_eq!(
            t.a_runs.load(SeqCst),
            1,
            "nobody answered device 0 in the post"
        );
        assert_eq!(t.actor_kicks.load(SeqCst), 0);
        // The answer comes later, from elsewhere: the kick reaches device 0's actor.
        t.answered.store(true, SeqCst);
        t.a.kick();
        assert_eq!(
            t.actor_kicks.load(SeqCst),
            1,
            "the late answer woke the actor"
        );
    }

    #[test]
    fn a_full_inbox_makes_the_poster_wait_for_room_and_a_closed_one_refuses() {
        let inbox = Inbox::<u32>::new(DeviceId(3), 1);
        inbox.post(1).unwrap();
        std::thread::scope(|s| {
            let poster = s.spawn(|| inbox.post(2));
            let mut got = VecDeque::new();
            while got.len() < 2 {
                inbox.drain_into(&mut got);
                std::thread::yield_now();
            }
            assert_eq!(poster.join().unwrap(), Ok(()));
            assert_eq!(got, [1, 2]);
        });
        inbox.close();
        assert_eq!(inbox.post(3), Err(Refused::Closed(DeviceId(3))));
    }
}
