//! Tickets: the handle `schedule` returns before the device actor has decided the operation.
//!
//! Scheduling must not cost a round trip. So the host gets a [`Ticket`] at once, a handle on
//! the engine's [`PendingEvent`]. Its stream is known from the start. Its sequence number, or
//! the typed error that refused it, arrives when the device decides. Creating one costs one
//! small allocation; deciding it costs one store, plus a wake-up if somebody waits. Waiting
//! on a ticket waits for that decision, then for the event. If the device stops first, the
//! ticket resolves to [`Error::ShutDown`], so no waiter hangs.

use std::time::{Duration, Instant};

use tributary::{
    dispatch::{HeldEvent, Issued},
    pending::PendingEvent,
    Error, Event, Result,
};

/// The event of an operation, possibly not decided yet. Cheap to clone.
#[derive(Clone)]
pub struct Ticket {
    inner: Inner,
}

#[derive(Clone)]
enum Inner {
    Pending(PendingEvent),
    /// A call the automatic replay holds for a replay of its segment: asking for its event
    /// issues what is held if it still is (DESIGN.md §4, "Automatic replay").
    Held(HeldEvent),
    /// The error boxed: inline it made every ticket 88 bytes (40 now), and tickets are
    /// moved in lists of them at every call (a replay's lasts, a cluster call's).
    Ready(Result<Event, Box<Error>>),
}

/// A decided ticket's value as the API gives it.
fn unboxed(r: &Result<Event, Box<Error>>) -> Result<Event> {
    match r {
        Ok(e) => Ok(e.clone()),
        Err(e) => Err((**e).clone()),
    }
}

impl Ticket {
    /// A ticket for an operation its device will decide.
    pub(crate) fn pending(pending: PendingEvent) -> Ticket {
        Ticket {
            inner: Inner::Pending(pending),
        }
    }

    /// A ticket for a call the automatic replay issued or holds.
    pub(crate) fn issued(issued: Issued) -> Ticket {
        Ticket {
            inner: match issued {
                Issued::Now(p) => Inner::Pending(p),
                Issued::Held(h) => Inner::Held(h),
            },
        }
    }

    /// A ticket that is already decided.
    ///
    /// ```
    /// use tributary::Error;
    /// use tributary_actors::Ticket;
    /// let t = Ticket::ready(Err(Error::ShutDown("stopped".into())));
    /// assert!(t.is_done());
    /// assert!(t.wait().is_err());
    /// ```
    pub fn ready(value: Result<Event>) -> Ticket {
        Ticket {
            inner: Inner::Ready(value.map_err(Box::new)),
        }
    }

    /// The event, if the operation was decided (or the error that refused it).
    pub fn try_event(&self) -> Option<Result<Event>> {
        match &self.inner {
            Inner::Pending(p) => p.outcome(),
            Inner::Held(h) => match h.pending() {
                Ok(p) => p.outcome(),
                Err(e) => Some(Err(e)),
            },
            Inner::Ready(r) => Some(unboxed(r)),
        }
    }

    /// The status of the operation `back` operations before this one on its stream (`0`:
    /// this one), if it was decided, read without making an event (see
    /// [`PendingEvent::status_before`]); `Err` if it was refused or there is no such
    /// operation. Never waits. The cluster's network stream asks it.
    #[cfg(feature = "mpi")]
    pub(crate) fn try_status_before(&self, back: u64) -> Option<Result<tributary::EventStatus>> {
        match &self.inner {
            Inner::Pending(p) => p.status_before(back),
            Inner::Held(h) => match h.pending() {
                Ok(p) => p.status_before(back),
                Err(e) => Some(Err(e)),
            },
            Inner::Ready(r) => Some(unboxed(r).and_then(|e| {
                e.before(back)
                    .map(|e| e.status())
                    .ok_or_else(|| Error::Internal(format!("the operation {back} before {e:?}")))
            })),
        }
    }

    fn event_until(&self, deadline: Option<Instant>, after: Duration) -> Result<Event> {
        let wait = |p: &PendingEvent| match p.wait_planned(deadline) {
            Some(_) => p
                .outcome()
                .unwrap_or_else(|| Err(Error::Internal("a decided ticket has no outcome".into()))),
            None => Err(Error::Timeout {
                what: format!("the decision of operation {p:?} by its device actor"),
                after,
            }),
        };
        match &self.inner {
            Inner::Ready(r) => unboxed(r),
            Inner::Pending(p) => wait(p),
            Inner::Held(h) => wait(&h.pending()?),
        }
    }

    /// Blocks until the device actor decided the operation: its event, or the error that
    /// refused it.
    pub fn event(&self) -> Result<Event> {
        self.event_until(None, Duration::MAX)
    }

    /// Whether the operation completed (successfully or not), or was refused.
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
        let deadline = Instant::now().checked_add(timeout);
        let event = self.event_until(deadline, timeout)?;
        match deadline {
            Some(d) => event.wait_timeout(d.saturating_duration_since(Instant::now())),
            None => event.wait(),
        }
    }

    /// Waits asynchronously for the decision and the completion.
    pub async fn wait_async(&self) -> Result<()> {
        let event = self.event_async().await?;
        event.wait_async().await
    }

    /// Waits asynchronously for the decision only.
    pub async fn event_async(&self) -> Result<Event> {
        match &self.inner {
            Inner::Ready(r) => unboxed(r),
            Inner::Pending(p) => p.planned_async().await,
            Inner::Held(h) => h.pending()?.planned_async().await,
        }
    }

    /// The operation as an [`Event`] usable before it is decided (a deferred event: it
    /// is done once the operation is decided and complete, or refused).
    pub fn as_event(&self) -> Option<Event> {
        match &self.inner {
            Inner::Pending(p) => Some(p.event()),
            Inner::Held(h) => h.pending().ok().map(|p| p.event()),
            Inner::Ready(r) => r.as_ref().ok().cloned(),
        }
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

/// Runs a future to completion on the calling thread (for the blocking API; never call it
/// inside an `async fn`). The engine crate's [`tributary::dispatch::block_on`], the one the
/// loom models run, re-exported: one implementation for both crates.
///
/// ```
/// assert_eq!(tributary_actors::block_on(async { 7 }), 7);
/// ```
pub use tributary::dispatch::block_on;
