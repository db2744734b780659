//! An unbounded multi-producer, single-consumer channel with disconnection.
//!
//! Normally it wraps `crossbeam-channel`'s unbounded channel. Under `tributary_loom` it is a
//! `VecDeque` behind the shim's `Mutex` and `Condvar`, so loom sees every hand-off. loom
//! cannot see into crossbeam, and `loom::sync::mpsc` does not model disconnection.
//!
//! Both implementations behave alike:
//!
//! - [`Sender::send`] never blocks. It fails, giving the message back, only once the
//!   [`Receiver`] is dropped.
//! - [`Receiver::recv`] blocks until a message arrives and keeps each sender's order. Once
//!   every sender is dropped it still returns what is queued, and only then [`RecvError`]. So
//!   a worker's receive loop drains the queue before it exits.
//! - Dropping the receiver drops the queued messages.

use std::fmt;

/// A message could not be sent because the receiver is gone; the message is given back.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SendError<T>(pub T);

impl<T> SendError<T> {
    /// The message that was not sent.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> fmt::Debug for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SendError { .. }")
    }
}

impl<T> fmt::Display for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("sending on a disconnected channel")
    }
}

impl<T> std::error::Error for SendError<T> {}

/// Every sender is gone and nothing is left in the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvError;

impl fmt::Display for RecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("receiving on an empty and disconnected channel")
    }
}

impl std::error::Error for RecvError {}

#[cfg(not(tributary_loom))]
mod imp {
    pub(super) use crossbeam_channel::{Receiver, Sender};

    pub(super) fn unbounded<T>() -> (Sender<T>, Receiver<T>) {
        crossbeam_channel::unbounded()
    }

    pub(super) fn send<T>(tx: &Sender<T>, msg: T) -> Result<(), T> {
        tx.send(msg).map_err(|e| e.into_inner())
    }

    pub(super) fn recv<T>(rx: &Receiver<T>) -> Result<T, ()> {
        rx.recv().map_err(|_| ())
    }
}

#[cfg(tributary_loom)]
use locked as imp;

/// The lock-and-condition-variable queue used under loom (and unit-tested with std).
#[cfg(any(tributary_loom, test))]
mod locked {
    use std::collections::VecDeque;

    use crate::sync::{Arc, Condvar, Mutex};

    struct State<T> {
        queue: VecDeque<T>,
        senders: usize,
        receiver: bool,
    }

    struct Chan<T> {
        state: Mutex<State<T>>,
        /// Notified when a message arrives or the last sender leaves.
        ready: Condvar,
    }

    pub(crate) struct Sender<T> {
        chan: Arc<Chan<T>>,
    }

    pub(crate) struct Receiver<T> {
        chan: Arc<Chan<T>>,
    }

    pub(crate) fn unbounded<T>() -> (Sender<T>, Receiver<T>) {
        let chan = Arc::new(Chan {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                senders: 1,
                receiver: true,
            }),
            ready: Condvar::new(),
        });
        (
            Sender {
                chan: Arc::clone(&chan),
            },
            Receiver { chan },
        )
    }

    pub(crate) fn send<T>(tx: &Sender<T>, msg: T) -> Result<(), T> {
        let mut state = tx.chan.state.lock();
        if !state.receiver {
            return Err(msg);
        }
        state.queue.push_back(msg);
        drop(state);
        // The receiver re-checks the queue under the lock before it sleeps, and we pushed
        // under the lock: either it sees the message, or it is asleep and woken here.
        if !mutant!("chan_lost_notify") {
            tx.chan.ready.notify_one();
        }
        Ok(())
    }

    pub(crate) fn recv<T>(rx: &Receiver<T>) -> Result<T, ()> {
        let mut state = rx.chan.state.lock();
        loop {
            if mutant!("chan_drop_queued") && state.senders == 0 {
                return Err(());
            }
            if let Some(msg) = state.queue.pop_front() {
                return Ok(msg);
            }
            if state.senders == 0 {
                return Err(());
            }
            state = rx.chan.ready.wait(state);
        }
    }

    impl<T> Clone for Sender<T> {
        fn clone(&self) -> Self {
            self.chan.state.lock().senders += 1;
            Sender {
                chan: Arc::clone(&self.chan),
            }
        }
    }

    impl<T> Drop for Sender<T> {
        fn drop(&mut self) {
            let mut state = self.chan.state.lock();
            state.senders -= 1;
            let last = state.senders == 0;
            drop(state);
            if last {
                self.chan.ready.notify_all();
            }
        }
    }

    impl<T> Drop for Receiver<T> {
        fn drop(&mut self) {
            let mut state = self.chan.state.lock();
            state.receiver = false;
            let queued = std::mem::take(&mut state.queue);
            drop(state);
            // Messages may own things whose drop takes locks: drop them unlocked.
            drop(queued);
        }
    }
}

/// The sending half of a [`channel`](self); cheap to clone.
pub struct Sender<T> {
    inner: imp::Sender<T>,
}

/// The receiving half of a [`channel`](self).
pub struct Receiver<T> {
    inner: imp::Receiver<T>,
}

/// A new unbounded channel.
pub fn unbounded<T>() -> (Sender<T>, Receiver<T>) {
    let (tx, rx) = imp::unbounded();
    (Sender { inner: tx }, Receiver { inner: rx })
}

impl<T> Sender<T> {
    /// Queues `msg` without blocking; gives it back if the receiver is gone.
    pub fn send(&self, msg: T) -> Result<(), SendError<T>> {
        imp::send(&self.inner, msg).map_err(SendError)
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender {
            inner: self.inner.clone(),
        }
    }
}

impl<T> Receiver<T> {
    /// Blocks until a message is available; [`RecvError`] once every sender is gone and
    /// the queue is empty.
    pub fn recv(&self) -> Result<T, RecvError> {
        imp::recv(&self.inner).map_err(|()| RecvError)
    }
}

impl<T> fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Sender { .. }")
    }
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Receiver { .. }")
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::sync::thread;

    #[test]
    fn drains_before_disconnect_and_reports_it() {
        let (tx, rx) = unbounded::<u32>();
        let tx2 = tx.clone();
        tx.send(1).unwrap();
        tx2.send(2).unwrap();
        drop(tx);
        assert_eq!(rx.recv(), Ok(1));
        drop(tx2);
        assert_eq!(rx.recv(), Ok(2));
        assert_eq!(rx.recv(), Err(RecvError));
    }

    #[test]
    fn send_to_dropped_receiver_gives_the_message_back() {
        let (tx, rx) = unbounded::<String>();
        drop(rx);
        let err = tx.send("m".into()).unwrap_err();
        assert_eq!(err.to_string(), "sending on a disconnected channel");
        assert_eq!(err.into_inner(), "m");
    }

    #[test]
    fn blocked_receiver_is_woken_by_send_and_by_disconnect() {
        let (tx, rx) = unbounded::<u32>();
        let h = thread::spawn(move || {
            let mut got = Vec::new();
            while let Ok(m) = rx.recv() {
                got.push(m);
            }
            got
        });
        std::thread::sleep(Duration::from_millis(10));
        for i in 0..100 {
            tx.send(i).unwrap();
        }
        drop(tx);
        assert_eq!(h.join().unwrap(), (0..100).collect::<Vec<_>>());
    }

    /// The same contract for the queue used under loom, run on std threads.
    #[test]
    fn locked_queue_keeps_the_contract() {
        let (tx, rx) = locked::unbounded::<u32>();
        let tx2 = tx.clone();
        let h = thread::spawn(move || {
            let mut got = Vec::new();
            while let Ok(m) = locked::recv(&rx) {
                got.push(m);
            }
            got
        });
        std::thread::sleep(Duration::from_millis(10));
        for i in 0..50 {
            locked::send(&tx, i).unwrap();
        }
        drop(tx);
        for i in 50..100 {
            locked::send(&tx2, i).unwrap();
        }
        drop(tx2);
        assert_eq!(h.join().unwrap(), (0..100).collect::<Vec<_>>());

        let (tx, rx) = locked::unbounded::<u32>();
        locked::send(&tx, 1).unwrap();
        drop(rx);
        assert_eq!(locked::send(&tx, 2), Err(2));
    }
}
