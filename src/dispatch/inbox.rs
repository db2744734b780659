//! A device's mailbox: a FIFO of operations that host threads post and one consumer (the
//! device actor) drains in batches.
//!
//! # Why not the actor framework's mailbox
//!
//! Two things are needed that a per-actor message queue does not give:
//!
//! - **Atomic posts to several devices.** A call that touches devices A and B (a copy, an
//!   all-reduce) must enter both mailboxes at one point of a single order shared by every
//!   host thread, or another thread's operations could land between the two halves in
//!   opposite orders on A and B, which no sequential execution explains (the torn copies of
//!   issue 16). [`post_atomically`] locks every involved inbox, in device order, pushes,
//!   then unlocks: strict two-phase locking, so the call takes effect at the moment it
//!   holds all the locks, between its start and its return (linearizable).
//! - **Batching.** A post wakes the consumer only when it was idle
//!   (its `scheduled` flag); while it works, later posts just append, and it drains
//!   everything queued in one go. One wake-up (one actor message) carries many operations.
//!
//! # The hand-off
//!
//! `scheduled` is set by the post that finds the consumer idle, which then kicks it (calls
//! the wake callback) or, where a runner is set ([`Inbox::set_runner`]), decides on its own
//! thread in the consumer's place ([`crate::dispatch::DeviceTurn`]); it stays set while the
//! consumer drains, and is cleared only by
//! [`Inbox::finish`] under the lock when the queue is empty. A post either sees it set
//! (the consumer will see the new operation before it may clear it) or sets it and drains
//! or kicks:
//! no operation is left behind by an idle consumer. A consumer that must wait for another
//! device in the middle of a batch ([`crate::dispatch::DeviceCore`]) keeps `scheduled`
//! set and is kicked again by whoever unblocks it ([`Inbox::kick`]).
//!
//! Capacity: a post to a full inbox waits for the consumer to make room, holding no other
//! inbox's lock while it waits (a consumer may need another device to progress first).

use std::collections::VecDeque;
use std::fmt;

use crate::{
    ids::DeviceId,
    sync::{Arc, Condvar, Mutex, MutexGuard},
};

/// What a kick does: for an actor, send it the message that makes it drain; for a model
/// thread, nothing (it waits on [`Inbox::wait_kicked`]).
pub type Waker = std::sync::Arc<dyn Fn() + Send + Sync>;

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
    runner: std::sync::OnceLock<Waker>,
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
    /// calls are ignored): `runner` must decide what is queued, or kick (see
    /// [`crate::dispatch::DeviceTurn::run_here`]). Posts from consumers
    /// ([`Inbox::post_internal`]) and waits for room always kick.
    pub fn set_runner(&self, runner: Waker) {
        let _ = self.runner.set(runner);
    }

    /// A post found the consumer idle and owes it a drain: run it here if a runner is
    /// set, else kick it.
    fn wake_idle(&self) {
        match self.runner.get() {
            Some(run) => run(),
            None => self.kick(),
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
            s = self.state.lock();
            while !s.closed && s.queue.len() >= self.capacity {
                s = self.room.wait(s);
            }
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
    pub fn kick(&self) {
        if let Some(w) = self.waker.get() {
            w();
            return;
        }
        let mut s = self.state.lock();
        s.kicked = true;
        self.work.notify_all();
    }

    /// Consumer side: moves every queued operation to the back of `into`.
    pub fn drain_into(&self, into: &mut VecDeque<T>) {
        let mut s = self.state.lock();
        if into.is_empty() {
            std::mem::swap(&mut s.queue, into);
        } else {
            into.extend(s.queue.drain(..));
        }
        self.room.notify_all();
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
        let mut guards: Vec<MutexGuard<'_, InboxState<T>>> = Vec::with_capacity(inboxes.len());
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
            let mut g = inbox.state.lock();
            while !g.closed && g.queue.len() >= inbox.capacity {
                g = inbox.room.wait(g);
            }
            continue;
        }
        let mut kick = Vec::new();
        for (i, g) in guards.iter_mut().enumerate() {
            let queue = &mut g.queue;
            fill(i, &mut |op| queue.push_back(op));
            if !g.scheduled && !g.queue.is_empty() {
                g.scheduled = true;
                kick.push(i);
            }
        }
        drop(guards);
        for i in kick {
            inboxes[i].wake_idle();
        }
        return Ok(());
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
