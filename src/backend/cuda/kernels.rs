//! Kernels on CUDA: what a routine's kernel launches, and the CUDA C of the built-ins.
//!
//! This module needs no GPU and no driver. [`kernel_launches`] turns a kernel and its bound
//! arguments into [`Launch`]es, plain data that the stream executes. So every launch can be
//! computed and checked on a machine without CUDA. It checks what the CPU backend checks,
//! and for user kernels the grid, block and shared memory against the device's
//! [`LaunchLimits`]. Its error message fails the plan. The launch model is in DESIGN.md §5,
//! "CUDA".
//!
//! A [`Program`] is its own cache key, and its text is a pure function of the key. So the
//! stream compiles each program once per device, with [`Program::nvrtc_options`]. A
//! launch's parameters come in order: buffers, the merge buffer, scalars, then a user
//! kernel's index values. [`LaunchParam::c_type`] gives their C types.
//!
//! The built-ins' geometry:
//!
//! - grids are 1-D, and kernels loop grid-stride over their elements;
//! - a grid stops growing at 32 blocks per multiprocessor;
//! - element-wise blocks have 256 threads, per-row and per-column blocks 64;
//! - matmuls use 16 x 16 blocks striding over 16 x 16 output tiles; where a block cannot
//!   hold 256 threads, they use 128-thread blocks of one thread per output;
//! - `softmax_xent` is two launches: the gradient with a thread per row, then the loss in
//!   one block;
//! - no built-in uses dynamic shared memory, and a kernel over no elements launches
//!   nothing.
//!
//! Buffers must be aligned to their element size; the stream refuses a misaligned pointer.
//! `source.rs` generates the CUDA C and `nvrtc.rs` compiles it. [`unsupported_on_cuda`] says
//! why [`Kernel::Cpu`] closures and [`Kernel::Shader`] shaders cannot run here.

mod source;

#[cfg(feature = "cuda")]
pub mod nvrtc;

use std::{borrow::Cow, sync::Arc};

use crate::{
    kernels::{Bindings, Builtin, CudaKernel, CudaScalar, CudaSource, IndexType, Kernel},
    node::{Bf16, DType, F16},
    protocol::ArgBinding,
};

/// A device's launch limits (the `CU_DEVICE_ATTRIBUTE_MAX_*` attributes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchLimits {
    /// Most threads in one block.
    pub max_threads_per_block: u32,
    /// Most threads per block along x, y and z.
    pub max_block: [u32; 3],
    /// Most blocks along x, y and z.
    pub max_grid: [u32; 3],
    /// Most dynamic shared memory per block without opting in, in bytes.
    pub max_shared_mem_per_block: u32,
    /// Streaming multiprocessors (grids of the built-ins are capped at 32 blocks per
    /// multiprocessor; their loops cover the rest).
    pub multiprocessor_count: u32,
}

impl LaunchLimits {
    /// The limits every CUDA device of compute capability 5.0 or newer meets, with one
    /// multiprocessor.
    pub const MINIMUM: LaunchLimits = LaunchLimits {
        max_threads_per_block: 1024,
        max_block: [1024, 1024, 64],
        max_grid: [i32::MAX as u32, 65535, 65535],
        max_shared_mem_per_block: 48 * 1024,
        multiprocessor_count: 1,
    };
}

/// Blocks per multiprocessor at which the built-ins' grids stop growing.
const BLOCKS_PER_MULTIPROCESSOR: u32 = 32;

/// A CUDA program: the unit the runtime compiles, loads and caches (by the value itself).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Program {
    /// Every built-in kernel for one dtype (entry points `<built-in>_<dtype>`).
    Builtins(DType),
    /// A user's CUDA C.
    UserCudaC(Arc<str>),
    /// A user's PTX.
    UserPtx(Arc<str>),
}

impl Program {
    /// The programs of the built-ins, one per dtype.
    pub fn builtins() -> impl Iterator<Item = Program> {
        DType::ALL.into_iter().map(Program::Builtins)
    }

    /// The CUDA C to compile, or `None` for PTX (loaded as it is: [`Program::ptx`]).
    pub fn cuda_c(&self) -> Option<Cow<'_, str>> {
        match self {
            Program::Builtins(dtype) => Some(Cow::Owned(source::builtin_source(*dtype))),
            Program::UserCudaC(src) => Some(Cow::Borrowed(src)),
            Program::UserPtx(_) => None,
        }
    }

    /// The PTX of a PTX program.
    pub fn ptx(&self) -> Option<&str> {
        match self {
            Program::UserPtx(ptx) => Some(ptx),
            Program::Builtins(_) | Program::UserCudaC(_) => None,
        }
    }

    /// The NVRTC options the program is compiled with, besides the architecture. The
    /// built-ins forbid contracting multiply-adds (their arithmetic uses round-to-nearest
    /// intrinsics anyway); user code gets NVRTC's defaults.
    pub fn nvrtc_options(&self) -> &'static [&'static str] {
        match self {
            Program::Builtins(_) => &["--fmad=false"],
            Program::UserCudaC(_) | Program::UserPtx(_) => &[],
        }
    }

    /// A short name, for NVRTC's messages and traces.
    pub fn name(&self) -> String {
        match self {
            Program::Builtins(dtype) => format!("tributary_builtins_{}.cu", dtype.name()),
            Program::UserCudaC(_) => "user_kernel.cu".to_string(),
            Program::UserPtx(_) => "user_kernel.ptx".to_string(),
        }
    }
}

/// One parameter of a launch, in the entry point's parameter order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LaunchParam {
    /// The device pointer of argument `i` (a `T*`).
    Buffer(usize),
    /// The device pointer of the merge buffer (a `const T*`).
    Merge,
    /// `unsigned int`.
    U32(u32),
    /// `unsigned long long`.
    U64(u64),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
}

impl LaunchParam {
    /// The parameter's C type, as the built-ins spell it (`T*` for pointers).
    pub const fn c_type(&self) -> &'static str {
        match self {
            LaunchParam::Buffer(_) | LaunchParam::Merge => "T*",
            LaunchParam::U32(_) => "u32",
            LaunchParam::U64(_) => "u64",
            LaunchParam::I32(_) => "int",
            LaunchParam::I64(_) => "long long",
            LaunchParam::F32(_) => "float",
            LaunchParam::F64(_) => "double",
        }
    }
}

impl From<CudaScalar> for LaunchParam {
    fn from(s: CudaScalar) -> LaunchParam {
        match s {
            CudaScalar::U32(x) => LaunchParam::U32(x),
            CudaScalar::U64(x) => LaunchParam::U64(x),
            CudaScalar::I32(x) => LaunchParam::I32(x),
            CudaScalar::I64(x) => LaunchParam::I64(x),
            CudaScalar::F32(x) => LaunchParam::F32(x),
            CudaScalar::F64(x) => LaunchParam::F64(x),
        }
    }
}

/// One kernel launch (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// The program holding the entry point.
    pub program: Program,
    /// The entry point.
    pub entry_point: String,
    /// Blocks along x, y and z.
    pub grid: [u32; 3],
    /// Threads per block along x, y and z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
    /// The parameters, in order.
    pub params: Vec<LaunchParam>,
    /// For built-ins, the items the kernel's loop covers: per thread (elements, rows or
    /// columns) for 1-D blocks, per block (output tiles) for the tiled matmuls' 2-D blocks;
    /// for user kernels, the threads launched.
    pub items: u64,
}

/// Why `kernel` cannot run on a CUDA device, or `None` if it can.
pub fn unsupported_on_cuda(kernel: &Kernel) -> Option<&'static str> {
    match kernel {
        Kernel::Cpu(_) => Some(
            "Rust closure kernels (Kernel::Cpu) run on CPU devices only; a CUDA device runs \
             built-ins and CUDA kernels (Kernel::Cuda)",
        ),
        Kernel::Shader(_) => Some(
            "shader kernels (WGSL or SPIR-V) run on Vulkan devices only; a CUDA device runs \
             built-ins and CUDA kernels (Kernel::Cuda)",
        ),
        Kernel::Builtin(_) | Kernel::Cuda(_) => None,
    }
}

/// The launches that run `kernel` over `args` (and `merge`) with the values of its
/// indices `bindings` (launch arguments of a user kernel after its scalars; built-ins read
/// none), in order; see the module doc.
pub fn kernel_launches(
    kernel: &Kernel,
    args: &[ArgBinding],
    merge: Option<&ArgBinding>,
    bindings: &Bindings,
    limits: &LaunchLimits,
) -> Result<Vec<Launch>, String> {
    match kernel {
        Kernel::Builtin(b) => {
            builtin_launches(b, args, merge, limits).map_err(|e| format!("{}: {e}", b.name()))
        }
        Kernel::Cuda(k) => user_launches(k, args, merge, bindings, limits),
        Kernel::Cpu(_) | Kernel::Shader(_) => Err(unsupported_on_cuda(kernel)
            .unwrap_or("unsupported kernel")
            .to_string()),
    }
}

/// The launches of a user CUDA kernel: one, or none when its grid or block is empty. Its
/// parameters: the buffers, the merge buffer, the scalars, then the index values of
/// `bindings` in declaration order (`u32` as `unsigned int`, `i32` as `int`, `i64` as
/// `long long`).
pub fn user_launches(
    k: &CudaKernel,
    args: &[ArgBinding],
    merge: Option<&ArgBinding>,
    bindings: &Bindings,
    limits: &LaunchLimits,
) -> Result<Vec<Launch>, String> {
    let (program, text) = match &k.source {
        CudaSource::CudaC(src) => (Program::UserCudaC(src.clone()), src),
        CudaSource::Ptx(src) => (Program::UserPtx(src.clone()), src),
    };
    if text.contains('\0') {
        return Err("the kernel's source contains a NUL byte".to_string());
    }
    if k.entry_point.is_empty() || k.entry_point.contains('\0') {
        return Err(format!(
            "entry point {:?} is empty or contains a NUL byte",
            k.entry_point
        ));
    }
    for (axis, ((&g, &b), (&max_g, &max_b))) in ["x", "y", "z"].iter().zip(
        k.grid
            .iter()
            .zip(&k.block)
            .zip(limits.max_grid.iter().zip(&limits.max_block)),
    ) {
        if g > max_g {
            return Err(format!(
                "{g} blocks along {axis}, the device allows {max_g}"
            ));
        }
        if b > max_b {
            return Err(format!(
                "{b} threads per block along {axis}, the device allows {max_b}"
            ));
        }
    }
    let threads_per_block: u64 = k.block.iter().map(|&b| u64::from(b)).product();
    if threads_per_block > u64::from(limits.max_threads_per_block) {
        return Err(format!(
            "{threads_per_block} threads per block, the device allows {}",
            limits.max_threads_per_block
        ));
    }
    if k.shared_mem_bytes > limits.max_shared_mem_per_block {
        return Err(format!(
            "{} bytes of dynamic shared memory, the device allows {}",
            k.shared_mem_bytes, limits.max_shared_mem_per_block
        ));
    }
    for (i, a) in args.iter().enumerate() {
        element_count(a, &format!("argument {i}"))?;
    }
    if k.grid.contains(&0) || threads_per_block == 0 {
        return Ok(Vec::new());
    }
    let mut params: Vec<LaunchParam> = (0..args.len()).map(LaunchParam::Buffer).collect();
    if merge.is_some() {
        params.push(LaunchParam::Merge);
    }
    params.extend(k.scalars.iter().copied().map(LaunchParam::from));
    for (decl, value) in bindings.iter() {
        let value = value.ok_or_else(|| format!("index {} has no value", decl.name()))?;
        params.push(index_param(decl.ty(), value)?);
    }
    let blocks: u64 = k.grid.iter().map(|&g| u64::from(g)).product();
    Ok(vec![Launch {
        program,
        entry_point: k.entry_point.clone(),
        grid: k.grid,
        block: k.block,
        shared_mem_bytes: k.shared_mem_bytes,
        params,
        items: blocks.saturating_mul(threads_per_block),
    }])
}

/// The launch argument of an index value of type `ty`.
fn index_param(ty: IndexType, value: i64) -> Result<LaunchParam, String> {
    let out_of_range = || format!("{value} is out of range for {ty}");
    Ok(match ty {
        IndexType::U32 => LaunchParam::U32(u32::try_from(value).map_err(|_| out_of_range())?),
        IndexType::I32 => LaunchParam::I32(i32::try_from(value).map_err(|_| out_of_range())?),
        IndexType::I64 => LaunchParam::I64(value),
    })
}

/// The element count of a binding, checked against its bytes.
fn element_count(a: &ArgBinding, what: &str) -> Result<u64, String> {
    a.shape
        .numel()
        .and_then(|n| n.checked_mul(a.dtype.size_in_bytes()).map(|b| (n, b)))
        .filter(|&(_, bytes)| bytes as u64 == a.bytes)
        .map(|(n, _)| n as u64)
        .ok_or_else(|| {
            format!(
                "{what} has {} bytes for shape {} of {}",
                a.bytes, a.shape, a.dtype
            )
        })
}

/// The launches of a built-in over checked arguments (see the module doc).
pub fn builtin_launches(
    b: &Builtin,
    args: &[ArgBinding],
    merge: Option<&ArgBinding>,
    limits: &LaunchLimits,
) -> Result<Vec<Launch>, String> {
    let accesses = b.accesses();
    if args.len() != accesses.len() {
        return Err(format!(
            "{} arguments given, {} expected",
            args.len(),
            accesses.len()
        ));
    }
    for (i, (a, &want)) in args.iter().zip(accesses).enumerate() {
        if a.access != want {
            return Err(format!(
                "argument {i} is declared {:?}, expected {want:?}",
                a.access
            ));
        }
    }
    let merge = if b.uses_merge() {
        Some(merge.ok_or("no merge buffer given")?)
    } else {
        None
    };
    let dtype = args.first().map(|a| a.dtype).ok_or("no arguments")?;
    if !b.dtypes().contains(&dtype) {
        return Err(format!("dtype {dtype} is not supported"));
    }
    let mut lens = Vec::with_capacity(args.len() + 1);
    for (i, a) in args.iter().enumerate() {
        if a.dtype != dtype {
            return Err(format!("argument {i} holds {}, not {dtype}", a.dtype));
        }
        lens.push(element_count(a, &format!("argument {i}"))?);
    }
    let merge_len = match merge {
        Some(m) if m.dtype != dtype => {
            return Err(format!("the merge buffer holds {}, not {dtype}", m.dtype))
        }
        Some(m) => Some(element_count(m, "the merge buffer")?),
        None => None,
    };
    let len = |i: usize| lens.get(i).copied().unwrap_or(0);
    let expect = |what: &str, got: u64, want: u64| -> Result<(), String> {
        if got == want {
            Ok(())
        } else {
            Err(format!("{what} has {got} elements, expected {want}"))
        }
    };
    let prod = |a: usize, b: usize| -> Result<u64, String> {
        (a as u64)
            .checked_mul(b as u64)
            .ok_or_else(|| format!("dimensions {a} x {b} overflow"))
    };
    let plan = Planner { dtype, limits };
    let n = len(0);
    use LaunchParam::{Buffer, Merge, U64};
    let launches = match *b {
        Builtin::Fill { value } => {
            plan.grid_stride("fill", vec![Buffer(0), U64(n), fill_bits(dtype, value)], n)
        }
        Builtin::Copy => {
            expect("the source", len(1), n)?;
            plan.grid_stride(
                "copy_range",
                vec![Buffer(0), Buffer(1), U64(0), U64(0), U64(n)],
                n,
            )
        }
        Builtin::CopyRange {
            dst_offset,
            src_offset,
            len: count,
        } => {
            let count = count as u64;
            let (dst_off, src_off) = (dst_offset as u64, src_offset as u64);
            let inside =
                |off: u64, total: u64| off.checked_add(count).is_some_and(|end| end <= total);
            if !inside(dst_off, len(0)) || !inside(src_off, len(1)) {
                return Err("range outside the buffers".into());
            }
            plan.grid_stride(
                "copy_range",
                vec![Buffer(0), Buffer(1), U64(dst_off), U64(src_off), U64(count)],
                count,
            )
        }
        Builtin::AddInto => {
            expect("the addend", len(1), n)?;
            plan.grid_stride("add_into", vec![Buffer(0), Buffer(1), U64(n)], n)
        }
        Builtin::AddMerge => {
            expect("the merge buffer", merge_len.unwrap_or(0), n)?;
            plan.grid_stride("add_into", vec![Buffer(0), Merge, U64(n)], n)
        }
        Builtin::CopyMerge => {
            expect("the merge buffer", merge_len.unwrap_or(0), n)?;
            plan.grid_stride(
                "copy_range",
                vec![Buffer(0), Merge, U64(0), U64(0), U64(n)],
                n,
            )
        }
        Builtin::Scale { alpha } => {
            expect("argument 1", len(1), n)?;
            plan.grid_stride(
                "scale",
                vec![Buffer(0), Buffer(1), plan.scalar(alpha), U64(n)],
                n,
            )
        }
        Builtin::ScaleInPlace { alpha } => plan.grid_stride(
            "scale",
            vec![Buffer(0), Buffer(0), plan.scalar(alpha), U64(n)],
            n,
        ),
        Builtin::Axpy { alpha } => {
            expect("argument 1", len(1), n)?;
            plan.grid_stride(
                "axpy",
                vec![Buffer(0), Buffer(1), plan.scalar(alpha), U64(n)],
                n,
            )
        }
        Builtin::SgdStep { lr } => {
            expect("argument 1", len(1), n)?;
            plan.grid_stride(
                "sgd_step",
                vec![Buffer(0), Buffer(1), plan.scalar(lr), U64(n)],
                n,
            )
        }
        Builtin::Relu => {
            expect("argument 1", len(1), n)?;
            plan.grid_stride("relu", vec![Buffer(0), Buffer(1), U64(n)], n)
        }
        Builtin::ReluBackward | Builtin::Mul => {
            expect("argument 1", len(1), n)?;
            expect("argument 2", len(2), n)?;
            let name = if *b == Builtin::Mul {
                "mul"
            } else {
                "relu_backward"
            };
            plan.grid_stride(name, vec![Buffer(0), Buffer(1), Buffer(2), U64(n)], n)
        }
        Builtin::Matmul { m, k, n: cols }
        | Builtin::MatmulTn { m, k, n: cols }
        | Builtin::MatmulNt { m, k, n: cols } => {
            let (name, a_len, b_len) = match b {
                Builtin::Matmul { .. } => ("matmul", prod(m, k)?, prod(k, cols)?),
                Builtin::MatmulTn { .. } => ("matmul_tn", prod(k, m)?, prod(k, cols)?),
                _ => ("matmul_nt", prod(m, k)?, prod(cols, k)?),
            };
            expect("c", n, prod(m, cols)?)?;
            expect("a", len(1), a_len)?;
            expect("b", len(2), b_len)?;
            let dims = [m as u64, k as u64, cols as u64].map(U64);
            let mut params = vec![Buffer(0), Buffer(1), Buffer(2)];
            params.extend(dims);
            plan.matmul(name, params, m as u64, cols as u64)
        }
        Builtin::AddRowBias { m, n: cols } => {
            expect("dst", n, prod(m, cols)?)?;
            expect("bias", len(1), cols as u64)?;
            plan.grid_stride(
                "add_row_bias",
                vec![Buffer(0), Buffer(1), U64(n), U64(cols as u64)],
                n,
            )
        }
        Builtin::SumRows { m, n: cols } => {
            expect("dst", n, cols as u64)?;
            expect("src", len(1), prod(m, cols)?)?;
            plan.grid_stride_by(
                source::ROWS_BLOCK,
                "sum_rows",
                vec![Buffer(0), Buffer(1), U64(m as u64), U64(cols as u64)],
                n,
            )
        }
        Builtin::SoftmaxXent { m, c, grad_scale } => {
            let mc = prod(m, c)?;
            expect("loss", n, 1)?;
            expect("dlogits", len(1), mc)?;
            expect("logits", len(2), mc)?;
            expect("labels", len(3), mc)?;
            let (rows, classes) = (U64(m as u64), U64(c as u64));
            let mut out = plan.grid_stride_by(
                source::ROWS_BLOCK,
                "softmax_xent_grad",
                vec![
                    Buffer(1),
                    Buffer(2),
                    Buffer(3),
                    plan.scalar(grad_scale),
                    rows,
                    classes,
                ],
                if mc == 0 { 0 } else { m as u64 },
            );
            // Always launched: it writes the loss, 0 when there are no rows.
            out.push(plan.single_block(
                "softmax_xent_loss",
                vec![Buffer(0), Buffer(2), Buffer(3), rows, classes],
                m as u64,
            ));
            out
        }
    };
    Ok(launches)
}

/// `fill`'s value parameter: the element's bits, converted exactly as the CPU backend
/// converts `value` (floats round to nearest, `f16`/`bf16` through `f32`; integers with
/// Rust's saturating `as`).
fn fill_bits(dtype: DType, value: f64) -> LaunchParam {
    match dtype {
        DType::F32 => LaunchParam::U32((value as f32).to_bits()),
        DType::F64 => LaunchParam::U64(value.to_bits()),
        DType::F16 => LaunchParam::U32(u32::from(F16::from_f32(value as f32).to_bits())),
        DType::BF16 => LaunchParam::U32(u32::from(Bf16::from_f32(value as f32).to_bits())),
        DType::I32 => LaunchParam::U32((value as i32) as u32),
        DType::U8 => LaunchParam::U32(u32::from(value as u8)),
    }
}

/// Launch geometry of the built-ins of one dtype on one device.
struct Planner<'a> {
    dtype: DType,
    limits: &'a LaunchLimits,
}

impl Planner<'_> {
    /// A scalar in the computation type: `double` for `f64`, else `float` (rounded from
    /// `f64` to nearest, as the CPU backend does).
    fn scalar(&self, x: f64) -> LaunchParam {
        if self.dtype == DType::F64 {
            LaunchParam::F64(x)
        } else {
            LaunchParam::F32(x as f32)
        }
    }

    fn entry_point(&self, kernel: &str) -> String {
        format!("{kernel}_{}", self.dtype.name())
    }

    /// The most blocks a built-in launches: 32 per multiprocessor, within the limit.
    fn grid_cap(&self) -> u32 {
        self.limits
            .multiprocessor_count
            .max(1)
            .saturating_mul(BLOCKS_PER_MULTIPROCESSOR)
            .min(self.limits.max_grid[0])
            .max(1)
    }

    /// Threads per block: `want`, lowered to the device's limits (to a multiple of a warp
    /// when at least one warp fits).
    fn block(&self, want: u32) -> u32 {
        let fit = want
            .min(self.limits.max_block[0])
            .min(self.limits.max_threads_per_block);
        if fit >= 32 {
            fit / 32 * 32
        } else {
            fit.max(1)
        }
    }

    /// An element-wise grid-stride kernel over `items` (nothing when there are none).
    fn grid_stride(&self, kernel: &str, params: Vec<LaunchParam>, items: u64) -> Vec<Launch> {
        self.grid_stride_by(source::ELEMENTWISE_BLOCK, kernel, params, items)
    }

    /// A grid-stride kernel over `items` with blocks of `block` threads (lowered to the
    /// limits); nothing when there are no items.
    fn grid_stride_by(
        &self,
        block: u32,
        kernel: &str,
        params: Vec<LaunchParam>,
        items: u64,
    ) -> Vec<Launch> {
        if items == 0 {
            return Vec::new();
        }
        let block = self.block(block);
        let blocks = items
            .div_ceil(u64::from(block))
            .min(u64::from(self.grid_cap())) as u32;
        vec![self.launch(kernel, params, blocks, block, items)]
    }

    /// A matmul over an `m` x `n` output: the tiled kernel (blocks of `TILE` x `TILE`
    /// threads striding over the tiles) where the device's blocks hold a tile, else the
    /// simple one (a thread per output).
    fn matmul(&self, kernel: &str, params: Vec<LaunchParam>, m: u64, n: u64) -> Vec<Launch> {
        let tile = source::TILE;
        let fits = self.limits.max_block[0] >= tile
            && self.limits.max_block[1] >= tile
            && self.limits.max_threads_per_block >= tile * tile;
        if !fits {
            return self.grid_stride_by(source::MATMUL_BLOCK, kernel, params, m * n);
        }
        let tiles = m.div_ceil(u64::from(tile)) * n.div_ceil(u64::from(tile));
        if tiles == 0 {
            return Vec::new();
        }
        let blocks = tiles.min(u64::from(self.grid_cap())) as u32;
        let mut launch = self.launch(&format!("{kernel}_tiled"), params, blocks, tile, tiles);
        launch.block = [tile, tile, 1];
        vec![launch]
    }

    /// A kernel run by one block whose threads stride by the block size over `items`.
    fn single_block(&self, kernel: &str, params: Vec<LaunchParam>, items: u64) -> Launch {
        let block = self.block(source::LOSS_BLOCK);
        self.launch(kernel, params, 1, block, items)
    }

    fn launch(
        &self,
        kernel: &str,
        params: Vec<LaunchParam>,
        blocks: u32,
        block: u32,
        items: u64,
    ) -> Launch {
        Launch {
            program: Program::Builtins(self.dtype),
            entry_point: self.entry_point(kernel),
            grid: [blocks, 1, 1],
            block: [block, 1, 1],
            shared_mem_bytes: 0,
            params,
            items,
        }
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests;
