//! Without a CUDA driver (every CI machine, most developer machines) the CUDA backend is
//! unavailable as a value, never a panic: at the backend, through `BackendKind`, through an
//! `Engine`'s backend and through `System` (with and without a timeline recorder). Where a
//! GPU is present the same calls succeed instead.
#![cfg(not(tributary_loom))]

use tributary::{
    backend::{
        cuda::{probe, CudaBackend, CudaConfig},
        BackendKind,
    },
    DeviceError, DeviceId, Error,
};
use tributary_actors::System;

fn unavailable(e: &DeviceError) -> bool {
    matches!(e, DeviceError::Unavailable(_))
}

#[test]
fn no_driver_is_unavailable_not_a_panic() {
    let kind = BackendKind::Cuda(CudaConfig::with_devices(2));
    match probe() {
        Err(reason) => {
            assert!(unavailable(&reason), "{reason}");
            eprintln!("no CUDA here, as expected on a machine without a GPU: {reason}");
            let err = CudaBackend::new(DeviceId(0), CudaConfig::default()).expect_err("no GPU");
            assert!(unavailable(&err), "{err}");
            // What an Engine is built on.
            let err = kind.create(0).err().expect("no GPU");
            assert!(unavailable(&err), "{err}");
            assert!(matches!(Error::from(err), Error::Device(e) if unavailable(&e)));
            for record in [false, true] {
                match System::builder()
                    .backend(kind.clone())
                    .record_timeline(record)
                    .spawn()
                {
                    Err(Error::Device(e)) => assert!(unavailable(&e), "{e}"),
                    Err(other) => panic!("expected an unavailable device, got {other}"),
                    Ok(_) => panic!("a CUDA system without a driver"),
                }
            }
        }
        Ok(info) => {
            eprintln!("CUDA {} present: {:?}", info.driver_version, info.devices);
            let sys = System::builder()
                .backend(kind)
                .record_timeline(true)
                .spawn()
                .expect("a CUDA system where a GPU is present");
            let d = sys.device_info(0).expect("device 0");
            assert_eq!(d.backend, "cuda");
            sys.shutdown().expect("shutdown");
        }
    }
    // The CPU backend is unaffected.
    let sys = System::builder()
        .backend(BackendKind::Cpu)
        .spawn()
        .expect("cpu");
    sys.shutdown().expect("shutdown");
}
