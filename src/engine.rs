//! The direct engine API: one owner thread drives the protocol and the backends.
//!
//! [`Engine`] is tributary without actors: it owns every [`DeviceState`], the host table
//! and the stream queues, and each method turns one operation into plans and submits them.
//! Scheduling returns an [`Event`] at once; host reads and writes block until the protocol
//! says the host array may be touched. The actor layer does the same work split over
//! device actors; this API is what engine tests, loom models and benchmarks use.

use std::{sync::Arc, time::Duration};

use serde::{Deserialize, Serialize};

use crate::{
    backend::{cpu::CpuBackend, Backend, StreamQueue},
    error::{Error, Result},
    event::Event,
    ids::DeviceId,
    kernels::RoutineSpec,
    memory::{AlignedBuffer, PoolConfig, PoolStats},
    node::{Element, HostedKind, MemoryMode, TensorNode},
    protocol::{Context, DeviceState, HostTable, Plan, Routine, TableSizes},
};

/// How a device-to-device operation delivers the node (DESIGN.md §2, "Merge buffer").
#[derive(Clone, Debug)]
pub enum MergeBufferUse {
    /// Copy into the node's own buffer in the destination context.
    No,
    /// Copy into the destination stream's merge buffer.
    Copy,
    /// No copy: schedule this routine (linked in the destination context, expecting the
    /// node as its merge input) reading the source buffer in place.
    StreamingFor(Routine),
}

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
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            devices: 2,
            streams_per_device: 2,
            pools: PoolConfig::default(),
        }
    }
}

/// The engine: devices, their protocol state, host arrays and stream queues.
pub struct Engine {
    backend: Arc<dyn Backend>,
    devices: Vec<DeviceState>,
    queues: Vec<Vec<Box<dyn StreamQueue>>>,
    host: HostTable,
}

fn as_bytes<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: `Element` is sealed and implemented only for plain-old-data types without
    // padding, so every byte of the slice is initialised; the length is exact.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

fn from_bytes<T: Element>(bytes: &[u8]) -> Vec<T> {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut out = Vec::<T>::with_capacity(n);
    // SAFETY: `out` has capacity for `n` elements; we copy exactly n * size_of::<T>()
    // bytes into it, and every bit pattern is a valid `T` (sealed POD `Element`).
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            out.as_mut_ptr().cast::<u8>(),
            n * std::mem::size_of::<T>(),
        );
        out.set_len(n);
    }
    out
}

impl Engine {
    /// An engine on the CPU backend.
    pub fn cpu(config: EngineConfig) -> Result<Engine> {
        let backend = CpuBackend::new(DeviceId(0), config.devices);
        Engine::with_backend(Arc::new(backend), config.streams_per_device, config.pools)
    }

    /// An engine on any backend, with `streams` streams per device.
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
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Number of streams of `device`.
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
    fn submit(&mut self, plans: Vec<Plan>) -> Result<Option<Event>> {
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
    pub fn context(&mut self, device: usize, stream: usize) -> Result<Context> {
        let count = self.devices.len();
        let state = self.devices.get_mut(device).ok_or(Error::NoSuchDevice {
            index: device,
            count,
        })?;
        state.root_context(stream)
    }

    /// Links a routine into `ctx`; the routine's context is a new child of `ctx`.
    pub fn link(&mut self, ctx: &Context, spec: RoutineSpec) -> Result<Routine> {
        self.backend
            .check_kernel(ctx.device(), &spec.name, &spec.kernel)?;
        let (routine, plans) = self.state(ctx.device())?.link(ctx, spec)?;
        self.submit(plans)?;
        Ok(routine)
    }

    /// Schedules a linked routine; returns its event without waiting.
    pub fn schedule(&mut self, routine: &Routine) -> Result<Event> {
        self.host.next_order();
        let span = tracing::trace_span!("schedule", routine = routine.name(), stream = %routine.context().stream());
        let _e = span.enter();
        let device = routine.context().device();
        let i = self.device_index(device)?;
        let plans = self.devices[i].schedule(routine, &mut self.host)?;
        self.submit(plans)?.ok_or_else(|| {
            Error::Internal(format!("scheduling {} planned nothing", routine.name()))
        })
    }

    /// Writes `data` into the host array of `node` (making it hosted if undecided), then
    /// returns a child of `ctx` holding a buffer of `node` initialised from it.
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
    pub fn from_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        self.host.next_order();
        let i = self.device_index(ctx.device())?;
        let plan = self.devices[i].from_host(ctx, node, &mut self.host)?;
        self.submit_one(plan)
    }

    /// Copies the buffer of hosted `node` in `ctx` into its host array.
    pub fn to_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        self.host.next_order();
        let i = self.device_index(ctx.device())?;
        let plan = self.devices[i].to_host(ctx, node, &mut self.host)?;
        self.submit_one(plan)
    }

    fn submit_one(&mut self, plan: Plan) -> Result<Event> {
        let event = plan.event().clone();
        self.submit(vec![plan])?;
        Ok(event)
    }

    /// Moves `node` from `src` to `dst` (DESIGN.md §3 rule 3); `None` when there was
    /// nothing to do (both contexts share the buffer).
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
        let plans = crate::protocol::device_to_device(
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
        if plans.is_empty() {
            return Ok(None);
        }
        self.submit(plans)
    }

    /// Reads the host value of hosted `node`: transfers the newest device value first if
    /// the host array is older, then waits for every pending transfer into the array.
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
            self.submit(vec![plan])?;
        }
        for e in self.host.pending_writes(node)? {
            e.wait()?;
        }
        Ok(from_bytes(&self.host.read_bytes(node)?))
    }

    /// Writes the host array of hosted `node` after every pending device read or write of
    /// it completed; every device copy then lags and is re-uploaded before its next use.
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
        self.host.commit_write(node, as_bytes(data))
    }

    /// Reads the buffer of `node` in `ctx` (any memory mode), waiting for its last write.
    pub fn read<T: Element>(&mut self, ctx: &Context, node: &TensorNode) -> Result<Vec<T>> {
        node.check_data(T::DTYPE, node.numel())?;
        let bytes = node.size_in_bytes()? as usize;
        let into = Arc::new(AlignedBuffer::new(bytes, 64)?);
        let i = self.device_index(ctx.device())?;
        let plan = self.devices[i].read_into(ctx, node, into.clone())?;
        let event = self.submit_one(plan)?;
        event.wait()?;
        // SAFETY: the copy into `into` completed (waited above) and nothing else refers to it.
        let data = unsafe { into.bytes(0, bytes) }.map_err(crate::DeviceError::from)?;
        Ok(from_bytes(data))
    }

    /// Finalizes `ctx`: its buffers are freed once every pending use completed.
    pub fn finalize(&mut self, ctx: &Context) -> Result<()> {
        self.host.next_order();
        let i = self.device_index(ctx.device())?;
        let plans = self.devices[i].finalize(ctx, &mut self.host)?;
        self.submit(plans)?;
        Ok(())
    }

    /// Waits for all work of `device` issued so far, then prunes its tables.
    /// Returns the first failure among that work, if any.
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
    pub fn memory_stats(&self) -> Vec<PoolStats> {
        self.devices.iter().map(|d| d.pool_stats()).collect()
    }

    /// Sizes of the protocol tables of every device, plus events held by host arrays.
    pub fn table_sizes(&self) -> (Vec<TableSizes>, usize) {
        (
            self.devices.iter().map(|d| d.table_sizes()).collect(),
            self.host.events_held(),
        )
    }

    /// Whether `ctx` is live.
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
