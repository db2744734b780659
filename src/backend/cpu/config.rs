//! How the CPU backend runs its streams and kernels: the pool's size, the spin window, the
//! streams that get a thread of their own, and the kernel mode. See DESIGN.md §5, "The CPU
//! worker model" and "The CPU's two kernel modes".

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{
    error::{Error, Result},
    ids::{DeviceId, StreamId},
    kernels::KernelMode,
};

/// The largest pool accepted: far beyond any core count, small enough that a typo (an
/// extra digit) is an error instead of ten thousand threads.
pub const MAX_WORKERS: usize = 1024;

/// The longest spin window accepted, in microseconds (10 ms): a worker that spins longer
/// than that before parking is a busy loop, not a wake-up optimisation.
pub const MAX_SPIN_US: u64 = 10_000;

/// Configuration of the CPU backend's streams and built-in kernels (serde: every field
/// optional; TOML `[cpu]` in a `SystemConfig`, e.g. `workers = 4`, `spin_us = 20`,
/// `dedicated_streams = [{ device = 0, index = 2 }]`, `kernel_mode = "exact"`).
///
/// Streams are multiplexed on a pool of `workers` threads shared by every device of the
/// backend; a worker that runs out of work, or whose stream waits for a dependency,
/// spins for `spin_us` before it parks. A stream listed in `dedicated_streams` gets a
/// thread of its own (a pool of one), for kernels that block (a network stream whose
/// operations wait on a communication thread) and must not hold a shared worker.
///
/// ```
/// use std::time::Duration;
/// use tributary::{backend::cpu::{CpuBackend, CpuConfig}, DeviceId, StreamId};
///
/// let config = CpuConfig::default()
///     .with_workers(4)
///     .with_spin(Duration::from_micros(20))
///     .with_dedicated_stream(StreamId { device: DeviceId(0), index: 1 });
/// let backend = CpuBackend::with_config(DeviceId(0), 2, config)?;
/// # Ok::<(), tributary::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
#[serde(default, deny_unknown_fields)]
pub struct CpuConfig {
    /// Worker threads shared by the streams; 0 (the default): one per available core
    /// (`std::thread::available_parallelism`).
    pub workers: usize,
    /// How long a worker spins for its next plan, or for the dependency its stream waits
    /// on, before it parks, in microseconds (default 50; 0: park at once).
    pub spin_us: u64,
    /// Streams that run on a thread of their own instead of the shared pool.
    pub dedicated_streams: Vec<StreamId>,
    /// How the built-ins order their floating-point sums: `fast` (the default, blocked
    /// matmuls) or `exact` (the order the Vulkan and CUDA backends reproduce bit for bit).
    pub kernel_mode: KernelMode,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            workers: 0,
            spin_us: 50,
            dedicated_streams: Vec::new(),
            kernel_mode: KernelMode::Fast,
        }
    }
}

impl CpuConfig {
    /// Sets [`CpuConfig::workers`] (0: one per available core).
    pub fn with_workers(mut self, workers: usize) -> CpuConfig {
        self.workers = workers;
        self
    }

    /// Sets the spin window ([`CpuConfig::spin_us`], rounded down to microseconds).
    pub fn with_spin(mut self, window: Duration) -> CpuConfig {
        self.spin_us = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        self
    }

    /// Gives `stream` a thread of its own ([`CpuConfig::dedicated_streams`]).
    pub fn with_dedicated_stream(mut self, stream: StreamId) -> CpuConfig {
        if !self.dedicated_streams.contains(&stream) {
            self.dedicated_streams.push(stream);
        }
        self
    }

    /// Sets [`CpuConfig::kernel_mode`].
    pub fn with_kernel_mode(mut self, mode: KernelMode) -> CpuConfig {
        self.kernel_mode = mode;
        self
    }

    /// The spin window.
    pub fn spin(&self) -> Duration {
        Duration::from_micros(self.spin_us)
    }

    /// Whether `stream` runs on a thread of its own.
    pub fn is_dedicated(&self, stream: StreamId) -> bool {
        self.dedicated_streams.contains(&stream)
    }

    /// The number of shared workers: [`CpuConfig::workers`], or one per available core.
    pub fn worker_count(&self) -> usize {
        if self.workers > 0 {
            return self.workers;
        }
        #[cfg(tributary_loom)]
        return 1;
        #[cfg(not(tributary_loom))]
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }

    /// [`Error::InvalidConfig`] naming the setting and its value unless the configuration
    /// is usable by a backend with `devices`: at most [`MAX_WORKERS`] workers, a spin
    /// window of at most [`MAX_SPIN_US`], dedicated streams on those devices.
    pub fn validate(&self, devices: &[DeviceId]) -> Result<()> {
        if self.workers > MAX_WORKERS {
            return Err(Error::InvalidConfig {
                setting: "cpu.workers".into(),
                value: self.workers.to_string(),
                reason: format!("at most {MAX_WORKERS} worker threads (0: one per core)"),
            });
        }
        if self.spin_us > MAX_SPIN_US {
            return Err(Error::InvalidConfig {
                setting: "cpu.spin_us".into(),
                value: self.spin_us.to_string(),
                reason: format!(
                    "a spin window of at most {MAX_SPIN_US} µs (a longer one is a busy loop)"
                ),
            });
        }
        if let Some(stream) = self
            .dedicated_streams
            .iter()
            .find(|s| !devices.contains(&s.device))
        {
            return Err(Error::InvalidConfig {
                setting: "cpu.dedicated_streams".into(),
                value: stream.to_string(),
                reason: format!("not a stream of this backend's devices {devices:?}"),
            });
        }
        Ok(())
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;

    fn sid(device: u32, index: u32) -> StreamId {
        StreamId {
            device: DeviceId(device),
            index,
        }
    }

    #[test]
    fn defaults_and_setters() {
        let c = CpuConfig::default();
        assert_eq!((c.workers, c.spin_us), (0, 50));
        assert!(c.worker_count() >= 1);
        assert_eq!(c.spin(), Duration::from_micros(50));
        let c = c
            .with_workers(3)
            .with_spin(Duration::from_nanos(2_500))
            .with_dedicated_stream(sid(0, 1))
            .with_dedicated_stream(sid(0, 1));
        assert_eq!(c.worker_count(), 3);
        assert_eq!(c.spin_us, 2);
        assert_eq!(c.dedicated_streams, vec![sid(0, 1)]);
        assert!(c.is_dedicated(sid(0, 1)) && !c.is_dedicated(sid(0, 0)));
    }

    #[test]
    fn bad_values_are_typed_errors_naming_them() {
        let devices = [DeviceId(0), DeviceId(1)];
        assert_eq!(CpuConfig::default().validate(&devices), Ok(()));
        let cases = [
            (
                CpuConfig::default().with_workers(MAX_WORKERS + 1),
                "cpu.workers",
                (MAX_WORKERS + 1).to_string(),
            ),
            (
                CpuConfig::default().with_spin(Duration::from_secs(1)),
                "cpu.spin_us",
                "1000000".to_string(),
            ),
            (
                CpuConfig::default().with_dedicated_stream(sid(2, 0)),
                "cpu.dedicated_streams",
                sid(2, 0).to_string(),
            ),
        ];
        for (config, setting, value) in cases {
            match config.validate(&devices) {
                Err(Error::InvalidConfig {
                    setting: s,
                    value: v,
                    ..
                }) => assert_eq!((s.as_str(), v), (setting, value)),
                other => panic!("{setting}: expected InvalidConfig, got {other:?}"),
            }
        }
    }

    #[test]
    fn serde_round_trip_with_defaults() {
        let c: CpuConfig = serde_json::from_str(r#"{ "workers": 2 }"#).unwrap();
        assert_eq!(c, CpuConfig::default().with_workers(2));
        let c = CpuConfig::default()
            .with_spin(Duration::from_micros(7))
            .with_dedicated_stream(sid(1, 3));
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<CpuConfig>(&json).unwrap(), c);
        assert!(serde_json::from_str::<CpuConfig>(r#"{ "threads": 2 }"#).is_err());
        let c: CpuConfig = serde_json::from_str(r#"{ "kernel_mode": "exact" }"#).unwrap();
        assert_eq!(c, CpuConfig::default().with_kernel_mode(KernelMode::Exact));
        assert_eq!(CpuConfig::default().kernel_mode, KernelMode::Fast);
        let err = serde_json::from_str::<CpuConfig>(r#"{ "kernel_mode": "quick" }"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("quick") && err.contains("exact"), "{err}");
    }
}
