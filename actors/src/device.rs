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
    DeviceId, Error, Event, Result, StreamId,
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
    /// Set when a handler panicked: the error every later message gets.
    poisoned: Option<Error>,
}

impl DeviceActor {
    /// A device actor over `state`, submitting to `streams` (stream `i` is index `i`).
    pub(crate) fn new(
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
            poisoned: None,
        }
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.state.device()
    }

    /// Runs a handler's body; a panic in it is the last line of [`crate::guard`]: it
    /// becomes [`Error::ActorPanicked`], every operation issued on the device fails with it
    /// as root cause (some may have been issued and never handed to a stream, and the
    /// tables may be half-updated), and every later message gets the same error.
    fn guarded<T>(&mut self, message: &str, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        let actor = format!("device actor {}", self.state.device());
        let result = crate::guard::catch(&actor, message, || f(self));
        if let Err(e @ Error::ActorPanicked { .. }) = &result {
            tracing::error!(device = %self.state.device(), error = %e, "device actor panicked");
            for i in 0..self.state.stream_count() {
                if let Some(t) = self.state.timeline(i) {
                    t.poison(Arc::new(tributary::Failure {
                        stream: t.stream(),
                        seq: t.completed().saturating_add(1),
                        operation: message.into(),
                        message: e.to_string(),
                    }));
                }
            }
            self.poisoned = Some(e.clone());
        }
        result
    }

    /// Refuses a stream index beyond the device's streams.
    fn check_stream_index(&self, index: usize) -> Result<()> {
        let count = self.state.stream_count();
        if index >= count {
            return Err(Error::NoSuchStream {
                device: self.state.device(),
                index,
                count,
            });
        }
        Ok(())
    }

    /// Refuses a stream of another device, or beyond the device's streams.
    fn check_stream(&self, stream: StreamId) -> Result<()> {
        if stream.device != self.state.device() {
            return Err(Error::ForeignStream {
                stream,
                device: self.state.device(),
            });
        }
        self.check_stream_index(stream.index as usize)
    }

    fn host(&self) -> std::sync::MutexGuard<'_, HostTable> {
        self.host.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands plans to their stream actors (in order).
    fn submit(&mut self, plans: Vec<Plan>) {
        let mut batch: Vec<Plan> = Vec::new();
        for plan in plans {
            if batch.last().is_some_and(|p| p.stream() != plan.stream()) {
                self.flush(std::mem::take(&mut batch));
            }
            batch.push(plan);
        }
        self.flush(batch);
    }

    fn flush(&self, batch: Vec<Plan>) {
        let Some(first) = batch.first() else { return };
        match self.streams.get(first.stream().index as usize) {
            // Same arbiter: do_send cannot be refused for capacity by a live actor, and
            // the device mailbox above it is what applies back-pressure to the host.
            Some(addr) => addr.do_send(Submit(batch)),
            None => {
                for plan in batch {
                    plan.fail_unsubmitted("no stream actor");
                }
            }
        }
    }

    fn last_event(plans: &[Plan]) -> Option<Event> {
        plans.last().map(|p| p.event().clone())
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
        self.guarded("NewContext", |this| {
            this.check_stream_index(msg.stream)?;
            this.state.root_context(msg.stream)
        })
    }
}

impl Handler<Link> for DeviceActor {
    type Result = Result<Routine>;
    fn handle(&mut self, msg: Link, _: &mut Self::Context) -> Self::Result {
        let _s =
            tracing::trace_span!("link", device = %self.state.device(), routine = %msg.spec.name)
                .entered();
        self.guarded("Link", |this| {
            // The backend compiles or checks the caller's kernel here (naga parses WGSL):
            // a panic there concerns that kernel only and touched no table, so it refuses
            // the routine instead of failing the device.
            let check = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                this.backend.check_routine(this.state.device(), &msg.spec)
            }));
            check.unwrap_or_else(|payload| {
                Err(Error::InvalidRoutine {
                    routine: msg.spec.name.clone(),
                    reason: format!(
                        "the backend's kernel check panicked: {}",
                        crate::guard::panic_message(&*payload)
                    ),
                })
            })?;
            let (routine, plans) = this.state.link(&msg.ctx, msg.spec)?;
            this.submit(plans);
            Ok(routine)
        })
    }
}

impl Handler<Schedule> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: Schedule, _: &mut Self::Context) {
        let Schedule {
            order,
            routine,
            ticket,
            bindings,
        } = msg;
        let _s = tracing::trace_span!(
            "schedule",
            device = %self.state.device(),
            stream = %routine.context().stream(),
            routine = routine.name()
        )
        .entered();
        let result = self.guarded("Schedule", |this| {
            let plans = {
                let host = this.host.clone();
                let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
                host.set_order(order);
                this.state.schedule_with(&routine, &bindings, &mut host)?
            };
            let event = Self::last_event(&plans)
                .ok_or_else(|| tributary::Error::Internal("scheduling planned nothing".into()))?;
            this.submit(plans);
            Ok(event)
        });
        if let Ok(e) = &result {
            tracing::trace!(seq = e.seq(), "scheduled");
        }
        ticket.resolve(result);
    }
}

impl Handler<FromHost> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: FromHost, _: &mut Self::Context) {
        let _s = span!(self, "from_host");
        let FromHost {
            order,
            ctx,
            node,
            ticket,
        } = msg;
        let result = self.guarded("FromHost", |this| {
            let plan = {
                let host = this.host.clone();
                let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
                host.set_order(order);
                this.state.from_host(&ctx, &node, &mut host)?
            };
            let e = plan.event().clone();
            this.submit(vec![plan]);
            Ok(e)
        });
        ticket.resolve(result);
    }
}

impl Handler<ToHost> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: ToHost, _: &mut Self::Context) {
        let _s = span!(self, "to_host");
        let ToHost {
            order,
            ctx,
            node,
            ticket,
        } = msg;
        let result = self.guarded("ToHost", |this| {
            let plan = {
                let host = this.host.clone();
                let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
                host.set_order(order);
                this.state.to_host(&ctx, &node, &mut host)?
            };
            let e = plan.event().clone();
            this.submit(vec![plan]);
            Ok(e)
        });
        ticket.resolve(result);
    }
}

impl Handler<InitFromHost> for DeviceActor {
    type Result = Result<Context>;
    fn handle(&mut self, msg: InitFromHost, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "init_from_host");
        self.guarded("InitFromHost", |this| {
            // Checked before the buffer is added: a refused upload must leave no child.
            this.state.check_context(&msg.ctx)?;
            if !msg.node.mode().is_hosted() {
                return Err(Error::NotHosted {
                    node: msg.node.to_string(),
                });
            }
            let (child, mut plans) = this.state.add_array(&msg.ctx, &msg.node)?;
            let upload = {
                let host = this.host.clone();
                let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
                host.set_order(msg.order);
                this.state.from_host(&child, &msg.node, &mut host)
            };
            match upload {
                Ok(p) => plans.push(p),
                Err(e) => {
                    // Keep the state consistent: the child exists, its memsets must run.
                    this.submit(plans);
                    return Err(e);
                }
            }
            this.submit(plans);
            Ok(child)
        })
    }
}

impl DeviceActor {
    /// Plans the copy of `node`'s buffer in `ctx`, as it is, into `into` (the node's size).
    fn read_buffer(
        &mut self,
        ctx: &Context,
        node: &tributary::TensorNode,
        into: Arc<tributary::memory::AlignedBuffer>,
    ) -> Result<Event> {
        let needed = node.size_in_bytes()?;
        if into.len() as u64 != needed {
            return Err(Error::SizeMismatch {
                node: node.to_string(),
                expected: format!("a destination of {needed} bytes"),
                found: format!("{} bytes", into.len()),
            });
        }
        let plan = self.state.read_into(ctx, node, into)?;
        let e = plan.event().clone();
        self.submit(vec![plan]);
        Ok(e)
    }
}

impl Handler<ReadNode> for DeviceActor {
    type Result = Result<ReadValue>;
    fn handle(&mut self, msg: ReadNode, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "read");
        self.guarded("ReadNode", |this| {
            // A lagging buffer stands for the host array's value (a routine would upload
            // it first): the host reads that, and nothing is planned.
            if this.state.lags(&msg.ctx, &msg.node, &this.host())? {
                return Ok(ReadValue::Host);
            }
            this.read_buffer(&msg.ctx, &msg.node, msg.into)
                .map(ReadValue::Device)
        })
    }
}

impl Handler<ReadInto> for DeviceActor {
    type Result = Result<Event>;
    fn handle(&mut self, msg: ReadInto, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "read");
        self.guarded("ReadInto", |this| {
            this.read_buffer(&msg.ctx, &msg.node, msg.into)
        })
    }
}

impl Handler<TransferToHost> for DeviceActor {
    type Result = Result<Event>;
    fn handle(&mut self, msg: TransferToHost, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "transfer_to_host");
        self.guarded("TransferToHost", |this| {
            this.check_stream(msg.stream)?;
            let plan = {
                let host = this.host.clone();
                let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
                host.set_order(msg.order);
                this.state
                    .plan_to_host(msg.stream, &msg.node, msg.loc, &mut host)?
            };
            let e = plan.event().clone();
            this.submit(vec![plan]);
            Ok(e)
        })
    }
}

impl Handler<GetSource> for DeviceActor {
    type Result = Result<Source>;
    fn handle(&mut self, msg: GetSource, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "source");
        self.guarded("GetSource", |this| {
            let mut source = this.state.source(&msg.ctx, &msg.node)?;
            let host = this.host.clone();
            let upload = {
                let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
                host.set_order(msg.order);
                this.state
                    .upload_lagging_source(&msg.ctx, &mut source, &mut host)?
            };
            // Submitted here, whatever the destination step does later: the upload is an
            // operation of this device, already in its tables.
            if let Some(plan) = upload {
                this.submit(vec![plan]);
            }
            Ok(source)
        })
    }
}

impl Handler<CopyIn> for DeviceActor {
    type Result = Result<Option<Event>>;
    fn handle(&mut self, msg: CopyIn, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "copy_in");
        self.guarded("CopyIn", |this| {
            let plan = {
                let host = this.host.clone();
                let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
                host.set_order(msg.order);
                this.state
                    .copy_in(&msg.dst, &msg.source, msg.into_merge, &mut host)?
            };
            Ok(plan.map(|p| {
                let e = p.event().clone();
                this.submit(vec![p]);
                e
            }))
        })
    }
}

impl Handler<ScheduleStreaming> for DeviceActor {
    type Result = Result<Event>;
    fn handle(&mut self, msg: ScheduleStreaming, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "schedule_streaming");
        self.guarded("ScheduleStreaming", |this| {
            let plans = {
                let host = this.host.clone();
                let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
                host.set_order(msg.order);
                this.state
                    .schedule_streaming(&msg.routine, &msg.source, &mut host)?
            };
            let e = Self::last_event(&plans).ok_or_else(|| {
                tributary::Error::Internal("streaming schedule planned nothing".into())
            })?;
            this.submit(plans);
            Ok(e)
        })
    }
}

impl Handler<RecordRead> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: RecordRead, _: &mut Self::Context) {
        // No reply to carry an error: a refusal (a poisoned actor) has nothing to report.
        let _ = self.guarded("RecordRead", |this| {
            this.state.record_remote_read(msg.loc, msg.event);
            Ok(())
        });
    }
}

impl Handler<Finalize> for DeviceActor {
    type Result = Result<()>;
    fn handle(&mut self, msg: Finalize, _: &mut Self::Context) -> Self::Result {
        let _s = span!(self, "finalize");
        self.guarded("Finalize", |this| {
            let plans = {
                let host = this.host.clone();
                let mut host = host.lock().unwrap_or_else(|p| p.into_inner());
                host.set_order(msg.order);
                this.state.finalize(&msg.ctx, &mut host)?
            };
            this.submit(plans);
            Ok(())
        })
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
        self.check_stream_index(msg.stream)?;
        let stream = StreamId {
            device: self.state.device(),
            index: msg.stream as u32,
        };
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
        // No reply to carry an error: a panic is reported by every later message.
        let _ = self.guarded("Sweep", |this| {
            this.sweep();
            Ok(())
        });
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
            let _ = self.guarded("Completed", |this| {
                this.sweep();
                Ok(())
            });
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

/// A handler that panics (tests of the last line only: no public message can panic).
#[cfg(test)]
#[derive(actix::Message, Debug)]
#[rtype(result = "Result<()>")]
pub(crate) struct PanicForTest;

#[cfg(test)]
impl Handler<PanicForTest> for DeviceActor {
    type Result = Result<()>;
    fn handle(&mut self, _: PanicForTest, _: &mut Self::Context) -> Self::Result {
        self.guarded("PanicForTest", |_| panic!("a bug"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use tributary::{kernels, DType, MemoryMode, TensorNode};

    use super::*;
    use crate::{block_on, System};

    const T: Duration = Duration::from_secs(20);

    fn hosted(sys: &System) -> (TensorNode, Context) {
        let w = TensorNode::new("w", DType::F32, [8])
            .with_mode(MemoryMode::hosted_changed_on_devices())
            .unwrap();
        let c = sys.context(0, 0).unwrap();
        let cw = c.init_from_host(&w, &[1.0f32; 8]).unwrap();
        (w, cw.protocol_context().clone())
    }

    #[test]
    fn transfer_to_host_with_a_bad_stream_is_refused_and_the_actor_serves_on() {
        let sys = System::builder().cpu_devices(2).spawn().unwrap();
        let (w, cw) = hosted(&sys);
        let addr = sys.device_actor(0).unwrap();
        let loc = cw.array(w.id()).unwrap().loc;
        sys.sync().unwrap(); // quiescent: no sweep can change the tables below
        let before = sys.table_sizes().unwrap();
        for stream in [
            StreamId {
                device: DeviceId(0),
                index: 7,
            },
            StreamId {
                device: DeviceId(1),
                index: 0,
            },
        ] {
            let reply = block_on(addr.send(TransferToHost {
                order: sys.next_order(),
                stream,
                node: w.clone(),
                loc,
            }))
            .unwrap();
            match (stream.index, reply) {
                (7, Err(Error::NoSuchStream { index, count, .. })) => {
                    assert_eq!((index, count), (7, 2))
                }
                (0, Err(Error::ForeignStream { stream, .. })) => {
                    assert_eq!(stream.device, tributary::DeviceId(1))
                }
                (_, other) => panic!("{stream}: {other:?}"),
            }
        }
        assert_eq!(sys.table_sizes().unwrap(), before);
        // The actor still serves: a routine on the same stream runs and reads right.
        let r = sys
            .link(&cw, kernels::scale_in_place(&w, 2.0).unwrap())
            .unwrap();
        r.schedule().unwrap().wait_timeout(T).unwrap();
        assert_eq!(r.context().read::<f32>(&w).unwrap(), vec![2.0; 8]);
        sys.shutdown().unwrap();
    }

    #[test]
    fn read_into_a_buffer_of_the_wrong_size_is_refused() {
        let sys = System::builder().cpu_devices(1).spawn().unwrap();
        let (w, cw) = hosted(&sys);
        let addr = sys.device_actor(0).unwrap();
        for len in [16, 64] {
            let into = std::sync::Arc::new(tributary::memory::AlignedBuffer::new(len, 64).unwrap());
            let reply = block_on(addr.send(ReadInto {
                ctx: cw.clone(),
                node: w.clone(),
                into,
            }))
            .unwrap();
            assert!(
                matches!(&reply, Err(Error::SizeMismatch { found, .. }) if found == &format!("{len} bytes")),
                "{reply:?}"
            );
        }
        assert_eq!(sys.read::<f32>(&cw, &w).unwrap(), vec![1.0; 8]);
        sys.shutdown().unwrap();
    }

    #[test]
    fn a_panicking_handler_fails_its_device_and_nothing_else() {
        let sys = System::builder().cpu_devices(2).spawn().unwrap();
        let (w, cw) = hosted(&sys);
        let addr = sys.device_actor(0).unwrap();
        let panicked = block_on(addr.send(PanicForTest)).unwrap();
        let Err(cause @ Error::ActorPanicked { .. }) = panicked else {
            panic!("{panicked:?}")
        };
        assert!(cause.to_string().contains("a bug"), "{cause}");
        // Every later message to that device gets the same error, instead of a dead
        // mailbox (`ShutDown`) or a hang.
        assert_eq!(sys.context(0, 1).err(), Some(cause.clone()));
        let t = sys.from_host(&cw, &w).unwrap();
        assert_eq!(t.wait_timeout(T), Err(cause.clone()));
        // What the device had issued fails with it as root cause, or had completed.
        sys.sync_device(0)
            .unwrap_or_else(|e| assert!(e.root_cause().is_some(), "{e}"));
        // The other device serves.
        let c1 = sys.context(1, 0).unwrap();
        let r = c1.link(kernels::fill(&w, 5.0).unwrap()).unwrap();
        r.schedule().unwrap().wait_timeout(T).unwrap();
        assert_eq!(r.context().read::<f32>(&w).unwrap(), vec![5.0; 8]);
        sys.shutdown().unwrap();
    }

    #[test]
    fn a_panicking_reply_future_becomes_a_typed_error() {
        let fut = crate::guard::CatchPanics::new("coordinator", "test", async {
            if std::hint::black_box(true) {
                panic!("in a reply future");
            }
            Ok(())
        });
        let got: Result<()> = block_on(fut);
        assert!(
            matches!(&got, Err(Error::ActorPanicked { panic, .. }) if panic == "in a reply future"),
            "{got:?}"
        );
    }
}
