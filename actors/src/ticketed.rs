//! Constructors of the messages whose operation produces an event: [`Schedule`], [`FromHost`]
//! and [`ToHost`]. Each asks the system's dispatcher to promise the event and returns the
//! message with the [`Ticket`] the device will decide. They live apart from `messages.rs`
//! because they need the [`System`] and the messages do not.

use tributary::{
    kernels::Bindings,
    pending::SeqPromise,
    protocol::{Context, Routine},
    StreamId, TensorNode,
};

use crate::{
    messages::{FromHost, Schedule, ToHost},
    system::System,
    ticket::Ticket,
};

/// A promise for an operation on `stream` and its ticket; a refused ticket when the
/// stream is not one of `sys`'s.
fn promise(sys: &System, stream: StreamId) -> (Option<SeqPromise>, Ticket) {
    match sys.dispatcher().pending_event(stream) {
        Ok((pending, promise)) => (Some(promise), Ticket::pending(pending)),
        Err(e) => (None, Ticket::ready(Err(e))),
    }
}

impl Schedule {
    /// A schedule of `routine` and the ticket its device will decide.
    pub fn new(sys: &System, routine: Routine) -> (Schedule, Ticket) {
        let (promise, ticket) = promise(sys, routine.context().stream());
        (
            Schedule {
                routine,
                bindings: Bindings::none(),
                promise,
            },
            ticket,
        )
    }
}

impl FromHost {
    /// An upload of `node`'s host array into `ctx`, and its ticket.
    pub fn new(sys: &System, ctx: Context, node: TensorNode) -> (FromHost, Ticket) {
        let (promise, ticket) = promise(sys, ctx.stream());
        (FromHost { ctx, node, promise }, ticket)
    }
}

impl ToHost {
    /// A download of `node`'s buffer in `ctx` into its host array, and its ticket.
    pub fn new(sys: &System, ctx: Context, node: TensorNode) -> (ToHost, Ticket) {
        let (promise, ticket) = promise(sys, ctx.stream());
        (ToHost { ctx, node, promise }, ticket)
    }
}
