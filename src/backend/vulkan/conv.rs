//! Error mapping at the backend edge: Vulkan result codes, loader and gpu-allocator errors
//! become the shared [`DeviceError`]. Nothing else in the crate sees a `vk::Result`.

use ash::vk;
use gpu_allocator::AllocationError;

use crate::error::DeviceError;

/// Maps the error of a call that allocates or may find the device lost.
///
/// - `ERROR_OUT_OF_HOST_MEMORY`, `ERROR_OUT_OF_DEVICE_MEMORY`, `ERROR_OUT_OF_POOL_MEMORY`
///   → [`DeviceError::OutOfMemory`] with `requested` bytes (0 when not an allocation);
/// - `ERROR_DEVICE_LOST` → [`DeviceError::Lost`];
/// - anything else → [`DeviceError::Unexpected`] naming the call.
pub(super) fn map_oom_and_lost(what: &str, requested: u64, r: vk::Result) -> DeviceError {
    match r {
        vk::Result::ERROR_OUT_OF_HOST_MEMORY
        | vk::Result::ERROR_OUT_OF_DEVICE_MEMORY
        | vk::Result::ERROR_OUT_OF_POOL_MEMORY => DeviceError::OutOfMemory { requested },
        vk::Result::ERROR_DEVICE_LOST => DeviceError::Lost(format!("{what}: {r}")),
        other => DeviceError::Unexpected(format!("{what}: {other}")),
    }
}

/// Maps the error of instance or device creation.
///
/// - `ERROR_INCOMPATIBLE_DRIVER`, `ERROR_INITIALIZATION_FAILED`, `ERROR_LAYER_NOT_PRESENT`,
///   `ERROR_EXTENSION_NOT_PRESENT`, `ERROR_FEATURE_NOT_PRESENT` →
///   [`DeviceError::Unavailable`] (no usable driver here);
/// - otherwise as [`map_oom_and_lost`].
pub(super) fn map_init_err(what: &str, r: vk::Result) -> DeviceError {
    match r {
        vk::Result::ERROR_INCOMPATIBLE_DRIVER
        | vk::Result::ERROR_INITIALIZATION_FAILED
        | vk::Result::ERROR_LAYER_NOT_PRESENT
        | vk::Result::ERROR_EXTENSION_NOT_PRESENT
        | vk::Result::ERROR_FEATURE_NOT_PRESENT => DeviceError::Unavailable(format!("{what}: {r}")),
        other => map_oom_and_lost(what, 0, other),
    }
}

/// Maps a failure to load the Vulkan loader library to [`DeviceError::Unavailable`].
pub(super) fn map_loading_err(e: ash::LoadingError) -> DeviceError {
    DeviceError::Unavailable(format!("cannot load the Vulkan loader: {e}"))
}

/// Maps a gpu-allocator error.
///
/// - `OutOfMemory` → [`DeviceError::OutOfMemory`] with `requested` bytes;
/// - `NoCompatibleMemoryTypeFound` → [`DeviceError::Unavailable`] (this device cannot hold
///   such a buffer at all);
/// - anything else → [`DeviceError::Unexpected`].
pub(super) fn map_alloc_err(requested: u64, e: AllocationError) -> DeviceError {
    match e {
        AllocationError::OutOfMemory => DeviceError::OutOfMemory { requested },
        AllocationError::NoCompatibleMemoryTypeFound => {
            DeviceError::Unavailable(format!("allocation of {requested} bytes: {e}"))
        }
        other => DeviceError::Unexpected(format!("allocation of {requested} bytes: {other}")),
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_the_shared_error() {
        assert_eq!(
            map_oom_and_lost("x", 7, vk::Result::ERROR_OUT_OF_DEVICE_MEMORY),
            DeviceError::OutOfMemory { requested: 7 }
        );
        assert!(matches!(
            map_oom_and_lost("x", 0, vk::Result::ERROR_DEVICE_LOST),
            DeviceError::Lost(_)
        ));
        assert!(matches!(
            map_init_err("x", vk::Result::ERROR_INCOMPATIBLE_DRIVER),
            DeviceError::Unavailable(_)
        ));
        assert!(matches!(
            map_init_err("x", vk::Result::ERROR_UNKNOWN),
            DeviceError::Unexpected(_)
        ));
        assert_eq!(
            map_alloc_err(9, AllocationError::OutOfMemory),
            DeviceError::OutOfMemory { requested: 9 }
        );
    }
}
