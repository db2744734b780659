//! Capturing a step through the actor layer.
//!
//! A [`StepCapture`] issues its calls as the dispatcher always does. Each operation is wrapped
//! in a [`DeviceOp::Recorded`] that names the capture's [`CaptureLog`] and the call's
//! position. A device core then describes it to its recorder with the engine's own
//! `record_*` functions. Other threads' calls are not recorded.
//! [`StepCapture::finish`] waits once for a fence on every device the step touched, then
//! builds the [`Step`]. A recorded call that was refused fails the capture with its error.
//! See DESIGN.md §4, "Step capture and replay".

use std::sync::Arc as StdArc;

use crate::{
    engine::MergeBufferUse,
    error::{Error, Result},
    kernels::Bindings,
    node::TensorNode,
    pending::PendingEvent,
    protocol::{Context, DeviceState, Routine, StepRecorder},
    replay::{Edge, Step},
    sync::{Arc, Mutex},
};

use super::{
    messages::Answer,
    system::{AllReduceCall, Dispatcher, Recording, Via},
};

/// Where a recorded operation is recorded, and as what.
#[derive(Clone, Debug)]
pub struct Record {
    pub(crate) log: Arc<CaptureLog>,
    /// The call's position in the step (a copy's destination half takes the next one).
    pub(crate) position: u32,
    /// The schedule slot (a schedule of a routine declaring indices).
    pub(crate) slot: Option<u32>,
    /// The global edge number (a copy between two devices).
    pub(crate) edge: Option<u32>,
}

/// The recorders of one capture, one per device that decided a recorded operation.
#[derive(Debug, Default)]
pub struct CaptureLog {
    recorders: Mutex<Vec<StepRecorder>>,
}

impl CaptureLog {
    /// Runs `f` with `state`'s recorder (made on its first use).
    pub(crate) fn with(&self, state: &DeviceState, f: impl FnOnce(&mut StepRecorder)) {
        let mut recorders = self.recorders.lock();
        let i = match recorders.iter().position(|r| r.device() == state.device()) {
            Some(i) => i,
            None => {
                recorders.push(state.recorder());
                recorders.len() - 1
            }
        };
        f(&mut recorders[i]);
    }

    fn take(&self) -> Vec<StepRecorder> {
        std::mem::take(&mut *self.recorders.lock())
    }
}

/// A step being captured through a [`Dispatcher`] (see the module documentation).
pub struct StepCapture<'d> {
    dispatcher: &'d Dispatcher,
    build: CaptureBuild,
}

/// What a capture has recorded so far, apart from the dispatcher it posts through: the
/// [`StepCapture`] of `System::capture`, and the automatic replay's captures
/// (`super::auto`), which live across calls.
#[derive(Debug)]
pub(crate) struct CaptureBuild {
    log: Arc<CaptureLog>,
    edges: Vec<Edge>,
    slots: Vec<Bindings>,
    position: u32,
    /// Devices (by index) the step posted to.
    touched: Vec<usize>,
}

impl<'d> StepCapture<'d> {
    /// An empty capture on `dispatcher`. Its posts are calls of their own to the automatic
    /// replay (`super::auto`): they issue what it holds first, and end its period.
    pub fn new(dispatcher: &'d Dispatcher) -> StepCapture<'d> {
        StepCapture {
            dispatcher,
            build: CaptureBuild::new(),
        }
    }

    /// [`Dispatcher::schedule`] (bindings checked by the caller), recorded.
    pub fn schedule(&mut self, routine: &Routine, bindings: Bindings) -> Result<PendingEvent> {
        self.build
            .schedule(self.dispatcher, routine, bindings, Via::Caller)
    }

    /// [`Dispatcher::device_to_device`], both halves recorded (a copy between two devices
    /// becomes an edge between their parts of the step).
    pub fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<PendingEvent>> {
        self.build
            .device_to_device(self.dispatcher, node, src, dst, mode, Via::Caller)
    }

    /// [`Dispatcher::all_reduce`], every operation of every step recorded (its copies
    /// between devices become edges between their parts of the step).
    pub fn all_reduce(&mut self, call: &AllReduceCall) -> Result<Vec<PendingEvent>> {
        self.build.all_reduce(self.dispatcher, call, Via::Caller)
    }

    /// The step position the next recorded operation takes (positions number a step's
    /// operations over every device in program order; a call may take several). With
    /// [`DeviceStep::stream_positions`](crate::protocol::DeviceStep::stream_positions), a
    /// caller finds where a call's operations run on their stream.
    pub fn position(&self) -> u32 {
        self.build.position
    }

    /// Fences every device the step touched: answered once each decided (and recorded)
    /// everything the capture posted.
    pub fn fences(&self) -> Result<Vec<Answer<()>>> {
        self.build.fences(self.dispatcher)
    }

    /// The step, once every fence of [`StepCapture::fences`] answered: the first refusal
    /// of a recorded call (in step order) fails it.
    pub fn finish(self) -> Result<Step> {
        self.build.finish()
    }
}

impl CaptureBuild {
    pub(crate) fn new() -> CaptureBuild {
        CaptureBuild {
            log: Arc::new(CaptureLog::default()),
            edges: Vec::new(),
            slots: Vec::new(),
            position: 0,
            touched: Vec::new(),
        }
    }

    pub(crate) fn schedule(
        &mut self,
        dispatcher: &Dispatcher,
        routine: &Routine,
        bindings: Bindings,
        via: Via,
    ) -> Result<PendingEvent> {
        let device = dispatcher.index_of(routine.context().device())?;
        let slot = (!bindings.is_empty()).then_some(self.slots.len() as u32);
        let pending = self.recording(|next| {
            let record = Record {
                slot,
                ..next(1, None, &[device])
            };
            dispatcher.schedule_recorded(routine, bindings.clone(), Some(&record), via)
        })?;
        if slot.is_some() {
            self.slots.push(bindings);
        }
        Ok(pending)
    }

    pub(crate) fn device_to_device(
        &mut self,
        dispatcher: &Dispatcher,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
        via: Via,
    ) -> Result<Option<PendingEvent>> {
        self.recording(|record| {
            dispatcher.device_to_device_recorded(node, src, dst, mode, Some(record), via)
        })
    }

    pub(crate) fn all_reduce(
        &mut self,
        dispatcher: &Dispatcher,
        call: &AllReduceCall,
        via: Via,
    ) -> Result<Vec<PendingEvent>> {
        self.recording(|record| dispatcher.all_reduce_recorded(call, Some(record), via))
    }

    /// Runs `call` with a [`Recording`] handing out the records of its operations at the
    /// step's next positions; keeps the positions, edges and devices they took only if the
    /// call posted (`Ok`).
    fn recording<T>(&mut self, call: impl FnOnce(Recording<'_>) -> Result<T>) -> Result<T> {
        let (edges_before, touched_before) = (self.edges.len(), self.touched.len());
        let (log, edges, touched) = (&self.log, &mut self.edges, &mut self.touched);
        let mut position = self.position;
        let mut next = |positions: u32, edge: Option<Edge>, devices: &[usize]| {
            for &d in devices {
                if !touched.contains(&d) {
                    touched.push(d);
                }
            }
            let edge = edge.map(|e| {
                edges.push(e);
                edges.len() as u32 - 1
            });
            let record = Record {
                log: log.clone(),
                position,
                slot: None,
                edge,
            };
            position += positions;
            record
        };
        let posted = call(&mut next);
        match posted {
            Ok(_) => self.position = position,
            Err(_) => {
                self.edges.truncate(edges_before);
                self.touched.truncate(touched_before);
            }
        }
        posted
    }

    /// Fences every device the step touched: answered once each decided (and recorded)
    /// everything the capture posted.
    pub(crate) fn fences(&self, dispatcher: &Dispatcher) -> Result<Vec<Answer<()>>> {
        self.touched
            .iter()
            .map(|&i| {
                dispatcher.request_via(Via::Auto, i, |r| {
                    super::messages::DeviceOp::Query(super::messages::Query::Fence(r))
                })
            })
            .collect()
    }

    /// The step, once every fence of [`CaptureBuild::fences`] answered: the first refusal
    /// of a recorded call (in step order) fails it.
    pub(crate) fn finish(self) -> Result<Step> {
        let recorders = self.log.take();
        let failure = recorders
            .iter()
            .filter_map(|r| r.failure())
            .min_by_key(|(p, _)| *p)
            .map(|(_, e)| e.clone());
        if let Some(e) = failure {
            return Err(e);
        }
        let parts = recorders
            .into_iter()
            .map(|r| r.finish().map(StdArc::new))
            .collect::<Result<Vec<_>>>()?;
        if parts.len() < self.touched.len() {
            return Err(Error::Internal(format!(
                "a captured step touched {} devices, {} recorded it",
                self.touched.len(),
                parts.len()
            )));
        }
        Ok(Step::new(parts, self.edges, self.slots, self.position))
    }
}
