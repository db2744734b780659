//! Routine specs, kernels, and the constructors of the built-ins.

use std::{collections::HashSet, fmt, sync::Arc};

use serde::{Deserialize, Serialize};

use super::{
    args::KernelArgs,
    bindings::{Bindings, IndexDecl, IndexType, MAX_INDICES},
};
use crate::{
    error::{Error, Result},
    node::{DType, TensorNode},
};

pub use crate::param::Access;

/// One argument of a routine: a node and how the routine uses it.
#[derive(Clone, Debug)]
pub struct Param {
    /// The node.
    pub node: TensorNode,
    /// How it is used.
    pub access: Access,
}

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
/// ([`RoutineSpec::with_index`]) follow the immediates in the same push-constant block, in
/// declaration order, each at the next multiple of its size (4 bytes for `u32`/`i32`, 8 for
/// `i64`, as a `vec2<u32>` low word first), exactly where further members of a WGSL struct
/// would be: `struct P { n: u32, alpha: f32, t: u32 }` over 8 bytes of immediates and an
/// index `t`. Immediates and indices together must fit the device's push constants
/// (128 bytes on lavapipe; checked at link, [`Error::PushConstantsTooLarge`]). The backend
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
/// indices ([`RoutineSpec::with_index`]) in declaration order (`unsigned int` for `u32`,
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

/// The portable built-in kernels (DESIGN.md §5).
///
/// Each variant documents its parameters in argument order (the order of
/// [`RoutineSpec::params`]) with their access, the dtypes it supports and its formula.
/// Dimensions are stored in the variant so that a backend needs nothing but the variant
/// and the buffers; a backend must refuse buffers that disagree with them.
///
/// Arithmetic on `f16`/`bf16` widens each element to `f32`, computes in `f32` and rounds
/// the result back. Scalars (`value`, `alpha`, `lr`, `grad_scale`) are stored as `f64` and
/// rounded to the computation type (`f32` for `f32`, `f16`, `bf16`) first.
/// "Floats" below means `f32`, `f64`, `f16` and `bf16`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Builtin {
    /// `fill(dst: Write)`: `dst[i] = value`, every dtype. Floats round `value` to the
    /// nearest (`f16`/`bf16` through `f32`); `i32`/`u8` cast with Rust's saturating `as`
    /// (NaN becomes 0).
    Fill {
        /// The value written.
        value: f64,
    },
    /// `copy(dst: Write, src: Read)`: bitwise copy, every dtype; same dtype and element
    /// count (shapes may differ: a reshaping copy).
    Copy,
    /// `add_into(dst: ReadWrite, src: Read)`: `dst[i] = dst[i] + src[i]`. Floats and `i32`
    /// (wrapping on overflow).
    AddInto,
    /// `add_merge(dst: ReadWrite)`, merge node = `dst`: `dst[i] = dst[i] + merge[i]` where
    /// `merge` is the stream's merge buffer holding a copy of `dst` from another context.
    /// Floats and `i32` (wrapping).
    AddMerge,
    /// `copy_merge(dst: Write)`, merge node = `dst`: `dst[i] = merge[i]`, bitwise, where
    /// `merge` is the stream's merge buffer holding a copy of `dst` from another context
    /// (OCANNL's `dst =: merge`). Every dtype.
    CopyMerge,
    /// `scale(dst: Write, src: Read)`: `dst[i] = alpha * src[i]`. Floats.
    Scale {
        /// The factor.
        alpha: f64,
    },
    /// `axpy(y: ReadWrite, x: Read)`: `y[i] = y[i] + (alpha * x[i])` (two roundings, no
    /// fused multiply-add). Floats.
    Axpy {
        /// The factor.
        alpha: f64,
    },
    /// `sgd_step(w: ReadWrite, g: Read)`: `w[i] = w[i] - (lr * g[i])`. Floats.
    SgdStep {
        /// The learning rate.
        lr: f64,
    },
    /// `matmul(c: Write, a: Read, b: Read)`, `a: [m,k]`, `b: [k,n]`, `c: [m,n]`, row-major:
    /// `c[i,j] = Σ_p a[i,p] * b[p,j]`, summed from 0 in increasing `p` (loop order i-p-j).
    /// Floats: `f16`/`bf16` summed in `f32`, rounded once. That order is the CPU's
    /// [`KernelMode::Exact`](super::KernelMode::Exact), which the GPU backends reproduce;
    /// the CPU's default [`KernelMode::Fast`](super::KernelMode::Fast) sums in blocks.
    Matmul {
        /// Rows of `a` and `c`.
        m: usize,
        /// Columns of `a`, rows of `b`.
        k: usize,
        /// Columns of `b` and `c`.
        n: usize,
    },
    /// `matmul_tn(c: Write, a: Read, b: Read)`, `a: [k,m]`, `b: [k,n]`, `c: [m,n]`:
    /// `c = aᵀ b`, `c[i,j] = Σ_p a[p,i] * b[p,j]`, summed as [`Builtin::Matmul`] (loop
    /// order p-i-j). Floats. (Weight gradient: `dW = xᵀ dy`.)
    MatmulTn {
        /// Columns of `a`, rows of `c`.
        m: usize,
        /// Rows of `a` and `b`.
        k: usize,
        /// Columns of `b` and `c`.
        n: usize,
    },
    /// `matmul_nt(c: Write, a: Read, b: Read)`, `a: [m,k]`, `b: [n,k]`, `c: [m,n]`:
    /// `c = a bᵀ`, `c[i,j] = Σ_p a[i,p] * b[j,p]`, summed as [`Builtin::Matmul`] (loop
    /// order i-j-p, row dot products). Floats. (Input gradient: `dx = dy Wᵀ`.)
    MatmulNt {
        /// Rows of `a` and `c`.
        m: usize,
        /// Columns of `a` and `b`.
        k: usize,
        /// Rows of `b`, columns of `c`.
        n: usize,
    },
    /// `add_row_bias(dst: ReadWrite, bias: Read)`, `dst: [m,n]`, `bias`: `n` elements:
    /// `dst[i,j] = dst[i,j] + bias[j]`. Floats.
    AddRowBias {
        /// Rows of `dst`.
        m: usize,
        /// Columns of `dst`, elements of `bias`.
        n: usize,
    },
    /// `relu(dst: Write, src: Read)`: `dst[i] = src[i]` if `src[i] > 0` or `src[i]` is NaN,
    /// else `+0`. Floats.
    Relu,
    /// `relu_backward(dgrad_in: Write, grad_out: Read, pre_activation: Read)`:
    /// `dgrad_in[i] = grad_out[i]` if `pre_activation[i] > 0`, else `+0`. Floats.
    ReluBackward,
    /// `sum_rows(dst: Write, src: Read)`, `src: [m,n]`, `dst`: `n` elements: column sums,
    /// `dst[j] = Σ_i src[i,j]`, summed from 0 in increasing `i` in the computation type
    /// and rounded once at the end. Floats. (Bias gradient: `db = Σ_rows dy`.)
    SumRows {
        /// Rows of `src`.
        m: usize,
        /// Columns of `src`, elements of `dst`.
        n: usize,
    },
    /// `softmax_xent(loss: Write, dlogits: Write, logits: Read, labels: Read)`,
    /// `logits: [m,c]`, `dlogits` and `labels`: `m*c` elements, `loss`: 1 element. Per row
    /// `i`, with `z = logits[i,·]`, `y = labels[i,·]` (one-hot, or any distribution):
    ///
    /// - `mx = max_j z_j` (first to last), `s = Σ_j exp(z_j - mx)`, `lse = mx + ln(s)`;
    /// - `loss_i = Σ_j y_j * (lse - z_j)`, the cross-entropy `-Σ_j y_j log softmax(z)_j`;
    /// - `dlogits[i,j] = (exp(z_j - mx) / s - y_j) * grad_scale`.
    ///
    /// `loss[0] = Σ_i loss_i`, the *sum* over rows (in increasing `i`); divide by the
    /// batch size for the mean. `dlogits` is `grad_scale` times the gradient of the sum
    /// when every label row sums to 1 (so `grad_scale = 1/m_total` gives the gradient of
    /// the mean over a global batch of `m_total` rows). Sums run in increasing `j`. Floats.
    SoftmaxXent {
        /// Rows (batch).
        m: usize,
        /// Classes.
        c: usize,
        /// Factor applied to the gradient.
        grad_scale: f64,
    },
    /// `mul(dst: Write, a: Read, b: Read)`: `dst[i] = a[i] * b[i]`. Floats.
    Mul,
    /// `scale_in_place(x: ReadWrite)`: `x[i] = alpha * x[i]`. Floats. (The mean of an
    /// all-reduce.)
    ScaleInPlace {
        /// The factor.
        alpha: f64,
    },
    /// `copy_range(dst: ReadWrite, src: Read)`: `dst[dst_offset + i] = src[src_offset + i]`
    /// for `i < len` (elements), bitwise; the rest of `dst` is unchanged. Every dtype.
    /// (Packing gradients into buckets and unpacking them.)
    CopyRange {
        /// First element written in `dst`.
        dst_offset: usize,
        /// First element read in `src`.
        src_offset: usize,
        /// Elements copied.
        len: usize,
    },
}

const FLOATS: &[DType] = &[DType::F32, DType::F64, DType::F16, DType::BF16];
const ADDABLE: &[DType] = &[DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32];
const ALL: &[DType] = &DType::ALL;

impl Builtin {
    /// The built-in's name (the constructor's name).
    pub const fn name(&self) -> &'static str {
        match self {
            Builtin::Fill { .. } => "fill",
            Builtin::Copy => "copy",
            Builtin::AddInto => "add_into",
            Builtin::AddMerge => "add_merge",
            Builtin::CopyMerge => "copy_merge",
            Builtin::Scale { .. } => "scale",
            Builtin::Axpy { .. } => "axpy",
            Builtin::SgdStep { .. } => "sgd_step",
            Builtin::Matmul { .. } => "matmul",
            Builtin::MatmulTn { .. } => "matmul_tn",
            Builtin::MatmulNt { .. } => "matmul_nt",
            Builtin::AddRowBias { .. } => "add_row_bias",
            Builtin::Relu => "relu",
            Builtin::ReluBackward => "relu_backward",
            Builtin::SumRows { .. } => "sum_rows",
            Builtin::SoftmaxXent { .. } => "softmax_xent",
            Builtin::Mul => "mul",
            Builtin::ScaleInPlace { .. } => "scale_in_place",
            Builtin::CopyRange { .. } => "copy_range",
        }
    }

    /// The access of each parameter, in argument order.
    pub const fn accesses(&self) -> &'static [Access] {
        use Access::{Read as R, ReadWrite as RW, Write as W};
        match self {
            Builtin::Fill { .. } | Builtin::CopyMerge => &[W],
            Builtin::AddMerge | Builtin::ScaleInPlace { .. } => &[RW],
            Builtin::Copy | Builtin::Scale { .. } | Builtin::Relu | Builtin::SumRows { .. } => {
                &[W, R]
            }
            Builtin::AddInto
            | Builtin::Axpy { .. }
            | Builtin::SgdStep { .. }
            | Builtin::AddRowBias { .. }
            | Builtin::CopyRange { .. } => &[RW, R],
            Builtin::Matmul { .. }
            | Builtin::MatmulTn { .. }
            | Builtin::MatmulNt { .. }
            | Builtin::ReluBackward
            | Builtin::Mul => &[W, R, R],
            Builtin::SoftmaxXent { .. } => &[W, W, R, R],
        }
    }

    /// Whether the built-in reads its stream's merge buffer.
    pub const fn uses_merge(&self) -> bool {
        matches!(self, Builtin::AddMerge | Builtin::CopyMerge)
    }

    /// The dtypes it supports (all its parameters have the same dtype).
    pub const fn dtypes(&self) -> &'static [DType] {
        match self {
            Builtin::Fill { .. }
            | Builtin::Copy
            | Builtin::CopyMerge
            | Builtin::CopyRange { .. } => ALL,
            Builtin::AddInto | Builtin::AddMerge => ADDABLE,
            Builtin::Matmul { .. }
            | Builtin::MatmulTn { .. }
            | Builtin::MatmulNt { .. }
            | Builtin::Scale { .. }
            | Builtin::Axpy { .. }
            | Builtin::SgdStep { .. }
            | Builtin::AddRowBias { .. }
            | Builtin::Relu
            | Builtin::ReluBackward
            | Builtin::SumRows { .. }
            | Builtin::SoftmaxXent { .. }
            | Builtin::Mul
            | Builtin::ScaleInPlace { .. } => FLOATS,
        }
    }
}

/// A kernel with the nodes it touches, in argument order. Linking it into a context gives
/// a routine.
///
/// Invariants (checked by [`RoutineSpec::new`]): at least one parameter, and no node twice
/// among the parameters. The merge node may also be a parameter (`g += merge(g)`).
/// Declared indices ([`RoutineSpec::with_index`]): at most [`MAX_INDICES`], distinct
/// names, none on a built-in.
#[derive(Clone, Debug)]
pub struct RoutineSpec {
    /// The routine's name (in traces and failures).
    pub name: String,
    /// The nodes, in argument order.
    pub params: Vec<Param>,
    /// The node the routine expects in its stream's merge buffer, if it reads it.
    pub merge: Option<TensorNode>,
    /// What it computes.
    pub kernel: Kernel,
    /// Its declared indices, in order (values given per schedule).
    indices: Vec<IndexDecl>,
}

impl RoutineSpec {
    /// Builds a spec; [`Error::InvalidRoutine`] when `params` is empty or names a node twice.
    ///
    /// Built-in kernels are not checked against the parameters here; use the constructor
    /// functions of [`crate::kernels`], which do.
    pub fn new(
        name: impl Into<String>,
        params: Vec<Param>,
        merge: Option<TensorNode>,
        kernel: Kernel,
    ) -> Result<RoutineSpec> {
        let name = name.into();
        if params.is_empty() {
            return Err(Error::InvalidRoutine {
                routine: name,
                reason: "a routine needs at least one parameter".to_string(),
            });
        }
        let mut seen = HashSet::with_capacity(params.len());
        for p in &params {
            if !seen.insert(p.node.id()) {
                return Err(Error::InvalidRoutine {
                    reason: format!("node {} appears twice among its parameters", p.node),
                    routine: name,
                });
            }
        }
        Ok(RoutineSpec {
            name,
            params,
            merge,
            kernel,
            indices: Vec::new(),
        })
    }

    /// Declares an integer index `name` of type [`IndexType::U32`], whose value each
    /// schedule gives ([`Engine::schedule_with`](crate::Engine::schedule_with)); see
    /// [`RoutineSpec::with_index_typed`].
    ///
    /// ```
    /// use tributary::kernels::{Access, RoutineSpec};
    /// use tributary::{DType, Engine, EngineConfig, Error, TensorNode};
    /// let mut e = Engine::cpu(EngineConfig::default())?;
    /// let y = TensorNode::new("y", DType::U8, [4]);
    /// let spec = RoutineSpec::custom("y = t", vec![(y.clone(), Access::Write)], None, |a| {
    ///     let t = a.index("t")?;
    ///     a.output::<u8>(0)?.fill(t as u8);
    ///     Ok(())
    /// })?
    /// .with_index("t")?;
    /// let root = e.context(0, 0)?;
    /// let r = e.link(&root, spec)?;
    /// e.schedule_with(&r, &[("t", 7)])?;
    /// assert_eq!(e.read::<u8>(r.context(), &y)?, vec![7; 4]);
    /// // A routine with indices cannot be scheduled without their values.
    /// assert!(matches!(e.schedule(&r), Err(Error::MissingBinding { .. })));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn with_index(self, name: &str) -> Result<RoutineSpec> {
        self.with_index_typed(name, IndexType::U32)
    }

    /// Declares an integer index `name` of type `ty`: a value given per schedule, in
    /// `ty`'s range, snapshotted into the plan when the routine is scheduled (never read
    /// when it runs). A CPU closure reads it with
    /// [`KernelArgs::index`](super::KernelArgs::index), a shader as push constants after
    /// its immediates ([`ShaderKernel`]), a CUDA kernel as arguments after its scalars
    /// ([`CudaKernel`]).
    ///
    /// [`Error::InvalidRoutine`] for an empty or repeated name, more than [`MAX_INDICES`]
    /// indices, or a built-in kernel (built-ins read no index).
    ///
    /// ```
    /// use tributary::kernels::{self, Access, IndexType, RoutineSpec};
    /// use tributary::{DType, Error, TensorNode};
    /// let y = TensorNode::new("y", DType::F32, [4]);
    /// let spec = RoutineSpec::custom("f", vec![(y.clone(), Access::Write)], None, |_| Ok(()))?
    ///     .with_index_typed("offset", IndexType::I64)?;
    /// assert_eq!(spec.indices()[0].name(), "offset");
    /// assert!(matches!(spec.with_index("offset"), Err(Error::InvalidRoutine { .. })));
    /// assert!(matches!(kernels::fill(&y, 1.0)?.with_index("t"), Err(Error::InvalidRoutine { .. })));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn with_index_typed(mut self, name: &str, ty: IndexType) -> Result<RoutineSpec> {
        let reason = if name.is_empty() {
            Some("an index needs a name".to_string())
        } else if self.indices.iter().any(|d| d.name() == name) {
            Some(format!("index {name} is declared twice"))
        } else if self.indices.len() >= MAX_INDICES {
            Some(format!(
                "index {name} is one too many: a routine declares at most {MAX_INDICES}"
            ))
        } else if let Kernel::Builtin(b) = &self.kernel {
            Some(format!(
                "index {name}: the built-in {} reads no index",
                b.name()
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(Error::InvalidRoutine {
                routine: self.name,
                reason,
            });
        }
        self.indices.push(IndexDecl::new(name, ty));
        Ok(self)
    }

    /// The declared indices, in order.
    pub fn indices(&self) -> &[IndexDecl] {
        &self.indices
    }

    /// Empty bindings for this spec's indices (for [`run_on_host_with`](super::run_on_host_with)).
    pub fn bindings(&self) -> Bindings {
        Bindings::empty_for(&self.name, &self.indices)
    }

    /// A spec running a Rust closure (CPU devices only); see [`RoutineSpec::new`].
    ///
    /// The closure returns `Err(message)` to fail the routine. Argument accesses return
    /// [`ArgError`](super::ArgError), which converts into `String`, so `?` works on them
    /// as on any `Result<_, String>` (no `.map_err(|e| e.to_string())`):
    ///
    /// ```
    /// use tributary::kernels::{self, Access, RoutineSpec};
    /// use tributary::{DType, TensorNode};
    /// let x = TensorNode::new("x", DType::F32, [3]);
    /// let y = TensorNode::new("y", DType::F32, [3]);
    /// let axpy = RoutineSpec::custom(
    ///     "y += 2x",
    ///     vec![(y.clone(), Access::ReadWrite), (x.clone(), Access::Read)],
    ///     None,
    ///     |args| {
    ///         let x = args.input::<f32>(1)?; // ArgError -> String through `?`
    ///         for (y, x) in args.output::<f32>(0)?.iter_mut().zip(x) {
    ///             *y += 2.0 * x;
    ///         }
    ///         if x.is_empty() {
    ///             return Err("nothing to do".into());
    ///         }
    ///         Ok(())
    ///     },
    /// )?;
    /// // Run on plain byte vectors (the CPU interpreter).
    /// let mut bufs = vec![kernels::to_bytes(&[1f32, 1.0, 1.0]), kernels::to_bytes(&[1f32, 2.0, 3.0])];
    /// kernels::run_on_host(&axpy, &mut bufs, None).expect("runs");
    /// assert_eq!(kernels::from_bytes::<f32>(&bufs[0])?, vec![3.0, 5.0, 7.0]);
    /// # Ok::<(), tributary::Error>(())
    /// ```
    pub fn custom(
        name: impl Into<String>,
        params: Vec<(TensorNode, Access)>,
        merge: Option<TensorNode>,
        f: impl Fn(&KernelArgs<'_>) -> Result<(), String> + Send + Sync + 'static,
    ) -> Result<RoutineSpec> {
        let params = params
            .into_iter()
            .map(|(node, access)| Param { node, access })
            .collect();
        RoutineSpec::new(name, params, merge, Kernel::Cpu(CpuKernel::new(f)))
    }

    /// A spec running a compute shader (Vulkan devices only); see [`ShaderKernel`] for the
    /// binding interface and [`RoutineSpec::new`] for the checks.
    pub fn shader(
        name: impl Into<String>,
        params: Vec<(TensorNode, Access)>,
        merge: Option<TensorNode>,
        shader: ShaderKernel,
    ) -> Result<RoutineSpec> {
        let params = params
            .into_iter()
            .map(|(node, access)| Param { node, access })
            .collect();
        RoutineSpec::new(name, params, merge, Kernel::Shader(shader))
    }

    /// A spec running a CUDA kernel (CUDA devices only); see [`CudaKernel`] for the
    /// parameter interface and [`RoutineSpec::new`] for the checks.
    pub fn cuda(
        name: impl Into<String>,
        params: Vec<(TensorNode, Access)>,
        merge: Option<TensorNode>,
        kernel: CudaKernel,
    ) -> Result<RoutineSpec> {
        let params = params
            .into_iter()
            .map(|(node, access)| Param { node, access })
            .collect();
        RoutineSpec::new(name, params, merge, Kernel::Cuda(kernel))
    }

    /// The nodes it reads (`Read` or `ReadWrite`), in argument order. The merge node is
    /// not among them unless it is also a parameter.
    pub fn inputs(&self) -> impl Iterator<Item = &TensorNode> {
        self.params
            .iter()
            .filter(|p| p.access.reads())
            .map(|p| &p.node)
    }

    /// The nodes it writes (`Write` or `ReadWrite`), in argument order.
    pub fn outputs(&self) -> impl Iterator<Item = &TensorNode> {
        self.params
            .iter()
            .filter(|p| p.access.writes())
            .map(|p| &p.node)
    }
}

// ---------------------------------------------------------------------------------------
// Validation helpers.

fn numel(node: &TensorNode) -> Result<usize> {
    node.shape().numel().ok_or_else(|| Error::InvalidSize {
        node: node.to_string(),
        reason: format!("{} elements overflow", node.shape()),
    })
}

fn dtype_list(allowed: &[DType]) -> String {
    let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        Some((last, _)) => (*last).to_string(),
        None => "nothing".to_string(),
    }
}

/// `node` has one of the dtypes `b` supports.
fn check_supported(b: &Builtin, node: &TensorNode) -> Result<()> {
    let allowed = b.dtypes();
    if allowed.contains(&node.dtype()) {
        Ok(())
    } else {
        Err(Error::DTypeMismatch {
            node: node.to_string(),
            expected: format!("{} (for {})", dtype_list(allowed), b.name()),
            found: node.dtype().to_string(),
        })
    }
}

/// `node` has the dtype of `reference`.
fn check_same_dtype(node: &TensorNode, reference: &TensorNode) -> Result<()> {
    if node.dtype() == reference.dtype() {
        Ok(())
    } else {
        Err(Error::DTypeMismatch {
            node: node.to_string(),
            expected: format!("{} (the dtype of {reference})", reference.dtype()),
            found: node.dtype().to_string(),
        })
    }
}

/// `node` has `expected` elements.
fn check_numel(node: &TensorNode, expected: usize, what: &str) -> Result<()> {
    let n = numel(node)?;
    if n == expected {
        Ok(())
    } else {
        Err(Error::SizeMismatch {
            node: node.to_string(),
            expected: format!("{expected} elements ({what})"),
            found: format!("{n} elements (shape {})", node.shape()),
        })
    }
}

/// `node` is a matrix: its `[rows, cols]`.
fn matrix(node: &TensorNode) -> Result<(usize, usize)> {
    match node.shape().dims() {
        &[r, c] => {
            numel(node)?;
            Ok((r, c))
        }
        _ => Err(Error::SizeMismatch {
            node: node.to_string(),
            expected: "a 2-D shape [rows, cols]".to_string(),
            found: format!("shape {}", node.shape()),
        }),
    }
}

/// `node` has exactly the shape `[r, c]`.
fn check_matrix(node: &TensorNode, r: usize, c: usize, what: &str) -> Result<()> {
    let (nr, nc) = matrix(node)?;
    if (nr, nc) == (r, c) {
        Ok(())
    } else {
        Err(Error::SizeMismatch {
            node: node.to_string(),
            expected: format!("shape [{r}, {c}] ({what})"),
            found: format!("shape {}", node.shape()),
        })
    }
}

/// Checks the dtypes of every node (supported, and all equal to the first), builds the spec.
fn build(b: Builtin, nodes: &[&TensorNode], merge: Option<TensorNode>) -> Result<RoutineSpec> {
    let first = nodes
        .first()
        .copied()
        .ok_or_else(|| Error::InvalidRoutine {
            routine: b.name().to_string(),
            reason: "no parameters".to_string(),
        })?;
    check_supported(&b, first)?;
    for n in &nodes[1..] {
        check_same_dtype(n, first)?;
    }
    let labels: Vec<&str> = nodes.iter().map(|n| n.label()).collect();
    let name = format!("{}({})", b.name(), labels.join(", "));
    let params = nodes
        .iter()
        .zip(b.accesses())
        .map(|(n, &access)| Param {
            node: (*n).clone(),
            access,
        })
        .collect();
    RoutineSpec::new(name, params, merge, Kernel::Builtin(b))
}

/// Checks that every node of `others` has as many elements as `dst`.
fn elementwise(b: Builtin, dst: &TensorNode, others: &[&TensorNode]) -> Result<RoutineSpec> {
    let mut nodes = vec![dst];
    nodes.extend_from_slice(others);
    // Dtypes first, so that a wrong dtype is reported as such even when sizes differ too.
    check_supported(&b, dst)?;
    for n in others {
        check_same_dtype(n, dst)?;
    }
    let n = numel(dst)?;
    for o in others {
        check_numel(o, n, &format!("the element count of {dst}"))?;
    }
    build(b, &nodes, None)
}

// ---------------------------------------------------------------------------------------
// Constructors of the built-ins.

/// `dst[i] = value` ([`Builtin::Fill`]); every dtype.
pub fn fill(dst: &TensorNode, value: f64) -> Result<RoutineSpec> {
    numel(dst)?;
    build(Builtin::Fill { value }, &[dst], None)
}

/// Bitwise copy `dst = src` ([`Builtin::Copy`]); same dtype and element count.
pub fn copy(dst: &TensorNode, src: &TensorNode) -> Result<RoutineSpec> {
    elementwise(Builtin::Copy, dst, &[src])
}

/// `dst += src` ([`Builtin::AddInto`]); floats and `i32`.
pub fn add_into(dst: &TensorNode, src: &TensorNode) -> Result<RoutineSpec> {
    elementwise(Builtin::AddInto, dst, &[src])
}

/// `dst += merge buffer` ([`Builtin::AddMerge`]): the merge buffer holds a copy of `dst`
/// from another context (the merge node is `dst`); floats and `i32`.
pub fn add_merge(dst: &TensorNode) -> Result<RoutineSpec> {
    numel(dst)?;
    build(Builtin::AddMerge, &[dst], Some(dst.clone()))
}

/// `dst = merge buffer` ([`Builtin::CopyMerge`]), bitwise: the merge buffer holds a copy
/// of `dst` from another context (the merge node is `dst`), which replaces `dst` here;
/// every dtype. OCANNL's `dst =: merge`: take another replica's value without a custom
/// kernel, on every backend.
///
/// ```
/// use tributary::{kernels, DType, TensorNode};
/// let w = TensorNode::new("w", DType::F16, [8]);
/// let spec = kernels::copy_merge(&w)?;
/// assert_eq!(spec.merge.as_ref(), Some(&w));
/// assert_eq!(spec.name, "copy_merge(w)");
/// # Ok::<(), tributary::Error>(())
/// ```
pub fn copy_merge(dst: &TensorNode) -> Result<RoutineSpec> {
    numel(dst)?;
    build(Builtin::CopyMerge, &[dst], Some(dst.clone()))
}

/// `dst = alpha * src` ([`Builtin::Scale`]); floats.
pub fn scale(dst: &TensorNode, src: &TensorNode, alpha: f64) -> Result<RoutineSpec> {
    elementwise(Builtin::Scale { alpha }, dst, &[src])
}

/// `x *= alpha` in place ([`Builtin::ScaleInPlace`]); floats.
pub fn scale_in_place(x: &TensorNode, alpha: f64) -> Result<RoutineSpec> {
    let b = Builtin::ScaleInPlace { alpha };
    check_supported(&b, x)?;
    numel(x)?;
    build(b, &[x], None)
}

/// `dst[dst_offset..dst_offset + len] = src[src_offset..src_offset + len]` (elements,
/// bitwise) ([`Builtin::CopyRange`]); same dtype, every dtype; ranges must be in bounds.
pub fn copy_range(
    dst: &TensorNode,
    dst_offset: usize,
    src: &TensorNode,
    src_offset: usize,
    len: usize,
) -> Result<RoutineSpec> {
    let b = Builtin::CopyRange {
        dst_offset,
        src_offset,
        len,
    };
    check_supported(&b, dst)?;
    check_same_dtype(src, dst)?;
    let in_bounds = |off: usize, node: &TensorNode| -> Result<()> {
        let n = numel(node)?;
        match off.checked_add(len) {
            Some(end) if end <= n => Ok(()),
            _ => Err(Error::SizeMismatch {
                node: node.to_string(),
                expected: format!("a range inside its {n} elements"),
                found: format!("{len} elements from {off}"),
            }),
        }
    };
    in_bounds(dst_offset, dst)?;
    in_bounds(src_offset, src)?;
    build(b, &[dst, src], None)
}

/// `y += alpha * x` ([`Builtin::Axpy`]); floats.
pub fn axpy(y: &TensorNode, x: &TensorNode, alpha: f64) -> Result<RoutineSpec> {
    elementwise(Builtin::Axpy { alpha }, y, &[x])
}

/// `w -= lr * g` ([`Builtin::SgdStep`]); floats.
pub fn sgd_step(w: &TensorNode, g: &TensorNode, lr: f64) -> Result<RoutineSpec> {
    elementwise(Builtin::SgdStep { lr }, w, &[g])
}

fn matmul_dtypes(b: &Builtin, c: &TensorNode, a: &TensorNode, bm: &TensorNode) -> Result<()> {
    check_supported(b, c)?;
    check_same_dtype(a, c)?;
    check_same_dtype(bm, c)
}

/// `c = a b` with `a: [m,k]`, `b: [k,n]`, `c: [m,n]` ([`Builtin::Matmul`]); floats.
pub fn matmul(c: &TensorNode, a: &TensorNode, b: &TensorNode) -> Result<RoutineSpec> {
    matmul_dtypes(&Builtin::Matmul { m: 0, k: 0, n: 0 }, c, a, b)?;
    let (m, k) = matrix(a)?;
    let (_, n) = matrix(b)?;
    check_matrix(b, k, n, &format!("rows = columns of {a}"))?;
    check_matrix(c, m, n, "the product's shape")?;
    build(Builtin::Matmul { m, k, n }, &[c, a, b], None)
}

/// `c = aᵀ b` with `a: [k,m]`, `b: [k,n]`, `c: [m,n]` ([`Builtin::MatmulTn`]); floats.
pub fn matmul_tn(c: &TensorNode, a: &TensorNode, b: &TensorNode) -> Result<RoutineSpec> {
    matmul_dtypes(&Builtin::MatmulTn { m: 0, k: 0, n: 0 }, c, a, b)?;
    let (k, m) = matrix(a)?;
    let (_, n) = matrix(b)?;
    check_matrix(b, k, n, &format!("rows = rows of {a}"))?;
    check_matrix(c, m, n, "the product's shape")?;
    build(Builtin::MatmulTn { m, k, n }, &[c, a, b], None)
}

/// `c = a bᵀ` with `a: [m,k]`, `b: [n,k]`, `c: [m,n]` ([`Builtin::MatmulNt`]); floats.
pub fn matmul_nt(c: &TensorNode, a: &TensorNode, b: &TensorNode) -> Result<RoutineSpec> {
    matmul_dtypes(&Builtin::MatmulNt { m: 0, k: 0, n: 0 }, c, a, b)?;
    let (m, k) = matrix(a)?;
    let (n, _) = matrix(b)?;
    check_matrix(b, n, k, &format!("columns = columns of {a}"))?;
    check_matrix(c, m, n, "the product's shape")?;
    build(Builtin::MatmulNt { m, k, n }, &[c, a, b], None)
}

/// `dst[i,j] += bias[j]` with `dst: [m,n]`, `bias`: `n` elements ([`Builtin::AddRowBias`]);
/// floats.
pub fn add_row_bias(dst: &TensorNode, bias: &TensorNode) -> Result<RoutineSpec> {
    check_supported(&Builtin::AddRowBias { m: 0, n: 0 }, dst)?;
    check_same_dtype(bias, dst)?;
    let (m, n) = matrix(dst)?;
    check_numel(bias, n, &format!("the columns of {dst}"))?;
    build(Builtin::AddRowBias { m, n }, &[dst, bias], None)
}

/// `dst = max(src, 0)` ([`Builtin::Relu`]); floats.
pub fn relu(dst: &TensorNode, src: &TensorNode) -> Result<RoutineSpec> {
    elementwise(Builtin::Relu, dst, &[src])
}

/// `dgrad_in = grad_out · [pre_activation > 0]` ([`Builtin::ReluBackward`]); floats.
pub fn relu_backward(
    dgrad_in: &TensorNode,
    grad_out: &TensorNode,
    pre_activation: &TensorNode,
) -> Result<RoutineSpec> {
    elementwise(Builtin::ReluBackward, dgrad_in, &[grad_out, pre_activation])
}

/// Column sums `dst[j] = Σ_i src[i,j]` with `src: [m,n]`, `dst`: `n` elements
/// ([`Builtin::SumRows`]); floats.
pub fn sum_rows(dst: &TensorNode, src: &TensorNode) -> Result<RoutineSpec> {
    check_supported(&Builtin::SumRows { m: 0, n: 0 }, dst)?;
    check_same_dtype(src, dst)?;
    let (m, n) = matrix(src)?;
    check_numel(dst, n, &format!("the columns of {src}"))?;
    build(Builtin::SumRows { m, n }, &[dst, src], None)
}

/// Softmax cross-entropy with its gradient ([`Builtin::SoftmaxXent`]): `loss[0]` = sum over
/// rows of the cross-entropy, `dlogits = (softmax(logits) - labels) * grad_scale`;
/// `logits: [m,c]`, `dlogits` and `labels_onehot`: `m*c` elements, `loss`: 1 element; floats.
pub fn softmax_xent(
    loss: &TensorNode,
    dlogits: &TensorNode,
    logits: &TensorNode,
    labels_onehot: &TensorNode,
    grad_scale: f64,
) -> Result<RoutineSpec> {
    let probe = Builtin::SoftmaxXent {
        m: 0,
        c: 0,
        grad_scale,
    };
    check_supported(&probe, logits)?;
    for n in [loss, dlogits, labels_onehot] {
        check_same_dtype(n, logits)?;
    }
    let (m, c) = matrix(logits)?;
    let mc = m * c; // cannot overflow: `matrix` checked the element count
    check_numel(dlogits, mc, &format!("the element count of {logits}"))?;
    check_numel(labels_onehot, mc, &format!("the element count of {logits}"))?;
    check_numel(loss, 1, "a scalar loss")?;
    build(
        Builtin::SoftmaxXent { m, c, grad_scale },
        &[loss, dlogits, logits, labels_onehot],
        None,
    )
}

/// `dst = a * b` elementwise ([`Builtin::Mul`]); floats.
pub fn mul(dst: &TensorNode, a: &TensorNode, b: &TensorNode) -> Result<RoutineSpec> {
    elementwise(Builtin::Mul, dst, &[a, b])
}

#[cfg(all(test, not(tributary_loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::node::Shape;

    fn node(label: &str, dtype: DType, dims: &[usize]) -> TensorNode {
        TensorNode::new(label, dtype, Shape::from(dims))
    }

    #[test]
    fn new_refuses_duplicates_and_empty() {
        let a = node("a", DType::F32, &[4]);
        let dup = RoutineSpec::custom(
            "dup",
            vec![(a.clone(), Access::Read), (a.clone(), Access::Write)],
            None,
            |_| Ok(()),
        );
        assert!(matches!(dup, Err(Error::InvalidRoutine { .. })));
        let empty = RoutineSpec::custom("empty", vec![], None, |_| Ok(()));
        assert!(matches!(empty, Err(Error::InvalidRoutine { .. })));
        // The merge node may be a parameter too.
        let ok = RoutineSpec::custom("m", vec![(a.clone(), Access::ReadWrite)], Some(a), |_| {
            Ok(())
        });
        assert!(ok.is_ok());
    }

    #[test]
    fn inputs_and_outputs_follow_access() {
        let x = node("x", DType::F32, &[3]);
        let y = node("y", DType::F32, &[3]);
        let s = axpy(&y, &x, 2.0).unwrap();
        let ins: Vec<_> = s.inputs().cloned().collect();
        let outs: Vec<_> = s.outputs().cloned().collect();
        assert_eq!(ins, vec![y.clone(), x.clone()]);
        assert_eq!(outs, vec![y.clone()]);
        let s = scale(&y, &x, 2.0).unwrap();
        assert_eq!(s.inputs().cloned().collect::<Vec<_>>(), vec![x.clone()]);
        assert_eq!(s.outputs().cloned().collect::<Vec<_>>(), vec![y]);
        assert!(s.merge.is_none());
        let m = add_merge(&x).unwrap();
        assert_eq!(m.merge, Some(x));
    }

    #[test]
    fn builtin_tables_agree_with_constructors() {
        let f = |d: &[usize]| node("t", DType::F32, d);
        let specs = [
            fill(&f(&[2]), 1.0),
            copy(&f(&[2]), &f(&[2])),
            add_into(&f(&[2]), &f(&[2])),
            add_merge(&f(&[2])),
            copy_merge(&f(&[2])),
            scale(&f(&[2]), &f(&[2]), 1.0),
            axpy(&f(&[2]), &f(&[2]), 1.0),
            sgd_step(&f(&[2]), &f(&[2]), 1.0),
            matmul(&f(&[2, 3]), &f(&[2, 4]), &f(&[4, 3])),
            matmul_tn(&f(&[2, 3]), &f(&[4, 2]), &f(&[4, 3])),
            matmul_nt(&f(&[2, 3]), &f(&[2, 4]), &f(&[3, 4])),
            add_row_bias(&f(&[2, 3]), &f(&[3])),
            relu(&f(&[2]), &f(&[2])),
            relu_backward(&f(&[2]), &f(&[2]), &f(&[2])),
            sum_rows(&f(&[3]), &f(&[2, 3])),
            softmax_xent(&f(&[1]), &f(&[2, 3]), &f(&[2, 3]), &f(&[2, 3]), 0.5),
            mul(&f(&[2]), &f(&[2]), &f(&[2])),
        ];
        for s in specs {
            let s = s.unwrap();
            let Kernel::Builtin(b) = &s.kernel else {
                panic!("not a built-in")
            };
            let acc: Vec<_> = s.params.iter().map(|p| p.access).collect();
            assert_eq!(acc, b.accesses(), "{}", b.name());
            assert_eq!(s.merge.is_some(), b.uses_merge());
            assert!(s.name.starts_with(b.name()));
            // Serialisable: a backend may ship it elsewhere.
            let json = serde_json::to_string(b).unwrap();
            let back: Builtin = serde_json::from_str(&json).unwrap();
            assert_eq!(&back, b);
        }
    }

    #[test]
    fn matmul_dims_are_recorded() {
        let c = node("c", DType::F64, &[2, 5]);
        let a = node("a", DType::F64, &[2, 7]);
        let b = node("b", DType::F64, &[7, 5]);
        let s = matmul(&c, &a, &b).unwrap();
        assert!(matches!(
            s.kernel,
            Kernel::Builtin(Builtin::Matmul { m: 2, k: 7, n: 5 })
        ));
        let bad = node("b", DType::F64, &[6, 5]);
        assert!(matches!(
            matmul(&c, &a, &bad),
            Err(Error::SizeMismatch { .. })
        ));
    }

    #[test]
    fn overflowing_shapes_are_refused() {
        let huge = node("h", DType::F32, &[usize::MAX, 2]);
        assert!(matches!(fill(&huge, 0.0), Err(Error::InvalidSize { .. })));
        let small = node("s", DType::F32, &[2]);
        assert!(matches!(
            copy(&small, &huge),
            Err(Error::InvalidSize { .. })
        ));
    }

    #[test]
    fn specs_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<RoutineSpec>();
        assert_send_sync::<Kernel>();
    }
}
