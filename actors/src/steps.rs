//! Step capture and replay on the actor system.
//!
//! [`System::capture`] runs a closure's schedules and copies for real while every device
//! records what it decides. [`System::replay`] issues the captured [`Step`] again as one
//! operation per device, at one point of the program order. Other host threads' calls fall
//! before or after a replay as a whole. See DESIGN.md §4, "Step capture and replay".

use tributary::{
    dispatch::{answer, StepCapture},
    kernels::{Bindings, IntoBindings},
    protocol::{Context, Routine},
    replay::{Step, StepBindings, StreamLasts},
    MergeBufferUse, Result, TensorNode,
};

use crate::{ticket::block_on, AllReducePlan, BucketedAllReduce, System, Ticket};

/// The calls of a step being captured on a [`System`] ([`System::capture`]): each runs for
/// real, as the `System` method of the same name, and is recorded.
pub struct SystemCapture<'s> {
    inner: StepCapture<'s>,
}

impl SystemCapture<'_> {
    /// [`System::schedule`], recorded.
    pub fn schedule(&mut self, routine: &Routine) -> Result<Ticket> {
        self.schedule_with(routine, Bindings::none())
    }

    /// [`System::schedule_with`], recorded; a replay may give the routine's indices other
    /// values ([`StepBindings`]).
    pub fn schedule_with(
        &mut self,
        routine: &Routine,
        bindings: impl IntoBindings,
    ) -> Result<Ticket> {
        let bound = routine.bind(bindings)?;
        Ok(Ticket::pending(self.inner.schedule(routine, bound)?))
    }

    /// [`System::device_to_device`], recorded: a copy between two devices becomes an edge
    /// between their parts of the step.
    pub fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Ticket>> {
        Ok(self
            .inner
            .device_to_device(node, src, dst, mode)?
            .map(Ticket::pending))
    }

    /// The step position the next recorded operation takes (`StepCapture::position`): the
    /// cluster's captures find their network routines by it.
    #[cfg(feature = "mpi")]
    pub(crate) fn position(&self) -> u32 {
        self.inner.position()
    }

    /// [`AllReducePlan::run`], recorded: every step's copies and merges (its copies between
    /// devices become edges between their parts of the step). A replay checks the plan's
    /// routines like any other: after [`AllReducePlan::finalize`] it is invalidated.
    pub fn all_reduce(&mut self, plan: &AllReducePlan) -> Result<Vec<Ticket>> {
        let pending = self.inner.all_reduce(&plan.call)?;
        Ok(pending.into_iter().map(Ticket::pending).collect())
    }

    /// [`BucketedAllReduce::run`], recorded: the packs, the all-reduce of the buckets and
    /// the unpacks.
    pub fn bucketed_all_reduce(&mut self, plan: &BucketedAllReduce) -> Result<()> {
        for p in plan.buckets.pack.iter().flatten() {
            self.schedule(p)?;
        }
        self.all_reduce(&plan.reduce)?;
        for u in plan.buckets.unpack.iter().flatten() {
            self.schedule(u)?;
        }
        Ok(())
    }
}

impl System {
    /// Captures a step: runs `calls` (schedules and copies through the [`SystemCapture`]
    /// it is given) for real, as the first step, while every device records what it
    /// decides for them; returns the [`Step`] to [`System::replay`]. Waits once, at the
    /// end, for every device the step touched to have decided the calls (not for the
    /// work to run). A call refused during the capture fails it with that call's error (the
    /// calls before it stay issued, as they would have been).
    ///
    /// ```
    /// use tributary::{kernels, DType, MemoryMode, MergeBufferUse};
    /// use tributary_actors::System;
    /// let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]).with_mode(MemoryMode::on_device())?;
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// let double = fill.context().link(kernels::scale_in_place(&x, 2.0)?)?;
    /// let copy = sys.context(1, 0)?.link(kernels::fill(&x, 0.0)?)?;
    /// fill.schedule()?;
    /// copy.schedule()?;
    /// // One step: double x on device 0, copy it to device 1.
    /// let step = sys.capture(|c| {
    ///     c.schedule(double.routine())?;
    ///     c.device_to_device(&x, double.protocol_context(), copy.protocol_context(), MergeBufferUse::No)?;
    ///     Ok(())
    /// })?;
    /// for _ in 0..3 {
    ///     sys.replay(&step)?; // one operation per device, no dependency inference
    /// }
    /// assert_eq!(copy.context().read::<f32>(&x)?, vec![16.0; 4]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn capture(
        &self,
        calls: impl FnOnce(&mut SystemCapture<'_>) -> Result<()>,
    ) -> Result<Step> {
        self.check_live()?;
        let mut c = SystemCapture {
            inner: StepCapture::new(self.dispatcher()),
        };
        let r = calls(&mut c);
        // Every device decides (and records) what the closure posted, refused or not,
        // before the capture returns: nothing recorded is left behind.
        let fences = c.inner.fences();
        let mut waited = Ok(());
        for fence in fences? {
            if let Err(e) = block_on(answer(fence)) {
                waited = waited.and(Err(e));
            }
        }
        r?;
        waited?;
        c.inner.finish()
    }

    /// Replays `step` with the index values it was captured with: one operation per device
    /// of the step, posted at one point of the program order; each device issues its
    /// templates again, waiting for what its buffers' uses are at that point and for each
    /// other as captured. Returns at once with a [`Ticket`] per stream the step runs on
    /// (its last operation there), device by device. A step this system did not capture is
    /// refused here; one that something invalidated since
    /// ([`tributary::Invalidation`]: a finalized context, a host write to a hosted node it
    /// reads, a moved merge buffer) is refused as a whole by its devices, every ticket then
    /// failing with [`tributary::Error::ReplayInvalidated`] and nothing issued.
    pub fn replay(&self, step: &Step) -> Result<StreamLasts<Ticket>> {
        self.replay_values(step, None)
    }

    /// [`System::replay`] with new index values for the captured schedules (see
    /// [`StepBindings`]); values of another shape are refused here with
    /// [`tributary::Invalidation::BindingShape`].
    ///
    /// ```
    /// use tributary::kernels::{Access, RoutineSpec};
    /// use tributary::{DType, Error, TensorNode};
    /// use tributary_actors::System;
    /// let sys = System::builder().cpu_devices(1).spawn()?;
    /// let log = TensorNode::new_zeroed("log", DType::I32, [4]);
    /// let spec = RoutineSpec::custom("log", vec![(log.clone(), Access::ReadWrite)], None, |a| {
    ///     let t = a.index("t")?;
    ///     a.output::<i32>(0)?[t as usize] = 10 * t as i32 + 1;
    ///     Ok(())
    /// })?
    /// .with_index("t")?;
    /// let r = sys.context(0, 0)?.link(spec)?;
    /// let step = sys.capture(|c| c.schedule_with(r.routine(), &[("t", 0)]).map(drop))?;
    /// let mut values = step.bindings();
    /// for t in 1..4 {
    ///     values.set_all("t", t)?;
    ///     sys.replay_with(&step, &values)?;
    /// }
    /// assert_eq!(r.context().read::<i32>(&log)?, vec![1, 11, 21, 31]);
    /// # sys.shutdown()?;
    /// # Ok::<(), Error>(())
    /// ```
    pub fn replay_with(&self, step: &Step, values: &StepBindings) -> Result<StreamLasts<Ticket>> {
        step.check_bindings(values)?;
        self.replay_values(step, Some(values.values()))
    }

    fn replay_values(
        &self,
        step: &Step,
        values: Option<&[Bindings]>,
    ) -> Result<StreamLasts<Ticket>> {
        self.check_live()?;
        Ok(self
            .dispatcher()
            .replay(step, values)?
            .into_iter()
            .map(Ticket::pending)
            .collect())
    }
}
