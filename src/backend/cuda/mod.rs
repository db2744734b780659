//! The CUDA backend on cudarc: devices are `CudaContext`s, streams are non-blocking CUDA
//! streams, pools are device allocations, and kernels are CUDA C compiled by NVRTC, or PTX.
//! Its design is in DESIGN.md §5, "CUDA". Without the `cuda` cargo feature the types still
//! exist and [`CudaBackend::new`] returns [`DeviceError::Unavailable`], so configuration and
//! tests need no `cfg`.
//!
//! The facts below are not in DESIGN.md:
//!
//! - Discovery never lets cudarc panic; see [`probe`] and `instance.rs`. Without NVRTC,
//!   CUDA C cannot be compiled, but PTX still loads.
//! - At start-up the backend enables peer access wherever the driver allows it. The result
//!   is the peer table behind [`Backend::can_stream`] and the copy routes.
//! - A plan that fails on the host still enqueues the waits for all its dependencies and
//!   records its event, so it completes only after them.
//! - Resolved work holds its pools, modules, staging slots and events until the watcher
//!   sees it complete.
//! - [`CudaConfig::force_staging`] forces the staged copy route, to test it where peer
//!   access exists.
//! - [`CudaConfig::share_context`] puts all logical devices of one GPU in its primary
//!   context: no context switch at their hand-offs, and they address each other's memory.
//! - A backend whose streams were stopped with a deadline destroys its contexts on a thread
//!   of its own, waited for until that deadline (`gpu_stream::drop_by`): destroying a
//!   context waits until the GPU is idle.
//! - Events have timing disabled. So the times a [`crate::trace::Recorder`] gets are the
//!   host's view, within a wake-up of the GPU's.
//!
//! Not done yet: host transfers go through the staging ring, which costs one extra
//! `memcpy`. Registering host arrays with `cuMemHostRegister` would skip it.

use serde::{Deserialize, Serialize};

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod events;
pub mod kernels;
#[cfg(feature = "cuda")]
use device as imp;
#[cfg(feature = "cuda")]
mod instance;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod stream;

#[cfg(not(feature = "cuda"))]
mod disabled;
#[cfg(not(feature = "cuda"))]
use disabled as imp;

use crate::error::DeviceError;
#[allow(unused_imports)] // referenced by the module documentation
use crate::{backend::Backend, event::Timeline};

pub use imp::{probe, CudaBackend};

/// The oldest CUDA driver the backend accepts, as `cuDriverGetVersion` reports it
/// (`1000 * major + 10 * minor`): CUDA 12.0.
pub const MIN_DRIVER_VERSION: i32 = 12_000;

/// Default size of each stream's pinned staging ring, in bytes.
pub const DEFAULT_STAGING_BYTES: u64 = 16 << 20;

/// Default spin window of a stream's threads, in microseconds ([`CudaConfig::spin_us`]).
pub const DEFAULT_SPIN_US: u64 = 50;

/// Configuration of the CUDA backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CudaConfig {
    /// Number of logical devices. `None`: one per GPU used. `Some(n)`: `n` logical devices
    /// assigned round-robin to the GPUs (several logical devices on one GPU, each with its
    /// own context unless [`share_context`](CudaConfig::share_context), emulate a multi-GPU
    /// machine).
    pub devices: Option<usize>,
    /// Which GPUs (CUDA device ordinals) to use. `None`: all of them.
    pub gpus: Option<Vec<usize>>,
    /// Stage every copy between two devices through pinned host memory, even where peer
    /// access is enabled (to test that path on a machine where it would not be taken).
    pub force_staging: bool,
    /// Size of each stream's pinned staging ring for host transfers, in bytes.
    pub staging_bytes: u64,
    /// How long a stream's submit and watcher threads poll for their next item before
    /// parking, in microseconds (0: park at once; at most
    /// [`MAX_SPIN_US`](crate::backend::cpu::MAX_SPIN_US)). Spinning saves a thread wake-up
    /// per operation while work keeps coming, at the cost of that much CPU after the last.
    pub spin_us: u64,
    /// Run a replay's consecutive device operations as a CUDA graph captured at the step's
    /// first replay and launched again by the later ones (DESIGN.md §5, "CUDA"); `false`:
    /// every replayed operation runs as a plan.
    pub replay_graphs: bool,
    /// Put every logical device of one GPU in the GPU's primary context instead of a
    /// context of its own per further device. The GPU switches contexts at every hand-off
    /// between two contexts (about 140 µs on an H100, where a 2-device all-reduce on one
    /// GPU ran 10x faster with a shared context); in one context a kernel of one device
    /// reads another's memory in place ([`Backend::can_stream`]) and copies between them
    /// are device-to-device. `false` (the default) keeps the devices apart, as separate
    /// GPUs would be. The test harness sets it from `TRIBUTARY_CUDA_SHARE_CONTEXT=1`.
    pub share_context: bool,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            devices: None,
            gpus: None,
            force_staging: false,
            staging_bytes: DEFAULT_STAGING_BYTES,
            spin_us: DEFAULT_SPIN_US,
            replay_graphs: true,
            share_context: false,
        }
    }
}

impl CudaConfig {
    /// `n` logical devices (see [`CudaConfig::devices`]).
    pub fn with_devices(n: usize) -> Self {
        CudaConfig {
            devices: Some(n),
            ..CudaConfig::default()
        }
    }
}

/// What [`probe`] found: the driver and the GPUs a backend would use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaInfo {
    /// The CUDA version the driver supports, as `major.minor`.
    pub driver_version: String,
    /// Names of the GPUs, by ordinal (e.g. `NVIDIA H100 80GB HBM3`).
    pub devices: Vec<String>,
    /// Whether the NVRTC library loads (needed to compile CUDA C; PTX loads without it).
    pub nvrtc: bool,
}

#[allow(dead_code)] // used by the disabled build only
fn not_built() -> DeviceError {
    DeviceError::Unavailable("tributary was built without the `cuda` cargo feature".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendKind;

    #[test]
    fn config_reads_from_json_with_defaults_and_refuses_unknown_fields() {
        let kind: BackendKind =
            serde_json::from_str(r#"{ "Cuda": { "devices": 2, "force_staging": true } }"#)
                .expect("a CUDA configuration");
        let BackendKind::Cuda(config) = kind else {
            panic!("not CUDA: {kind:?}");
        };
        assert_eq!(config.devices, Some(2));
        assert!(config.force_staging);
        assert_eq!(config.gpus, None);
        assert_eq!(config.staging_bytes, DEFAULT_STAGING_BYTES);
        assert_eq!(config.spin_us, DEFAULT_SPIN_US);
        assert!(config.replay_graphs, "replays run as graphs by default");
        assert!(
            !config.share_context,
            "a context per logical device by default"
        );
        let kind: BackendKind =
            serde_json::from_str(r#"{ "Cuda": { "share_context": true } }"#).expect("a config");
        assert!(matches!(kind, BackendKind::Cuda(c) if c.share_context));
        let kind: BackendKind =
            serde_json::from_str(r#"{ "Cuda": { "replay_graphs": false } }"#).expect("a config");
        assert!(matches!(kind, BackendKind::Cuda(c) if !c.replay_graphs));
        let err = serde_json::from_str::<BackendKind>(r#"{ "Cuda": { "device": 2 } }"#)
            .expect_err("a misspelt field");
        assert!(err.to_string().contains("device"), "{err}");
        assert_eq!(CudaConfig::with_devices(3).devices, Some(3));
    }

    /// A spin window above the limit is refused before any driver call, naming the value
    /// (so this runs without a GPU).
    #[cfg(feature = "cuda")]
    #[test]
    fn an_overlong_spin_window_is_refused() {
        let too_long = crate::backend::cpu::MAX_SPIN_US + 1;
        let config = CudaConfig {
            spin_us: too_long,
            ..CudaConfig::default()
        };
        match CudaBackend::new(crate::DeviceId(0), config) {
            Err(DeviceError::Unexpected(why)) => {
                assert!(why.contains(&format!("spin_us = {too_long}")), "{why}")
            }
            Err(other) => panic!("another error: {other}"),
            Ok(_) => panic!("an overlong spin window was accepted"),
        }
    }
}
