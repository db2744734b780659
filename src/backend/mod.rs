//! Backends: what executes plans on real memory.
//!
//! A backend owns device memory and stream queues. It runs the work of each [`Plan`] after
//! the dependencies the plan lists, then completes or fails the plan's event. It makes no
//! scheduling decision. The contract every backend keeps, and why its `unsafe` code is
//! sound, are in DESIGN.md §5, "Backends" and "Soundness: the types carry the protocol's
//! promise".
//!
//! A backend author implements [`Backend`] and [`StreamQueue`]. In `submit`, call
//! [`Plan::check_queue`] first and read the plan through its accessors. Rely on its
//! dependencies for ordering, and on its bindings not aliasing unless both are read-only.
//! Name those facts in the `// SAFETY:` comments. [`Backend::start_stream`] is `unsafe`: the
//! engine and the actor system are its only safe callers, and a user gets no queue.
//!
//! The backends are [`cpu`], [`vulkan`] and [`cuda`]. The CPU backend is always built. The
//! types of the other two always exist; without their cargo feature,
//! [`vulkan::VulkanBackend::new`] and [`cuda::CudaBackend::new`] return
//! [`DeviceError::Unavailable`]. [`BackendKind`] picks a backend from configuration. What the
//! two GPU backends' streams do alike is written once, in `gpu_stream.rs`.

pub mod cpu;
pub mod cuda;
pub mod fault;
#[cfg(any(feature = "vulkan", feature = "cuda"))]
mod gpu_stream;
#[cfg(any(feature = "vulkan", feature = "cuda"))]
pub(crate) mod recording;
pub mod vulkan;

use serde::{Deserialize, Serialize};

use crate::{
    error::{DeviceError, Error, Result},
    event::Timeline,
    ids::{DeviceId, PoolId, StreamId},
    kernels::RoutineSpec,
    protocol::{Plan, StreamProgram},
    sync::Arc,
};

/// A queue of work on one stream.
pub trait StreamQueue: Send + Sync {
    /// Enqueues a plan. Never waits for the work. If the queue is dead the plan's event is
    /// failed (so nobody waits forever) and an error is returned. A plan for another
    /// stream's timeline is refused with [`Error::WrongStream`] ([`Plan::check_queue`]) and
    /// its event left alone (it belongs to another queue).
    fn submit(&self, plan: Plan) -> Result<()>;

    /// Whether the queue runs a [`StreamProgram`] in place ([`StreamQueue::submit_program`]).
    /// Default `false`: a replay hands such a queue its operations as plans
    /// ([`StreamProgram::into_plans`]), submitted with every other device's in issue order.
    fn runs_programs(&self) -> bool {
        false
    }

    /// Enqueues a replayed stream's program (DESIGN.md §4, "Compiled replays"): its
    /// operations run in order, each after its dependencies, as the plans of
    /// [`StreamProgram::into_plans`] would. Never waits for the work. A program of another
    /// stream's timeline is refused with [`Error::WrongStream`] ([`StreamProgram::check_queue`]).
    /// Default: the operations submitted as plans, one by one.
    fn submit_program(&self, program: StreamProgram) -> Result<()> {
        let mut result = Ok(());
        program.into_plans(|plan| {
            let submitted = self.submit(plan);
            if result.is_ok() {
                result = submitted;
            }
        });
        result
    }

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

    /// Creates the memory of a pool. A `pool` that is live on `device` already is refused
    /// ([`DeviceError::Unexpected`] naming it): each pool has one owner, the protocol
    /// instance of its device, and memory never changes under its plans.
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
    ///
    /// # Safety
    ///
    /// The backend runs what the queue receives with raw memory accesses ordered only by
    /// plan dependencies, so the caller promises that:
    ///
    /// - every plan submitted to the returned queue was made by the one protocol instance
    ///   ([`DeviceState`](crate::protocol::DeviceState)) that issues `timeline`'s sequence
    ///   numbers, whose pool memory is this backend's `stream.device` (its
    ///   [`BackendMemory`]) and which is the only one making plans that name those pools;
    /// - `timeline` is completed by the returned queue only: no other queue is started on
    ///   it, and nothing else signals, fails or poisons it (failing the event of a plan
    ///   that could not be submitted excepted);
    /// - every protocol instance whose plans this queue's plans depend on lives on
    ///   timelines completed by such queues too.
    unsafe fn start_stream(
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

    /// Refuses, at link time, a routine that `device` can never run: a kernel of another
    /// backend (a Rust closure on a GPU, a shader on the CPU) with
    /// [`Error::InvalidRoutine`], a shader whose immediates and index values exceed the
    /// device's push constants with [`Error::PushConstantsTooLarge`]. Default: every
    /// routine. A wrapper backend must forward it. The stream still fails the event of
    /// such a routine if one reaches it.
    fn check_routine(&self, device: DeviceId, spec: &RoutineSpec) -> Result<()> {
        let _ = (device, spec);
        Ok(())
    }

    /// What `device` is: its name, memory and limits ([`DeviceInfo`]). An unknown device is
    /// [`DeviceError::Unexpected`] naming it.
    fn device_info(&self, device: DeviceId) -> Result<DeviceInfo, DeviceError>;
}

/// What a device is (the counterpart of rune's `Device_info`): what a user asks first, and
/// what a scheduler needs to size work. Every backend fills it from its driver.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// The tributary device.
    pub device: DeviceId,
    /// The backend's short name (`cpu`, `vulkan`, `cuda`).
    pub backend: String,
    /// The device's name as its driver reports it (`llvmpipe (LLVM 15.0.6, 256 bits)`,
    /// `NVIDIA H100 80GB HBM3`, `CPU virtual device 0`).
    pub name: String,
    /// Memory the device can allocate from, in bytes (Vulkan: its device-local heaps;
    /// CUDA: `cuDeviceTotalMem`; CPU: the host's physical memory), `None` where unknown.
    pub memory_bytes: Option<u64>,
    /// The largest workgroup (Vulkan) or thread block (CUDA) a kernel may use; 1 on the
    /// CPU, where a kernel runs on one worker thread.
    pub max_workgroup_size: u32,
    /// Shared memory one workgroup or block can use, in bytes (0 on the CPU).
    pub shared_memory_bytes: u64,
    /// The element types its built-in kernels support.
    pub dtypes: Vec<crate::node::DType>,
}

impl DeviceInfo {
    /// Information about `device` of `backend` called `name`; the other fields are filled
    /// with the `with_*` setters.
    pub fn new(device: DeviceId, backend: &str, name: impl Into<String>) -> DeviceInfo {
        DeviceInfo {
            device,
            backend: backend.to_string(),
            name: name.into(),
            memory_bytes: None,
            max_workgroup_size: 1,
            shared_memory_bytes: 0,
            dtypes: Vec::new(),
        }
    }

    /// Sets [`DeviceInfo::memory_bytes`].
    pub fn with_memory_bytes(mut self, bytes: Option<u64>) -> DeviceInfo {
        self.memory_bytes = bytes;
        self
    }

    /// Sets [`DeviceInfo::max_workgroup_size`] and [`DeviceInfo::shared_memory_bytes`].
    pub fn with_workgroup_limits(mut self, max_size: u32, shared_memory_bytes: u64) -> DeviceInfo {
        self.max_workgroup_size = max_size;
        self.shared_memory_bytes = shared_memory_bytes;
        self
    }

    /// Sets [`DeviceInfo::dtypes`].
    pub fn with_dtypes(mut self, dtypes: impl Into<Vec<crate::node::DType>>) -> DeviceInfo {
        self.dtypes = dtypes.into();
        self
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.backend, self.device, self.name)?;
        match self.memory_bytes {
            Some(b) => write!(f, ", {:.1} GiB", b as f64 / (1u64 << 30) as f64)?,
            None => f.write_str(", memory unknown")?,
        }
        write!(
            f,
            ", workgroup <= {}, shared memory {} B, dtypes {:?}",
            self.max_workgroup_size, self.shared_memory_bytes, self.dtypes
        )
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
/// `{ "Vulkan": { ... } }` or `{ "Cuda": { ... } }`; TOML `backend = "Cpu"`,
/// `[backend.Vulkan]` or `[backend.Cuda]`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum BackendKind {
    /// Virtual CPU devices (their number is configured beside this, e.g.
    /// `SystemConfig::cpu_devices`).
    #[default]
    Cpu,
    /// Vulkan devices ([`vulkan::VulkanConfig`]).
    Vulkan(vulkan::VulkanConfig),
    /// CUDA devices ([`cuda::CudaConfig`]).
    Cuda(cuda::CudaConfig),
}

impl BackendKind {
    /// Creates the backend, its devices numbered from `DeviceId(0)`; `cpu_devices` is the
    /// number of CPU devices (ignored by other kinds). A Vulkan or CUDA backend that cannot
    /// start (no loader or driver library, too old a driver, no suitable device) is
    /// [`DeviceError::Unavailable`].
    pub fn create(&self, cpu_devices: usize) -> Result<std::sync::Arc<dyn Backend>, DeviceError> {
        self.create_with(cpu_devices, &cpu::CpuConfig::default(), None)
            .map_err(into_device_error)
    }

    /// [`BackendKind::create`], recording every operation and wait of the backend's
    /// streams in `recorder` when one is given ([`crate::trace`]).
    pub fn create_with_recorder(
        &self,
        cpu_devices: usize,
        recorder: Option<std::sync::Arc<crate::trace::Recorder>>,
    ) -> Result<std::sync::Arc<dyn Backend>, DeviceError> {
        self.create_with(cpu_devices, &cpu::CpuConfig::default(), recorder)
            .map_err(into_device_error)
    }

    /// [`BackendKind::create_with_recorder`], the CPU backend's streams run as `cpu` says
    /// (ignored by other kinds). A CPU configuration it cannot use is
    /// [`Error::InvalidConfig`] ([`cpu::CpuConfig::validate`]); a backend that cannot
    /// start is [`Error::Device`].
    ///
    /// ```
    /// use tributary::backend::{cpu::CpuConfig, BackendKind};
    /// let backend = BackendKind::Cpu.create_with(2, &CpuConfig::default().with_workers(1), None)?;
    /// assert_eq!(backend.devices().len(), 2);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn create_with(
        &self,
        cpu_devices: usize,
        cpu: &cpu::CpuConfig,
        recorder: Option<std::sync::Arc<crate::trace::Recorder>>,
    ) -> Result<std::sync::Arc<dyn Backend>> {
        // A plain `std` Arc: loom's cannot hold a trait object.
        use std::sync::Arc;
        Ok(match (self, recorder) {
            (BackendKind::Cpu, None) => Arc::new(cpu::CpuBackend::with_config(
                DeviceId(0),
                cpu_devices,
                cpu.clone(),
            )?),
            (BackendKind::Cpu, Some(recorder)) => Arc::new(
                cpu::CpuBackend::with_config(DeviceId(0), cpu_devices, cpu.clone())?
                    .with_recorder(recorder),
            ),
            (BackendKind::Vulkan(config), None) => {
                Arc::new(vulkan::VulkanBackend::new(DeviceId(0), config.clone())?)
            }
            (BackendKind::Vulkan(config), Some(recorder)) => Arc::new(
                vulkan::VulkanBackend::new(DeviceId(0), config.clone())?.with_recorder(recorder),
            ),
            (BackendKind::Cuda(config), None) => {
                Arc::new(cuda::CudaBackend::new(DeviceId(0), config.clone())?)
            }
            (BackendKind::Cuda(config), Some(recorder)) => Arc::new(
                cuda::CudaBackend::new(DeviceId(0), config.clone())?.with_recorder(recorder),
            ),
        })
    }
}

/// The [`DeviceError`] of [`BackendKind::create`], which takes the default CPU
/// configuration (always valid) and so only fails with a device error.
fn into_device_error(e: Error) -> DeviceError {
    match e {
        Error::Device(e) => e,
        other => DeviceError::Unexpected(other.to_string()),
    }
}

/// The [`Backend::create_pool`] error for a pool id that is already live on `device`.
pub(crate) fn pool_exists(device: DeviceId, pool: PoolId) -> DeviceError {
    DeviceError::Unexpected(format!("pool {pool} already exists on {device}"))
}

/// Every backend's rule for a host transfer: it covers its whole host array, exactly
/// `bytes` long. Anything else would be truncated or overrun, so it is a bug to report
/// (the plan fails with this message, naming both sizes).
pub(crate) fn check_host_array(host_len: usize, bytes: u64) -> std::result::Result<(), String> {
    if bytes != host_len as u64 {
        return Err(format!(
            "size mismatch: host array of {host_len} bytes, transfer of {bytes} bytes"
        ));
    }
    Ok(())
}

/// The [`Backend::check_routine`] error of a backend that cannot run `kernel` at all.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A host array shorter or longer than its transfer is refused, naming both sizes (the
    /// CUDA backend once accepted a longer one and truncated it).
    #[test]
    fn a_host_array_must_be_exactly_the_transfer() {
        assert!(check_host_array(16, 16).is_ok());
        for (len, bytes) in [(32usize, 16u64), (8, 16), (0, 1)] {
            let e = check_host_array(len, bytes).expect_err("a size mismatch");
            assert!(e.contains("size mismatch"), "{e}");
            assert!(e.contains(&format!("{len} bytes")), "{e}");
            assert!(e.contains(&format!("{bytes} bytes")), "{e}");
        }
    }
}
