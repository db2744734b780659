//! The CUDA backend on cudarc (feature `cuda`): devices are `CudaContext`s, streams are
//! non-blocking CUDA streams, pools are device allocations, kernels are CUDA C compiled by
//! NVRTC (built-ins) or user CUDA C / PTX.
//!
//! Built with the `cuda` cargo feature (cudarc with `dynamic-loading`: building needs no
//! CUDA toolkit, and the driver library is opened at run time). Without the feature the
//! types of this module still exist and [`CudaBackend::new`] returns
//! [`DeviceError::Unavailable`], so configuration and tests need no `cfg`.
//!
//! # Internals
//!
//! **Discovery.** cudarc opens `libcuda` lazily and *panics* on the first call when it is
//! missing, so before any driver call the backend asks cudarc whether the library loads
//! (`is_culib_present`), then reads the driver's CUDA version (`cuDriverGetVersion`, which
//! needs no `cuInit`), then initialises the driver and counts devices. No library, a driver
//! older than CUDA [`MIN_DRIVER_VERSION`], no device, or a failing `cuInit` is
//! [`DeviceError::Unavailable`] saying which ([`probe`]); the calls also run under
//! `catch_unwind`, so a library lacking a symbol is an error too (unless the binary is built
//! with `panic = "abort"`). NVRTC is probed the same way, but its absence only disables
//! compiling CUDA C: PTX still loads.
//!
//! **Devices.** One tributary device is one `CudaContext`. [`CudaConfig::devices`] may ask
//! for more logical devices than there are GPUs: they are assigned round-robin over
//! [`CudaConfig::gpus`]; the first logical device of a GPU uses its primary context, every
//! further one its own (non-primary) context, so two logical devices on one GPU have
//! separate memory, streams and modules, as two GPUs would: that is how tests emulate a
//! multi-GPU machine with one GPU. At start-up the backend tries to enable peer access
//! (`cuCtxEnablePeerAccess`) from every context to every other where
//! `cuDeviceCanAccessPeer` allows it, or where both are on the same GPU; what succeeded is
//! the peer table behind [`Backend::can_stream`] and the copy routes.
//!
//! **Streams.** Each tributary stream is a non-blocking CUDA stream (no implicit ordering
//! with the legacy default stream) with two threads that belong to no actor:
//!
//! - the *submit thread* takes plans in order. A dependency on another stream of the same
//!   device becomes `cuStreamWaitEvent` on the CUDA event that stream recorded for that
//!   sequence number (no host round trip). A dependency on another device or backend is
//!   waited for on the host, on this thread (waits only point to earlier events, so they
//!   cannot deadlock). It then enqueues the work, records one pooled event (timing
//!   disabled) after it, and hands the sequence number to the watcher;
//! - the *watcher thread* synchronises those events in order (`cuEventSynchronize`) and
//!   signals or fails the tributary [`Timeline`], after finishing what the host still owes
//!   the work (copying a device-to-host transfer out of its staging slot), and drops what
//!   the work kept alive (pools, modules, staging slots, events).
//!
//! **Failures without running the work.** As on Vulkan, every stream publishes the
//! *decision* it took for each sequence number (its recorded event, or the root cause it
//! failed with) before that number can complete. A stream that depends on another stream
//! of the same device waits (on the host, briefly) for that decision: a failed data
//! dependency fails the plan at once, without enqueueing its work, and otherwise the wait
//! is enqueued on the GPU. A failed plan still enqueues the waits for all its dependencies
//! and records its event, so it completes only after them. Failures are decided on the
//! host (an unsupported kernel, a program that does not compile, an unresolvable buffer, a
//! failed dependency); enqueued work fails only by a CUDA error (an illegal address in a
//! user kernel, a lost device), which CUDA makes sticky for the whole context: the device
//! is then marked lost and every later plan on it fails with that cause.
//!
//! **Memory.** A pool is one device allocation (`cuMemAlloc`); a location `{pool, offset}`
//! resolves to `base + offset` inside the backend only, when the plan is submitted, and the
//! resolved work holds the pool until its completion, so releasing a pool never frees
//! memory under running work. Host transfers go through each stream's *staging ring*: one
//! pinned, portable host allocation ([`CudaConfig::staging_bytes`], made on the first
//! transfer and reused for all later ones). A transfer is cut into slots of at most a
//! quarter of the ring; each slot is reused only after the event of the copy that used it
//! completed (the watcher releases slots in order; a full ring makes the submit thread wait
//! for the oldest). Host-to-device: the host array is copied into the slot on the submit
//! thread (after all dependencies completed, as the host array may be written by an earlier
//! device-to-host transfer), then `cuMemcpyHtoDAsync`. Device-to-host: `cuMemcpyDtoHAsync`
//! into the slot, and the watcher copies the slot into the host array before completing.
//!
//! **Copies.** Memset is `cuMemsetD8Async`. A copy inside one device (or between devices
//! sharing a context) is `cuMemcpyDtoDAsync`; between contexts with peer access, or two
//! contexts of one GPU (the driver refuses them peer access, yet copies between them on the
//! GPU), it is `cuMemcpyPeerAsync`; otherwise ([`CudaConfig::force_staging`] forces it, to test that
//! path where peer access exists) it is staged: after every dependency and this stream's
//! earlier work completed, each slot is downloaded from the source context and uploaded to
//! the destination context with synchronous copies on the submit thread. `StreamingFor`
//! (a kernel reading another device's buffer in place) is allowed where the destination
//! can address the source: same context, or peer access enabled.
//!
//! **Kernels** ([`kernels`]). A kernel becomes a list of [`kernels::Launch`]es (program,
//! entry point, grid, block, dynamic shared memory, ordered parameters) computed without a
//! driver by [`kernels::kernel_launches`] from the bindings and the device's limits; the
//! stream resolves each `Buffer(i)` parameter to argument `i`'s `base + offset` (and
//! `Merge` to the merge buffer's), compiles each program with NVRTC for the device's
//! `compute_XY` once per device (the built-ins are one CUDA C program per dtype; PTX loads
//! as it is), keeps the module and its entry points, and launches with `cuLaunchKernel`.
//! [`Kernel::Cpu`](crate::kernels::Kernel::Cpu) closures and WGSL/SPIR-V shaders cannot run
//! here: [`Backend::check_routine`] refuses them at link time. `tests/cuda_kernels.rs`
//! compiles every program with NVRTC and assembles it with `ptxas` for `sm_80` and `sm_90`
//! where those tools are installed (CI installs them).
//!
//! **Timelines.** With a [`Recorder`](crate::trace::Recorder)
//! ([`CudaBackend::with_recorder`]) streams record as Vulkan's do (the shared
//! `backend::recording`): waits on the host as waits; each operation as work from when the
//! submit thread started it (or the previous operation was seen done) to when the watcher
//! saw it complete; and a wait on another stream of the device that was still running as a
//! wait from when the stream was ready to when the producer was seen done. Events have
//! timing disabled, so these are the host's view, within a wake-up of the GPU's.
//!
//! **Not done (yet).** Host transfers from the user's memory go through the ring (one
//! extra `memcpy`); registering host arrays (`cuMemHostRegister`) would skip it.

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
    /// own context, emulate a multi-GPU machine).
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
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            devices: None,
            gpus: None,
            force_staging: false,
            staging_bytes: DEFAULT_STAGING_BYTES,
            spin_us: DEFAULT_SPIN_US,
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
