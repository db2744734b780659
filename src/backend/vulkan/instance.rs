//! Instance and physical-device discovery, logical device creation, and the objects whose
//! lifetimes everything else hangs on: [`InstanceCore`] and [`LogicalDevice`].
//!
//! Every object that holds a Vulkan handle of a device holds an `Arc<LogicalDevice>` and
//! destroys its handle in its own `Drop`. So the device's `Drop` runs after all of them: it
//! waits for the device to go idle, drops the allocator and destroys the device.
//! `InstanceCore` outlives every device the same way.
//!
//! Every wait for device work, such as [`LogicalDevice::wait_semaphores`], is bounded; see
//! DESIGN.md §5, "Vulkan". A wait that times out or fails marks the device lost. What that
//! work might still use is leaked by [`LogicalDevice::leak`]: never freed, never reused. A
//! leaked object keeps its `LogicalDevice` alive, so a device with pending work is never
//! destroyed, which would be undefined behaviour. Tests inject a stuck or lost device
//! through [`LogicalDevice::inject`].

use std::{
    ffi::CStr,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::{Duration, Instant},
};

use ash::vk;
use gpu_allocator::vulkan::{Allocator, AllocatorCreateDesc};

use super::{
    conv::{map_alloc_err, map_init_err, map_loading_err, map_oom_and_lost},
    WaitFault,
};
use crate::error::DeviceError;

/// How long one blocking Vulkan wait lasts before the waiter looks around again (lost
/// device, deadline).
const WAIT_SLICE: Duration = Duration::from_millis(200);

/// Locks a mutex, ignoring poisoning (the data behind our mutexes stays consistent: every
/// critical section either completes or only drops values).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The loaded library and the instance.
pub(super) struct InstanceCore {
    // Kept alive: the instance's function pointers come from this library.
    _entry: ash::Entry,
    pub(super) instance: ash::Instance,
    pub(super) api_version: u32,
}

impl Drop for InstanceCore {
    fn drop(&mut self) {
        // SAFETY: every child object (devices) holds an `Arc<InstanceCore>`, so none is
        // left when this runs; the instance is not used after this call.
        unsafe { self.instance.destroy_instance(None) };
    }
}

/// A physical device that satisfies our requirements, with what we need to know of it.
#[derive(Clone)]
pub(super) struct PhysicalInfo {
    pub(super) handle: vk::PhysicalDevice,
    pub(super) name: String,
    pub(super) queue_family: u32,
    pub(super) limits: Limits,
    pub(super) float64: bool,
    /// Bytes in the device-local memory heaps.
    pub(super) device_local_bytes: u64,
    /// `maxComputeWorkGroupInvocations`.
    pub(super) max_workgroup_invocations: u32,
    /// `maxComputeSharedMemorySize`.
    pub(super) max_shared_memory: u32,
}

/// The limits the backend respects.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    pub(super) min_storage_offset_alignment: u64,
    pub(super) max_storage_range: u64,
    pub(super) max_workgroups_x: u32,
    pub(super) max_push_constants: u32,
    /// Loop iterations one invocation may run in all before the driver stops it silently
    /// (llvmpipe, i.e. lavapipe: 65535); `None` where there is no such limit.
    pub(super) max_loop_iterations: Option<u64>,
}

fn version_string(v: u32) -> String {
    format!(
        "{}.{}.{}",
        vk::api_version_major(v),
        vk::api_version_minor(v),
        vk::api_version_patch(v)
    )
}

/// Loads the Vulkan loader and creates an instance (API 1.2).
pub(super) fn create_instance() -> Result<Arc<InstanceCore>, DeviceError> {
    // SAFETY: `Entry::load` dlopens the system's Vulkan loader and runs its initialisers;
    // we trust the installed loader (the usual premise of using Vulkan at all). Failure to
    // find it is an error value.
    let entry = unsafe { ash::Entry::load() }.map_err(map_loading_err)?;
    // SAFETY: a global command with no preconditions.
    let version = unsafe { entry.try_enumerate_instance_version() }
        .map_err(|r| map_init_err("vkEnumerateInstanceVersion", r))?
        .unwrap_or(vk::API_VERSION_1_0);
    if version < vk::API_VERSION_1_2 {
        return Err(DeviceError::Unavailable(format!(
            "Vulkan 1.2 needed, the loader offers {}",
            version_string(version)
        )));
    }
    let app = vk::ApplicationInfo::default()
        .application_name(c"tributary")
        .engine_name(c"tributary")
        .api_version(vk::API_VERSION_1_2);
    let info = vk::InstanceCreateInfo::default().application_info(&app);
    // SAFETY: `info` and what it points to live until the call returns.
    let instance = unsafe { entry.create_instance(&info, None) }
        .map_err(|r| map_init_err("vkCreateInstance", r))?;
    Ok(Arc::new(InstanceCore {
        _entry: entry,
        instance,
        api_version: version,
    }))
}

impl InstanceCore {
    /// The physical devices we can use, in enumeration order; why each other one is not.
    pub(super) fn physical_devices(&self) -> Result<(Vec<PhysicalInfo>, Vec<String>), DeviceError> {
        let inst = &self.instance;
        // SAFETY: valid instance.
        let handles = unsafe { inst.enumerate_physical_devices() }
            .map_err(|r| map_init_err("vkEnumeratePhysicalDevices", r))?;
        let mut usable = Vec::new();
        let mut refused = Vec::new();
        for pd in handles {
            // SAFETY: `pd` comes from this instance.
            let props = unsafe { inst.get_physical_device_properties(pd) };
            let name = props
                .device_name_as_c_str()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|_| "unnamed device".into());
            let mut driver = vk::PhysicalDeviceDriverProperties::default();
            let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut driver);
            // SAFETY: `pd` comes from this instance; the driver-properties struct is core in
            // 1.2 (devices below 1.2 are refused by `check_physical` anyway); both structs
            // live across the call.
            unsafe { inst.get_physical_device_properties2(pd, &mut props2) };
            let llvmpipe = driver.driver_id == vk::DriverId::MESA_LLVMPIPE;
            // SAFETY: `pd` comes from this instance.
            let memory = unsafe { inst.get_physical_device_memory_properties(pd) };
            let device_local_bytes = memory
                .memory_heaps_as_slice()
                .iter()
                .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
                .map(|h| h.size)
                .sum();
            match check_physical(inst, pd, &props) {
                Ok((queue_family, float64)) => usable.push(PhysicalInfo {
                    handle: pd,
                    name,
                    queue_family,
                    float64,
                    device_local_bytes,
                    max_workgroup_invocations: props.limits.max_compute_work_group_invocations,
                    max_shared_memory: props.limits.max_compute_shared_memory_size,
                    limits: Limits {
                        min_storage_offset_alignment: props
                            .limits
                            .min_storage_buffer_offset_alignment
                            .max(4),
                        max_storage_range: u64::from(props.limits.max_storage_buffer_range),
                        max_workgroups_x: props.limits.max_compute_work_group_count[0].max(1),
                        max_push_constants: props.limits.max_push_constants_size,
                        max_loop_iterations: llvmpipe.then_some(65_535),
                    },
                }),
                Err(why) => refused.push(format!("{name}: {why}")),
            }
        }
        Ok((usable, refused))
    }
}

const PUSH_DESCRIPTOR: &CStr = ash::khr::push_descriptor::NAME;

/// `(compute queue family, shaderFloat64)`, or why the device does not qualify.
fn check_physical(
    inst: &ash::Instance,
    pd: vk::PhysicalDevice,
    props: &vk::PhysicalDeviceProperties,
) -> Result<(u32, bool), String> {
    if props.api_version < vk::API_VERSION_1_2 {
        return Err(format!(
            "Vulkan {} (1.2 needed)",
            version_string(props.api_version)
        ));
    }
    // SAFETY: `pd` comes from `inst`.
    let families = unsafe { inst.get_physical_device_queue_family_properties(pd) };
    let family = families
        .iter()
        .position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE) && f.queue_count > 0)
        .ok_or("no compute queue")?;
    // SAFETY: `pd` comes from `inst`.
    let exts = unsafe { inst.enumerate_device_extension_properties(pd) }
        .map_err(|r| format!("cannot list extensions: {r}"))?;
    if !exts
        .iter()
        .any(|e| e.extension_name_as_c_str() == Ok(PUSH_DESCRIPTOR))
    {
        return Err("no VK_KHR_push_descriptor".into());
    }
    let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
    let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut v12);
    // SAFETY: `pd` supports 1.2 (checked above), so the 1.2 feature struct is valid in the
    // chain; both structs live across the call.
    unsafe { inst.get_physical_device_features2(pd, &mut f2) };
    let float64 = f2.features.shader_float64 == vk::TRUE;
    if v12.timeline_semaphore != vk::TRUE {
        return Err("no timeline semaphores".into());
    }
    Ok((family as u32, float64))
}

/// A logical device, its queue and its allocator.
pub(super) struct LogicalDevice {
    /// Keeps the instance alive as long as the device.
    _instance: Arc<InstanceCore>,
    pub(super) physical: PhysicalInfo,
    pub(super) device: ash::Device,
    pub(super) push_descriptor: ash::khr::push_descriptor::Device,
    /// The device's single queue, shared by all its streams.
    queue: Mutex<vk::Queue>,
    /// `None` only during `Drop` (dropped before the device is destroyed).
    allocator: Mutex<Option<Allocator>>,
    /// A command pool and fence for synchronous staging copies.
    helper: Mutex<Helper>,
    /// Set when the device is lost: the root cause every later operation fails with.
    lost: Mutex<Option<String>>,
    /// How long one wait for submitted work may block ([`super::VulkanConfig::device_timeout`]).
    timeout: Duration,
    /// Injected wait results ([`LogicalDevice::inject`]).
    injected: Mutex<Injected>,
    /// Objects leaked because the device might still use them ([`LogicalDevice::leak`]).
    leaked: AtomicUsize,
    /// Whether a leak has pinned this `LogicalDevice` (one extra `Arc` forgotten).
    pinned: AtomicBool,
}

/// What the next waits report instead of asking the driver (test seam).
#[derive(Default)]
struct Injected {
    /// Every wait times out (a device that stopped answering).
    stuck: bool,
    /// The next wait reports `VK_ERROR_DEVICE_LOST`.
    lose_next: bool,
}

struct Helper {
    pool: vk::CommandPool,
    fence: vk::Fence,
}

impl LogicalDevice {
    /// Creates a logical device on `physical` with one queue, timeline semaphores, push
    /// descriptors and `shaderFloat64` where available.
    pub(super) fn new(
        instance: Arc<InstanceCore>,
        physical: PhysicalInfo,
        timeout: Duration,
    ) -> Result<Arc<LogicalDevice>, DeviceError> {
        let inst = &instance.instance;
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(physical.queue_family)
            .queue_priorities(&priorities)];
        let exts = [PUSH_DESCRIPTOR.as_ptr()];
        let features = vk::PhysicalDeviceFeatures::default().shader_float64(physical.float64);
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default().timeline_semaphore(true);
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&exts)
            .enabled_features(&features)
            .push_next(&mut v12);
        // SAFETY: `physical.handle` comes from this instance; the requested extension and
        // features were checked to be supported; `info` outlives the call.
        let device = unsafe { inst.create_device(physical.handle, &info, None) }
            .map_err(|r| map_init_err("vkCreateDevice", r))?;
        match Self::finish(&instance, &physical, &device) {
            Ok((queue, push_descriptor, allocator, helper)) => Ok(Arc::new(LogicalDevice {
                _instance: instance,
                physical,
                device,
                push_descriptor,
                queue: Mutex::new(queue),
                allocator: Mutex::new(Some(allocator)),
                helper: Mutex::new(helper),
                lost: Mutex::new(None),
                timeout,
                injected: Mutex::new(Injected::default()),
                leaked: AtomicUsize::new(0),
                pinned: AtomicBool::new(false),
            })),
            Err(e) => {
                // SAFETY: `finish` destroyed whatever it created before failing; nothing
                // else holds the device.
                unsafe { device.destroy_device(None) };
                Err(e)
            }
        }
    }

    /// The rest of device set-up; on error, everything it created is destroyed again.
    fn finish(
        instance: &InstanceCore,
        physical: &PhysicalInfo,
        device: &ash::Device,
    ) -> Result<
        (
            vk::Queue,
            ash::khr::push_descriptor::Device,
            Allocator,
            Helper,
        ),
        DeviceError,
    > {
        let inst = &instance.instance;
        // SAFETY: queue 0 of the family was requested at creation.
        let queue = unsafe { device.get_device_queue(physical.queue_family, 0) };
        let push_descriptor = ash::khr::push_descriptor::Device::new(inst, device);
        let allocator = Allocator::new(&AllocatorCreateDesc {
            instance: inst.clone(),
            device: device.clone(),
            physical_device: physical.handle,
            debug_settings: Default::default(),
            buffer_device_address: false,
            allocation_sizes: Default::default(),
        })
        .map_err(|e| map_alloc_err(0, e))?;
        let pool_info = vk::CommandPoolCreateInfo::default()
            .queue_family_index(physical.queue_family)
            .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
        // SAFETY: valid device and create info.
        let pool = unsafe { device.create_command_pool(&pool_info, None) }
            .map_err(|r| map_oom_and_lost("vkCreateCommandPool", 0, r))?;
        // SAFETY: valid device and create info.
        let fence = match unsafe { device.create_fence(&vk::FenceCreateInfo::default(), None) } {
            Ok(f) => f,
            Err(r) => {
                // SAFETY: the pool was created above and is unused.
                unsafe { device.destroy_command_pool(pool, None) };
                return Err(map_oom_and_lost("vkCreateFence", 0, r));
            }
        };
        Ok((queue, push_descriptor, allocator, Helper { pool, fence }))
    }

    /// The queue, locked: every `vkQueueSubmit` on this device goes through it.
    pub(super) fn queue(&self) -> MutexGuard<'_, vk::Queue> {
        lock(&self.queue)
    }

    /// Runs `f` with the allocator (an error if the device is being torn down).
    pub(super) fn with_allocator<R>(
        &self,
        f: impl FnOnce(&mut Allocator) -> Result<R, DeviceError>,
    ) -> Result<R, DeviceError> {
        match lock(&self.allocator).as_mut() {
            Some(a) => f(a),
            None => Err(DeviceError::Lost("the device is being destroyed".into())),
        }
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

    /// Records commands with `record`, submits them and waits for them (staging copies).
    /// `keep` is what the commands use (staging and pool buffers): if the wait fails the
    /// device may still use it, so it is leaked with the command buffer, not freed.
    pub(super) fn run_sync<K>(
        self: &Arc<Self>,
        record: impl FnOnce(vk::CommandBuffer),
        keep: K,
    ) -> Result<(), DeviceError> {
        if let Some(cause) = self.lost() {
            return Err(DeviceError::Lost(cause));
        }
        let helper = lock(&self.helper);
        let d = &self.device;
        let alloc = vk::CommandBufferAllocateInfo::default()
            .command_pool(helper.pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        // SAFETY: the pool belongs to this device and is only used under `helper`'s lock.
        let cbs = unsafe { d.allocate_command_buffers(&alloc) }
            .map_err(|r| map_oom_and_lost("vkAllocateCommandBuffers", 0, r))?;
        // Whether the device may still be executing the command buffer.
        let mut pending = false;
        let result = (|| {
            let cb = *cbs
                .first()
                .ok_or_else(|| DeviceError::Unexpected("no command buffer allocated".into()))?;
            let begin = vk::CommandBufferBeginInfo::default()
                .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: fresh command buffer of a pool we hold the lock of.
            unsafe { d.begin_command_buffer(cb, &begin) }
                .map_err(|r| map_oom_and_lost("vkBeginCommandBuffer", 0, r))?;
            record(cb);
            host_visibility_barrier(d, cb);
            // SAFETY: recording started above.
            unsafe { d.end_command_buffer(cb) }
                .map_err(|r| map_oom_and_lost("vkEndCommandBuffer", 0, r))?;
            let submit = [vk::SubmitInfo::default().command_buffers(&cbs)];
            {
                let queue = self.queue();
                // SAFETY: the queue is externally synchronised by its mutex; the command
                // buffer is fully recorded; the fence is unsignalled (reset after each
                // use, and never reused after a failed wait: the device is lost then).
                unsafe { d.queue_submit(*queue, &submit, helper.fence) }
                    .map_err(|r| self.fail(map_oom_and_lost("vkQueueSubmit", 0, r)))?;
            }
            pending = true;
            self.wait_fence(helper.fence, "a staging copy (vkWaitForFences)")?;
            pending = false;
            // SAFETY: the fence is signalled and no longer in use by the queue.
            unsafe { d.reset_fences(&[helper.fence]) }
                .map_err(|r| map_oom_and_lost("vkResetFences", 0, r))
        })();
        if pending {
            // The wait failed (the device is marked lost): the copy may still be pending.
            // Its command buffer and everything it uses stay allocated for good.
            self.leak(cbs, "a staging command buffer");
            self.leak(keep, "the buffers of a staging copy");
            return result;
        }
        // SAFETY: `pending` is false: either the submission completed (fence waited) or
        // it never happened, so the command buffer is not in use.
        unsafe { d.free_command_buffers(helper.pool, &cbs) };
        drop(keep);
        result
    }

    /// Waits until every `(semaphore, value)` is reached, for at most the device timeout;
    /// `what` names the wait in the error.
    pub(super) fn wait_semaphores(
        &self,
        waits: &[(vk::Semaphore, u64)],
        what: &str,
    ) -> Result<(), DeviceError> {
        if waits.is_empty() {
            return Ok(());
        }
        let sems: Vec<_> = waits.iter().map(|w| w.0).collect();
        let vals: Vec<_> = waits.iter().map(|w| w.1).collect();
        let info = vk::SemaphoreWaitInfo::default()
            .semaphores(&sems)
            .values(&vals);
        self.bounded_wait(what, |ns| {
            // SAFETY: the semaphores belong to this device and are kept alive by the
            // caller for the duration of the call.
            unsafe { self.device.wait_semaphores(&info, ns) }
        })
    }

    /// Waits until `fence` is signalled, for at most the device timeout.
    pub(super) fn wait_fence(&self, fence: vk::Fence, what: &str) -> Result<(), DeviceError> {
        self.bounded_wait(what, |ns| {
            // SAFETY: the fence belongs to this device and lives as long as it.
            unsafe { self.device.wait_for_fences(&[fence], true, ns) }
        })
    }

    /// Calls `wait_for(ns)` in slices until it succeeds, the device is lost, or the device
    /// timeout has passed. A timeout, or any error of the wait, marks the device lost:
    /// the work waited for may still be running, and whoever waited must leak what it uses.
    fn bounded_wait(
        &self,
        what: &str,
        mut wait_for: impl FnMut(u64) -> ash::prelude::VkResult<()>,
    ) -> Result<(), DeviceError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(cause) = self.lost() {
                return Err(DeviceError::Lost(cause));
            }
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(WAIT_SLICE);
            let result = match self.injected_result() {
                Some(vk::Result::TIMEOUT) => {
                    // A device that stopped answering: the wait blocks for its slice.
                    std::thread::sleep(slice);
                    Err(vk::Result::TIMEOUT)
                }
                Some(r) => Err(r),
                None => wait_for(u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX)),
            };
            match result {
                Ok(()) => return Ok(()),
                Err(vk::Result::TIMEOUT) if Instant::now() < deadline => continue,
                Err(vk::Result::TIMEOUT) => {
                    return Err(self.fail(DeviceError::Lost(format!(
                        "timed out: {what} did not complete within {:?} \
                         (VulkanConfig::device_timeout); the device stopped answering",
                        self.timeout
                    ))))
                }
                Err(r) => return Err(self.fail(DeviceError::Lost(format!("{what}: {r:?}")))),
            }
        }
    }

    /// What the next wait reports instead of asking the driver, if a fault was injected.
    fn injected_result(&self) -> Option<vk::Result> {
        let mut injected = lock(&self.injected);
        if injected.lose_next {
            injected.lose_next = false;
            return Some(vk::Result::ERROR_DEVICE_LOST);
        }
        injected.stuck.then_some(vk::Result::TIMEOUT)
    }

    /// Makes later waits on this device fail as `fault` says (see [`WaitFault`]).
    pub(super) fn inject(&self, fault: WaitFault) {
        let mut injected = lock(&self.injected);
        match fault {
            WaitFault::Stuck => injected.stuck = true,
            WaitFault::Lost => injected.lose_next = true,
        }
    }

    /// Leaks `thing` (its `Drop` never runs) because the device might still use what it
    /// owns, and pins this `LogicalDevice` (it is never destroyed: a device with pending work
    /// cannot be). Counted in [`LogicalDevice::leaked`].
    pub(super) fn leak<T>(self: &Arc<Self>, thing: T, what: &str) {
        std::mem::forget(thing);
        self.leaked.fetch_add(1, Ordering::Relaxed);
        if !self.pinned.swap(true, Ordering::Relaxed) {
            std::mem::forget(self.clone());
        }
        tracing::warn!(
            device = %self.physical.name,
            what,
            "leaked: the device may still use it"
        );
    }

    /// How many objects were leaked because the device might still use them.
    pub(super) fn leaked(&self) -> usize {
        self.leaked.load(Ordering::Relaxed)
    }

    /// Records a lost device for `Lost` errors, then returns the error.
    pub(super) fn fail(&self, e: DeviceError) -> DeviceError {
        if let DeviceError::Lost(cause) = &e {
            self.mark_lost(cause);
        }
        e
    }
}

/// Ends a command buffer's work with a barrier that makes its writes available and visible
/// to host reads (pool memory read by `memcpy` after a semaphore or fence wait).
pub(super) fn host_visibility_barrier(d: &ash::Device, cb: vk::CommandBuffer) {
    let barrier = [vk::MemoryBarrier::default()
        .src_access_mask(vk::AccessFlags::MEMORY_WRITE)
        .dst_access_mask(vk::AccessFlags::HOST_READ | vk::AccessFlags::HOST_WRITE)];
    // SAFETY: `cb` is in the recording state (callers' contract).
    unsafe {
        d.cmd_pipeline_barrier(
            cb,
            vk::PipelineStageFlags::ALL_COMMANDS,
            vk::PipelineStageFlags::HOST,
            vk::DependencyFlags::empty(),
            &barrier,
            &[],
            &[],
        )
    };
}

impl Drop for LogicalDevice {
    fn drop(&mut self) {
        // SAFETY: every object created from this device holds an `Arc<LogicalDevice>`, so all
        // of them (buffers, pipelines, semaphores, command pools) are destroyed already; we
        // wait for the device to go idle, destroy our own helper objects, drop the
        // allocator (which frees its memory blocks) and only then destroy the device.
        unsafe {
            let _ = self.device.device_wait_idle();
            let helper = lock(&self.helper);
            self.device.destroy_fence(helper.fence, None);
            self.device.destroy_command_pool(helper.pool, None);
            drop(helper);
            drop(lock(&self.allocator).take());
            self.device.destroy_device(None);
        }
    }
}
