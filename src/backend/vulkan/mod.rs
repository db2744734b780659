//! The Vulkan backend: devices are `VkDevice`s, streams are submission chains ordered by
//! timeline semaphores, pools are gpu-allocator allocations of `VkBuffer`s, kernels are
//! WGSL compiled to SPIR-V by naga (built-ins) or user WGSL / SPIR-V.
//!
//! Built with the `vulkan` cargo feature (ash, gpu-allocator, naga). Without it the types of
//! this module still exist and [`VulkanBackend::new`] returns
//! [`DeviceError::Unavailable`], so configuration and tests need no `cfg`.
//!
//! # Internals
//!
//! **Discovery.** `ash::Entry::load` opens the Vulkan loader at run time; a missing loader
//! or driver, an instance older than 1.2, or no physical device with a compute queue,
//! timeline semaphores and `VK_KHR_push_descriptor` is [`DeviceError::Unavailable`], never a
//! panic ([`probe`] says which). One tributary device is one logical `VkDevice`.
//! [`VulkanConfig::devices`] may ask for more logical devices than there are physical
//! ones: they are assigned round-robin, so two logical devices on the single `llvmpipe`
//! physical device of Mesa's lavapipe driver are how the tests emulate two GPUs. Logical
//! devices share nothing but the instance: separate queues, memory and pipelines.
//!
//! **Streams.** lavapipe exposes one queue per device, and real GPUs have few, so the
//! streams of a device are *logical* submission chains that share the device's queue (a
//! mutex around `vkQueueSubmit`). Each stream owns a timeline semaphore whose value is the
//! tributary event sequence number: the batch of event `n` signals `n` and waits for the
//! stream's previous value, so a stream is FIFO even though the queue may overlap batches.
//! (lavapipe runs a queue's batches one after another, so there every semaphore wait is
//! already satisfied when its batch starts: the tests exercise the waits, but only a GPU
//! that overlaps batches can show one missing.) Each stream has two threads:
//!
//! - the *submit thread* takes plans in order and turns their dependencies into waits.
//!   A dependency on another stream of the same device becomes a semaphore wait inside the
//!   batch (no host round trip). A dependency on another device or another backend is
//!   waited for on the host, on this thread, which belongs to no actor and blocks nothing
//!   else (waits only point to earlier events, so they cannot deadlock). It then records
//!   and submits one command buffer (or an empty batch that only signals);
//! - the *completion thread* waits on the semaphore (`vkWaitSemaphores`) and, in order,
//!   signals or fails the tributary [`Timeline`], then drops what the work kept alive
//!   (pool buffers, pipelines, staging memory).
//!
//! **Failures without running the work.** A failed data dependency must fail a plan
//! *before* its work runs, but a semaphore only says "done". So every stream publishes the
//! *decision* it took for each sequence number (submitted as work, or failed with a root
//! cause) before the semaphore can reach it; a stream depending on another stream of the
//! same device first waits (on the host, briefly) until that decision exists, fails at once
//! on a failed data dependency, and otherwise waits for the value on the GPU. A failed plan
//! still submits an empty batch that waits for all its dependencies and signals its value,
//! so it completes only after them and every chain keeps moving. Failures are decided on
//! the host (a Rust closure kernel, a shader that does not compile, an unresolvable buffer,
//! a failed dependency): submitted GPU work does not fail except by a lost device, which
//! fails every stream of that device.
//!
//! **Memory.** A pool is one `VkBuffer` (storage, transfer source and destination) with its
//! own gpu-allocator allocation (`GpuOnly`). Where that memory is host-visible and coherent
//! (lavapipe: its one memory type is), host transfers read and write it directly; otherwise
//! they stage through host-visible buffers ([`VulkanConfig::force_staging`] forces that path
//! so the tests cover it on lavapipe). A location `{pool, offset}` is resolved to the pool's
//! buffer when the plan is submitted; the resolved work keeps the buffer alive until it
//! completes, so releasing a pool never frees memory under running work. Every command
//! buffer ends with a barrier that makes its writes visible to the host. Device teardown
//! waits for the device to go idle, frees every allocation and drops the allocator before
//! `vkDestroyDevice`.
//!
//! **Transfers.** Memset is `vkCmdFillBuffer`, same-device copies are `vkCmdCopyBuffer`.
//! Work that touches the host (from/to host, copies across devices) runs on the submit
//! thread after all its dependencies *and* the stream's previous work completed: a direct
//! `memcpy` where memory is mapped, otherwise a fenced staging copy; an empty batch then
//! signals its value (queue submission also makes the host writes visible to the device).
//! Across devices this is one `memcpy` between the two mapped pools on lavapipe, a
//! download and an upload through host memory elsewhere. `StreamingFor` works on one
//! device (the consumer binds the source buffer); across devices it is refused
//! ([`Backend::can_stream`] is false).
//!
//! **A device that stops answering.** Every wait for submitted work (the completion
//! thread's semaphore wait, a host transfer's wait for its dependencies, a staging copy's
//! fence) is bounded by [`VulkanConfig::device_timeout`]. A wait that times out or fails
//! marks the device lost: that operation and every later one of the device fail with
//! [`DeviceError::Lost`] ("timed out ..."), dependents on any device with that root cause.
//! Events complete in order, only after the submit thread is done with their host work.
//! What the device might still be using (command buffers, pool and staging buffers,
//! semaphores, the device itself) is deliberately leaked, never freed:
//! [`VulkanBackend::leaked_objects`] counts it. Other devices and backends keep serving.
//! [`VulkanBackend::inject_wait_fault`] makes a device stuck or lost, for tests.
//!
//! **Kernels.** Every built-in is a WGSL template instantiated per dtype, compiled by naga
//! to SPIR-V once per process and turned into a compute pipeline once per device (both
//! cached). Buffers are bound with `VK_KHR_push_descriptor` as storage-buffer ranges at
//! their offsets, which must be multiples of `minStorageBufferOffsetAlignment`: the backend
//! reports it through [`Backend::min_alignment`], pool owners raise their alignment to it,
//! and a misaligned binding fails its plan. Scalars and sizes go in push constants (WGSL
//! `var<immediate>`). Kernels loop grid-stride over their elements, so one dispatch never
//! needs more than `maxComputeWorkGroupCount[0]` workgroups. `f16`/`bf16` buffers are read
//! as `u32` words, two elements each, converted with the same integer code as the CPU
//! backend, and each invocation owns whole words (no write races on packed halves). `f64`
//! needs `shaderFloat64`. [`Kernel::Cpu`](crate::kernels::Kernel::Cpu) closures and
//! [`Kernel::Cuda`](crate::kernels::Kernel::Cuda) kernels cannot run
//! here: [`Backend::check_routine`] refuses them at link time and the stream fails their
//! event if one arrives anyway. [`Kernel::Shader`](crate::kernels::Kernel::Shader) runs
//! user WGSL or SPIR-V (parameters at bindings `0..n`, the merge buffer at `n`; its
//! immediates, then the values of the routine's declared indices, in push constants, laid
//! out as [`ShaderKernel`](crate::kernels::ShaderKernel) documents;
//! [`Backend::check_routine`] refuses at link a shader whose push constants exceed the
//! device's `maxPushConstantsSize`).
//!
//! **Results against the CPU backend** (in its exact kernel mode, DESIGN.md §5). Fill, copy,
//! copy-range, memset and the integer kernels are bitwise equal. The element-wise float
//! kernels, matmuls and `sum_rows` perform the same operations in the same order in the
//! same precision, and are bitwise
//! equal on lavapipe (the conformance suite checks it); a driver that contracts multiply-adds
//! into FMAs or flushes denormals may differ in the last bits (for sums: relative to the sum
//! of the terms' magnitudes). `softmax_xent`
//! uses the driver's `exp`/`log` for `f32` (and for `f16`/`bf16`, computed in `f32`) and
//! polynomial `exp`/`log` written in WGSL for `f64` (SPIR-V's `GLSL.std.450` has no 64-bit
//! `Exp`/`Log`): within `1e-5` relative (`f32`), `1e-12` (`f64`), one unit in the last place
//! (`f16`, `bf16`). Its loss sums per-row values kept in a scratch buffer, in row order, as
//! the CPU does.
//!
//! **Limits.** A kernel binding is at most `maxStorageBufferRange` bytes (128 MiB on
//! lavapipe); larger buffers can be copied, filled and transferred, but a kernel over one
//! fails with a message saying so. lavapipe's compiler (llvmpipe) silently stops a shader
//! invocation after 65 535 loop iterations in all; the backend knows the driver and fails,
//! with a message, any built-in dispatch that would need more (a `sum_rows` over more than
//! about 65 000 rows, a matmul with `k` that large, a softmax over that many classes) rather
//! than return truncated results. Other drivers have no such limit. User shaders are not
//! checked.
//!
//! **Not done (yet).** Importing one host allocation into several devices
//! (`VK_EXT_external_memory_host`) would let cross-device copies on lavapipe skip the pool
//! mappings' `memcpy`; the staging path allocates its staging buffer per transfer instead of
//! keeping a ring; there is no pipeline cache on disk (lavapipe's first dispatch of a
//! pipeline compiles it, 35-80 ms).

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
