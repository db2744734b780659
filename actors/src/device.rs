//! The device actor: the single owner of one device's protocol state.
//!
//! [`DeviceActor`] owns the engine's [`DeviceCore`] through its [`DeviceTurn`]. Host threads
//! and the coordinator post operations to its inbox directly. By default, the post that finds
//! the device idle decides on its own thread; otherwise it kicks the actor, which then
//! drains: a [`Kicks`] flag the actor polls as a stream (a message would box its envelope
//! every time). A drained actor decides everything queued until the inbox is empty. Plans go
//! straight to the stream queues through a [`PlanSink`]. The actor never waits for work. See
//! DESIGN.md §4, "Who decides".
//!
//! Public messages from [`crate::messages`] become the same operations, posted behind what
//! is queued. Completions from the streams trigger pruning and deferred frees.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use actix::{
    prelude::Stream, Actor, Addr, AsyncContext, Context as ActorContext, Handler, ResponseFuture,
    StreamHandler,
};
use tributary::{
    backend::StreamQueue,
    dispatch::{
        answer,
        kicks::Kicks,
        messages::{DeviceOp, Query, Reply},
        DeviceTurn, Dispatcher, PlanSink, Progress,
    },
    pending::SeqPromise,
    protocol::{Context, Plans, Routine, StreamProgram, TableSizes},
    DeviceId, Error, Event, Result,
};

use crate::{
    messages::*,
    stream::{StreamActor, StreamWatch},
};

/// Sweep at most this often in response to completions.
const SWEEP_INTERVAL: Duration = Duration::from_millis(2);

/// The actor owning one device's pools and tables.
pub struct DeviceActor {
    turn: Arc<DeviceTurn>,
    dispatcher: Arc<Dispatcher>,
    index: usize,
    streams: Vec<Addr<StreamActor>>,
    last_sweep: Instant,
    /// The actor's wake-ups (set once started).
    kicks: Arc<Kicks>,
}

/// Hands plans to the stream queues; on request ([`PlanSink::watch`]: memory waits for
/// work in flight) makes each stream's actor watch for its completions.
pub(crate) struct QueueSink {
    queues: Vec<Arc<dyn StreamQueue>>,
    watches: Vec<StreamWatch>,
}

impl QueueSink {
    pub(crate) fn new(queues: Vec<Arc<dyn StreamQueue>>, watches: Vec<StreamWatch>) -> Self {
        QueueSink { queues, watches }
    }
}

impl PlanSink for QueueSink {
    fn submit(&mut self, plans: &mut Plans) {
        for plan in plans.drain(..) {
            let i = plan.stream().index as usize;
            match (self.queues.get(i), self.watches.get(i)) {
                (Some(q), Some(w)) => {
                    w.submitted(plan.event().seq());
                    // A dead queue fails the plan's event itself.
                    let _ = q.submit(plan);
                }
                _ => plan.fail_unsubmitted("no such stream queue"),
            }
        }
    }

    fn submit_programs(&mut self, programs: &mut Vec<StreamProgram>) {
        // A queue that runs programs takes its stream's part whole; the others' operations
        // go as plans, in issue order.
        let mut plans = Plans::new();
        for program in programs.drain(..) {
            let i = program.stream().index as usize;
            match (self.queues.get(i), self.watches.get(i)) {
                (Some(q), Some(w)) if q.runs_programs() => {
                    w.submitted(program.last_seq());
                    // A dead queue fails the program's events itself.
                    let _ = q.submit_program(program);
                }
                _ => program.into_plans(|plan| plans.push(plan)),
            }
        }
        if !plans.is_empty() {
            plans.sort_by_key(|p| p.issue());
            self.submit(&mut plans);
        }
    }

    fn watch(&mut self) {
        for w in &self.watches {
            w.arm();
        }
    }
}

impl DeviceActor {
    /// A device actor deciding, with `turn`, the operations of its inbox.
    pub(crate) fn new(
        turn: Arc<DeviceTurn>,
        dispatcher: Arc<Dispatcher>,
        index: usize,
        streams: Vec<Addr<StreamActor>>,
    ) -> Self {
        DeviceActor {
            turn,
            dispatcher,
            index,
            streams,
            last_sweep: Instant::now(),
            kicks: Arc::new(Kicks::new()),
        }
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.turn.inbox().device()
    }

    fn drain(&mut self) {
        if self.turn.run_kicked() == Progress::Idle && self.last_sweep.elapsed() >= SWEEP_INTERVAL {
            self.sweep();
        }
    }

    /// Sweeps unless a host thread is deciding (it is not worth making it wait).
    fn sweep(&mut self) {
        if let Some(mut core) = self.turn.try_core() {
            core.sweep();
            self.last_sweep = Instant::now();
        }
    }

    /// Posts an operation with a reply to this device and answers the message with it.
    fn ask<T: Clone + Send + 'static>(
        &self,
        make: impl FnOnce(Reply<T>) -> DeviceOp,
    ) -> ResponseFuture<Result<T>> {
        let asked = self.dispatcher.request(self.index, make);
        Box::pin(async move { answer(asked?).await })
    }

    fn query<T: Clone + Send + 'static>(
        &self,
        make: impl FnOnce(Reply<T>) -> Query,
    ) -> ResponseFuture<Result<T>> {
        self.ask(|r| DeviceOp::Query(make(r)))
    }
}

impl Actor for DeviceActor {
    type Context = ActorContext<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let kicked = self.kicks.clone();
        self.turn.inbox().set_waker(Arc::new(move || kicked.kick()));
        // Posts made before the waker was set found the inbox idle and kicked nobody.
        self.kicks.kick();
        ctx.add_stream(Drains(self.kicks.clone()));
        let completed = ctx.address().recipient::<Completed>();
        for s in &self.streams {
            s.do_send(Subscribe(completed.clone()));
        }
    }
}

/// A device actor's kicks as a stream: one [`Drain`] per batch of kicks, never ending.
struct Drains(Arc<Kicks>);

impl Stream for Drains {
    type Item = Drain;

    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Drain>> {
        self.0.poll_kicked(cx).map(|()| Some(Drain))
    }
}

impl StreamHandler<Drain> for DeviceActor {
    fn handle(&mut self, _: Drain, _: &mut Self::Context) {
        let _s = tracing::trace_span!("drain", device = %self.device()).entered();
        self.drain();
    }
}

impl Handler<NewContext> for DeviceActor {
    type Result = ResponseFuture<Result<Context>>;
    fn handle(&mut self, msg: NewContext, _: &mut Self::Context) -> Self::Result {
        self.ask(|reply| DeviceOp::NewContext {
            stream: msg.stream,
            reply,
        })
    }
}

impl Handler<Link> for DeviceActor {
    type Result = ResponseFuture<Result<Routine>>;
    fn handle(&mut self, msg: Link, _: &mut Self::Context) -> Self::Result {
        self.ask(|reply| DeviceOp::Link {
            ctx: msg.ctx,
            spec: Box::new(msg.spec),
            reply,
        })
    }
}

impl Handler<Schedule> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: Schedule, _: &mut Self::Context) {
        if let Some(promise) = msg.promise {
            // A refusal to post (the device is stopping) drops the promise: the ticket
            // reports `ShutDown`.
            let _ = self.dispatcher.post_to(
                self.index,
                DeviceOp::Schedule {
                    stamp: 0,
                    routine: msg.routine,
                    bindings: msg.bindings,
                    promise,
                },
            );
        }
    }
}

impl DeviceActor {
    fn transfer(
        &self,
        ctx: Context,
        node: tributary::TensorNode,
        up: bool,
        promise: Option<SeqPromise>,
    ) {
        if let Some(promise) = promise {
            let _ = self.dispatcher.post_to(
                self.index,
                DeviceOp::Transfer {
                    stamp: 0,
                    ctx,
                    node,
                    up,
                    promise,
                },
            );
        }
    }
}

impl Handler<FromHost> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: FromHost, _: &mut Self::Context) {
        self.transfer(msg.ctx, msg.node, true, msg.promise);
    }
}

impl Handler<ToHost> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: ToHost, _: &mut Self::Context) {
        self.transfer(msg.ctx, msg.node, false, msg.promise);
    }
}

impl Handler<InitFromHost> for DeviceActor {
    type Result = ResponseFuture<Result<Context>>;
    fn handle(&mut self, msg: InitFromHost, _: &mut Self::Context) -> Self::Result {
        self.ask(|reply| DeviceOp::InitFromHost {
            stamp: 0,
            ctx: msg.ctx,
            node: msg.node,
            reply,
        })
    }
}

impl Handler<Finalize> for DeviceActor {
    type Result = ResponseFuture<Result<()>>;
    fn handle(&mut self, msg: Finalize, _: &mut Self::Context) -> Self::Result {
        self.ask(|reply| DeviceOp::Finalize {
            stamp: 0,
            ctx: msg.ctx,
            reply,
        })
    }
}

impl Handler<Fence> for DeviceActor {
    type Result = ResponseFuture<Result<()>>;
    fn handle(&mut self, _: Fence, _: &mut Self::Context) -> Self::Result {
        self.query(Query::Fence)
    }
}

impl Handler<LastEvents> for DeviceActor {
    type Result = ResponseFuture<Result<Vec<Event>>>;
    fn handle(&mut self, _: LastEvents, _: &mut Self::Context) -> Self::Result {
        self.query(Query::LastEvents)
    }
}

impl Handler<StreamLastEvent> for DeviceActor {
    type Result = ResponseFuture<Result<Option<Event>>>;
    fn handle(&mut self, msg: StreamLastEvent, _: &mut Self::Context) -> Self::Result {
        self.query(|r| Query::StreamLastEvent(msg.stream, r))
    }
}

impl Handler<Sweep> for DeviceActor {
    type Result = ResponseFuture<Result<()>>;
    fn handle(&mut self, _: Sweep, _: &mut Self::Context) -> Self::Result {
        self.query(Query::Sweep)
    }
}

impl Handler<IsIdle> for DeviceActor {
    type Result = ResponseFuture<Result<bool>>;
    fn handle(&mut self, _: IsIdle, _: &mut Self::Context) -> Self::Result {
        self.query(Query::IsIdle)
    }
}

impl Handler<GetMemoryStats> for DeviceActor {
    type Result = ResponseFuture<Result<tributary::memory::PoolStats>>;
    fn handle(&mut self, _: GetMemoryStats, _: &mut Self::Context) -> Self::Result {
        self.query(Query::MemoryStats)
    }
}

impl Handler<GetTableSizes> for DeviceActor {
    type Result = ResponseFuture<Result<TableSizes>>;
    fn handle(&mut self, _: GetTableSizes, _: &mut Self::Context) -> Self::Result {
        self.query(Query::TableSizes)
    }
}

impl Handler<DebugInfo> for DeviceActor {
    type Result = ResponseFuture<Result<serde_json::Value>>;
    fn handle(&mut self, _: DebugInfo, _: &mut Self::Context) -> Self::Result {
        self.query(Query::DebugInfo)
    }
}

impl Handler<Completed> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: Completed, _: &mut Self::Context) {
        tracing::trace!(stream = %msg.stream, seq = msg.seq, "completed");
        // The kicks are polled after the whole mailbox: a kick that came in before this
        // message is acted on now, as a wake-up message queued before it would have been.
        if self.kicks.take() {
            self.drain();
        }
        if self.last_sweep.elapsed() >= SWEEP_INTERVAL {
            self.sweep();
        }
    }
}

impl Handler<StopStreams> for DeviceActor {
    type Result = ResponseFuture<Vec<Abandoned>>;
    fn handle(&mut self, msg: StopStreams, _: &mut Self::Context) -> Self::Result {
        // Decide what was posted before the stop; refuse what comes later.
        self.drain();
        self.turn.core().refuse_all(
            self.turn.inbox(),
            &Error::ShutDown("the system was shut down".into()),
        );
        let streams = self.streams.clone();
        Box::pin(async move {
            let mut abandoned = Vec::new();
            for s in streams {
                if let Ok(Some(a)) = s
                    .send(crate::stream::StopStream {
                        deadline: msg.deadline,
                    })
                    .await
                {
                    abandoned.push(a);
                }
            }
            abandoned
        })
    }
}

/// Panics while deciding (tests of the last line only: no operation can panic).
#[cfg(test)]
#[derive(actix::Message, Debug)]
#[rtype(result = "()")]
pub(crate) struct PanicForTest;

#[cfg(test)]
impl Handler<PanicForTest> for DeviceActor {
    type Result = ();
    fn handle(&mut self, _: PanicForTest, ctx: &mut Self::Context) {
        let e = Error::ActorPanicked {
            actor: format!("device actor {}", self.device()),
            message: "PanicForTest".into(),
            panic: "a bug".into(),
        };
        self.turn.core().poison(&e, "PanicForTest");
        let _ = ctx;
    }
}
