//! The device actor's decisions as plain code over its state: [`DeviceCore`].
//!
//! A device actor or a loom model thread owns one `DeviceCore` and calls
//! [`DeviceCore::run`] when its inbox kicks it. `run` decides the queued operations in order.
//! It asks the device's [`DeviceState`] for the plans, hands them to a [`PlanSink`], and
//! answers the caller with a reply or a [`SeqPromise`]. Nothing here waits for work to run.
//!
//! A copy's destination half needs the source's [`Verdict`] before it can plan. If the
//! verdict is missing, `run` returns [`Progress::Blocked`] and keeps the rest of the batch;
//! the verdict kicks the inbox when it is set. See DESIGN.md §4, "Cross-device calls without
//! round trips", for why this wait cannot deadlock.

use std::collections::VecDeque;
use std::sync::Arc as StdArc;
use std::task::{Wake, Waker};

use crate::{
    backend::Backend,
    error::{Error, Result},
    event::Event,
    ids::StreamId,
    node::TensorNode,
    pending::{Planned, SeqPromise},
    protocol::{Context, DeviceState, HostTable, Plans, Routine, StreamProgram},
    sync::{Arc, Mutex},
};

use super::{
    inbox::Inbox,
    messages::{Delivery, DeviceOp, Query, ReadValue, Record, Reply, SourceLink, Verdict},
    replay::PartBox,
};

/// Where a device's plans go: its stream queues (the actor layer), or a model's streams.
pub trait PlanSink: Send {
    /// Hands `plans` to their streams, in order, emptying the list (borrowed, not moved: a
    /// list of one plan is about 500 bytes, copied at every hand-over it was moved by).
    /// Never blocks on the work, nor on another device's decisions (`Event::seq` of a
    /// dependency on a copy's other half that is not planned yet): the thread submitting
    /// may be the one that decides that device next (a post decided in rounds,
    /// [`super::inbox`]).
    fn submit(&mut self, plans: &mut Plans);

    /// Hands a replay's per-stream programs to their streams, emptying `programs`. Default:
    /// their operations as plans, in issue order ([`StreamProgram::into_plans`]); a sink whose
    /// queues run programs ([`StreamQueue::runs_programs`]) hands them over whole.
    ///
    /// [`StreamQueue::runs_programs`]: crate::backend::StreamQueue::runs_programs
    fn submit_programs(&mut self, programs: &mut Vec<StreamProgram>) {
        let mut plans = Plans::new();
        for program in programs.drain(..) {
            program.into_plans(|plan| plans.push(plan));
        }
        plans.sort_by_key(|p| p.issue());
        self.submit(&mut plans);
    }

    /// Asks for a sweep of the device once the work submitted so far completes: called
    /// after a batch that leaves freed memory waiting for work in flight. Tables need no
    /// such call (the device prunes them as it issues), so a device that frees nothing
    /// hears nothing of its completions: no message or wake-up per operation.
    fn watch(&mut self) {}
}

/// How a call to [`DeviceCore::run`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Everything posted was decided and the inbox is idle again.
    Idle,
    /// An operation waits for another device's half of its call; the inbox is kicked
    /// when it may go on.
    Blocked,
    /// [`DeviceCore::run_once`] decided one batch and more was posted meanwhile: the
    /// inbox still owes a drain, which the caller hands to the actor.
    More,
}

/// One device's protocol owner; see the module documentation.
pub struct DeviceCore {
    state: DeviceState,
    /// Host arrays, shared by every device of the system.
    host: Arc<Mutex<HostTable>>,
    /// A host table for operations that touch no hosted node: their decisions never read
    /// or write host records, so they need not take the shared table's lock.
    scratch: HostTable,
    /// Checks kernels at link time (none in models).
    backend: Option<StdArc<dyn Backend>>,
    sink: Box<dyn PlanSink>,
    backlog: VecDeque<DeviceOp>,
    /// Set when deciding an operation panicked: the error every later operation gets.
    poisoned: Option<Error>,
    /// Wakes this core when a verdict it waits for arrives.
    kick: Option<Waker>,
    /// The record of the operation being decided, if it is recorded into a step being
    /// captured (`super::capture`).
    recording: Option<Record>,
    /// The programs of the replay part being decided (kept: a replay allocates no list).
    programs: Vec<StreamProgram>,
}

/// A waker that kicks an inbox.
struct Kick(Arc<Inbox<DeviceOp>>);

impl Wake for Kick {
    fn wake(self: StdArc<Self>) {
        self.0.kick();
    }

    fn wake_by_ref(self: &StdArc<Self>) {
        self.0.kick();
    }
}

/// What handling one operation did.
// Under loom the operation is larger than clippy's bound (loom's synchronisation types are);
// the value is returned and matched at once, and boxing it would allocate where an
// operation blocks.
#[allow(clippy::large_enum_variant)]
enum Handled {
    Done,
    /// The operation waits for a verdict: put it back and stop.
    Blocked(DeviceOp),
}

impl DeviceCore {
    /// A core deciding for `state`, sharing host arrays through `host`, submitting to
    /// `sink`; `backend` checks kernels when they are linked.
    pub fn new(
        state: DeviceState,
        host: Arc<Mutex<HostTable>>,
        backend: Option<StdArc<dyn Backend>>,
        sink: Box<dyn PlanSink>,
    ) -> DeviceCore {
        DeviceCore {
            state,
            host,
            scratch: HostTable::default(),
            backend,
            sink,
            backlog: VecDeque::new(),
            poisoned: None,
            kick: None,
            recording: None,
            programs: Vec::new(),
        }
    }

    /// The device's protocol state (for reports).
    pub fn state(&self) -> &DeviceState {
        &self.state
    }

    /// The error every operation gets after a panic, if one happened.
    pub fn poisoned(&self) -> Option<&Error> {
        self.poisoned.as_ref()
    }

    /// Drains `inbox` and decides every operation in order, until the inbox is idle or an
    /// operation waits for another device ([`Progress::Blocked`]; the inbox is kicked
    /// when it can go on). Call it whenever the inbox kicks.
    pub fn run(&mut self, inbox: &Arc<Inbox<DeviceOp>>) -> Progress {
        loop {
            let progress = self.run_once(inbox);
            if progress != Progress::More {
                return progress;
            }
        }
    }

    /// One batch: decides what is queued now (and what an earlier blocked run kept), then
    /// stops, [`Progress::More`] if more was posted meanwhile. For a thread that decides
    /// on the actor's behalf ([`super::DeviceTurn`]) and must not be kept working by other
    /// threads' posts.
    pub fn run_once(&mut self, inbox: &Arc<Inbox<DeviceOp>>) -> Progress {
        inbox.drain_into(&mut self.backlog);
        let mut progress = Progress::More;
        while let Some(op) = self.backlog.pop_front() {
            if let Handled::Blocked(op) = self.guarded(op, inbox) {
                self.backlog.push_front(op);
                progress = Progress::Blocked;
                break;
            }
        }
        if self.state.reclaim_freed() {
            self.sink.watch();
        }
        if progress == Progress::Blocked {
            return progress;
        }
        if inbox.finish() {
            Progress::Idle
        } else {
            Progress::More
        }
    }

    /// How many operations this device issued are still queued or running.
    pub fn work_in_flight(&self) -> u64 {
        self.state.work_in_flight()
    }

    /// Refuses everything still queued or kept (the device is stopping).
    pub fn refuse_all(&mut self, inbox: &Inbox<DeviceOp>, error: &Error) {
        let mut ops = std::mem::take(&mut self.backlog);
        ops.extend(inbox.close());
        for op in ops {
            let state = &self.state;
            op.refuse(error, |i| state.issued(i));
        }
    }

    /// Decides one operation; a panic while deciding it poisons the device (the last
    /// line: no operation should panic, but if one does, its tables may be half updated,
    /// so every later operation is refused and every issued event fails).
    #[cfg(not(tributary_loom))]
    fn guarded(&mut self, op: DeviceOp, inbox: &Arc<Inbox<DeviceOp>>) -> Handled {
        if let Some(e) = &self.poisoned {
            let state = &self.state;
            op.refuse(e, |i| state.issued(i));
            return Handled::Done;
        }
        let name = op.name();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handle(op, inbox))) {
            Ok(handled) => handled,
            Err(payload) => {
                let e = Error::ActorPanicked {
                    actor: format!("device actor {}", self.state.device()),
                    message: name.into(),
                    panic: crate::error::panic_message(&*payload),
                };
                self.poison(&e, name);
                Handled::Done
            }
        }
    }

    #[cfg(tributary_loom)]
    fn guarded(&mut self, op: DeviceOp, inbox: &Arc<Inbox<DeviceOp>>) -> Handled {
        self.handle(op, inbox)
    }

    /// Fails every operation issued on the device with `e` as root cause and refuses
    /// every later one.
    pub fn poison(&mut self, e: &Error, operation: &str) {
        tracing::error!(device = %self.state.device(), error = %e, "device actor panicked");
        for i in 0..self.state.stream_count() {
            if let Some(t) = self.state.timeline(i) {
                t.poison(std::sync::Arc::new(crate::Failure {
                    stream: t.stream(),
                    seq: t.completed().saturating_add(1),
                    operation: operation.into(),
                    message: e.to_string(),
                }));
            }
        }
        self.poisoned = Some(e.clone());
    }

    fn submit(&mut self, plans: Plans) {
        let mut plans = plans;
        self.submit_from(&mut plans);
    }

    /// [`DeviceCore::submit`] of a list it empties, which stays where its maker put it.
    fn submit_from(&mut self, plans: &mut Plans) {
        if !plans.is_empty() {
            self.sink.submit(plans);
        }
    }

    /// Answers `promise` with the last of `plans` (submitted, emptying the list), or
    /// refuses it with the error at `stream`'s last issued sequence number.
    fn decide(&mut self, promise: SeqPromise, stream: StreamId, plans: &mut Result<Plans>) {
        match plans {
            Ok(plans) => {
                let planned = match plans.last() {
                    Some(p) => Planned::At(p.event().seq()),
                    None => Planned::Refused(
                        self.state.issued(stream.index as usize),
                        Error::Internal("an operation planned nothing".into()),
                    ),
                };
                promise.resolve(planned);
                self.submit_from(plans);
            }
            Err(e) => {
                promise.resolve(Planned::Refused(
                    self.state.issued(stream.index as usize),
                    e.clone(),
                ));
            }
        }
    }

    /// Runs `f` with the host table: the shared one (locked, stamped) when the operation
    /// touches a hosted node, else the scratch table.
    fn with_host<R>(
        &mut self,
        hosted: bool,
        stamp: u64,
        f: impl FnOnce(&mut DeviceState, &mut HostTable) -> R,
    ) -> R {
        if hosted {
            let host = self.host.clone();
            let mut host = host.lock();
            host.set_order(stamp);
            f(&mut self.state, &mut host)
        } else {
            self.scratch.set_order(stamp);
            f(&mut self.state, &mut self.scratch)
        }
    }

    fn check_stream_index(&self, index: usize) -> Result<StreamId> {
        let count = self.state.stream_count();
        if index >= count {
            return Err(Error::NoSuchStream {
                device: self.state.device(),
                index,
                count,
            });
        }
        Ok(StreamId {
            device: self.state.device(),
            index: index as u32,
        })
    }

    /// Decides `op`, its plans stamped with the stamp its call took when it was posted.
    fn handle(&mut self, mut op: DeviceOp, inbox: &Arc<Inbox<DeviceOp>>) -> Handled {
        let stamp = op.stamp_mut().map(|s| *s);
        self.state.set_issue_stamp(stamp);
        let handled = self.decide_op(op, inbox);
        match handled {
            // Not decided yet: what the device does until it is comes before its plans.
            Handled::Blocked(_) => self.state.abandon_issue_stamp(),
            Handled::Done => self.state.set_issue_stamp(None),
        }
        handled
    }

    fn decide_op(&mut self, op: DeviceOp, inbox: &Arc<Inbox<DeviceOp>>) -> Handled {
        match op {
            DeviceOp::NewContext { stream, reply } => {
                let r = self
                    .check_stream_index(stream)
                    .and_then(|_| self.state.root_context(stream));
                reply.send(r);
            }
            DeviceOp::Link { ctx, spec, reply } => {
                let r = self.link(&ctx, *spec);
                reply.send(r);
            }
            DeviceOp::Schedule {
                stamp,
                routine,
                bindings,
                promise,
            } => {
                let hosted = reads_or_writes_hosted(&routine);
                let mut plans = self.with_host(hosted, stamp, |s, h| {
                    s.schedule_with(&routine, &bindings, h)
                });
                self.record(plans.as_ref().err(), 0, |s, rec, r| {
                    s.record_schedule(rec, &routine, &bindings, r.position, r.slot)
                });
                self.decide(promise, routine.context().stream(), &mut plans);
            }
            DeviceOp::Transfer {
                stamp,
                ctx,
                node,
                up,
                promise,
            } => {
                let plan = self.with_host(true, stamp, |s, h| {
                    if up {
                        s.from_host(&ctx, &node, h)
                    } else {
                        s.to_host(&ctx, &node, h)
                    }
                });
                let mut plans = plan.map(|p| Plans::from_buf([p]));
                self.decide(promise, ctx.stream(), &mut plans);
            }
            DeviceOp::InitFromHost {
                stamp,
                ctx,
                node,
                reply,
            } => {
                let r = self.init_from_host(stamp, &ctx, &node);
                reply.send(r);
            }
            DeviceOp::Read {
                ctx,
                node,
                into,
                raw,
                reply,
            } => {
                let r = self.read(&ctx, &node, into, raw);
                reply.send(r);
            }
            DeviceOp::TransferToHost {
                stamp,
                stream,
                node,
                loc,
                reply,
            } => {
                let r = self.check_stream(stream).and_then(|()| {
                    self.with_host(true, stamp, |s, h| s.plan_to_host(stream, &node, loc, h))
                });
                reply.send(r.map(|plan| {
                    let e = plan.event().clone();
                    self.submit(Plans::from_buf([plan]));
                    e
                }));
            }
            DeviceOp::CopySource {
                stamp,
                ctx,
                node,
                reader,
                verdict,
            } => self.copy_source(stamp, &ctx, &node, reader, verdict),
            DeviceOp::CopyDest {
                stamp,
                delivery,
                verdict,
                promise,
                source,
            } => {
                return self.copy_dest(inbox, stamp, delivery, verdict, promise, source);
            }
            DeviceOp::RecordRead { loc, event } => self.state.record_remote_read(loc, event),
            DeviceOp::ForgetRead { loc, event } => self.state.forget_remote_read(loc, &event),
            DeviceOp::Finalize { stamp, ctx, reply } => {
                let plans = self.with_host(true, stamp, |s, h| s.finalize(&ctx, h));
                reply.send(plans.map(|plans| self.submit(plans)));
            }
            DeviceOp::Query(q) => self.query(q),
            DeviceOp::Recorded { record, op } => {
                self.recording = Some(record);
                let handled = self.decide_op(*op, inbox);
                let record = self.recording.take();
                if let (Handled::Blocked(op), Some(record)) = (handled, record) {
                    return Handled::Blocked(DeviceOp::Recorded {
                        record,
                        op: Box::new(op),
                    });
                }
            }
            DeviceOp::Replay { stamp, part } => return self.replay(inbox, stamp, part),
            DeviceOp::Gated { gates, op } => {
                let waker = self.kick_waker(inbox);
                // A refused fence (a poisoned device) orders nothing any more: go on.
                if gates.iter().all(|g| g.poll_get(&waker).is_some()) {
                    return self.handle(*op, inbox);
                }
                return Handled::Blocked(DeviceOp::Gated { gates, op });
            }
        }
        Handled::Done
    }

    fn kick_waker(&mut self, inbox: &Arc<Inbox<DeviceOp>>) -> Waker {
        self.kick
            .get_or_insert_with(|| Waker::from(StdArc::new(Kick(inbox.clone()))))
            .clone()
    }

    /// Records the operation being decided into its capture, if it is recorded: `f` with
    /// the device's recorder when it was planned, else its refusal (`error`). `offset`:
    /// its position within the call (a copy's destination half is the call's second).
    fn record(
        &self,
        error: Option<&Error>,
        offset: u32,
        f: impl FnOnce(&DeviceState, &mut crate::protocol::StepRecorder, &Record),
    ) {
        let Some(r) = &self.recording else { return };
        r.log.with(&self.state, |rec| match error {
            Some(e) => rec.fail(r.position + offset, e.clone()),
            None => f(&self.state, rec, r),
        });
    }

    /// Records the destination half of a recorded copy just decided (`plans`: the source
    /// buffer, the plans, and where the source is and its size).
    fn record_copy_dest(
        &self,
        plans: &Result<(
            crate::ids::BufferLoc,
            Plans,
            (crate::protocol::GlobalLoc, u64),
        )>,
        delivery: &Delivery,
    ) {
        let (error, source) = match plans {
            Err(e) => (Some(e), None),
            Ok((_, _, source)) => (None, Some(*source)),
        };
        self.record(error, 1, |s, rec, r| {
            let Some(source) = source else { return };
            match delivery {
                Delivery::Copy {
                    dst,
                    node,
                    into_merge,
                } => s.record_copy_in(rec, dst, node, *into_merge, source, r.position + 1, r.edge),
                Delivery::Streaming(routine) => {
                    s.record_streaming(rec, routine, source, r.position + 1, r.edge)
                }
            }
        });
    }

    /// This device's part of a replay (`super::replay`): checks, waits for every other
    /// part's check, then issues its templates (waiting where a copy's source has not
    /// answered yet). The part's box goes back to its pool when the part is done or
    /// refused.
    fn replay(&mut self, inbox: &Arc<Inbox<DeviceOp>>, stamp: u64, mut boxed: PartBox) -> Handled {
        let Some(part) = boxed.part() else {
            return Handled::Done;
        };
        let hosted = !part.step.hosted_nodes().is_empty();
        if !part.started {
            let checked = self.with_host(hosted, stamp, |s, h| s.check_replay(&part.step, h));
            let checked = checked.map_err(|why| crate::protocol::invalidated(part.step_id, why));
            part.run.rebase(stamp, stamp);
            part.started = true;
            match part.check.take() {
                Some(check) => check.send(checked),
                // Alone on its step: its own check is the verdict.
                None => match checked {
                    Ok(()) => part.go = true,
                    Err(e) => return self.refuse_replay(boxed, &e),
                },
            }
        }
        let waker = self.kick_waker(inbox);
        if !part.go && mutant!("replay_barrier") {
            // The shape without the barrier: each part issues on its own check alone.
            let own = part.checks.as_ref().and_then(|c| c.get(part.index));
            if let Some(Err(e)) = own.and_then(|c| c.get()) {
                return self.refuse_replay(boxed, &e);
            }
            part.go = true;
        }
        if !part.go {
            match part.poll_checks(&waker) {
                None => return Handled::Blocked(DeviceOp::Replay { stamp, part: boxed }),
                Some(Err(e)) => return self.refuse_replay(boxed, &e),
                Some(Ok(())) => part.go = true,
            }
        }
        let mut programs = std::mem::take(&mut self.programs);
        let progress = {
            let (run, mut links) = part.links(&waker);
            self.with_host(hosted, stamp, |s, h| {
                s.replay(run, &mut links, h, &mut programs)
            })
        };
        if !programs.is_empty() {
            self.sink.submit_programs(&mut programs);
        }
        programs.clear();
        self.programs = programs;
        match progress {
            crate::protocol::ReplayProgress::Blocked => {
                Handled::Blocked(DeviceOp::Replay { stamp, part: boxed })
            }
            crate::protocol::ReplayProgress::Done => {
                for (promise, event) in std::mem::take(&mut part.last)
                    .into_iter()
                    .zip(part.run.last_events())
                {
                    promise.resolve(Planned::At(event.seq()));
                }
                part.step.give_back_events(part.run.take_events());
                boxed.finish();
                Handled::Done
            }
        }
    }

    /// Refuses a replay's part with `error` (see [`ReplayPart::refuse`]).
    fn refuse_replay(&self, boxed: PartBox, error: &Error) -> Handled {
        if let Some(part) = boxed.take() {
            let state = &self.state;
            part.refuse(error, |i| state.issued(i));
        }
        Handled::Done
    }

    fn check_stream(&self, stream: StreamId) -> Result<()> {
        if stream.device != self.state.device() {
            return Err(Error::ForeignStream {
                stream,
                device: self.state.device(),
            });
        }
        self.check_stream_index(stream.index as usize).map(drop)
    }

    fn link(&mut self, ctx: &Context, spec: crate::kernels::RoutineSpec) -> Result<Routine> {
        if let Some(backend) = &self.backend {
            // The backend compiles or checks the caller's kernel here (naga parses WGSL):
            // a panic there concerns that kernel only and touched no table, so it refuses
            // the routine instead of failing the device.
            let device = self.state.device();
            let check = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                backend.check_routine(device, &spec)
            }));
            check.unwrap_or_else(|payload| {
                Err(Error::InvalidRoutine {
                    routine: spec.name.clone(),
                    reason: format!(
                        "the backend's kernel check panicked: {}",
                        crate::error::panic_message(&*payload)
                    ),
                })
            })?;
        }
        let (routine, plans) = self.state.link(ctx, spec)?;
        self.submit(plans);
        Ok(routine)
    }

    fn init_from_host(&mut self, stamp: u64, ctx: &Context, node: &TensorNode) -> Result<Context> {
        // Checked before the buffer is added: a refused upload must leave no child.
        self.state.check_context(ctx)?;
        if !node.mode().is_hosted() {
            return Err(Error::NotHosted {
                node: node.to_string(),
            });
        }
        let (child, mut plans) = self.state.add_array(ctx, node)?;
        let upload = self.with_host(true, stamp, |s, h| s.from_host(&child, node, h));
        match upload {
            Ok(p) => {
                plans.push(p);
                self.submit(plans);
                Ok(child)
            }
            Err(e) => {
                // Keep the state consistent: the child exists, its memsets must run.
                self.submit(plans);
                Err(e)
            }
        }
    }

    fn read(
        &mut self,
        ctx: &Context,
        node: &TensorNode,
        into: StdArc<crate::memory::AlignedBuffer>,
        raw: bool,
    ) -> Result<ReadValue> {
        // A lagging buffer stands for the host array's value (a routine would upload it
        // first): the caller reads that, and nothing is planned.
        if !raw && node.mode().is_hosted() {
            let host = self.host.clone();
            let host = host.lock();
            if self.state.lags(ctx, node, &host)? {
                return Ok(ReadValue::Host);
            }
        }
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
        self.submit(Plans::from_buf([plan]));
        Ok(ReadValue::Device(e))
    }

    /// The source half of a device-to-device call (DESIGN.md §3, rule 3, steps 2 and 4).
    fn copy_source(
        &mut self,
        stamp: u64,
        ctx: &Context,
        node: &TensorNode,
        reader: Event,
        verdict: Reply<crate::protocol::Source>,
    ) {
        let mut source = match self.state.source(ctx, node) {
            Ok(s) => s,
            Err(e) => {
                self.record(Some(&e), 0, |_, _, _| {});
                return verdict.send(Err(e));
            }
        };
        if node.mode().is_hosted() {
            let upload = self.with_host(true, stamp, |s, h| {
                s.upload_lagging_source(ctx, &mut source, h)
            });
            match upload {
                // Submitted whatever the destination does: the upload is an operation of
                // this device, already in its tables.
                Ok(plan) => self.submit(plan.into_iter().collect()),
                Err(e) => {
                    self.record(Some(&e), 0, |_, _, _| {});
                    return verdict.send(Err(e));
                }
            }
        }
        // A copy of a lagging hosted source uploads first, which a replay does not do: its
        // check refuses the step then (`HostWritten`), so the upload is not recorded.
        self.record(None, 0, |s, rec, r| {
            s.record_copy_source(rec, ctx, node, r.edge)
        });
        // Recorded here, at this call's place in this device's order, before any later
        // write of the source is decided: that write waits for the destination's
        // operation, whenever the destination plans it.
        // A source nothing wrote will be refused by the destination: nothing reads it.
        if !mutant!("late_source_read") && source.check_written().is_ok() {
            self.state.record_remote_read(source.loc().loc, reader);
        }
        verdict.send(Ok(source));
    }

    /// The destination half of a device-to-device call (DESIGN.md §3, rule 3, step 3):
    /// once the source answered, plans the copy or the streaming consumer. A refusal tells
    /// the source to forget the read it recorded (posted before the caller learns of it).
    fn copy_dest(
        &mut self,
        inbox: &Arc<Inbox<DeviceOp>>,
        stamp: u64,
        delivery: Delivery,
        verdict: Verdict,
        promise: SeqPromise,
        link: SourceLink,
    ) -> Handled {
        // The destination's own first check comes before the source's answer, as in the
        // single-owner composition (`protocol::device_to_device`).
        let (dst_ctx, stream) = match &delivery {
            Delivery::Copy { dst, .. } => (dst.clone(), dst.stream()),
            Delivery::Streaming(r) => (r.context().clone(), r.context().stream()),
        };
        let checked = self.state.check_context(&dst_ctx);
        let source = match checked {
            Err(e) => Err(e),
            Ok(()) => match verdict.poll_get(&self.kick_waker(inbox)) {
                Some(answer) => answer,
                None => {
                    return Handled::Blocked(DeviceOp::CopyDest {
                        stamp,
                        delivery,
                        verdict,
                        promise,
                        source: link,
                    })
                }
            },
        };
        let plans = source.and_then(|source| {
            let hosted = source.node().mode().is_hosted()
                || matches!(&delivery, Delivery::Streaming(r) if reads_or_writes_hosted(r));
            let plans = self.with_host(hosted, stamp, |s, h| match &delivery {
                Delivery::Copy {
                    dst, into_merge, ..
                } => s
                    .copy_in(dst, &source, *into_merge, h)
                    .map(|p| p.into_iter().collect::<Plans>()),
                Delivery::Streaming(r) => s.schedule_streaming(r, &source, h),
            })?;
            Ok((source.loc().loc, plans, (source.loc(), source.bytes())))
        });
        if self.recording.is_some() {
            self.record_copy_dest(&plans, &delivery);
        }
        match plans {
            Ok((loc, plans, _)) if !plans.is_empty() => {
                let last = plans.last().map(|p| p.event().clone());
                self.decide(promise, stream, &mut Ok(plans));
                if let (true, Some(event)) = (mutant!("late_source_read"), last) {
                    // The old shape, as a mutant: the read reaches the source later, after
                    // whatever the source decided meanwhile.
                    link.inbox
                        .post_internal(DeviceOp::RecordRead { loc, event });
                }
            }
            // Both contexts share the buffer: nothing to do (the dispatcher does not post
            // such a call; answered as a no-op ordered after the stream's last operation).
            Ok(_) => {
                link.forget();
                promise.resolve(Planned::At(self.state.issued(stream.index as usize)));
            }
            Err(e) => {
                link.forget();
                self.decide(promise, stream, &mut Err(e));
            }
        }
        Handled::Done
    }

    fn query(&mut self, q: Query) {
        match q {
            Query::LastEvents(r) => r.send(Ok(self.state.last_events())),
            Query::StreamLastEvent(index, r) => {
                let out = self.check_stream_index(index).map(|stream| {
                    self.state
                        .last_events()
                        .into_iter()
                        .find(|e| e.stream() == stream)
                });
                r.send(out);
            }
            Query::IsIdle(r) => r.send(Ok(self.state.last_events().iter().all(Event::is_done))),
            Query::MemoryStats(r) => r.send(Ok(self.state.pool_stats())),
            Query::TableSizes(r) => r.send(Ok(self.state.table_sizes())),
            Query::DebugInfo(r) => r.send(Ok(self.debug_info())),
            Query::Sweep(r) => {
                self.sweep();
                r.send(Ok(()));
            }
            Query::Fence(r) => r.send(Ok(())),
        }
    }

    /// Prunes the tables and returns reusable memory to the pools.
    pub fn sweep(&mut self) {
        self.state.sweep();
        self.host.lock().prune();
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

/// Whether scheduling `routine` may read or update a host record: it has a hosted node.
fn reads_or_writes_hosted(routine: &Routine) -> bool {
    routine
        .spec()
        .params
        .iter()
        .any(|p| p.node.mode().is_hosted())
}
