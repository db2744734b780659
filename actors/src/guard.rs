//! The last line against panics in actors.
//!
//! Validation makes every accepted message safe to handle; this guard is for the bugs it
//! missed. A panicking actix handler ends the actor's task but not its arbiter. The actor's
//! mailbox closes, later requests fail with a misleading `ShutDown`, and operations it issued
//! but never handed to a stream leave their waiters hanging. So handlers run under
//! [`std::panic::catch_unwind`], and the panic becomes [`Error::ActorPanicked`] in the reply.
//! Each actor decides what else fails. See DESIGN.md §4, "Public and private messages".

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
