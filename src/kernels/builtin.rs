//! The portable built-in kernels: the [`Builtin`] table of dtypes and parameters, and the
//! constructors that check dtypes and shapes and build specs. See DESIGN.md §5.

use serde::{Deserialize, Serialize};

use super::{Access, Kernel, Param, RoutineSpec};
use crate::{
    error::{Error, Result},
    node::{DType, TensorNode},
};

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
}
