//! Replaying a captured [`Step`] through the actor layer, one operation per device.
//!
//! [`Dispatcher::replay`] posts one [`DeviceOp::Replay`] to every device of the step in one
//! atomic post. Each part carries the one-shots it shares with the other parts: each copy's
//! [`PendingEvent`] and answer, a check per device, and a promise per stream for its last
//! event. A replay is all or nothing across devices, so no part issues anything until every
//! part's check has answered (a one-device step's part answers only itself: it has no check
//! cells). A part that waits blocks its inbox as a copy's destination half does. See
//! DESIGN.md §4, "Step capture and replay".
//!
//! A replay allocates nothing in steady state (DESIGN.md §4, "Issuing without
//! allocation"): its parts travel in boxes the devices give back to the dispatcher's
//! [`PartBoxes`], its one-shots' cells (pending events, checks, copies' answers) are pooled,
//! its edge lists are inline, its event lists are its device's, its index values share a
//! list its step keeps ([`Step::shared_values`]), and its tickets come back inline
//! ([`StreamLasts`]).

use std::sync::Arc as StdArc;

use smallvec::SmallVec;
use std::task::Waker;

use crate::{
    error::{Error, Result},
    event::Event,
    kernels::Bindings,
    pending::{PendingEvent, Planned, SeqPromise},
    protocol::{invalidated, Deps, DeviceStep, ReplayLinks, ReplayRun},
    replay::{Step, StreamLasts},
    sync::{Arc, Mutex},
};

use super::{
    messages::{pooled_reply, AnswerPool, DeviceOp, Part, Parts, PooledAnswer, Reply},
    system::{Dispatcher, Via},
};

/// An incoming edge as its destination part holds it: the source's answer, the promise of
/// the destination operation, its stream index.
pub(crate) type Incoming = (PooledAnswer<Deps>, Option<SeqPromise>, usize);

/// An outgoing edge as its source part holds it: the reply to the destination, and the
/// destination's operation (a reader of the source's buffer).
pub(crate) type Outgoing = (Option<Reply<Deps>>, Event);

/// Every part's check of one replay, in device order (inline up to four devices).
pub(crate) type Checks = SmallVec<[PooledAnswer<()>; 4]>;

/// What a device's part of a replay holds beside its step and streams: its check, every
/// part's checks, its place among them, and its edges ([`Dispatcher::replay_via`]).
struct NewPart {
    check: Option<Reply<()>>,
    checks: Option<Checks>,
    index: usize,
    incoming: SmallVec<[Incoming; 4]>,
    outgoing: SmallVec<[Outgoing; 4]>,
}

/// One device's part of a replay (see the module documentation).
pub struct ReplayPart {
    pub(crate) step: StdArc<DeviceStep>,
    /// The step's number (for errors).
    pub(crate) step_id: u64,
    /// The replay's index values, by schedule slot (`None`: the captured ones).
    pub(crate) values: Option<StdArc<[Bindings]>>,
    /// This device's check, answered once it checked (`None` alone on its step).
    pub(crate) check: Option<Reply<()>>,
    /// Every part's check (this device's too), in device order; `None` for the part of a
    /// one-device step, which goes on its own check alone.
    pub(crate) checks: Option<Checks>,
    /// This part's place in `checks`.
    pub(crate) index: usize,
    /// Every part answered `Ok`: issuing.
    pub(crate) go: bool,
    /// Per local incoming edge: the source's answer, the promise of the destination
    /// operation this device plans, and its stream index.
    pub(crate) incoming: SmallVec<[Incoming; 4]>,
    /// Per local outgoing edge: the answer to the destination, and its operation (a reader
    /// of this device's buffer).
    pub(crate) outgoing: SmallVec<[Outgoing; 4]>,
    /// Per stream the step runs on here (the step's order): its last event's promise.
    pub(crate) last: SmallVec<[SeqPromise; 2]>,
    /// The run (based at the stamp the post gave the part when it starts).
    pub(crate) run: ReplayRun,
    /// Checked and based: the run started.
    pub(crate) started: bool,
}

impl ReplayPart {
    /// Refuses the part with `error`: the caller's promises at each stream's last issued
    /// number, the copies' answers and promises dropped (their other halves fail with
    /// [`Error::ShutDown`], or are refused themselves).
    pub(crate) fn refuse(self, error: &Error, issued: impl Fn(usize) -> u64) {
        let streams: SmallVec<[usize; 4]> = self.step.streams().collect();
        if let Some(check) = self.check {
            check.send(Err(error.clone()));
        }
        for (promise, stream) in self.last.into_iter().zip(streams) {
            promise.resolve(Planned::Refused(issued(stream), error.clone()));
        }
        for (reply, _) in self.outgoing {
            if let Some(r) = reply {
                r.send(Err(error.clone()));
            }
        }
        for (_, promise, stream) in self.incoming {
            if let Some(p) = promise {
                p.resolve(Planned::Refused(issued(stream), error.clone()));
            }
        }
    }

    /// Polls every part's check: `None` while one has not answered (`waker` is woken when
    /// it does), else the first refusal in device order, or `Ok`.
    pub(crate) fn poll_checks(&self, waker: &Waker) -> Option<Result<()>> {
        let mut verdict = Ok(());
        for check in self.checks.iter().flat_map(|c| c.iter()) {
            match check.poll_get(waker) {
                None => return None,
                Some(Err(e)) if verdict.is_ok() => verdict = Err(e),
                Some(_) => {}
            }
        }
        Some(verdict)
    }

    /// The run's links as a device core sees them, waking `waker` when an answer arrives.
    pub(crate) fn links<'a>(&'a mut self, waker: &'a Waker) -> (&'a mut ReplayRun, PartLinks<'a>) {
        (
            &mut self.run,
            PartLinks {
                values: self.values.as_deref(),
                incoming: &mut self.incoming,
                outgoing: &mut self.outgoing,
                waker,
            },
        )
    }
}

/// [`ReplayLinks`] over a [`ReplayPart`]'s one-shots.
pub(crate) struct PartLinks<'a> {
    values: Option<&'a [Bindings]>,
    incoming: &'a mut [Incoming],
    outgoing: &'a mut [Outgoing],
    waker: &'a Waker,
}

impl ReplayLinks for PartLinks<'_> {
    fn values(&self, slot: u32) -> Option<&Bindings> {
        self.values.and_then(|v| v.get(slot as usize))
    }

    fn incoming(&mut self, e: u32) -> Option<Result<Deps>> {
        self.incoming
            .get(e as usize)
            .and_then(|(answer, _, _)| answer.poll_get(self.waker))
    }

    fn planned(&mut self, e: u32, event: &Event) {
        if let Some(p) = self
            .incoming
            .get_mut(e as usize)
            .and_then(|(_, p, _)| p.take())
        {
            p.resolve(Planned::At(event.seq()));
        }
    }

    fn answer(&mut self, e: u32, deps: Deps) {
        if let Some(r) = self
            .outgoing
            .get_mut(e as usize)
            .and_then(|(r, _)| r.take())
        {
            r.send(Ok(deps));
        }
    }

    fn reader(&self, e: u32) -> Event {
        // One entry per outgoing edge of the step, made from it (`Dispatcher::replay`).
        self.outgoing[e as usize].1.clone()
    }
}

impl std::fmt::Debug for ReplayPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayPart")
            .field("step", &self.step_id)
            .field("device", &self.step.device())
            .field("go", &self.go)
            .finish()
    }
}

/// A [`ReplayPart`] in a box that goes back to its dispatcher's pool (`PartBoxes`) when the part
/// is taken out (done or refused), for the next replay to fill.
#[derive(Debug)]
pub struct PartBox {
    part: Box<Option<ReplayPart>>,
    pool: StdArc<PartBoxes>,
}

impl PartBox {
    /// The part (`None` once taken).
    pub(crate) fn part(&mut self) -> Option<&mut ReplayPart> {
        Option::as_mut(&mut self.part)
    }

    /// The part, to read (`None` once taken).
    pub(crate) fn get(&self) -> Option<&ReplayPart> {
        Option::as_ref(&self.part)
    }

    /// Drops the part where it lies and gives the box back (a part is over half a
    /// kilobyte: [`PartBox::take`] would copy it out first).
    pub(crate) fn finish(mut self) {
        *self.part = None;
        self.pool.give_back(self.part);
    }

    /// Takes the part out and gives the box back.
    pub(crate) fn take(mut self) -> Option<ReplayPart> {
        let part = self.part.take();
        self.pool.give_back(self.part);
        part
    }
}

/// What replays reuse, kept by the dispatcher: the parts' boxes, the checks' cells and the
/// copies' answers' cells.
#[derive(Debug)]
pub struct ReplayPools {
    parts: StdArc<PartBoxes>,
    checks: Arc<AnswerPool<()>>,
    edges: Arc<AnswerPool<Deps>>,
}

impl ReplayPools {
    /// Empty pools.
    pub fn new() -> ReplayPools {
        ReplayPools {
            parts: PartBoxes::new(),
            checks: AnswerPool::new(),
            edges: AnswerPool::new(),
        }
    }
}

impl Default for ReplayPools {
    fn default() -> Self {
        ReplayPools::new()
    }
}

/// Boxes of replay parts, reused (see the module documentation). A box comes back empty,
/// so the pool holds no step, promise or answer alive.
#[derive(Debug, Default)]
pub struct PartBoxes {
    // The boxes themselves are what is pooled: a part moves between threads in one.
    #[allow(clippy::vec_box)]
    free: Mutex<Vec<Box<Option<ReplayPart>>>>,
}

/// Boxes a [`PartBoxes`] keeps at most; more are freed. A part holds its box only while it
/// waits in its device's inbox or for its copies, so the default inbox capacity
/// (`SystemConfig::mailbox_capacity`, 4,096) bounds what a host that runs ahead needs: a
/// burst that queued that many replays is followed by ones that allocate no box. The pool
/// is a high-water mark: empty boxes, a few hundred bytes each.
const POOLED_PARTS: usize = 4096;

impl PartBoxes {
    /// An empty pool.
    pub fn new() -> StdArc<PartBoxes> {
        StdArc::new(PartBoxes::default())
    }

    /// `part` in a box of this pool (a new one if none is free).
    fn boxed(self: &StdArc<Self>, part: ReplayPart) -> PartBox {
        let mut b = self.free.lock().pop().unwrap_or_else(|| Box::new(None));
        *b = Some(part);
        PartBox {
            part: b,
            pool: self.clone(),
        }
    }

    fn give_back(&self, b: Box<Option<ReplayPart>>) {
        if b.is_some() {
            return;
        }
        let mut free = self.free.lock();
        if free.len() < POOLED_PARTS {
            free.push(b);
        }
    }
}

impl Dispatcher {
    /// Replays `step` (with `values` for its schedules with indices, checked by the caller,
    /// or those it was captured with): one [`DeviceOp::Replay`] per device, posted at one
    /// point of the program order. Returns the last event of every stream the step runs
    /// on, device by device, each planned when its device issues its part, or refused with
    /// [`Error::ReplayInvalidated`] when a device finds the step invalidated.
    pub fn replay(
        &self,
        step: &Step,
        values: Option<&[Bindings]>,
    ) -> Result<StreamLasts<PendingEvent>> {
        match self.auto() {
            // Told and posted under the automatic replay's lock, as any invalidating call.
            Some(auto) => auto.interrupt_posting(self, super::auto::Barrier::Invalidating, || {
                self.replay_via(step, values, Via::Auto)
            }),
            None => self.replay_via(step, values, Via::Auto),
        }
    }

    /// [`Dispatcher::replay`], its post made `via` the caller or the automatic replay.
    pub(super) fn replay_via(
        &self,
        step: &Step,
        values: Option<&[Bindings]>,
        via: Via,
    ) -> Result<StreamLasts<PendingEvent>> {
        let inner = &step.inner;
        let foreign = |d: &DeviceStep| {
            invalidated(
                inner.id,
                crate::error::Invalidation::Foreign { device: d.device() },
            )
        };
        let values = values.map(|v| step.shared_values(v));
        let mut last = StreamLasts::new();
        let one_part = match &inner.devices[..] {
            [d] if inner.edges.is_empty() && d.incoming.is_empty() && d.outgoing.is_empty() => {
                Some(d)
            }
            _ => None,
        };
        if let Some(d) = one_part {
            // One device and no copy between devices: its part goes on its own check, with
            // no edge, list of parts or shared cell to make (the common replay, as a
            // Task Bench timestep's).
            let device = self.index_of(d.device()).map_err(|_| foreign(d))?;
            let part = self.replay_part(
                step,
                d,
                device,
                values,
                NewPart {
                    check: None,
                    checks: None,
                    index: 0,
                    incoming: SmallVec::new(),
                    outgoing: SmallVec::new(),
                },
                &mut last,
            )?;
            self.post_one_via(via, part)?;
            return Ok(last);
        }
        let index: SmallVec<[usize; 4]> = inner
            .devices
            .iter()
            .map(|d| self.index_of(d.device()).map_err(|_| foreign(d)))
            .collect::<Result<_>>()?;
        let pools = self.replay_pools();
        // Per edge: the destination operation (its pending event and promise) and the
        // source's answer (inline up to four edges; the cells are pooled).
        let mut readers: SmallVec<[Event; 4]> = SmallVec::new();
        let mut promises: SmallVec<[Option<SeqPromise>; 4]> = SmallVec::new();
        let mut replies: SmallVec<[Option<Reply<Deps>>; 4]> = SmallVec::new();
        let mut answers: SmallVec<[Option<PooledAnswer<Deps>>; 4]> = SmallVec::new();
        for e in &inner.edges {
            let (pending, promise) = self.pending_event(crate::ids::StreamId {
                device: e.dst,
                index: e.dst_stream.index,
            })?;
            readers.push(pending.event());
            promises.push(Some(promise));
            let (r, a) = pooled_reply(&pools.edges);
            replies.push(Some(r));
            answers.push(Some(a));
        }
        // A one-device step's part goes on its own check: no cells to share.
        let alone = inner.devices.len() == 1;
        let (check_replies, checks): (SmallVec<[_; 4]>, Checks) = if alone {
            (std::iter::once(None).collect(), SmallVec::new())
        } else {
            inner
                .devices
                .iter()
                .map(|_| {
                    let (r, a) = pooled_reply(&pools.checks);
                    (Some(r), a)
                })
                .unzip()
        };
        let checks = (!alone).then_some(checks);
        let mut parts = Parts::new();
        for ((k, d), check) in inner.devices.iter().enumerate().zip(check_replies) {
            let incoming = d
                .incoming
                .iter()
                .map(|&g| {
                    let g = g as usize;
                    let stream = inner.edges[g].dst_stream.index as usize;
                    match (answers[g].take(), promises[g].take()) {
                        (Some(a), p) => Ok((a, p, stream)),
                        _ => Err(Error::Internal(format!(
                            "edge {g} of step {} has two destinations",
                            inner.id
                        ))),
                    }
                })
                .collect::<Result<_>>()?;
            let outgoing = d
                .outgoing
                .iter()
                .map(|&g| (replies[g as usize].take(), readers[g as usize].clone()))
                .collect();
            let new = NewPart {
                check,
                checks: checks.clone(),
                index: k,
                incoming,
                outgoing,
            };
            parts.push(self.replay_part(step, d, index[k], values.clone(), new, &mut last)?);
        }
        if parts.len() == 1 {
            if let Some(p) = parts.pop() {
                self.post_one_via(via, p)?;
            }
        } else if !parts.is_empty() {
            self.post_via(via, parts)?;
        }
        Ok(last)
    }

    /// Device `d`'s part of a replay of `step` (device index `device`), its streams' last
    /// events' promises made and their pending events pushed to `last`.
    fn replay_part(
        &self,
        step: &Step,
        d: &StdArc<DeviceStep>,
        device: usize,
        values: Option<StdArc<[Bindings]>>,
        new: NewPart,
        last: &mut StreamLasts<PendingEvent>,
    ) -> Result<Part> {
        let inner = &step.inner;
        let mut stream_promises = SmallVec::new();
        for s in d.streams() {
            let (pending, promise) = self.pending_event(crate::ids::StreamId {
                device: d.device(),
                index: s as u32,
            })?;
            last.push(pending);
            stream_promises.push(promise);
        }
        let part = ReplayPart {
            step: d.clone(),
            step_id: inner.id,
            values,
            check: new.check,
            checks: new.checks,
            index: new.index,
            go: false,
            incoming: new.incoming,
            outgoing: new.outgoing,
            last: stream_promises,
            run: ReplayRun::with_events(d.clone(), 0, 0, d.events_list()),
            started: false,
        };
        let op = DeviceOp::Replay {
            stamp: 0,
            part: self.replay_pools().parts.boxed(part),
        };
        let span = u64::from(inner.positions).div_ceil(super::system::STEP_STAMPS);
        Ok(Part::new(device, 0, 0, op).with_span(span))
    }
}
