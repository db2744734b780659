//! Kernels: what a routine runs, before it is linked into a context. See DESIGN.md §2,
//! "Routine".
//!
//! A [`RoutineSpec`] is a kernel with the tensor nodes it touches, in argument order, each with
//! its [`Access`]. It may also name the node expected in the stream's merge buffer, and
//! declare named integer indices, [`Bindings`]. A [`Kernel`] is one of four kinds:
//!
//! - [`Builtin`]: the portable built-ins every backend implements, as serialisable data. This
//!   module's constructors, such as [`fill`], [`add_merge`] and [`matmul`], check dtypes and
//!   shapes and return typed errors.
//! - [`CpuKernel`]: a Rust closure over [`KernelArgs`] for the CPU; see [`RoutineSpec::custom`].
//! - [`ShaderKernel`]: a WGSL or SPIR-V shader for Vulkan; see [`RoutineSpec::shader`].
//! - [`CudaKernel`]: CUDA C or PTX for CUDA; see [`RoutineSpec::cuda`].
//!
//! [`run_cpu`] runs a built-in or a closure over [`KernelArgs`]. [`run_on_host`] runs a spec
//! on plain byte vectors, for tests and the sequential reference interpreter.
//!
//! Every CPU built-in runs sequentially, so its results are reproducible bit for bit. In
//! [`KernelMode::Exact`] each follows the operation order documented per built-in, without
//! fused multiply-adds. The default, [`KernelMode::Fast`], runs the matmuls on blocked kernels;
//! see DESIGN.md §5. `f16` and `bf16` are computed in `f32` and rounded back, ties to even.

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
