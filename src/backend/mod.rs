//! Backends: what executes plans on real memory.
//!
//! A backend owns device memory (pools, addressed by [`crate::BufferLoc`] and resolved
//! privately) and stream queues. The protocol never sees pointers; a backend never makes a
//! scheduling decision: it waits for exactly the dependencies a [`Plan`] lists, runs the
//! work, and completes the plan's event (or fails it, carrying the root cause).
//!
//! Contract every backend keeps (checked by the engine tests on every backend):
//! - work on one stream completes in submission order, and the timeline is signalled in
//!   that order;
//! - a plan completes (ok or failed) only after *all* its dependencies completed;
//! - a failed [`crate::protocol::DepKind::Data`] dependency fails the plan with the same
//!   root cause, without running its work;
//! - `submit` never blocks on the work itself.
//!
//! Backends: [`cpu`] (always built) and [`vulkan`] (its types always exist; without the
//! `vulkan` cargo feature, [`vulkan::VulkanBackend::new`] reports
//! [`DeviceError::Unavailable`]). [`BackendKind`] picks one from configuration.

pub mod cpu;
pub mod fault;
pub mod vulkan;

use serde::{Deserialize, Serialize};

use crate::{
    error::{DeviceError, Error, Result},
    event::Timeline,
    ids::{DeviceId, PoolId, StreamId},
    kernels::Kernel,
    protocol::Plan,
    sync::Arc,
};

/// A queue of work on one stream.
pub trait StreamQueue: Send + Sync {
    /// Enqueues a plan. Never waits for the work. If the queue is dead the plan's event is
    /// failed (so nobody waits forever) and an error is returned.
    fn submit(&self, plan: Plan) -> Result<()>;

    /// Stops accepting work, lets queued work finish, and joins the worker.
    fn shutdown(&self);

    /// Like [`StreamQueue::shutdown`], but gives up after `timeout`: returns `false` if
    /// work was still running then (the worker is detached; the caller fails what is left).
    fn shutdown_within(&self, timeout: std::time::Duration) -> bool {
        let _ = timeout;
        self.shutdown();
        true
    }
}

/// A family of devices of one kind (CPU, Vulkan, CUDA).
pub trait Backend: Send + Sync + 'static {
    /// Short name (`cpu`, `vulkan`, `cuda`).
    fn name(&self) -> &'static str;

    /// The devices this backend drives, in order.
    fn devices(&self) -> Vec<DeviceId>;

    /// Creates the memory of a pool.
    fn create_pool(
        &self,
        device: DeviceId,
        pool: PoolId,
        bytes: u64,
        align: u64,
    ) -> Result<(), DeviceError>;

    /// Releases the memory of a pool (no plan refers to it any more).
    fn release_pool(&self, device: DeviceId, pool: PoolId);

    /// Starts the queue of one stream, which completes events on `timeline`.
    fn start_stream(
        &self,
        stream: StreamId,
        timeline: Arc<Timeline>,
    ) -> Result<Box<dyn StreamQueue>, DeviceError>;

    /// Whether work on `dst` can read memory of `src` in place (`StreamingFor`).
    fn can_stream(&self, src: DeviceId, dst: DeviceId) -> bool;

    /// The smallest alignment of buffer offsets inside the pools of `device` that the
    /// backend needs (Vulkan: `minStorageBufferOffsetAlignment`, so that every buffer can
    /// be bound as a storage-buffer range at its offset). Whoever creates the device's
    /// pools raises [`crate::memory::PoolConfig::min_alignment`] to it. Default: 1.
    fn min_alignment(&self, device: DeviceId) -> u64 {
        let _ = device;
        1
    }

    /// Refuses, at link time, a kernel that `device` can never run (a Rust closure on a
    /// GPU, a shader on the CPU) with [`Error::InvalidRoutine`]. Default: every kernel.
    /// The stream still fails the event of such a kernel if one reaches it.
    fn check_kernel(&self, device: DeviceId, routine: &str, kernel: &Kernel) -> Result<()> {
        let _ = (device, routine, kernel);
        Ok(())
    }
}

/// The pool memory of one device of a backend: what a
/// [`DeviceState`](crate::protocol::DeviceState) asks for while it decides (the engine's
/// and the device actors' way of lending it the backend).
pub struct BackendMemory {
    // A plain `std` Arc: loom's cannot hold a trait object.
    backend: std::sync::Arc<dyn Backend>,
    device: DeviceId,
}

impl BackendMemory {
    /// The pools of `device` on `backend`.
    pub fn new(backend: std::sync::Arc<dyn Backend>, device: DeviceId) -> Self {
        BackendMemory { backend, device }
    }
}

impl crate::memory::PoolMemory for BackendMemory {
    fn create_pool(&mut self, pool: PoolId, bytes: u64, align: u64) -> Result<()> {
        self.backend
            .create_pool(self.device, pool, bytes, align)
            .map_err(Error::from)
    }

    fn release_pool(&mut self, pool: PoolId) {
        self.backend.release_pool(self.device, pool);
    }
}

/// Which backend a system or an engine runs on (serde: `"Cpu"` or
/// `{ "Vulkan": { ... } }`; TOML `backend = "Cpu"` or `[backend.Vulkan]`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackendKind {
    /// Virtual CPU devices (their number is configured beside this, e.g.
    /// `SystemConfig::cpu_devices`).
    #[default]
    Cpu,
    /// Vulkan devices ([`vulkan::VulkanConfig`]).
    Vulkan(vulkan::VulkanConfig),
}

impl BackendKind {
    /// Creates the backend, its devices numbered from `DeviceId(0)`; `cpu_devices` is the
    /// number of CPU devices (ignored by other kinds). A Vulkan backend that cannot start
    /// (no loader, no driver, no suitable device) is [`DeviceError::Unavailable`].
    pub fn create(&self, cpu_devices: usize) -> Result<std::sync::Arc<dyn Backend>, DeviceError> {
        // A plain `std` Arc: loom's cannot hold a trait object.
        use std::sync::Arc;
        match self {
            BackendKind::Cpu => Ok(Arc::new(cpu::CpuBackend::new(DeviceId(0), cpu_devices))),
            BackendKind::Vulkan(config) => Ok(Arc::new(vulkan::VulkanBackend::new(
                DeviceId(0),
                config.clone(),
            )?)),
        }
    }
}

/// The [`Backend::check_kernel`] error of a backend that cannot run `kernel` at all.
pub(crate) fn unsupported_kernel(
    routine: &str,
    device: DeviceId,
    backend: &str,
    why: &str,
) -> Error {
    Error::InvalidRoutine {
        routine: routine.to_string(),
        reason: format!("{backend} device {device} cannot run it: {why}"),
    }
}
