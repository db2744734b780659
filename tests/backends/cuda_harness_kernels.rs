//! The CUDA kernels the end-to-end tests use on CUDA (`tributary_testkit::support`: the
//! slow writers and readers, the failing kernel) checked with NVRTC on any machine, so that
//! a GPU run does not find them broken: the spinning ones compile for `compute_80`, the
//! failing one does not, and NVRTC's log carries its message. Skips with a reason where
//! NVRTC is missing (a failure under `TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK=1`, which
//! `.ci/run` sets).
#![cfg(not(tributary_loom))]

use support::{failing, node, shared, slow_copy_on, slow_fill_times, Kind};
use tributary::{
    backend::cuda::kernels::nvrtc::{compile_to_ptx, nvrtc_available},
    kernels::{CudaSource, Kernel, RoutineSpec},
};
use tributary_testkit::support;

fn cuda_c(spec: &RoutineSpec) -> (String, String) {
    match &spec.kernel {
        Kernel::Cuda(k) => match &k.source {
            CudaSource::CudaC(src) => (src.to_string(), k.entry_point.clone()),
            other => panic!("{}: not CUDA C: {other:?}", spec.name),
        },
        other => panic!("{}: not a CUDA kernel: {other:?}", spec.name),
    }
}

#[test]
fn harness_kernels_compile_and_the_failing_one_fails_with_its_message() {
    if let Err(reason) = nvrtc_available() {
        assert!(
            std::env::var("TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK").as_deref() != Ok("1"),
            "TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK=1 but NVRTC is unavailable: {reason}"
        );
        support::log(&format!("skipping CUDA harness kernel check: {reason}"));
        return;
    }
    let (x, y) = (node("x", shared()), node("y", shared()));
    for spec in [
        slow_fill_times(Kind::Cuda, &x, 3.0, 2),
        slow_copy_on(Kind::Cuda, &y, &x),
    ] {
        let (src, entry) = cuda_c(&spec);
        let ptx = compile_to_ptx(&src, "harness.cu", "compute_80", &[])
            .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
        assert!(
            ptx.contains(&format!(".entry {entry}")),
            "{}: {ptx}",
            spec.name
        );
    }
    let (src, _) = cuda_c(&failing(Kind::Cuda, "boom", &x, "kernel exploded"));
    let err = compile_to_ptx(&src, "harness.cu", "compute_80", &[]).expect_err("an #error");
    assert!(err.contains("kernel exploded"), "{err}");
    support::log("CUDA harness kernels: 2 compile, the failing one fails with its message");
}
