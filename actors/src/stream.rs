//! The stream actor: owns one stream's backend queue and publishes its completions.
//!
//! The device actor hands plans straight to the backend queue. The stream actor owns the
//! queue's life, stops it at shutdown, and watches its timeline. It never runs or waits for
//! work itself. One watcher future at a time waits for the last submitted event. When it
//! completes, the actor publishes [`Completed`] and re-arms if more work came meanwhile, so
//! completions are coalesced. The device arms it with one `Watch` message, and only when
//! freed memory waits for work in flight. See DESIGN.md §4, "Completions are not messages
//! unless needed".

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use actix::{
    fut::wrap_future, Actor, ActorFutureExt, Addr, AsyncContext, Context as ActorContext, Handler,
    Message, Recipient,
};
use tributary::{backend::StreamQueue, Event, StreamId, Timeline};

use crate::messages::{Abandoned, Completed, Subscribe, Watch};

/// Stop the stream: queued work may finish until `deadline`, the rest is abandoned.
#[derive(Message, Debug)]
#[rtype(result = "Option<Abandoned>")]
pub(crate) struct StopStream {
    /// When to give up.
    pub(crate) deadline: Instant,
}

/// What the submitting side and the watcher share.
#[derive(Debug, Default)]
struct WatchState {
    /// Highest sequence number submitted.
    submitted: AtomicU64,
    /// A watcher is armed (or a `Watch` message is on its way).
    watching: AtomicBool,
}

/// The submitting side's handle on a stream actor's watcher.
#[derive(Clone)]
pub(crate) struct StreamWatch {
    state: Arc<WatchState>,
    timeline: tributary::sync::Arc<Timeline>,
    addr: Addr<StreamActor>,
}

impl StreamWatch {
    /// Records that `seq` was submitted.
    pub(crate) fn submitted(&self, seq: u64) {
        self.state.submitted.fetch_max(seq, Ordering::Release);
    }

    /// Makes sure the stream actor watches for the completion of what was submitted (one
    /// message when it was idle and work is in flight).
    pub(crate) fn arm(&self) {
        if self.state.submitted.load(Ordering::Acquire) <= self.timeline.completed() {
            return;
        }
        if !self.state.watching.swap(true, Ordering::AcqRel) {
            self.addr.do_send(Watch);
        }
    }
}

/// The actor owning one stream's queue.
pub struct StreamActor {
    stream: StreamId,
    queue: Option<Arc<dyn StreamQueue>>,
    timeline: tributary::sync::Arc<Timeline>,
    subscribers: Vec<Recipient<Completed>>,
    state: Arc<WatchState>,
}

impl StreamActor {
    /// A stream actor over a started backend queue, and the handle the device actor uses
    /// to arm its watcher.
    pub(crate) fn start(
        arbiter: &actix::ArbiterHandle,
        stream: StreamId,
        queue: Arc<dyn StreamQueue>,
        timeline: tributary::sync::Arc<Timeline>,
    ) -> (Addr<StreamActor>, StreamWatch) {
        let state = Arc::new(WatchState::default());
        let (s, t) = (state.clone(), timeline.clone());
        let addr = StreamActor::start_in_arbiter(arbiter, move |_| StreamActor {
            stream,
            queue: Some(queue),
            timeline: t,
            subscribers: Vec::new(),
            state: s,
        });
        (
            addr.clone(),
            StreamWatch {
                state,
                timeline,
                addr,
            },
        )
    }

    fn watch(&mut self, ctx: &mut ActorContext<Self>) {
        let submitted = loop {
            let submitted = self.state.submitted.load(Ordering::Acquire);
            if submitted > self.timeline.completed() {
                break submitted;
            }
            self.state.watching.store(false, Ordering::Release);
            // A submission may have raced with the store: if so, and nobody re-armed,
            // watch it.
            if self.state.submitted.load(Ordering::Acquire) <= self.timeline.completed()
                || self.state.watching.swap(true, Ordering::AcqRel)
            {
                return;
            }
        };
        let event = Event::new(self.timeline.clone(), submitted);
        let seq = submitted;
        let fut = wrap_future::<_, Self>(async move { event.wait_async().await }).map(
            move |_result, act, ctx| {
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
                } else {
                    act.state.watching.store(false, Ordering::Release);
                }
            },
        );
        ctx.spawn(fut);
    }
}

impl Actor for StreamActor {
    type Context = ActorContext<Self>;
}

impl Handler<Watch> for StreamActor {
    type Result = ();
    fn handle(&mut self, _: Watch, ctx: &mut Self::Context) {
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
        let submitted = self.state.submitted.load(Ordering::Acquire);
        ctx.stop();
        if drained && completed >= submitted {
            return None;
        }
        let abandoned = Abandoned {
            stream: self.stream,
            from_seq: completed + 1,
            to_seq: submitted,
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
