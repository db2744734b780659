//! Step capture and replay on the single-owner engine (DESIGN.md §4, "Step capture and
//! replay"): [`Engine::capture`] runs a closure's schedules and copies for real while each
//! device records them ([`crate::protocol::StepRecorder`]); [`Engine::replay`] issues the
//! captured [`Step`] again, device by device, with the same protocol code the actor
//! system's device cores run.

use std::sync::Arc;

use smallvec::SmallVec;

use super::{Engine, MergeBufferUse};
use crate::{
    error::{Error, Invalidation, Result},
    event::Event,
    kernels::{Bindings, IntoBindings},
    node::TensorNode,
    pending::{CellPool, PendingEvent, Planned, SeqPromise},
    protocol::{
        invalidated, reserve_issue_stamps, Context, Deps, DeviceStep, Plan, ReplayLinks,
        ReplayProgress, ReplayRun, Routine, StepRecorder, StreamProgram, OP_STAMPS,
    },
    replay::{Edge, Step, StepBindings, StreamLasts},
};

/// The calls of a step being captured ([`Engine::capture`]): each runs for real, as the
/// engine method of the same name, and is recorded.
pub struct Capture<'e> {
    engine: &'e mut Engine,
    recorders: Vec<Option<StepRecorder>>,
    edges: Vec<Edge>,
    slots: Vec<Bindings>,
    position: u32,
    failure: Option<Error>,
}

impl Capture<'_> {
    fn recorder(&mut self, device: usize) -> &mut StepRecorder {
        let state = &self.engine.devices[device];
        self.recorders[device].get_or_insert_with(|| state.recorder())
    }

    fn failed<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.failure.get_or_insert_with(|| e.clone());
        }
        r
    }

    /// [`Engine::schedule`], recorded.
    pub fn schedule(&mut self, routine: &Routine) -> Result<Event> {
        self.schedule_with(routine, Bindings::none())
    }

    /// [`Engine::schedule_with`], recorded; a replay may give the routine's indices other
    /// values ([`StepBindings`]).
    pub fn schedule_with(
        &mut self,
        routine: &Routine,
        bindings: impl IntoBindings,
    ) -> Result<Event> {
        let bound = routine.bind(bindings);
        let bound = self.failed(bound)?;
        let device = self.engine.device_index(routine.context().device());
        let device = self.failed(device)?;
        let event = self.engine.schedule_with(routine, &bound);
        let event = self.failed(event)?;
        let slot = (!bound.is_empty()).then(|| {
            self.slots.push(bound.clone());
            self.slots.len() as u32 - 1
        });
        let position = self.position;
        self.position += 1;
        let state = &self.engine.devices[device];
        let rec = self.recorders[device].get_or_insert_with(|| state.recorder());
        state.record_schedule(rec, routine, &bound, position, slot);
        Ok(event)
    }

    /// [`Engine::device_to_device`], recorded (a copy between two devices becomes an
    /// edge between their parts of the step).
    pub fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Event>> {
        let r = self
            .engine
            .device_index(src.device())
            .and_then(|si| Ok((si, self.engine.device_index(dst.device())?)));
        let (si, di) = self.failed(r)?;
        let r = self.engine.device_to_device(node, src, dst, mode.clone());
        let Some(event) = self.failed(r)? else {
            return Ok(None);
        };
        let Some(source) = self.engine.devices[si].source_of(src, node) else {
            return Ok(Some(event));
        };
        let edge = (si != di).then(|| {
            let dst_stream = match &mode {
                MergeBufferUse::StreamingFor(r) => r.context().stream(),
                _ => dst.stream(),
            };
            self.edges.push(Edge {
                src: src.device(),
                dst: dst.device(),
                dst_stream,
            });
            self.edges.len() as u32 - 1
        });
        let position = self.position;
        self.position += 2;
        self.recorder(si);
        self.recorder(di);
        let (src_state, rec) = (&self.engine.devices[si], &mut self.recorders[si]);
        if let Some(rec) = rec {
            src_state.record_copy_source(rec, src, node, edge);
        }
        let (dst_state, rec) = (&self.engine.devices[di], &mut self.recorders[di]);
        if let Some(rec) = rec {
            match &mode {
                MergeBufferUse::No | MergeBufferUse::Copy => dst_state.record_copy_in(
                    rec,
                    dst,
                    node,
                    matches!(mode, MergeBufferUse::Copy),
                    source,
                    position + 1,
                    edge,
                ),
                MergeBufferUse::StreamingFor(r) => {
                    dst_state.record_streaming(rec, r, source, position + 1, edge)
                }
            }
        }
        Ok(Some(event))
    }
}

/// The lists a replay fills and empties, kept between replays.
pub(super) struct ReplayScratch {
    /// The programs of the replay in progress.
    programs: Vec<StreamProgram>,
    /// Its plans, for queues that run no programs.
    planned: Vec<Plan>,
    /// Event lists of finished [`ReplayRun`]s, for the next ones.
    events: Vec<Vec<Event>>,
    /// The cells of the copies' deferred events, reused.
    cells: crate::sync::Arc<CellPool>,
}

impl Default for ReplayScratch {
    fn default() -> Self {
        ReplayScratch {
            programs: Vec::new(),
            planned: Vec::new(),
            events: Vec::new(),
            cells: CellPool::new(),
        }
    }
}

/// The links of one replay on the engine: every edge's deferred event and answer.
struct EngineLinks<'v> {
    values: Option<&'v [Bindings]>,
    pending: SmallVec<[(PendingEvent, Option<SeqPromise>); 4]>,
    answers: SmallVec<[Option<Deps>; 4]>,
}

/// [`EngineLinks`] as one device sees them (its local edge numbers).
struct DeviceLinks<'a, 'v> {
    links: &'a mut EngineLinks<'v>,
    step: &'a DeviceStep,
}

impl ReplayLinks for DeviceLinks<'_, '_> {
    fn values(&self, slot: u32) -> Option<&Bindings> {
        self.links.values.and_then(|v| v.get(slot as usize))
    }

    fn incoming(&mut self, e: u32) -> Option<Result<Deps>> {
        let g = self.step.incoming[e as usize] as usize;
        self.links.answers[g].clone().map(Ok)
    }

    fn planned(&mut self, e: u32, event: &Event) {
        let g = self.step.incoming[e as usize] as usize;
        if let Some(p) = self.links.pending[g].1.take() {
            p.resolve(Planned::At(event.seq()));
        }
    }

    fn answer(&mut self, e: u32, deps: Deps) {
        let g = self.step.outgoing[e as usize] as usize;
        self.links.answers[g] = Some(deps);
    }

    fn reader(&self, e: u32) -> Event {
        let g = self.step.outgoing[e as usize] as usize;
        self.links.pending[g].0.event()
    }
}

impl Engine {
    /// Captures a step: runs `calls` (schedules and copies through the [`Capture`] it is
    /// given) for real, as the first step, while every device records them; returns the
    /// [`Step`] to replay. Any call refused during the capture fails it with that call's
    /// error (the calls before it stay issued, as they would have been).
    ///
    /// ```
    /// use tributary::{kernels, DType, Engine, EngineConfig, MemoryMode, MergeBufferUse, TensorNode};
    /// let mut e = Engine::cpu(EngineConfig::default())?;
    /// let x = TensorNode::new("x", DType::F32, [4]).with_mode(MemoryMode::on_device())?;
    /// let (c0, c1) = (e.context(0, 0)?, e.context(1, 0)?);
    /// let fill = e.link(&c0, kernels::fill(&x, 1.0)?)?;
    /// let double = e.link(fill.context(), kernels::scale_in_place(&x, 2.0)?)?;
    /// let copy = e.link(&c1, kernels::fill(&x, 0.0)?)?;
    /// e.schedule(&fill)?;
    /// e.schedule(&copy)?;
    /// // One step: double x on device 0, copy it to device 1.
    /// let step = e.capture(|c| {
    ///     c.schedule(&double)?;
    ///     c.device_to_device(&x, double.context(), copy.context(), MergeBufferUse::No)?;
    ///     Ok(())
    /// })?;
    /// for _ in 0..3 {
    ///     e.replay(&step)?; // no dependency inference: the captured edges, fresh events
    /// }
    /// assert_eq!(e.read::<f32>(copy.context(), &x)?, vec![16.0; 4]);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn capture(&mut self, calls: impl FnOnce(&mut Capture<'_>) -> Result<()>) -> Result<Step> {
        let devices = self.devices.len();
        let mut c = Capture {
            engine: self,
            recorders: (0..devices).map(|_| None).collect(),
            edges: Vec::new(),
            slots: Vec::new(),
            position: 0,
            failure: None,
        };
        let r = calls(&mut c);
        let Capture {
            recorders,
            edges,
            slots,
            position,
            failure,
            ..
        } = c;
        r?;
        if let Some(e) = failure {
            return Err(e);
        }
        let parts = recorders
            .into_iter()
            .flatten()
            .map(|r| r.finish().map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(Step::new(parts, edges, slots, position))
    }

    /// Replays `step` with the index values it was captured with: every device issues its
    /// templates again, waiting for what its buffers' uses were when the replay started
    /// and for each other as captured. Returns the last event of every stream the step
    /// runs on. [`Error::ReplayInvalidated`] (nothing planned) if something the captured
    /// decisions depend on changed ([`Invalidation`]).
    pub fn replay(&mut self, step: &Step) -> Result<StreamLasts<Event>> {
        self.replay_values(step, None)
    }

    /// [`Engine::replay`] with new index values for the captured schedules (see
    /// [`StepBindings`]); values of another shape are [`Invalidation::BindingShape`].
    pub fn replay_with(
        &mut self,
        step: &Step,
        values: &StepBindings,
    ) -> Result<StreamLasts<Event>> {
        step.check_bindings(values)?;
        self.replay_values(step, Some(values.values()))
    }

    fn replay_values(
        &mut self,
        step: &Step,
        values: Option<&[Bindings]>,
    ) -> Result<StreamLasts<Event>> {
        let inner = &step.inner;
        let mut index: SmallVec<[usize; 4]> = SmallVec::new();
        for d in &inner.devices {
            let i = self
                .device_index(d.device())
                .map_err(|_| invalidated(inner.id, Invalidation::Foreign { device: d.device() }))?;
            self.devices[i]
                .check_replay(d, &self.host)
                .map_err(|why| invalidated(inner.id, why))?;
            index.push(i);
        }
        // Every check passed: from here on the replay is planned whole.
        let host_base = self.host.next_order();
        self.host.set_order(host_base + u64::from(inner.positions));
        let span = u64::from(inner.positions).div_ceil(OP_STAMPS).max(1) * OP_STAMPS;
        let base = reserve_issue_stamps(span);
        let mut pending = SmallVec::new();
        for e in &inner.edges {
            let di = self.device_index(e.dst)?;
            let timeline = self.devices[di]
                .timeline(e.dst_stream.index as usize)
                .ok_or(Error::NoSuchStream {
                    device: e.dst,
                    index: e.dst_stream.index as usize,
                    count: self.devices[di].stream_count(),
                })?
                .clone();
            let (p, promise) = PendingEvent::pooled(timeline, &self.replay_scratch.cells);
            pending.push((p, Some(promise)));
        }
        let mut links = EngineLinks {
            values,
            answers: (0..pending.len()).map(|_| None).collect(),
            pending,
        };
        let scratch = &mut self.replay_scratch;
        let mut runs: SmallVec<[Option<ReplayRun>; 4]> = inner
            .devices
            .iter()
            .map(|d| {
                let events = scratch.events.pop().unwrap_or_default();
                Some(ReplayRun::with_events(d.clone(), base, host_base, events))
            })
            .collect();
        let mut events = StreamLasts::new();
        // Every plan is submitted once the whole step is planned, in issue order: a
        // device's template may wait for a copy another device plans later in this loop
        // (`DepRef::Remote`), and a backend (or a recorder) may need its dependencies
        // planned when it is submitted.
        let mut programs = std::mem::take(&mut self.replay_scratch.programs);
        let result = loop {
            let mut waiting = false;
            let mut progressed = false;
            for (k, slot) in runs.iter_mut().enumerate() {
                let Some(run) = slot else { continue };
                let before = run.progress();
                let state = &mut self.devices[index[k]];
                let mut view = DeviceLinks {
                    links: &mut links,
                    step: &inner.devices[k],
                };
                let progress = state.replay(run, &mut view, &mut self.host, &mut programs);
                state.clear_issue_stamp();
                progressed |= run.progress() > before;
                match progress {
                    ReplayProgress::Done => {
                        events.extend(run.last_events());
                        if let Some(run) = slot.take() {
                            self.replay_scratch.events.push(run.into_events());
                        }
                        progressed = true;
                    }
                    ReplayProgress::Blocked => waiting = true,
                }
            }
            if !waiting {
                break Ok(events);
            }
            if !progressed {
                // Every source half comes before its destination half in the step's order,
                // which every device follows: some device can always go on.
                break Err(Error::Internal(format!(
                    "replay of step {} made no progress",
                    inner.id
                )));
            }
        };
        // Promises still unresolved (only on the error path) are refused now, so that no
        // submitted plan waits for an operation nobody will plan.
        drop(links);
        // A queue that runs programs takes its stream's part whole; the others' operations
        // go as plans, in issue order.
        let mut planned = std::mem::take(&mut self.replay_scratch.planned);
        for program in programs.drain(..) {
            let stream = program.stream();
            let queue = self
                .device_index(stream.device)
                .ok()
                .and_then(|d| self.queues[d].get(stream.index as usize));
            match queue {
                Some(q) if q.runs_programs() => {
                    // A dead queue fails the program's events itself.
                    let _ = q.submit_program(program);
                }
                _ => program.into_plans(|plan| planned.push(plan)),
            }
        }
        self.replay_scratch.programs = programs;
        planned.sort_by_key(|p| p.issue());
        let submitted = self.submit(planned.drain(..));
        self.replay_scratch.planned = planned;
        submitted?;
        result
    }
}
