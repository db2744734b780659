//! The backends suite: the same behaviour from every backend, and the CUDA backend's
//! kernels and availability, in one test binary (`cargo test --test backends`; a test's
//! path is `<module>::<name>`).
//!
//! - `backend_conformance`: one conformance suite run on every backend present;
//! - `cuda_kernels`: every built-in CUDA kernel compiled with NVRTC and ptxas, and run on
//!   the host against the CPU backend (no GPU needed);
//! - `cuda_harness_kernels`: the tests' own CUDA kernels compile;
//! - `cuda_unavailable`: without a CUDA driver the backend is unavailable as a value.
//!
//! `vulkan_unavailable` is not here: it changes the process's environment (its own binary,
//! `tests/vulkan_unavailable.rs`). Shared support is the `tributary-testkit` crate.

mod backend_conformance;
mod cuda_harness_kernels;
mod cuda_kernels;
mod cuda_unavailable;
