//! Tickets: the handle `schedule` returns before the device actor has processed it.
//!
//! Scheduling must not cost a round trip, so the host gets a [`Ticket`] at once and the
//! device actor fills in the operation's [`Event`] (or the typed error that refused it)
//! when it processes the message. Waiting on a ticket first waits for that assignment, then
//! for the event. If the actor stops before processing the message, the ticket resolves to
//! [`Error::ShutDown`], so no waiter can hang on a dead actor.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Condvar, Mutex},
    task::{Context, Poll, Wake, Waker},
    time::{Duration, Instant},
};

use tributary::{Error, Event, Result};

enum State {
    Pending(Vec<Waker>),
    Ready(Result<Event>),
}

struct Slot {
    state: Mutex<State>,
    ready: Condvar,
}

impl Slot {
    fn resolve(&self, value: Result<Event>) {
        let wakers = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match std::mem::replace(&mut *s, State::Ready(value)) {
                State::Pending(w) => w,
                State::Ready(old) => {
                    // First resolution wins.
                    *s = State::Ready(old);
                    Vec::new()
                }
            }
        };
        self.ready.notify_all();
        wakers.into_iter().for_each(Waker::wake);
    }
}

/// The event of an operation, possibly not assigned yet.
#[derive(Clone)]
pub struct Ticket {
    slot: Arc<Slot>,
}

/// The device actor's side of a [`Ticket`]. Dropping it unresolved fails the ticket.
pub struct TicketSender {
    slot: Option<Arc<Slot>>,
}

impl std::fmt::Debug for TicketSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TicketSender")
    }
}

impl TicketSender {
    /// Assigns the ticket's outcome.
    pub fn resolve(mut self, value: Result<Event>) {
        if let Some(slot) = self.slot.take() {
            slot.resolve(value);
        }
    }
}

impl Drop for TicketSender {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            slot.resolve(Err(Error::ShutDown(
                "the actor stopped before processing the operation".into(),
            )));
        }
    }
}

impl Ticket {
    /// A new pending ticket and its sender.
    pub fn new() -> (Ticket, TicketSender) {
        let slot = Arc::new(Slot {
            state: Mutex::new(State::Pending(Vec::new())),
            ready: Condvar::new(),
        });
        (
            Ticket { slot: slot.clone() },
            TicketSender { slot: Some(slot) },
        )
    }

    /// A ticket that is already resolved.
    pub fn ready(value: Result<Event>) -> Ticket {
        let (t, s) = Ticket::new();
        s.resolve(value);
        t
    }

    /// The event, if assigned.
    pub fn try_event(&self) -> Option<Result<Event>> {
        match &*self.slot.state.lock().unwrap_or_else(|p| p.into_inner()) {
            State::Ready(r) => Some(r.clone()),
            State::Pending(_) => None,
        }
    }

    fn event_until(&self, deadline: Option<Instant>) -> Result<Event> {
        let mut s = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let State::Ready(r) = &*s {
                return r.clone();
            }
            s = match deadline {
                None => self.slot.ready.wait(s).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Timeout {
                            what: "event assignment by the device actor".into(),
                            after: Duration::ZERO,
                        });
                    }
                    self.slot
                        .ready
                        .wait_timeout(s, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    /// Blocks until the device actor assigned the event (or refused the operation).
    pub fn event(&self) -> Result<Event> {
        self.event_until(None)
    }

    /// Whether the operation completed (successfully or not).
    pub fn is_done(&self) -> bool {
        match self.try_event() {
            Some(Ok(e)) => e.is_done(),
            Some(Err(_)) => true,
            None => false,
        }
    }

    /// Blocks until the operation completed; its error or root cause otherwise.
    pub fn wait(&self) -> Result<()> {
        self.event()?.wait()
    }

    /// Like [`Ticket::wait`], bounded by `timeout`.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let event = self.event_until(Some(deadline)).map_err(|e| match e {
            Error::Timeout { what, .. } => Error::Timeout {
                what,
                after: timeout,
            },
            other => other,
        })?;
        event.wait_timeout(deadline.saturating_duration_since(Instant::now()))
    }

    /// Waits asynchronously for the event's assignment and completion.
    pub async fn wait_async(&self) -> Result<()> {
        let event = self.event_async().await?;
        event.wait_async().await
    }

    /// Waits asynchronously for the event's assignment only.
    pub async fn event_async(&self) -> Result<Event> {
        TicketFuture { slot: &self.slot }.await
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.try_event() {
            Some(Ok(e)) => write!(f, "Ticket({e})"),
            Some(Err(e)) => write!(f, "Ticket(error: {e})"),
            None => f.write_str("Ticket(pending)"),
        }
    }
}

struct TicketFuture<'a> {
    slot: &'a Slot,
}

impl Future for TicketFuture<'_> {
    type Output = Result<Event>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
        match &mut *s {
            State::Ready(r) => Poll::Ready(r.clone()),
            State::Pending(wakers) => {
                if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
                    wakers.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}

struct ThreadWaker(std::thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs a future to completion on the calling thread (for the blocking API).
pub fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}
