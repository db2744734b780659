//! The stream actor: owns one stream's backend queue and publishes its completions.
//!
//! Plans arrive from the device actor in order and go straight to the backend queue (a
//! CPU worker thread, a Vulkan submission chain, a CUDA stream); the actor never runs or
//! waits for work itself. One watcher future at a time waits, asynchronously, for the last
//! submitted event; when it completes, the actor publishes [`Completed`] to its
//! subscribers (the device actor prunes its tables and frees deferred memory) and re-arms
//! if more work was submitted meanwhile, so completions are coalesced, not one per plan.
//!
//! Only the device actor talks to it (its messages are crate-private): plans reach a
//! stream queue only from the protocol, in the order it issued them.

use std::time::Instant;

use actix::{
    fut::wrap_future, Actor, ActorFutureExt, AsyncContext, Context as ActorContext, Handler,
    Message, Recipient,
};
use tributary::{backend::StreamQueue, sync::Arc, Event, StreamId, Timeline};

use crate::messages::{Abandoned, Completed, Submit, Subscribe};

/// Stop the stream: queued work may finish until `deadline`, the rest is abandoned.
#[derive(Message, Debug)]
#[rtype(result = "Option<Abandoned>")]
pub(crate) struct StopStream {
    /// When to give up.
    pub(crate) deadline: Instant,
}

/// The actor owning one stream's queue.
pub struct StreamActor {
    stream: StreamId,
    queue: Option<Box<dyn StreamQueue>>,
    timeline: Arc<Timeline>,
    subscribers: Vec<Recipient<Completed>>,
    submitted: u64,
    watching: bool,
}

impl StreamActor {
    /// A stream actor over a started backend queue.
    pub(crate) fn new(
        stream: StreamId,
        queue: Box<dyn StreamQueue>,
        timeline: Arc<Timeline>,
    ) -> Self {
        StreamActor {
            stream,
            queue: Some(queue),
            timeline,
            subscribers: Vec::new(),
            submitted: 0,
            watching: false,
        }
    }

    fn watch(&mut self, ctx: &mut ActorContext<Self>) {
        if self.watching || self.submitted <= self.timeline.completed() {
            return;
        }
        self.watching = true;
        let event = Event::new(self.timeline.clone(), self.submitted);
        let seq = self.submitted;
        let fut = wrap_future::<_, Self>(async move { event.wait_async().await }).map(
            move |_result, act, ctx| {
                act.watching = false;
                // A poisoned stream never completes its pending work: stop watching.
                let completed = act.timeline.completed();
                if completed >= seq {
                    let msg = Completed {
                        stream: act.stream,
                        seq: completed,
                    };
                    act.subscribers
                        .retain(|s| s.try_send(msg).is_ok() || s.connected());
                    act.watch(ctx);
                }
            },
        );
        ctx.spawn(fut);
    }
}

impl Actor for StreamActor {
    type Context = ActorContext<Self>;
}

impl Handler<Submit> for StreamActor {
    type Result = ();
    fn handle(&mut self, msg: Submit, ctx: &mut Self::Context) {
        let Some(queue) = &self.queue else {
            for plan in msg.0 {
                plan.fail_unsubmitted("stream stopped");
            }
            return;
        };
        let submitted = &mut self.submitted;
        let actor = format!("stream actor {}", self.stream);
        let outcome = crate::guard::catch(&actor, "Submit", || {
            for plan in msg.0 {
                *submitted = (*submitted).max(plan.event().seq());
                // A dead queue fails the plan's event itself.
                let _ = queue.submit(plan);
            }
            Ok(())
        });
        if let Err(e) = outcome {
            // The last line (see `crate::guard`): a plan lost in the panic would never
            // complete, so everything not completed on the stream fails with the panic.
            tracing::error!(stream = %self.stream, error = %e, "stream actor panicked");
            self.timeline
                .poison(std::sync::Arc::new(tributary::Failure {
                    stream: self.stream,
                    seq: self.timeline.completed() + 1,
                    operation: "submit".into(),
                    message: e.to_string(),
                }));
        }
        self.watch(ctx);
    }
}

impl Handler<Subscribe> for StreamActor {
    type Result = ();
    fn handle(&mut self, msg: Subscribe, _: &mut Self::Context) {
        self.subscribers.push(msg.0);
    }
}

impl Handler<StopStream> for StreamActor {
    type Result = Option<Abandoned>;
    fn handle(&mut self, msg: StopStream, ctx: &mut Self::Context) -> Option<Abandoned> {
        use actix::ActorContext as _;
        let queue = self.queue.take()?;
        let left = msg.deadline.saturating_duration_since(Instant::now());
        let drained = queue.shutdown_within(left);
        let completed = self.timeline.completed();
        ctx.stop();
        if drained && completed >= self.submitted {
            return None;
        }
        let abandoned = Abandoned {
            stream: self.stream,
            from_seq: completed + 1,
            to_seq: self.submitted,
        };
        self.timeline
            .poison(std::sync::Arc::new(tributary::Failure {
                stream: self.stream,
                seq: completed + 1,
                operation: "shutdown".into(),
                message: format!(
                    "abandoned at shutdown (operations {}..={} of {})",
                    abandoned.from_seq, abandoned.to_seq, self.stream
                ),
            }));
        Some(abandoned)
    }
}
