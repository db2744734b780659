//! The backend object: its devices, one `CudaContext` each, their pools, the peer table, and
//! the [`Backend`] implementation.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule};

use super::{
    events::EventPool,
    instance::{driver_error, guarded, lock, open_driver, version_string},
    kernels::{unsupported_on_cuda, LaunchLimits, Program},
    memory::{can_address, copy_route, CopyRoute, DevicePool, Region, RouteFacts},
    stream::{CudaStreamQueue, StreamShared},
    CudaConfig, CudaInfo,
};
use crate::{
    backend::{
        gpu_stream::{drop_by, StopDeadline},
        unsupported_kernel, Backend, DeviceInfo, StreamQueue,
    },
    error::{DeviceError, Result},
    event::Timeline,
    ids::{DeviceId, PoolId, StreamId},
    node::DType,
    protocol::GlobalLoc,
    sync::Arc as SyncArc,
    trace::Recorder,
};

/// What the backend knows of a GPU's limits (the kernels module's launch limits are
/// these).
#[derive(Clone, Debug)]
pub(super) struct GpuLimits {
    pub(super) max_threads_per_block: u32,
    /// Most threads per block along x, y and z.
    pub(super) max_block: [u32; 3],
    /// Most blocks along x, y and z.
    pub(super) max_grid: [u32; 3],
    pub(super) shared_memory_per_block: u64,
    pub(super) multiprocessors: u32,
    /// `(major, minor)` compute capability.
    pub(super) compute_capability: (i32, i32),
}

impl GpuLimits {
    /// The limits the kernels module sizes launches by.
    pub(super) fn launch_limits(&self) -> LaunchLimits {
        LaunchLimits {
            max_threads_per_block: self.max_threads_per_block,
            max_block: self.max_block,
            max_grid: self.max_grid,
            max_shared_mem_per_block: u32::try_from(self.shared_memory_per_block)
                .unwrap_or(u32::MAX),
            multiprocessor_count: self.multiprocessors,
        }
    }
}

/// A program loaded in a context, and its entry points looked up so far.
pub(super) struct LoadedProgram {
    pub(super) module: Arc<CudaModule>,
    pub(super) functions: HashMap<String, CudaFunction>,
}

/// One tributary device: a CUDA context with its pools, modules, events and streams.
pub(super) struct Gpu {
    pub(super) id: DeviceId,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) name: String,
    pub(super) total_memory: u64,
    pub(super) limits: GpuLimits,
    pools: Mutex<HashMap<PoolId, Arc<DevicePool>>>,
    /// Compiled and loaded programs, with the entry points looked up so far.
    pub(super) modules: Mutex<HashMap<Program, LoadedProgram>>,
    pub(super) events: Arc<EventPool>,
    /// The streams of this device, to turn dependencies on them into event waits.
    streams: Mutex<Vec<Arc<StreamShared>>>,
    /// Set when a CUDA error poisoned the context: the root cause later work fails with.
    lost: Mutex<Option<String>>,
}

impl Gpu {
    /// The stream of this device whose timeline is `timeline`, if any.
    pub(super) fn stream_of(&self, timeline: &SyncArc<Timeline>) -> Option<Arc<StreamShared>> {
        lock(&self.streams)
            .iter()
            .find(|s| SyncArc::ptr_eq(&s.timeline, timeline))
            .cloned()
    }

    /// Marks the device lost (first cause wins) and returns the cause.
    pub(super) fn mark_lost(&self, cause: &str) -> String {
        lock(&self.lost)
            .get_or_insert_with(|| cause.to_string())
            .clone()
    }

    /// Why the device is lost, if it is.
    pub(super) fn lost(&self) -> Option<String> {
        lock(&self.lost).clone()
    }
}

/// What the backend's streams share.
pub(super) struct Shared {
    pub(super) gpus: Vec<Arc<Gpu>>,
    pub(super) config: CudaConfig,
    /// `peer[dst][src]`: device `dst`'s context has peer access to `src`'s (by index).
    peer: Vec<Vec<bool>>,
    driver_version: i32,
    /// The deadline its streams were stopped by, if any: the contexts are destroyed by it.
    pub(super) stop_deadline: Arc<StopDeadline>,
}

impl Drop for Shared {
    /// The last owner of the backend destroys the contexts (with the last `Gpu`s, unless a
    /// stream thread still holds one). `cuCtxDestroy` waits until the whole GPU is idle,
    /// kernels of other devices a bounded shutdown abandoned included (3-4 s past a 500 ms
    /// `System::shutdown_within` on an H100), so after a stop with a deadline it runs on a
    /// thread of its own, waited for only until that deadline ([`drop_by`]).
    fn drop(&mut self) {
        drop_by(std::mem::take(&mut self.gpus), self.stop_deadline.get());
    }
}

impl Shared {
    fn index(&self, device: DeviceId) -> Option<usize> {
        self.gpus.iter().position(|g| g.id == device)
    }

    pub(super) fn gpu(&self, device: DeviceId) -> Option<&Arc<Gpu>> {
        self.gpus.iter().find(|g| g.id == device)
    }

    /// What decides how `src` and `dst` exchange data (both must be devices of ours).
    pub(super) fn route_facts(&self, src: DeviceId, dst: DeviceId) -> Option<RouteFacts> {
        let (s, d) = (self.index(src)?, self.index(dst)?);
        let (sg, dg) = (self.gpus.get(s)?, self.gpus.get(d)?);
        Some(RouteFacts {
            same_device: s == d,
            same_context: sg.ctx.cu_ctx() == dg.ctx.cu_ctx(),
            same_gpu: sg.ctx.cu_device() == dg.ctx.cu_device(),
            peer_access: self
                .peer
                .get(d)
                .and_then(|row| row.get(s))
                .copied()
                .unwrap_or(false),
            force_staging: self.config.force_staging,
        })
    }

    /// The route of a copy from `src` to `dst`.
    pub(super) fn route(&self, src: DeviceId, dst: DeviceId) -> Option<CopyRoute> {
        self.route_facts(src, dst).map(copy_route)
    }

    /// Resolves a location to a checked byte range of its pool.
    pub(super) fn resolve(&self, g: GlobalLoc, bytes: u64) -> std::result::Result<Region, String> {
        let gpu = self
            .gpu(g.device)
            .ok_or_else(|| format!("device {} is not a CUDA device of this backend", g.device))?;
        let pool = lock(&gpu.pools)
            .get(&g.loc.pool)
            .cloned()
            .ok_or_else(|| format!("pool {} does not exist on {}", g.loc.pool, g.device))?;
        Region::new(pool, g.loc.offset, bytes).map_err(|e| format!("{}: {e}", g.loc))
    }
}

/// The CUDA backend: logical devices (contexts) on the machine's GPUs.
///
/// See the [module documentation](super) for how it works.
#[derive(Clone)]
pub struct CudaBackend {
    shared: Arc<Shared>,
    recorder: Option<Arc<Recorder>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("devices", &self.device_names())
            .finish()
    }
}

/// Opens the driver and lists the GPUs the backend would use, without creating contexts;
/// [`DeviceError::Unavailable`] says why the backend cannot run here.
pub fn probe() -> Result<CudaInfo, DeviceError> {
    let (version, count) = open_driver()?;
    let devices = guarded("listing CUDA devices", || {
        (0..count)
            .map(|i| {
                cudarc::driver::result::device::get(i as i32)
                    .and_then(cudarc::driver::result::device::get_name)
                    .map_err(|e| DeviceError::Unavailable(driver_error(e)))
            })
            .collect::<Result<Vec<_>, _>>()
    })??;
    Ok(CudaInfo {
        driver_version: version_string(version),
        devices,
        nvrtc: super::kernels::nvrtc::nvrtc_available().is_ok(),
    })
}

fn attribute(ctx: &CudaContext, a: sys::CUdevice_attribute) -> Result<i32, DeviceError> {
    ctx.attribute(a).map_err(|e| {
        DeviceError::Unavailable(format!("device attribute {a:?}: {}", driver_error(e)))
    })
}

/// Creates the context of logical device `id` on GPU `ordinal`: the GPU's primary context
/// when `primary` (its first logical device, or every one with
/// [`CudaConfig::share_context`]), a context of its own otherwise.
fn open_gpu(id: DeviceId, ordinal: usize, primary: bool, driver: i32) -> Result<Gpu, DeviceError> {
    let unavailable = |what: &'static str| {
        move |e| DeviceError::Unavailable(format!("GPU {ordinal}: {what}: {}", driver_error(e)))
    };
    // Non-primary contexts use cuCtxCreate_v4, which drivers before CUDA 12.5 lack: there,
    // logical devices on one GPU share its primary context.
    let ctx = if primary || driver < 12_050 {
        CudaContext::new(ordinal).map_err(unavailable("cuDevicePrimaryCtxRetain"))?
    } else {
        CudaContext::new_non_primary(ordinal, 0).map_err(unavailable("cuCtxCreate"))?
    };
    // SAFETY: the backend never uses cudarc's `CudaSlice`, whose cross-stream tracking
    // this turns off; it orders all work itself with events.
    unsafe { ctx.disable_event_tracking() };
    use sys::CUdevice_attribute as A;
    let dims = |x, y, z| -> Result<[u32; 3], DeviceError> {
        Ok([
            attribute(&ctx, x)?.max(1) as u32,
            attribute(&ctx, y)?.max(1) as u32,
            attribute(&ctx, z)?.max(1) as u32,
        ])
    };
    let limits = GpuLimits {
        max_block: dims(
            A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X,
            A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y,
            A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z,
        )?,
        max_grid: dims(
            A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X,
            A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y,
            A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z,
        )?,
        max_threads_per_block: attribute(&ctx, A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?.max(1)
            as u32,
        shared_memory_per_block: attribute(
            &ctx,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
        )?
        .max(0) as u64,
        multiprocessors: attribute(&ctx, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1)
            as u32,
        compute_capability: ctx
            .compute_capability()
            .map_err(unavailable("compute capability"))?,
    };
    let name = ctx.name().map_err(unavailable("cuDeviceGetName"))?;
    let total_memory = ctx.total_mem().map_err(unavailable("cuDeviceTotalMem"))? as u64;
    let events = Arc::new(EventPool::for_context(ctx.clone()));
    Ok(Gpu {
        id,
        ctx,
        name,
        total_memory,
        limits,
        pools: Mutex::new(HashMap::new()),
        modules: Mutex::new(HashMap::new()),
        events,
        streams: Mutex::new(Vec::new()),
        lost: Mutex::new(None),
    })
}

/// Enables peer access wherever the driver allows it: `table[dst][src]`.
fn enable_peers(gpus: &[Arc<Gpu>]) -> Vec<Vec<bool>> {
    gpus.iter()
        .map(|dst| {
            gpus.iter()
                .map(|src| {
                    if dst.ctx.cu_ctx() == src.ctx.cu_ctx() {
                        return false;
                    }
                    let same_gpu = dst.ctx.cu_device() == src.ctx.cu_device();
                    let mut can = 0i32;
                    // SAFETY: both are valid devices of an initialised driver; `can`
                    // outlives the call.
                    let allowed = unsafe {
                        sys::cuDeviceCanAccessPeer(
                            &mut can,
                            dst.ctx.cu_device(),
                            src.ctx.cu_device(),
                        )
                    }
                    .result()
                    .is_ok_and(|()| can != 0);
                    if !(allowed || same_gpu) || dst.ctx.bind_to_thread().is_err() {
                        return false;
                    }
                    // SAFETY: `dst`'s context is current on this thread, `src`'s context is
                    // alive (held by `src`); peer access lasts as long as both contexts.
                    let r = unsafe { sys::cuCtxEnablePeerAccess(src.ctx.cu_ctx(), 0) };
                    matches!(
                        r,
                        sys::CUresult::CUDA_SUCCESS
                            | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                    )
                })
                .collect()
        })
        .collect()
}

impl CudaBackend {
    /// Creates the backend's logical devices, numbered from `first`.
    ///
    /// [`DeviceError::Unavailable`] when the driver library is missing, the driver is older
    /// than CUDA [`MIN_DRIVER_VERSION`](super::MIN_DRIVER_VERSION), there is no GPU, or a
    /// GPU asked for in [`CudaConfig::gpus`] does not exist; never a panic.
    pub fn new(first: DeviceId, config: CudaConfig) -> Result<CudaBackend, DeviceError> {
        if config.spin_us > crate::backend::cpu::MAX_SPIN_US {
            return Err(DeviceError::Unexpected(format!(
                "invalid CUDA configuration: spin_us = {} (at most {})",
                config.spin_us,
                crate::backend::cpu::MAX_SPIN_US
            )));
        }
        let (driver, count) = open_driver()?;
        let ordinals = match &config.gpus {
            None => (0..count).collect::<Vec<_>>(),
            Some(list) => {
                if let Some(bad) = list.iter().find(|&&o| o >= count) {
                    return Err(DeviceError::Unavailable(format!(
                        "GPU {bad} asked for, the driver sees {count}"
                    )));
                }
                list.clone()
            }
        };
        if ordinals.is_empty() {
            return Err(DeviceError::Unavailable("no GPU selected".into()));
        }
        let n = config.devices.unwrap_or(ordinals.len());
        if n == 0 {
            return Err(DeviceError::Unexpected(
                "a CUDA backend with zero devices".into(),
            ));
        }
        let mut gpus = Vec::with_capacity(n);
        for i in 0..n {
            let ordinal = ordinals[i % ordinals.len()];
            let id = u32::try_from(i)
                .ok()
                .and_then(|i| first.0.checked_add(i))
                .map(DeviceId)
                .ok_or_else(|| DeviceError::Unexpected("too many devices".into()))?;
            let primary = config.share_context || i < ordinals.len();
            gpus.push(Arc::new(guarded("creating a CUDA context", || {
                open_gpu(id, ordinal, primary, driver)
            })??));
        }
        let peer = guarded("enabling peer access", || enable_peers(&gpus))?;
        tracing::debug!(
            devices = n,
            gpus = %gpus.iter().map(|g| g.name.as_str()).collect::<Vec<_>>().join(", "),
            driver = %version_string(driver),
            "cuda backend up"
        );
        Ok(CudaBackend {
            shared: Arc::new(Shared {
                gpus,
                config,
                peer,
                driver_version: driver,
                stop_deadline: Arc::default(),
            }),
            recorder: None,
        })
    }

    /// Records every operation and host wait of its streams in `recorder` (the
    /// [module documentation](super) says what the times mean).
    pub fn with_recorder(mut self, recorder: std::sync::Arc<Recorder>) -> CudaBackend {
        self.recorder = Some(recorder);
        self
    }

    /// The name of the GPU under each logical device, in device order.
    pub fn device_names(&self) -> Vec<String> {
        self.shared.gpus.iter().map(|g| g.name.clone()).collect()
    }

    /// The configuration it was created with.
    pub fn config(&self) -> &CudaConfig {
        &self.shared.config
    }

    /// The CUDA version the driver supports, as `major.minor`.
    pub fn driver_version(&self) -> String {
        version_string(self.shared.driver_version)
    }

    /// Whether copies from `src` to `dst` go peer-to-peer (`cuMemcpyPeerAsync`); `false`
    /// for direct, staged, or unknown devices.
    pub fn peer_copies(&self, src: DeviceId, dst: DeviceId) -> bool {
        self.shared.route(src, dst) == Some(CopyRoute::Peer)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
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
        // cuMemAlloc aligns to at least 256 bytes, more than the planner ever asks.
        if align > 256 {
            return Err(DeviceError::Unexpected(format!(
                "pool alignment {align} above the 256 bytes cuMemAlloc guarantees"
            )));
        }
        if let Some(cause) = gpu.lost() {
            return Err(DeviceError::Lost(cause));
        }
        if lock(&gpu.pools).contains_key(&pool) {
            return Err(crate::backend::pool_exists(device, pool));
        }
        let memory = DevicePool::new(&gpu.ctx, bytes)?;
        lock(&gpu.pools).insert(pool, Arc::new(memory));
        Ok(())
    }

    fn release_pool(&self, device: DeviceId, pool: PoolId) {
        if let Some(gpu) = self.shared.gpu(device) {
            // In-flight work keeps its own `Arc`; the memory is freed after it.
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
        let shared = Arc::new(StreamShared::new(stream, timeline));
        let queue = CudaStreamQueue::start(
            self.shared.clone(),
            gpu.clone(),
            shared.clone(),
            self.recorder.clone(),
        )?;
        lock(&gpu.streams).push(shared);
        Ok(Box::new(queue))
    }

    fn can_stream(&self, src: DeviceId, dst: DeviceId) -> bool {
        self.shared.route_facts(src, dst).is_some_and(can_address)
    }

    fn device_info(&self, device: DeviceId) -> Result<DeviceInfo, DeviceError> {
        let gpu = self
            .shared
            .gpu(device)
            .ok_or_else(|| DeviceError::Unexpected(format!("unknown device {device}")))?;
        Ok(DeviceInfo::new(device, "cuda", gpu.name.clone())
            .with_memory_bytes(Some(gpu.total_memory))
            .with_workgroup_limits(
                gpu.limits.max_threads_per_block,
                gpu.limits.shared_memory_per_block,
            )
            .with_dtypes(DType::ALL.to_vec()))
    }

    fn min_alignment(&self, device: DeviceId) -> u64 {
        // Kernels read elements at their natural alignment; 16 covers vector loads of
        // every dtype.
        let _ = device;
        16
    }

    fn check_routine(&self, device: DeviceId, spec: &crate::kernels::RoutineSpec) -> Result<()> {
        match unsupported_on_cuda(&spec.kernel) {
            Some(why) => Err(unsupported_kernel(&spec.name, device, "cuda", why)),
            None => Ok(()),
        }
    }
}
