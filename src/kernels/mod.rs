//! Kernels: what a routine runs, before it is linked into a context.
//!
//! A [`RoutineSpec`] is a kernel together with the tensor nodes it touches, in argument
//! order, each with its [`Access`] (read, write or both), plus the node expected in the
//! stream's merge buffer, if any (DESIGN.md §2, "Routine" and "Merge buffer"). Linking a
//! spec into a context gives a routine.
//!
//! Kernels come in two kinds ([`Kernel`]):
//!
//! - [`Builtin`]: the portable built-ins every backend implements (DESIGN.md §5). They are
//!   plain data (serialisable), built by the constructor functions of this module
//!   ([`fill`], [`copy`], [`add_into`], [`add_merge`], [`copy_merge`], [`scale`], [`axpy`], [`sgd_step`],
//!   [`matmul`], [`matmul_tn`], [`matmul_nt`], [`add_row_bias`], [`relu`],
//!   [`relu_backward`], [`sum_rows`], [`softmax_xent`], [`mul`]), which check dtypes and
//!   shapes and return typed errors ([`Error::DTypeMismatch`](crate::Error::DTypeMismatch),
//!   [`Error::SizeMismatch`](crate::Error::SizeMismatch),
//!   [`Error::InvalidRoutine`](crate::Error::InvalidRoutine)).
//! - [`CpuKernel`]: a Rust closure over typed views ([`KernelArgs`]), for the CPU backend
//!   ([`RoutineSpec::custom`]).
//! - [`ShaderKernel`]: a compute shader (WGSL or SPIR-V) for the Vulkan backend
//!   ([`RoutineSpec::shader`]).
//! - [`CudaKernel`]: a CUDA kernel (CUDA C or PTX) for the CUDA backend
//!   ([`RoutineSpec::cuda`]).
//!
//! [`run_cpu`] runs either kind over [`KernelArgs`]; [`run_on_host`] runs a spec on plain
//! byte vectors (tests, the engine's sequential reference interpreter).
//!
//! **Bindings.** A routine may declare named integer indices
//! ([`RoutineSpec::with_index`]) whose values each schedule gives, snapshotted into the
//! plan ([`Bindings`]; the `bindings` module explains why and how each backend passes them).
//!
//! **Determinism.** Every CPU built-in runs sequentially, without threads, so results are
//! bitwise reproducible. In [`KernelMode::Exact`] each follows the order of floating-point
//! operations documented per built-in, without fused multiply-adds; the default
//! [`KernelMode::Fast`] runs the matmuls on blocked kernels instead (DESIGN.md §5). `f16`
//! and `bf16` arithmetic converts each element to `f32`, computes in `f32` and rounds the
//! result back (ties to even).
//!
//! Files: `kind.rs` (the kernel kinds), `builtin.rs` (the built-in table and constructors),
//! `spec.rs` ([`RoutineSpec`]), `bindings.rs` (indices), `args.rs` (typed views), `cpu.rs`
//! (running kernels on the host).

mod args;
mod bindings;
mod builtin;
mod cpu;
mod kind;
mod spec;

pub use args::{from_bytes, to_bytes, ArgError, ArgSlot, ArgView, KernelArgs};
pub use bindings::{Bindings, IndexDecl, IndexType, IntoBindings, MAX_INDICES};
pub use builtin::{
    add_into, add_merge, add_row_bias, axpy, copy, copy_merge, copy_range, fill, matmul, matmul_nt,
    matmul_tn, mul, relu, relu_backward, scale, scale_in_place, sgd_step, softmax_xent, sum_rows,
    Builtin,
};
pub use cpu::{run_cpu, run_on_host, run_on_host_with, KernelMode};
pub(crate) use cpu::{CUDA_ON_CPU, SHADER_ON_CPU};
pub use kind::{
    CpuKernel, CpuKernelFn, CudaKernel, CudaScalar, CudaSource, Kernel, ShaderKernel, ShaderSource,
};
pub use spec::{Access, Param, RoutineSpec};
