//! The CUDA backend on cudarc (feature `cuda`): devices are `CudaContext`s, streams are
//! non-blocking CUDA streams, pools are device allocations, kernels are CUDA C compiled by
//! NVRTC (built-ins) or user CUDA C / PTX.
//!
//! Under construction: the modules below arrive with the backend (`instance.rs`,
//! `device.rs`, `memory.rs`, `stream.rs`, `kernels.rs`, the same files and roles as the
//! Vulkan backend's).
//!
//! **Kernels** ([`kernels`]): a routine's kernel becomes a list of [`kernels::Launch`]es
//! (program, entry point, grid, block, ordered parameters) computed without a driver by
//! [`kernels::kernel_launches`]; the built-ins are CUDA C, one program per dtype, compiled
//! by NVRTC once per device, bitwise equal to the CPU backend for element-wise ops.
//! `tests/cuda_kernels.rs` compiles every program with NVRTC and assembles it with
//! `ptxas` for `sm_80` and `sm_90` where those tools are installed (CI installs them).

pub mod kernels;
