//! Without a usable Vulkan driver the backend is unavailable as a value, never a panic: at
//! the backend, through `BackendKind`, and through `System`.
//!
//! Not in the backends suite (`tests/backends/`): alone in its own test binary, because it
//! points the Vulkan loader at a driver manifest that does not exist (`VK_ICD_FILENAMES`,
//! set for the whole process), which would make every Vulkan test of a shared binary
//! unavailable, or fail under `TRIBUTARY_REQUIRE_VULKAN=1`.
#![cfg(not(tributary_loom))]

use tributary::{
    backend::{
        vulkan::{probe, VulkanBackend, VulkanConfig},
        BackendKind,
    },
    DeviceError, DeviceId, Error,
};
use tributary_actors::System;

#[test]
fn no_driver_is_unavailable_not_a_panic() {
    // This binary has no other test, so nothing reads the environment concurrently.
    std::env::set_var("VK_ICD_FILENAMES", "/nonexistent/tributary_icd.json");
    std::env::remove_var("VK_DRIVER_FILES");
    let unavailable = |e: &DeviceError| matches!(e, DeviceError::Unavailable(_));
    let err = probe().expect_err("no driver");
    assert!(unavailable(&err), "{err}");
    let err =
        VulkanBackend::new(DeviceId(0), VulkanConfig::with_devices(2)).expect_err("no driver");
    assert!(unavailable(&err), "{err}");
    let kind = BackendKind::Vulkan(VulkanConfig::default());
    let err = kind.create(0).err().expect("no driver");
    assert!(unavailable(&err), "{err}");
    match System::builder().backend(kind).spawn() {
        Err(Error::Device(e)) => assert!(unavailable(&e), "{e}"),
        Err(other) => panic!("expected an unavailable device, got {other}"),
        Ok(_) => panic!("a Vulkan system without a driver"),
    }
    // The CPU backend is unaffected.
    let sys = System::builder()
        .backend(BackendKind::Cpu)
        .spawn()
        .expect("cpu");
    sys.shutdown().expect("shutdown");
}
