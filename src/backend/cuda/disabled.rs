//! The CUDA backend's API when the `cuda` cargo feature is off: it cannot be created.

use super::{not_built, CudaConfig, CudaInfo};
use crate::{
    backend::{Backend, StreamQueue},
    error::DeviceError,
    event::Timeline,
    ids::{DeviceId, PoolId, StreamId},
    sync::Arc,
};

/// The CUDA backend (this build has no CUDA support: [`CudaBackend::new`] always
/// reports [`DeviceError::Unavailable`]).
#[derive(Clone, Debug)]
pub struct CudaBackend {
    never: std::convert::Infallible,
}

/// Always [`DeviceError::Unavailable`]: built without the `cuda` feature.
pub fn probe() -> Result<CudaInfo, DeviceError> {
    Err(not_built())
}

impl CudaBackend {
    /// Always [`DeviceError::Unavailable`]: built without the `cuda` feature.
    pub fn new(first: DeviceId, config: CudaConfig) -> Result<CudaBackend, DeviceError> {
        let _ = (first, config);
        Err(not_built())
    }

    /// Records the streams' operations in `recorder` (this value cannot exist).
    pub fn with_recorder(self, recorder: std::sync::Arc<crate::trace::Recorder>) -> CudaBackend {
        let _ = recorder;
        match self.never {}
    }

    /// Names of the GPUs (none: this value cannot exist).
    pub fn device_names(&self) -> Vec<String> {
        match self.never {}
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
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
