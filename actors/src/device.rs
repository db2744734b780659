//! The device actor: the single owner of one device's protocol state.
//!
//! [`DeviceActor`] wraps the engine's sans-IO [`DeviceState`]: every message becomes a
//! call on the state machine, in arrival order, and the resulting plans go to the stream
//! actors of the device (which live on the same arbiter, so that hop costs no thread
//! wake-up). The actor never waits for work: waits happen on stream workers and on the
//! host. The state asks the backend for pool memory itself, while it decides
//! ([`tributary::backend::BackendMemory`]). Completion events from the streams trigger
//! pruning and deferred frees.

use std::{
    sync::{Arc, Mutex},
    time::Instant,
};

use actix::{Actor, Addr, AsyncContext, Context as ActorContext, Handler, ResponseFuture};
use tributary::{
    backend::Backend,
    protocol::{Context, DeviceState, HostTable, Plan, Routine, Source},
    DeviceId, Event, Result,
};

use crate::{messages::*, stream::StreamActor};

/// Sweep at most this often in response to completions.
const SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_millis(2);

/// The actor owning one device's pools and tables.
pub struct DeviceActor {
    state: DeviceState,
    host: Arc<Mutex<HostTable>>,
    backend: Arc<dyn Backend>,
    streams: Vec<Addr<StreamActor>>,
    mailbox_capacity: usize,
    last_sweep: Instant,
}

impl DeviceActor {
    /// A device actor over `state`, submitting to `streams` (stream `i` is index `i`).
    pub fn new(
        state: DeviceState,
        host: Arc<Mutex<HostTable>>,
        backend: Arc<dyn Backend>,
        streams: Vec<Addr<StreamActor>>,
        mailbox_capacity: usize,
    ) -> Self {
        DeviceActor {
            state,
            host,
            backend,
            streams,
            mailbox_capacity,
            last_sweep: Instant::now(),
        }
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.state.device()
    }

    fn host(&self) -> std::sync::MutexGuard<'_, HostTable> {
        self.host.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands plans to their stream actors (in order).
    fn submit(&mut self, plans: Vec<Plan>) {
        let mut batch: Vec<Plan> = Vec::new();
        for plan in plans {
            if batch.last().is_some_and(|p| p.stream != plan.stream) {
                self.flush(std::mem::take(&mut batch));
            }
            batch.push(plan);
        }
        self.flush(batch);
    }

    fn flush(&self, batch: Vec<Plan>) {
        let Some(first) = batch.first() else { return };
        match self.streams.get(first.stream.index as usize) {
            // Same arbiter: do_send cannot be refused for capacity by a live actor, and
            // the device mailbox above it is what applies back-pressure to the host.
            Some(addr) => addr.do_send(Submit(batch)),
            None => {
                for plan in batch {
                    plan.event.timeline().fail(
                        plan.event.seq(),
                        Arc::new(tributary::Failure {
                            stream: plan.stream,
                            seq: plan.event.seq(),
                            operation: plan.work.label(),
                            message: "no stream actor".into(),
                        }),
                    );
                }
            }
        }
    }

    fn last_event(plans: &[Plan]) -> Option<Event> {
        plans.last().map(|p| p.event.clone())
    }

    fn sweep(&mut self) {
        self.state.sweep();
        self.host().prune();
        self.last_sweep = Instant::now();
    }

    fn debug_info(&self) -> serde_json::Value {
        let streams: Vec<_> = (0..self.state.stream_count())
            .filter_map(|i| self.state.timeline(i))
            .map(|t| serde_json::json!({ "stream": t.stream().to_string(), "completed": t.completed() }))
            .collect();
        serde_json::json!({
            "device": self.state.device(),
            "tables": self.state.table_sizes(),
            "pools": self.state.pool_stats(),
            "streams": streams,
            "last_events": self.state.last_events().iter().map(|e| e.to_string()).collect::<Vec<_>>(),
        })
    }
}

impl Actor for DeviceActor {
    type Context = ActorContext<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.mailbox_capacity);
        let me = ctx.address().recipient::<Completed>();
        for s in &self.streams {
            s.do_send(Subscribe(me.clone()));
        }
    }
}

macro_rules! span {
    ($self:ident, $msg:literal) => {
        tracing::trace_span!($msg, device = %$self.state.device()).entered()
    };
}

impl Handler<NewContext> for DeviceActor {
    type Result = Result<Context>;
    fn handle(&mut self, msg: NewContext, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "new_context");
        self.state.root_context(msg.stream)
    }
}

impl Handler<Link> for DeviceActor {
    type Result = Result<Routine>;
    fn handle(&mut self, msg: Link, _: &mut Self::Context) -> Self::Result {
        let _s =
            tracing::trace_span!("link", device = %self.state.device(), routine = %msg.spec.name)
                .entered();
        self.backend
            .check_kernel(self.state.device(), &msg.spec.name, &msg.spec.kernel)?;
        let (routine, plans) = self.state.link(&msg.ctx, msg.spec)?;
        self.submit(plans);
        Ok(routine)
    }
}

impl Handler<Schedule> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: Schedule, _: &mut Self::Context) {
        let _s = tracing::trace_span!(
            "schedule",
            device = %self.state.device(),
            stream = %msg.routine.context().stream(),
            routine = msg.routine.name()
        )
        .entered();
        let host = self.host.clone();
        let planned = {
            let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
            host.set_order(msg.order);
            self.state.schedule(&msg.routine, &mut host)
        };
        let result = planned.and_then(|plans| {
            let event = Self::last_event(&plans);
            self.submit(plans);
            event.ok_or_else(|| tributary::Error::Unknown {
                what: "empty plan".into(),
            })
        });
        if let Ok(e) = &result {
            tracing::trace!(seq = e.seq(), "scheduled");
        }
        msg.ticket.resolve(result);
    }
}

impl Handler<FromHost> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: FromHost, _: &mut Self::Context) {
        let _s = span!(self, "from_host");
        let host = self.host.clone();
        let plan = {
            let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
            host.set_order(msg.order);
            self.state.from_host(&msg.ctx, &msg.node, &mut host)
        };
        let result = plan.map(|p| {
            let e = p.event.clone();
            self.submit(vec![p]);
            e
        });
        msg.ticket.resolve(result);
    }
}

impl Handler<ToHost> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: ToHost, _: &mut Self::Context) {
        let _s = span!(self, "to_host");
        let host = self.host.clone();
        let plan = {
            let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
            host.set_order(msg.order);
            self.state.to_host(&msg.ctx, &msg.node, &mut host)
        };
        let result = plan.map(|p| {
            let e = p.event.clone();
            self.submit(vec![p]);
            e
        });
        msg.ticket.resolve(result);
    }
}

impl Handler<InitFromHost> for DeviceActor {
    type Result = Result<Context>;
    fn handle(&mut self, msg: InitFromHost, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "init_from_host");
        let (child, mut plans) = self.state.add_array(&msg.ctx, &msg.node)?;
        let host = self.host.clone();
        let upload = {
            let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
            host.set_order(msg.order);
            self.state.from_host(&child, &msg.node, &mut host)
        };
        match upload {
            Ok(p) => plans.push(p),
            Err(e) => {
                // Keep the state consistent: the child exists, its memsets must run.
                self.submit(plans);
                return Err(e);
            }
        }
        self.submit(plans);
        Ok(child)
    }
}

impl Handler<ReadInto> for DeviceActor {
    type Result = Result<Event>;
    fn handle(&mut self, msg: ReadInto, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "read");
        let plan = self.state.read_into(&msg.ctx, &msg.node, msg.into)?;
        let e = plan.event.clone();
        self.submit(vec![plan]);
        Ok(e)
    }
}

impl Handler<TransferToHost> for DeviceActor {
    type Result = Result<Event>;
    fn handle(&mut self, msg: TransferToHost, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "transfer_to_host");
        let host = self.host.clone();
        let plan = {
            let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
            host.set_order(msg.order);
            self.state
                .plan_to_host(msg.stream, &msg.node, msg.loc, &mut host)?
        };
        let e = plan.event.clone();
        self.submit(vec![plan]);
        Ok(e)
    }
}

impl Handler<GetSource> for DeviceActor {
    type Result = Result<Source>;
    fn handle(&mut self, msg: GetSource, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "source");
        self.state.source(&msg.ctx, &msg.node)
    }
}

impl Handler<CopyIn> for DeviceActor {
    type Result = Result<Option<Event>>;
    fn handle(&mut self, msg: CopyIn, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "copy_in");
        let host = self.host.clone();
        let plan = {
            let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
            host.set_order(msg.order);
            self.state
                .copy_in(&msg.dst, &msg.source, msg.into_merge, &mut host)?
        };
        match plan {
            Some(p) => {
                let e = p.event.clone();
                self.submit(vec![p]);
                Ok(Some(e))
            }
            None => Ok(None),
        }
    }
}

impl Handler<ScheduleStreaming> for DeviceActor {
    type Result = Result<Event>;
    fn handle(&mut self, msg: ScheduleStreaming, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "schedule_streaming");
        let host = self.host.clone();
        let plans = {
            let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
            host.set_order(msg.order);
            self.state
                .schedule_streaming(&msg.routine, &msg.source, &mut host)?
        };
        let e = Self::last_event(&plans).ok_or_else(|| tributary::Error::Unknown {
            what: "empty plan".into(),
        })?;
        self.submit(plans);
        Ok(e)
    }
}

impl Handler<RecordRead> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: RecordRead, _: &mut Self::Context) {
        self.state.record_remote_read(msg.loc, msg.event);
    }
}

impl Handler<Finalize> for DeviceActor {
    type Result = Result<()>;
    fn handle(&mut self, msg: Finalize, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "finalize");
        let host = self.host.clone();
        let plans = {
            let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
            host.set_order(msg.order);
            self.state.finalize(&msg.ctx, &mut host)?
        };
        self.submit(plans);
        Ok(())
    }
}

impl Handler<Fence> for DeviceActor {
    type Result = ();
    fn handle(&mut self, _: Fence, _: &mut Self::Context) {}
}

impl Handler<LastEvents> for DeviceActor {
    type Result = Vec<Event>;
    fn handle(&mut self, _: LastEvents, _: &mut Self::Context) -> Vec<Event> {
        self.state.last_events()
    }
}

impl Handler<StreamLastEvent> for DeviceActor {
    type Result = Result<Option<Event>>;
    fn handle(&mut self, msg: StreamLastEvent, _: &mut Self::Context) -> Self::Result {
        let stream = self
            .state
            .timeline(msg.stream)
            .ok_or_else(|| tributary::Error::Unknown {
                what: format!("stream {} on {}", msg.stream, self.state.device()),
            })?
            .stream();
        Ok(self
            .state
            .last_events()
            .into_iter()
            .find(|e| e.stream() == stream))
    }
}

impl Handler<Sweep> for DeviceActor {
    type Result = ();
    fn handle(&mut self, _: Sweep, _: &mut Self::Context) {
        self.sweep();
    }
}

impl Handler<IsIdle> for DeviceActor {
    type Result = bool;
    fn handle(&mut self, _: IsIdle, _: &mut Self::Context) -> bool {
        self.state.last_events().iter().all(|e| e.is_done())
    }
}

impl Handler<GetMemoryStats> for DeviceActor {
    type Result = actix::MessageResult<GetMemoryStats>;
    fn handle(&mut self, _: GetMemoryStats, _: &mut Self::Context) -> Self::Result {
        actix::MessageResult(self.state.pool_stats())
    }
}

impl Handler<GetTableSizes> for DeviceActor {
    type Result = actix::MessageResult<GetTableSizes>;
    fn handle(&mut self, _: GetTableSizes, _: &mut Self::Context) -> Self::Result {
        actix::MessageResult(self.state.table_sizes())
    }
}

impl Handler<DebugInfo> for DeviceActor {
    type Result = actix::MessageResult<DebugInfo>;
    fn handle(&mut self, _: DebugInfo, _: &mut Self::Context) -> Self::Result {
        actix::MessageResult(self.debug_info())
    }
}

impl Handler<Completed> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: Completed, _: &mut Self::Context) {
        tracing::trace!(stream = %msg.stream, seq = msg.seq, "completed");
        if self.last_sweep.elapsed() >= SWEEP_INTERVAL {
            self.sweep();
        }
    }
}

impl Handler<StopStreams> for DeviceActor {
    type Result = ResponseFuture<Vec<Abandoned>>;
    fn handle(&mut self, msg: StopStreams, _: &mut Self::Context) -> Self::Result {
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
