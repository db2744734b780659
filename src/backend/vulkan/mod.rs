//! The Vulkan backend: devices are `VkDevice`s, streams are submission chains ordered by
//! timeline semaphores, pools are gpu-allocator buffers, and kernels are WGSL or SPIR-V. Its
//! design is in DESIGN.md §5, "Vulkan". This doc holds what the code relies on beyond it.
//!
//! Without the `vulkan` cargo feature the types still exist and [`VulkanBackend::new`]
//! returns [`DeviceError::Unavailable`], so configuration and tests need no `cfg`.
//!
//! # Devices and streams
//!
//! A usable device needs Vulkan 1.2, a compute queue, timeline semaphores and
//! `VK_KHR_push_descriptor`; [`probe`] says what is missing. Logical devices are assigned
//! round-robin over the physical ones and share nothing but the instance. That is how the
//! tests emulate two GPUs on the one `llvmpipe` device of Mesa's lavapipe.
//!
//! The streams of a device share its queue, behind a mutex around `vkQueueSubmit`. lavapipe
//! exposes one queue, and real GPUs have few. The batch of event `n` signals `n` and waits
//! for the stream's previous value, so a stream stays FIFO even where the queue overlaps
//! batches. lavapipe runs batches one after another, so the tests exercise the semaphore
//! waits but cannot show a missing one.
//!
//! A plan that fails on the host still submits an empty batch. It waits for all the plan's
//! dependencies and signals its value, so it completes after them and every chain keeps
//! moving. Submitted work fails only when the device is lost.
//!
//! # Memory and transfers
//!
//! A pool is one `VkBuffer` with its own `GpuOnly` allocation. Where that memory is
//! host-visible and coherent, as on lavapipe, host transfers read and write it directly.
//! Elsewhere they go through staging buffers. [`VulkanConfig::force_staging`] forces that
//! route, so the lavapipe tests cover it. Every command buffer ends with a barrier that
//! makes its writes visible to the host.
//!
//! Memset is `vkCmdFillBuffer`, and a copy on one device is `vkCmdCopyBuffer`. Work that
//! touches the host runs on the submit thread after its dependencies and the stream's
//! earlier work completed. An empty batch then signals its value, and the queue submission
//! makes the host writes visible to the device. [`VulkanBackend::leaked_objects`] counts
//! what a lost device left behind. [`VulkanBackend::inject_wait_fault`] makes a device stuck
//! or lost, for tests.
//!
//! # Kernels
//!
//! Buffers are bound with `VK_KHR_push_descriptor` at their offsets, which must be multiples
//! of `minStorageBufferOffsetAlignment`. The backend reports it through
//! [`Backend::min_alignment`], pool owners align to it, and a misaligned binding fails its
//! plan. `f64` needs `shaderFloat64`. A user shader binds its parameters at `0..n` and the
//! merge buffer at `n`. [`crate::kernels::ShaderKernel`] gives its push-constant layout.
//!
//! # Results against the CPU's exact mode
//!
//! Fills, copies, memset and the integer kernels are bitwise equal. The float element-wise
//! kernels, matmuls and `sum_rows` do the same operations in the same order and precision.
//! They are bitwise equal on lavapipe. A driver that fuses multiply-adds or flushes denormals
//! may differ in the last bits; for sums, relative to the sum of the terms' magnitudes.
//!
//! `softmax_xent` uses the driver's `exp` and `log` for `f32`, `f16` and `bf16`. For `f64` it
//! uses polynomials written in WGSL, because `GLSL.std.450` has no 64-bit `Exp` or `Log`. It
//! is within `1e-5` relative for `f32`, `1e-12` for `f64`, and one unit in the last place for
//! `f16` and `bf16`. Its loss sums per-row values in row order, as the CPU does.
//!
//! # Limits
//!
//! A kernel binding is at most `maxStorageBufferRange` bytes, 128 MiB on lavapipe. Larger
//! buffers can be copied, filled and transferred, but a kernel over one fails with a message.
//! lavapipe's compiler silently stops an invocation after 65 535 loop iterations in all. The
//! backend knows this driver and fails any built-in dispatch that would need more, such as a
//! `sum_rows` over about 65 000 rows, rather than return truncated results. User shaders are
//! not checked.
//!
//! Not done yet: importing one host allocation into several devices with
//! `VK_EXT_external_memory_host`; a staging ring instead of a buffer per transfer; a pipeline
//! cache on disk. lavapipe compiles a pipeline on its first dispatch, in 35-80 ms.

use std::time::Duration;

use serde::{Deserialize, Serialize};

#[cfg(feature = "vulkan")]
mod conv;
#[cfg(feature = "vulkan")]
mod device;
#[cfg(feature = "vulkan")]
use device as imp;
#[cfg(feature = "vulkan")]
mod instance;
#[cfg(feature = "vulkan")]
mod kernels;
#[cfg(feature = "vulkan")]
mod memory;
#[cfg(feature = "vulkan")]
mod shaders;
#[cfg(feature = "vulkan")]
mod stream;

#[cfg(not(feature = "vulkan"))]
mod disabled;
#[cfg(not(feature = "vulkan"))]
use disabled as imp;

use crate::error::DeviceError;
#[allow(unused_imports)] // referenced by the module documentation
use crate::{backend::Backend, event::Timeline};

pub use imp::{probe, VulkanBackend};

/// Configuration of the Vulkan backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VulkanConfig {
    /// Number of logical devices. `None`: one per suitable physical device. `Some(n)`:
    /// `n` logical devices assigned round-robin to the physical devices (several logical
    /// devices on one physical device emulate a multi-GPU machine).
    pub devices: Option<usize>,
    /// Never touch pool memory from the host even where it is mapped: host transfers and
    /// cross-device copies go through staging buffers, as on a discrete GPU.
    pub force_staging: bool,
    /// The longest one wait for submitted device work may block (default 60 s; serde: `{
    /// secs, nanos }`). Past it the device counts as lost: the waiting operation and every
    /// later one of the device fail with [`DeviceError::Lost`] ("timed out ..."), their
    /// dependents with that root cause, and what the device might still use is leaked,
    /// never freed (see the module documentation). A wait covers one batch for the
    /// completion thread, but a host transfer first waits for everything its stream queued
    /// before it: set the deadline above the longest such backlog.
    pub device_timeout: Duration,
}

impl Default for VulkanConfig {
    fn default() -> Self {
        VulkanConfig {
            devices: None,
            force_staging: false,
            device_timeout: DEFAULT_DEVICE_TIMEOUT,
        }
    }
}

/// [`VulkanConfig::device_timeout`] by default.
pub const DEFAULT_DEVICE_TIMEOUT: Duration = Duration::from_secs(60);

impl VulkanConfig {
    /// `n` logical devices (see [`VulkanConfig::devices`]).
    pub fn with_devices(n: usize) -> Self {
        VulkanConfig {
            devices: Some(n),
            ..VulkanConfig::default()
        }
    }
}

/// A failure injected into the waits of one device
/// ([`VulkanBackend::inject_wait_fault`]), to test what a hung or lost GPU does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitFault {
    /// From now on every wait on the device (timeline semaphores, fences) reports
    /// `VK_TIMEOUT` after blocking for its slice, as a device that stopped answering
    /// would: after [`VulkanConfig::device_timeout`] the device is lost.
    Stuck,
    /// The next wait on the device reports `VK_ERROR_DEVICE_LOST`.
    Lost,
}

/// How the operations of replayed steps ran on a Vulkan backend's streams
/// ([`VulkanBackend::replay_counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VulkanReplayCounts {
    /// Recorded into a command buffer kept for the step's next replays (a first replay, or
    /// new buffers or index values).
    pub recorded: u64,
    /// Resubmitted from a kept command buffer.
    pub resubmitted: u64,
    /// Run as plans, one by one: host transfers, copies between devices, operations whose
    /// input failed or that wait for another device.
    pub as_plans: u64,
}

/// What [`probe`] found: the physical devices a backend would use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VulkanInfo {
    /// Instance API version, as `major.minor.patch`.
    pub api_version: String,
    /// Names of the suitable physical devices (e.g. `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub devices: Vec<String>,
}

#[allow(dead_code)] // used by the disabled build only
fn not_built() -> DeviceError {
    DeviceError::Unavailable("tributary was built without the `vulkan` cargo feature".into())
}
