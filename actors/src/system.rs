//! The host-side handle: spawn the actor system from plain synchronous code and drive it.
//!
//! [`System::builder`] (or a [`SystemConfig`] read from TOML or JSON) says how many CPU
//! devices and streams to create; [`SystemBuilder::spawn`] starts an actix system on its
//! own thread, one arbiter per device (the device actor and its stream actors share it),
//! and the coordinator. The caller needs no async runtime: blocking methods wait on their
//! replies, and `*_async` methods return futures for callers that have one.
//!
//! Program order: each call sends its messages from the calling thread, in order, to the
//! device actors it affects; calls that touch several devices (device-to-device, host
//! reads and writes) wait for the replies they need before returning, so no later call can
//! overtake them (DESIGN.md §4).

use std::{
    path::Path,
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use actix::{Actor, Addr, Arbiter, MailboxError};
use serde::{Deserialize, Serialize};
use tributary::trace::Recorder;
use tributary::{
    backend::{cpu::CpuConfig, Backend, BackendKind},
    kernels::RoutineSpec,
    memory::{AlignedBuffer, PoolConfig, PoolStats},
    protocol::{Context, DeviceState, HostTable, Routine, TableSizes},
    DType, DeviceId, Element, Error, HostedKind, MemoryMode, MergeBufferUse, Result, Shape,
    StreamId, TensorNode, Timeline,
};

use crate::{
    coordinator::Coordinator,
    device::DeviceActor,
    messages::*,
    stream::StreamActor,
    ticket::{block_on, Ticket, TicketSender},
};

/// How many streams each device gets (OCANNL's `config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum StreamConfig {
    /// One stream per device: parallelism only across devices.
    OnlyDevicesParallel,
    /// One compute stream plus one for copies.
    ForParallelCopying,
    /// This many streams per device.
    MostParallelStreams(usize),
}

impl StreamConfig {
    /// Streams per device on the CPU backend.
    ///
    /// ```
    /// use tributary_actors::StreamConfig;
    /// assert_eq!(StreamConfig::ForParallelCopying.streams_per_device(), 2);
    /// assert_eq!(StreamConfig::MostParallelStreams(0).streams_per_device(), 1);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn streams_per_device(self) -> usize {
        match self {
            StreamConfig::OnlyDevicesParallel => 1,
            StreamConfig::ForParallelCopying => 2,
            StreamConfig::MostParallelStreams(n) => n.max(1),
        }
    }
}

/// Configuration of a [`System`], serde-deserialisable (TOML or JSON).
///
/// New settings may be added in minor releases (`#[non_exhaustive]`): build one with
/// [`System::builder`], from a document ([`SystemConfig::from_toml_str`]), or from
/// `SystemConfig::default()` and field assignments.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[non_exhaustive]
#[serde(default, deny_unknown_fields)]
pub struct SystemConfig {
    /// Number of virtual CPU devices.
    pub cpu_devices: usize,
    /// Streams per device.
    pub streams: StreamConfig,
    /// Pool configuration of every device.
    pub pools: PoolConfig,
    /// Capacity of each device actor's mailbox (back-pressure beyond it).
    pub mailbox_capacity: usize,
    /// How long `shutdown` lets in-flight work finish, in milliseconds.
    pub shutdown_timeout_ms: u64,
    /// Record a timeline of every operation and wait (see [`System::timeline`]).
    pub record_timeline: bool,
    /// Which backend runs the devices (default: `Cpu`, with `cpu_devices` devices).
    pub backend: BackendKind,
    /// How the CPU backend runs its streams (TOML `[cpu]`: `workers`, `spin_us`,
    /// `dedicated_streams`); ignored by other backends.
    pub cpu: CpuConfig,
}

impl Default for SystemConfig {
    fn default() -> Self {
        SystemConfig {
            cpu_devices: 2,
            streams: StreamConfig::MostParallelStreams(2),
            pools: PoolConfig::default(),
            mailbox_capacity: 4096,
            shutdown_timeout_ms: 10_000,
            record_timeline: false,
            backend: BackendKind::Cpu,
            cpu: CpuConfig::default(),
        }
    }
}

impl SystemConfig {
    /// Parses a TOML document; [`Error::ConfigParse`] with the parser's message otherwise.
    ///
    /// ```
    /// use tributary_actors::SystemConfig;
    /// let c = SystemConfig::from_toml_str("cpu_devices = 3")?;
    /// assert_eq!(c.cpu_devices, 3);
    /// assert!(SystemConfig::from_toml_str("cpu_devices = \"three\"").is_err());
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn from_toml_str(text: &str) -> Result<SystemConfig> {
        toml::from_str(text).map_err(|e| Error::ConfigParse {
            path: None,
            format: "toml".into(),
            message: e.to_string(),
        })
    }

    /// Parses a JSON document; [`Error::ConfigParse`] with the parser's message otherwise.
    ///
    /// ```
    /// use tributary_actors::SystemConfig;
    /// let c = SystemConfig::from_json_str(r#"{ "cpu_devices": 1 }"#)?;
    /// assert_eq!(c.cpu_devices, 1);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn from_json_str(text: &str) -> Result<SystemConfig> {
        serde_json::from_str(text).map_err(|e| Error::ConfigParse {
            path: None,
            format: "json".into(),
            message: e.to_string(),
        })
    }

    /// Reads a `.json` file as JSON, any other as TOML; [`Error::ConfigParse`] naming the
    /// file when it cannot be read or parsed.
    ///
    /// ```
    /// use tributary::Error;
    /// use tributary_actors::SystemConfig;
    /// let err = SystemConfig::from_file("/nonexistent/tributary.toml").unwrap_err();
    /// assert!(matches!(err, Error::ConfigParse { path: Some(_), .. }), "{err}");
    /// ```
    pub fn from_file(path: impl AsRef<Path>) -> Result<SystemConfig> {
        let path = path.as_ref();
        let json = path.extension().and_then(|e| e.to_str()) == Some("json");
        let format = if json { "json" } else { "toml" };
        let with_path = |e: Error| match e {
            Error::ConfigParse {
                format, message, ..
            } => Error::ConfigParse {
                path: Some(path.to_path_buf()),
                format,
                message,
            },
            other => other,
        };
        let text = std::fs::read_to_string(path).map_err(|e| Error::ConfigParse {
            path: Some(path.to_path_buf()),
            format: format.into(),
            message: e.to_string(),
        })?;
        if json {
            Self::from_json_str(&text).map_err(with_path)
        } else {
            Self::from_toml_str(&text).map_err(with_path)
        }
    }
}

/// Builds a [`System`].
#[derive(Clone, Default)]
pub struct SystemBuilder {
    config: SystemConfig,
    /// A backend made by the caller, used instead of creating `config.backend`.
    instance: Option<Arc<dyn Backend>>,
}

impl std::fmt::Debug for SystemBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SystemBuilder")
            .field("config", &self.config)
            .field("instance", &self.instance.as_ref().map(|b| b.name()))
            .finish()
    }
}

impl SystemBuilder {
    /// Number of CPU devices.
    ///
    /// ```
    /// let sys = tributary_actors::System::builder().cpu_devices(3).spawn()?;
    /// assert_eq!(sys.device_count(), 3);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn cpu_devices(mut self, n: usize) -> Self {
        self.config.cpu_devices = n;
        self
    }

    /// How the CPU backend runs its streams: worker threads, spin window, streams with a
    /// thread of their own (default: one worker per core, 50 µs).
    ///
    /// ```
    /// use tributary::backend::cpu::CpuConfig;
    /// let sys = tributary_actors::System::builder()
    ///     .cpu(CpuConfig::default().with_workers(1))
    ///     .spawn()?;
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn cpu(mut self, config: CpuConfig) -> Self {
        self.config.cpu = config;
        self
    }

    /// Streams per device.
    ///
    /// ```
    /// use tributary_actors::{StreamConfig, System};
    /// let sys = System::builder().streams(StreamConfig::MostParallelStreams(3)).spawn()?;
    /// assert_eq!(sys.device(0).stream_count(), 3);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn streams(mut self, streams: StreamConfig) -> Self {
        self.config.streams = streams;
        self
    }

    /// Pool configuration.
    ///
    /// ```
    /// use tributary::memory::PoolConfig;
    /// let pools = PoolConfig { limit_bytes: Some(1 << 20), ..PoolConfig::default() };
    /// let sys = tributary_actors::System::builder().pools(pools).spawn()?;
    /// assert_eq!(sys.config().pools.limit_bytes, Some(1 << 20));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn pools(mut self, pools: PoolConfig) -> Self {
        self.config.pools = pools;
        self
    }

    /// Mailbox capacity of each device actor.
    ///
    /// ```
    /// let sys = tributary_actors::System::builder().mailbox_capacity(0).spawn()?;
    /// assert_eq!(sys.config().mailbox_capacity, 1); // at least one
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn mailbox_capacity(mut self, n: usize) -> Self {
        self.config.mailbox_capacity = n.max(1);
        self
    }

    /// Records a timeline of every operation and wait, for [`System::timeline`].
    ///
    /// ```
    /// let sys = tributary_actors::System::builder().record_timeline(true).spawn()?;
    /// assert!(sys.timeline().is_some());
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn record_timeline(mut self, on: bool) -> Self {
        self.config.record_timeline = on;
        self
    }

    /// The backend (default: CPU; e.g. `BackendKind::Vulkan(VulkanConfig::with_devices(2))`).
    ///
    /// ```
    /// use tributary::backend::BackendKind;
    /// let sys = tributary_actors::System::builder().backend(BackendKind::Cpu).cpu_devices(1).spawn()?;
    /// assert_eq!(sys.device_info(0)?.backend, "cpu");
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn backend(mut self, backend: BackendKind) -> Self {
        self.config.backend = backend;
        self
    }

    /// Runs on `backend`, a backend the caller made (a wrapper that injects faults or
    /// records plans, a backend of its own), instead of creating the configured
    /// [`BackendKind`]; its devices are the system's devices, and `cpu_devices` is
    /// ignored. A timeline recording (`record_timeline`) then records only what the
    /// actors see, not the backend's own work spans.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tributary::{backend::cpu::CpuBackend, DeviceId};
    /// let sys = tributary_actors::System::builder()
    ///     .backend_instance(Arc::new(CpuBackend::new(DeviceId(0), 3)))
    ///     .spawn()?;
    /// assert_eq!(sys.device_count(), 3);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn backend_instance(mut self, backend: Arc<dyn Backend>) -> Self {
        self.instance = Some(backend);
        self
    }

    /// The whole configuration.
    ///
    /// ```
    /// use tributary_actors::{System, SystemConfig};
    /// let config = SystemConfig::from_toml_str("cpu_devices = 1")?;
    /// let sys = System::builder().config(config).spawn()?;
    /// assert_eq!(sys.device_count(), 1);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn config(mut self, config: SystemConfig) -> Self {
        self.config = config;
        self
    }

    /// Starts the actor system on its own threads.
    ///
    /// ```
    /// use tributary::backend::BackendKind;
    /// let sys = tributary_actors::System::builder().spawn()?; // 2 CPU devices x 2 streams
    /// assert_eq!((sys.device_count(), sys.device(1).stream_count()), (2, 2));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn spawn(self) -> Result<System> {
        System::spawn(self.config, self.instance)
    }
}

struct Shared {
    devices: Vec<Addr<DeviceActor>>,
    device_ids: Vec<DeviceId>,
    streams: Vec<usize>,
    coordinator: Addr<Coordinator>,
    host: Arc<Mutex<HostTable>>,
    actix: actix::System,
    thread: Mutex<Option<JoinHandle<()>>>,
    arbiters: Mutex<Vec<Arbiter>>,
    shut_down: std::sync::atomic::AtomicBool,
    config: SystemConfig,
    recorder: Option<Arc<Recorder>>,
    /// What each device is, read from the backend at spawn (the backend itself lives on
    /// the actor threads and is dropped there).
    device_info: Vec<tributary::backend::DeviceInfo>,
    order: std::sync::atomic::AtomicU64,
    /// The device that last got an operation that may transfer each host array.
    host_array_device: Mutex<std::collections::HashMap<tributary::NodeId, tributary::DeviceId>>,
}

/// The host application's handle on a running device system. Cheap to clone.
#[derive(Clone)]
pub struct System {
    shared: Arc<Shared>,
}

fn mailbox(e: MailboxError) -> Error {
    Error::ShutDown(format!("actor unreachable: {e}"))
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

    fn spawn(config: SystemConfig, instance: Option<Arc<dyn Backend>>) -> Result<System> {
        let recorder = config.record_timeline.then(|| Arc::new(Recorder::new()));
        let backend: Arc<dyn Backend> = match instance {
            Some(backend) => backend,
            None => {
                config
                    .backend
                    .create_with(config.cpu_devices, &config.cpu, recorder.clone())?
            }
        };
        if backend.devices().is_empty() {
            return Err(Error::InvalidConfig {
                setting: "cpu_devices".into(),
                value: config.cpu_devices.to_string(),
                reason: "the backend has no devices to run".into(),
            });
        }
        let device_info = backend
            .devices()
            .into_iter()
            .map(|d| backend.device_info(d))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let streams = config.streams.streams_per_device();
        let host = Arc::new(Mutex::new(HostTable::default()));
        let (tx, rx) = std::sync::mpsc::channel();
        let cfg = config.clone();
        let host2 = host.clone();
        let thread = std::thread::Builder::new()
            .name("tributary-actix".into())
            .spawn(move || {
                let sys = actix::System::new();
                let started = sys.block_on(async move { start_actors(cfg, backend, host2) });
                let ok = started.is_ok();
                let _ =
                    tx.send(started.map(|(d, ids, c, a)| (d, ids, c, a, actix::System::current())));
                if ok {
                    let _ = sys.run();
                }
            })
            .map_err(|e| Error::Io {
                what: "spawn the actor thread".into(),
                message: e.to_string(),
            })?;
        let (devices, device_ids, coordinator, arbiters, actix) = rx
            .recv()
            .map_err(|_| Error::ShutDown("actor thread died during start-up".into()))??;
        Ok(System {
            shared: Arc::new(Shared {
                streams: vec![streams; devices.len()],
                devices,
                device_ids,
                coordinator,
                host,
                actix,
                thread: Mutex::new(Some(thread)),
                arbiters: Mutex::new(arbiters),
                shut_down: std::sync::atomic::AtomicBool::new(false),
                config,
                recorder,
                device_info,
                order: std::sync::atomic::AtomicU64::new(0),
                host_array_device: Mutex::new(std::collections::HashMap::new()),
            }),
        })
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

    /// A new program-order stamp, for messages that update the shared host table. Hosts
    /// that send messages directly take their stamps here too.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
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

    /// A handle on device `i`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let ctx = sys.device(1).stream(0).context()?;
    /// assert_eq!(ctx.device(), tributary::DeviceId(1));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn device(&self, i: usize) -> DeviceHandle {
        DeviceHandle {
            sys: self.clone(),
            index: i,
        }
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

    fn check_live(&self) -> Result<()> {
        if self
            .shared
            .shut_down
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Err(Error::ShutDown("the system was shut down".into()));
        }
        Ok(())
    }

    fn device_addr(&self, device: DeviceId) -> Result<&Addr<DeviceActor>> {
        self.shared
            .device_ids
            .iter()
            .position(|&d| d == device)
            .and_then(|i| self.shared.devices.get(i))
            .ok_or(Error::UnknownDevice {
                device,
                count: self.shared.device_ids.len(),
            })
    }

    /// The device actor of device index `i`; [`Error::NoSuchDevice`] beyond the devices.
    fn device_index(&self, i: usize) -> Result<&Addr<DeviceActor>> {
        self.shared.devices.get(i).ok_or(Error::NoSuchDevice {
            index: i,
            count: self.shared.devices.len(),
        })
    }

    async fn request<A, M>(&self, addr: &Addr<A>, msg: M) -> Result<M::Result>
    where
        A: Actor + actix::Handler<M>,
        A::Context: actix::dev::ToEnvelope<A, M>,
        M: actix::Message + Send + 'static,
        M::Result: Send,
    {
        self.check_live()?;
        addr.send(msg).await.map_err(mailbox)
    }

    /// Sends a message that has no reply, applying back-pressure when the mailbox is full.
    fn post<M>(&self, addr: &Addr<DeviceActor>, mut msg: M) -> Result<()>
    where
        DeviceActor: actix::Handler<M>,
        M: actix::Message + Send + 'static,
        M::Result: Send,
    {
        self.check_live()?;
        let mut spins = 0u32;
        loop {
            match addr.try_send(msg) {
                Ok(()) => return Ok(()),
                Err(actix::dev::SendError::Full(m)) => {
                    msg = m;
                    spins += 1;
                    if spins < 64 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
                Err(actix::dev::SendError::Closed(_)) => {
                    return Err(Error::ShutDown("device actor stopped".into()))
                }
            }
        }
    }

    // ----- contexts, linking, scheduling --------------------------------------------

    /// A root context on `stream` of device `device`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let ctx = sys.context(1, 1)?;
    /// assert_eq!(ctx.stream().index, 1);
    /// assert!(matches!(sys.context(2, 0), Err(Error::NoSuchDevice { index: 2, count: 2 })));
    /// assert!(matches!(sys.context(0, 5), Err(Error::NoSuchStream { index: 5, .. })));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn context(&self, device: usize, stream: usize) -> Result<ContextHandle> {
        block_on(self.context_async(device, stream))
    }

    /// Async [`System::context`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let ctx = block_on(sys.context_async(0, 1))?;
    /// assert_eq!(ctx.stream().index, 1);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn context_async(&self, device: usize, stream: usize) -> Result<ContextHandle> {
        let addr = self.device_index(device)?;
        let ctx = self.request(addr, NewContext { stream }).await??;
        Ok(ContextHandle {
            sys: self.clone(),
            ctx,
        })
    }

    /// Links a routine into `ctx`.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let root = sys.context(0, 0)?;
    /// let fill = sys.link(&root, kernels::fill(&x, 2.0)?)?; // a handle derefs to its context
    /// assert!(fill.protocol_context().contains(&x));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn link(&self, ctx: &Context, spec: RoutineSpec) -> Result<RoutineHandle> {
        block_on(self.link_async(ctx, spec))
    }

    /// Async [`System::link`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let root = sys.context(0, 0)?;
    /// let fill = block_on(sys.link_async(&root, kernels::fill(&x, 2.0)?))?;
    /// assert!(fill.protocol_context().contains(&x));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn link_async(&self, ctx: &Context, spec: RoutineSpec) -> Result<RoutineHandle> {
        let addr = self.device_addr(ctx.device())?;
        let routine = self
            .request(
                addr,
                Link {
                    ctx: ctx.clone(),
                    spec,
                },
            )
            .await??;
        Ok(RoutineHandle {
            sys: self.clone(),
            routine,
        })
    }

    /// Posts a message carrying a ticket to `ctx`'s device; returns the ticket at once.
    fn post_ticketed<M>(
        &self,
        ctx: &Context,
        make: impl FnOnce(TicketSender) -> M,
    ) -> Result<Ticket>
    where
        DeviceActor: actix::Handler<M>,
        M: actix::Message + Send + 'static,
        M::Result: Send,
    {
        let addr = self.device_addr(ctx.device())?;
        let (ticket, sender) = Ticket::new();
        self.post(addr, make(sender))?;
        Ok(ticket)
    }

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
        self.order_host_arrays(routine.context().device(), hosted_reads(routine))?;
        self.post_ticketed(routine.context(), |ticket| Schedule {
            order: self.next_order(),
            routine: routine.clone(),
            ticket,
        })
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
        self.order_host_arrays(ctx.device(), std::iter::once(node))?;
        self.post_ticketed(ctx, |ticket| FromHost {
            order: self.next_order(),
            ctx: ctx.clone(),
            node: node.clone(),
            ticket,
        })
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
        self.order_host_arrays(ctx.device(), std::iter::once(node))?;
        self.post_ticketed(ctx, |ticket| ToHost {
            order: self.next_order(),
            ctx: ctx.clone(),
            node: node.clone(),
            ticket,
        })
    }

    /// Writes `data` as the host value of `node` (made hosted if undecided) and returns a
    /// child of `ctx` holding a buffer initialised from it.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::I32, [3]);
    /// let root = sys.context(1, 0)?;
    /// let held = sys.init_from_host(&root, &w, &[1i32, 2, 3])?;
    /// assert_eq!(held.read::<i32>(&w)?, vec![1, 2, 3]);
    /// assert!(matches!(
    ///     sys.init_from_host(&held, &w, &[0i32; 3]),
    ///     Err(Error::AlreadyInContext { .. })
    /// ));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn init_from_host<T: Element>(
        &self,
        ctx: &Context,
        node: &TensorNode,
        data: &[T],
    ) -> Result<ContextHandle> {
        block_on(self.init_from_host_async(ctx, node, data))
    }

    /// Async [`System::init_from_host`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]);
    /// let root = sys.context(0, 0)?;
    /// let held = block_on(sys.init_from_host_async(&root, &w, &[1.0f32, 2.0]))?;
    /// assert_eq!(held.read::<f32>(&w)?, vec![1.0, 2.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn init_from_host_async<T: Element>(
        &self,
        ctx: &Context,
        node: &TensorNode,
        data: &[T],
    ) -> Result<ContextHandle> {
        node.check_data(T::DTYPE, data.len())?;
        if ctx.contains(node) {
            return Err(Error::AlreadyInContext {
                node: node.to_string(),
                context: ctx.id(),
            });
        }
        if !node.mode().is_hosted() {
            node.refine_mode(MemoryMode::Hosted(HostedKind::Unset))?;
        }
        self.host_write_async(node, data).await?;
        // The write fenced every device: this device's upload is the only pending use.
        self.note_host_array_use(ctx.device(), node);
        let addr = self.device_addr(ctx.device())?;
        let child = self
            .request(
                addr,
                InitFromHost {
                    order: self.next_order(),
                    ctx: ctx.clone(),
                    node: node.clone(),
                },
            )
            .await??;
        Ok(ContextHandle {
            sys: self.clone(),
            ctx: child,
        })
    }

    /// Moves `node` from `src` to `dst` through the coordinator; `None` when both share
    /// the buffer. Returns once both devices have recorded the operation.
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
    ) -> Result<Option<tributary::Event>> {
        block_on(self.device_to_device_async(node, src, dst, mode))
    }

    /// Async [`System::device_to_device`].
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
    /// let copy = block_on(sys.device_to_device_async(&g, &a.context(), &b.context(), MergeBufferUse::No))?;
    /// assert!(copy.is_some());
    /// assert_eq!(b.context().read::<f32>(&g)?, vec![1.0; 4]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn device_to_device_async(
        &self,
        node: &TensorNode,
        src: &Context,
        dst: &Context,
        mode: MergeBufferUse,
    ) -> Result<Option<tributary::Event>> {
        if node.mode().is_hosted() {
            // The source device uploads the node first if its buffer lags the host array
            // (a copy never reads a stale value): order that host-array transfer too.
            self.order_host_arrays(src.device(), std::iter::once(node))?;
        }
        if let MergeBufferUse::StreamingFor(routine) = &mode {
            // The consumer is scheduled by the coordinator and may upload the hosted nodes
            // it reads: order those host-array transfers like a direct `schedule`.
            self.order_host_arrays(dst.device(), hosted_reads(routine))?;
        }
        self.request(
            &self.shared.coordinator,
            DeviceToDevice {
                order: self.next_order(),
                node: node.clone(),
                src: src.clone(),
                dst: dst.clone(),
                mode,
            },
        )
        .await?
    }

    // ----- host arrays ----------------------------------------------------------------

    /// Host arrays are shared by every device, and device actors process their mailboxes
    /// independently: two transfers of one host array posted to two devices could be
    /// planned in the opposite order. Before posting an operation that may transfer the
    /// host arrays of `nodes` on `device`, wait until the device that last got such an
    /// operation for one of them has processed it (a fence), so the shared table records
    /// the transfers in program order.
    pub(crate) fn order_host_arrays<'n>(
        &self,
        device: tributary::DeviceId,
        nodes: impl Iterator<Item = &'n TensorNode>,
    ) -> Result<()> {
        let mut fence = Vec::new();
        {
            let mut last = self
                .shared
                .host_array_device
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for n in nodes {
                if let Some(prev) = last.insert(n.id(), device) {
                    if prev != device && !fence.contains(&prev) {
                        fence.push(prev);
                    }
                }
            }
        }
        for d in fence {
            let addr = self.device_addr(d)?;
            block_on(self.request(addr, Fence))?;
        }
        Ok(())
    }

    fn note_host_array_use(&self, device: tributary::DeviceId, node: &TensorNode) {
        self.shared
            .host_array_device
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.id(), device);
    }

    async fn fence_all(&self) -> Result<()> {
        for addr in &self.shared.devices {
            self.request(addr, Fence).await?;
        }
        Ok(())
    }

    fn host_table(&self) -> std::sync::MutexGuard<'_, HostTable> {
        self.shared.host.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the host value of hosted `node` (transferring the newest device value first).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// held.link(kernels::fill(&w, 5.0)?)?.schedule()?;
    /// assert_eq!(sys.host_read::<f32>(&w)?, vec![5.0, 5.0]); // the device value, transferred
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn host_read<T: Element>(&self, node: &TensorNode) -> Result<Vec<T>> {
        block_on(self.host_read_async(node))
    }

    /// Async [`System::host_read`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// sys.host_write(&w, &[1.0f32, 2.0])?;
    /// assert_eq!(block_on(sys.host_read_async::<f32>(&w))?, vec![1.0, 2.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn host_read_async<T: Element>(&self, node: &TensorNode) -> Result<Vec<T>> {
        node.check_data(T::DTYPE, node.numel())?;
        if !node.mode().is_hosted() {
            return Err(Error::NotHosted {
                node: node.to_string(),
            });
        }
        // Every earlier device operation must be in the tables before we look.
        self.fence_all().await?;
        let newer = self.host_table().record(node)?.newer_on_device();
        if let Some(copy) = newer {
            let addr = self.device_addr(copy.loc.device)?;
            self.request(
                addr,
                TransferToHost {
                    order: self.next_order(),
                    stream: copy.stream,
                    node: node.clone(),
                    loc: copy.loc.loc,
                },
            )
            .await??;
        }
        self.read_host_array(node).await
    }

    /// The host array of hosted `node` as it is now (no transfer from a device), once
    /// every pending transfer into it has completed.
    async fn read_host_array<T: Element>(&self, node: &TensorNode) -> Result<Vec<T>> {
        loop {
            let pending = self.host_table().pending_writes(node)?;
            if pending.iter().all(|e| e.is_done()) {
                for e in &pending {
                    e.wait()?; // reports a failed transfer
                }
                // Read under the lock: no new transfer into the array can be planned meanwhile.
                let bytes = self.host_table().read_bytes(node)?;
                return Ok(tributary::kernels::from_bytes(&bytes)?);
            }
            for e in pending {
                let _ = e.wait_async().await;
            }
        }
    }

    /// Writes the host value of hosted `node`; device copies re-upload before their next use.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// sys.host_write(&w, &[1.0f32, 2.0])?;
    /// assert_eq!(sys.host_read::<f32>(&w)?, vec![1.0, 2.0]);
    /// let plain = sys.node("p", DType::F32, [2]);
    /// assert!(matches!(sys.host_write(&plain, &[0f32; 2]), Err(Error::NotHosted { .. })));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn host_write<T: Element>(&self, node: &TensorNode, data: &[T]) -> Result<()> {
        block_on(self.host_write_async(node, data))
    }

    /// Async [`System::host_write`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// block_on(sys.host_write_async(&w, &[1.0f32, 2.0]))?;
    /// assert_eq!(sys.host_read::<f32>(&w)?, vec![1.0, 2.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn host_write_async<T: Element>(&self, node: &TensorNode, data: &[T]) -> Result<()> {
        node.check_data(T::DTYPE, data.len())?;
        if !node.mode().is_hosted() {
            return Err(Error::NotHosted {
                node: node.to_string(),
            });
        }
        self.fence_all().await?;
        let bytes = tributary::kernels::to_bytes(data);
        loop {
            let pending = {
                let mut host = self.host_table();
                let pending = host.begin_write(node)?;
                if pending.iter().all(|e| e.is_done()) {
                    // After the fences, later than every operation issued before.
                    host.set_order(self.next_order());
                    return host.commit_write(node, &bytes);
                }
                pending
            };
            for e in pending {
                let _ = e.wait_async().await;
            }
        }
    }

    /// Reads the value of `node` in `ctx` (any memory mode): what a routine of `ctx` would
    /// read. That is the buffer after its last write, or, for a hosted node whose buffer
    /// lags a host write, the host array (which a routine would upload first; the buffer
    /// is left as it is). [`System::read_device_raw`] shows the buffer's bytes instead.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let g = sys.node("g", DType::U8, [3]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&g, 7.0)?)?;
    /// fill.schedule()?;
    /// assert_eq!(sys.read::<u8>(fill.protocol_context(), &g)?, vec![7; 3]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn read<T: Element>(&self, ctx: &Context, node: &TensorNode) -> Result<Vec<T>> {
        block_on(self.read_async(ctx, node))
    }

    /// Async [`System::read`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let g = sys.node("g", DType::U8, [3]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&g, 7.0)?)?;
    /// fill.schedule()?;
    /// assert_eq!(block_on(sys.read_async::<u8>(fill.protocol_context(), &g))?, vec![7; 3]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub async fn read_async<T: Element>(&self, ctx: &Context, node: &TensorNode) -> Result<Vec<T>> {
        node.check_data(T::DTYPE, node.numel())?;
        if node.mode().is_hosted() {
            // The value may be the host array's: every earlier transfer into it, on any
            // device, must be in the host table first.
            self.order_host_arrays(ctx.device(), std::iter::once(node))?;
        }
        let bytes = node.size_in_bytes()? as usize;
        let into = Arc::new(AlignedBuffer::new(bytes, 64)?);
        let addr = self.device_addr(ctx.device())?;
        let read = ReadNode {
            ctx: ctx.clone(),
            node: node.clone(),
            into: into.clone(),
        };
        match self.request(addr, read).await?? {
            ReadValue::Host => self.read_host_array(node).await,
            ReadValue::Device(event) => {
                event.wait_async().await?;
                read_back(&into, bytes)
            }
        }
    }

    /// The bytes of `node`'s buffer in `ctx` as they are, after its last write, for
    /// debugging: unlike [`System::read`], a buffer lagging a host write shows its stale
    /// device value, which no routine would read.
    ///
    /// ```
    /// # use tributary::{kernels, DType, MemoryMode};
    /// # use tributary_actors::System;
    /// # let sys = System::builder().cpu_devices(1).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// let ctx = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 1.0])?;
    /// sys.host_write(&w, &[2.0f32, 2.0])?; // the device buffer now lags
    /// assert_eq!(sys.read::<f32>(&ctx, &w)?, vec![2.0, 2.0]); // what a routine would read
    /// assert_eq!(sys.read_device_raw::<f32>(&ctx, &w)?, vec![1.0, 1.0]); // the stale bytes
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn read_device_raw<T: Element>(&self, ctx: &Context, node: &TensorNode) -> Result<Vec<T>> {
        block_on(async {
            node.check_data(T::DTYPE, node.numel())?;
            let bytes = node.size_in_bytes()? as usize;
            let into = Arc::new(AlignedBuffer::new(bytes, 64)?);
            let addr = self.device_addr(ctx.device())?;
            let event = self
                .request(
                    addr,
                    ReadInto {
                        ctx: ctx.clone(),
                        node: node.clone(),
                        into: into.clone(),
                    },
                )
                .await??;
            event.wait_async().await?;
            read_back(&into, bytes)
        })
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
        // A finalize may write hosted values back to their host arrays: order it after
        // every device's earlier host-array transfers.
        block_on(self.fence_all())?;
        let addr = self.device_addr(ctx.device())?;
        block_on(self.request(
            addr,
            Finalize {
                ctx: ctx.clone(),
                order: self.next_order(),
            },
        ))?
    }

    // ----- synchronisation and reports ------------------------------------------------

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
        let addr = self.device_index(i)?;
        let events = self.request(addr, LastEvents).await?;
        let mut first = Ok(());
        for e in events {
            if let Err(err) = e.wait_async().await {
                if first.is_ok() {
                    first = Err(err);
                }
            }
        }
        self.request(addr, Sweep).await?;
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
            let addr = self.device_index(device)?;
            match self.request(addr, StreamLastEvent { stream }).await?? {
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
            for addr in &self.shared.devices {
                idle &= self.request(addr, IsIdle).await?;
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
            for addr in &self.shared.devices {
                out.push(self.request(addr, GetMemoryStats).await?);
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
            for addr in &self.shared.devices {
                out.push(self.request(addr, GetTableSizes).await?);
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
            for addr in &self.shared.devices {
                out.push(self.request(addr, DebugInfo).await?);
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

/// The elements of a host buffer that a completed device read filled.
fn read_back<T: Element>(into: &AlignedBuffer, bytes: usize) -> Result<Vec<T>> {
    // SAFETY: the copy into `into` completed (its event was awaited) and the device holds
    // no other reference to it.
    let data = unsafe { into.bytes(0, bytes) }.map_err(tributary::DeviceError::from)?;
    Ok(tributary::kernels::from_bytes(data)?)
}

/// The hosted nodes a routine reads (which it may upload before running).
pub(crate) fn hosted_reads(routine: &Routine) -> impl Iterator<Item = &TensorNode> {
    routine
        .spec()
        .params
        .iter()
        .filter(|p| p.access.reads() && p.node.mode().is_hosted())
        .map(|p| &p.node)
}

type Started = (
    Vec<Addr<DeviceActor>>,
    Vec<DeviceId>,
    Addr<Coordinator>,
    Vec<Arbiter>,
);

fn start_actors(
    config: SystemConfig,
    backend: Arc<dyn Backend>,
    host: Arc<Mutex<HostTable>>,
) -> Result<Started> {
    let streams = config.streams.streams_per_device();
    let mut devices = Vec::new();
    let mut ids = Vec::new();
    let mut arbiters = Vec::new();
    for device in backend.devices() {
        let arbiter = Arbiter::new();
        let mut timelines = Vec::new();
        let mut stream_addrs = Vec::new();
        for index in 0..streams as u32 {
            let stream = StreamId { device, index };
            let timeline = Timeline::new(stream);
            // SAFETY: `timeline` is fresh and completed only by this queue (its stream
            // actor fails events only of plans it cannot submit); the plans the stream
            // actor submits are those of the `DeviceState` made below from these timelines,
            // whose pool memory is `backend`'s `device`; every device lives on such queues.
            let queue = unsafe { backend.start_stream(stream, timeline.clone()) }?;
            let t = timeline.clone();
            stream_addrs.push(StreamActor::start_in_arbiter(
                &arbiter.handle(),
                move |_| StreamActor::new(stream, queue, t),
            ));
            timelines.push(timeline);
        }
        let mut pools = config.pools.clone();
        pools.min_alignment = pools.min_alignment.max(backend.min_alignment(device));
        let memory = tributary::backend::BackendMemory::new(backend.clone(), device);
        let state = DeviceState::new(device, timelines, pools, Box::new(memory));
        let (h, b, cap) = (host.clone(), backend.clone(), config.mailbox_capacity);
        let addr = DeviceActor::start_in_arbiter(&arbiter.handle(), move |_| {
            DeviceActor::new(state, h, b, stream_addrs, cap)
        });
        devices.push(addr);
        ids.push(device);
        arbiters.push(arbiter);
    }
    let pairs = ids.iter().copied().zip(devices.iter().cloned()).collect();
    let b = backend.clone();
    let coordinator = Coordinator::new(pairs, Arc::new(move |s, d| b.can_stream(s, d))).start();
    Ok((devices, ids, coordinator, arbiters))
}

/// A device of a running system.
#[derive(Clone)]
pub struct DeviceHandle {
    sys: System,
    index: usize,
}

impl DeviceHandle {
    /// Stream `i` of this device.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let ctx = sys.device(0).stream(1).context()?;
    /// assert_eq!(ctx.stream().index, 1);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn stream(&self, i: usize) -> StreamHandle {
        StreamHandle {
            sys: self.sys.clone(),
            device: self.index,
            index: i,
        }
    }

    /// Number of streams.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// assert_eq!(sys.device(0).stream_count(), 2);
    /// assert_eq!(sys.device(9).stream_count(), 0); // no such device
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn stream_count(&self) -> usize {
        self.sys
            .shared
            .streams
            .get(self.index)
            .copied()
            .unwrap_or(0)
    }
}

/// A stream of a running system.
#[derive(Clone)]
pub struct StreamHandle {
    sys: System,
    device: usize,
    index: usize,
}

impl StreamHandle {
    /// A new root context on this stream.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let root = sys.device(1).stream(0).context()?;
    /// assert_eq!(root.device(), tributary::DeviceId(1));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn context(&self) -> Result<ContextHandle> {
        self.sys.context(self.device, self.index)
    }
}

/// A context of a running system, with the operations that start from it.
///
/// Two types are called "context": this handle (a [`protocol::Context`](Context) plus the
/// [`System`] it lives in, so it can link, read and finalize by itself) and the protocol's
/// [`Context`] value it wraps ([`ContextHandle::protocol_context`]), which the lower-level
/// methods of [`System`] take. A handle derefs to its `Context` and is `AsRef<Context>`,
/// so it can be passed wherever a `&Context` or an `impl AsRef<Context>` is expected.
#[derive(Clone)]
pub struct ContextHandle {
    sys: System,
    ctx: Context,
}

impl ContextHandle {
    /// The protocol's context value this handle wraps.
    ///
    /// ```
    /// let sys = tributary_actors::System::builder().cpu_devices(1).spawn()?;
    /// let ctx = sys.context(0, 0)?;
    /// assert_eq!(ctx.protocol_context().device(), tributary::DeviceId(0));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn protocol_context(&self) -> &Context {
        &self.ctx
    }

    /// The protocol's context value: renamed [`ContextHandle::protocol_context`].
    #[deprecated(note = "renamed `protocol_context` (a `ContextHandle` is itself a context)")]
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Links a routine; its context is a child of this one.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// fill.schedule()?;
    /// assert_eq!(fill.context().read::<f32>(&x)?, vec![1.0; 4]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn link(&self, spec: RoutineSpec) -> Result<RoutineHandle> {
        self.sys.link(&self.ctx, spec)
    }

    /// See [`System::init_from_host`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]);
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// assert_eq!(held.read::<f32>(&w)?, vec![1.0, 2.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn init_from_host<T: Element>(
        &self,
        node: &TensorNode,
        data: &[T],
    ) -> Result<ContextHandle> {
        self.sys.init_from_host(&self.ctx, node, data)
    }

    /// See [`System::from_host`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]);
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// sys.host_write(&w, &[3.0f32, 4.0])?;
    /// held.from_host(&w)?.wait()?;
    /// assert_eq!(held.read::<f32>(&w)?, vec![3.0, 4.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn from_host(&self, node: &TensorNode) -> Result<Ticket> {
        self.sys.from_host(&self.ctx, node)
    }

    /// See [`System::to_host`].
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let w = sys.node("w", DType::F32, [2]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    /// let held = sys.context(0, 0)?.init_from_host(&w, &[1.0f32, 2.0])?;
    /// let fill = held.link(kernels::fill(&w, 4.0)?)?;
    /// fill.schedule()?;
    /// fill.context().to_host(&w)?.wait()?;
    /// assert_eq!(sys.host_read::<f32>(&w)?, vec![4.0, 4.0]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn to_host(&self, node: &TensorNode) -> Result<Ticket> {
        self.sys.to_host(&self.ctx, node)
    }

    /// Reads the value of `node` in this context: what a routine here would read (see
    /// [`System::read`]).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F64, [2]);
    /// let fill = sys.context(1, 1)?.link(kernels::fill(&x, 0.5)?)?;
    /// fill.schedule()?;
    /// assert_eq!(fill.context().read::<f64>(&x)?, vec![0.5, 0.5]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn read<T: Element>(&self, node: &TensorNode) -> Result<Vec<T>> {
        self.sys.read(&self.ctx, node)
    }

    /// The bytes of `node`'s buffer in this context as they are, stale or not (see
    /// [`System::read_device_raw`]).
    ///
    /// ```
    /// # use tributary::{kernels, DType};
    /// # use tributary_actors::System;
    /// # let sys = System::builder().cpu_devices(1).spawn()?;
    /// let x = sys.node("x", DType::F32, [2]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 0.5)?)?;
    /// fill.schedule()?;
    /// assert_eq!(fill.context().read_device_raw::<f32>(&x)?, vec![0.5, 0.5]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn read_device_raw<T: Element>(&self, node: &TensorNode) -> Result<Vec<T>> {
        self.sys.read_device_raw(&self.ctx, node)
    }

    /// Finalizes this context.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// fill.schedule()?;
    /// fill.context().finalize()?;
    /// assert!(matches!(fill.context().finalize(), Err(Error::ContextFinalized { .. })));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn finalize(&self) -> Result<()> {
        self.sys.finalize(&self.ctx)
    }
}

impl std::ops::Deref for ContextHandle {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl AsRef<Context> for ContextHandle {
    fn as_ref(&self) -> &Context {
        &self.ctx
    }
}

/// A routine's handle stands for the context it was linked into (a child of the one given
/// to `link`): the context holding what the routine wrote.
impl AsRef<Context> for RoutineHandle {
    fn as_ref(&self) -> &Context {
        self.routine.context()
    }
}

/// A linked routine of a running system.
#[derive(Clone)]
pub struct RoutineHandle {
    sys: System,
    routine: Routine,
}

impl RoutineHandle {
    /// The engine routine (for `MergeBufferUse::StreamingFor`).
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// assert_eq!(fill.routine().name(), "fill(x)");
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn routine(&self) -> &Routine {
        &self.routine
    }

    /// The protocol's context value of the routine (a child of the one it was linked
    /// into); [`RoutineHandle::context`] gives it as a handle.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// assert!(fill.protocol_context().contains(&x));
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn protocol_context(&self) -> &Context {
        self.routine.context()
    }

    /// The routine's context (a child of the one it was linked into), as a handle.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let y = sys.node("y", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// // Chain: link the next routine into the context the first one wrote.
    /// let copy = fill.context().link(kernels::copy(&y, &x)?)?;
    /// fill.schedule()?;
    /// copy.schedule()?;
    /// assert_eq!(copy.context().read::<f32>(&y)?, vec![1.0; 4]);
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn context(&self) -> ContextHandle {
        ContextHandle {
            sys: self.sys.clone(),
            ctx: self.routine.context().clone(),
        }
    }

    /// Schedules the routine; returns at once with a ticket for its event.
    ///
    /// ```
    /// # use tributary::{kernels, DType, Error, MemoryMode, MergeBufferUse};
    /// # use tributary_actors::{block_on, System};
    /// # let sys = System::builder().cpu_devices(2).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]);
    /// let fill = sys.context(0, 0)?.link(kernels::fill(&x, 1.0)?)?;
    /// let ticket = fill.schedule()?; // returns at once
    /// ticket.wait()?;
    /// assert!(ticket.event()?.is_done());
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn schedule(&self) -> Result<Ticket> {
        self.sys.schedule(&self.routine)
    }
}
