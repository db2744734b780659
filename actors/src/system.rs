//! The host-side handle: drive a running actor system from synchronous or async code.
//!
//! [`System`] is a thin handle over the engine's [`Dispatcher`]. Each call posts its
//! operations straight into the inboxes of the devices it concerns. There is no actor message
//! per call, and no round trip for work that returns a [`Ticket`]. Calls that return a value
//! wait for the device's answer.
//!
//! `System` is `Send + Sync + Clone`, and any number of host threads may use it at once.
//! Every call is linearizable. See DESIGN.md §4, "Inboxes: one order shared by every device,
//! and batches".

use std::{
    sync::{atomic::AtomicBool, Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use actix::{Addr, Arbiter};
use serde::Serialize;
use tributary::trace::Recorder;
use tributary::{
    dispatch::{answer, messages::Query, Dispatcher},
    memory::PoolStats,
    protocol::{Context, Routine, TableSizes},
    DType, Error, MergeBufferUse, Result, Shape, TensorNode,
};

use crate::{
    config::{SystemBuilder, SystemConfig},
    coordinator::Coordinator,
    device::DeviceActor,
    messages::{Abandoned, StopStreams},
    ticket::{block_on, Ticket},
};

pub(crate) struct Shared {
    pub(crate) dispatcher: Arc<Dispatcher>,
    pub(crate) devices: Vec<Addr<DeviceActor>>,
    pub(crate) streams: Vec<usize>,
    pub(crate) coordinator: Addr<Coordinator>,
    pub(crate) actix: actix::System,
    pub(crate) thread: Mutex<Option<JoinHandle<()>>>,
    pub(crate) arbiters: Mutex<Vec<Arbiter>>,
    pub(crate) shut_down: AtomicBool,
    pub(crate) config: SystemConfig,
    pub(crate) recorder: Option<Arc<Recorder>>,
    /// What each device is, read from the backend at spawn (the backend itself lives on
    /// the actor threads and is dropped there).
    pub(crate) device_info: Vec<tributary::backend::DeviceInfo>,
    pub(crate) order: std::sync::atomic::AtomicU64,
}

/// The host application's handle on a running device system. Cheap to clone; `Send +
/// Sync`; every call is atomic (see the module documentation).
#[derive(Clone)]
pub struct System {
    pub(crate) shared: Arc<Shared>,
}

/// What `shutdown` had to give up on.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShutdownReport {
    /// Operations that had not completed by the deadline, per stream.
    pub abandoned: Vec<Abandoned>,
    /// How long the shutdown took.
    pub took: Duration,
}

/// Memory of every device: a serde value with a short human table as `Display`.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryReport {
    /// Per device.
    pub devices: Vec<PoolStats>,
}

impl std::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<6} {:>12} {:>12} {:>12} {:>6} {:>7}",
            "device", "live", "reserved", "peak", "pools", "frag"
        )?;
        for d in &self.devices {
            writeln!(
                f,
                "{:<6} {:>12} {:>12} {:>12} {:>6} {:>6.1}%",
                d.device.to_string(),
                d.live_bytes,
                d.reserved_bytes,
                d.peak_live_bytes,
                d.pools,
                d.fragmentation * 100.0
            )?;
        }
        Ok(())
    }
}

impl System {
    /// A builder with the default configuration (2 CPU devices x 2 streams).
    ///
    /// ```
    /// let sys = tributary_actors::System::builder().cpu_devices(1).spawn()?;
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn builder() -> SystemBuilder {
        SystemBuilder::default()
    }

    /// Spawns a system from a configuration.
    ///
    /// ```
    /// use tributary_actors::{System, SystemConfig};
    /// let sys = System::from_config(SystemConfig::from_json_str(r#"{ "cpu_devices": 1 }"#)?)?;
    /// assert_eq!(sys.device_count(), 1);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn from_config(config: SystemConfig) -> Result<System> {
        System::spawn(config, None)
    }

    /// The timeline recorder, when the system records one
    /// ([`SystemBuilder::record_timeline`], CPU, Vulkan and CUDA backends); export it with
    /// `write_chrome_trace`, summarise it with `summary`.
    ///
    /// ```
    /// let sys = tributary_actors::System::builder().record_timeline(true).spawn()?;
    /// let x = sys.node("x", tributary::DType::F32, [4]);
    /// sys.context(0, 0)?.link(tributary::kernels::fill(&x, 1.0)?)?.schedule()?.wait()?;
    /// let recorder = sys.timeline().expect("recording");
    /// assert!(!recorder.records().is_empty());
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn timeline(&self) -> Option<Arc<Recorder>> {
        self.shared.recorder.clone()
    }

    /// An increasing number, unique within this system (a program-order stamp for hosts
    /// that keep their own logs; the actors take their stamps when operations are posted).
    ///
    /// ```
    /// # let sys = tributary_actors::System::builder().cpu_devices(2).spawn()?;
    /// let a = sys.next_order();
    /// assert!(sys.next_order() > a);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn next_order(&self) -> u64 {
        self.shared
            .order
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// How many fences host-array order has cost so far: `gates` (an operation on one
    /// device ordered after another device's earlier operations, posted with it: no round
    /// trip) and `waited` (fences a host read or write waited for, one per device).
    /// Reading parameters and writing one's own buffers costs none: a data-parallel step
    /// in steady state adds nothing here.
    ///
    /// ```
    /// let sys = tributary_actors::System::builder().spawn()?;
    /// let w = sys.node("w", tributary::DType::F32, [2]);
    /// sys.host_write(&w.with_mode(tributary::MemoryMode::hosted_changed_on_devices())?, &[1.0f32, 2.0])?;
    /// assert_eq!(sys.fence_stats().waited, 2); // one fence per device
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn fence_stats(&self) -> tributary::dispatch::FenceStats {
        self.dispatcher().fence_counts()
    }

    /// What the automatic replay did so far ([`SystemConfig::auto_replay`]; all zeros
    /// when it is off): periods recognised, steps captured and replayed, calls replayed,
    /// and why it fell back to issuing.
    ///
    /// ```
    /// use tributary::{kernels, DType};
    /// let sys = tributary_actors::System::builder().cpu_devices(1).auto_replay(true).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let add = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// for _ in 0..3 {
    ///     add.schedule()?; // a period of one call, seen three times
    /// }
    /// assert_eq!(sys.replay_stats().periods, 1);
    /// sys.sync()?; // not a schedule: the period is given up
    /// assert_eq!(sys.replay_stats().fallbacks.mismatch, 1);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn replay_stats(&self) -> crate::ReplayStats {
        self.dispatcher().replay_stats().unwrap_or_default()
    }

    /// Issues now every call the automatic replay holds ([`SystemConfig::auto_replay`]):
    /// for a host thread about to block on something the system does not see (an MPI
    /// call, another process) while work it issued must run. Any other call, a wait on a
    /// held ticket and a shutdown do it by themselves. Nothing to do when the automatic
    /// replay is off.
    pub fn issue_held(&self) {
        self.dispatcher().release_held();
    }

    /// The engine-side router this system posts through.
    pub(crate) fn dispatcher(&self) -> &Arc<Dispatcher> {
        &self.shared.dispatcher
    }

    /// The configuration the system runs with.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// assert_eq!(sys.config().cpu_devices, 2);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn config(&self) -> &SystemConfig {
        &self.shared.config
    }

    /// Number of devices.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// assert_eq!(sys.device_count(), 2);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn device_count(&self) -> usize {
        self.shared.devices.len()
    }

    /// What device `i` is: name, memory, limits, dtypes. An index out of range is
    /// [`Error::NoSuchDevice`].
    ///
    /// ```
    /// # fn main() -> Result<(), tributary::Error> {
    /// let sys = tributary_actors::System::builder().cpu_devices(2).spawn()?;
    /// assert_eq!(sys.device_info(1)?.backend, "cpu");
    /// assert!(sys.device_info(2).is_err());
    /// sys.shutdown()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn device_info(&self, i: usize) -> Result<tributary::backend::DeviceInfo> {
        self.shared
            .device_info
            .get(i)
            .cloned()
            .ok_or(Error::NoSuchDevice {
                index: i,
                count: self.shared.device_info.len(),
            })
    }

    /// The device actor of device `i`, for hosts that send messages directly.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// assert!(sys.device_actor(1).is_some());
    /// assert!(sys.device_actor(2).is_none());
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn device_actor(&self, i: usize) -> Option<Addr<DeviceActor>> {
        self.shared.devices.get(i).cloned()
    }

    /// The coordinator actor.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// assert!(sys.coordinator().connected());
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn coordinator(&self) -> Addr<Coordinator> {
        self.shared.coordinator.clone()
    }

    /// Creates a tensor node (memory mode `Unset`; refine it with [`TensorNode::with_mode`]).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2, 3]);
    /// assert_eq!((w.label(), w.numel()), ("w", 6));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn node(&self, label: &str, dtype: DType, shape: impl Into<Shape>) -> TensorNode {
        TensorNode::new(label, dtype, shape)
    }

    pub(crate) fn check_live(&self) -> Result<()> {
        if self
            .shared
            .shut_down
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Err(Error::ShutDown("the system was shut down".into()));
        }
        Ok(())
    }

    // ----- contexts, linking, scheduling --------------------------------------------

    /// Schedules a routine. Returns at once, without a round trip to the device actor.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 2.0)?)?;
    /// let ticket = sys.schedule(fill.routine())?;
    /// ticket.wait()?;
    /// assert_eq!(fill.context().read::<f32>(&x)?, vec![2.0; 4]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn schedule(&self, routine: &Routine) -> Result<Ticket> {
        self.schedule_with(routine, tributary::kernels::Bindings::none())
    }

    /// Schedules a routine with values for the integer indices it declares: name-value
    /// pairs (`&[("t", 3)]`) or a `Bindings` (`routine.bindings()`, refilled every step).
    /// The values are checked here, on the calling thread (a missing, unknown, repeated or
    /// out-of-range value is its typed error and nothing is posted), then snapshotted into
    /// the operation and the plan. Returns at once, without a round trip.
    ///
    /// ```
    /// # use tributary::{kernels::{Access, RoutineSpec}, DType, Error};
    /// # use tributary_actors::System;
    /// # let sys = System::builder().cpu_devices(1).spawn()?;
    /// let y = sys.node("y", DType::I32, [2]);
    /// let spec = RoutineSpec::custom("y = t", vec![(y.clone(), Access::Write)], None, |a| {
    ///     let t = a.index("t")? as i32;
    ///     a.output::<i32>(0)?.fill(t);
    ///     Ok(())
    /// })?
    /// .with_index("t")?;
    /// let r = sys.context(0, 0)?.link(spec)?;
    /// sys.schedule_with(r.routine(), &[("t", 5)])?.wait()?;
    /// assert_eq!(r.context().read::<i32>(&y)?, vec![5, 5]);
    /// assert!(matches!(sys.schedule(r.routine()), Err(Error::MissingBinding { .. })));
    /// # sys.shutdown()?;
    /// # Ok::<(), Error>(())
    /// ```
    pub fn schedule_with(
        &self,
        routine: &Routine,
        bindings: impl tributary::kernels::IntoBindings,
    ) -> Result<Ticket> {
        let bindings = routine.bind(bindings)?;
        self.check_live()?;
        Ok(Ticket::issued(
            self.dispatcher().auto_schedule(routine, bindings)?,
        ))
    }

    /// Uploads the host array of hosted `node` into its buffer in `ctx`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]);
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// sys.host_write(&w, &[3.0f32, 4.0])?;
    /// sys.from_host(&held, &w)?.wait()?;
    /// assert_eq!(held.read::<f32>(&w)?, vec![3.0, 4.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn from_host(&self, ctx: &Context, node: &TensorNode) -> Result<Ticket> {
        self.check_live()?;
        Ok(Ticket::pending(
            self.dispatcher().transfer(ctx, node, true)?,
        ))
    }

    /// Downloads the buffer of hosted `node` in `ctx` into its host array.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// let double = held.link(kernels::scale_in_place(&w, 2.0)?)?;
    /// double.schedule()?;
    /// sys.to_host(double.protocol_context(), &w)?.wait()?;
    /// assert_eq!(sys.host_read::<f32>(&w)?, vec![2.0, 4.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn to_host(&self, ctx: &Context, node: &TensorNode) -> Result<Ticket> {
        self.check_live()?;
        Ok(Ticket::pending(
            self.dispatcher().transfer(ctx, node, false)?,
        ))
    }

    /// Moves `node` from `src` to `dst` (DESIGN.md §3, rule 3). Returns at once: `None`
    /// when both contexts share the buffer (nothing to do), otherwise a ticket for the
    /// destination's operation (the copy, or the streaming consumer). The source and
    /// destination devices get their halves in one atomic post; a refusal the devices
    /// find in their tables (a finalized context, a source nothing wrote) comes through
    /// the ticket, with nothing planned.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let g = sys.node("g", DType::F32, [4]).with_mode(MemoryMode::on_device())?;
    /// let a = sys.context(0, 0)?.link(kernels::fill(&g, 1.0)?)?;
    /// let b = sys.context(1, 0)?.link(kernels::fill(&g, 2.0)?)?;
    /// a.schedule()?;
    /// b.schedule()?;
    /// // b = a's value, through b's merge buffer (OCANNL's `g =: merge`).
    /// let take = b.context().link(kernels::copy_merge(&g)?)?;
    /// sys.device_to_device(&g, a.protocol_context(), take.protocol_context(), MergeBufferUse::Copy)?;
    /// take.schedule()?;
    /// assert_eq!(take.context().read::<f32>(&g)?, vec![1.0; 4]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn device_to_device(
        &self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Ticket>> {
        self.check_live()?;
        Ok(self
            .dispatcher()
            .auto_device_to_device(node, src, dst, mode)?
            .map(Ticket::issued))
    }

    /// Finalizes `ctx`: its buffers are freed after their pending uses.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// fill.schedule()?;
    /// sys.finalize(fill.protocol_context())?;
    /// assert!(matches!(fill.context().read::<f32>(&x), Err(Error::ContextFinalized { .. })));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn finalize(&self, ctx: &Context) -> Result<()> {
        self.check_live()?;
        block_on(answer(self.dispatcher().finalize(ctx)?))
    }

    // ----- synchronisation and reports ------------------------------------------------

    /// A query to device `i`, answered in its inbox order.
    async fn query<T: Clone>(
        &self,
        i: usize,
        make: impl FnOnce(tributary::dispatch::messages::Reply<T>) -> Query,
    ) -> Result<T> {
        self.check_live()?;
        answer(self.dispatcher().query(i, make)?).await
    }

    /// Waits for all work issued so far on device `i`, then prunes its tables. Returns the
    /// first failure among that work, if any.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let ticket = sys.context(1, 0)?.link(kernels::fill(&x, 1.0)?)?.schedule()?;
    /// sys.sync_device(1)?;
    /// assert!(ticket.is_done());
    /// assert!(matches!(sys.sync_device(2), Err(Error::NoSuchDevice { .. })));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn sync_device(&self, i: usize) -> Result<()> {
        block_on(self.sync_device_async(i))
    }

    /// Async [`System::sync_device`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// block_on(sys.sync_device_async(0))?;
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn sync_device_async(&self, i: usize) -> Result<()> {
        let events = self.query(i, Query::LastEvents).await?;
        let mut first = Ok(());
        for e in events {
            if let Err(err) = e.wait_async().await {
                if first.is_ok() {
                    first = Err(err);
                }
            }
        }
        self.query(i, Query::Sweep).await?;
        first
    }

    /// Waits for all work issued so far on one stream (`await` of the design).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let ticket = sys.context(0, 1)?.link(kernels::fill(&x, 1.0)?)?.schedule()?;
    /// sys.await_stream(0, 1)?;
    /// assert!(ticket.is_done());
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn await_stream(&self, device: usize, stream: usize) -> Result<()> {
        block_on(async {
            match self
                .query(device, |r| Query::StreamLastEvent(stream, r))
                .await?
            {
                Some(e) => e.wait_async().await,
                None => Ok(()),
            }
        })
    }

    /// Waits for all work of every device.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let t0 = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?.schedule()?;
    /// let t1 = sys.context(1, 1)?.link(kernels::fill(&x, 2.0)?)?.schedule()?;
    /// sys.sync()?;
    /// assert!(t0.is_done() && t1.is_done());
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn sync(&self) -> Result<()> {
        block_on(self.sync_async())
    }

    /// Async [`System::sync`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// block_on(sys.sync_async())?;
    /// assert!(sys.is_idle()?);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn sync_async(&self) -> Result<()> {
        let mut first = Ok(());
        for i in 0..self.device_count() {
            let r = self.sync_device_async(i).await;
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Whether every operation issued so far has completed.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?.schedule()?;
    /// sys.sync()?;
    /// assert!(sys.is_idle()?);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn is_idle(&self) -> Result<bool> {
        block_on(async {
            let mut idle = true;
            for i in 0..self.device_count() {
                idle &= self.query(i, Query::IsIdle).await?;
            }
            Ok(idle)
        })
    }

    /// Memory statistics of every device.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [256]);
    /// let _fill = sys.context(1, 0)?.link(kernels::fill(&x, 1.0)?)?; // linking allocates
    /// let stats = sys.memory_stats()?;
    /// assert!(stats[1].live_bytes >= 1024);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn memory_stats(&self) -> Result<Vec<PoolStats>> {
        block_on(async {
            let mut out = Vec::new();
            for i in 0..self.device_count() {
                out.push(self.query(i, Query::MemoryStats).await?);
            }
            Ok(out)
        })
    }

    /// Memory report (serde, and a short table through `Display`).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let report = sys.memory_report()?;
    /// println!("{report}"); // a table, one row per device
    /// assert_eq!(report.devices.len(), 2);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn memory_report(&self) -> Result<MemoryReport> {
        Ok(MemoryReport {
            devices: self.memory_stats()?,
        })
    }

    /// Sizes of every device's protocol tables.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// assert_eq!(sys.table_sizes()?.len(), 2);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn table_sizes(&self) -> Result<Vec<TableSizes>> {
        block_on(async {
            let mut out = Vec::new();
            for i in 0..self.device_count() {
                out.push(self.query(i, Query::TableSizes).await?);
            }
            Ok(out)
        })
    }

    /// Debug information as JSON: every device's tables, pools and streams.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let info = sys.debug_info()?;
    /// assert_eq!(info["devices"].as_array().map(Vec::len), Some(2));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn debug_info(&self) -> Result<serde_json::Value> {
        block_on(async {
            let mut out = Vec::new();
            for i in 0..self.device_count() {
                out.push(self.query(i, Query::DebugInfo).await?);
            }
            Ok(serde_json::json!({ "devices": out }))
        })
    }

    /// Stops the system: in-flight work may finish within the configured timeout, what is
    /// left is abandoned (its waiters fail) and reported. Later calls fail with `ShutDown`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let report = sys.shutdown()?;
    /// assert!(report.abandoned.is_empty());
    /// assert!(matches!(sys.context(0, 0), Err(Error::ShutDown(_))));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn shutdown(&self) -> Result<ShutdownReport> {
        self.shutdown_within(Duration::from_millis(
            self.shared.config.shutdown_timeout_ms,
        ))
    }

    /// [`System::shutdown`] with an explicit bound.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let report = sys.shutdown_within(std::time::Duration::from_secs(5))?;
    /// assert!(report.abandoned.is_empty());
    /// assert!(sys.shutdown().is_err()); // already shut down
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn shutdown_within(&self, timeout: Duration) -> Result<ShutdownReport> {
        let start = Instant::now();
        let deadline = start + timeout;
        if self
            .shared
            .shut_down
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return Err(Error::ShutDown("the system was already shut down".into()));
        }
        let mut report = ShutdownReport::default();
        // Calls the automatic replay still holds are issued, and run like the rest.
        self.dispatcher().release_held();
        block_on(async {
            for addr in &self.shared.devices {
                if let Ok(a) = addr.send(StopStreams { deadline }).await {
                    report.abandoned.extend(a);
                }
            }
        });
        self.shared.actix.stop();
        let arbiters: Vec<Arbiter> = self
            .shared
            .arbiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for a in &arbiters {
            a.stop();
        }
        // Joined, not only stopped: the actors, and with the last of them the backend, are
        // dropped on these threads. Dropping the last Vulkan instance unloads the driver
        // (the loader `dlclose`s it); if that runs while the main thread is already in the
        // process's exit handlers, a handler of the driver is called after its code was
        // unmapped (seen with lavapipe: SIGSEGV at exit, the main thread in
        // `__run_exit_handlers` jumping to unmapped memory, once in 8-23 runs).
        for a in arbiters {
            let _ = a.join();
        }
        if let Some(t) = self
            .shared
            .thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = t.join();
        }
        report.took = start.elapsed();
        Ok(report)
    }
}
