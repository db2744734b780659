//! The backend object: its devices, their pools, and the [`Backend`] implementation.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use super::{
    instance::{create_instance, lock, InstanceCore, LogicalDevice},
    kernels::{PipelineCache, SpirvCache, CPU_KERNEL_ON_VULKAN, CUDA_KERNEL_ON_VULKAN},
    memory::{Buffer, Region},
    stream::{StreamShared, VulkanStream},
    VulkanConfig, VulkanInfo, VulkanReplayCounts, WaitFault,
};
use crate::{
    backend::{recording::StreamTrace, unsupported_kernel, Backend, StreamQueue},
    error::{DeviceError, Error, Result},
    event::Timeline,
    ids::{DeviceId, PoolId, StreamId},
    kernels::{Kernel, RoutineSpec},
    protocol::GlobalLoc,
    sync::Arc as SyncArc,
    trace::Recorder,
};

/// One tributary device: a logical `VkDevice` with its pools, pipelines and streams.
pub(super) struct Gpu {
    pub(super) id: DeviceId,
    pub(super) core: Arc<LogicalDevice>,
    pools: Mutex<HashMap<PoolId, Arc<Buffer>>>,
    pub(super) pipelines: PipelineCache,
    /// The streams of this device, to turn dependencies on them into semaphore waits.
    streams: Mutex<Vec<Arc<StreamShared>>>,
}

impl Gpu {
    /// The stream of this device whose timeline is `timeline`, if any.
    pub(super) fn stream_of(&self, timeline: &SyncArc<Timeline>) -> Option<Arc<StreamShared>> {
        lock(&self.streams)
            .iter()
            .find(|s| SyncArc::ptr_eq(&s.timeline, timeline))
            .cloned()
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Pipelines and pools go first; `LogicalDevice` (held by everything) goes last.
        self.pipelines.clear();
        lock(&self.pools).clear();
    }
}

/// What the backend's streams share.
pub(super) struct Shared {
    // Kept for `probe`-like reporting and to outlive the devices.
    _instance: Arc<InstanceCore>,
    pub(super) gpus: Vec<Arc<Gpu>>,
    pub(super) spirv: Arc<SpirvCache>,
    pub(super) config: VulkanConfig,
    /// How the operations of replays ran ([`VulkanBackend::replay_counts`]).
    pub(super) replays: ReplayCounters,
}

/// [`VulkanReplayCounts`], counted by the streams (statistics: relaxed).
#[derive(Default)]
pub(super) struct ReplayCounters {
    pub(super) recorded: AtomicU64,
    pub(super) resubmitted: AtomicU64,
    pub(super) as_plans: AtomicU64,
}

impl ReplayCounters {
    pub(super) fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl Shared {
    pub(super) fn gpu(&self, device: DeviceId) -> Option<&Arc<Gpu>> {
        self.gpus.iter().find(|g| g.id == device)
    }

    /// Resolves a location to a checked byte range of its pool buffer.
    pub(super) fn resolve(&self, g: GlobalLoc, bytes: u64) -> std::result::Result<Region, String> {
        let gpu = self
            .gpu(g.device)
            .ok_or_else(|| format!("device {} is not a Vulkan device of this backend", g.device))?;
        let buffer = lock(&gpu.pools)
            .get(&g.loc.pool)
            .cloned()
            .ok_or_else(|| format!("pool {} does not exist on {}", g.loc.pool, g.device))?;
        Region::new(buffer, g.loc.offset, bytes).map_err(|e| format!("{}: {e}", g.loc))
    }
}

/// The Vulkan backend: logical devices on the machine's Vulkan physical devices.
///
/// See the [module documentation](super) for how it works.
#[derive(Clone)]
pub struct VulkanBackend {
    shared: Arc<Shared>,
    recorder: Option<Arc<Recorder>>,
}

impl std::fmt::Debug for VulkanBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VulkanBackend")
            .field("devices", &self.device_names())
            .finish()
    }
}

/// Loads Vulkan and lists the physical devices the backend would use, without creating
/// devices; [`DeviceError::Unavailable`] says why the backend cannot run here.
pub fn probe() -> Result<VulkanInfo, DeviceError> {
    let instance = create_instance()?;
    let (usable, refused) = instance.physical_devices()?;
    if usable.is_empty() {
        return Err(no_device(&refused));
    }
    Ok(VulkanInfo {
        api_version: format!(
            "{}.{}.{}",
            ash::vk::api_version_major(instance.api_version),
            ash::vk::api_version_minor(instance.api_version),
            ash::vk::api_version_patch(instance.api_version)
        ),
        devices: usable.into_iter().map(|p| p.name).collect(),
    })
}

fn no_device(refused: &[String]) -> DeviceError {
    DeviceError::Unavailable(if refused.is_empty() {
        "no Vulkan physical device".into()
    } else {
        format!("no suitable Vulkan device ({})", refused.join("; "))
    })
}

impl VulkanBackend {
    /// Creates the backend's logical devices, numbered from `first`.
    ///
    /// [`DeviceError::Unavailable`] when there is no loader, no driver, or no physical
    /// device with a compute queue, timeline semaphores and `VK_KHR_push_descriptor`;
    /// never a panic.
    pub fn new(first: DeviceId, config: VulkanConfig) -> Result<VulkanBackend, DeviceError> {
        let instance = create_instance()?;
        let (usable, refused) = instance.physical_devices()?;
        if usable.is_empty() {
            return Err(no_device(&refused));
        }
        let n = config.devices.unwrap_or(usable.len());
        if n == 0 {
            return Err(DeviceError::Unexpected(
                "a Vulkan backend with zero devices".into(),
            ));
        }
        let mut gpus = Vec::with_capacity(n);
        for i in 0..n {
            let physical = usable[i % usable.len()].clone();
            let core = LogicalDevice::new(instance.clone(), physical, config.device_timeout)?;
            let id = u32::try_from(i)
                .ok()
                .and_then(|i| first.0.checked_add(i))
                .map(DeviceId)
                .ok_or_else(|| DeviceError::Unexpected("too many devices".into()))?;
            gpus.push(Arc::new(Gpu {
                id,
                core,
                pools: Mutex::new(HashMap::new()),
                pipelines: PipelineCache::default(),
                streams: Mutex::new(Vec::new()),
            }));
        }
        tracing::debug!(
            devices = n,
            physical = %usable.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", "),
            "vulkan backend up"
        );
        Ok(VulkanBackend {
            shared: Arc::new(Shared {
                _instance: instance,
                gpus,
                spirv: Arc::new(SpirvCache::default()),
                config,
                replays: ReplayCounters::default(),
            }),
            recorder: None,
        })
    }

    /// The name of the physical device under each logical device, in device order.
    pub fn device_names(&self) -> Vec<String> {
        self.shared
            .gpus
            .iter()
            .map(|g| g.core.physical.name.clone())
            .collect()
    }

    /// Records every operation and wait of the streams started from now on (see
    /// [`crate::trace`] for what the timestamps mean on a GPU).
    pub fn with_recorder(mut self, recorder: Arc<Recorder>) -> VulkanBackend {
        self.recorder = Some(recorder);
        self
    }

    /// The configuration it was created with.
    pub fn config(&self) -> &VulkanConfig {
        &self.shared.config
    }

    /// Makes the waits of `device` fail as `fault` says, from now on (a test seam for a
    /// hung or lost GPU; see [`WaitFault`]). Other devices are unaffected.
    pub fn inject_wait_fault(&self, device: DeviceId, fault: WaitFault) -> Result<(), DeviceError> {
        self.gpu_of(device)?.core.inject(fault);
        Ok(())
    }

    /// Why `device` is lost, if it is ([`DeviceError::Lost`]'s cause).
    pub fn lost_cause(&self, device: DeviceId) -> Result<Option<String>, DeviceError> {
        Ok(self.gpu_of(device)?.core.lost())
    }

    /// How many objects of `device` were deliberately leaked, not freed, because the device
    /// stopped answering while it might still use them (see [`VulkanConfig::device_timeout`]).
    pub fn leaked_objects(&self, device: DeviceId) -> Result<usize, DeviceError> {
        Ok(self.gpu_of(device)?.core.leaked())
    }

    /// How the operations of replayed steps ran on this backend's streams so far: recorded
    /// into a command buffer kept for the step's next replays, resubmitted from one, or run
    /// as plans (host transfers, copies between devices, failed inputs: see DESIGN.md §5,
    /// "Vulkan").
    pub fn replay_counts(&self) -> VulkanReplayCounts {
        let c = &self.shared.replays;
        VulkanReplayCounts {
            recorded: c.recorded.load(Ordering::Relaxed),
            resubmitted: c.resubmitted.load(Ordering::Relaxed),
            as_plans: c.as_plans.load(Ordering::Relaxed),
        }
    }

    fn gpu_of(&self, device: DeviceId) -> Result<&Arc<Gpu>, DeviceError> {
        self.shared
            .gpu(device)
            .ok_or_else(|| DeviceError::Unexpected(format!("unknown device {device}")))
    }
}

impl Backend for VulkanBackend {
    fn name(&self) -> &'static str {
        "vulkan"
    }

    fn devices(&self) -> Vec<DeviceId> {
        self.shared.gpus.iter().map(|g| g.id).collect()
    }

    fn create_pool(
        &self,
        device: DeviceId,
        pool: PoolId,
        bytes: u64,
        align: u64,
    ) -> Result<(), DeviceError> {
        let gpu = self
            .shared
            .gpu(device)
            .ok_or_else(|| DeviceError::Unexpected(format!("unknown device {device}")))?;
        // Buffers start at offset 0 of their own allocation, which satisfies any
        // alignment the pool planner asks for (minStorageBufferOffsetAlignment and the
        // planner's are powers of two far below the allocation's).
        let _ = align;
        if let Some(cause) = gpu.core.lost() {
            return Err(DeviceError::Lost(cause));
        }
        if lock(&gpu.pools).contains_key(&pool) {
            return Err(crate::backend::pool_exists(device, pool));
        }
        let buffer = Arc::new(Buffer::pool(
            &gpu.core,
            bytes,
            self.shared.config.force_staging,
        )?);
        match lock(&gpu.pools).entry(pool) {
            std::collections::hash_map::Entry::Occupied(_) => {
                Err(crate::backend::pool_exists(device, pool))
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(buffer);
                Ok(())
            }
        }
    }

    fn release_pool(&self, device: DeviceId, pool: PoolId) {
        if let Some(gpu) = self.shared.gpu(device) {
            // In-flight work keeps its own `Arc`; the buffer is destroyed after it.
            lock(&gpu.pools).remove(&pool);
        }
    }

    unsafe fn start_stream(
        &self,
        stream: StreamId,
        timeline: SyncArc<Timeline>,
    ) -> Result<Box<dyn StreamQueue>, DeviceError> {
        let gpu = self
            .shared
            .gpu(stream.device)
            .ok_or_else(|| DeviceError::Unexpected(format!("unknown device {}", stream.device)))?
            .clone();
        let shared = Arc::new(StreamShared::new(gpu.core.clone(), stream, timeline)?);
        lock(&gpu.streams).push(shared.clone());
        let trace = StreamTrace::new(self.recorder.clone(), stream);
        let queue = VulkanStream::start(self.shared.clone(), gpu, shared, trace)?;
        Ok(Box::new(queue))
    }

    fn can_stream(&self, src: DeviceId, dst: DeviceId) -> bool {
        // A kernel binds buffers of its own device only.
        src == dst && self.shared.gpu(src).is_some()
    }

    fn device_info(&self, device: DeviceId) -> Result<crate::backend::DeviceInfo, DeviceError> {
        use crate::node::DType;
        let gpu = self
            .shared
            .gpu(device)
            .ok_or_else(|| DeviceError::Unexpected(format!("unknown device {device}")))?;
        let p = &gpu.core.physical;
        let dtypes: Vec<DType> = DType::ALL
            .into_iter()
            .filter(|d| *d != DType::F64 || p.float64)
            .collect();
        Ok(
            crate::backend::DeviceInfo::new(device, "vulkan", p.name.clone())
                .with_memory_bytes(Some(p.device_local_bytes))
                .with_workgroup_limits(p.max_workgroup_invocations, u64::from(p.max_shared_memory))
                .with_dtypes(dtypes),
        )
    }

    fn min_alignment(&self, device: DeviceId) -> u64 {
        self.shared
            .gpu(device)
            .map_or(1, |g| g.core.physical.limits.min_storage_offset_alignment)
    }

    fn check_routine(&self, device: DeviceId, spec: &RoutineSpec) -> Result<()> {
        let routine = spec.name.as_str();
        match &spec.kernel {
            Kernel::Cpu(_) => Err(unsupported_kernel(
                routine,
                device,
                "vulkan",
                CPU_KERNEL_ON_VULKAN,
            )),
            Kernel::Cuda(_) => Err(unsupported_kernel(
                routine,
                device,
                "vulkan",
                CUDA_KERNEL_ON_VULKAN,
            )),
            Kernel::Builtin(_) => Ok(()),
            Kernel::Shader(s) => {
                // Immediates and index values share the push constants: refuse at link
                // what no schedule could dispatch.
                let bytes = super::kernels::push_constant_size(s.immediates.len(), spec.indices());
                let limit = self
                    .shared
                    .gpu(device)
                    .map_or(u32::MAX, |g| g.core.physical.limits.max_push_constants);
                if bytes > limit as usize {
                    return Err(Error::PushConstantsTooLarge {
                        routine: routine.to_string(),
                        device,
                        bytes,
                        immediates: s.immediates.len(),
                        limit,
                    });
                }
                Ok(())
            }
        }
    }
}
