//! The three ways a host reaches the protocol, behind one interface, so that the table of
//! misuses in `tests/reliability/reliability_bad_input.rs` is written once and run against each:
//!
//! - [`EngineApi`]: the single-owner `Engine`;
//! - [`SystemApi`]: the actor system's blocking methods (`System`);
//! - [`MessagesApi`]: the raw actix messages sent to the actors' addresses
//!   (`System::device_actor`, `System::coordinator`), as a host that runs its own actix
//!   would send them. Host arrays have no message (see `tributary_actors::messages`): host
//!   reads and writes, and reads of a buffer, go through `System` there too.

use std::time::Duration;

use tributary::{
    kernels::{Bindings, RoutineSpec},
    memory::{PoolConfig, PoolStats},
    protocol::{Context, Routine, TableSizes},
    DType, Engine, EngineConfig, Error, Event, MergeBufferUse, Result, TensorNode,
};
use tributary_actors::{
    block_on,
    messages::{
        DeviceToDevice, Finalize, FromHost, GetMemoryStats, GetTableSizes, InitFromHost,
        LastEvents, Link, NewContext, Schedule, Sweep, ToHost,
    },
    StreamConfig, System, Ticket,
};

/// How long a test waits for anything.
pub const BOUND: Duration = Duration::from_secs(20);

/// Host data of one of the element types the table uses.
pub enum Data {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
}

/// Values for a routine's indices as a host gives them: name-value pairs, or a
/// [`Bindings`] (which a raw `Schedule` message carries as it is).
pub enum Given<'a> {
    Pairs(&'a [(&'a str, i64)]),
    Bindings(Bindings),
}

/// Values read back, in the element type asked for.
#[derive(Debug, PartialEq)]
pub enum Values {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
}

impl Values {
    /// The f32 values (the probe reads only those).
    pub fn f32(self) -> Vec<f32> {
        match self {
            Values::F32(v) => v,
            other => panic!("read as f32, got {other:?}"),
        }
    }
}

/// Calls `$body` with `$v` bound to the data's vector, whatever its element type.
macro_rules! with_data {
    ($data:expr, |$v:ident| $body:expr) => {
        match $data {
            Data::F32($v) => $body,
            Data::F64($v) => $body,
            Data::I32($v) => $body,
        }
    };
}

/// Reads with the element type `$t` set to the one `$as` names.
macro_rules! read_as {
    ($as:expr, |$t:ident| $body:expr) => {
        match $as {
            DType::F32 => {
                type $t = f32;
                $body.map(Values::F32)
            }
            DType::F64 => {
                type $t = f64;
                $body.map(Values::F64)
            }
            DType::I32 => {
                type $t = i32;
                $body.map(Values::I32)
            }
            other => panic!("the table reads no {other}"),
        }
    };
}

/// The operations the misuses and the probe use.
pub trait Api {
    /// Which runner this is (in failure messages).
    fn name(&self) -> &'static str;
    /// A root context on `stream` of device `device`.
    fn context(&mut self, device: usize, stream: usize) -> Result<Context>;
    /// Links `spec` into `ctx`.
    fn link(&mut self, ctx: &Context, spec: RoutineSpec) -> Result<Routine>;
    /// Schedules `routine`; returns once it has an event (or was refused).
    fn schedule(&mut self, routine: &Routine) -> Result<Event>;
    /// Schedules `routine` with values for its indices.
    fn schedule_with(&mut self, routine: &Routine, given: Given<'_>) -> Result<Event>;
    /// Writes `data` as `node`'s host value and adds a buffer of it to a child of `ctx`.
    fn init_from_host(&mut self, ctx: &Context, node: &TensorNode, data: Data) -> Result<Context>;
    /// Uploads `node`'s host array into its buffer in `ctx` (named like the engine's).
    #[allow(clippy::wrong_self_convention)]
    fn from_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event>;
    /// Downloads `node`'s buffer in `ctx` into its host array.
    fn to_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event>;
    /// Moves `node` from `src` to `dst`.
    fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Event>>;
    /// Reads `node`'s buffer in `ctx` as `dtype`.
    fn read(&mut self, ctx: &Context, node: &TensorNode, dtype: DType) -> Result<Values>;
    /// Reads `node`'s host value as `dtype`.
    fn host_read(&mut self, node: &TensorNode, dtype: DType) -> Result<Values>;
    /// Writes `node`'s host value.
    fn host_write(&mut self, node: &TensorNode, data: Data) -> Result<()>;
    /// Finalizes `ctx`.
    fn finalize(&mut self, ctx: &Context) -> Result<()>;
    /// Waits for everything issued, and leaves the tables and pools as they stay until the
    /// next operation (so two snapshots around a refused call can be compared).
    fn quiesce(&mut self) -> Result<()>;
    /// Memory statistics of every device.
    fn memory_stats(&mut self) -> Vec<PoolStats>;
    /// Protocol table sizes of every device.
    fn table_sizes(&mut self) -> Vec<TableSizes>;
    /// Everything a refused call must leave as it was: memory statistics, table sizes
    /// (and what else the runner can count).
    fn snapshot(&mut self) -> String {
        format!("{:?} {:?}", self.memory_stats(), self.table_sizes())
    }
    /// A second, independent instance of the same kind (its contexts mean nothing here).
    fn another(&self) -> Result<Box<dyn Api>>;
    /// The raw-message runner, for rows only messages can express.
    fn messages(&mut self) -> Option<&mut MessagesApi> {
        None
    }
}

/// The configuration of every world: 2 devices x 2 streams, small pools, a 1 MiB limit.
pub fn pools() -> PoolConfig {
    PoolConfig {
        pool_bytes: 64 << 10,
        limit_bytes: Some(1 << 20),
        ..PoolConfig::default()
    }
}

// ----- Engine ---------------------------------------------------------------------------

/// The engine.
pub struct EngineApi(pub Engine);

impl EngineApi {
    pub fn new() -> Result<EngineApi> {
        Ok(EngineApi(Engine::cpu(EngineConfig {
            devices: 2,
            streams_per_device: 2,
            pools: pools(),
            ..EngineConfig::default()
        })?))
    }
}

impl Api for EngineApi {
    fn name(&self) -> &'static str {
        "engine"
    }
    fn context(&mut self, device: usize, stream: usize) -> Result<Context> {
        self.0.context(device, stream)
    }
    fn link(&mut self, ctx: &Context, spec: RoutineSpec) -> Result<Routine> {
        self.0.link(ctx, spec)
    }
    fn schedule(&mut self, routine: &Routine) -> Result<Event> {
        self.0.schedule(routine)
    }
    fn schedule_with(&mut self, routine: &Routine, given: Given<'_>) -> Result<Event> {
        match given {
            Given::Pairs(pairs) => self.0.schedule_with(routine, pairs),
            Given::Bindings(b) => self.0.schedule_with(routine, b),
        }
    }
    fn init_from_host(&mut self, ctx: &Context, node: &TensorNode, data: Data) -> Result<Context> {
        with_data!(data, |v| self.0.init_from_host(ctx, node, &v))
    }
    fn from_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        self.0.from_host(ctx, node)
    }
    fn to_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        self.0.to_host(ctx, node)
    }
    fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Event>> {
        self.0.device_to_device(node, src, dst, mode)
    }
    fn read(&mut self, ctx: &Context, node: &TensorNode, dtype: DType) -> Result<Values> {
        read_as!(dtype, |T| self.0.read::<T>(ctx, node))
    }
    fn host_read(&mut self, node: &TensorNode, dtype: DType) -> Result<Values> {
        read_as!(dtype, |T| self.0.host_read::<T>(node))
    }
    fn host_write(&mut self, node: &TensorNode, data: Data) -> Result<()> {
        with_data!(data, |v| self.0.host_write(node, &v))
    }
    fn finalize(&mut self, ctx: &Context) -> Result<()> {
        self.0.finalize(ctx)
    }
    fn quiesce(&mut self) -> Result<()> {
        self.0.sync_all_timeout(BOUND)
    }
    fn memory_stats(&mut self) -> Vec<PoolStats> {
        self.0.memory_stats()
    }
    fn table_sizes(&mut self) -> Vec<TableSizes> {
        self.0.table_sizes().0
    }
    fn snapshot(&mut self) -> String {
        // With the events held by host arrays, which only the engine reports.
        format!("{:?} {:?}", self.memory_stats(), self.0.table_sizes())
    }
    fn another(&self) -> Result<Box<dyn Api>> {
        Ok(Box::new(EngineApi(Engine::cpu(EngineConfig::default())?)))
    }
}

// ----- System ---------------------------------------------------------------------------

/// A system of 2 CPU devices x 2 streams, the engine's pools.
pub fn system() -> Result<System> {
    System::builder()
        .cpu_devices(2)
        .streams(StreamConfig::MostParallelStreams(2))
        .pools(pools())
        .spawn()
}

/// Waits for everything issued on every device, then sweeps again: the first pass may
/// sweep a device before another device's reads of its buffers completed, and a later
/// sweep (on any completion) would then still change its tables.
fn quiesce(sys: &System) -> Result<()> {
    sys.sync()?;
    sys.sync()
}

/// The actor system's blocking methods.
pub struct SystemApi(pub System);

impl Drop for SystemApi {
    fn drop(&mut self) {
        let _ = self.0.shutdown();
    }
}

impl Api for SystemApi {
    fn name(&self) -> &'static str {
        "system"
    }
    fn context(&mut self, device: usize, stream: usize) -> Result<Context> {
        Ok(self.0.context(device, stream)?.protocol_context().clone())
    }
    fn link(&mut self, ctx: &Context, spec: RoutineSpec) -> Result<Routine> {
        Ok(self.0.link(ctx, spec)?.routine().clone())
    }
    fn schedule(&mut self, routine: &Routine) -> Result<Event> {
        self.0.schedule(routine)?.event()
    }
    fn schedule_with(&mut self, routine: &Routine, given: Given<'_>) -> Result<Event> {
        match given {
            Given::Pairs(pairs) => self.0.schedule_with(routine, pairs),
            Given::Bindings(b) => self.0.schedule_with(routine, b),
        }?
        .event()
    }
    fn init_from_host(&mut self, ctx: &Context, node: &TensorNode, data: Data) -> Result<Context> {
        with_data!(data, |v| Ok(self
            .0
            .init_from_host(ctx, node, &v)?
            .protocol_context()
            .clone()))
    }
    fn from_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        self.0.from_host(ctx, node)?.event()
    }
    fn to_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        self.0.to_host(ctx, node)?.event()
    }
    fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Event>> {
        // A refusal the devices find comes through the ticket: wait for the decision.
        self.0
            .device_to_device(node, src, dst, mode)?
            .map(|t| t.event())
            .transpose()
    }
    fn read(&mut self, ctx: &Context, node: &TensorNode, dtype: DType) -> Result<Values> {
        read_as!(dtype, |T| self.0.read::<T>(ctx, node))
    }
    fn host_read(&mut self, node: &TensorNode, dtype: DType) -> Result<Values> {
        read_as!(dtype, |T| self.0.host_read::<T>(node))
    }
    fn host_write(&mut self, node: &TensorNode, data: Data) -> Result<()> {
        with_data!(data, |v| self.0.host_write(node, &v))
    }
    fn finalize(&mut self, ctx: &Context) -> Result<()> {
        self.0.finalize(ctx)
    }
    fn quiesce(&mut self) -> Result<()> {
        quiesce(&self.0)
    }
    fn memory_stats(&mut self) -> Vec<PoolStats> {
        self.0.memory_stats().expect("memory stats")
    }
    fn table_sizes(&mut self) -> Vec<TableSizes> {
        self.0.table_sizes().expect("table sizes")
    }
    fn another(&self) -> Result<Box<dyn Api>> {
        Ok(Box::new(SystemApi(System::builder().spawn()?)))
    }
}

// ----- Raw messages ---------------------------------------------------------------------

/// The raw actix messages, sent to the addresses `System` hands out.
pub struct MessagesApi(pub System);

impl Drop for MessagesApi {
    fn drop(&mut self) {
        let _ = self.0.shutdown();
    }
}

/// A refused delivery (a stopped actor) as an error.
fn delivered<T>(reply: std::result::Result<T, actix::MailboxError>) -> Result<T> {
    reply.map_err(|e| Error::ShutDown(format!("mailbox: {e}")))
}

impl MessagesApi {
    /// The device actor of the device `ctx` lives on (CPU device ids are their indices).
    pub fn actor_of(&self, ctx: &Context) -> Result<actix::Addr<tributary_actors::DeviceActor>> {
        self.actor(ctx.device().0 as usize)
    }

    /// The device actor of device index `i`.
    pub fn actor(&self, i: usize) -> Result<actix::Addr<tributary_actors::DeviceActor>> {
        self.0.device_actor(i).ok_or(Error::NoSuchDevice {
            index: i,
            count: self.0.device_count(),
        })
    }

    /// Sends `msg` to device `i` and waits for the reply.
    pub fn ask<M>(&self, i: usize, msg: M) -> Result<M::Result>
    where
        tributary_actors::DeviceActor: actix::Handler<M>,
        M: actix::Message + Send + 'static,
        M::Result: Send,
    {
        delivered(block_on(self.actor(i)?.send(msg)))
    }

    /// Sends a ticketed message to `ctx`'s device; returns once the ticket has its event.
    fn ticketed<M>(&self, ctx: &Context, msg: M, ticket: Ticket) -> Result<Event>
    where
        tributary_actors::DeviceActor: actix::Handler<M>,
        M: actix::Message<Result = ()> + Send + 'static,
    {
        delivered(block_on(self.actor_of(ctx)?.send(msg)))?;
        ticket.event()
    }

    /// The underlying system (for what has no message).
    pub fn system(&self) -> &System {
        &self.0
    }
}

impl Api for MessagesApi {
    fn name(&self) -> &'static str {
        "messages"
    }
    fn context(&mut self, device: usize, stream: usize) -> Result<Context> {
        self.ask(device, NewContext { stream })?
    }
    fn link(&mut self, ctx: &Context, spec: RoutineSpec) -> Result<Routine> {
        let ctx = ctx.clone();
        delivered(block_on(self.actor_of(&ctx)?.send(Link { ctx, spec })))?
    }
    fn schedule(&mut self, routine: &Routine) -> Result<Event> {
        let (msg, ticket) = Schedule::new(&self.0, routine.clone());
        self.ticketed(routine.context(), msg, ticket)
    }
    fn schedule_with(&mut self, routine: &Routine, given: Given<'_>) -> Result<Event> {
        // Pairs have no message form: a host turns them into `Bindings` first (which
        // checks them); `Bindings` go into the message unchecked, for the actor to check.
        let bindings = match given {
            Given::Pairs(pairs) => routine.bind(pairs)?,
            Given::Bindings(b) => b,
        };
        let (mut msg, ticket) = Schedule::new(&self.0, routine.clone());
        msg.bindings = bindings;
        self.ticketed(routine.context(), msg, ticket)
    }
    fn init_from_host(&mut self, ctx: &Context, node: &TensorNode, data: Data) -> Result<Context> {
        // The host value has no message: write it first, then add the buffer.
        self.host_write(node, data)?;
        let msg = InitFromHost::new(ctx.clone(), node.clone());
        delivered(block_on(self.actor_of(ctx)?.send(msg)))?
    }
    fn from_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        let (msg, ticket) = FromHost::new(&self.0, ctx.clone(), node.clone());
        self.ticketed(ctx, msg, ticket)
    }
    fn to_host(&mut self, ctx: &Context, node: &TensorNode) -> Result<Event> {
        let (msg, ticket) = ToHost::new(&self.0, ctx.clone(), node.clone());
        self.ticketed(ctx, msg, ticket)
    }
    fn device_to_device(
        &mut self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<Event>> {
        let msg = DeviceToDevice::new(node.clone(), src.clone(), dst.clone(), mode);
        delivered(block_on(self.0.coordinator().send(msg)))?
    }
    fn read(&mut self, ctx: &Context, node: &TensorNode, dtype: DType) -> Result<Values> {
        read_as!(dtype, |T| self.0.read::<T>(ctx, node))
    }
    fn host_read(&mut self, node: &TensorNode, dtype: DType) -> Result<Values> {
        read_as!(dtype, |T| self.0.host_read::<T>(node))
    }
    fn host_write(&mut self, node: &TensorNode, data: Data) -> Result<()> {
        with_data!(data, |v| self.0.host_write(node, &v))
    }
    fn finalize(&mut self, ctx: &Context) -> Result<()> {
        let msg = Finalize::new(ctx.clone());
        delivered(block_on(self.actor_of(ctx)?.send(msg)))?
    }
    fn quiesce(&mut self) -> Result<()> {
        // `System::sync` in messages, twice (see `quiesce`).
        for _ in 0..2 {
            for i in 0..self.0.device_count() {
                for e in self.ask(i, LastEvents)?? {
                    e.wait_timeout(BOUND)?;
                }
                self.ask(i, Sweep)??;
            }
        }
        Ok(())
    }
    fn memory_stats(&mut self) -> Vec<PoolStats> {
        (0..self.0.device_count())
            .map(|i| {
                self.ask(i, GetMemoryStats)
                    .and_then(|r| r)
                    .expect("memory stats")
            })
            .collect()
    }
    fn table_sizes(&mut self) -> Vec<TableSizes> {
        (0..self.0.device_count())
            .map(|i| {
                self.ask(i, GetTableSizes)
                    .and_then(|r| r)
                    .expect("table sizes")
            })
            .collect()
    }
    fn another(&self) -> Result<Box<dyn Api>> {
        Ok(Box::new(MessagesApi(System::builder().spawn()?)))
    }
    fn messages(&mut self) -> Option<&mut MessagesApi> {
        Some(self)
    }
}
