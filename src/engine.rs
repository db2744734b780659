//! The direct engine API: one owner thread drives the protocol and the backends.
//!
//! [`Engine`] is tributary without actors. It owns every [`DeviceState`], the host table and
//! the stream queues. Each method turns one operation into plans and submits them. Scheduling
//! returns an [`Event`] at once. Host reads and writes block until the host array may be
//! touched. Engine tests, loom models and benchmarks use this API. See DESIGN.md §4.

use std::{sync::Arc, time::Duration};

mod capture;
pub use capture::Capture;

use serde::{Deserialize, Serialize};

use crate::{
    backend::{
        cpu::{CpuBackend, CpuConfig},
        Backend, StreamQueue,
    },
    error::{Error, Result},
    event::Event,
    ids::DeviceId,
    kernels::{Bindings, IntoBindings, RoutineSpec},
    memory::{AlignedBuffer, PoolConfig, PoolStats},
    node::{Element, HostedKind, MemoryMode, TensorNode},
    protocol::{Context, DeviceState, HostTable, Plan, Routine, TableSizes},
};

pub use crate::protocol::MergeBufferUse;

/// Configuration of an [`Engine`] on the CPU backend.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// Number of virtual CPU devices.
    pub devices: usize,
    /// Streams per device.
    pub streams_per_device: usize,
    /// Pool configuration of every device.
    pub pools: PoolConfig,
    /// How the CPU backend runs the streams: workers, spin window, dedicated threads.
    pub cpu: CpuConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            devices: 2,
            streams_per_device: 2,
            pools: PoolConfig::default(),
            cpu: CpuConfig::default(),
        }
    }
}

/// The engine: devices, their protocol state, host arrays and stream queues.
pub struct Engine {
    backend: Arc<dyn Backend>,
    devices: Vec<DeviceState>,
    queues: Vec<Vec<Box<dyn StreamQueue>>>,
    host: HostTable,
    /// Lists a replay fills and empties, kept so that a replay allocates none of them.
    replay_scratch: capture::ReplayScratch,
}

impl Engine {
    /// An engine on the CPU backend.
    ///
    /// ```
    /// # use tributary::{Engine, EngineConfig};
    /// let e = Engine::cpu(EngineConfig { devices: 3, ..EngineConfig::default() })?;
    /// assert_eq!(e.device_count(), 3);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn cpu(config: EngineConfig) -> Result<Engine> {
        let backend = CpuBackend::with_config(DeviceId(0), config.devices, config.cpu)?;
        Engine::with_backend(Arc::new(backend), config.streams_per_device, config.pools)
    }

    /// An engine on any backend, with `streams` streams per device.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tributary::{backend::cpu::CpuBackend, memory::PoolConfig, DeviceId, Engine, Error};
    /// let e = Engine::with_backend(Arc::new(CpuBackend::new(DeviceId(0), 1)), 2, PoolConfig::default())?;
    /// assert_eq!(e.stream_count(0), 2);
    /// let none = Engine::with_backend(Arc::new(CpuBackend::new(DeviceId(0), 1)), 0, PoolConfig::default());
    /// assert!(matches!(none, Err(Error::InvalidConfig { .. })));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn with_backend(
        backend: Arc<dyn Backend>,
        streams: usize,
        pools: PoolConfig,
    ) -> Result<Engine> {
        if streams == 0 {
            return Err(Error::InvalidConfig {
                setting: "streams".into(),
                value: streams.to_string(),
                reason: "every device needs at least one stream".into(),
            });
        }
        let mut devices = Vec::new();
        let mut queues = Vec::new();
        for device in backend.devices() {
            let mut pools = pools.clone();
            pools.min_alignment = pools.min_alignment.max(backend.min_alignment(device));
            let timelines: Vec<_> = (0..streams as u32)
                .map(|index| crate::event::Timeline::new(crate::StreamId { device, index }))
                .collect();
            let mut qs = Vec::new();
            for t in &timelines {
                // SAFETY: `t` is a fresh timeline that only this queue completes; the
                // plans this engine submits to it are those of the `DeviceState` made
                // below from the same timelines, whose pool memory is `backend`'s
                // `device`; every other device's state lives on such queues too.
                qs.push(unsafe { backend.start_stream(t.stream(), t.clone()) }?);
            }
            let memory = crate::backend::BackendMemory::new(backend.clone(), device);
            devices.push(DeviceState::new(device, timelines, pools, Box::new(memory)));
            queues.push(qs);
        }
        Ok(Engine {
            backend,
            devices,
            queues,
            host: HostTable::default(),
            replay_scratch: Default::default(),
        })
    }

    /// What device `device` is: name, memory, limits, dtypes. A device index out of range is
    /// [`Error::NoSuchDevice`].
    ///
    /// ```
    /// use tributary::{Engine, EngineConfig};
    /// let engine = Engine::cpu(EngineConfig::default())?;
    /// let info = engine.device_info(0)?;
    /// assert_eq!(info.backend, "cpu");
    /// assert!(engine.device_info(engine.device_count()).is_err());
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn device_info(&self, device: usize) -> Result<crate::backend::DeviceInfo> {
        let state = self.devices.get(device).ok_or(Error::NoSuchDevice {
            index: device,
            count: self.devices.len(),
        })?;
        Ok(self.backend.device_info(state.device())?)
    }

    /// The backend's name.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// assert_eq!(e.backend_name(), "cpu");
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Number of devices.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// assert_eq!(e.device_count(), EngineConfig::default().devices);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Number of streams of `device`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// assert_eq!(e.stream_count(0), 2);
    /// assert_eq!(e.stream_count(99), 0); // no such device
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn stream_count(&self, device: usize) -> usize {
        self.devices.get(device).map_or(0, |d| d.stream_count())
    }

    fn device_index(&self, device: DeviceId) -> Result<usize> {
        self.devices
            .iter()
            .position(|d| d.device() == device)
            .ok_or(Error::UnknownDevice {
                device,
                count: self.devices.len(),
            })
    }

    fn state(&mut self, device: DeviceId) -> Result<&mut DeviceState> {
        let i = self.device_index(device)?;
        Ok(&mut self.devices[i])
    }

    /// Submits plans to their streams.
    fn submit(&mut self, plans: impl IntoIterator<Item = Plan>) -> Result<Option<Event>> {
        let mut last = None;
        for plan in plans {
            let d = self.device_index(plan.stream().device)?;
            let event = plan.event().clone();
            tracing::trace!(stream = %plan.stream(), seq = event.seq(), op = ?plan.work(), deps = plan.deps().len(), "submit");
            let queues = &self.queues[d];
            match queues.get(plan.stream().index as usize) {
                Some(q) => {
                    // A dead queue fails the event itself; the error reaches waiters.
                    let _ = q.submit(plan);
                }
                None => {
                    return Err(Error::NoSuchStream {
                        device: plan.stream().device,
                        index: plan.stream().index as usize,
                        count: queues.len(),
                    })
                }
            }
            last = Some(event);
        }
        Ok(last)
    }

    /// A root context (no arrays) on `stream` of `device`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let c = e.context(1, 0)?;
    /// assert_eq!(c.device(), tributary::DeviceId(1));
    /// assert!(matches!(e.context(0, 9), Err(Error::NoSuchStream { index: 9, count: 2, .. })));
    /// assert!(matches!(e.context(9, 0), Err(Error::NoSuchDevice { index: 9, count: 2 })));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn context(&mut self, device: usize, stream: usize) -> Result<Context> {
        let count = self.devices.len();
        let state = self.devices.get_mut(device).ok_or(Error::NoSuchDevice {
            index: device,
            count,
        })?;
        state.root_context(stream)
    }

    /// Links a routine into `ctx`; the routine's context is a new child of `ctx`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let x = TensorNode::new("x", DType::F32, [4]);
    /// let root = e.context(0, 0)?;
    /// let fill = e.link(&root, kernels::fill(&x, 1.5)?)?;
    /// // The routine's context is a child of `root` that holds a buffer of `x`.
    /// assert!(fill.context().contains(&x) && !root.contains(&x));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn link(&mut self, ctx: &Context, spec: RoutineSpec) -> Result<Routine> {
        self.backend.check_routine(ctx.device(), &spec)?;
        let (routine, plans) = self.state(ctx.device())?.link(ctx, spec)?;
        self.submit(plans)?;
        Ok(routine)
    }

    /// Schedules a linked routine; returns its event without waiting.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let x = TensorNode::new("x", DType::F32, [4]);
    /// let root = e.context(0, 0)?;
    /// let fill = e.link(&root, kernels::fill(&x, 1.5)?)?;
    /// let event = e.schedule(&fill)?; // returns at once
    /// event.wait()?;
    /// assert_eq!(e.read::<f32>(fill.context(), &x)?, vec![1.5; 4]);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn schedule(&mut self, routine: &Routine) -> Result<Event> {
        self.schedule_with(routine, Bindings::none())
    }

    /// Schedules a linked routine with values for the integer indices it declares
    /// ([`RoutineSpec::with_index`](crate::kernels::RoutineSpec::with_index)): name-value
    /// pairs (`&[("t", 3)]`) or a [`Bindings`] (keep one per routine and refill it every
    /// step: [`Routine::bindings`]). The values are snapshotted into the plan now; the
    /// kernel sees them when it runs, whatever later schedules give. Returns its event
    /// without waiting.
    ///
    /// A missing value ([`Error::MissingBinding`]), an undeclared name
    /// ([`Error::UnknownBinding`]), a name given twice ([`Error::DuplicateBinding`]) or a
    /// value outside its index's type ([`Error::BindingOutOfRange`]) refuses the schedule,
    /// and nothing changes.
    ///
    /// ```
    /// use tributary::kernels::{Access, RoutineSpec};
    /// use tributary::{DType, Engine, EngineConfig, Error, TensorNode};
    /// let mut e = Engine::cpu(EngineConfig::default())?;
    /// let log = TensorNode::new_zeroed("log", DType::I32, [4]);
    /// // log[t] = 10 t: each run writes the slot its own schedule named.
    /// let spec = RoutineSpec::custom("log", vec![(log.clone(), Access::ReadWrite)], None, |a| {
    ///     let t = a.index("t")?;
    ///     a.output::<i32>(0)?[t as usize] = 10 * t as i32;
    ///     Ok(())
    /// })?
    /// .with_index("t")?;
    /// let root = e.context(0, 0)?;
    /// let r = e.link(&root, spec)?;
    /// for t in 0..4 {
    ///     e.schedule_with(&r, &[("t", t)])?; // four plans queued, each with its own t
    /// }
    /// e.sync_all()?;
    /// assert_eq!(e.read::<i32>(r.context(), &log)?, vec![0, 10, 20, 30]);
    /// assert!(matches!(e.schedule_with(&r, &[("t", -1)]), Err(Error::BindingOutOfRange { .. })));
    /// assert!(matches!(e.schedule_with(&r, &[("x", 1)]), Err(Error::UnknownBinding { .. })));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn schedule_with(
        &mut self,
        routine: &Routine,
        bindings: impl IntoBindings,
    ) -> Result<Event> {
        let bindings = routine.bind(bindings)?;
        self.host.next_order();
        let span = tracing::trace_span!("schedule", routine = routine.name(), stream = %routine.context().stream());
        let _e = span.enter();
        let device = routine.context().device();
        let i = self.device_index(device)?;
        let plans = self.devices[i].schedule_with(routine, &bindings, &mut self.host)?;
        self.submit(plans)?.ok_or_else(|| {
            Error::Internal(format!("scheduling {} planned nothing", routine.name()))
        })
    }

    /// Writes `data` into the host array of `node` (making it hosted if undecided), then
    /// returns a child of `ctx` holding a buffer of `node` initialised from it.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let w = TensorNode::new("w", DType::F32, [3]);
    /// let root = e.context(0, 0)?;
    /// let held = e.init_from_host(&root, &w, &[1.0f32, 2.0, 3.0])?;
    /// assert!(w.mode().is_hosted());
    /// assert_eq!(e.read::<f32>(&held, &w)?, vec![1.0, 2.0, 3.0]);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn init_from_host<T: Element>(
        &mut self,
        ctx: &Context,
        node: &TensorNode,
        data: &[T],
    ) -> Result<Context> {
        self.host.next_order();
        let i = self.device_index(ctx.device())?;
        self.devices[i].check_context(ctx)?;
        if ctx.contains(node) {
            return Err(Error::AlreadyInContext {
                node: node.to_string(),
                context: ctx.id(),
            });
        }
        node.check_data(T::DTYPE, data.len())?;
        if !node.mode().is_hosted() {
            node.refine_mode(MemoryMode::Hosted(HostedKind::Unset))?;
        }
        self.host_write(node, data)?;
        let (child, mut plans) = self.devices[i].add_array(ctx, node)?;
        plans.push(self.devices[i].from_host(&child, node, &mut self.host)?);
        self.submit(plans)?;
        Ok(child)
    }

    /// Copies the host array of hosted `node` into its buffer in `ctx`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let w = TensorNode::new("w", DType::F32, [2]);
    /// let root = e.context(0, 0)?;
    /// let held = e.init_from_host(&root, &w, &[1.0f32, 2.0])?;
    /// e.host_write(&w, &[5.0f32, 6.0])?;
    /// e.from_host(&held, &w)?.wait()?;
    /// assert_eq!(e.read::<f32>(&held, &w)?, vec![5.0, 6.0]);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn from_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        self.host.next_order();
        let i = self.device_index(ctx.device())?;
        let plan = self.devices[i].from_host(ctx, node, &mut self.host)?;
        self.submit_one(plan)
    }

    /// Copies the buffer of hosted `node` in `ctx` into its host array.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let w = TensorNode::new("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// let root = e.context(0, 0)?;
    /// let held = e.init_from_host(&root, &w, &[1.0f32, 2.0])?;
    /// let double = e.link(&held, kernels::scale_in_place(&w, 2.0)?)?;
    /// e.schedule(&double)?;
    /// e.to_host(double.context(), &w)?.wait()?;
    /// assert_eq!(e.host_read::<f32>(&w)?, vec![2.0, 4.0]);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn to_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        self.host.next_order();
        let i = self.device_index(ctx.device())?;
        let plan = self.devices[i].to_host(ctx, node, &mut self.host)?;
        self.submit_one(plan)
    }

    fn submit_one(&mut self, plan: Plan) -> Result<Event> {
        let event = plan.event().clone();
        self.submit([plan])?;
        Ok(event)
    }

    /// Moves `node` from `src` to `dst` (DESIGN.md §3 rule 3); `None` when there was
    /// nothing to do (both contexts share the buffer).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// use tributary::MergeBufferUse;
    /// let g = TensorNode::new("g", DType::F32, [4]).with_mode(MemoryMode::on_device())?;
    /// let (c0, c1) = (e.context(0, 0)?, e.context(1, 0)?);
    /// let a = e.link(&c0, kernels::fill(&g, 1.0)?)?;
    /// let b = e.link(&c1, kernels::fill(&g, 2.0)?)?;
    /// e.schedule(&a)?;
    /// e.schedule(&b)?;
    /// // b += a: a's value goes into device 1's merge buffer, then `add_merge` runs.
    /// let sum = e.link(b.context(), kernels::add_merge(&g)?)?;
    /// e.device_to_device(&g, a.context(), sum.context(), MergeBufferUse::Copy)?;
    /// e.schedule(&sum)?;
    /// assert_eq!(e.read::<f32>(sum.context(), &g)?, vec![3.0; 4]);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Event>> {
        self.host.next_order();
        let si = self.device_index(src.device())?;
        let di = self.device_index(dst.device())?;
        let can_stream = self.backend.can_stream(src.device(), dst.device());
        let planned = crate::protocol::device_to_device(
            &mut self.devices,
            si,
            di,
            node,
            src,
            dst,
            mode,
            can_stream,
            &mut self.host,
        )?;
        // The upload of a lagging source is an operation of the source device, recorded in
        // its tables: it runs even if the destination step failed.
        if let Some(upload) = planned.upload {
            self.submit([upload])?;
        }
        let plans = planned.destination?;
        if plans.is_empty() {
            return Ok(None);
        }
        self.submit(plans)
    }

    /// Reads the host value of hosted `node`: transfers the newest device value first if
    /// the host array is older, then waits for every pending transfer into the array.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let w = TensorNode::new("w", DType::I32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// let root = e.context(0, 0)?;
    /// let held = e.init_from_host(&root, &w, &[1i32, 2])?;
    /// let add = e.link(&held, kernels::fill(&w, 7.0)?)?;
    /// e.schedule(&add)?;
    /// // The device value is newer: it is transferred first.
    /// assert_eq!(e.host_read::<i32>(&w)?, vec![7, 7]);
    /// assert!(matches!(e.host_read::<f32>(&w), Err(Error::DTypeMismatch { .. })));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn host_read<T: Element>(&mut self, node: &TensorNode) -> Result<Vec<T>> {
        self.host.next_order();
        node.check_data(T::DTYPE, node.numel())?;
        if !node.mode().is_hosted() {
            return Err(Error::NotHosted {
                node: node.to_string(),
            });
        }
        let newer = self.host.record(node)?.newer_on_device();
        if let Some(copy) = newer {
            let i = self.device_index(copy.loc.device)?;
            let plan =
                self.devices[i].plan_to_host(copy.stream, node, copy.loc.loc, &mut self.host)?;
            self.submit([plan])?;
        }
        self.read_host_array(node)
    }

    /// Writes the host array of hosted `node` after every pending device read or write of
    /// it completed; every device copy then lags and is re-uploaded before its next use.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let w = TensorNode::new("w", DType::F64, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// e.host_write(&w, &[0.5f64, 0.25])?;
    /// assert_eq!(e.host_read::<f64>(&w)?, vec![0.5, 0.25]);
    /// assert!(matches!(e.host_write(&w, &[1.0f64]), Err(Error::SizeMismatch { .. })));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn host_write<T: Element>(&mut self, node: &TensorNode, data: &[T]) -> Result<()> {
        self.host.next_order();
        node.check_data(T::DTYPE, data.len())?;
        if !node.mode().is_hosted() {
            return Err(Error::NotHosted {
                node: node.to_string(),
            });
        }
        for e in self.host.begin_write(node)? {
            // Order only: a failed transfer still must not overlap our write.
            let _ = e.wait();
        }
        self.host.commit_write(node, bytemuck::cast_slice(data))
    }

    /// Reads the value of `node` in `ctx` (any memory mode): what a routine of `ctx` would
    /// read. That is the buffer after its last write, or, for a hosted node whose buffer
    /// lags a host write, the host array (which a routine would upload first; the buffer
    /// is left as it is). [`Engine::read_device_raw`] shows the buffer's bytes instead.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let g = TensorNode::new("g", DType::U8, [3]).with_mode(MemoryMode::on_device())?;
    /// let root = e.context(0, 1)?;
    /// let fill = e.link(&root, kernels::fill(&g, 9.0)?)?;
    /// e.schedule(&fill)?;
    /// assert_eq!(e.read::<u8>(fill.context(), &g)?, vec![9, 9, 9]); // waits for the fill
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn read<T: Element>(&mut self, ctx: &Context, node: &TensorNode) -> Result<Vec<T>> {
        node.check_data(T::DTYPE, node.numel())?;
        let i = self.device_index(ctx.device())?;
        if self.devices[i].lags(ctx, node, &self.host)? {
            return self.read_host_array(node);
        }
        self.read_device_raw(ctx, node)
    }

    /// The bytes of `node`'s buffer in `ctx` as they are, after its last write, for
    /// debugging: unlike [`Engine::read`], a buffer lagging a host write shows its stale
    /// device value, which no routine would read.
    pub fn read_device_raw<T: Element>(
        &mut self,
        ctx: &Context,
        node: &TensorNode,
    ) -> Result<Vec<T>> {
        node.check_data(T::DTYPE, node.numel())?;
        let bytes = node.size_in_bytes()? as usize;
        let into = Arc::new(AlignedBuffer::new(bytes, 64)?);
        let i = self.device_index(ctx.device())?;
        let plan = self.devices[i].read_into(ctx, node, into.clone())?;
        let event = self.submit_one(plan)?;
        event.wait()?;
        // SAFETY: the copy into `into` completed (waited above) and nothing else refers to it.
        let data = unsafe { into.bytes(0, bytes) }.map_err(crate::DeviceError::from)?;
        Ok(crate::kernels::from_bytes(data)?)
    }

    /// The host array of hosted `node` as it is now (no transfer from a device), after
    /// every pending transfer into it.
    fn read_host_array<T: Element>(&mut self, node: &TensorNode) -> Result<Vec<T>> {
        for e in self.host.pending_writes(node)? {
            e.wait()?;
        }
        Ok(crate::kernels::from_bytes(&self.host.read_bytes(node)?)?)
    }

    /// Finalizes `ctx`: its buffers are freed once every pending use completed.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let x = TensorNode::new("x", DType::F32, [4]);
    /// let root = e.context(0, 0)?;
    /// let fill = e.link(&root, kernels::fill(&x, 1.0)?)?;
    /// e.schedule(&fill)?;
    /// e.finalize(fill.context())?;
    /// assert!(!e.is_live(fill.context()));
    /// assert!(matches!(e.read::<f32>(fill.context(), &x), Err(Error::ContextFinalized { .. })));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn finalize(&mut self, ctx: &Context) -> Result<()> {
        self.host.next_order();
        let i = self.device_index(ctx.device())?;
        let plans = self.devices[i].finalize(ctx, &mut self.host)?;
        self.submit(plans)?;
        Ok(())
    }

    /// Waits for all work of `device` issued so far, then prunes its tables.
    /// Returns the first failure among that work, if any.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let x = TensorNode::new("x", DType::F32, [4]);
    /// let root = e.context(1, 0)?;
    /// let fill = e.link(&root, kernels::fill(&x, 1.0)?)?;
    /// let event = e.schedule(&fill)?;
    /// e.sync_device(1)?;
    /// assert!(event.is_done());
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn sync_device(&mut self, device: usize) -> Result<()> {
        let count = self.devices.len();
        let state = self.devices.get_mut(device).ok_or(Error::NoSuchDevice {
            index: device,
            count,
        })?;
        let mut first = Ok(());
        for e in state.last_events() {
            if let Err(err) = e.wait() {
                if first.is_ok() {
                    first = Err(err);
                }
            }
        }
        state.sweep();
        self.host.prune();
        first
    }

    /// Waits for all work of every device (see [`Engine::sync_device`]).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let x = TensorNode::new("x", DType::F32, [4]);
    /// let mut events = Vec::new();
    /// for d in 0..e.device_count() {
    ///     let root = e.context(d, 0)?;
    ///     let fill = e.link(&root, kernels::fill(&x, d as f64)?)?;
    ///     events.push(e.schedule(&fill)?);
    /// }
    /// e.sync_all()?;
    /// assert!(events.iter().all(|ev| ev.is_done()));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn sync_all(&mut self) -> Result<()> {
        let mut first = Ok(());
        for d in 0..self.devices.len() {
            let r = self.sync_device(d);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Waits up to `timeout` for all work of every device; `Error::Timeout` otherwise.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// e.sync_all_timeout(std::time::Duration::from_secs(10))?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn sync_all_timeout(&mut self, timeout: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        for state in &self.devices {
            for e in state.last_events() {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                match e.wait_timeout(left) {
                    Err(err @ Error::Timeout { .. }) => return Err(err),
                    _ => continue,
                }
            }
        }
        self.sync_all()
    }

    /// Memory statistics of every device.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let x = TensorNode::new("x", DType::F32, [256]);
    /// let root = e.context(0, 0)?;
    /// let _fill = e.link(&root, kernels::fill(&x, 1.0)?)?; // linking allocates
    /// let stats = e.memory_stats();
    /// assert!(stats[0].live_bytes >= 1024);
    /// assert_eq!(stats[1].live_bytes, 0);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn memory_stats(&self) -> Vec<PoolStats> {
        self.devices.iter().map(|d| d.pool_stats()).collect()
    }

    /// Sizes of the protocol tables of every device, plus events held by host arrays.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let (per_device, host_events) = e.table_sizes();
    /// assert_eq!(per_device.len(), e.device_count());
    /// assert_eq!(host_events, 0);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn table_sizes(&self) -> (Vec<TableSizes>, usize) {
        (
            self.devices.iter().map(|d| d.table_sizes()).collect(),
            self.host.events_held(),
        )
    }

    /// Whether `ctx` is live.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Engine, EngineConfig, Error, MemoryMode, TensorNode};
    /// # let mut e = Engine::cpu(EngineConfig::default())?;
    /// let root = e.context(0, 0)?;
    /// assert!(e.is_live(&root));
    /// e.finalize(&root)?;
    /// assert!(!e.is_live(&root));
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn is_live(&self, ctx: &Context) -> bool {
        self.devices
            .iter()
            .any(|d| d.device() == ctx.device() && d.is_live(ctx))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for qs in &self.queues {
            for q in qs {
                q.shutdown();
            }
        }
    }
}
