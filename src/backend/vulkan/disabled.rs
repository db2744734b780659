//! The Vulkan backend's API when the `vulkan` cargo feature is off: it cannot be created.

use super::{not_built, VulkanConfig, VulkanInfo, VulkanReplayCounts, WaitFault};
use crate::{
    backend::{Backend, StreamQueue},
    error::DeviceError,
    event::Timeline,
    ids::{DeviceId, PoolId, StreamId},
    sync::Arc,
};

/// The Vulkan backend (this build has no Vulkan support: [`VulkanBackend::new`] always
/// reports [`DeviceError::Unavailable`]).
#[derive(Clone, Debug)]
pub struct VulkanBackend {
    never: std::convert::Infallible,
}

/// Always [`DeviceError::Unavailable`]: built without the `vulkan` feature.
pub fn probe() -> Result<VulkanInfo, DeviceError> {
    Err(not_built())
}

impl VulkanBackend {
    /// Always [`DeviceError::Unavailable`]: built without the `vulkan` feature.
    pub fn new(first: DeviceId, config: VulkanConfig) -> Result<VulkanBackend, DeviceError> {
        let _ = (first, config);
        Err(not_built())
    }

    /// Records the timeline (this value cannot exist).
    pub fn with_recorder(self, recorder: std::sync::Arc<crate::trace::Recorder>) -> VulkanBackend {
        let _ = recorder;
        match self.never {}
    }

    /// Names of the physical devices (none: this value cannot exist).
    pub fn device_names(&self) -> Vec<String> {
        match self.never {}
    }

    /// Injects a wait fault (this value cannot exist).
    pub fn inject_wait_fault(&self, _: DeviceId, _: WaitFault) -> Result<(), DeviceError> {
        match self.never {}
    }

    /// Why a device is lost (this value cannot exist).
    pub fn lost_cause(&self, _: DeviceId) -> Result<Option<String>, DeviceError> {
        match self.never {}
    }

    /// How replays ran (this value cannot exist).
    pub fn replay_counts(&self) -> VulkanReplayCounts {
        match self.never {}
    }

    /// Leaked objects (this value cannot exist).
    pub fn leaked_objects(&self, _: DeviceId) -> Result<usize, DeviceError> {
        match self.never {}
    }
}

impl Backend for VulkanBackend {
    fn name(&self) -> &'static str {
        "vulkan"
    }

    fn devices(&self) -> Vec<DeviceId> {
        match self.never {}
    }

    fn create_pool(&self, _: DeviceId, _: PoolId, _: u64, _: u64) -> Result<(), DeviceError> {
        match self.never {}
    }

    fn release_pool(&self, _: DeviceId, _: PoolId) {
        match self.never {}
    }

    unsafe fn start_stream(
        &self,
        _: StreamId,
        _: Arc<Timeline>,
    ) -> Result<Box<dyn StreamQueue>, DeviceError> {
        match self.never {}
    }

    fn can_stream(&self, _: DeviceId, _: DeviceId) -> bool {
        match self.never {}
    }

    fn device_info(&self, _: DeviceId) -> Result<crate::backend::DeviceInfo, DeviceError> {
        match self.never {}
    }
}
