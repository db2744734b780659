//! Configuration of a [`crate::System`]: devices, streams, pools, mailboxes and the backend.
//! It is read from TOML or JSON, or built with [`SystemBuilder`].

use std::{path::Path, sync::Arc};

use serde::{Deserialize, Serialize};
use tributary::{
    backend::{cpu::CpuConfig, Backend, BackendKind},
    memory::PoolConfig,
    Error, Result,
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

/// Configuration of a [`System`](crate::System), serde-deserialisable (TOML or JSON).
///
/// New settings may be added in minor releases (`#[non_exhaustive]`): build one with
/// [`System::builder`](crate::System::builder), from a document ([`SystemConfig::from_toml_str`]), or from
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
    /// Record a timeline of every operation and wait (see [`System::timeline`](crate::System::timeline)).
    pub record_timeline: bool,
    /// Which backend runs the devices (default: `Cpu`, with `cpu_devices` devices).
    pub backend: BackendKind,
    /// How the CPU backend runs its streams and built-ins (TOML `[cpu]`: `workers`,
    /// `spin_us`, `dedicated_streams`, `kernel_mode`); ignored by other backends.
    pub cpu: CpuConfig,
    /// A host call that finds a device actor idle decides its operations on the calling
    /// thread, holding the actor's turn, instead of waking the actor's thread (default
    /// `true`; DESIGN.md §4 "Who decides"). Decisions and their order are the same either
    /// way; `false` keeps every decision on the actors' arbiters (a wake-up per call into
    /// an idle device).
    pub decide_on_posting_thread: bool,
    /// The dispatcher recognises a repeated sequence of schedules and copies and replays it
    /// without a capture call (TOML `auto_replay`; DESIGN.md §4, "Automatic replay"; see
    /// [`System::replay_stats`](crate::System::replay_stats)).
    pub auto_replay: bool,
}

/// Whether [`SystemConfig::auto_replay`] is on by default.
pub const AUTO_REPLAY_DEFAULT: bool = false;

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
            decide_on_posting_thread: true,
            auto_replay: AUTO_REPLAY_DEFAULT,
        }
    }
}

impl SystemConfig {
    /// Parses a TOML document; [`Error::ConfigParse`] with the parser's message otherwise.
    ///
    /// ```
    /// use tributary_actors::SystemConfig;
    /// let c = SystemConfig::from_toml_str("cpu_devices = 3")?;
    /// let exact = SystemConfig::from_toml_str("[cpu]\nkernel_mode = \"exact\"")?;
    /// assert_eq!(exact.cpu.kernel_mode, tributary::kernels::KernelMode::Exact);
    /// assert!(SystemConfig::from_toml_str("[cpu]\nkernel_mode = \"quick\"").is_err());
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

/// Builds a [`System`](crate::System).
#[derive(Clone, Default)]
pub struct SystemBuilder {
    pub(crate) config: SystemConfig,
    /// A backend made by the caller, used instead of creating `config.backend`.
    pub(crate) instance: Option<Arc<dyn Backend>>,
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

    /// Whether a host call into an idle device decides on the calling thread (default) or
    /// wakes the device actor's thread ([`SystemConfig::decide_on_posting_thread`]).
    ///
    /// ```
    /// let sys = tributary_actors::System::builder()
    ///     .decide_on_posting_thread(false)
    ///     .spawn()?;
    /// assert!(!sys.config().decide_on_posting_thread);
    /// sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn decide_on_posting_thread(mut self, on: bool) -> Self {
        self.config.decide_on_posting_thread = on;
        self
    }

    /// Turns the automatic replay on or off ([`SystemConfig::auto_replay`]): a period of
    /// calls seen three times in a row is captured, then replayed while it repeats.
    ///
    /// ```
    /// use tributary::{kernels, DType, MemoryMode};
    /// let sys = tributary_actors::System::builder().cpu_devices(1).auto_replay(true).spawn()?;
    /// let x = sys.node("x", DType::F32, [4]).with_mode(MemoryMode::on_device())?;
    /// let ctx = sys.context(0, 0)?;
    /// let fill = ctx.link(kernels::fill(&x, 1.0)?)?;
    /// let double = fill.context().link(kernels::scale_in_place(&x, 2.0)?)?;
    /// // A period of two calls, seen three times, is learned as 32 of them (at least
    /// // `MIN_PERIOD`, 64 calls): captured the next 32 times, replayed the 32 after.
    /// for _ in 0..3 + 32 + 32 {
    ///     fill.schedule()?;
    ///     double.schedule()?;
    /// }
    /// let stats = sys.replay_stats();
    /// assert_eq!((stats.periods, stats.replays, stats.calls_replayed), (1, 1, 64));
    /// assert_eq!(double.context().read::<f32>(&x)?, vec![2.0; 4]);
    /// // The same key in a configuration file:
    /// let config = tributary_actors::SystemConfig::from_toml_str("auto_replay = true")?;
    /// assert!(config.auto_replay);
    /// assert!(tributary_actors::SystemConfig::from_toml_str("auto_replay = 1").is_err());
    /// # sys.shutdown()?;
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn auto_replay(mut self, on: bool) -> Self {
        self.config.auto_replay = on;
        self
    }

    /// Records a timeline of every operation and wait, for [`System::timeline`](crate::System::timeline).
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
}
