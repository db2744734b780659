//! The CUDA backend on cudarc (feature `cuda`): devices are `CudaContext`s, streams are
//! non-blocking CUDA streams, pools are device allocations, kernels are CUDA C compiled by
//! NVRTC (built-ins) or user CUDA C / PTX.
//!
//! Under construction: the modules below arrive with the backend (`instance.rs`,
//! `device.rs`, `memory.rs`, `stream.rs`, `kernels.rs`, the same files and roles as the
//! Vulkan backend's).
