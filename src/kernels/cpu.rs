//! Running kernels on the CPU: the built-ins, and host-vector execution of specs.

use std::{
    any::Any,
    ops::{Add, Div, Mul, Sub},
    panic::{catch_unwind, AssertUnwindSafe},
};

use serde::{Deserialize, Serialize};

use super::{
    args::{ArgView, KernelArgs},
    bindings::{Bindings, IntoBindings},
    Access, Builtin, Kernel, RoutineSpec,
};
use crate::node::{Bf16, DType, Element, F16};

mod matmul;

use matmul::{matmul, Layout};

/// Why a [`Kernel::Shader`] cannot run on the CPU.
pub(crate) const SHADER_ON_CPU: &str =
    "shader kernels (WGSL or SPIR-V) run on Vulkan devices only, not on the CPU";

/// Why a [`Kernel::Cuda`] cannot run on the CPU.
pub(crate) const CUDA_ON_CPU: &str =
    "CUDA kernels (CUDA C or PTX) run on CUDA devices only, not on the CPU";

/// How the CPU built-ins may order their floating-point work (`CpuConfig::kernel_mode`,
/// TOML `[cpu] kernel_mode = "exact"`).
///
/// Only the matmuls differ between the modes; every other built-in computes the same
/// bits in both. Either mode is deterministic: the same inputs give the same bits on
/// every run, whatever the stream or worker that runs them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelMode {
    /// Matmuls on `matrixmultiply`'s blocked kernels, single-threaded (`f16`/`bf16`
    /// through `f32`): about 7x the exact loops. Results differ from
    /// [`KernelMode::Exact`] by rounding only: each output within
    /// `2 k u Σ_p |a_ip b_pj|` of the exact mode's (`u` = 2^-24 for `f32`, `f16` and
    /// `bf16`, 2^-53 for `f64`), plus one unit in the last place of an `f16`/`bf16`
    /// output. They may differ between processors of different instruction sets (fused
    /// multiply-add or not), never between runs on one machine.
    #[default]
    Fast,
    /// Every sum in the documented order of its built-in, one rounding per operation:
    /// the bits the Vulkan and CUDA backends reproduce, and what
    /// [`run_on_host`] computes.
    Exact,
}

/// Runs `kernel` over `args` on the calling thread, its built-ins in `mode`.
///
/// Built-ins dispatch on the dtype of their first parameter and check every view against
/// their declared accesses, dtypes and dimensions (an error, never a panic, when the views
/// disagree); [`Kernel::Cpu`] calls the closure; [`Kernel::Shader`] and [`Kernel::Cuda`]
/// are errors. A panic inside the kernel is caught and returned as
/// `Err("kernel panicked: ...")`, so a failing kernel never unwinds into the caller
/// (DESIGN.md §3, rule 6); what it wrote before failing is left as it is.
pub fn run_cpu(kernel: &Kernel, args: &KernelArgs<'_>, mode: KernelMode) -> Result<(), String> {
    // AssertUnwindSafe: after a panic the only state left behind is the partially written
    // buffers (reported as a failure) and the borrow flags of `args`, which stay
    // conservative (a flag set is never unset).
    let outcome = catch_unwind(AssertUnwindSafe(|| match kernel {
        Kernel::Builtin(b) => run_builtin(b, args, mode).map_err(|e| format!("{}: {e}", b.name())),
        Kernel::Cpu(k) => k.call(args),
        Kernel::Shader(_) => Err(SHADER_ON_CPU.to_string()),
        Kernel::Cuda(_) => Err(CUDA_ON_CPU.to_string()),
    }));
    match outcome {
        Ok(result) => result,
        Err(payload) => Err(format!("kernel panicked: {}", panic_message(&*payload))),
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(non-string panic payload)"
    }
}

/// Runs `spec` on plain byte vectors: `buffers[i]` holds parameter `i` (native byte order,
/// exactly the node's element count times its dtype's size), `merge` the merge buffer's
/// contents when the spec reads one.
///
/// Every buffer is copied into an aligned temporary, the kernel runs with [`run_cpu`] in
/// [`KernelMode::Exact`] (the reference order every backend reproduces), and
/// the temporaries of `Write`/`ReadWrite` parameters are copied back, only on success (on
/// error `buffers` are unchanged). Correctness over speed: this is for tests and the
/// engine's sequential reference interpreter.
pub fn run_on_host(
    spec: &RoutineSpec,
    buffers: &mut [Vec<u8>],
    merge: Option<&[u8]>,
) -> Result<(), String> {
    run_on_host_with(spec, buffers, merge, Bindings::none())
}

/// [`run_on_host`] with values for the spec's declared indices (as a schedule gives them:
/// anything [`IntoBindings`] accepts); a missing, unknown, repeated or out-of-range value is
/// an error before anything runs.
///
/// ```
/// use tributary::kernels::{self, Access, RoutineSpec};
/// use tributary::{DType, TensorNode};
/// let y = TensorNode::new("y", DType::I32, [2]);
/// let spec = RoutineSpec::custom("y = t", vec![(y.clone(), Access::Write)], None, |a| {
///     let t = a.index("t")? as i32;
///     a.output::<i32>(0)?.fill(t);
///     Ok(())
/// })?
/// .with_index("t")?;
/// let mut bufs = vec![vec![0u8; 8]];
/// kernels::run_on_host_with(&spec, &mut bufs, None, &[("t", 5)]).expect("runs");
/// assert_eq!(kernels::from_bytes::<i32>(&bufs[0])?, vec![5, 5]);
/// assert!(kernels::run_on_host(&spec, &mut bufs, None).is_err()); // no value for t
/// # Ok::<(), tributary::Error>(())
/// ```
pub fn run_on_host_with(
    spec: &RoutineSpec,
    buffers: &mut [Vec<u8>],
    merge: Option<&[u8]>,
    bindings: impl IntoBindings,
) -> Result<(), String> {
    let bindings = bindings
        .into_bindings(spec.bindings())
        .map_err(|e| e.to_string())?;
    if buffers.len() != spec.params.len() {
        return Err(format!(
            "{}: {} buffers for {} parameters",
            spec.name,
            buffers.len(),
            spec.params.len()
        ));
    }
    let expected_bytes = |node: &crate::node::TensorNode| {
        node.shape()
            .numel()
            .and_then(|n| n.checked_mul(node.dtype().size_in_bytes()))
            .ok_or_else(|| format!("{}: the size of {node} overflows", spec.name))
    };
    for (i, (p, buf)) in spec.params.iter().zip(buffers.iter()).enumerate() {
        let want = expected_bytes(&p.node)?;
        if buf.len() != want {
            return Err(format!(
                "{}: buffer {i} for {} has {} bytes, expected {want}",
                spec.name,
                p.node,
                buf.len()
            ));
        }
    }
    let merge_data = match (&spec.merge, merge) {
        (None, _) => None,
        (Some(node), None) => {
            return Err(format!(
                "{}: expects {node} in the merge buffer, none given",
                spec.name
            ))
        }
        (Some(node), Some(data)) => {
            let want = expected_bytes(node)?;
            if data.len() != want {
                return Err(format!(
                    "{}: merge buffer for {node} has {} bytes, expected {want}",
                    spec.name,
                    data.len()
                ));
            }
            Some((node, aligned_copy(data)))
        }
    };
    let mut temps: Vec<Vec<u64>> = buffers.iter().map(|b| aligned_copy(b)).collect();
    let mut merge_temp = merge_data;
    let views: Vec<ArgView> = spec
        .params
        .iter()
        .zip(temps.iter_mut())
        .zip(buffers.iter())
        .map(|((p, t), b)| ArgView {
            ptr: t.as_mut_ptr().cast::<u8>(),
            bytes: b.len(),
            dtype: p.node.dtype(),
            shape: p.node.shape().clone(),
            access: p.access,
        })
        .collect();
    let merge_view = merge_temp.as_mut().map(|(node, t)| ArgView {
        ptr: t.as_mut_ptr().cast::<u8>(),
        bytes: node.dtype().size_in_bytes() * node.numel(),
        dtype: node.dtype(),
        shape: node.shape().clone(),
        access: Access::Read,
    });
    let result = {
        // SAFETY: each view points into its own temporary (`temps[i]` or `merge_temp`), a
        // distinct live allocation of at least `bytes` initialised bytes (`aligned_copy`
        // rounds up), aligned to 8 bytes (enough for every dtype), and valid for reads and
        // writes; no two views share an allocation, so none overlap. The temporaries are
        // neither moved nor accessed until `args` is dropped at the end of this block.
        let args = unsafe { KernelArgs::with_parts(views, merge_view, bindings) };
        run_cpu(&spec.kernel, &args, KernelMode::Exact)
    };
    result?;
    for ((p, t), b) in spec.params.iter().zip(&temps).zip(buffers.iter_mut()) {
        if p.access.writes() {
            let n = b.len();
            b.copy_from_slice(&u64_bytes(t)[..n]);
        }
    }
    Ok(())
}

/// `data` copied into 8-byte-aligned storage (zero-padded to a whole word).
fn aligned_copy(data: &[u8]) -> Vec<u64> {
    let mut words = vec![0u64; data.len().div_ceil(8)];
    for (w, chunk) in words.iter_mut().zip(data.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_ne_bytes(b);
    }
    words
}

/// The bytes of `words` in memory order.
fn u64_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_ne_bytes()).collect()
}

// ---------------------------------------------------------------------------------------
// Arithmetic abstraction: the computation type of each float dtype.

/// A computation type (`f32` or `f64`).
trait Num:
    Copy
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
{
    const ZERO: Self;
    fn from_f64(x: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn is_nan(self) -> bool;
}

impl Num for f32 {
    const ZERO: f32 = 0.0;
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    fn exp(self) -> f32 {
        f32::exp(self)
    }
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}

impl Num for f64 {
    const ZERO: f64 = 0.0;
    fn from_f64(x: f64) -> f64 {
        x
    }
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    fn ln(self) -> f64 {
        f64::ln(self)
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

/// A float storage type and how it widens to its computation type.
trait Real: Element {
    type C: Num;
    fn load(self) -> Self::C;
    fn store(c: Self::C) -> Self;
    /// The slice as its computation type, where the two are the same type.
    fn as_comp(_: &[Self]) -> Option<&[Self::C]> {
        None
    }
    /// [`Real::as_comp`], mutably.
    fn as_comp_mut(_: &mut [Self]) -> Option<&mut [Self::C]> {
        None
    }
}

/// A storage type that is its own computation type.
macro_rules! wide_real {
    ($t:ty) => {
        impl Real for $t {
            type C = $t;
            fn load(self) -> $t {
                self
            }
            fn store(c: $t) -> $t {
                c
            }
            fn as_comp(s: &[$t]) -> Option<&[$t]> {
                Some(s)
            }
            fn as_comp_mut(s: &mut [$t]) -> Option<&mut [$t]> {
                Some(s)
            }
        }
    };
}

wide_real!(f32);
wide_real!(f64);

impl Real for F16 {
    type C = f32;
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(c: f32) -> F16 {
        F16::from_f32(c)
    }
}

impl Real for Bf16 {
    type C = f32;
    fn load(self) -> f32 {
        self.to_f32()
    }
    fn store(c: f32) -> Bf16 {
        Bf16::from_f32(c)
    }
}

// ---------------------------------------------------------------------------------------
// Built-ins.

type KResult = Result<(), String>;

fn unsupported(b: &Builtin, d: DType) -> String {
    format!("dtype {d} is not supported")
        + &match b.dtypes() {
            [] => String::new(),
            ds => format!(
                " (supported: {})",
                ds.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
            ),
        }
}

/// Dispatches a generic kernel over the float dtypes.
macro_rules! floats {
    ($b:expr, $dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<F16>($($arg),*),
            DType::BF16 => $f::<Bf16>($($arg),*),
            other => Err(unsupported($b, other)),
        }
    };
}

fn check_len(what: &str, len: usize, expected: usize) -> KResult {
    if len == expected {
        Ok(())
    } else {
        Err(format!("{what} has {len} elements, expected {expected}"))
    }
}

fn product(a: usize, b: usize) -> Result<usize, String> {
    a.checked_mul(b)
        .ok_or_else(|| format!("dimensions {a} x {b} overflow"))
}

fn run_builtin(b: &Builtin, args: &KernelArgs<'_>, mode: KernelMode) -> KResult {
    let accesses = b.accesses();
    if args.len() != accesses.len() {
        return Err(format!(
            "{} arguments given, {} expected",
            args.len(),
            accesses.len()
        ));
    }
    for (i, &want) in accesses.iter().enumerate() {
        if args.access(i) != Some(want) {
            return Err(format!(
                "argument {i} is declared {:?}, expected {want:?}",
                args.access(i)
            ));
        }
    }
    if b.uses_merge() && !args.has_merge() {
        return Err("no merge buffer given".to_string());
    }
    let dtype = args.dtype(0).ok_or("no arguments")?;
    if !b.dtypes().contains(&dtype) {
        return Err(unsupported(b, dtype));
    }
    match *b {
        Builtin::Fill { value } => fill(args, dtype, value),
        Builtin::Copy => copy(args),
        Builtin::CopyMerge => copy_merge(args),
        Builtin::AddInto => match dtype {
            DType::I32 => add_i32(args, false),
            d => floats!(b, d, add_real(args, false)),
        },
        Builtin::AddMerge => match dtype {
            DType::I32 => add_i32(args, true),
            d => floats!(b, d, add_real(args, true)),
        },
        Builtin::Scale { alpha } => floats!(b, dtype, scale(args, alpha)),
        Builtin::Axpy { alpha } => floats!(b, dtype, axpy(args, alpha)),
        Builtin::SgdStep { lr } => floats!(b, dtype, sgd_step(args, lr)),
        Builtin::Matmul { m, k, n } => {
            floats!(b, dtype, matmul(args, Layout::Nn, (m, k, n), mode))
        }
        Builtin::MatmulTn { m, k, n } => {
            floats!(b, dtype, matmul(args, Layout::Tn, (m, k, n), mode))
        }
        Builtin::MatmulNt { m, k, n } => {
            floats!(b, dtype, matmul(args, Layout::Nt, (m, k, n), mode))
        }
        Builtin::AddRowBias { m, n } => floats!(b, dtype, add_row_bias(args, m, n)),
        Builtin::Relu => floats!(b, dtype, relu(args)),
        Builtin::ReluBackward => floats!(b, dtype, relu_backward(args)),
        Builtin::SumRows { m, n } => floats!(b, dtype, sum_rows(args, m, n)),
        Builtin::SoftmaxXent { m, c, grad_scale } => {
            floats!(b, dtype, softmax_xent(args, m, c, grad_scale))
        }
        Builtin::Mul => floats!(b, dtype, mul(args)),
        Builtin::ScaleInPlace { alpha } => floats!(b, dtype, scale_in_place(args, alpha)),
        Builtin::CopyRange {
            dst_offset,
            src_offset,
            len,
        } => copy_range(args, dtype, dst_offset, src_offset, len),
    }
}

fn fill(args: &KernelArgs<'_>, dtype: DType, value: f64) -> KResult {
    match dtype {
        DType::F32 => args.output::<f32>(0)?.fill(value as f32),
        DType::F64 => args.output::<f64>(0)?.fill(value),
        DType::F16 => args.output::<F16>(0)?.fill(F16::from_f32(value as f32)),
        DType::BF16 => args.output::<Bf16>(0)?.fill(Bf16::from_f32(value as f32)),
        DType::I32 => args.output::<i32>(0)?.fill(value as i32),
        DType::U8 => args.output::<u8>(0)?.fill(value as u8),
    }
    Ok(())
}

fn copy(args: &KernelArgs<'_>) -> KResult {
    if args.dtype(0) != args.dtype(1) {
        return Err(format!(
            "dtypes differ: {:?} and {:?}",
            args.dtype(0),
            args.dtype(1)
        ));
    }
    let dst = args.output_bytes(0)?;
    let src = args.input_bytes(1)?;
    check_len("the source (bytes)", src.len(), dst.len())?;
    dst.copy_from_slice(src);
    Ok(())
}

/// `dst = merge`, bitwise ([`Builtin::CopyMerge`]).
fn copy_merge(args: &KernelArgs<'_>) -> KResult {
    if args.merge_dtype() != args.dtype(0) {
        return Err(format!(
            "dtypes differ: {:?} and the merge buffer's {:?}",
            args.dtype(0),
            args.merge_dtype()
        ));
    }
    let dst = args.output_bytes(0)?;
    let src = args.merge_bytes()?;
    check_len("the merge buffer (bytes)", src.len(), dst.len())?;
    dst.copy_from_slice(src);
    Ok(())
}

/// `dst` (argument 0, mutable) and the second operand: argument 1 or the merge buffer.
fn add_i32(args: &KernelArgs<'_>, from_merge: bool) -> KResult {
    let dst = args.output::<i32>(0)?;
    let src = if from_merge {
        args.merge::<i32>()?
    } else {
        args.input::<i32>(1)?
    };
    check_len("the addend", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = d.wrapping_add(s);
    }
    Ok(())
}

fn add_real<T: Real>(args: &KernelArgs<'_>, from_merge: bool) -> KResult {
    let dst = args.output::<T>(0)?;
    let src = if from_merge {
        args.merge::<T>()?
    } else {
        args.input::<T>(1)?
    };
    check_len("the addend", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = T::store(d.load() + s.load());
    }
    Ok(())
}

/// `dst[i] = f(src[i])` for a `Write` destination (argument 0) and source (argument 1).
fn map1<T: Real>(args: &KernelArgs<'_>, f: impl Fn(T::C) -> T::C) -> KResult {
    let dst = args.output::<T>(0)?;
    let src = args.input::<T>(1)?;
    check_len("argument 1", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = T::store(f(s.load()));
    }
    Ok(())
}

/// `dst[i] = f(dst[i], src[i])` for a `ReadWrite` destination (argument 0).
fn update<T: Real>(args: &KernelArgs<'_>, f: impl Fn(T::C, T::C) -> T::C) -> KResult {
    let dst = args.output::<T>(0)?;
    let src = args.input::<T>(1)?;
    check_len("argument 1", src.len(), dst.len())?;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = T::store(f(d.load(), s.load()));
    }
    Ok(())
}

/// `dst[i] = f(a[i], b[i])` for a `Write` destination (argument 0), inputs 1 and 2.
fn map2<T: Real>(args: &KernelArgs<'_>, f: impl Fn(T::C, T::C) -> T::C) -> KResult {
    let dst = args.output::<T>(0)?;
    let a = args.input::<T>(1)?;
    let b = args.input::<T>(2)?;
    check_len("argument 1", a.len(), dst.len())?;
    check_len("argument 2", b.len(), dst.len())?;
    for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
        *d = T::store(f(x.load(), y.load()));
    }
    Ok(())
}

fn scale_in_place<T: Real>(args: &KernelArgs<'_>, alpha: f64) -> KResult {
    let alpha = T::C::from_f64(alpha);
    for x in args.output::<T>(0)?.iter_mut() {
        *x = T::store(alpha * x.load());
    }
    Ok(())
}

fn copy_range(
    args: &KernelArgs<'_>,
    dtype: DType,
    dst_offset: usize,
    src_offset: usize,
    len: usize,
) -> KResult {
    if args.dtype(1) != Some(dtype) {
        return Err(format!("dtypes differ: {dtype:?} and {:?}", args.dtype(1)));
    }
    let size = dtype.size_in_bytes();
    let bytes = |off: usize| -> Result<std::ops::Range<usize>, String> {
        let start = off.checked_mul(size).ok_or("offset overflows")?;
        let end = len
            .checked_mul(size)
            .and_then(|l| l.checked_add(start))
            .ok_or("range overflows")?;
        Ok(start..end)
    };
    let (d, s) = (bytes(dst_offset)?, bytes(src_offset)?);
    let dst = args.output_bytes(0)?;
    let src = args.input_bytes(1)?;
    let (Some(dst), Some(src)) = (dst.get_mut(d), src.get(s)) else {
        return Err("range outside the buffers".to_string());
    };
    dst.copy_from_slice(src);
    Ok(())
}

fn scale<T: Real>(args: &KernelArgs<'_>, alpha: f64) -> KResult {
    let alpha = T::C::from_f64(alpha);
    map1::<T>(args, |x| alpha * x)
}

fn axpy<T: Real>(args: &KernelArgs<'_>, alpha: f64) -> KResult {
    let alpha = T::C::from_f64(alpha);
    update::<T>(args, |y, x| y + alpha * x)
}

fn sgd_step<T: Real>(args: &KernelArgs<'_>, lr: f64) -> KResult {
    let lr = T::C::from_f64(lr);
    update::<T>(args, |w, g| w - lr * g)
}

fn relu<T: Real>(args: &KernelArgs<'_>) -> KResult {
    map1::<T>(args, |x| {
        if x > T::C::ZERO || x.is_nan() {
            x
        } else {
            T::C::ZERO
        }
    })
}

fn relu_backward<T: Real>(args: &KernelArgs<'_>) -> KResult {
    map2::<T>(args, |g, pre| if pre > T::C::ZERO { g } else { T::C::ZERO })
}

fn mul<T: Real>(args: &KernelArgs<'_>) -> KResult {
    map2::<T>(args, |a, b| a * b)
}

fn add_row_bias<T: Real>(args: &KernelArgs<'_>, m: usize, n: usize) -> KResult {
    let dst = args.output::<T>(0)?;
    let bias = args.input::<T>(1)?;
    check_len("dst", dst.len(), product(m, n)?)?;
    check_len("bias", bias.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    for row in dst.chunks_exact_mut(n) {
        for (d, &b) in row.iter_mut().zip(bias) {
            *d = T::store(d.load() + b.load());
        }
    }
    Ok(())
}

fn sum_rows<T: Real>(args: &KernelArgs<'_>, m: usize, n: usize) -> KResult {
    let dst = args.output::<T>(0)?;
    let src = args.input::<T>(1)?;
    check_len("dst", dst.len(), n)?;
    check_len("src", src.len(), product(m, n)?)?;
    if n == 0 {
        return Ok(());
    }
    let mut acc = vec![T::C::ZERO; n];
    for row in src.chunks_exact(n) {
        for (a, &x) in acc.iter_mut().zip(row) {
            *a = *a + x.load();
        }
    }
    for (d, a) in dst.iter_mut().zip(acc) {
        *d = T::store(a);
    }
    Ok(())
}

fn softmax_xent<T: Real>(args: &KernelArgs<'_>, m: usize, c: usize, grad_scale: f64) -> KResult {
    let loss = args.output::<T>(0)?;
    let dlogits = args.output::<T>(1)?;
    let logits = args.input::<T>(2)?;
    let labels = args.input::<T>(3)?;
    let mc = product(m, c)?;
    check_len("loss", loss.len(), 1)?;
    check_len("dlogits", dlogits.len(), mc)?;
    check_len("logits", logits.len(), mc)?;
    check_len("labels", labels.len(), mc)?;
    let scale = T::C::from_f64(grad_scale);
    let mut total = T::C::ZERO;
    if c > 0 {
        let mut e = vec![T::C::ZERO; c];
        for ((z, y), g) in logits
            .chunks_exact(c)
            .zip(labels.chunks_exact(c))
            .zip(dlogits.chunks_exact_mut(c))
        {
            let Some((first, rest)) = z.split_first() else {
                continue; // unreachable: chunks of c > 0 elements
            };
            let mut mx = first.load();
            for &zj in rest {
                let zj = zj.load();
                if zj > mx {
                    mx = zj;
                }
            }
            let mut s = T::C::ZERO;
            for (ej, &zj) in e.iter_mut().zip(z) {
                *ej = (zj.load() - mx).exp();
                s = s + *ej;
            }
            let lse = mx + s.ln();
            let mut row_loss = T::C::ZERO;
            for ((gj, (&ej, &zj)), &yj) in g.iter_mut().zip(e.iter().zip(z)).zip(y) {
                let yj = yj.load();
                row_loss = row_loss + yj * (lse - zj.load());
                *gj = T::store((ej / s - yj) * scale);
            }
            total = total + row_loss;
        }
    }
    if let Some(l) = loss.first_mut() {
        *l = T::store(total);
    }
    Ok(())
}

#[cfg(all(test, not(tributary_loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{kernels, node::TensorNode};

    #[test]
    fn panicking_custom_kernel_is_an_error() {
        let a = TensorNode::new("a", DType::F32, [2]);
        let spec =
            RoutineSpec::custom("boom", vec![(a, Access::Write)], None, |_| panic!("kaboom"))
                .unwrap();
        let mut bufs = vec![vec![7u8; 8]];
        let err = run_on_host(&spec, &mut bufs, None).unwrap_err();
        assert!(err.contains("kaboom"), "{err}");
        assert_eq!(bufs[0], vec![7u8; 8], "unchanged on error");
    }

    #[test]
    fn builtin_refuses_disagreeing_views() {
        // A spec whose built-in disagrees with its params (possible through `new`).
        let c = TensorNode::new("c", DType::F32, [2, 2]);
        let a = TensorNode::new("a", DType::F32, [2, 3]);
        let b = TensorNode::new("b", DType::F32, [3, 2]);
        let mut spec = kernels::matmul(&c, &a, &b).unwrap();
        spec.kernel = Kernel::Builtin(Builtin::Matmul { m: 2, k: 2, n: 2 });
        let mut bufs = vec![vec![0u8; 16], vec![0u8; 24], vec![0u8; 24]];
        let err = run_on_host(&spec, &mut bufs, None).unwrap_err();
        assert!(err.contains("matmul"), "{err}");
        // Wrong accesses.
        let mut spec = kernels::copy(&c, &TensorNode::new("d", DType::F32, [4])).unwrap();
        spec.kernel = Kernel::Builtin(Builtin::AddInto);
        let mut bufs = vec![vec![0u8; 16], vec![0u8; 16]];
        let err = run_on_host(&spec, &mut bufs, None).unwrap_err();
        assert!(err.contains("declared"), "{err}");
        // Missing merge buffer.
        let spec = kernels::add_merge(&c).unwrap();
        let err = run_on_host(&spec, &mut [vec![0u8; 16]], None).unwrap_err();
        assert!(err.contains("merge"), "{err}");
        // Wrong dtype for a float-only built-in.
        let i = TensorNode::new("i", DType::I32, [4]);
        let j = TensorNode::new("j", DType::I32, [4]);
        let mut spec = kernels::copy(&i, &j).unwrap();
        spec.kernel = Kernel::Builtin(Builtin::Scale { alpha: 1.0 });
        let err = run_on_host(&spec, &mut [vec![0u8; 16], vec![0u8; 16]], None).unwrap_err();
        assert!(err.contains("not supported"), "{err}");
    }

    #[test]
    fn run_on_host_checks_buffer_sizes() {
        let a = TensorNode::new("a", DType::F64, [3]);
        let spec = kernels::fill(&a, 1.0).unwrap();
        assert!(run_on_host(&spec, &mut [vec![0u8; 23]], None).is_err());
        assert!(run_on_host(&spec, &mut [], None).is_err());
        let mut ok = [vec![0u8; 24]];
        run_on_host(&spec, &mut ok, None).unwrap();
        assert_eq!(
            kernels::from_bytes::<f64>(&ok[0]).unwrap(),
            vec![1.0, 1.0, 1.0]
        );
    }
}
