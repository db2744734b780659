//! The last line against panics in actors.
//!
//! Validation makes every message an actor accepts safe to handle; this is for the bugs
//! validation missed. Without it a panicking handler ends the actor's task (the arbiter's
//! tokio runtime catches the unwind, actix restarts nothing): the arbiter thread and its
//! other actors live on, but the actor's mailbox closes, every later request to it fails
//! with a misleading `ShutDown`, and operations it had issued but not yet handed to a stream
//! never complete, so their waiters hang. Instead, handlers run under
//! [`std::panic::catch_unwind`]: the panic becomes [`Error::ActorPanicked`] in the reply,
//! and the actor decides what else fails (the device actor fails everything it issued and
//! refuses every later message, since its tables may be half-updated).

use std::{
    future::Future,
    panic::{catch_unwind, AssertUnwindSafe},
    pin::Pin,
    task::{Context, Poll},
};

use tributary::{Error, Result};

pub(crate) use tributary::error::panic_message;

/// A future whose panics (in any poll) become [`Error::ActorPanicked`]: reply futures run
/// as tasks of their own, so a panic there would drop the reply channel (the caller saw
/// only "mailbox closed").
pub(crate) struct CatchPanics<F> {
    fut: Pin<Box<F>>,
    actor: &'static str,
    message: &'static str,
}

impl<F> CatchPanics<F> {
    /// Wraps `fut`, run by `actor` for `message`.
    pub(crate) fn new(actor: &'static str, message: &'static str, fut: F) -> Self {
        CatchPanics {
            fut: Box::pin(fut),
            actor,
            message,
        }
    }
}

impl<T, F: Future<Output = Result<T>>> Future for CatchPanics<F> {
    type Output = Result<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let (actor, message) = (self.actor, self.message);
        let fut = self.fut.as_mut();
        match catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(poll) => poll,
            Err(payload) => Poll::Ready(Err(Error::ActorPanicked {
                actor: actor.into(),
                message: message.into(),
                panic: panic_message(&*payload),
            })),
        }
    }
}
