//! The kinds of kernel a routine can run. [`Kernel`] is the choice: a Rust closure
//! [`CpuKernel`], a Vulkan compute shader [`ShaderKernel`], a CUDA kernel [`CudaKernel`], or a
//! portable `Builtin`.

use std::{fmt, sync::Arc};

use super::{args::KernelArgs, Builtin};

/// A Rust kernel for the CPU backend: a closure over typed views of its arguments.
///
/// It returns `Err(message)` to fail the routine (DESIGN.md §3, rule 6). It must not keep
/// pointers into the views beyond the call.
#[derive(Clone)]
pub struct CpuKernel(pub Arc<CpuKernelFn>);

/// The closure type behind a [`CpuKernel`].
pub type CpuKernelFn = dyn Fn(&KernelArgs<'_>) -> Result<(), String> + Send + Sync;

impl CpuKernel {
    /// Wraps a closure.
    pub fn new(f: impl Fn(&KernelArgs<'_>) -> Result<(), String> + Send + Sync + 'static) -> Self {
        CpuKernel(Arc::new(f))
    }

    /// Calls the closure.
    pub fn call(&self, args: &KernelArgs<'_>) -> Result<(), String> {
        (self.0)(args)
    }
}

impl fmt::Debug for CpuKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CpuKernel(..)")
    }
}

/// What a routine computes.
#[derive(Clone, Debug)]
pub enum Kernel {
    /// A portable built-in, implemented by every backend.
    Builtin(Builtin),
    /// A Rust closure; runs on CPU devices only.
    Cpu(CpuKernel),
    /// A compute shader (WGSL or SPIR-V); runs on Vulkan devices only.
    Shader(ShaderKernel),
    /// A CUDA kernel (CUDA C or PTX); runs on CUDA devices only.
    Cuda(CudaKernel),
}

/// The code of a [`ShaderKernel`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ShaderSource {
    /// WGSL source, compiled to SPIR-V by the backend (naga).
    Wgsl(Arc<str>),
    /// SPIR-V words, used as they are.
    SpirV(Arc<[u32]>),
}

/// A user compute shader for GPU backends (Vulkan).
///
/// Binding interface: parameter `i` of the routine is the storage buffer at
/// `@group(0) @binding(i)`, bound over the node's buffer rounded up to whole 4-byte words
/// (so `arrayLength` of an `array<u32>` over 5 `u8` elements is 2); the merge buffer, if the
/// routine reads one, is binding `params.len()`; `immediates` are the push constants (WGSL
/// `var<immediate>`). The values of the routine's declared indices
/// ([`RoutineSpec::with_index`](super::RoutineSpec::with_index)) follow the immediates in the same push-constant block, in
/// declaration order, each at the next multiple of its size (4 bytes for `u32`/`i32`, 8 for
/// `i64`, as a `vec2<u32>` low word first), exactly where further members of a WGSL struct
/// would be: `struct P { n: u32, alpha: f32, t: u32 }` over 8 bytes of immediates and an
/// index `t`. Immediates and indices together must fit the device's push constants
/// (128 bytes on lavapipe; checked at link, [`Error::PushConstantsTooLarge`](crate::Error::PushConstantsTooLarge)). The backend
/// dispatches `workgroups` once; the shader must bound its own indices. Like every kernel,
/// it must write every element of its `Write` parameters.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShaderKernel {
    /// The code.
    pub source: ShaderSource,
    /// The entry point (`main` by default).
    pub entry_point: String,
    /// Workgroups dispatched along x, y and z.
    pub workgroups: [u32; 3],
    /// Push-constant bytes.
    pub immediates: Vec<u8>,
}

impl ShaderKernel {
    /// A WGSL shader with entry point `main`, dispatched over `workgroups`.
    pub fn wgsl(source: impl Into<Arc<str>>, workgroups: [u32; 3]) -> ShaderKernel {
        ShaderKernel {
            source: ShaderSource::Wgsl(source.into()),
            entry_point: "main".into(),
            workgroups,
            immediates: Vec::new(),
        }
    }

    /// A SPIR-V module with entry point `main`, dispatched over `workgroups`.
    pub fn spirv(words: impl Into<Arc<[u32]>>, workgroups: [u32; 3]) -> ShaderKernel {
        ShaderKernel {
            source: ShaderSource::SpirV(words.into()),
            entry_point: "main".into(),
            workgroups,
            immediates: Vec::new(),
        }
    }

    /// Sets the push-constant bytes.
    pub fn with_immediates(mut self, bytes: impl Into<Vec<u8>>) -> ShaderKernel {
        self.immediates = bytes.into();
        self
    }

    /// Sets the entry point.
    pub fn with_entry_point(mut self, name: impl Into<String>) -> ShaderKernel {
        self.entry_point = name.into();
        self
    }
}

/// The code of a [`CudaKernel`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CudaSource {
    /// CUDA C source, compiled to PTX by the backend (NVRTC, once per device, cached).
    /// It is compiled without headers: use the built-in device functions only.
    CudaC(Arc<str>),
    /// PTX text, loaded as it is.
    Ptx(Arc<str>),
}

/// A scalar argument of a [`CudaKernel`], passed by value after the buffers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CudaScalar {
    /// C `unsigned int`.
    U32(u32),
    /// C `unsigned long long`.
    U64(u64),
    /// C `int`.
    I32(i32),
    /// C `long long`.
    I64(i64),
    /// C `float`.
    F32(f32),
    /// C `double`.
    F64(f64),
}

/// A user kernel for CUDA devices.
///
/// Parameter interface (C): parameter `i` of the routine is a device pointer to the node's
/// buffer (`T* p_i`, in argument order), then the merge buffer's pointer if the routine
/// reads one, then `scalars` by value in order, then the values of the routine's declared
/// indices ([`RoutineSpec::with_index`](super::RoutineSpec::with_index)) in declaration order (`unsigned int` for `u32`,
/// `int` for `i32`, `long long` for `i64`); for example `extern "C" __global__ void
/// f(float* y, const float* x, unsigned long long n, float alpha, unsigned int t)`. Buffers are aligned to
/// at least their element size. The backend launches `grid` blocks of `block` threads with
/// `shared_mem_bytes` of dynamic shared memory once; the kernel must bound its own indices
/// and, like every kernel, write every element of its `Write` parameters. A grid or block
/// with a zero dimension launches nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaKernel {
    /// The code.
    pub source: CudaSource,
    /// The entry point (an `extern "C" __global__` function).
    pub entry_point: String,
    /// Blocks along x, y and z.
    pub grid: [u32; 3],
    /// Threads per block along x, y and z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
    /// Scalar arguments, after the buffers.
    pub scalars: Vec<CudaScalar>,
}

impl CudaKernel {
    /// CUDA C source with entry point `entry_point`, launched as `grid` blocks of `block`
    /// threads.
    pub fn cuda_c(
        source: impl Into<Arc<str>>,
        entry_point: impl Into<String>,
        grid: [u32; 3],
        block: [u32; 3],
    ) -> CudaKernel {
        CudaKernel {
            source: CudaSource::CudaC(source.into()),
            entry_point: entry_point.into(),
            grid,
            block,
            shared_mem_bytes: 0,
            scalars: Vec::new(),
        }
    }

    /// PTX text with entry point `entry_point`, launched as `grid` blocks of `block`
    /// threads.
    pub fn ptx(
        source: impl Into<Arc<str>>,
        entry_point: impl Into<String>,
        grid: [u32; 3],
        block: [u32; 3],
    ) -> CudaKernel {
        CudaKernel {
            source: CudaSource::Ptx(source.into()),
            ..CudaKernel::cuda_c("", entry_point, grid, block)
        }
    }

    /// Sets the scalar arguments.
    pub fn with_scalars(mut self, scalars: impl Into<Vec<CudaScalar>>) -> CudaKernel {
        self.scalars = scalars.into();
        self
    }

    /// Sets the dynamic shared memory per block.
    pub fn with_shared_mem_bytes(mut self, bytes: u32) -> CudaKernel {
        self.shared_mem_bytes = bytes;
        self
    }
}
